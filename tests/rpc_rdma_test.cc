// The runtime suite over RDMA (Soft-RoCE in the VM, or a real device), and
// what the counters must show: small calls went by SEND into the SRQ, large
// ones by READ, and the server counted calls per method.
#include "tests/echo_service.h"
#include "tests/rpc_suite.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {

INSTANTIATE_TEST_SUITE_P(Rdma, RpcSuite,
                         ::testing::Values(SuiteParam{"rdma", [] {
                           return "rdma://" + rdma::testing::RequireRdmaTestAddress() + ":0";
                         }}),
                         [](const auto& info) { return info.param.name; });

TEST(RdmaCounters, SmallCallsBySendLargeCallsByRead) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  TestServer ts("rdma://" + ip + ":0");
  ASSERT_TRUE(ts.server);
  auto ch = Channel::Create(ts.address);
  ASSERT_TRUE(ch.ok());
  const auto& c = transport::rdma::Counters();
  auto call = [&](size_t size) {
    ClientContext ctx;
    EchoRequest req;
    req.set_data(std::string(size, 'c'));
    EchoResponse resp;
    Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data().size(), size);
  };
  call(16);  // connects
  uint64_t reads = c.reads.load(), consumed = c.srq_slots_consumed.load();
  for (int i = 0; i < 10; ++i) call(100);
  EXPECT_EQ(c.reads.load(), reads) << "small calls must not READ";
  EXPECT_GE(c.srq_slots_consumed.load() - consumed, 20u) << "request and response per call";
  reads = c.reads.load();
  for (int i = 0; i < 3; ++i) call(256 * 1024);
  EXPECT_GE(c.reads.load() - reads, 6u) << "large request and response are READ";
  EXPECT_EQ(ts.server->MethodCallCounts()["/rdmarpc.test.Echo/Echo"], 14u);
  printf("%s\n", c.ToString().c_str());
}

// Run-to-completion: in busy (and adaptive) poll mode a blocking caller picks
// up its own response from the completion queue; in event mode the poller
// thread does, as it must (no thread may spin there).
size_t CallerCompletionsFor(const char* poll_mode, int calls) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  setenv("RDMARPC_RDMA_POLL", poll_mode, 1);
  TestServer ts("rdma://" + ip + ":0");
  auto ch = Channel::Create(ts.address);  // the transports read the mode now
  unsetenv("RDMARPC_RDMA_POLL");
  EXPECT_TRUE(ts.server && ch.ok());
  if (!ts.server || !ch.ok()) return 0;
  const auto& c = transport::rdma::Counters();
  EchoRequest req;
  req.set_data("run to completion");
  EchoResponse resp;
  {
    ClientContext ctx;
    EXPECT_TRUE((*ch)->Call(kEcho, &ctx, req, &resp).ok());  // connects
  }
  const uint64_t before = c.caller_completions.load();
  for (int i = 0; i < calls; ++i) {
    ClientContext ctx;
    Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), req.data());
  }
  return c.caller_completions.load() - before;
}

TEST(RdmaRunToCompletion, BusyModeCallersPollTheirOwnResponses) {
  const int calls = 200;
  EXPECT_GE(CallerCompletionsFor("busy", calls), static_cast<size_t>(calls));
}

TEST(RdmaRunToCompletion, EventModeLeavesPollingToThePoller) {
  EXPECT_EQ(CallerCompletionsFor("event", 50), 0u);
}

}  // namespace rdmarpc::testing
