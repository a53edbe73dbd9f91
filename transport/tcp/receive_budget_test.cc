// ReceiveBudget: bytes count as they arrive and until their payload is
// released; what would pass the bound is refused and counts nothing; a
// payload abandoned part way gives back what it counted; payloads outlive
// their owner's reference (the sanitizers' round checks that nothing leaks
// and nothing is used after it is freed).
#include "transport/tcp/receive_budget.h"

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

// Owns the owner's reference for a test.
struct Budget {
  explicit Budget(size_t bound, std::shared_ptr<MemoryQuota> quota = nullptr)
      : b(ReceiveBudget::New(bound, std::move(quota))) {}
  ~Budget() {
    if (b != nullptr) b->Drop();
  }
  ReceiveBudget* operator->() const { return b; }
  ReceiveBudget* b;
};

TEST(ReceiveBudget, BytesCountAsTheyArriveAndUntilThePayloadIsReleased) {
  Budget budget(1000);
  std::optional<ReceiveBudget::Incoming> in = budget->Allocate(600);
  ASSERT_TRUE(in);
  EXPECT_EQ(budget->held(), 0u) << "an announced payload counted before its bytes came";
  ASSERT_TRUE(in->Count(100));
  memset(in->data(), 'x', 600);
  ASSERT_TRUE(in->Count(500));
  EXPECT_EQ(budget->held(), 600u);
  Buffer payload = std::move(*in).Take();
  in.reset();
  EXPECT_EQ(payload.size(), 600u);
  EXPECT_EQ(std::string(payload.data(), 3), "xxx");
  EXPECT_EQ(budget->held(), 600u) << "a delivered payload stopped counting before its release";
  Buffer moved = std::move(payload);
  EXPECT_EQ(budget->held(), 600u);
  moved.Reset();
  EXPECT_EQ(budget->held(), 0u);
}

TEST(ReceiveBudget, WhatWouldPassTheBoundIsRefusedAndCountsNothing) {
  Budget budget(1000);
  EXPECT_TRUE(budget->Fits(1000));
  EXPECT_FALSE(budget->Fits(1001));
  std::optional<ReceiveBudget::Incoming> first = budget->Allocate(700);
  std::optional<ReceiveBudget::Incoming> second = budget->Allocate(400);
  ASSERT_TRUE(first && second);
  ASSERT_TRUE(first->Count(700));
  EXPECT_FALSE(budget->Fits(400));
  EXPECT_TRUE(budget->Fits(300));
  ASSERT_TRUE(second->Count(300));
  EXPECT_FALSE(second->Count(100)) << "counted past the bound";
  EXPECT_EQ(budget->held(), 1000u);
  EXPECT_FALSE(second->Count(size_t{1} << 62)) << "a count that overflows passed";

  const absl::Status why = budget->Exceeded(400, "tcp://10.0.0.7:7000");
  EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted) << why;
  for (const char* part : {"400 bytes from tcp://10.0.0.7:7000", "TcpOptions::max_receive_bytes",
                           "1000 bytes", "1000 held now"}) {
    EXPECT_NE(why.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << why;
  }

  second.reset();  // abandoned part way: gives back the 300 it counted
  EXPECT_EQ(budget->held(), 700u);
  Buffer kept = std::move(*first).Take();
  first.reset();
  EXPECT_EQ(budget->held(), 700u);
  kept.Reset();
  EXPECT_EQ(budget->held(), 0u);
  EXPECT_TRUE(budget->Fits(1000));
}

TEST(ReceiveBudget, PayloadsOutliveTheOwnersReference) {
  ReceiveBudget* budget = ReceiveBudget::New(1 << 20);
  std::vector<Buffer> kept;
  for (size_t size : {1, 10, 1000}) {
    std::optional<ReceiveBudget::Incoming> in = budget->Allocate(size);
    ASSERT_TRUE(in);
    ASSERT_TRUE(in->Count(size));
    kept.push_back(std::move(*in).Take());
  }
  EXPECT_EQ(budget->held(), 1011u);
  std::optional<ReceiveBudget::Incoming> never_counted = budget->Allocate(5);
  ASSERT_TRUE(never_counted);
  budget->Drop();
  never_counted.reset();
  // Released on other threads, as the runtime's workers release payloads.
  std::thread a([b = std::move(kept[0])]() mutable { b.Reset(); });
  std::thread c([b = std::move(kept[2])]() mutable { b.Reset(); });
  a.join();
  c.join();
  EXPECT_EQ(kept[1].size(), 10u);
  kept.clear();  // the last: frees the budget
}

// Two transports' budgets given one quota: bytes count on both, each
// budget refuses what the quota has no room for though its own bound has,
// and names the quota then; what is released, and a refusal, leave the
// quota as they leave the budget.
TEST(ReceiveBudget, BudgetsSharingAQuotaAreBoundTogether) {
  auto quota = MemoryQuota::Create("both", 1000);
  Budget first(800, quota);
  Budget second(800, quota);
  std::optional<ReceiveBudget::Incoming> a = first->Allocate(700);
  std::optional<ReceiveBudget::Incoming> b = second->Allocate(500);
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->Count(700));
  EXPECT_EQ(quota->used(), 700u);
  EXPECT_FALSE(second->Fits(500)) << "the quota's room was not looked at";
  EXPECT_TRUE(second->Fits(300));
  ASSERT_TRUE(b->Count(300));
  EXPECT_FALSE(b->Count(200)) << "counted past the quota";
  EXPECT_EQ(second->held(), 300u) << "a refusal by the quota counted on the budget";
  EXPECT_EQ(quota->used(), 1000u);

  const absl::Status why = second->Exceeded(500, "tcp://10.0.0.7:7000");
  EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted) << why;
  for (const char* part : {"500 bytes for a message from tcp://10.0.0.7:7000",
                           "memory quota \"both\"", "1000 bytes", "1000 held now"}) {
    EXPECT_NE(why.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << why;
  }
  const absl::Status own = first->Exceeded(900, "tcp://10.0.0.8:7000");
  EXPECT_NE(own.message().find("TcpOptions::max_receive_bytes"), absl::string_view::npos)
      << "past the budget's own bound, the bound is not named: " << own;

  b.reset();
  EXPECT_EQ(quota->used(), 700u);
  Buffer kept = std::move(*a).Take();
  a.reset();
  EXPECT_EQ(quota->used(), 700u) << "a delivered payload stopped counting on the quota";
  kept.Reset();
  EXPECT_EQ(quota->used(), 0u);
  EXPECT_TRUE(second->Fits(800));
}

// Many payloads arriving on some threads while others are released on
// others never take the count past the bound or lose a byte of it.
TEST(ReceiveBudget, ConcurrentCountsAndReleasesKeepTheBound) {
  constexpr size_t kBound = 64 * 1024;
  Budget budget(kBound);
  std::vector<std::thread> threads;
  std::atomic<bool> passed_the_bound{false};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        std::optional<ReceiveBudget::Incoming> in = budget->Allocate(4096);
        if (!in || !in->Count(4096)) continue;
        if (budget->held() > kBound) passed_the_bound = true;
        Buffer b = std::move(*in).Take();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(passed_the_bound.load());
  EXPECT_EQ(budget->held(), 0u);
}

}  // namespace
}  // namespace rdmarpc::transport
