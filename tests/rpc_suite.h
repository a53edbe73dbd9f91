// The runtime's conformance suite, written once and run over every transport.
//
// tests/rpc_tcp_test.cc instantiates it over tcp://, and
// tests/rpc_rdma_test.cc over rdma:// (in the Soft-RoCE VM). Each parameter
// says where a test server should listen and where connecting stalls.
//
// The tests live in one file per concern, tests/rpc_suite_<concern>.cc:
// calls, payloads, cancellation, connecting, server, interceptors,
// channel_groups, balancing and mixed_load; helpers more than one of them
// uses are in tests/rpc_suite_util.h.
#ifndef RDMARPC_TESTS_RPC_SUITE_H_
#define RDMARPC_TESTS_RPC_SUITE_H_

#include <functional>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace rdmarpc::testing {

// An address where a connect waits for a handshake that never comes, and
// what keeps it so (a listener) until dropped.
struct StalledAddress {
  std::string address;
  std::shared_ptr<void> keep;
};

struct SuiteParam {
  std::string name;                          // "tcp", "rdma"
  std::function<std::string()> listen_addr;  // e.g. "tcp://127.0.0.1:0"
  std::function<StalledAddress()> stalled;
};

class RpcSuite : public ::testing::TestWithParam<SuiteParam> {};

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_RPC_SUITE_H_
