#include "rpc/internal/timer_queue.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdmarpc::internal {
namespace {

// CancelAll drops an owner's timers, leaves other owners' alone, and returns
// only once a callback of the owner that was already running has returned.
TEST(TimerQueue, CancelAllWaitsForTheOwnersRunningCallbackAndSparesOthers) {
  TimerQueue timers;
  int a, b;  // owners
  absl::Notification running, other_fired;
  std::atomic<bool> finished{false};
  std::atomic<int> dropped_fired{0};
  timers.Schedule(
      absl::Now(),
      [&] {
        running.Notify();
        absl::SleepFor(absl::Milliseconds(300));
        finished = true;
      },
      &a);
  timers.Schedule(
      absl::Now() + absl::Milliseconds(500), [&] { dropped_fired++; }, &a);
  timers.Schedule(
      absl::Now() + absl::Milliseconds(500), [&] { other_fired.Notify(); }, &b);
  running.WaitForNotification();
  timers.CancelAll(&a);
  EXPECT_TRUE(finished) << "CancelAll returned while the owner's callback ran";
  EXPECT_TRUE(other_fired.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(dropped_fired, 0) << "a cancelled timer fired";
}

}  // namespace
}  // namespace rdmarpc::internal
