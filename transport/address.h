// Address: where a channel connects or a server listens, e.g.
//   "tcp://127.0.0.1:5000", "rdma://10.0.0.1:7471", "auto://host:port"
//   "tcp://[::1]:5000"  (IPv6 in brackets), "tcp://host:0" (any free port)
// "auto" means RDMA when a usable device exists, else TCP (one log line).
#ifndef RDMARPC_TRANSPORT_ADDRESS_H_
#define RDMARPC_TRANSPORT_ADDRESS_H_

#include <sys/socket.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::transport {

struct Address {
  std::string scheme;  // "tcp", "rdma" or "auto"
  std::string host;    // without brackets
  uint16_t port = 0;

  std::string ToString() const;
};

absl::StatusOr<Address> ParseAddress(absl::string_view text);

// The socket address of host:port (first result of getaddrinfo), with its
// length in *len when len is not null. UNAVAILABLE naming the address if it
// does not resolve.
absl::StatusOr<sockaddr_storage> ResolveAddress(const Address& addr, socklen_t* len = nullptr);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ADDRESS_H_
