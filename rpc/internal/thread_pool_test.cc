#include "rpc/internal/thread_pool.h"

#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "base/threads_of_process.h"
#include "gtest/gtest.h"

namespace rdmarpc::internal {
namespace {

// This process's threads, from /proc.
int Threads() { return static_cast<int>(ThreadIdsOfThisProcess().size()); }

// True once the process has `n` threads, within 10 s.
bool ThreadsBecome(int n) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (Threads() != n && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return Threads() == n;
}

TEST(ThreadPool, StopRunsWhatIsQueuedAndRefusesMore) {
  std::vector<int> ran;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto made = ThreadPool::Create(1, "test-task", "the test's tasks");
  ASSERT_TRUE(made.ok()) << made.status();
  ThreadPool& pool = **made;
  ASSERT_TRUE(pool.Post([&] { released.wait(); }));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.Post([&ran, i] { ran.push_back(i); }));
  std::thread stopper([&] { pool.Stop(); });
  release.set_value();
  stopper.join();
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(pool.Post([] {}));
}

// A task that destroys its pool (a callback dropping the last reference to
// the channel that owns the pool) ends, and its thread, which the pool could
// not join, leaves without touching the destroyed pool (ASan would say).
TEST(ThreadPool, ATaskThatDestroysItsPoolEndsAndItsThreadLeaves) {
  const int before = Threads();
  auto made = ThreadPool::Create(1, "test-task", "the test's tasks");
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<ThreadPool> pool = *std::move(made);
  ASSERT_TRUE(ThreadsBecome(before + 1));
  // The task runs once Post has returned (behind the gate, on the one
  // thread): a pool's owner does not destroy it while it posts to it.
  std::promise<void> open;
  ASSERT_TRUE(pool->Post([gate = open.get_future().share()] { gate.wait(); }));
  std::promise<void> destroyed;
  ASSERT_TRUE(pool->Post([&] {
    pool.reset();
    destroyed.set_value();
  }));
  open.set_value();
  ASSERT_EQ(destroyed.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(pool, nullptr);
  EXPECT_TRUE(ThreadsBecome(before)) << Threads() << " threads, " << before << " before the pool";
}

}  // namespace
}  // namespace rdmarpc::internal
