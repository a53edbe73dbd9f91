#include "transport/rdma/sent_by_round.h"

#include "gtest/gtest.h"

namespace rdmarpc::transport::rdma {
namespace {

TEST(SentByRound, KeepsTheLatestRoundApart) {
  SentByRound sent;
  EXPECT_EQ(sent.total(), 0);
  EXPECT_EQ(sent.InRound(0), 0);
  sent.Add(3, 2);
  sent.Add(3, 5);
  EXPECT_EQ(sent.total(), 7);
  EXPECT_EQ(sent.InRound(3), 7);
  EXPECT_EQ(sent.InRound(4), 0) << "a frame polled in a later round can have had it all";
  sent.Add(5, 1);
  EXPECT_EQ(sent.total(), 8);
  EXPECT_EQ(sent.InRound(5), 1);
  EXPECT_EQ(sent.InRound(3), 0);
}

// A round read stale may only count more as sent before: a check can miss
// a peer then, never blame one.
TEST(SentByRound, AStaleRoundCountsAsSentBefore) {
  SentByRound sent;
  sent.Add(7, 4);
  sent.Add(6, 3);
  EXPECT_EQ(sent.total(), 7);
  EXPECT_EQ(sent.InRound(7), 4);
  EXPECT_EQ(sent.total() - sent.InRound(7), 3);
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
