// Fault injection for the runtime's tests, off unless a test arms it.
//
// A connection can close between a channel taking it for a call and the
// transport queueing the call's request; the transport then refuses the
// request unsent (transport::kNeverSent). That window is microseconds wide,
// so tests open it on purpose here. Production code reads this once per
// request sent: one relaxed atomic load.
#ifndef RDMARPC_RPC_INTERNAL_SEND_FAULTS_H_
#define RDMARPC_RPC_INTERNAL_SEND_FAULTS_H_

#include <atomic>
#include <functional>

#include "transport/transport.h"

namespace rdmarpc::internal {

struct SendFaults {
  // The next N requests are refused before they reach the transport, as a
  // transport refuses a frame whose connection has just closed under the
  // send. The connection itself stays up: the channel closes it, as it does
  // one the transport reports closing.
  static std::atomic<int>& RefuseRequests() {
    static std::atomic<int> n{0};
    return n;
  }
  // Where set, runs on the connection of each request refused so, before
  // the refusal: a test that closes it there, and waits for the channel to
  // hear, has the loss come between the channel taking the connection for
  // the call and the transport refusing the request. Set it before
  // RefuseRequests, and clear it after.
  static std::function<void(transport::Connection&)>& BeforeRefusal() {
    static std::function<void(transport::Connection&)> f;
    return f;
  }
  static bool TakeRefusedRequest() {
    std::atomic<int>& n = RefuseRequests();
    if (n.load(std::memory_order_relaxed) <= 0) return false;
    // Acquire: BeforeRefusal was set before the count.
    return n.fetch_sub(1, std::memory_order_acquire) > 0;
  }
  // Disarms both when it goes out of scope, so that a failed test leaves no
  // fault armed for the next: `SendFaults::Disarm disarm;` before arming.
  struct Disarm {
    ~Disarm() {
      RefuseRequests() = 0;
      BeforeRefusal() = nullptr;
    }
  };
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_SEND_FAULTS_H_
