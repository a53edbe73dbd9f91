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

  bool lost = false;      // Channel::mu_
  absl::Status lost_why;  // Channel::mu_: what the calls still on it end with
  bool go_away = false;   // Channel::mu_: the server's GOAWAY came on it
  // Set under Channel::mu_ before `sending` gets its kGoAwayBit, and read by
  // whoever acknowledges: the channel moved to a faster connection, so the
  // end of this one's drain tells the server nothing (it sent no GOAWAY).
  bool moved = false;
  bool done = false;  // Channel::watch_mu_
  // kSender for each request being sent on this connection outside mu_ (they
  // started under mu_ while it was conn_), plus kGoAwayBit once the server's
  // GOAWAY came, plus kLostBit once the connection closed. No request starts
  // on it after either, so the count only falls from then on, and whoever
  // sees it at zero with a bit set does what the bit asks, once: OnGoAway or
  // OnClosed when no send is under way, else the last of them (EndSend).
  // - The acknowledgment of a GOAWAY promises the server that no request
  //   follows, so it goes after theirs.
  // - A request being sent as the connection closes may be refused unsent,
  //   and then its call goes on the next connection (SendAgainUnsent); so
  //   the calls still on it end as lost only after those sends.
  std::atomic<uint32_t> sending{0};
  static constexpr uint32_t kGoAwayBit = 1;
  static constexpr uint32_t kLostBit = 2;
  static constexpr uint32_t kSender = 4;

 private:
  Channel* const channel_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_INTERNAL_CHANNEL_WATCH_H_
