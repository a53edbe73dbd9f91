// What rdma_connection.cc, rdma_connection_receive.cc and
// rdma_connection_timeouts.cc share: which frames cost credit, the wr_id
// layout and the wording of durations and revocations in error messages.
// Not for use outside RdmaConnection.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_INTERNAL_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_INTERNAL_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport::rdma::internal {

// kCredit and kShrink frames are free, so that peers that both ran out can
// still unblock each other; each side bounds how many it sends instead.
inline bool CostsCredit(MessageKind kind) {
  return kind != MessageKind::kCredit && kind != MessageKind::kShrink;
}

// wr_id: kind (4 bits) | signaled (1 bit) | connection serial (27 bits) | index.
inline constexpr uint64_t kSignaledBit = uint64_t{1} << 59;

inline uint64_t WrId(uint64_t kind, uint32_t serial, uint32_t index, bool signaled) {
  return (kind << 60) | (signaled ? kSignaledBit : 0) | (uint64_t{serial & 0x07ffffff} << 32) |
         index;
}

// When a peer with release timeout `ms` revokes a buffer it advertised in a
// frame of `kind`, for the messages that explain a failed READ.
inline std::string RevocationRule(MessageKind kind, uint32_t ms) {
  return kind == MessageKind::kResponse
             ? absl::StrCat("the peer revokes a response's buffer ", ms,
                            " ms after sending it, by its release_timeout_ms")
             : absl::StrCat("the peer revokes a request's buffer ", ms,
                            " ms after the request's deadline, by its release_timeout_ms");
}

// Durations in messages, to the millisecond.
inline std::string Rounded(absl::Duration d) {
  return absl::FormatDuration(absl::Trunc(d + absl::Microseconds(500), absl::Milliseconds(1)));
}

}  // namespace rdmarpc::transport::rdma::internal

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_INTERNAL_H_
