// A channel to a host name that resolves to several addresses tries each in
// turn, so a server that listens on one family only is still reached by
// name: on a stock Debian "localhost" is [::1] first, then 127.0.0.1, and a
// server on 127.0.0.1 or 0.0.0.0 refuses [::1].
//
// Runs under tests/with_own_etc_hosts.sh, which gives the process an
// /etc/hosts of its own (in a private mount namespace) at the path in
// $RDMARPC_TEST_HOSTS, for names no machine has. The Tcp tests run on the
// host; the Rdma one in the Soft-RoCE VM.
#include <stdlib.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"
#include "transport/address.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

constexpr char kName[] = "rdmarpc-two-addresses";

// Makes kName resolve to `first`, then `second`, and checks that it does:
// else the tests below would pass without a second address to try.
void NameTwoAddresses(const std::string& first, const std::string& second) {
  const char* path = getenv("RDMARPC_TEST_HOSTS");
  ASSERT_NE(path, nullptr) << "run under tests/with_own_etc_hosts.sh";
  {
    std::ofstream hosts(path, std::ios::trunc);
    hosts << first << " " << kName << "\n" << second << " " << kName << "\n";
  }
  auto resolved =
      transport::ResolveAddresses(*transport::ParseAddress(absl::StrCat("tcp://", kName, ":1")));
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  ASSERT_EQ(resolved->size(), 2u);
  const auto host = [](const transport::SocketAddress& a) {
    return transport::SockaddrHost(reinterpret_cast<const sockaddr*>(&a.storage));
  };
  ASSERT_EQ(host((*resolved)[0]), first) << "getaddrinfo's order is not the file's";
  ASSERT_EQ(host((*resolved)[1]), second);
}

uint16_t PortOf(const std::string& address) { return transport::ParseAddress(address)->port; }

Status EchoOnce(const std::string& target, const std::string& data) {
  auto ch = Channel::Create(target);
  if (!ch.ok()) return ch.status();
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  EchoRequest req;
  req.set_data(data);
  EchoResponse resp;
  Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
  if (s.ok() && resp.data() != data) return Status(StatusCode::kInternal, "wrong echo");
  return s;
}

// The server on the name's second address, then on its first.
TEST(TcpNamedHost, ReachesAServerOnEitherOfTheNamesAddresses) {
  NameTwoAddresses("::1", "127.0.0.1");
  for (const char* listen : {"tcp://127.0.0.1:0", "tcp://[::1]:0"}) {
    TestServer ts(listen);
    ASSERT_TRUE(ts.server);
    const Status s = EchoOnce(absl::StrCat("tcp://", kName, ":", PortOf(ts.address)), listen);
    EXPECT_TRUE(s.ok()) << listen << ": " << s;
  }
}

TEST(TcpNamedHost, NoServerOnAnyAddressNamesEachAttempt) {
  NameTwoAddresses("::1", "127.0.0.1");
  // A port just freed: nothing listens there on either family.
  uint16_t port;
  {
    TestServer ts("tcp://127.0.0.1:0");
    ASSERT_TRUE(ts.server);
    port = PortOf(ts.address);
    ts.server->Shutdown();
  }
  const Status s = EchoOnce(absl::StrCat("tcp://", kName, ":", port), "none");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const std::string& tried : {absl::StrCat("[::1]:", port, ": Connection refused"),
                                   absl::StrCat("127.0.0.1:", port, ": Connection refused")}) {
    EXPECT_NE(s.message().find(tried), absl::string_view::npos) << s;
  }
}

// Over RDMA: the name's first address is the interface's IPv6 one, where
// no server listens (rdma_cm's connect is rejected), the second its IPv4.
TEST(RdmaNamedHost, ReachesAServerOnTheNamesSecondAddress) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  const std::string ip6 = rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip.empty() || ip6.empty());
  NameTwoAddresses(ip6, ip);
  TestServer ts("rdma://" + ip + ":0");
  ASSERT_TRUE(ts.server);
  const Status s =
      EchoOnce(absl::StrCat("rdma://", kName, ":", PortOf(ts.address)), std::string(100, 'r'));
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace rdmarpc::testing
