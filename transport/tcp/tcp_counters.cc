#include "transport/tcp/tcp_counters.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::tcp {
namespace {

using Shards = base::ShardedCounts<TcpCounters>;
constexpr TcpCounters::Field kFields[] = {
    &TcpCounters::frames_sent,        &TcpCounters::bytes_sent,
    &TcpCounters::sendmsg_calls,      &TcpCounters::frames_queued,
    &TcpCounters::send_refusals,      &TcpCounters::frames_received,
    &TcpCounters::bytes_received,     &TcpCounters::receive_refusals,
    &TcpCounters::malformed_frames,   &TcpCounters::peer_timeouts,
    &TcpCounters::connections_opened, &TcpCounters::connections_closed,
    &TcpCounters::accepts_refused,    &TcpCounters::accept_pauses,
};
static_assert(Shards::ListsEveryFieldOnce(kFields),
              "kFields must list every field of TcpCounters once");

}  // namespace

TcpCounters Counters() { return Shards::Sum(kFields); }

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
