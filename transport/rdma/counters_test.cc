// The sharded counters add up exactly: counts from many threads at once,
// from threads that have exited (their shards passed on to later threads),
// made while a thread exits, and a gauge taken from on another thread than
// the one that added to it.
#include "transport/rdma/counters.h"

#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc::transport::rdma {
namespace {

TEST(RdmaCounters, CountsFromManyThreadsAddUpExactly) {
  constexpr int kThreads = 8;
  constexpr uint64_t kEach = 100000;
  const RdmaCounters before = Counters();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([] {
      for (uint64_t i = 0; i < kEach; ++i) {
        Count(&RdmaCounters::sends);
        Count(&RdmaCounters::bytes_read, 3);
      }
    });
  }
  for (auto& t : threads) t.join();
  const RdmaCounters after = Counters();
  EXPECT_EQ(after.sends - before.sends, kThreads * kEach);
  EXPECT_EQ(after.bytes_read - before.bytes_read, 3 * kThreads * kEach);
  EXPECT_EQ(after.reads, before.reads) << "another counter moved";
}

TEST(RdmaCounters, ExitedThreadsKeepTheirCountsAndTheirShardsAreReused) {
  const RdmaCounters before = Counters();
  // One after another: each later thread takes a shard an earlier one gave
  // back, counts in already, and must add to them, not restart them.
  for (int t = 0; t < 50; ++t) {
    std::thread([] { Count(&RdmaCounters::keepalives, 7); }).join();
  }
  EXPECT_EQ(Counters().keepalives - before.keepalives, 350u);
}

TEST(RdmaCounters, CountsMadeWhileAThreadExitsAreKept) {
  // Constructed before the thread's first count, so destroyed after its
  // shard went back.
  struct CountsAtExit {
    ~CountsAtExit() { Count(&RdmaCounters::poller_sleeps, 5); }
  };
  const RdmaCounters before = Counters();
  std::thread([] {
    thread_local CountsAtExit at_exit;
    (void)&at_exit;
    Count(&RdmaCounters::poller_sleeps);
  }).join();
  EXPECT_EQ(Counters().poller_sleeps - before.poller_sleeps, 6u);
}

TEST(RdmaCounters, AGaugeTakenFromOnAnotherThreadAddsUp) {
  const RdmaCounters before = Counters();
  Count(&RdmaCounters::registered_bytes, 1 << 20);  // this thread keeps its shard
  EXPECT_EQ(Counters().registered_bytes - before.registered_bytes, uint64_t{1} << 20);
  // So the other thread's shard goes below zero on its own; the sum does not.
  std::thread([] { Uncount(&RdmaCounters::registered_bytes, 1 << 20); }).join();
  EXPECT_EQ(Counters().registered_bytes, before.registered_bytes);
}

TEST(RdmaCounters, ToStringShowsTheSums) {
  Count(&RdmaCounters::credit_stalls, 2);
  std::thread([] { Count(&RdmaCounters::credit_stalls, 3); }).join();
  const RdmaCounters c = Counters();
  const std::string text = c.ToString();
  EXPECT_NE(text.find("credit_stalls=" + std::to_string(c.credit_stalls) + " "),
            std::string::npos)
      << text;
  EXPECT_GE(c.credit_stalls, 5u);
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
