#include "base/inline_mutex.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(InlineMutexTest, ContendedIncrementsAreNotLost) {
  InlineMutex mu;
  uint64_t count = 0;  // plain: only the lock keeps the updates whole
  constexpr int kThreads = 8;
  constexpr int kEach = 100000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kEach; ++i) {
        std::lock_guard<InlineMutex> lock(mu);
        count = count + 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(count, uint64_t{kThreads} * kEach);
}

TEST(InlineMutexTest, TryLockFailsWhileHeldAndSucceedsAfter) {
  InlineMutex mu;
  ASSERT_TRUE(mu.try_lock());
  bool other_got_it = true;
  std::thread([&] { other_got_it = mu.try_lock(); }).join();
  EXPECT_FALSE(other_got_it);
  mu.unlock();
  std::thread([&] {
    other_got_it = mu.try_lock();
    if (other_got_it) mu.unlock();
  }).join();
  EXPECT_TRUE(other_got_it);
}

TEST(InlineMutexTest, SleeperIsWokenByUnlock) {
  InlineMutex mu;
  mu.lock();
  std::atomic<bool> waiting{false};
  std::atomic<bool> acquired{false};
  std::thread sleeper([&] {
    waiting = true;
    mu.lock();  // blocks in the kernel until the unlock below
    acquired = true;
    mu.unlock();
  });
  while (!waiting) std::this_thread::yield();
  // Time for the sleeper to reach the kernel wait, so that the unlock below
  // has someone to wake (a broken wake then hangs the test). Nothing else
  // rests on it: were the sleeper late, the checks below would still hold.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(acquired);
  mu.unlock();
  sleeper.join();
  EXPECT_TRUE(acquired);
  EXPECT_TRUE(mu.try_lock());  // left free, not stuck in the contended state
  mu.unlock();
}

}  // namespace
}  // namespace rdmarpc
