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
#include <future>

#include "absl/time/time.h"

namespace rdmarpc {

absl::Time SteadyNow();

// A wall-clock time (absl::Now()'s) as SteadyNow()'s, and back. Infinite
// times stay infinite.
absl::Time FromWallClock(absl::Time wall);
absl::Time ToWallClock(absl::Time steady);

// The longest single wait of the library's timed waits, which wait again for
// what is left: wait_for adds its wait to steady_clock::now(), which
// overflows for a wait of some 292 years and returns at once, so a deadline
// meant as "never" (or a peer's huge timeout) would make its waiter spin.
inline constexpr absl::Duration kLongestSteadyWait = absl::Hours(1);

// Waits on `cv` (a condition_variable, or a condition_variable_any) with
// `lock` held until `done()` (true) or until SteadyNow() reaches `deadline`
// (false). Not wait_until with absl::ToChronoTime, which waits on the wall
// clock.
template <typename CondVar, typename Lock, typename Done>
bool WaitUntil(CondVar& cv, Lock& lock, absl::Time deadline, Done done) {
  while (!done()) {
    const absl::Duration left = deadline - SteadyNow();
    if (left <= absl::ZeroDuration()) return false;
    cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, kLongestSteadyWait)));
  }
  return true;
}

// Waits until `future` (a std::future or std::shared_future) is ready (true)
// or SteadyNow() reaches `deadline` (false). Not future::wait_until with
// absl::ToChronoTime, which waits on the wall clock: a deadline of
// SteadyNow()'s given to it is wrong by every step of the wall clock so far.
template <typename Future>
bool WaitUntilReady(const Future& future, absl::Time deadline) {
  for (;;) {
    const absl::Duration left = std::max(deadline - SteadyNow(), absl::ZeroDuration());
    if (future.wait_for(absl::ToChronoNanoseconds(std::min(left, kLongestSteadyWait))) ==
        std::future_status::ready) {
      return true;
    }
    if (left == absl::ZeroDuration()) return false;
  }
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_STEADY_CLOCK_H_
