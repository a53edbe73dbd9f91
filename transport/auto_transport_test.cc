#include "transport/auto_transport.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "gtest/gtest.h"
#include "transport/attempt_errors.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::transport {
namespace {

// A transport that answers from a script and records what it was asked.
class ScriptedTransport : public Transport {
 public:
  struct Listening : Listener {
    Listening(Address a, std::atomic<int>* shared) : addr(std::move(a)), shared(shared) {}
    const Address& address() const override { return addr; }
    void SharePortWithRdma() override { ++*shared; }
    Address addr;
    std::atomic<int>* shared;
  };

  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Address& addr, ConnectionObserver*,
                                                      absl::Time deadline) override {
    connects.push_back(addr.ToString());
    deadlines.push_back(deadline);
    absl::Status s = connect_results.front();
    connect_results.pop_front();
    if (s.ok()) return std::shared_ptr<Connection>();  // a null connection stands for one
    return s;
  }
  // With `silent`, as RDMA to a host without it: no answer, until the
  // deadline or until given up.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectUnless(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) override {
    if (!silent) return Connect(addr, observer, deadline);
    connects.push_back(addr.ToString());
    while (SteadyNow() < deadline) {
      if (give_up.load()) {
        ++given_up;
        return absl::CancelledError("given up early");
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::DeadlineExceededError("timed out");
  }
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Address& addr, AcceptCallback) override {
    listens.push_back(addr.ToString());
    absl::Status s = listen_results.front();
    listen_results.pop_front();
    if (!s.ok()) return s;
    Address bound = addr;
    if (bound.port == 0) bound.port = next_port++;
    if (!bound_host.empty()) bound.host = bound_host;
    return std::unique_ptr<Listener>(new Listening(bound, &shared_ports));
  }
  void Shutdown() override { ++shutdowns; }

  std::deque<absl::Status> connect_results;
  std::deque<absl::Status> listen_results;
  std::vector<std::string> connects;
  std::vector<absl::Time> deadlines;
  std::vector<std::string> listens;
  uint16_t next_port = 4000;
  std::string bound_host;  // as a listener on a host name reports its first address
  int shutdowns = 0;
  std::atomic<int> shared_ports{0};  // SharePortWithRdma calls on its listeners
  bool silent = false;
  int given_up = 0;
};

absl::Status NotReachable(const char* why) {
  absl::Status s = absl::UnavailableError(why);
  s.SetPayload(kNotReachableThisWay, absl::Cord("RDMA_CM_EVENT_REJECTED"));
  return s;
}

// An AutoTransport over two scripted ones; `tcp` is handed over when the
// AutoTransport first needs it. Its fallback memory is its own unless one
// is given, so that no test sees another's.
struct Pair {
  explicit Pair(absl::Duration remember = absl::Seconds(60), FallbackMemory* memory = nullptr)
      : t(
            std::unique_ptr<Transport>(rdma), nullptr,
            [this] { return std::unique_ptr<Transport>(tcp_owned.release()); }, "test", remember,
            memory != nullptr ? memory : &own_memory) {}

  FallbackMemory own_memory;
  std::unique_ptr<ScriptedTransport> tcp_owned = std::make_unique<ScriptedTransport>();
  ScriptedTransport* tcp = tcp_owned.get();
  ScriptedTransport* rdma = new ScriptedTransport;
  AutoTransport t;
};

Address At(const std::string& text) { return *ParseAddress(text); }

// A connection that is only its peer's name and what the server's kHello
// said.
class PeerOnly : public Connection {
 public:
  PeerOnly(std::string peer, bool server_tcp_alone)
      : peer_(std::move(peer)), server_tcp_alone_(server_tcp_alone) {}
  absl::Status Send(OutboundMessage&&) override { return absl::OkStatus(); }
  absl::StatusOr<Buffer> AllocatePayload(size_t) override {
    return absl::UnimplementedError("no memory here");
  }
  void Close() override {}
  bool Delivered() override { return true; }
  const std::string& peer() const override { return peer_; }
  bool ServerTcpAlone() const override { return server_tcp_alone_; }

 private:
  const std::string peer_;
  const bool server_tcp_alone_;
};

TEST(AutoTransport, FallsBackToTcpOnlyForAutoAddressesRdmaCannotReach) {
  Pair p(absl::ZeroDuration());  // each connect asks RDMA first
  p.rdma->connect_results = {NotReachable("no listener"), NotReachable("no listener"),
                             absl::UnavailableError("the server refused")};
  p.tcp->connect_results = {absl::OkStatus()};
  EXPECT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  EXPECT_EQ(p.tcp->connects, std::vector<std::string>{"tcp://10.0.0.2:7"});
  // rdma:// means RDMA, and a refusal is no reason to try TCP.
  EXPECT_FALSE(p.t.Connect(At("rdma://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  EXPECT_FALSE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  EXPECT_EQ(p.tcp->connects.size(), 1u);
  EXPECT_EQ(p.rdma->connects.size(), 3u);
}

// A host without RDMA drops rdma_cm's packets: RDMA gets half the time
// left, and TCP the rest. rdma:// gets it all.
TEST(AutoTransport, RdmaThatDoesNotAnswerInHalfTheTimeFallsBack) {
  Pair p;
  p.rdma->connect_results = {absl::DeadlineExceededError("timed out"), absl::OkStatus()};
  p.tcp->connect_results = {absl::OkStatus()};
  const absl::Time start = SteadyNow();
  const absl::Time deadline = start + absl::Seconds(10);
  EXPECT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  ASSERT_EQ(p.tcp->deadlines.size(), 1u);
  EXPECT_EQ(p.tcp->deadlines[0], deadline);
  EXPECT_GE(p.rdma->deadlines[0], start + absl::Seconds(5));
  EXPECT_LE(p.rdma->deadlines[0], SteadyNow() + absl::Seconds(5));
  EXPECT_TRUE(p.t.Connect(At("rdma://10.0.0.2:7"), nullptr, deadline).ok());
  EXPECT_EQ(p.rdma->deadlines[1], deadline);
}

// Once TCP has reached a target RDMA could not, the next connections to it,
// by any AutoTransport of the process, go over TCP straight away, with the
// whole deadline, rather than wait for RDMA again.
TEST(AutoTransport, ATargetReachedOverTcpIsConnectedOverTcpStraightAway) {
  FallbackMemory memory;
  Pair first(absl::Seconds(60), &memory);
  first.rdma->connect_results = {absl::DeadlineExceededError("timed out")};
  first.tcp->connect_results = {absl::OkStatus(), absl::OkStatus()};
  const absl::Time deadline = SteadyNow() + absl::Seconds(10);
  ASSERT_TRUE(first.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  ASSERT_TRUE(first.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  EXPECT_EQ(first.rdma->connects.size(), 1u);
  EXPECT_EQ(first.tcp->deadlines, (std::vector<absl::Time>{deadline, deadline}));

  Pair second(absl::Seconds(60), &memory);
  second.tcp->connect_results = {absl::OkStatus()};
  ASSERT_TRUE(second.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  EXPECT_TRUE(second.rdma->connects.empty());
  // Another port is another target, and rdma:// is never diverted.
  second.rdma->connect_results = {absl::OkStatus(), absl::OkStatus()};
  ASSERT_TRUE(second.t.Connect(At("auto://10.0.0.2:8"), nullptr, deadline).ok());
  ASSERT_TRUE(second.t.Connect(At("rdma://10.0.0.2:7"), nullptr, deadline).ok());
  EXPECT_EQ(second.rdma->connects,
            (std::vector<std::string>{"auto://10.0.0.2:8", "rdma://10.0.0.2:7"}));
}

TEST(AutoTransport, WithoutMemoryEveryConnectionTriesRdmaFirst) {
  Pair p(absl::ZeroDuration());
  p.rdma->connect_results = {NotReachable("no listener"), NotReachable("no listener")};
  p.tcp->connect_results = {absl::OkStatus(), absl::OkStatus()};
  ASSERT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  ASSERT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  EXPECT_EQ(p.rdma->connects.size(), 2u);
}

// TCP failing where it had worked (the server came back over RDMA alone):
// RDMA first within the same connect, and from then on.
TEST(AutoTransport, ARememberedTargetThatTcpNoLongerReachesTriesRdma) {
  Pair p;
  p.rdma->connect_results = {NotReachable("no listener"), absl::OkStatus(), absl::OkStatus()};
  p.tcp->connect_results = {absl::OkStatus(), absl::UnavailableError("connection refused")};
  const absl::Time deadline = SteadyNow() + absl::Seconds(10);
  ASSERT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  auto conn = p.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, deadline).ok());
  EXPECT_EQ(p.rdma->connects.size(), 3u);
  EXPECT_EQ(p.tcp->connects.size(), 2u);
}

// TCP that used up the whole deadline of a remembered target says so.
TEST(AutoTransport, ARememberedTargetWhoseTcpTimesOutSaysWhy) {
  Pair p;
  p.rdma->connect_results = {NotReachable("no listener")};
  p.tcp->connect_results = {absl::OkStatus(), absl::DeadlineExceededError("timed out")};
  ASSERT_TRUE(p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture()).ok());
  auto conn = p.t.Connect(At("auto://10.0.0.2:7"), nullptr, SteadyNow());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(conn.status().message(),
            "over TCP, as RDMA could not reach auto://10.0.0.2:7 lately: timed out");
  EXPECT_EQ(p.rdma->connects.size(), 1u);
}

class IgnoringObserver : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&&) override {}
  void OnClosed(Connection&, const absl::Status&) override {}
};

// A real TCP server on this host, TCP alone on its port or beside RDMA.
struct TcpServer {
  explicit TcpServer(bool beside_rdma) : transport(TransportOptions{}) {
    auto l = transport.Listen(At("tcp://127.0.0.1:0"), [this](std::shared_ptr<Connection>) {
      ++accepted;
      return static_cast<ConnectionObserver*>(&observer);
    });
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return;
    listener = std::move(*l);
    if (beside_rdma) listener->SharePortWithRdma();
  }
  std::string Auto() const { return absl::StrCat("auto://127.0.0.1:", listener->address().port); }

  IgnoringObserver observer;
  std::atomic<int> accepted{0};
  TcpTransport transport;
  std::unique_ptr<Listener> listener;
};

// RDMA that does not answer within 200 ms is asked about over TCP: a server
// whose kHello says TCP alone listens there ends the wait (rather than half
// the connect timeout, 10 s here).
TEST(AutoTransport, AServerThatSaysTcpAloneListensEndsTheWaitForRdma) {
  TcpServer server(/*beside_rdma=*/false);
  ASSERT_TRUE(server.listener);
  Pair p(absl::ZeroDuration());
  p.rdma->silent = true;
  p.tcp->connect_results = {absl::OkStatus()};
  ::testing::internal::CaptureStderr();
  const absl::Time start = SteadyNow();
  EXPECT_TRUE(p.t.Connect(At(server.Auto()), nullptr, start + absl::Seconds(20)).ok());
  const absl::Duration took = SteadyNow() - start;
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_GE(took, absl::Milliseconds(200)) << "asked before RDMA had its head start";
  EXPECT_LT(took, absl::Seconds(5)) << "waited for RDMA regardless";
  EXPECT_EQ(p.rdma->given_up, 1);
  EXPECT_EQ(p.tcp->connects, std::vector<std::string>{absl::StrCat(
                                 "tcp://127.0.0.1:", server.listener->address().port)});
  EXPECT_TRUE(absl::StrContains(log, "its server listens over TCP alone")) << log;
}

// A TCP server beside an RDMA listener (auto://'s) says no such thing, nor
// does a port where nothing listens: RDMA keeps its half of the time.
TEST(AutoTransport, ATcpPortThatDoesNotSayTcpAloneLeavesRdmaItsTime) {
  TcpServer beside(/*beside_rdma=*/true);
  ASSERT_TRUE(beside.listener);
  TcpServer closed(/*beside_rdma=*/false);
  ASSERT_TRUE(closed.listener);
  const std::string nobody = closed.Auto();
  closed.listener.reset();
  for (const std::string& target : {beside.Auto(), nobody}) {
    SCOPED_TRACE(target);
    Pair p(absl::ZeroDuration());
    p.rdma->silent = true;
    p.tcp->connect_results = {absl::OkStatus()};
    const absl::Time start = SteadyNow();
    EXPECT_TRUE(p.t.Connect(At(target), nullptr, start + absl::Seconds(2)).ok());
    EXPECT_GE(SteadyNow() - start, absl::Seconds(1));
    EXPECT_EQ(p.rdma->given_up, 0);
    EXPECT_EQ(p.tcp->connects.size(), 1u);
  }
}

// An auto:// connection over TCP to a server that listens over RDMA too
// may go faster later; one to a server with TCP alone, one over RDMA, and
// one to a tcp:// address may not. ConnectFaster asks RDMA alone, with the
// deadline given, and once RDMA connects the target is no longer
// remembered as one RDMA cannot reach.
TEST(AutoTransport, ATcpConnectionBesideRdmaMayGoFasterOverRdmaAlone) {
  FallbackMemory memory;
  Pair p(absl::Seconds(60), &memory);
  const Address target = At("auto://10.0.0.2:7");
  EXPECT_TRUE(p.t.MayGoFaster(target, PeerOnly("tcp://10.0.0.2:7", false)));
  EXPECT_FALSE(p.t.MayGoFaster(target, PeerOnly("tcp://10.0.0.2:7", true)));
  EXPECT_FALSE(p.t.MayGoFaster(target, PeerOnly("rdma://10.0.0.2:7", false)));
  EXPECT_FALSE(p.t.MayGoFaster(At("tcp://10.0.0.2:7"), PeerOnly("tcp://10.0.0.2:7", false)));

  memory.Remember("auto://10.0.0.2:7", SteadyNow());
  p.rdma->connect_results = {NotReachable("no route"), absl::OkStatus()};
  const std::atomic<bool> give_up{false};
  const absl::Time deadline = SteadyNow() + absl::Seconds(5);
  EXPECT_FALSE(p.t.ConnectFaster(target, nullptr, deadline, give_up).ok());
  EXPECT_TRUE(memory.FellBackWithin("auto://10.0.0.2:7", absl::Seconds(60), SteadyNow()));
  EXPECT_TRUE(p.t.ConnectFaster(target, nullptr, deadline, give_up).ok());
  EXPECT_FALSE(memory.FellBackWithin("auto://10.0.0.2:7", absl::Seconds(60), SteadyNow()));
  EXPECT_EQ(p.rdma->connects, (std::vector<std::string>{"rdma://10.0.0.2:7", "rdma://10.0.0.2:7"}));
  EXPECT_EQ(p.rdma->deadlines, (std::vector<absl::Time>{deadline, deadline}));
  EXPECT_TRUE(p.tcp->connects.empty());
}

// Its owner ends a try that RDMA keeps waiting (its connection was lost,
// or it goes away).
TEST(AutoTransport, ATryOfTheFasterWayEndsOnceGivenUp) {
  Pair p;
  p.rdma->silent = true;
  const std::atomic<bool> give_up{true};
  auto conn =
      p.t.ConnectFaster(At("auto://10.0.0.2:7"), nullptr, SteadyNow() + absl::Seconds(30), give_up);
  EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
  EXPECT_EQ(p.rdma->given_up, 1);
}

// A connect given up (ConnectUnless: a channel that goes) ends whichever
// way it is trying, and tries no other: RDMA that does not answer, after
// the TCP port was asked whether TCP alone listens there, or before it
// would be (too little time for the question); and TCP, to a target that
// RDMA could not reach lately.
TEST(AutoTransport, AConnectGivenUpEndsWhicheverWayItTriesAndTriesNoOther) {
  TcpServer beside(/*beside_rdma=*/true);
  ASSERT_TRUE(beside.listener);
  {
    SCOPED_TRACE("RDMA, once the TCP port was asked");
    Pair p(absl::ZeroDuration());
    p.rdma->silent = true;
    std::atomic<bool> give_up{false};
    auto connecting = std::async(std::launch::async, [&] {
      return p.t.ConnectUnless(At(beside.Auto()), nullptr, SteadyNow() + absl::Seconds(60),
                               give_up);
    });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (beside.accepted.load() == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(beside.accepted.load(), 1) << "the TCP port was not asked";
    ASSERT_EQ(connecting.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
    give_up.store(true);
    ASSERT_EQ(connecting.wait_for(std::chrono::seconds(10)), std::future_status::ready)
        << "a connect given up went on";
    const auto conn = connecting.get();
    EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
    EXPECT_EQ(p.rdma->given_up, 1);
    EXPECT_TRUE(p.tcp->connects.empty());
  }
  {
    SCOPED_TRACE("RDMA, with too little time to ask the TCP port");
    Pair p(absl::ZeroDuration());
    p.rdma->silent = true;
    const std::atomic<bool> give_up{true};
    const auto conn = p.t.ConnectUnless(At("auto://10.0.0.2:7"), nullptr,
                                        SteadyNow() + absl::Milliseconds(300), give_up);
    EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
    EXPECT_EQ(p.rdma->given_up, 1);
    EXPECT_TRUE(p.tcp->connects.empty());
  }
  {
    SCOPED_TRACE("TCP, to a target RDMA could not reach lately");
    FallbackMemory memory;
    Pair p(absl::Seconds(60), &memory);
    memory.Remember("auto://10.0.0.2:7", SteadyNow());
    p.tcp->silent = true;
    const std::atomic<bool> give_up{true};
    const auto conn = p.t.ConnectUnless(At("auto://10.0.0.2:7"), nullptr,
                                        SteadyNow() + absl::Seconds(60), give_up);
    EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
    EXPECT_EQ(p.tcp->given_up, 1);
    EXPECT_TRUE(p.rdma->connects.empty());
  }
}

// Made where no RDMA device was usable: auto:// goes over TCP straight
// away, and the RDMA transport is made at the first need that finds a
// device, after which RDMA comes first.
struct NoDeviceYet {
  NoDeviceYet()
      : t(
            nullptr,
            [this]() -> absl::StatusOr<std::unique_ptr<Transport>> {
              ++rdma_asked;
              if (!device) return absl::UnavailableError("no usable RDMA device");
              if (not_made > 0) {
                --not_made;
                absl::Status s = absl::ResourceExhaustedError(
                    absl::StrCat("an RDMA device is usable (rxe0), but the RDMA transport cannot "
                                 "be made: no thread for the rdma_cm events (try ",
                                 rdma_asked.load(), ")"));
                s.SetPayload(kRdmaNotMade, absl::Cord());
                return s;
              }
              return std::unique_ptr<Transport>(rdma_owned.release());
            },
            [this] { return std::unique_ptr<Transport>(tcp_owned.release()); }, "test",
            absl::Seconds(60), &memory) {}

  FallbackMemory memory;
  // Atomic: an auto:// listener looks for a device on a thread of its own.
  std::atomic<bool> device{false};
  std::atomic<int> rdma_asked{0};
  // Makes of the RDMA transport, with a device, that fail as without a
  // thread for it.
  std::atomic<int> not_made{0};
  std::unique_ptr<ScriptedTransport> rdma_owned = std::make_unique<ScriptedTransport>();
  std::unique_ptr<ScriptedTransport> tcp_owned = std::make_unique<ScriptedTransport>();
  ScriptedTransport* rdma = rdma_owned.get();
  ScriptedTransport* tcp = tcp_owned.get();
  AutoTransport t;
};

TEST(AutoTransport, WithoutADeviceYetAutoGoesOverTcpAndTurnsToRdmaOnceOneIsUsable) {
  NoDeviceYet n;
  const Address target = At("auto://10.0.0.2:7");
  n.tcp->connect_results = {absl::OkStatus()};
  EXPECT_TRUE(n.t.Connect(target, nullptr, SteadyNow() + absl::Seconds(5)).ok());
  EXPECT_EQ(n.tcp->connects, std::vector<std::string>{"tcp://10.0.0.2:7"});
  // rdma:// needs a device, and says there is none.
  auto rdma_only = n.t.Connect(At("rdma://10.0.0.2:7"), nullptr, SteadyNow() + absl::Seconds(5));
  EXPECT_TRUE(absl::IsUnavailable(rdma_only.status())) << rdma_only.status();
  EXPECT_TRUE(absl::StrContains(rdma_only.status().message(), "no usable RDMA device"))
      << rdma_only.status();
  // The TCP connection may go faster; while no device is usable, a try
  // fails at once.
  EXPECT_TRUE(n.t.MayGoFaster(target, PeerOnly("tcp://10.0.0.2:7", false)));
  const std::atomic<bool> give_up{false};
  auto faster = n.t.ConnectFaster(target, nullptr, SteadyNow() + absl::Seconds(5), give_up);
  EXPECT_TRUE(absl::IsUnavailable(faster.status())) << faster.status();
  EXPECT_EQ(n.rdma_asked, 3);

  n.device = true;
  n.rdma->connect_results = {absl::OkStatus(), absl::OkStatus()};
  EXPECT_TRUE(n.t.ConnectFaster(target, nullptr, SteadyNow() + absl::Seconds(5), give_up).ok());
  EXPECT_TRUE(n.t.Connect(target, nullptr, SteadyNow() + absl::Seconds(5)).ok());
  EXPECT_EQ(n.rdma->connects, (std::vector<std::string>{"rdma://10.0.0.2:7", "auto://10.0.0.2:7"}));
  EXPECT_EQ(n.tcp->connects.size(), 1u);
  EXPECT_EQ(n.rdma_asked, 4) << "the RDMA transport was made more than once";
}

// A device usable but its RDMA transport not made (no thread or descriptor
// for it): one line says so, however many connects try again meanwhile,
// each goes over TCP, and the first try that makes it connects over RDMA.
// Before, each try said "an RDMA device is usable now" as if it were used.
TEST(AutoTransport, ADeviceWhoseTransportCannotBeMadeIsSaidOnceAndTriedAtEachConnect) {
  NoDeviceYet n;
  const Address target = At("auto://10.0.0.2:7");
  n.device = true;
  n.not_made = 3;
  n.tcp->connect_results = {absl::OkStatus(), absl::OkStatus(), absl::OkStatus()};
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(n.t.Connect(target, nullptr, SteadyNow() + absl::Seconds(5)).ok()) << i;
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(n.tcp->connects.size(), 3u);
  EXPECT_EQ(n.rdma_asked, 3);
  const std::string line =
      "rdmarpc[test]: an RDMA device is usable (rxe0), but the RDMA transport cannot be made: "
      "no thread for the rdma_cm events (try 1); auto:// goes on over TCP and tries RDMA again\n";
  EXPECT_EQ(log, line);

  n.rdma->connect_results = {absl::OkStatus()};
  EXPECT_TRUE(n.t.Connect(target, nullptr, SteadyNow() + absl::Seconds(5)).ok());
  EXPECT_EQ(n.rdma->connects, std::vector<std::string>{"auto://10.0.0.2:7"});
  EXPECT_EQ(n.tcp->connects.size(), 3u);
  EXPECT_EQ(n.rdma_asked, 4);
}

TEST(AutoTransport, WithoutADeviceYetShutDownMakesNoRdma) {
  NoDeviceYet n;
  n.t.Shutdown();
  n.device = true;
  const std::atomic<bool> give_up{false};
  auto faster =
      n.t.ConnectFaster(At("auto://10.0.0.2:7"), nullptr, SteadyNow() + absl::Seconds(5), give_up);
  EXPECT_FALSE(faster.ok());
  EXPECT_EQ(n.rdma_asked, 0);
  EXPECT_TRUE(n.rdma->connects.empty());
}

// Waits, up to 10 s, until `done`; false if it never came.
bool Within10s(const std::function<bool()>& done) {
  const absl::Time until = SteadyNow() + absl::Seconds(10);
  while (!done()) {
    if (SteadyNow() > until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// A server's auto:// listener, made where no device was usable, takes TCP
// alone (its kHello says so) and looks for a device now and then; once one
// is usable it listens over RDMA on the TCP port too, after a try that
// fails for a reason it names, and then tells its TCP clients.
TEST(AutoTransport, WithoutADeviceYetAListenerTakesTcpAloneAndAddsRdmaOnceADeviceIsUsable) {
  NoDeviceYet n;
  n.tcp->listen_results = {absl::OkStatus()};
  ::testing::internal::CaptureStderr();
  auto l = n.t.Listen(At("auto://10.0.0.1:0"), nullptr);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->address().ToString(), "auto://10.0.0.1:4000");
  EXPECT_EQ(n.tcp->listens, std::vector<std::string>{"tcp://10.0.0.1:0"});
  auto rdma_only = n.t.Listen(At("rdma://10.0.0.1:0"), nullptr);
  EXPECT_TRUE(absl::StrContains(rdma_only.status().message(), "no usable RDMA device"))
      << rdma_only.status();
  EXPECT_TRUE(Within10s([&] { return n.rdma_asked.load() >= 3; })) << "it never looked";
  EXPECT_TRUE(n.rdma->listens.empty()) << "it listened over RDMA without a device";
  EXPECT_EQ(n.tcp->shared_ports.load(), 0);

  n.rdma->listen_results = {absl::UnavailableError("port 4000 in use"), absl::OkStatus()};
  n.device = true;
  EXPECT_TRUE(Within10s([&] { return n.tcp->shared_ports.load() == 1; }))
      << "its TCP clients were never told";
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(n.rdma->listens,
            (std::vector<std::string>{"rdma://10.0.0.1:4000", "rdma://10.0.0.1:4000"}));
  EXPECT_EQ(n.tcp->listens.size(), 1u);
  EXPECT_TRUE(absl::StrContains(log,
                                "auto://10.0.0.1:4000 cannot listen over RDMA yet, though a device "
                                "is usable: port 4000 in use"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "auto://10.0.0.1:4000 listens over RDMA too now")) << log;
  EXPECT_EQ((*l)->address().ToString(), "auto://10.0.0.1:4000");
  const int asked = n.rdma_asked.load();
  l->reset();
  EXPECT_EQ(n.rdma_asked.load(), asked) << "it looked again once it listened over RDMA";
}

// A listener on a host name listens over RDMA on that name too, on the port
// TCP took, not on the one address a listener reports (the first of the
// name's).
TEST(AutoTransport, WithoutADeviceYetAListenerOnANameListensOverRdmaOnTheName) {
  NoDeviceYet n;
  n.tcp->listen_results = {absl::OkStatus()};
  n.tcp->bound_host = "10.0.0.1";
  auto l = n.t.Listen(At("auto://server.example:0"), nullptr);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->address().ToString(), "auto://10.0.0.1:4000");
  n.rdma->listen_results = {absl::OkStatus()};
  n.device = true;
  EXPECT_TRUE(Within10s([&] { return n.tcp->shared_ports.load() == 1; }))
      << "it never listened over RDMA";
  EXPECT_EQ(n.rdma->listens, std::vector<std::string>{"rdma://server.example:4000"});
}

// One destroyed before a device came stops looking at once, not at its
// next look (a second away).
TEST(AutoTransport, WithoutADeviceYetAListenerDestroyedStopsLookingAtOnce) {
  NoDeviceYet n;
  n.tcp->listen_results = {absl::OkStatus()};
  auto l = n.t.Listen(At("auto://10.0.0.1:0"), nullptr);
  ASSERT_TRUE(l.ok()) << l.status();
  const absl::Time start = SteadyNow();
  l->reset();
  EXPECT_LT(SteadyNow() - start, absl::Milliseconds(500)) << "its thread kept it waiting";
}

TEST(FallbackMemory, RemembersForTheWindowFromTheFallbackOnly) {
  FallbackMemory m;
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  EXPECT_FALSE(m.FellBackWithin("auto://h:1", absl::Seconds(60), t0));
  m.Remember("auto://h:1", t0);
  EXPECT_TRUE(m.FellBackWithin("auto://h:1", absl::Seconds(60), t0 + absl::Seconds(59)));
  EXPECT_FALSE(m.FellBackWithin("auto://h:1", absl::Seconds(60), t0 + absl::Seconds(60)));
  EXPECT_FALSE(m.FellBackWithin("auto://h:1", absl::ZeroDuration(), t0));
  EXPECT_FALSE(m.FellBackWithin("auto://h:2", absl::Seconds(60), t0));
  m.Forget("auto://h:1");
  EXPECT_FALSE(m.FellBackWithin("auto://h:1", absl::Seconds(60), t0));
}

TEST(FallbackMemory, StaysBounded) {
  FallbackMemory m;
  const absl::Time t0 = absl::UnixEpoch() + absl::Hours(1);
  for (size_t i = 0; i < FallbackMemory::kMaxTargets; ++i) {
    const std::string target = absl::StrCat("auto://h:", i);
    m.Remember(target, t0);
    EXPECT_TRUE(m.FirstMention(target));
  }
  EXPECT_TRUE(m.FellBackWithin("auto://h:0", absl::Seconds(60), t0));
  EXPECT_FALSE(m.FirstMention("auto://h:0"));
  // One more target starts the memory again, with it alone.
  m.Remember("auto://another:1", t0);
  EXPECT_FALSE(m.FellBackWithin("auto://h:0", absl::Seconds(60), t0));
  EXPECT_TRUE(m.FellBackWithin("auto://another:1", absl::Seconds(60), t0));
  EXPECT_TRUE(m.FirstMention("auto://another:1"));
  EXPECT_TRUE(m.FirstMention("auto://h:0"));
}

TEST(AutoTransport, AFailedFallbackSaysWhatBothWaysDid) {
  Pair p;
  p.rdma->connect_results = {NotReachable("no RDMA listener")};
  p.tcp->connect_results = {absl::UnavailableError("connection refused")};
  auto conn = p.t.Connect(At("auto://10.0.0.2:7"), nullptr, absl::InfiniteFuture());
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(conn.status().message(),
            "over RDMA: no RDMA listener; then over TCP: connection refused");
}

// A host that is down answers neither way: what to check is said once,
// after both, whichever clock ran out on the RDMA side. Advice that only
// one way's failure has stays with it.
TEST(AutoTransport, AFallbackNothingAnsweredEitherWaySaysWhatToCheckOnce) {
  const std::string rdma_failed = "connecting to rdma://10.0.0.2:7 timed out";
  const std::string tcp_failed = "connect to tcp://10.0.0.2:7: timed out";
  Pair p;
  p.rdma->connect_results = {NothingAnswered(absl::DeadlineExceededError(rdma_failed))};
  p.tcp->connect_results = {NothingAnswered(absl::UnavailableError(tcp_failed))};
  auto conn = p.t.Connect(At("auto://10.0.0.2:7"), nullptr, SteadyNow() + absl::Seconds(10));
  ASSERT_FALSE(conn.ok());
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  const std::string advice(*NothingAnswered(absl::UnknownError("")).GetPayload(kWhatToDo));
  EXPECT_EQ(
      std::string(conn.status().message()),
      absl::StrCat("over RDMA: ", rdma_failed, "; then over TCP: ", tcp_failed, ". ", advice));

  // rdma_cm's own clock: its failure ends with the devices too.
  const std::string cm_failed = "rdma_cm could not connect (RDMA_CM_EVENT_ADDR_ERROR)";
  Pair other(absl::ZeroDuration());
  other.rdma->connect_results = {
      WithWhatToDo(NothingAnswered(NotReachable(cm_failed.c_str())), "Devices: rxe0 (a test's)."),
      WithWhatToDo(NotReachable("no route"), "Devices: rxe0 (a test's)."),
      NothingAnswered(absl::DeadlineExceededError(rdma_failed))};
  other.tcp->connect_results = {
      NothingAnswered(absl::UnavailableError(tcp_failed)),
      WithWhatToDo(absl::UnavailableError("Connection refused"), "No server listens there."),
      absl::UnavailableError("Connection refused")};
  for (const std::string& said :
       {absl::StrCat("over RDMA: ", cm_failed,
                     ". Devices: rxe0 (a test's).; then over TCP: ", tcp_failed, ". ", advice),
        std::string("over RDMA: no route. Devices: rxe0 (a test's).; then over TCP: Connection "
                    "refused. No server listens there."),
        absl::StrCat("over RDMA: ", rdma_failed, ". ", advice,
                     "; then over TCP: Connection refused")}) {
    conn = other.t.Connect(At("auto://10.0.0.2:7"), nullptr, SteadyNow() + absl::Seconds(10));
    ASSERT_FALSE(conn.ok());
    EXPECT_EQ(std::string(conn.status().message()), said);
  }
}

TEST(AutoTransport, ListensOverBothOnThePortRdmaTook) {
  Pair p;
  p.rdma->listen_results = {absl::OkStatus()};
  p.tcp->listen_results = {absl::OkStatus()};
  auto l = p.t.Listen(At("auto://10.0.0.1:0"), nullptr);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->address().ToString(), "auto://10.0.0.1:4000");
  EXPECT_EQ(p.tcp->listens, std::vector<std::string>{"tcp://10.0.0.1:4000"});
  // rdma:// listens over RDMA alone, and says so.
  p.rdma->listen_results = {absl::OkStatus()};
  auto rdma_only = p.t.Listen(At("rdma://10.0.0.1:0"), nullptr);
  ASSERT_TRUE(rdma_only.ok()) << rdma_only.status();
  EXPECT_EQ((*rdma_only)->address().ToString(), "rdma://10.0.0.1:4001");
  EXPECT_EQ(p.tcp->listens.size(), 1u);
}

// Port 0: RDMA's ephemeral port may be a TCP port in use; the pair is made
// again on another. A port asked for that TCP cannot take is an error.
TEST(AutoTransport, AnEphemeralPortTakenOverTcpIsChosenAgain) {
  Pair p;
  p.rdma->listen_results = {absl::OkStatus(), absl::OkStatus()};
  p.tcp->listen_results = {absl::UnavailableError("Address already in use"), absl::OkStatus()};
  auto l = p.t.Listen(At("auto://10.0.0.1:0"), nullptr);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->address().ToString(), "auto://10.0.0.1:4001");
  EXPECT_EQ(p.tcp->listens,
            (std::vector<std::string>{"tcp://10.0.0.1:4000", "tcp://10.0.0.1:4001"}));

  p.rdma->listen_results = {absl::OkStatus()};
  p.tcp->listen_results = {absl::UnavailableError("Address already in use")};
  auto fixed = p.t.Listen(At("auto://10.0.0.1:7471"), nullptr);
  ASSERT_FALSE(fixed.ok());
  EXPECT_TRUE(absl::StrContains(fixed.status().message(), "TCP could not take it"))
      << fixed.status();
  EXPECT_TRUE(absl::StrContains(fixed.status().message(), "Address already in use"))
      << fixed.status();
}

TEST(AutoTransport, ShutsDownBoth) {
  Pair p;
  p.rdma->listen_results = {absl::OkStatus()};
  p.tcp->listen_results = {absl::OkStatus()};
  ASSERT_TRUE(p.t.Listen(At("auto://10.0.0.1:0"), nullptr).ok());
  p.t.Shutdown();
  EXPECT_EQ(p.rdma->shutdowns, 1);
  EXPECT_EQ(p.tcp->shutdowns, 1);
}

}  // namespace
}  // namespace rdmarpc::transport
