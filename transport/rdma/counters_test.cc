// The RDMA counters reach Counters() from any thread, gauges included, and
// ToString shows the sums (the sharding itself: base/sharded_counts_test.cc).
#include "transport/rdma/counters.h"

#include <string>
#include <thread>
#include <utility>

#include "gtest/gtest.h"

namespace rdmarpc::transport::rdma {
namespace {

TEST(RdmaCounters, CountAndUncountReachTheSum) {
  const RdmaCounters before = Counters();
  Count(&RdmaCounters::registered_bytes, 1 << 20);
  std::thread([] { Count(&RdmaCounters::reads, 2); }).join();
  RdmaCounters now = Counters();
  EXPECT_EQ(now.registered_bytes - before.registered_bytes, uint64_t{1} << 20);
  EXPECT_EQ(now.reads - before.reads, 2u);
  std::thread([] { Uncount(&RdmaCounters::registered_bytes, 1 << 20); }).join();
  now = Counters();
  EXPECT_EQ(now.registered_bytes, before.registered_bytes);
  EXPECT_EQ(now.sends, before.sends) << "another counter moved";
}

TEST(RdmaCounters, ToStringShowsTheSums) {
  Count(&RdmaCounters::credit_stalls, 2);
  std::thread([] { Count(&RdmaCounters::credit_stalls, 3); }).join();
  const RdmaCounters c = Counters();
  const std::string text = c.ToString();
  EXPECT_NE(text.find("credit_stalls=" + std::to_string(c.credit_stalls) + " "),
            std::string::npos)
      << text;
  EXPECT_GE(c.credit_stalls, 5u);
}

TEST(RdmaCounters, NamedGivesEveryCounterUnderItsFieldName) {
  Count(&RdmaCounters::late_reads_skipped, 4);
  const RdmaCounters c = Counters();
  const auto named = c.Named();
  EXPECT_EQ(named.size(), sizeof(RdmaCounters) / sizeof(uint64_t));
  EXPECT_EQ(named.front(), std::make_pair(std::string("sends"), c.sends));
  bool found = false;
  for (const auto& [name, value] : named) {
    if (name != "late_reads_skipped") continue;
    found = true;
    EXPECT_EQ(value, c.late_reads_skipped);
    EXPECT_GE(value, 4u);
  }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
