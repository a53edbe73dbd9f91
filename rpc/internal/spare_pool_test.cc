#include "rpc/internal/spare_pool.h"

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc::internal {
namespace {

struct Counted {
  Counted() { ++alive; }
  ~Counted() { --alive; }
  int value = 0;
  static inline int alive = 0;
};

TEST(SparePool, GivenBackObjectIsTakenAgain) {
  using Pool = SparePool<Counted, 4>;
  Counted* a = Pool::Take();
  a->value = 7;
  Pool::Give(a);
  Counted* b = Pool::Take();
  EXPECT_EQ(b, a);
  EXPECT_EQ(b->value, 7);  // the pool does not reset; callers do
  Pool::Give(b);
}

TEST(SparePool, KeepsAtMostItsBoundAndDeletesTheRest) {
  using Pool = SparePool<Counted, 4>;
  std::vector<Counted*> taken;
  for (int i = 0; i < 10; ++i) taken.push_back(Pool::Take());
  const int alive = Counted::alive;
  for (Counted* c : taken) Pool::Give(c);
  EXPECT_EQ(Counted::alive, alive - 6);
  std::set<Counted*> again;
  for (int i = 0; i < 4; ++i) again.insert(Pool::Take());
  for (Counted* c : again) {
    EXPECT_NE(std::find(taken.begin(), taken.end(), c), taken.end());
    Pool::Give(c);
  }
}

TEST(SpareAllocator, SharedObjectsReuseTheirStorage) {
  const Counted* first;
  {
    auto p = std::allocate_shared<Counted>(SpareAllocator<Counted>());
    first = p.get();
  }
  auto q = std::allocate_shared<Counted>(SpareAllocator<Counted>());
  EXPECT_EQ(q.get(), first);
}

#if defined(__SANITIZE_ADDRESS__)
TEST(SpareAllocatorDeathTest, UseOfAFreedSharedObjectIsReportedUnderAsan) {
  const Counted* stale;
  {
    auto p = std::allocate_shared<Counted>(SpareAllocator<Counted>());
    stale = p.get();
  }
  EXPECT_DEATH(
      {
        const volatile int* v = &stale->value;
        (void)*v;
      },
      "use-after-poison");
}
#endif

}  // namespace
}  // namespace rdmarpc::internal
