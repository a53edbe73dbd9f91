// auto:// on a machine with RDMA still reaches peers without it: a server on
// auto:// listens on TCP too, at the port RDMA took, and an auto:// client
// connects over TCP where RDMA cannot reach the peer (no RDMA listener or
// route there), saying so once. rdma:// never falls back, and
// TransportTunables::tcp_fallback = false keeps auto:// to RDMA
// (transport/auto_transport.h). Runs in the Soft-RoCE VM, which has a device.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"
#include "tests/gate.h"
#include "transport/fallback_memory.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/testing/lose_connection.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

using transport::rdma::Counters;
using transport::rdma::FaultInjection;

// On a channel of its own.
Status Echo(const std::string& address, const std::string& data, ChannelOptions options = {}) {
  auto ch = Channel::Create(address, std::move(options));
  if (!ch.ok()) return ch.status();
  return EchoOn(**ch, data);
}

std::string Port(const std::string& address) { return address.substr(address.rfind(':') + 1); }

// A channel to `server` that connects over TCP first, as after a device
// went away (the process remembers that RDMA could not reach the server
// lately), and tries RDMA `upgrade` after.
StatusOr<std::shared_ptr<Channel>> ChannelOverTcpFirst(const TestServer& server,
                                                       absl::Duration upgrade,
                                                       ChannelOptions options = {}) {
  transport::FallbackMemory::Process().Remember(server.address, SteadyNow());
  options.transport.tcp_fallback_upgrade = upgrade;
  return Channel::Create(server.address, options);
}

class AutoFallback : public ::testing::Test {
 protected:
  void SetUp() override {
    ip_ = rdma::testing::RequireRdmaTestAddress();
    ASSERT_FALSE(ip_.empty());
  }
  std::string ip_;
};

// A server without RDMA (tcp:// here): an auto:// client's RDMA connect is
// rejected by the peer's rdma_cm (nothing listens there over RDMA), or its
// TCP question hears that TCP alone listens there, and the client connects
// over TCP, small and large calls alike, logging it once.
TEST_F(AutoFallback, AClientReachesAServerWithoutRdmaOverTcp) {
  TestServer server(absl::StrCat("tcp://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  const std::string target = absl::StrCat("auto://", ip_, ":", Port(server.address));
  ::testing::internal::CaptureStderr();
  Status small, large;
  {
    auto ch = Channel::Create(target);
    ASSERT_TRUE(ch.ok()) << ch.status();
    small = EchoOn(**ch, "small");
    large = EchoOn(**ch, std::string(4 << 20, 'L'));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(small.ok()) << small;
  EXPECT_TRUE(large.ok()) << large;
  EXPECT_EQ(server.service.started.load(), 2);  // by the server that has TCP alone
  // rdma_cm's reject usually comes first; where it takes over 200 ms (a
  // loaded machine, a sanitizer), the TCP question's kHello may end the wait.
  EXPECT_TRUE(absl::StrContains(log,
                                "cannot be reached over RDMA (RDMA_CM_EVENT_REJECTED); "
                                "auto:// connects over TCP") ||
              absl::StrContains(log,
                                "cannot be reached over RDMA (its server listens over TCP alone, "
                                "as its kHello says); auto:// connects over TCP"))
      << log;
  EXPECT_EQ(log.find("auto:// connects over TCP"), log.rfind("auto:// connects over TCP"))
      << "logged more than once for one target of one channel: " << log;
}

// A server on auto:// with RDMA takes RDMA clients, TCP clients (a machine
// without a device, whose auto:// is TCP) on the same port, and auto://
// clients over RDMA. It gives its address as auto://, which reaches it
// from either kind of client.
TEST_F(AutoFallback, AnAutoServerTakesTcpClientsOnItsPort) {
  TestServer server(absl::StrCat("auto://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  ASSERT_EQ(server.address.rfind("auto://", 0), 0u) << server.address;
  const std::string port = Port(server.address);
  const Status tcp = Echo(absl::StrCat("tcp://", ip_, ":", port), std::string(1 << 20, 'T'));
  EXPECT_TRUE(tcp.ok()) << tcp;
  const uint64_t rdma_opened = Counters().connections_opened;
  const Status rdma = Echo(absl::StrCat("rdma://", ip_, ":", port), "rdma");
  EXPECT_TRUE(rdma.ok()) << rdma;
  ::testing::internal::CaptureStderr();
  const Status automatic = Echo(absl::StrCat("auto://", ip_, ":", port), "auto");
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(automatic.ok()) << automatic;
  EXPECT_FALSE(absl::StrContains(log, "auto:// connects over TCP")) << log;
  // Both ends of the rdma:// and auto:// connections are in this process.
  EXPECT_GE(Counters().connections_opened, rdma_opened + 4);
  EXPECT_EQ(server.service.started.load(), 3);
}

// A server on the unspecified address, dialled as the address it gives, is
// reached over RDMA by auto:// and rdma:// alike, large calls included: as a
// destination 0.0.0.0 is this host, and the connect goes to its RoCE
// address (rdma_cm alone would look for a loopback path Soft-RoCE lacks).
TEST_F(AutoFallback, AServerOnTheUnspecifiedAddressIsReachedOverRdma) {
  TestServer server("auto://0.0.0.0:0");
  ASSERT_TRUE(server.server);
  ASSERT_EQ(server.address.rfind("auto://0.0.0.0:", 0), 0u) << server.address;
  const uint64_t opened = Counters().connections_opened;
  const uint64_t reads = Counters().reads;
  ::testing::internal::CaptureStderr();
  const Status automatic = Echo(server.address, std::string(100 << 10, 'a'));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(automatic.ok()) << automatic;
  EXPECT_FALSE(absl::StrContains(log, "connects over TCP")) << log;
  const Status rdma = Echo(absl::StrCat("rdma://0.0.0.0:", Port(server.address)), "r");
  EXPECT_TRUE(rdma.ok()) << rdma;
  // Both ends of both connections are in this process.
  EXPECT_GE(Counters().connections_opened, opened + 4);
  EXPECT_GE(Counters().reads, reads + 2) << "the large request and its echo went by READ";
  EXPECT_EQ(server.service.started.load(), 2);
}

// A loopback address has no RDMA path on Soft-RoCE (rdma_cm resolves its
// address to the device, then finds no route): auto:// reaches an auto://
// server there over TCP, on the port the server gives, and rdma:// fails at
// once saying why. On a device that loops back, both go over RDMA.
class AutoFallbackOnThisHost : public ::testing::TestWithParam<std::string> {};

TEST_P(AutoFallbackOnThisHost, AnAutoServerIsReachedAtTheAddressItGives) {
  ASSERT_FALSE(rdma::testing::RequireRdmaTestAddress().empty());
  const std::string host = GetParam();
  TestServer server(absl::StrCat("auto://", host, ":0"));
  ASSERT_TRUE(server.server);
  ASSERT_EQ(server.address.rfind(absl::StrCat("auto://", host, ":"), 0), 0u) << server.address;
  ::testing::internal::CaptureStderr();
  const Status automatic = Echo(server.address, std::string(100 << 10, 'a'));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(automatic.ok()) << automatic;
  const Status rdma = Echo(absl::StrCat("rdma://", host, ":", Port(server.address)), "r");
  if (rdma.ok()) {
    EXPECT_FALSE(absl::StrContains(log, "auto:// connects over TCP")) << log;
    EXPECT_EQ(server.service.started.load(), 2);
    return;
  }
  printf("%s\n%s\n", log.c_str(), rdma.ToString().c_str());
  EXPECT_EQ(rdma.code(), StatusCode::kUnavailable) << rdma;
  EXPECT_TRUE(absl::StrContains(rdma.message(), "a loopback or unspecified address")) << rdma;
  EXPECT_TRUE(absl::StrContains(log, "cannot be reached over RDMA (")) << log;
  EXPECT_TRUE(absl::StrContains(log, "auto:// connects over TCP")) << log;
  EXPECT_EQ(server.service.started.load(), 1);
}

INSTANTIATE_TEST_SUITE_P(Hosts, AutoFallbackOnThisHost, ::testing::Values("127.0.0.1", "[::1]"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param == "127.0.0.1" ? std::string("loopback4")
                                                            : std::string("loopback6");
                         });

// The TCP connections to `port` that this VM has established, both ends
// counted.
int EstablishedTcp(const std::string& port) {
  FILE* ss = popen(
      absl::StrCat("ss -Htn state established '( dport = :", port, " or sport = :", port, " )'")
          .c_str(),
      "r");
  if (ss == nullptr) return -1;
  int lines = 0;
  for (int c; (c = fgetc(ss)) != EOF;) lines += c == '\n';
  return pclose(ss) == 0 ? lines : -1;
}

// An auto:// channel that went over TCP to a server that listens over RDMA
// too (here because the process remembers that RDMA could not reach the
// target lately, as after a device went away) moves to RDMA once RDMA
// connects: the call under way ends on the TCP connection, new calls go
// by RDMA, and the TCP connection closes.
TEST_F(AutoFallback, AChannelOverTcpMovesToRdmaOnceRdmaReachesTheServer) {
  TestServer server(absl::StrCat("auto://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  const std::string port = Port(server.address);
  auto ch = ChannelOverTcpFirst(server, absl::Milliseconds(500));
  ASSERT_TRUE(ch.ok()) << ch.status();
  const std::string large(100 << 10, 'u');
  const uint64_t reads_on_tcp = Counters().reads;
  ASSERT_TRUE(EchoOn(**ch, large).ok());
  EXPECT_EQ(Counters().reads, reads_on_tcp) << "the first call went by RDMA, not over TCP";
  EXPECT_EQ(EstablishedTcp(port), 2);

  ::testing::internal::CaptureStderr();
  // Under way over TCP as the channel moves.
  ClientContext slow_ctx;
  EchoRequest slow_req;
  slow_req.set_data("slow");
  slow_req.set_sleep_ms(2000);
  EchoResponse slow_resp;
  std::promise<Status> slow_done;
  (*ch)->CallAsync(kEcho, &slow_ctx, slow_req, &slow_resp,
                   [&](Status s) { slow_done.set_value(std::move(s)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*ch)->stats().upgrades == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ((*ch)->stats().upgrades, 1u) << "the channel did not move to RDMA";
  const uint64_t reads_on_rdma = Counters().reads;
  EXPECT_TRUE(EchoOn(**ch, large).ok());
  EXPECT_GE(Counters().reads, reads_on_rdma + 1) << "a call after the move did not go by READ";
  EXPECT_EQ(EstablishedTcp(port), 2) << "the TCP connection closed under the call on it";
  const Status slow = slow_done.get_future().get();
  EXPECT_TRUE(slow.ok()) << slow;
  EXPECT_EQ(slow_resp.data(), "slow");
  const absl::Time closed_by = absl::Now() + absl::Seconds(5);
  while (EstablishedTcp(port) != 0 && absl::Now() < closed_by) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(EstablishedTcp(port), 0) << "the TCP connection outlived its last call";
  EXPECT_FALSE(transport::FallbackMemory::Process().FellBackWithin(server.address, absl::Hours(1),
                                                                   SteadyNow()))
      << "the process still remembers the target as one RDMA cannot reach";
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(absl::StrContains(
      log, absl::StrCat("rdmarpc[channel ", server.address, "]: rdma://", ip_, ":", port,
                        " reaches the server again: new calls go there, and the connection "
                        "tcp://",
                        ip_, ":", port, " closes once its 1 call has ended")))
      << log;
  EXPECT_EQ((*ch)->stats().go_aways, 0u);
  printf("%s", log.c_str());
}

// Callers see nothing of the move: calls made from several threads all
// along, over TCP, across the move and over RDMA, all succeed.
TEST_F(AutoFallback, CallsMadeAllAlongAsTheChannelMovesAllSucceed) {
  TestServer server(absl::StrCat("auto://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  auto ch = ChannelOverTcpFirst(server, absl::Milliseconds(300));
  ASSERT_TRUE(ch.ok()) << ch.status();
  std::atomic<bool> stop{false};
  std::atomic<int> ok_before{0}, ok_after{0}, failed{0};
  std::mutex mu;
  Status first_failure;
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      // Small ones by SEND, large ones by READ once on RDMA.
      const std::string data(t % 2 == 0 ? 64 : (64 << 10), 'm');
      while (!stop.load()) {
        const bool moved = (*ch)->stats().upgrades > 0;
        const Status s = EchoOn(**ch, data);
        if (s.ok()) {
          ++(moved ? ok_after : ok_before);
          continue;
        }
        ++failed;
        std::lock_guard<std::mutex> lock(mu);
        if (first_failure.ok()) first_failure = s;
      }
    });
  }
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*ch)->stats().upgrades == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  absl::SleepFor(absl::Milliseconds(500));
  stop = true;
  for (auto& c : callers) c.join();
  EXPECT_EQ((*ch)->stats().upgrades, 1u) << "the channel did not move to RDMA";
  EXPECT_EQ(failed.load(), 0) << first_failure;
  EXPECT_GT(ok_before.load(), 0);
  EXPECT_GT(ok_after.load(), 0);
  EXPECT_EQ((*ch)->stats().transparent_retries, 0u);
  printf("calls: %d over TCP, %d after the move, %d failed\n", ok_before.load(), ok_after.load(),
         failed.load());
}

// A call whose callback runs inline, on the I/O thread of the channel's TCP
// connection, and holds that thread until its gate opens: what the server
// sends on that connection meanwhile stays unread. Shared with the callback,
// which may run after the test has given up on it.
struct HeldCallback {
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  std::promise<void> entered;
  std::promise<Status> done;
  Gate gate;

  static std::shared_ptr<HeldCallback> Start(Channel& channel) {
    auto held = std::make_shared<HeldCallback>();
    held->req.set_data("held");
    channel.CallAsync(kEcho, &held->ctx, held->req, &held->resp, [held](Status s) {
      held->entered.set_value();
      held->gate.Wait();
      held->done.set_value(std::move(s));
    });
    return held;
  }
};

// Lets go of what a test held, on every way out of it: the channel's
// destructor waits for those threads.
struct LetGoOnExit {
  std::shared_ptr<HeldCallback> callback;
  ~LetGoOnExit() {
    FaultInjection::StopHoldingConnects();
    if (callback) callback->gate.Open();
  }
};

// The server begins to shut down as the channel's RDMA connection is made,
// and its GOAWAY on that connection comes before the channel takes it (the
// connect held there), while the GOAWAY on the TCP connection in use is
// still unread: the channel does not move to a connection the server has
// asked to drain. It acknowledges that GOAWAY and closes the connection, and
// the TCP connection drains in turn once its GOAWAY is read.
TEST_F(AutoFallback, AGoAwayOnTheRdmaConnectionBeforeTheChannelTakesItKeepsTheChannelOffIt) {
  TestServer server(absl::StrCat("auto://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  ChannelOptions inline_callbacks;
  inline_callbacks.callback_threads = 0;
  auto ch = ChannelOverTcpFirst(server, absl::Milliseconds(300), inline_callbacks);
  ASSERT_TRUE(ch.ok()) << ch.status();
  std::future<void> shutdown;
  LetGoOnExit let_go;
  FaultInjection::HoldNextConnect();
  ASSERT_TRUE(EchoOn(**ch, "over tcp").ok());
  let_go.callback = HeldCallback::Start(**ch);
  ASSERT_EQ(let_go.callback->entered.get_future().wait_for(std::chrono::seconds(20)),
            std::future_status::ready)
      << "the call over TCP was never answered";
  ASSERT_TRUE(FaultInjection::WaitUntilConnectHeld(std::chrono::seconds(10)))
      << "the channel never tried RDMA";
  const uint64_t closed = Counters().connections_closed;
  shutdown = std::async(std::launch::async, [&] { server.server->Shutdown(absl::Seconds(10)); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*ch)->stats().go_aways == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ((*ch)->stats().go_aways, 1u) << "no GOAWAY came on the RDMA connection";

  FaultInjection::ReleaseHeldConnects();
  const absl::Time decided_by = absl::Now() + absl::Seconds(10);
  while ((*ch)->stats().upgrades == 0 && Counters().connections_closed < closed + 2 &&
         absl::Now() < decided_by) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ((*ch)->stats().upgrades, 0u)
      << "the channel moved to a connection the server had asked to drain";
  EXPECT_GE(Counters().connections_closed, closed + 2) << "the RDMA connection was not closed";

  let_go.callback->gate.Open();
  const Status held = let_go.callback->done.get_future().get();
  EXPECT_TRUE(held.ok()) << held;
  shutdown.get();
  EXPECT_EQ((*ch)->stats().go_aways, 2u) << "the TCP connection's GOAWAY was not counted";
}

// The channel's RDMA connection is lost as soon as it is made, before the
// channel takes it (a failed post ends it: the first keepalive on the
// silent connection, of either side): the channel stays on TCP rather than
// move to a dead connection, tries RDMA again later, and moves then.
TEST_F(AutoFallback, AnRdmaConnectionLostBeforeTheChannelTakesItIsLeftAndTriedAgain) {
  TestServer server(absl::StrCat("auto://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  auto ch = ChannelOverTcpFirst(server, absl::Milliseconds(300));
  ASSERT_TRUE(ch.ok()) << ch.status();
  LetGoOnExit let_go;
  FaultInjection::HoldNextConnect();
  ASSERT_TRUE(EchoOn(**ch, "over tcp").ok());
  ASSERT_TRUE(FaultInjection::WaitUntilConnectHeld(std::chrono::seconds(10)))
      << "the channel never tried RDMA";
  ASSERT_TRUE(transport::rdma::testing::LoseTheOnlyConnection())
      << "the RDMA connection was not lost";

  FaultInjection::HoldNextConnect();  // the next try
  FaultInjection::ReleaseHeldConnects();
  EXPECT_TRUE(FaultInjection::WaitUntilConnectHeld(std::chrono::seconds(20)))
      << "the channel did not try RDMA again";
  EXPECT_EQ((*ch)->stats().upgrades, 0u) << "the channel moved to a connection already lost";
  const Status on_tcp = EchoOn(**ch, "still over tcp");
  EXPECT_TRUE(on_tcp.ok()) << on_tcp;
  FaultInjection::ReleaseHeldConnects();
  const absl::Time moved_by = absl::Now() + absl::Seconds(10);
  while ((*ch)->stats().upgrades == 0 && absl::Now() < moved_by) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ((*ch)->stats().upgrades, 1u) << "the second try did not take";
  const uint64_t reads = Counters().reads;
  const Status on_rdma = EchoOn(**ch, std::string(100 << 10, 'r'));
  EXPECT_TRUE(on_rdma.ok()) << on_rdma;
  EXPECT_GE(Counters().reads, reads + 1) << "the call after the move did not go by READ";
}

// rdma:// means RDMA: no fallback to the TCP server, and the error says why.
// tcp_fallback = false keeps auto:// to RDMA as well.
TEST_F(AutoFallback, RdmaAddressesAndAForbiddenFallbackStayOnRdma) {
  TestServer server(absl::StrCat("tcp://", ip_, ":0"));
  ASSERT_TRUE(server.server);
  const std::string port = Port(server.address);
  const Status rdma = Echo(absl::StrCat("rdma://", ip_, ":", port), "x");
  EXPECT_EQ(rdma.code(), StatusCode::kUnavailable) << rdma;
  EXPECT_TRUE(absl::StrContains(rdma.message(), "no rdmarpc server listens there")) << rdma;
  ChannelOptions no_fallback;
  no_fallback.transport.tcp_fallback = false;
  const Status automatic = Echo(absl::StrCat("auto://", ip_, ":", port), "x", no_fallback);
  EXPECT_EQ(automatic.code(), StatusCode::kUnavailable) << automatic;
  EXPECT_EQ(server.service.started.load(), 0);
  // Nor does such a server listen on TCP.
  EchoService service;
  transport::TransportTunables rdma_only;
  rdma_only.tcp_fallback = false;
  auto rdma_server = ServerBuilder()
                         .AddListeningPort(absl::StrCat("auto://", ip_, ":0"))
                         .RegisterService(&service)
                         .SetTransportTunables(rdma_only)
                         .BuildAndStart();
  ASSERT_TRUE(rdma_server.ok()) << rdma_server.status();
  const Status tcp =
      Echo(absl::StrCat("tcp://", ip_, ":", Port((*rdma_server)->addresses()[0])), "x");
  EXPECT_EQ(tcp.code(), StatusCode::kUnavailable) << tcp;
}

}  // namespace
}  // namespace rdmarpc::testing
