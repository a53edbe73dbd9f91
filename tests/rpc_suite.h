// The runtime's conformance suite, written once and run over every transport.
//
// tests/rpc_tcp_test.cc instantiates it over tcp://, and
// tests/rpc_rdma_test.cc over rdma:// (in the Soft-RoCE VM). Each parameter
// is a function that returns the address a test server should listen on.
#ifndef RDMARPC_TESTS_RPC_SUITE_H_
#define RDMARPC_TESTS_RPC_SUITE_H_

#include <functional>
#include <string>

#include "gtest/gtest.h"

namespace rdmarpc::testing {

struct SuiteParam {
  std::string name;                          // "tcp", "rdma"
  std::function<std::string()> listen_addr;  // e.g. "tcp://127.0.0.1:0"
};

class RpcSuite : public ::testing::TestWithParam<SuiteParam> {};

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_RPC_SUITE_H_
