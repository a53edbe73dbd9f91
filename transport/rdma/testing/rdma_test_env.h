// What an RDMA test needs from its environment, and a clear failure without it.
//
// RDMA tests are tagged "rdma" in Bazel and are meant to run under
// tools/vm/run.sh (make test does that): either on this machine's own RDMA
// device or inside a Soft-RoCE VM. Run any other way on a machine without a
// device they FAIL, naming what to do; they never skip and never pass.
//
//   TEST(Foo, Bar) {
//     const std::string addr = rdmarpc::rdma::testing::RequireRdmaTestAddress();
//     ...listen or connect on addr...
//   }
#ifndef RDMARPC_TRANSPORT_RDMA_TESTING_RDMA_TEST_ENV_H_
#define RDMARPC_TRANSPORT_RDMA_TESTING_RDMA_TEST_ENV_H_

#include <string>

namespace rdmarpc::rdma::testing {

// The IPv4 address of an RDMA-capable local interface ($RDMARPC_TEST_ADDR),
// after checking that libibverbs sees at least one device. Fails the current
// test (gtest FAIL) and returns "" when either is missing.
std::string RequireRdmaTestAddress();

// A global IPv6 address of the same interface ($RDMARPC_TEST_ADDR6; the VM
// gives its interface fd77::1). Fails the current test and returns "" when it
// is not set.
std::string RequireRdmaTestAddress6();

// Another host of the test address's /24 that nobody holds (.254, or .253
// when the test address is .254): nothing answers rdma_cm's connect request
// or a TCP SYN there. Fails the current test and returns "" like
// RequireRdmaTestAddress.
std::string SilentTestNetworkHost();

// The peer VM's address in two-VM mode ($RDMARPC_PEER_ADDR), or "".
std::string PeerAddress();

// The peer VM's IPv6 address in two-VM mode ($RDMARPC_PEER_ADDR6), or "".
std::string PeerAddress6();

// "server", "client", "single" or "host" ($RDMARPC_VM_ROLE), or "".
std::string Role();

}  // namespace rdmarpc::rdma::testing

#endif  // RDMARPC_TRANSPORT_RDMA_TESTING_RDMA_TEST_ENV_H_
