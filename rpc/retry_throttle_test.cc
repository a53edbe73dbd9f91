#include "rpc/retry_throttle.h"

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

std::shared_ptr<RetryThrottle> Make(int max_tokens, double token_ratio) {
  auto made = RetryThrottle::Create(max_tokens, token_ratio);
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? *made : nullptr;
}

// gRPC's own sequence: 4 tokens, so retries stop at 2 or fewer, and a
// success gives back 1.6.
TEST(RetryThrottle, RetriesStopAtHalfTheTokensAndSuccessesBringThemBack) {
  auto t = Make(4, 1.6);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->tokens(), 4);
  EXPECT_TRUE(t->RecordFailure());  // 3
  t->RecordSuccess();               // 4: never above the most
  EXPECT_EQ(t->tokens(), 4);
  EXPECT_TRUE(t->RecordFailure());   // 3
  EXPECT_FALSE(t->RecordFailure());  // 2: at half, so no retry
  t->RecordSuccess();                // 3.6
  EXPECT_DOUBLE_EQ(t->tokens(), 3.6);
  EXPECT_TRUE(t->RecordFailure());   // 2.6
  EXPECT_FALSE(t->RecordFailure());  // 1.6
  EXPECT_FALSE(t->RecordFailure());  // 0.6
  EXPECT_FALSE(t->RecordFailure());  // 0: never below
  EXPECT_EQ(t->tokens(), 0);
  t->RecordSuccess();  // 1.6
  t->RecordSuccess();  // 3.2
  EXPECT_DOUBLE_EQ(t->tokens(), 3.2);
  EXPECT_TRUE(t->RecordFailure());  // 2.2
}

TEST(RetryThrottle, TheRatioCountsInThousandths) {
  auto t = Make(10, 0.0019);
  ASSERT_TRUE(t);
  EXPECT_DOUBLE_EQ(t->token_ratio(), 0.001);
  EXPECT_EQ(t->max_tokens(), 10);
  for (int i = 0; i < 10; ++i) t->RecordFailure();
  t->RecordSuccess();
  EXPECT_DOUBLE_EQ(t->tokens(), 0.001);
  EXPECT_DOUBLE_EQ(Make(10, 0.3)->token_ratio(), 0.3) << "rounded down below what was asked";
}

TEST(RetryThrottle, FiguresOutsideGrpcsBoundsAreRefusedByName) {
  for (int max_tokens : {0, -1, 1001}) {
    auto made = RetryThrottle::Create(max_tokens, 0.1);
    ASSERT_FALSE(made.ok()) << max_tokens;
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find("max_tokens is " + std::to_string(max_tokens)),
              std::string::npos)
        << made.status();
  }
  for (double ratio : {0.0, 0.0009, -1.0, 1000.5, std::nan("")}) {
    auto made = RetryThrottle::Create(10, ratio);
    ASSERT_FALSE(made.ok()) << ratio;
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find("token_ratio"), std::string::npos) << made.status();
  }
  EXPECT_TRUE(RetryThrottle::Create(1000, 1000).ok());
  EXPECT_TRUE(RetryThrottle::Create(1, 0.001).ok());
}

// Channels share one throttle across their threads: no count is lost.
TEST(RetryThrottle, CountsFromManyThreadsAddUp) {
  auto t = Make(1000, 0.5);
  ASSERT_TRUE(t);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 100; ++j) t->RecordFailure();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t->tokens(), 200);
  threads.clear();
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 100; ++j) t->RecordSuccess();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(t->tokens(), 400);
}

}  // namespace
}  // namespace rdmarpc
