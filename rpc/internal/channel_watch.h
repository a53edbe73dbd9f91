// Channel::Watch: the observer of one connection of a channel, and what the
// channel keeps of that connection's state outside its own fields. Shared
// by rpc/channel.cc (the call path, GOAWAY, loss) and rpc/channel_connect.cc
// (connecting, and moving to a faster connection).
#ifndef RDMARPC_RPC_INTERNAL_CHANNEL_WATCH_H_
#define RDMARPC_RPC_INTERNAL_CHANNEL_WATCH_H_

#include <atomic>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "rpc/channel.h"
#include "transport/transport.h"
#include "transport/wire_format.h"

namespace rdmarpc {

class Channel::Watch final : public transport::ConnectionObserver {
 public:
  explicit Watch(Channel* channel) : channel_(channel) {}
  void OnMessage(transport::Connection& conn, transport::InboundMessage&& msg) override {
    if (msg.header.kind == transport::MessageKind::kGoAway) {
      return channel_->OnGoAway(*this, conn);
    }
    channel_->OnMessage(conn, std::move(msg));
  }
  void OnClosed(transport::Connection& conn, const absl::Status& why) override {
    channel_->OnClosed(*this, conn, why);
  }
  void OnMayGoFaster(transport::Connection& conn) override { channel_->OnMayGoFaster(*this, conn); }

  bool lost = false;     // Channel::mu_
  bool go_away = false;  // Channel::mu_: the server's GOAWAY came on it
  // Set under Channel::mu_ before `sending` gets its 1, and read by whoever
  // brings `sending` to 1: the channel moved to a faster connection, so the
  // end of this one's drain tells the server nothing (it sent no GOAWAY).
  bool moved = false;
  bool done = false;  // Channel::watch_mu_
  // Twice the requests being sent on this connection outside mu_ (they
  // started under mu_ while it was conn_), plus one once the server's GOAWAY
  // came. The acknowledgment promises the server that no request follows,
  // so it goes after theirs: sent by whoever brings this to exactly 1
  // (OnGoAway when none is under way, else the last of them, EndSend). No
  // request starts on it after the GOAWAY, so it only falls from then on.
  std::atomic<uint32_t> sending{0};

 private:
  Channel* const channel_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_INTERNAL_CHANNEL_WATCH_H_
