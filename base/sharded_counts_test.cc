// Sharded counts add up exactly: counts from many threads at once, from
// threads that have exited (their shards passed on to later threads), made
// while a thread exits, and a gauge taken from on another thread than the
// one that added to it; snapshots name and subtract every field.
#include "base/sharded_counts.h"

#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc::base {
namespace {

struct TestCounts {
  uint64_t frames = 0;
  uint64_t bytes = 0;
  uint64_t held = 0;  // a gauge
};
using Shards = ShardedCounts<TestCounts>;
constexpr Shards::NamedField kFields[] = {
    {"frames", &TestCounts::frames}, {"bytes", &TestCounts::bytes}, {"held", &TestCounts::held}};
static_assert(Shards::ListsEveryFieldOnce(kFields));

constexpr Shards::NamedField kOneMissing[] = {{"frames", &TestCounts::frames},
                                              {"bytes", &TestCounts::bytes}};
static_assert(!Shards::ListsEveryFieldOnce(kOneMissing));
constexpr Shards::NamedField kOneTwice[] = {
    {"frames", &TestCounts::frames}, {"bytes", &TestCounts::bytes}, {"again", &TestCounts::frames}};
static_assert(!Shards::ListsEveryFieldOnce(kOneTwice));
constexpr Shards::NamedField kANameTwice[] = {
    {"frames", &TestCounts::frames}, {"bytes", &TestCounts::bytes}, {"bytes", &TestCounts::held}};
static_assert(!Shards::ListsEveryFieldOnce(kANameTwice));

TestCounts Now() { return Shards::Sum(kFields); }

TEST(ShardedCounts, CountsFromManyThreadsAddUpExactly) {
  constexpr int kThreads = 8;
  constexpr uint64_t kEach = 100000;
  const TestCounts before = Now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([] {
      for (uint64_t i = 0; i < kEach; ++i) {
        Shards::Add(&TestCounts::frames);
        Shards::Add(&TestCounts::bytes, 3);
      }
    });
  }
  for (auto& t : threads) t.join();
  const TestCounts after = Now();
  EXPECT_EQ(after.frames - before.frames, kThreads * kEach);
  EXPECT_EQ(after.bytes - before.bytes, 3 * kThreads * kEach);
  EXPECT_EQ(after.held, before.held) << "another counter moved";
}

TEST(ShardedCounts, ExitedThreadsKeepTheirCountsAndTheirShardsAreReused) {
  const TestCounts before = Now();
  // One after another: each later thread takes a shard an earlier one gave
  // back, counts in already, and must add to them, not restart them.
  for (int t = 0; t < 50; ++t) {
    std::thread([] { Shards::Add(&TestCounts::bytes, 7); }).join();
  }
  EXPECT_EQ(Now().bytes - before.bytes, 350u);
}

TEST(ShardedCounts, CountsMadeWhileAThreadExitsAreKept) {
  // Constructed before the thread's first count, so destroyed after its
  // shard went back.
  struct CountsAtExit {
    ~CountsAtExit() { Shards::Add(&TestCounts::frames, 5); }
  };
  const TestCounts before = Now();
  std::thread([] {
    thread_local CountsAtExit at_exit;
    (void)&at_exit;
    Shards::Add(&TestCounts::frames);
  }).join();
  EXPECT_EQ(Now().frames - before.frames, 6u);
}

TEST(ShardedCounts, AGaugeTakenFromOnAnotherThreadAddsUp) {
  const TestCounts before = Now();
  Shards::Add(&TestCounts::held, 1 << 20);  // this thread keeps its shard
  EXPECT_EQ(Now().held - before.held, uint64_t{1} << 20);
  // So the other thread's shard goes below zero on its own; the sum does not.
  std::thread([] { Shards::Add(&TestCounts::held, uint64_t{0} - (1 << 20)); }).join();
  EXPECT_EQ(Now().held, before.held);
}

TEST(ShardedCounts, NamedGivesEachFieldUnderItsNameInTheListsOrder) {
  TestCounts counts;
  counts.frames = 1;
  counts.bytes = 2;
  counts.held = 3;
  const std::vector<std::pair<std::string, uint64_t>> named = Shards::Named(counts, kFields);
  const std::vector<std::pair<std::string, uint64_t>> expected = {
      {"frames", 1}, {"bytes", 2}, {"held", 3}};
  EXPECT_EQ(named, expected);
}

TEST(ShardedCounts, DifferenceSubtractsEveryFieldListed) {
  TestCounts earlier;
  earlier.frames = 1;
  earlier.bytes = 10;
  earlier.held = 100;
  TestCounts later;
  later.frames = 4;
  later.bytes = 30;
  later.held = 160;
  const TestCounts diff = Shards::Difference(later, earlier, kFields);
  EXPECT_EQ(diff.frames, 3u);
  EXPECT_EQ(diff.bytes, 20u);
  EXPECT_EQ(diff.held, 60u);
}

}  // namespace
}  // namespace rdmarpc::base
