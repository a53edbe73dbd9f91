#include "rpc/internal/spare_pool.h"

#include <algorithm>
#include <memory>
#include <set>
#include <thread>
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

// A thread keeps up to its bound itself and the shared stack as many again.
TEST(SparePool, KeepsAtMostItsBoundsAndDeletesTheRest) {
  using Pool = SparePool<Counted, 4>;
  std::vector<Counted*> taken;
  for (int i = 0; i < 10; ++i) taken.push_back(Pool::Take());
  const int alive = Counted::alive;
  for (Counted* c : taken) Pool::Give(c);
  EXPECT_EQ(Counted::alive, alive - 2);
  std::set<Counted*> again;
  for (int i = 0; i < 8; ++i) again.insert(Pool::Take());
  EXPECT_EQ(again.size(), 8u);
  for (Counted* c : again) {
    EXPECT_NE(std::find(taken.begin(), taken.end(), c), taken.end());
    Pool::Give(c);
  }
}

// What a thread held is not lost when it exits: its stack goes to the shared
// one, where any thread finds it.
TEST(SparePool, SparesOfAnExitingThreadGoToTheOthers) {
  struct Tagged {
    int value = 0;
  };
  using Pool = SparePool<Tagged, 8>;
  std::vector<Tagged*> given;
  std::thread([&] {
    for (int i = 0; i < 3; ++i) given.push_back(Pool::Take());
    for (Tagged* t : given) Pool::Give(t);
  }).join();
  std::set<Tagged*> taken;
  for (int i = 0; i < 3; ++i) taken.insert(Pool::Take());
  EXPECT_EQ(taken, std::set<Tagged*>(given.begin(), given.end()));
  for (Tagged* t : taken) Pool::Give(t);
}

// Overflow from one thread's stack reaches another thread while both live.
TEST(SparePool, OverflowOfOneThreadIsTakenByAnother) {
  struct Tagged {
    int value = 0;
  };
  using Pool = SparePool<Tagged, 2>;
  std::vector<Tagged*> mine;
  for (int i = 0; i < 3; ++i) mine.push_back(Pool::Take());
  for (Tagged* t : mine) Pool::Give(t);  // two stay here, the third is shared
  Tagged* other = nullptr;
  std::thread([&] {
    other = Pool::Take();
    Pool::Give(other);
  }).join();
  EXPECT_EQ(other, mine[2]);
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
