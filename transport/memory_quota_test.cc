// MemoryQuota: reservations up to the bound and no further, whatever the
// threads; a refusal reserves nothing; the error names the quota, its bound
// and what is held.
#include "transport/memory_quota.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

TEST(MemoryQuota, ReservesUpToItsBoundAndNoFurther) {
  auto quota = MemoryQuota::Create("frontend", 1000);
  EXPECT_EQ(quota->name(), "frontend");
  EXPECT_EQ(quota->bound(), 1000u);
  EXPECT_TRUE(quota->Fits(1000));
  EXPECT_FALSE(quota->Fits(1001));
  ASSERT_TRUE(quota->TryReserve(600));
  EXPECT_EQ(quota->Shortfall(400), 0u);
  EXPECT_EQ(quota->Shortfall(500), 100u);
  EXPECT_FALSE(quota->TryReserve(401)) << "reserved past the bound";
  EXPECT_EQ(quota->used(), 600u) << "a refusal reserved something";
  EXPECT_FALSE(quota->TryReserve(size_t{1} << 63)) << "a reservation that overflows passed";
  ASSERT_TRUE(quota->TryReserve(400));
  EXPECT_EQ(quota->used(), 1000u);
  EXPECT_FALSE(quota->Fits(1));

  const absl::Status why = quota->Exceeded(300, "a message from tcp://10.0.0.7:7000");
  EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted) << why;
  for (const char* part :
       {"300 bytes for a message from tcp://10.0.0.7:7000", "memory quota \"frontend\"",
        "TransportTunables::memory_quota", "1000 bytes", "1000 held now"}) {
    EXPECT_NE(why.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << why;
  }

  quota->Release(600);
  quota->Release(400);
  EXPECT_EQ(quota->used(), 0u);
  EXPECT_TRUE(quota->Fits(1000));
}

TEST(MemoryQuota, ThreadsTogetherNeverPassTheBound) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  auto quota = MemoryQuota::Create("shared", 10);
  std::atomic<size_t> most{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        if (!quota->TryReserve(3)) continue;
        const size_t now = quota->used();
        size_t seen = most.load();
        while (now > seen && !most.compare_exchange_weak(seen, now)) {
        }
        quota->Release(3);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(most.load(), 10u);
  EXPECT_GE(most.load(), 3u);
  EXPECT_EQ(quota->used(), 0u);
}

// Idle memory reserved on the quota, as idle RDMA blocks are: the
// reclaimer gives it back, all of it, when asked for any.
size_t idle_bytes = 0;
const MemoryQuota* asked_of = nullptr;
size_t asked_for = 0;

size_t GiveBackIdle(size_t bytes, const MemoryQuota* quota) {
  asked_of = quota;
  asked_for = bytes;
  const size_t given = idle_bytes;
  const_cast<MemoryQuota*>(quota)->Release(given);
  idle_bytes = 0;
  return given;
}

TEST(MemoryQuota, IdleMemoryIsGivenBackBeforeAReservationIsRefused) {
  auto quota = MemoryQuota::Create("reclaimed", 1000);
  ASSERT_TRUE(quota->TryReserve(300));  // in use
  ASSERT_TRUE(quota->TryReserve(600));
  idle_bytes = 600;
  EXPECT_FALSE(quota->Reserve(200)) << "reserved past the bound with no reclaimer";
  MemoryQuota::SetReclaimer(&GiveBackIdle);
  EXPECT_FALSE(quota->TryReserve(200)) << "TryReserve gave back idle memory";
  EXPECT_EQ(idle_bytes, 600u);
  EXPECT_FALSE(quota->Reserve(1001)) << "past the bound itself";
  EXPECT_EQ(idle_bytes, 600u) << "idle memory given back for what can never fit";
  ASSERT_TRUE(quota->Reserve(200));
  EXPECT_EQ(asked_of, quota.get());
  EXPECT_EQ(asked_for, 100u) << "the shortfall";
  EXPECT_EQ(quota->used(), 500u);
  EXPECT_FALSE(quota->Reserve(600)) << "nothing idle is left";
  EXPECT_TRUE(quota->MakeRoom(500));
  EXPECT_EQ(quota->used(), 500u) << "MakeRoom reserved something";

  idle_bytes = 500;  // the 300 and 200 reserved above, idle now
  EXPECT_TRUE(quota->MakeRoom(800));
  EXPECT_EQ(quota->used(), 0u);
  MemoryQuota::SetReclaimer(nullptr);
}

TEST(MemoryQuotaDeathTest, ReleasingMoreThanIsReservedAborts) {
  auto quota = MemoryQuota::Create("q", 100);
  ASSERT_TRUE(quota->TryReserve(10));
  EXPECT_DEATH(quota->Release(11), "memory quota \"q\": 11 bytes released, 10 were reserved");
  quota->Release(10);
}

}  // namespace
}  // namespace rdmarpc::transport
