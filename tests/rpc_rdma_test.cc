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

}  // namespace rdmarpc::testing
