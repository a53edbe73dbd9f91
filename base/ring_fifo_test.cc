#include "base/ring_fifo.h"

#include <deque>
#include <memory>
#include <random>

#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(RingFifo, KeepsOrderThroughWrapAroundAndGrowth) {
  RingFifo<int> ring;
  std::deque<int> model;
  std::mt19937 rng(7);
  int next = 0;
  // Lengths wander between 0 and a few hundred, so the ring wraps at every
  // capacity it grows through, and grows while wrapped.
  for (int step = 0; step < 20000; ++step) {
    const bool push = model.empty() || (rng() % 100) < (step < 10000 ? 55u : 45u);
    if (push) {
      ring.push_back(next);
      model.push_back(next++);
    } else {
      ASSERT_EQ(ring.front(), model.front()) << "step " << step;
      ring.pop_front();
      model.pop_front();
    }
    ASSERT_EQ(ring.size(), model.size());
  }
  while (!model.empty()) {
    ASSERT_EQ(ring.front(), model.front());
    ring.pop_front();
    model.pop_front();
  }
  EXPECT_TRUE(ring.empty());
}

TEST(RingFifo, PopReleasesWhatTheSlotHeld) {
  RingFifo<std::shared_ptr<int>> ring;
  auto held = std::make_shared<int>(1);
  ring.push_back(held);
  ring.push_back(std::make_shared<int>(2));
  EXPECT_EQ(held.use_count(), 2);
  ring.pop_front();
  EXPECT_EQ(held.use_count(), 1);
  ring.push_back(held);
  ring.clear();
  EXPECT_EQ(held.use_count(), 1);
  EXPECT_TRUE(ring.empty());
}

TEST(RingFifo, EmplaceBackGivesAFreshSlotInOrderThroughGrowth) {
  RingFifo<std::shared_ptr<int>> ring;
  // Past the first capacity and wrapped: every slot handed out is empty,
  // whether new or vacated by pop_front, and the order is kept.
  for (int i = 0; i < 40; ++i) {
    std::shared_ptr<int>& slot = ring.emplace_back();
    EXPECT_EQ(slot, nullptr) << i;
    slot = std::make_shared<int>(i);
    if (i % 3 == 2) ring.pop_front();
  }
  int expect = 13;  // 40 pushed, 13 popped
  ASSERT_EQ(ring.size(), 27u);
  while (!ring.empty()) {
    EXPECT_EQ(*ring.front(), expect++);
    ring.pop_front();
  }
}

TEST(RingFifo, SwapExchangesContentsInOrder) {
  RingFifo<int> a, b;
  for (int i = 0; i < 20; ++i) a.push_back(i);
  for (int i = 0; i < 5; ++i) a.pop_front();  // a's head is not at slot 0
  b.push_back(100);
  a.swap(b);
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a.front(), 100);
  ASSERT_EQ(b.size(), 15u);
  for (int i = 5; i < 20; ++i) {
    EXPECT_EQ(b.front(), i);
    b.pop_front();
  }
}

}  // namespace
}  // namespace rdmarpc
