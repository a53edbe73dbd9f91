#include "rpc/internal/timer_queue.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/cpu_time.h"
#include "base/steady_clock.h"
#include "gtest/gtest.h"

namespace rdmarpc::internal {
namespace {

// CancelAll drops an owner's timers, leaves other owners' alone, and returns
// only once a callback of the owner that was already running has returned.
TEST(TimerQueue, CancelAllWaitsForTheOwnersRunningCallbackAndSparesOthers) {
  auto made = TimerQueue::Create("test-timer", "the test's timers");
  ASSERT_TRUE(made.ok()) << made.status();
  TimerQueue& timers = **made;
  int a, b;  // owners
  absl::Notification running, other_fired;
  std::atomic<bool> finished{false};
  std::atomic<int> dropped_fired{0};
  timers.Schedule(
      SteadyNow(),
      [&] {
        running.Notify();
        absl::SleepFor(absl::Milliseconds(300));
        finished = true;
      },
      &a);
  timers.Schedule(
      SteadyNow() + absl::Milliseconds(500), [&] { dropped_fired++; }, &a);
  timers.Schedule(
      SteadyNow() + absl::Milliseconds(500), [&] { other_fired.Notify(); }, &b);
  running.WaitForNotification();
  timers.CancelAll(&a);
  EXPECT_TRUE(finished) << "CancelAll returned while the owner's callback ran";
  EXPECT_TRUE(other_fired.WaitForNotificationWithTimeout(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(dropped_fired, 0) << "a cancelled timer fired";
}

// A timer centuries out (a deadline meant as "never", a peer's timeout_us)
// leaves the timer thread asleep, and one due meanwhile still fires on time.
TEST(TimerQueue, ATimerCenturiesOutLeavesTheThreadAsleep) {
  auto made = TimerQueue::Create("test-timer", "the test's timers");
  ASSERT_TRUE(made.ok()) << made.status();
  TimerQueue& timers = **made;
  std::atomic<bool> far_fired{false};
  timers.Schedule(SteadyNow() + absl::Hours(24 * 365 * 300), [&] { far_fired = true; });
  absl::SleepFor(absl::Milliseconds(50));  // the thread is waiting by now
  const absl::Duration cpu_before = ProcessCpuTime();
  absl::Notification near_fired;
  const absl::Time near = SteadyNow() + absl::Milliseconds(400);
  timers.Schedule(near, [&] { near_fired.Notify(); });
  ASSERT_TRUE(near_fired.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(SteadyNow(), near);
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_LT(cpu, absl::Milliseconds(150)) << "the timer thread spun for " << cpu;
  EXPECT_FALSE(far_fired);
}

}  // namespace
}  // namespace rdmarpc::internal
