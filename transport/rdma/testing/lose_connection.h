// LoseTheOnlyConnection: ends the one RDMA connection a test has open (both
// of its ends in this process), as a device does when a post fails, with no
// peer asking for it: no GOAWAY, no close, the listener still there. For a
// connect held by FaultInjection::HoldNextConnect, it makes the connection
// that the caller is about to get one already lost.
//
//   FaultInjection::HoldNextConnect();
//   ... start what connects; FaultInjection::WaitUntilConnectHeld(...) ...
//   ASSERT_TRUE(LoseTheOnlyConnection());
//   FaultInjection::ReleaseHeldConnects();
#ifndef RDMARPC_TRANSPORT_RDMA_TESTING_LOSE_CONNECTION_H_
#define RDMARPC_TRANSPORT_RDMA_TESTING_LOSE_CONNECTION_H_

#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"

namespace rdmarpc::transport::rdma::testing {

// Fails the next post of any thread: on a silent connection, the first
// keepalive of either end (RdmaOptions::keepalive_ms). True once both ends
// have closed and their owners have heard it (connections_closed is counted
// after the observer's OnClosed), false if that took over 20 s.
inline bool LoseTheOnlyConnection() {
  const uint64_t closed = Counters().connections_closed;
  FaultInjection::FailNextPostOfAnyThread();
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (Counters().connections_closed < closed + 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  return Counters().connections_closed >= closed + 2;
}

}  // namespace rdmarpc::transport::rdma::testing

#endif  // RDMARPC_TRANSPORT_RDMA_TESTING_LOSE_CONNECTION_H_
