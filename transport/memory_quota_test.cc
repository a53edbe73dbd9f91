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

TEST(MemoryQuotaDeathTest, ReleasingMoreThanIsReservedAborts) {
  auto quota = MemoryQuota::Create("q", 100);
  ASSERT_TRUE(quota->TryReserve(10));
  EXPECT_DEATH(quota->Release(11), "memory quota \"q\": 11 bytes released, 10 were reserved");
  quota->Release(10);
}

}  // namespace
}  // namespace rdmarpc::transport
