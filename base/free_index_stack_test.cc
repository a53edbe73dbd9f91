#include "base/free_index_stack.h"

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(FreeIndexStack, PopsWhatWasPushedLastFirstAndNothingWhenEmpty) {
  FreeIndexStack stack(8);
  EXPECT_FALSE(stack.Pop().has_value());
  stack.Push(3);
  stack.Push(0);
  stack.Push(7);
  EXPECT_EQ(stack.Pop(), 7u);
  EXPECT_EQ(stack.Pop(), 0u);
  stack.Push(5);
  EXPECT_EQ(stack.Pop(), 5u);
  EXPECT_EQ(stack.Pop(), 3u);
  EXPECT_FALSE(stack.Pop().has_value());
}

TEST(FreeIndexStack, HoldsEveryIndexOnce) {
  FreeIndexStack stack(512);
  for (uint32_t i = 0; i < 512; ++i) stack.Push(i);
  std::set<uint32_t> seen;
  while (auto i = stack.Pop()) EXPECT_TRUE(seen.insert(*i).second) << *i;
  EXPECT_EQ(seen.size(), 512u);
}

// Threads take indices and give them back as fast as they can, fewer indices
// than threads want, so that pops race with pops and pushes of the same
// index. No index may be held by two threads at once, and all come back.
// (On two cores a thread is rarely preempted between reading the head and
// its compare-and-swap, so this seldom provokes ABA itself; the tag that
// defeats it is argued in the header. TSan runs this test too.)
TEST(FreeIndexStack, ConcurrentTakersNeverShareAnIndex) {
  constexpr uint32_t kIndices = 2;
  constexpr int kThreads = 8;
  constexpr int kRounds = 200000;
  FreeIndexStack stack(kIndices);
  for (uint32_t i = 0; i < kIndices; ++i) stack.Push(i);
  std::atomic<int> holders[kIndices] = {};
  std::atomic<uint64_t> shared{0}, taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int r = 0; r < kRounds; ++r) {
        std::optional<uint32_t> i = stack.Pop();
        if (!i) continue;
        taken.fetch_add(1, std::memory_order_relaxed);
        if (holders[*i].fetch_add(1) != 0) shared.fetch_add(1);
        holders[*i].fetch_sub(1);
        stack.Push(*i);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(shared.load(), 0u) << "an index was handed to two threads at once";
  EXPECT_GT(taken.load(), 0u);
  std::set<uint32_t> back;
  for (uint32_t n = 0; n <= kIndices; ++n) {  // bounded: a corrupt stack may cycle
    std::optional<uint32_t> i = stack.Pop();
    if (!i) break;
    EXPECT_TRUE(back.insert(*i).second) << "index " << *i << " was on the stack twice";
  }
  EXPECT_EQ(back.size(), kIndices);
  EXPECT_FALSE(stack.Pop().has_value());
}

}  // namespace
}  // namespace rdmarpc
