// A channel to a host name that resolves to several addresses tries each,
// so a server that listens on one family only is still reached by name: on
// a stock Debian "localhost" is [::1] first, then 127.0.0.1, and a server on
// 127.0.0.1 or 0.0.0.0 refuses [::1]. An address that hangs or answers
// nothing holds the connect up for a quarter of a second, not for its
// timeout (transport/address_race.h). A server on such a name listens on
// each of its addresses, so a client that dials either reaches it.
//
// Runs under tests/with_own_etc_hosts.sh, which gives the process an
// /etc/hosts of its own (in a private mount namespace) at the path in
// $RDMARPC_TEST_HOSTS, for names no machine has. The Tcp tests run on the
// host, the Rdma ones in the Soft-RoCE VM.
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "transport/address.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"
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

// In the VM: the interface's IPv4 and IPv6 addresses, and kName resolving
// to the IPv6 one, then the IPv4 one.
void NameTheInterfacesTwoAddresses(std::string* ip, std::string* ip6) {
  *ip = rdma::testing::RequireRdmaTestAddress();
  *ip6 = rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip->empty() || ip6->empty());
  NameTwoAddresses(*ip6, *ip);
}

uint16_t PortOf(const std::string& address) { return transport::ParseAddress(address)->port; }

// A port that a server on `address` has just given up, so that nothing
// listens there on either family; 0 when no server could start.
uint16_t JustFreedPort(const std::string& address) {
  TestServer ts(address);
  if (!ts.server) return 0;
  const uint16_t port = PortOf(ts.address);
  ts.server->Shutdown();
  return port;
}

Status EchoOnce(const std::string& target, const std::string& data, ChannelOptions options = {}) {
  auto ch = Channel::Create(target, std::move(options));
  if (!ch.ok()) return ch.status();
  return EchoOn(**ch, data);
}

// How many times `part` is in `text`.
size_t Count(absl::string_view text, absl::string_view part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != absl::string_view::npos; at = text.find(part, at + 1)) {
    ++n;
  }
  return n;
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

// A socket on [::1]:port (any free port for 0) that takes connections (the
// kernel's handshake) but never accepts them, so no kHello comes: a server
// that hangs, or a port some other program has taken. With kAnswersNothing
// its accept queue is full, so the kernel drops the SYNs that come: as a
// host that is down, or a firewall that drops the port, answers nothing.
class SilentListener {
 public:
  enum Silence { kTakesConnections, kAnswersNothing };
  explicit SilentListener(uint16_t port, Silence silence = kTakesConnections) {
    fd_ = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int one = 1;
    setsockopt(fd_, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    a.sin6_port = htons(port);
    const int backlog = silence == kAnswersNothing ? 0 : 16;
    listening_ =
        bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && listen(fd_, backlog) == 0;
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin6_port);
    if (listening_ && silence == kAnswersNothing) {
      // The one connection a backlog of 0 holds.
      filler_ = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
      listening_ = connect(filler_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    }
  }
  ~SilentListener() {
    if (filler_ >= 0) close(filler_);
    close(fd_);
  }
  bool listening() const { return listening_; }
  uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  int filler_ = -1;
  bool listening_ = false;
  uint16_t port_ = 0;
};

// The name's first address takes the connection and never greets, or
// answers nothing at all: the second is asked beside it kNextAddressAfter
// in (transport/address_race.h), so the call is served although the first
// address's connect would wait out a connect_timeout of two minutes (asked
// in turn, it held the connect for 60 s of it, past the call's 20).
TEST(TcpNamedHost, AnAddressThatHangsDoesNotHoldUpTheConnect) {
  NameTwoAddresses("::1", "127.0.0.1");
  for (const auto silence : {SilentListener::kTakesConnections, SilentListener::kAnswersNothing}) {
    TestServer ts("tcp://127.0.0.1:0");
    ASSERT_TRUE(ts.server);
    const uint16_t port = PortOf(ts.address);
    SilentListener hangs(port, silence);
    ASSERT_TRUE(hangs.listening()) << "[::1]:" << port << ": " << strerror(errno);
    ChannelOptions options;
    options.connect_timeout = absl::Minutes(2);
    const Status s =
        EchoOnce(absl::StrCat("tcp://", kName, ":", port), "past the hang", std::move(options));
    EXPECT_TRUE(s.ok()) << (silence == SilentListener::kAnswersNothing ? "no SYN-ACK" : "no kHello")
                        << ": " << s;
  }
}

TEST(TcpNamedHost, NoServerOnAnyAddressNamesEachAttempt) {
  NameTwoAddresses("::1", "127.0.0.1");
  const uint16_t port = JustFreedPort("tcp://127.0.0.1:0");
  ASSERT_NE(port, 0);
  const Status s = EchoOnce(absl::StrCat("tcp://", kName, ":", port), "none");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const std::string& tried : {absl::StrCat("[::1]:", port, ": Connection refused"),
                                   absl::StrCat("127.0.0.1:", port, ": Connection refused")}) {
    EXPECT_NE(s.message().find(tried), absl::string_view::npos) << s;
  }
  EXPECT_EQ(Count(s.message(), "No server listens there"), 1u) << "after both, once: " << s;
  EXPECT_TRUE(absl::EndsWith(s.message(), "check the address and port.")) << s;
}

// A server on the name listens on both of its addresses, on one port.
TEST(TcpNamedHost, AServerOnTheNameListensOnEachOfItsAddresses) {
  NameTwoAddresses("::1", "127.0.0.1");
  TestServer ts(absl::StrCat("tcp://", kName, ":0"));
  ASSERT_TRUE(ts.server);
  const uint16_t port = PortOf(ts.address);
  for (const std::string& at :
       {absl::StrCat("tcp://[::1]:", port), absl::StrCat("tcp://127.0.0.1:", port)}) {
    const Status s = EchoOnce(at, at);
    EXPECT_TRUE(s.ok()) << at << ": " << s;
  }
}

// Another program has the port on [::1]: the server leaves that address out
// and listens on the name's other one.
TEST(TcpNamedHost, AnAddressTheServerCannotBindIsLeftOut) {
  NameTwoAddresses("::1", "127.0.0.1");
  SilentListener taken(0);
  ASSERT_TRUE(taken.listening()) << strerror(errno);
  const std::string name = absl::StrCat("tcp://", kName, ":", taken.port());
  TestServer ts(name);
  ASSERT_TRUE(ts.server);
  EXPECT_EQ(ts.address, name);
  const std::string at = absl::StrCat("tcp://127.0.0.1:", taken.port());
  const Status s = EchoOnce(at, at);
  EXPECT_TRUE(s.ok()) << at << ": " << s;
}

// Why a server on `address` did not start; OK if it did.
Status StartOn(const std::string& address) {
  EchoService service;
  return ServerBuilder()
      .AddListeningPort(address)
      .RegisterService(&service)
      .BuildAndStart()
      .status();
}

// Why a server on kName:`port` over `scheme` did not start; OK if it did.
Status StartOnName(const std::string& scheme, uint16_t port = 0) {
  return StartOn(absl::StrCat(scheme, "://", kName, ":", port));
}

TEST(TcpNamedHost, AServerThatCanBindNoAddressNamesEachThenWhatToDo) {
  NameTwoAddresses("192.0.2.1", "198.51.100.1");
  const Status s = StartOnName("tcp");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const char* tried : {"192.0.2.1:0: Cannot assign requested address",
                            "198.51.100.1:0: Cannot assign requested address"}) {
    EXPECT_NE(s.message().find(tried), absl::string_view::npos) << s;
  }
  EXPECT_EQ(Count(s.message(), "No interface of this host has that address"), 1u) << s;
  EXPECT_TRUE(absl::EndsWith(s.message(), "or on 0.0.0.0 or [::] for all.")) << s;
}

// A name that resolves to no address (names resolve from the test's own
// /etc/hosts alone): a call to it and a server on it fail UNAVAILABLE (the
// name may resolve later), naming it and how to see what it resolves to.
void ExpectANameThatDoesNotResolveSaysWhatToTry(const std::string& scheme) {
  NameTwoAddresses("::1", "127.0.0.1");  // the file is in effect, and names another
  const std::string nowhere = "rdmarpc-no-such-name";
  const std::string target = absl::StrCat(scheme, "://", nowhere, ":5000");
  for (const Status& s : {EchoOnce(target, "none"), StartOn(target)}) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find(absl::StrCat("cannot resolve ", target, ": ")),
              absl::string_view::npos)
        << s;
    // Once in what the user prints too: the advice's payload is the transport's.
    EXPECT_EQ(Count(s.ToString(), absl::StrCat("`getent ahosts ", nowhere, "`")), 1u) << s;
  }
}

TEST(TcpNamedHost, ANameThatDoesNotResolveSaysWhatToTry) {
  ExpectANameThatDoesNotResolveSaysWhatToTry("tcp");
}

TEST(RdmaNamedHost, ANameThatDoesNotResolveSaysWhatToTry) {
  ExpectANameThatDoesNotResolveSaysWhatToTry("rdma");
}

// A server on the name has its port on both addresses: a second one there
// names each address, then says once what to do about the port.
void ExpectAPortTakenOnEachAddressSaysWhatToDoOnce(const std::string& scheme,
                                                   const std::string& first_ip,
                                                   const std::string& second_ip) {
  TestServer first(absl::StrCat(scheme, "://", kName, ":0"));
  ASSERT_TRUE(first.server);
  const uint16_t port = PortOf(first.address);
  const Status s = StartOnName(scheme, port);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const std::string& tried :
       {absl::StrCat("[", first_ip, "]:", port, ": Address already in use"),
        absl::StrCat(second_ip, ":", port, ": Address already in use")}) {
    EXPECT_NE(s.message().find(tried), absl::string_view::npos) << tried << "\n" << s;
  }
  EXPECT_EQ(Count(s.ToString(), "Another server has this port there"), 1u) << s;
  EXPECT_TRUE(absl::EndsWith(s.message(), "(port 0 picks a free one).")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "Devices: ")) << "no device's doing: " << s;
}

TEST(TcpNamedHost, APortTakenOnEachAddressSaysWhatToDoOnce) {
  NameTwoAddresses("::1", "127.0.0.1");
  ExpectAPortTakenOnEachAddressSaysWhatToDoOnce("tcp", "::1", "127.0.0.1");
}

TEST(RdmaNamedHost, APortTakenOnEachAddressSaysWhatToDoOnce) {
  std::string ip, ip6;
  ASSERT_NO_FATAL_FAILURE(NameTheInterfacesTwoAddresses(&ip, &ip6));
  ExpectAPortTakenOnEachAddressSaysWhatToDoOnce("rdma", ip6, ip);
}

// Over RDMA: the name's first address is the interface's IPv6 one, where
// no server listens (rdma_cm's connect is rejected), the second its IPv4.
TEST(RdmaNamedHost, ReachesAServerOnTheNamesSecondAddress) {
  std::string ip, ip6;
  ASSERT_NO_FATAL_FAILURE(NameTheInterfacesTwoAddresses(&ip, &ip6));
  TestServer ts("rdma://" + ip + ":0");
  ASSERT_TRUE(ts.server);
  const Status s =
      EchoOnce(absl::StrCat("rdma://", kName, ":", PortOf(ts.address)), std::string(100, 'r'));
  EXPECT_TRUE(s.ok()) << s;
}

// Over RDMA, a server on the name takes a cm_id on each of its addresses.
TEST(RdmaNamedHost, AServerOnTheNameListensOnEachOfItsAddresses) {
  std::string ip, ip6;
  ASSERT_NO_FATAL_FAILURE(NameTheInterfacesTwoAddresses(&ip, &ip6));
  TestServer ts(absl::StrCat("rdma://", kName, ":0"));
  ASSERT_TRUE(ts.server);
  const uint16_t port = PortOf(ts.address);
  for (const std::string& at :
       {absl::StrCat("rdma://[", ip6, "]:", port), absl::StrCat("rdma://", ip, ":", port)}) {
    const Status s = EchoOnce(at, at);
    EXPECT_TRUE(s.ok()) << at << ": " << s;
  }
}

// No server on either of the name's addresses: rdma_cm's connect is
// rejected on each, and the error says that both were tried, and each, then
// once the devices there are and what to try, as the error of a connect to
// one address does.
TEST(RdmaNamedHost, NoServerOnAnyAddressNamesEachAttempt) {
  std::string ip, ip6;
  ASSERT_NO_FATAL_FAILURE(NameTheInterfacesTwoAddresses(&ip, &ip6));
  const uint16_t port = JustFreedPort("rdma://" + ip + ":0");
  ASSERT_NE(port, 0);
  const Status s = EchoOnce(absl::StrCat("rdma://", kName, ":", port), "none");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const std::string& part : {absl::StrCat(kName, ":", port, ", each of its 2 addresses"),
                                  absl::StrCat("rdma://[", ip6, "]:", port, ": rejected"),
                                  absl::StrCat("rdma://", ip, ":", port, ": rejected")}) {
    EXPECT_NE(s.message().find(part), absl::string_view::npos) << part << "\n" << s;
  }
  const Status one = EchoOnce(absl::StrCat("rdma://", ip, ":", port), "none");
  EXPECT_EQ(one.code(), StatusCode::kUnavailable) << one;
  for (const Status& each : {s, one}) {
    EXPECT_EQ(Count(each.message(), "Devices: "), 1u) << each;
    EXPECT_EQ(Count(each.message(), "Try: "), 1u) << each;
    EXPECT_TRUE(absl::EndsWith(each.message(), "or use tcp:// (or auto://).")) << each;
  }
}

// Neither of the name's addresses is this machine's: the error names each,
// then once that they are not this host's, the devices there are and what
// to try.
TEST(RdmaNamedHost, AServerThatCanBindNoAddressNamesEachThenTheDevices) {
  NameTwoAddresses("192.0.2.1", "198.51.100.1");
  const Status s = StartOnName("rdma");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  for (const char* tried : {"192.0.2.1:0: ", "198.51.100.1:0: "}) {
    EXPECT_NE(s.message().find(tried), absl::string_view::npos) << s;
  }
  EXPECT_EQ(Count(s.message(), "No interface of this host has that address"), 1u) << s;
  EXPECT_EQ(Count(s.message(), "Devices: "), 1u) << s;
  EXPECT_TRUE(absl::EndsWith(s.message(), "or use tcp:// (or auto://).")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "the server listens")) << "it is the server: " << s;
}

// The name's first address is a host of the interface's IPv6 network that
// does not exist: nothing answers there, so rdma_cm's address resolution
// waits, for as long as two minutes here. The second address is asked
// beside it and serves the call.
TEST(RdmaNamedHost, AnAddressThatHangsDoesNotHoldUpTheConnect) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  const std::string ip6 = rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip.empty() || ip6.empty());
  const std::string absent = ip6.substr(0, ip6.rfind(':') + 1) + "fe";
  NameTwoAddresses(absent, ip);
  TestServer ts("rdma://" + ip + ":0");
  ASSERT_TRUE(ts.server);
  ChannelOptions options;
  options.connect_timeout = absl::Minutes(2);
  options.transport.rdma.connect_timeout_ms = 120000;
  const Status s = EchoOnce(absl::StrCat("rdma://", kName, ":", PortOf(ts.address)),
                            "past the hang", std::move(options));
  EXPECT_TRUE(s.ok()) << s;
}

// Both of the name's addresses connect, the first only after the second was
// asked beside it (its connect held past kNextAddressAfter): the second's
// connection serves the calls, and the first's, made all the same, is
// closed (both of its ends) without the channel hearing of it, as it never
// had it: the channel counts one connect, which did not fail.
TEST(RdmaNamedHost, AConnectionMadeLateBesideTheWinnerIsClosedUnseen) {
  using transport::rdma::Counters;
  using transport::rdma::FaultInjection;
  std::string ip, ip6;
  ASSERT_NO_FATAL_FAILURE(NameTheInterfacesTwoAddresses(&ip, &ip6));
  TestServer ts(absl::StrCat("rdma://", kName, ":0"));
  ASSERT_TRUE(ts.server);
  const auto before = Counters();
  auto ch = Channel::Create(absl::StrCat("rdma://", kName, ":", PortOf(ts.address)));
  ASSERT_TRUE(ch.ok()) << ch.status();
  FaultInjection::HeldConnects held;  // after the channel, whose end waits for its connect
  auto call = std::async(std::launch::async, [&] { return EchoOn(**ch, "on the second"); });
  ASSERT_TRUE(FaultInjection::WaitUntilConnectHeld(std::chrono::seconds(10)))
      << "the first address never connected";
  // The second address, asked kNextAddressAfter in, connects too: both ends
  // of both connections are open.
  const absl::Time give_up = SteadyNow() + absl::Seconds(20);
  while (Counters().connections_opened < before.connections_opened + 4 && SteadyNow() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(Counters().connections_opened, before.connections_opened + 4)
      << "the second address was not asked while the first was held";
  FaultInjection::ReleaseHeldConnects();
  const Status s = call.get();
  EXPECT_TRUE(s.ok()) << s;
  while (Counters().connections_closed < before.connections_closed + 2 && SteadyNow() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Counters().connections_closed, before.connections_closed + 2)
      << "the connection made late was not closed at both ends, or more were";
  EXPECT_EQ((*ch)->stats().connect_attempts, 1u);
  EXPECT_EQ((*ch)->stats().connect_failures, 0u);
  EXPECT_EQ(EchoOn(**ch, "and again"), Status());
}

}  // namespace
}  // namespace rdmarpc::testing
