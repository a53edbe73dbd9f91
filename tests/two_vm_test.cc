// Client and server on two machines (two Soft-RoCE VMs on a virtual wire, run
// by tools/vm/run.sh --vms 2): the same binary runs in both, with
// RDMARPC_VM_ROLE telling it which side it is. The tests run in order on both
// sides, each on its own port.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"
#include "transport/tcp/tcp_counters.h"

namespace rdmarpc {
namespace {

constexpr int kPort = 7471;
constexpr int kSmallCalls = 200;
constexpr int kLargeCalls = 4;
constexpr size_t kLarge = 3 << 20;

class CountingEcho : public examples::Echo::Service {
 public:
  Status Say(ServerContext*, const examples::EchoRequest* req,
             examples::EchoResponse* resp) override {
    resp->set_payload(req->payload());
    resp->set_server_calls(++calls);
    return Status();
  }
  std::atomic<uint64_t> calls{0};
};

// The server VM may still be booting, or its server not listening yet:
// retries until it answers, for up to two minutes.
Status CallUntilAnswered(examples::Echo::Stub& stub) {
  examples::EchoRequest req;
  examples::EchoResponse resp;
  req.set_payload("hello");
  Status s;
  const absl::Time until = absl::Now() + absl::Seconds(120);
  do {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(10));
    s = stub.Say(&ctx, req, &resp);
    if (!s.ok()) absl::SleepFor(absl::Milliseconds(500));
  } while (!s.ok() && absl::Now() < until);
  return s;
}

void RunServer(const std::string& address) {
  CountingEcho service;
  auto server = ServerBuilder().AddListeningPort(address).RegisterService(&service).BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Time until = absl::Now() + absl::Seconds(240);
  while (service.calls.load() < kSmallCalls + kLargeCalls && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Seconds(2));  // let the last responses (and READs) finish
  (*server)->Shutdown(absl::Seconds(5));
  EXPECT_EQ(service.calls.load(), static_cast<uint64_t>(kSmallCalls + kLargeCalls));
  printf("server counters: %s\n", transport::rdma::Counters().ToString().c_str());
}

void RunClient(const std::string& address) {
  const uint64_t reads_before = transport::rdma::Counters().reads;
  auto channel = Channel::Create(address);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = examples::Echo::NewStub(*channel);
  examples::EchoRequest req;
  examples::EchoResponse resp;
  Status s = CallUntilAnswered(*stub);
  ASSERT_TRUE(s.ok()) << "server never answered: " << s;
  for (int i = 1; i < kSmallCalls; ++i) {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    req.set_payload("small-" + std::to_string(i));
    ASSERT_TRUE(stub->Say(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.payload(), req.payload());
  }
  for (int i = 0; i < kLargeCalls; ++i) {
    std::string big(kLarge, '\0');
    for (size_t k = 0; k < big.size(); ++k) big[k] = static_cast<char>((k * 7 + i) & 0xff);
    req.set_payload(big);
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(60));
    Status st = stub->Say(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(resp.payload(), big) << "large payload " << i << " came back different";
  }
  const transport::rdma::RdmaCounters counters = transport::rdma::Counters();
  printf("client counters: %s\n", counters.ToString().c_str());
  EXPECT_GE(counters.reads - reads_before, static_cast<uint64_t>(kLargeCalls))
      << "large responses go by READ";
}

// The echo test in whichever role this VM has, the server listening on
// `self` and the client calling `peer` (hosts, IPv6 in brackets) on `port`.
void RunEcho(const std::string& self, const std::string& peer, int port) {
  const std::string port_part = ":" + std::to_string(port);
  const std::string role = rdma::testing::Role();
  if (role == "server") {
    RunServer("rdma://" + self + port_part);
  } else {
    ASSERT_EQ(role, "client") << "run under tools/vm/run.sh --vms 2 (make test does)";
    RunClient("rdma://" + peer + port_part);
  }
}

TEST(TwoVms, EchoAcrossTheWire) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  RunEcho(ip, rdma::testing::PeerAddress(), kPort);
}

// The same over IPv6: each side's GID for its fd77:: address, and the
// neighbour discovery that RoCE v2 over IPv6 needs on the wire.
TEST(TwoVms, EchoAcrossTheWireOverIpv6) {
  const std::string ip6 = rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip6.empty());
  const std::string peer6 = rdma::testing::PeerAddress6();
  ASSERT_FALSE(peer6.empty()) << "RDMARPC_PEER_ADDR6 is not set: run under tools/vm/run.sh --vms 2";
  RunEcho("[" + ip6 + "]", "[" + peer6 + "]", kPort + 3);
}

// A host of the wire's network that is down: no ARP answer comes, and
// rdma_cm's own clock (RdmaOptions::connect_timeout_ms) runs out before the
// channel's. The call ends UNAVAILABLE saying what to check once, as when
// the channel's clock runs out first (transport_tests/failures.cc), before
// what the devices here are. The server VM has nothing to do.
TEST(TwoVms, ACallToAHostThatIsDownSaysWhatToCheck) {
  if (rdma::testing::Role() == "server") return;
  const std::string silent = rdma::testing::SilentTestNetworkHost();
  ASSERT_FALSE(silent.empty());
  ChannelOptions options;
  options.connect_timeout = absl::Seconds(20);
  options.transport.rdma.connect_timeout_ms = 300;
  const std::string target = absl::StrCat("rdma://", silent, ":", kPort);
  auto channel = Channel::Create(target, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = examples::Echo::NewStub(*channel);
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  examples::EchoRequest req;
  examples::EchoResponse resp;
  const Status s = stub->Say(&ctx, req, &resp);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  const std::string message(s.message());
  EXPECT_NE(message.find(absl::StrCat("rdma_cm could not connect to ", target)), std::string::npos)
      << s;
  EXPECT_NE(message.find("Connection timed out"), std::string::npos) << s;
  const size_t advice = message.find("Nothing answered in time: ");
  EXPECT_NE(advice, std::string::npos) << s;
  EXPECT_EQ(message.find("Nothing answered in time: ", advice + 1), std::string::npos) << s;
  EXPECT_GT(message.find("Devices: "), advice) << s;
}

// Takes the interface that carries `ip` down or up. Down, this machine is
// gone as far as its peer can tell: no disconnect, no acknowledgement, no
// answer to ARP. ""; or what failed.
std::string SetInterfaceUp(const std::string& ip, bool up) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return std::string("getifaddrs: ") + strerror(errno);
  std::string name;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
    if (ip == text) name = a->ifa_name;
  }
  freeifaddrs(list);
  if (name.empty() || name.size() >= IFNAMSIZ) return "no interface has " + ip;
  const int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::string("socket: ") + strerror(errno);
  ifreq req{};
  memcpy(req.ifr_name, name.c_str(), name.size());
  std::string error;
  if (ioctl(fd, SIOCGIFFLAGS, &req) != 0) {
    error = "SIOCGIFFLAGS " + name + ": " + strerror(errno);
  } else {
    req.ifr_flags = up ? (req.ifr_flags | IFF_UP) : (req.ifr_flags & ~IFF_UP);
    if (ioctl(fd, SIOCSIFFLAGS, &req) != 0) error = "SIOCSIFFLAGS " + name + ": " + strerror(errno);
  }
  close(fd);
  return error;
}

// Long enough for the client's keepalive (1 s of silence, then ~2 s of
// unacknowledged retries: the default RdmaOptions and TcpOptions) with
// the VMs' slowness; a call that ended only after the wire came back would
// prove nothing.
constexpr absl::Duration kCutFor = absl::Seconds(12);

// Answers "cut" by taking its own wire down for kCutFor, then up again.
class WireCutter : public examples::Echo::Service {
 public:
  explicit WireCutter(std::string ip) : ip_(std::move(ip)) {}
  Status Say(ServerContext*, const examples::EchoRequest* req,
             examples::EchoResponse* resp) override {
    if (req->payload() != "cut") {
      resp->set_payload(req->payload());
      return Status();
    }
    // The request's acknowledgment may be delayed (up to 200 ms on Linux):
    // once it is out, the client has nothing in flight, and the cut tests
    // its keepalive.
    absl::SleepFor(absl::Milliseconds(500));
    std::string error = SetInterfaceUp(ip_, false);
    if (error.empty()) {
      absl::SleepFor(kCutFor);
      error = SetInterfaceUp(ip_, true);
    }
    if (!error.empty()) return Status(StatusCode::kInternal, error);
    cuts.fetch_add(1);
    return Status();
  }
  std::atomic<uint64_t> cuts{0};

 private:
  const std::string ip_;
};

void RunCutServer(const std::string& address, const std::string& ip) {
  WireCutter service(ip);
  auto server = ServerBuilder().AddListeningPort(address).RegisterService(&service).BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Time until = absl::Now() + absl::Seconds(240);
  while (service.cuts.load() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  (*server)->Shutdown(absl::Seconds(5));
  EXPECT_EQ(service.cuts.load(), 1u) << "the client never asked for the cut";
}

// `why`: words the transport's error must hold, such as what noticed. With
// `send_into_the_cut`, a large call goes out once the wire is down, so
// that the connection has data in flight rather than nothing to say.
void RunCutClient(const std::string& address, const std::vector<std::string>& why,
                  bool send_into_the_cut) {
  auto channel = Channel::Create(address);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = examples::Echo::NewStub(*channel);
  Status s = CallUntilAnswered(*stub);
  ASSERT_TRUE(s.ok()) << "server never answered: " << s;
  const uint64_t tcp_timeouts_before = transport::tcp::Counters().peer_timeouts;

  // No deadlines: only the transport can end these calls.
  const auto call = [&stub](const std::string& payload) {
    ClientContext ctx;
    examples::EchoRequest req;
    examples::EchoResponse resp;
    req.set_payload(payload);
    return stub->Say(&ctx, req, &resp);
  };
  const absl::Time started = absl::Now();
  std::future<Status> cut = std::async(std::launch::async, call, "cut");
  std::vector<Status> ended;
  if (send_into_the_cut) {
    absl::SleepFor(absl::Seconds(2));  // the server takes its wire down 0.5 s into "cut"
    ended.push_back(call(std::string(4 << 20, 'x')));
  }
  ended.push_back(cut.get());
  const absl::Duration took = absl::Now() - started;
  for (const Status& s : ended) {
    printf("call across the cut wire ended after %s: %s\n", absl::FormatDuration(took).c_str(),
           s.ToString().c_str());
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find(address), std::string::npos)
        << "the error does not name the server: " << s;
    for (const std::string& word : why) EXPECT_NE(s.message().find(word), std::string::npos) << s;
  }
  EXPECT_LT(took, kCutFor) << "not noticed while the wire was down";
  // Over TCP the one connection's end was the peer watch's verdict.
  const bool over_tcp = address.rfind("tcp://", 0) == 0;
  EXPECT_EQ(transport::tcp::Counters().peer_timeouts - tcp_timeouts_before, over_tcp ? 1u : 0u);
}

// The cut-wire test over `scheme` on `port`, in whichever role this VM has;
// `why` and `send_into_the_cut` as for RunCutClient.
void RunWireCut(const std::string& scheme, int port, const std::vector<std::string>& why,
                bool send_into_the_cut = false) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  const std::string port_part = ":" + std::to_string(port);
  if (rdma::testing::Role() == "server") {
    RunCutServer(scheme + "://" + ip + port_part, ip);
  } else {
    RunCutClient(scheme + "://" + rdma::testing::PeerAddress() + port_part, why, send_into_the_cut);
  }
}

// The server's machine drops off the wire (no disconnect, no more
// acknowledgements) while a call without a deadline waits for it: the
// client's keepalive ends the call UNAVAILABLE, naming the server (and over
// RDMA our device, port and GID), before the wire is back. Over TCP (the
// fallback) first, then over RDMA.
TEST(TwoVms, CallWithoutDeadlineEndsWhenTheServersWireIsCutTcp) {
  RunWireCut("tcp", kPort + 1, {"TcpOptions::peer_timeout_ms", "a keepalive or window probe"});
}

// The same with a large request sent into the cut: its bytes stay
// unacknowledged, so no keepalive goes out; the peer watch ends both calls.
TEST(TwoVms, CallsEndWhenTheServersWireIsCutUnderThemTcp) {
  RunWireCut("tcp", kPort + 4, {"TcpOptions::peer_timeout_ms", "data sent to it waited"},
             /*send_into_the_cut=*/true);
}

// Last in this file, and recovery is not asserted: after this test, on
// Soft-RoCE (Debian 12's Linux 6.1), no rdma_cm connection between the two
// VMs succeeds any more, in either direction and for any process (fresh
// rping pairs time out as well; within one VM the CM still answers), although
// our listener is in LISTEN, QP1 in RTS, GIDs and neighbours are in place
// and the REQs reach the server VM's UDP layer. A flap alone does not do it
// (the TCP test before this one flaps the same link, and rping traffic
// across the same 12 s flap recovers): it follows QPs failing while the link
// is down.
TEST(TwoVms, CallWithoutDeadlineEndsWhenTheServersWireIsCutRdma) {
  RunWireCut("rdma", kPort + 2, {"keepalive", "; our end: device ", " gid_index "});
}

}  // namespace
}  // namespace rdmarpc
