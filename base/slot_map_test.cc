#include "base/slot_map.h"

#include <map>
#include <memory>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(SlotMap, TakeReturnsWhatWasInsertedOnce) {
  SlotMap<std::string> m;
  const uint64_t a = m.Insert("a");
  const uint64_t b = m.Insert("b");
  EXPECT_NE(a, 0u);
  EXPECT_NE(b, 0u);
  EXPECT_NE(a, b);
  EXPECT_EQ(m.size(), 2u);
  ASSERT_NE(m.Get(b), nullptr);
  EXPECT_EQ(*m.Get(b), "b");
  std::string out;
  ASSERT_TRUE(m.Take(a, &out));
  EXPECT_EQ(out, "a");
  EXPECT_FALSE(m.Take(a, &out));
  EXPECT_EQ(m.Get(a), nullptr);
  EXPECT_EQ(m.size(), 1u);
}

TEST(SlotMap, AnIdTakenOnceNeverMatchesTheSlotsNextValue) {
  SlotMap<int> m;
  const uint64_t first = m.Insert(1);
  int out = 0;
  ASSERT_TRUE(m.Take(first, &out));
  const uint64_t second = m.Insert(2);  // reuses the freed slot
  EXPECT_EQ(static_cast<uint32_t>(second), static_cast<uint32_t>(first));
  EXPECT_NE(second, first);
  EXPECT_FALSE(m.Take(first, &out));  // a late response for the first call
  EXPECT_EQ(out, 1);
  ASSERT_TRUE(m.Take(second, &out));
  EXPECT_EQ(out, 2);
}

TEST(SlotMap, IdsItNeverHandedOutFindNothing) {
  SlotMap<int> m;
  const uint64_t id = m.Insert(5);
  int out = 0;
  EXPECT_FALSE(m.Take(0, &out));
  EXPECT_FALSE(m.Take(id + 1000, &out));          // a slot that does not exist
  EXPECT_FALSE(m.Take(id + (1ull << 32), &out));  // a later generation
  EXPECT_FALSE(m.Take(~0ull, &out));
  EXPECT_EQ(m.size(), 1u);
}

TEST(SlotMap, TakingReleasesWhatTheValueOwned) {
  SlotMap<std::shared_ptr<int>> m;
  auto p = std::make_shared<int>(7);
  const uint64_t id = m.Insert(std::shared_ptr<int>(p));
  EXPECT_EQ(p.use_count(), 2);
  std::shared_ptr<int> out;
  ASSERT_TRUE(m.Take(id, &out));
  out.reset();
  EXPECT_EQ(p.use_count(), 1);
}

TEST(SlotMap, AgreesWithAMapUnderRandomUse) {
  SlotMap<int> m;
  std::map<uint64_t, int> model;
  std::vector<uint64_t> gone;
  std::mt19937 rng(42);
  for (int step = 0; step < 20000; ++step) {
    const int op = rng() % 3;
    if (op < 2 || model.empty()) {
      const int v = static_cast<int>(rng());
      const uint64_t id = m.Insert(int(v));
      ASSERT_TRUE(model.emplace(id, v).second) << "id " << id << " handed out twice";
    } else {
      auto it = model.begin();
      std::advance(it, rng() % model.size());
      int out = 0;
      ASSERT_TRUE(m.Take(it->first, &out));
      EXPECT_EQ(out, it->second);
      gone.push_back(it->first);
      model.erase(it);
    }
    ASSERT_EQ(m.size(), model.size());
  }
  for (uint64_t id : gone) EXPECT_EQ(m.Get(id), nullptr);
  size_t seen = 0;
  m.ForEach([&](uint64_t id, int& v) {
    ++seen;
    auto it = model.find(id);
    ASSERT_NE(it, model.end());
    EXPECT_EQ(v, it->second);
  });
  EXPECT_EQ(seen, model.size());
}

}  // namespace
}  // namespace rdmarpc
