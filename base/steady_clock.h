// SteadyNow: the clock for everything the library times (call deadlines,
// retries and backoff, keepalives, how long a peer may READ a buffer).
//
// Why not absl::Now(): it reads the wall clock, which steps: NTP correcting a
// clock that was wrong at boot, an administrator's `date -s`, a VM resumed
// from a snapshot. Kept in wall time, every deadline and timeout ends at once
// when the clock steps forward, and none ends for the length of the step when
// it steps back (calls that never time out, a dead peer never noticed, a
// buffer left open to a peer's READs for an hour). SteadyNow() reads
// CLOCK_MONOTONIC, as an absl::Time equal to the wall clock at its first
// reading, so that it prints as a date and takes absl::Duration arithmetic.
//
//   const absl::Time deadline = SteadyNow() + absl::Seconds(5);
//   ...
//   if (SteadyNow() >= deadline) ...
//   WaitUntil(cv, lock, deadline, [&] { return done; });
//
// What not to rely on: SteadyNow() drifts from absl::Now() by every step
// and slew of the wall clock since the first reading, so a time of one clock
// must never be compared with the other. Times users give and get
// (ClientContext, ServerContext, Channel::WaitForConnected) are wall-clock,
// as absl::Now() gives them; FromWallClock and ToWallClock convert them
// where they cross into the library.
#ifndef RDMARPC_BASE_STEADY_CLOCK_H_
#define RDMARPC_BASE_STEADY_CLOCK_H_

#include <algorithm>

#include "absl/time/time.h"

namespace rdmarpc {

absl::Time SteadyNow();

// A wall-clock time (absl::Now()'s) as SteadyNow()'s, and back. Infinite
// times stay infinite.
absl::Time FromWallClock(absl::Time wall);
absl::Time ToWallClock(absl::Time steady);

// Waits on `cv` (a condition_variable, or a condition_variable_any) with
// `lock` held until `done()` (true) or until SteadyNow() reaches `deadline`
// (false). Not wait_until with absl::ToChronoTime, which waits on the wall
// clock.
template <typename CondVar, typename Lock, typename Done>
bool WaitUntil(CondVar& cv, Lock& lock, absl::Time deadline, Done done) {
  // Waits are cut to an hour: wait_for adds its wait to steady_clock::now(),
  // which overflows for a wait of centuries (a deadline meant as "never").
  constexpr absl::Duration kLongestWait = absl::Hours(1);
  while (!done()) {
    const absl::Duration left = deadline - SteadyNow();
    if (left <= absl::ZeroDuration()) return false;
    cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, kLongestWait)));
  }
  return true;
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_STEADY_CLOCK_H_
