// The runtime suite over RDMA (Soft-RoCE in the VM, or a real device), then
// a look at the transport counters: small calls must have gone by SEND into
// the SRQ, large ones by READ.
#include "tests/rpc_suite.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {

INSTANTIATE_TEST_SUITE_P(Rdma, RpcSuite,
                         ::testing::Values(SuiteParam{"rdma", [] {
                           return "rdma://" + rdma::testing::RequireRdmaTestAddress() + ":0";
                         }}),
                         [](const auto& info) { return info.param.name; });

}  // namespace rdmarpc::testing
