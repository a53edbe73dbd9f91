// The server's side of a call's life: shutdown and its drain, the health
// service, call limits, a successor taking over, and restarts under load
// (see rpc_suite.h).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/echo.rdmarpc.pb.h"
#include "proto/health.rdmarpc.pb.h"
#include "proto/reflection.rdmarpc.pb.h"
#include "proto/stats.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/health.h"
#include "rpc/server.h"
#include "rpc/service.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"

namespace rdmarpc::testing {
namespace {

using test::EchoRequest;
using test::EchoResponse;

TEST_P(RpcSuite, ShutdownDrainsThenCancelsInFlightCalls) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  auto ch = MakeChannel(ts->address);
  constexpr int kQuick = 20, kSlow = 20;
  auto calls =
      StartCalls(*ch, kEcho, kQuick + kSlow, [](int i) { return i < kQuick ? 50 : 60000; });
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ts->service.started.load() < 4 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  ts->server->Shutdown(absl::Seconds(2));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15)) << "shutdown exceeded its bound";
  int ok = 0, ended = 0;
  for (auto& c : calls) {
    auto f = c->result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    const Status s = f.get();
    ++ended;
    if (s.ok()) {
      ++ok;
    } else {
      EXPECT_TRUE(s.code() == StatusCode::kCancelled || s.code() == StatusCode::kUnavailable) << s;
    }
  }
  EXPECT_EQ(ended, kQuick + kSlow);
  EXPECT_GE(ok, 4) << "calls running at shutdown should drain within the grace period";
  EXPECT_LE(ok, kQuick) << "slow calls cannot have finished";
}

// Shutdown reaches calls whose inline handlers went asynchronous: they are
// cancelled, answered, and their handlers told.
TEST_P(RpcSuite, ShutdownCancelsCallsOfInlineHandlersFinishingLater) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr(), 64u << 20, /*workers=*/0);
  ASSERT_TRUE(ts->server);
  auto ch = MakeChannel(ts->address);
  constexpr int kCalls = 10;
  auto calls = StartCalls(*ch, kEchoLater, kCalls, [](int) { return 60000; });
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ts->service.started.load() < kCalls && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(ts->service.started.load(), kCalls);
  const absl::Time start = absl::Now();
  ts->server->Shutdown(absl::Milliseconds(100));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15)) << "shutdown exceeded its bound";
  for (auto& c : calls) {
    auto f = c->result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    const Status s = f.get();
    EXPECT_TRUE(s.code() == StatusCode::kCancelled || s.code() == StatusCode::kUnavailable) << s;
  }
  while (ts->service.saw_cancel.load() < kCalls && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(ts->service.saw_cancel.load(), kCalls);
}

using health::v1::HealthCheckRequest;
using health::v1::HealthCheckResponse;

// Health::Check through the generated stub: what it answers (kept in the
// response's status; an error Status for a name it does not know).
StatusOr<HealthCheckResponse::ServingStatus> CheckHealth(health::v1::Health::Stub& stub,
                                                         const std::string& service) {
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(10));
  HealthCheckRequest req;
  req.set_service(service);
  HealthCheckResponse resp;
  Status s = stub.Check(&ctx, req, &resp);
  if (!s.ok()) return s;
  return resp.status();
}

// Server::Wait, as a server binary's main thread uses it: it blocks while
// the server serves and returns once Shutdown has answered the calls in
// flight, and at once on a server already shut down.
TEST_P(RpcSuite, WaitReturnsOnceShutdownHasAnsweredTheCallsInFlight) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  auto ch = MakeChannel(ts->address);
  std::atomic<bool> returned{false};
  std::atomic<int> finished_at_return{-1};
  std::thread waiter([&] {
    ts->server->Wait();
    finished_at_return.store(ts->service.finished.load());
    returned.store(true);
  });
  EXPECT_TRUE(EchoOn(*ch, "served while Wait blocks").ok());
  auto calls = StartCalls(*ch, kEcho, 1, [](int) { return 300; });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (ts->service.started.load() < 2 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  EXPECT_FALSE(returned.load()) << "Wait returned while the server was serving";
  ts->server->Shutdown(absl::Seconds(20));
  waiter.join();
  EXPECT_EQ(finished_at_return.load(), 2) << "Wait returned before the call in flight was answered";
  auto f = calls[0]->result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_TRUE(f.get().ok());
  auto again = std::async(std::launch::async, [&] { ts->server->Wait(); });
  EXPECT_EQ(again.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "Wait on a server already shut down blocked";
}

StatusOr<std::unique_ptr<Server>> BuildWithHealth(const std::string& address, Service* service) {
  return ServerBuilder()
      .AddListeningPort(address)
      .RegisterService(service)
      .EnableHealthService()
      .BuildAndStart();
}

// The standard health service: the server ("") and each registered service
// are SERVING from the start, an unknown name is NOT_FOUND, the program
// changes and adds statuses, and HealthService::Shutdown marks everything
// NOT_SERVING for good while ordinary calls still work; once the server
// shuts down, Check is UNAVAILABLE like any other call.
TEST_P(RpcSuite, HealthServiceSaysWhatServesUntilTheServerDrains) {
  GeneratedEcho service;
  auto built = BuildWithHealth(GetParam().listen_addr(), &service);
  ASSERT_TRUE(built.ok()) << built.status();
  HealthService* health = (*built)->health();
  ASSERT_NE(health, nullptr);
  auto ch = MakeChannel((*built)->addresses()[0]);
  auto stub = health::v1::Health::NewStub(ch);
  auto echo = examples::Echo::NewStub(ch);
  const auto echo_works = [&] {
    ClientContext ctx;
    examples::EchoRequest req;
    req.set_payload("still here");
    examples::EchoResponse resp;
    return echo->Say(&ctx, req, &resp).ok() && resp.payload() == "still here";
  };
  uint64_t checks = 0;
  const auto status_of = [&](const std::string& name) {
    ++checks;
    auto s = CheckHealth(*stub, name);
    EXPECT_TRUE(s.ok()) << name << ": " << s.status();
    return s.ok() ? *s : HealthCheckResponse::UNKNOWN;
  };
  const std::string kEcho = "rdmarpc.examples.Echo";

  EXPECT_EQ(status_of(""), HealthCheckResponse::SERVING);
  EXPECT_EQ(status_of(kEcho), HealthCheckResponse::SERVING);
  auto unknown = CheckHealth(*stub, "rdmarpc.examples.Nope");
  ++checks;
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound) << unknown.status();
  EXPECT_NE(unknown.status().message().find("\"rdmarpc.examples.Nope\""), absl::string_view::npos)
      << unknown.status();

  health->SetServingStatus(kEcho, false);
  EXPECT_EQ(status_of(kEcho), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(status_of(""), HealthCheckResponse::SERVING);
  health->SetServingStatus("storage", true);
  EXPECT_EQ(status_of("storage"), HealthCheckResponse::SERVING);
  health->SetServingStatus(false);
  for (const std::string& name : {std::string(), kEcho, std::string("storage")}) {
    EXPECT_EQ(status_of(name), HealthCheckResponse::NOT_SERVING) << name;
  }
  health->SetServingStatus(true);
  EXPECT_EQ(status_of(kEcho), HealthCheckResponse::SERVING);

  health->Shutdown();
  health->SetServingStatus(true);
  health->SetServingStatus("", true);
  for (const std::string& name : {std::string(), kEcho, std::string("storage")}) {
    EXPECT_EQ(status_of(name), HealthCheckResponse::NOT_SERVING) << name << " after Shutdown";
  }
  EXPECT_TRUE(echo_works()) << "HealthService::Shutdown stopped the server's calls";
  EXPECT_EQ((*built)->MethodCallCounts()["/rdmarpc.health.v1.Health/Check"], checks);

  (*built)->Shutdown();
  EXPECT_EQ(CheckHealth(*stub, "").status().code(), StatusCode::kUnavailable);
}

// Server::Shutdown marks everything NOT_SERVING even when the program never
// told the health service, so nothing in the process reports SERVING while
// the server drains.
TEST_P(RpcSuite, ServerShutdownMarksEverythingNotServing) {
  GeneratedEcho service;
  auto built = BuildWithHealth(GetParam().listen_addr(), &service);
  ASSERT_TRUE(built.ok()) << built.status();
  HealthService* health = (*built)->health();
  ASSERT_TRUE(health->Check("rdmarpc.examples.Echo").ok());
  EXPECT_EQ(*health->Check("rdmarpc.examples.Echo"), HealthCheckResponse::SERVING);
  (*built)->Shutdown();
  for (const char* name : {"", "rdmarpc.examples.Echo"}) {
    auto s = health->Check(name);
    ASSERT_TRUE(s.ok()) << name << ": " << s.status();
    EXPECT_EQ(*s, HealthCheckResponse::NOT_SERVING) << name;
  }
}

// Without EnableHealthService there is none (UNIMPLEMENTED); a program that
// registers its own health service and enables ours is refused at build.
TEST_P(RpcSuite, HealthServiceOnlyWhenEnabledAndOnlyOnce) {
  GeneratedEcho service;
  auto plain = ServerBuilder()
                   .AddListeningPort(GetParam().listen_addr())
                   .RegisterService(&service)
                   .BuildAndStart();
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->health(), nullptr);
  auto stub = health::v1::Health::NewStub(MakeChannel((*plain)->addresses()[0]));
  EXPECT_EQ(CheckHealth(*stub, "").status().code(), StatusCode::kUnimplemented);

  HealthService own;
  auto twice = BuildWithHealth(GetParam().listen_addr(), &own);
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), StatusCode::kAlreadyExists) << twice.status();
  EXPECT_NE(twice.status().message().find("/rdmarpc.health.v1.Health/Check registered twice"),
            absl::string_view::npos)
      << twice.status();
}

// Cancels `calls`, checks that each ends CANCELLED, and waits (up to 20 s)
// until the server no longer counts them in flight.
void CancelAndAwaitRelease(std::vector<std::unique_ptr<AsyncCall>>& calls, Server& server) {
  for (auto& c : calls) c->ctx.TryCancel();
  for (auto& c : calls) {
    auto f = c->result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    EXPECT_EQ(f.get().code(), StatusCode::kCancelled);
  }
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (server.stats().calls_in_flight > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server.stats().calls_in_flight, 0u);
}

// Clients keep calling while the server restarts on the same address: every
// call ends with a status (OK, or UNAVAILABLE / CANCELLED while it is down),
// none hangs, and calls succeed again once it is back.
// With SetMaxConcurrentCalls(2), two slow calls fill the server: a third
// is refused RESOURCE_EXHAUSTED, its handler not run, while the built-in
// services (health, stats, reflection) still answer, neither counted nor
// refused; once the slow calls end, calls go through again. With workers,
// and with inline handlers that finish on threads of their own.
TEST_P(RpcSuite, CallsOverTheServersLimitAreRefusedAndBuiltInServicesAreNot) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    EchoService service;
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&service)
                     .SetWorkerThreads(workers)
                     .SetMaxConcurrentCalls(2)
                     .EnableHealthService()
                     .EnableStatsService()
                     .EnableReflectionService()
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    Server& server = **built;
    auto ch = MakeChannel(server.addresses()[0]);
    auto calls = StartCalls(*ch, workers == 0 ? kEchoLater : kEcho, 2, [](int) { return 30000; });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (service.started.load() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_EQ(service.started.load(), 2);
    EchoResponse resp;
    {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(10));
      const Status s = ch->Call(kEcho, &ctx, Req("over"), &resp);
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("2 calls in flight"), absl::string_view::npos) << s;
      EXPECT_NE(s.message().find("SetMaxConcurrentCalls"), absl::string_view::npos) << s;
    }
    EXPECT_EQ(service.started.load(), 2) << "the refused call's handler ran";
    auto health = health::v1::Health::NewStub(ch);
    auto serving = CheckHealth(*health, "");
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_EQ(*serving, HealthCheckResponse::SERVING);
    {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(10));
      stats::v1::StatsResponse stats;
      const Status s = stats::v1::Stats::NewStub(ch)->Get(&ctx, stats::v1::StatsRequest(), &stats);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(stats.calls_in_flight(), 2u);
      EXPECT_EQ(stats.refused_over_limit(), 1u);
    }
    {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(10));
      reflection::v1::DescribeResponse description;
      const Status s = reflection::v1::Reflection::NewStub(ch)->Describe(
          &ctx, reflection::v1::DescribeRequest(), &description);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_GE(description.services_size(), 3);  // health, stats, reflection
    }
    EXPECT_EQ(server.stats().refused_over_limit, 1u);
    EXPECT_EQ(server.stats().calls_in_flight, 2u);
    CancelAndAwaitRelease(calls, server);
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(10));
    const Status s = ch->Call(kEcho, &ctx, Req("after"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "after");
    EXPECT_EQ(server.stats().refused_over_limit, 1u);
  }
}

// One connection at its own limit is refused; another connection to the
// same server is served meanwhile, and the first is served again once its
// calls end.
TEST_P(RpcSuite, ACallOverItsConnectionsLimitIsRefusedWhileOtherConnectionsAreServed) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    EchoService service;
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&service)
                     .SetWorkerThreads(workers)
                     .SetMaxConcurrentCallsPerConnection(2)
                     .SetMaxConcurrentCalls(100)
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    Server& server = **built;
    auto greedy = MakeChannel(server.addresses()[0]);
    auto other = MakeChannel(server.addresses()[0]);
    auto calls =
        StartCalls(*greedy, workers == 0 ? kEchoLater : kEcho, 2, [](int) { return 30000; });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (service.started.load() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_EQ(service.started.load(), 2);
    EchoResponse resp;
    const auto call = [&](Channel& ch, const std::string& data) {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(10));
      return ch.Call(kEcho, &ctx, Req(data), &resp);
    };
    {
      const Status s = call(*greedy, "over");
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("2 of its calls in flight"), absl::string_view::npos) << s;
      EXPECT_NE(s.message().find("SetMaxConcurrentCallsPerConnection"), absl::string_view::npos)
          << s;
    }
    EXPECT_EQ(service.started.load(), 2) << "the refused call's handler ran";
    {
      const Status s = call(*other, "another connection");
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(resp.data(), "another connection");
    }
    EXPECT_EQ(server.stats().refused_over_connection_limit, 1u);
    EXPECT_EQ(server.stats().refused_over_limit, 0u);
    CancelAndAwaitRelease(calls, server);
    const Status s = call(*greedy, "after");
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "after");
    EXPECT_EQ(server.stats().refused_over_connection_limit, 1u);
  }
}

TEST(ServerBuilderTest, RefusesANegativeCallLimit) {
  for (bool per_connection : {false, true}) {
    EchoService service;
    ServerBuilder builder;
    builder.AddListeningPort("tcp://127.0.0.1:0").RegisterService(&service);
    if (per_connection) {
      builder.SetMaxConcurrentCallsPerConnection(-1);
    } else {
      builder.SetMaxConcurrentCalls(-1);
    }
    auto built = builder.BuildAndStart();
    ASSERT_FALSE(built.ok());
    EXPECT_EQ(built.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(
        built.status().message().find(per_connection ? "SetMaxConcurrentCallsPerConnection(-1)"
                                                     : "SetMaxConcurrentCalls(-1)"),
        absl::string_view::npos)
        << built.status();
  }
}

// A second server on the address a first one serves cannot start: its error
// names the address, says the port is taken and what to do, and the first
// server serves on.
TEST_P(RpcSuite, AServerOnAPortInUseFailsToStartAndTheFirstServesOn) {
  TestServer first(GetParam().listen_addr());
  ASSERT_TRUE(first.server);
  EchoService echo;
  const std::string port = first.address.substr(first.address.rfind(':'));
  const std::string asked = GetParam().listen_addr();
  const std::string again = asked.substr(0, asked.rfind(':')) + port;
  auto second = ServerBuilder().AddListeningPort(again).RegisterService(&echo).BuildAndStart();
  ASSERT_FALSE(second.ok()) << "two servers on " << again;
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status();
  for (const std::string& part :
       {port, std::string("Address already in use"),
        std::string("listen on another port (port 0 picks a free one).")}) {
    EXPECT_NE(second.status().message().find(part), absl::string_view::npos) << part << "\n"
                                                                             << second.status();
  }
  EXPECT_EQ(second.status().message().find("Devices: "), absl::string_view::npos)
      << "a port in use is not a device's fault: " << second.status();
  auto ch = MakeChannel(first.address);
  const Status s = EchoOn(*ch, "still served");
  EXPECT_TRUE(s.ok()) << s;
}

// A server that shuts down tells its clients (GOAWAY): the channel leaves
// the draining connection to the calls on it, which still end there, and a
// new call waits for a new connection, here to the server's successor,
// instead of being refused by the server that is going away.
TEST_P(RpcSuite, AServerThatShutsDownSendsNewCallsToItsSuccessor) {
  ParkService park;
  EchoService echo;
  auto first = ServerBuilder()
                   .AddListeningPort(GetParam().listen_addr())
                   .RegisterService(&park)
                   .RegisterService(&echo)
                   .BuildAndStart();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->addresses()[0];
  auto ch = MakeChannel(address);
  AsyncCall held;
  EchoRequest held_req = Req("held");
  held_req.set_tag(3);
  ch->CallAsync(ParkService::kPark, &held.ctx, held_req, &held.resp,
                [&](Status s) { held.result.set_value(s); });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (park.parked_calls.load() < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(park.parked_calls.load(), 1);
  std::thread shutdown([&] { (*first)->Shutdown(absl::Seconds(30)); });
  while (ch->stats().go_aways < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(ch->stats().go_aways, 1u);
  EXPECT_NE(ch->GetState(false), ChannelState::kReady);
  // Made while the first server drains: without its GOAWAY the call would
  // go to it and be refused.
  AsyncCall next;
  next.ctx.set_wait_for_ready(true);
  next.ctx.set_timeout(absl::Seconds(60));
  ch->CallAsync(kEcho, &next.ctx, Req("next"), &next.resp,
                [&](Status s) { next.result.set_value(s); });
  park.FinishHeld();
  auto held_f = held.result.get_future();
  ASSERT_EQ(held_f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status held_status = held_f.get();
  EXPECT_TRUE(held_status.ok()) << "the call on the draining connection: " << held_status;
  EXPECT_EQ(held.resp.data(), "held");
  shutdown.join();
  first->reset();
  TestServer second(address);
  ASSERT_TRUE(second.server);
  auto next_f = next.result.get_future();
  ASSERT_EQ(next_f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status next_status = next_f.get();
  ASSERT_TRUE(next_status.ok()) << next_status;
  EXPECT_EQ(next.resp.data(), "next");
  EXPECT_EQ(second.service.started.load(), 1);
  EXPECT_EQ(echo.started.load(), 0) << "a call went to the first server after its GOAWAY";
}

// A server that shuts down gracefully while clients keep calling loses none
// of their calls: those that crossed its GOAWAY on the wire are served (the
// server waits for the channel's acknowledgment), and the rest wait for the
// successor. Small and large requests (READ over RDMA), workers and inline
// handlers; each of several restarts races several calls.
TEST_P(RpcSuite, BusyClientsLoseNoCallThroughGracefulRestarts) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    auto ts = std::make_unique<TestServer>(GetParam().listen_addr(), 64u << 20, workers);
    ASSERT_TRUE(ts->server);
    const std::string address = ts->address;
    auto ch = MakeChannel(address);
    std::atomic<bool> stop{false};
    std::atomic<int> ok{0};
    std::vector<std::thread> clients;
    for (int t = 0; t < 4; ++t) {
      clients.emplace_back([&, t] {
        for (int i = 0; !stop.load(); ++i) {
          ClientContext ctx;
          ctx.set_wait_for_ready(true);
          ctx.set_timeout(absl::Seconds(60));
          EchoResponse resp;
          const std::string data = absl::StrCat(t, "-", i, std::string(i % 3 ? 10 : 20000, 'z'));
          const Status s = ch->Call(kEcho, &ctx, Req(data), &resp);
          if (s.ok() && resp.data() == data) {
            ok.fetch_add(1);
          } else {
            ADD_FAILURE() << "call " << t << "-" << i << ": " << s;
          }
        }
      });
    }
    const absl::Time until = absl::Now() + absl::Seconds(120);
    const auto served_more = [&](int n) {
      const int target = ok.load() + n;
      while (ok.load() < target && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
      return ok.load() >= target;
    };
    EXPECT_TRUE(served_more(50));
    constexpr int kRestarts = 3;
    for (int r = 0; r < kRestarts; ++r) {
      ts->server->Shutdown(absl::Seconds(30));
      ts.reset();
      ts = std::make_unique<TestServer>(address, 64u << 20, workers);
      ASSERT_TRUE(ts->server);
      EXPECT_TRUE(served_more(50)) << "restart " << r;
    }
    stop = true;
    for (auto& c : clients) c.join();
    EXPECT_EQ(ch->stats().go_aways, static_cast<uint64_t>(kRestarts));
  }
}

TEST_P(RpcSuite, ServerRestartUnderLoad) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  const std::string address = ts->address;
  auto ch = MakeChannel(address);
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, down{0}, other{0}, ok_after{0};
  std::atomic<bool> restarted{false};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        ClientContext ctx;
        ctx.set_timeout(absl::Seconds(10));
        EchoResponse resp;
        const std::string data = absl::StrCat(t, "-", i, std::string(i % 3 ? 10 : 20000, 'z'));
        Status s = ch->Call(kEcho, &ctx, Req(data), &resp);
        if (s.ok() && resp.data() == data) {
          ok.fetch_add(1);
          if (restarted.load()) ok_after.fetch_add(1);
        } else if (s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCancelled) {
          down.fetch_add(1);
          absl::SleepFor(absl::Milliseconds(5));
        } else {
          other.fetch_add(1);
          ADD_FAILURE() << s;
        }
      }
    });
  }
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ok.load() < 50 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ts->server->Shutdown(absl::Milliseconds(100));
  ts.reset();
  absl::SleepFor(absl::Milliseconds(200));
  TestServer again(address);
  ASSERT_TRUE(again.server);
  restarted = true;
  while (ok_after.load() < 50 && absl::Now() < until + absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  stop = true;
  for (auto& c : clients) c.join();
  EXPECT_GE(ok_after.load(), 50) << "calls did not resume after the restart";
  EXPECT_EQ(other.load(), 0);
  printf("restart under load: %d ok, %d unavailable/cancelled while down\n", ok.load(),
         down.load());
}

// Why a server of services `a` and `b` does not start; OK if it does.
Status WhyNotBoth(Service* a, Service* b) {
  ServerBuilder builder;
  builder.AddListeningPort("tcp://127.0.0.1:0").RegisterService(a).RegisterService(b);
  auto server = builder.BuildAndStart();
  return server.ok() ? Status() : server.status();
}

TEST(ServerBuilderTest, RefusesDuplicateMethods) {
  EchoService a, b;
  const Status s = WhyNotBoth(&a, &b);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("registered twice"), absl::string_view::npos) << s;
}

// A service of one method, written by hand, that answers OK with nothing.
class OneMethod : public Service {
 public:
  explicit OneMethod(std::string_view full_name) {
    AddMethod(std::string(full_name), [](ServerCall* call) { call->Finish(Status(), nullptr); });
  }
};

// Two methods of different names whose ids collide (32-bit FNV-1a): the
// server refuses to start, naming both and the id, rather than route one's
// calls to the other.
TEST(ServerBuilderTest, RefusesMethodsWhoseIdsCollide) {
  constexpr std::string_view kFirst = "/rdmarpc.test.Clash/Call132789";
  constexpr std::string_view kSecond = "/rdmarpc.test.Clash/Call729192";
  static_assert(MethodId(kFirst) == MethodId(kSecond), "the two names no longer collide");
  OneMethod a(kFirst), b(kSecond);
  const Status s = WhyNotBoth(&a, &b);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s;
  EXPECT_NE(
      s.message().find(absl::StrCat("methods ", std::string(kFirst), " and ", std::string(kSecond),
                                    " have the same id 0xfce534b (rename one")),
      absl::string_view::npos)
      << s;
}

}  // namespace
}  // namespace rdmarpc::testing
