#include "transport/tcp/tcp_counters.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::tcp {
namespace {

using Shards = base::ShardedCounts<TcpCounters>;
// Each field under its own name.
#define RDMARPC_COUNTER(f) \
  { #f, &TcpCounters::f }
constexpr Shards::NamedField kFields[] = {
    RDMARPC_COUNTER(frames_sent),        RDMARPC_COUNTER(bytes_sent),
    RDMARPC_COUNTER(sendmsg_calls),      RDMARPC_COUNTER(frames_queued),
    RDMARPC_COUNTER(send_refusals),      RDMARPC_COUNTER(frames_received),
    RDMARPC_COUNTER(bytes_received),     RDMARPC_COUNTER(receive_refusals),
    RDMARPC_COUNTER(malformed_frames),   RDMARPC_COUNTER(peer_timeouts),
    RDMARPC_COUNTER(connections_opened), RDMARPC_COUNTER(connections_closed),
    RDMARPC_COUNTER(accepts_refused),    RDMARPC_COUNTER(accept_pauses),
};
#undef RDMARPC_COUNTER
static_assert(Shards::ListsEveryFieldOnce(kFields),
              "kFields must list every field of TcpCounters once");

}  // namespace

TcpCounters Counters() { return Shards::Sum(kFields); }

std::vector<std::pair<std::string, uint64_t>> TcpCounters::Named() const {
  return Shards::Named(*this, kFields);
}

TcpCounters TcpCounters::Since(const TcpCounters& earlier) const {
  return Shards::Difference(*this, earlier, kFields);
}

std::string TcpCounters::ToString() const {
  return absl::StrCat("frames_sent=", frames_sent, " bytes_sent=", bytes_sent,
                      " sendmsg_calls=", sendmsg_calls, " frames_queued=", frames_queued,
                      " send_refusals=", send_refusals, " frames_received=", frames_received,
                      " bytes_received=", bytes_received, " receive_refusals=", receive_refusals,
                      " malformed_frames=", malformed_frames, " peer_timeouts=", peer_timeouts,
                      " conns_opened=", connections_opened, " conns_closed=", connections_closed,
                      " accepts_refused=", accepts_refused, " accept_pauses=", accept_pauses);
}

}  // namespace rdmarpc::transport::tcp
