// A server asked for a port below 1024 by a process without
// CAP_NET_BIND_SERVICE (a user's program, a systemd service without
// AmbientCapabilities=) fails to start, and says why and what to do, over
// TCP and over RDMA, where rdma_cm enforces the same rule; the RDMA error
// does not send the user looking at devices.
//
// Runs in the Soft-RoCE VM under tests/without_capability.sh
// net_bind_service, which drops the capability that root would have.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

// Nothing listens there in the VM, over either transport.
constexpr int kPrivilegedPort = 1023;

Status StartOn(const std::string& address) {
  EchoService service;
  auto server = ServerBuilder().AddListeningPort(address).RegisterService(&service).BuildAndStart();
  return server.status();
}

void ExpectRefusedSayingWhatToDo(const std::string& address) {
  const Status s = StartOn(address);
  ASSERT_FALSE(s.ok()) << address << " started: run under tests/without_capability.sh "
                       << "net_bind_service";
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const std::string& part : {address, std::string("Permission denied"),
                                  std::string("CAP_NET_BIND_SERVICE: listen on a higher one")}) {
    EXPECT_TRUE(absl::StrContains(s.message(), part)) << part << "\n" << s;
  }
  EXPECT_FALSE(absl::StrContains(s.message(), "Devices: ")) << s;
}

TEST(PrivilegedPort, OverTcpIsRefusedSayingWhatToDo) {
  ExpectRefusedSayingWhatToDo(absl::StrCat("tcp://127.0.0.1:", kPrivilegedPort));
}

TEST(PrivilegedPort, OverRdmaIsRefusedSayingWhatToDo) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  ExpectRefusedSayingWhatToDo(absl::StrCat("rdma://", ip, ":", kPrivilegedPort));
}

// The first port past them is anyone's: what failed above was the port.
TEST(PrivilegedPort, TheFirstUnprivilegedOneServes) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  for (const std::string& address :
       {std::string("tcp://127.0.0.1:1024"), "rdma://" + ip + ":1024"}) {
    TestServer ts(address);
    EXPECT_TRUE(ts.server) << address;
  }
}

}  // namespace
}  // namespace rdmarpc::testing
