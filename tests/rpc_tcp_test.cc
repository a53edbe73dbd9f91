// The runtime suite over TCP on loopback, IPv4 and IPv6.
#include "tests/rpc_suite.h"

namespace rdmarpc::testing {

INSTANTIATE_TEST_SUITE_P(
    Tcp, RpcSuite,
    ::testing::Values(SuiteParam{"tcp", [] { return std::string("tcp://127.0.0.1:0"); }},
                      SuiteParam{"tcp6", [] { return std::string("tcp://[::1]:0"); }}),
    [](const auto& info) { return info.param.name; });

}  // namespace rdmarpc::testing
