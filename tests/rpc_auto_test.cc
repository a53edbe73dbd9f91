// The runtime suite over auto:// on a machine with RDMA (Soft-RoCE in the
// VM): the server listens over RDMA and TCP on one port and gives its
// address as auto://, and the channels connect through the AutoTransport
// (transport/auto_transport.h), so restarts on a fixed port, graceful
// shutdown, GOAWAY and deadlines are checked through the pairing and the
// fallback's wrapper as users of auto:// meet them. The stalled address
// gets no answer over either: RDMA gives up after half the connect
// timeout, and TCP's SYN goes unanswered for the rest.
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/rpc_suite.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {

StalledAddress StalledAuto() {
  const std::string host = rdma::testing::SilentTestNetworkHost();
  if (host.empty()) return {};
  return {absl::StrCat("auto://", host, ":7471"), nullptr};
}

INSTANTIATE_TEST_SUITE_P(
    Auto, RpcSuite,
    ::testing::Values(SuiteParam{
        "auto", [] { return "auto://" + rdma::testing::RequireRdmaTestAddress() + ":0"; },
        StalledAuto}),
    [](const auto& info) { return info.param.name; });

}  // namespace rdmarpc::testing
