#include "base/steady_clock.h"

#include <future>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(SteadyClock, ReadsAsTheWallClockAtFirstAndNeverGoesBack) {
  const absl::Time first = SteadyNow();
  EXPECT_LT(absl::AbsDuration(first - absl::Now()), absl::Seconds(1));
  absl::Time last = first;
  for (int i = 0; i < 100000; ++i) {
    const absl::Time now = SteadyNow();
    ASSERT_GE(now, last);
    last = now;
  }
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_GE(SteadyNow() - first, absl::Milliseconds(20));
}

TEST(SteadyClock, WallClockTimesConvertBothWays) {
  const absl::Time wall = absl::Now() + absl::Seconds(30);
  EXPECT_LT(absl::AbsDuration(ToWallClock(FromWallClock(wall)) - wall), absl::Milliseconds(1));
  EXPECT_LT(absl::AbsDuration(FromWallClock(wall) - (SteadyNow() + absl::Seconds(30))),
            absl::Milliseconds(1));
  for (absl::Time infinite : {absl::InfiniteFuture(), absl::InfinitePast()}) {
    EXPECT_EQ(FromWallClock(infinite), infinite);
    EXPECT_EQ(ToWallClock(infinite), infinite);
  }
}

TEST(SteadyClock, WaitUntilEndsAtTheDeadlineOrWhenDone) {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::unique_lock<std::mutex> lock(mu);
  const absl::Time start = SteadyNow();
  EXPECT_FALSE(WaitUntil(cv, lock, start + absl::Milliseconds(50), [&] { return done; }));
  EXPECT_GE(SteadyNow() - start, absl::Milliseconds(50));
  EXPECT_FALSE(WaitUntil(cv, lock, absl::InfinitePast(), [&] { return done; }));

  std::thread finisher([&] {
    absl::SleepFor(absl::Milliseconds(20));
    std::lock_guard<std::mutex> l(mu);
    done = true;
    cv.notify_all();
  });
  EXPECT_TRUE(WaitUntil(cv, lock, absl::InfiniteFuture(), [&] { return done; }));
  lock.unlock();
  finisher.join();
}

TEST(SteadyClock, WaitUntilReadyEndsAtTheDeadlineOrWhenReady) {
  std::promise<void> promise;
  std::future<void> future = promise.get_future();
  const absl::Time start = SteadyNow();
  EXPECT_FALSE(WaitUntilReady(future, start + absl::Milliseconds(50)));
  EXPECT_GE(SteadyNow() - start, absl::Milliseconds(50));
  EXPECT_FALSE(WaitUntilReady(future, absl::InfinitePast()));

  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(20));
    promise.set_value();
  });
  EXPECT_TRUE(WaitUntilReady(future, absl::InfiniteFuture()));
  setter.join();
  EXPECT_TRUE(WaitUntilReady(future, absl::InfinitePast())) << "a ready future at any deadline";
}

}  // namespace
}  // namespace rdmarpc
