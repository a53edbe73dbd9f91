// BalancedChannel: calls spread over several servers, in turn over those
// that are up or to the least busy (see rpc_suite.h).

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/balanced_channel.h"
#include "rpc/channel_group.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"

namespace rdmarpc::testing {
namespace {

std::vector<std::unique_ptr<TestServer>> StartServers(int n, const std::string& listen) {
  std::vector<std::unique_ptr<TestServer>> servers;
  for (int i = 0; i < n; ++i) servers.push_back(std::make_unique<TestServer>(listen));
  return servers;
}

// Empty for a server that did not start, which MakeBalanced then refuses.
std::vector<std::string> AddressesOf(const std::vector<std::unique_ptr<TestServer>>& servers) {
  std::vector<std::string> addresses;
  for (const auto& ts : servers) {
    EXPECT_TRUE(ts->server);
    addresses.push_back(ts->address);
  }
  return addresses;
}

std::shared_ptr<BalancedChannel> MakeBalanced(
    const std::vector<std::string>& addresses,
    BalancingPolicy policy = BalancingPolicy::kRoundRobin) {
  auto ch = BalancedChannel::Create(addresses, ChannelOptions(), policy);
  EXPECT_TRUE(ch.ok()) << ch.status();
  return ch.ok() ? *ch : nullptr;
}

bool AllConnected(BalancedChannel& ch) {
  for (const auto& backend : ch.backends()) {
    if (!backend->WaitForConnected(absl::Now() + absl::Seconds(20))) return false;
  }
  return true;
}

// The calls each server has started.
std::vector<int> Served(const std::vector<std::unique_ptr<TestServer>>& servers) {
  std::vector<int> n;
  for (const auto& ts : servers) n.push_back(ts->service.started.load());
  return n;
}

// `n` blocking Echo calls, each answered with its own data.
void CallEach(BalancedChannel& ch, int n, absl::string_view tag) {
  for (int i = 0; i < n; ++i) {
    const std::string data = absl::StrCat(tag, " ", i);
    const Status s = EchoOn(ch, data);
    ASSERT_TRUE(s.ok()) << data << ": " << s;
  }
}

// With every server up, calls go to each in turn: blocking, asynchronous and
// with an attachment alike, each answered by the server it went to.
TEST_P(RpcSuite, ABalancedChannelGivesItsServersTheirCallsInTurn) {
  constexpr int kServers = 3;
  auto servers = StartServers(kServers, GetParam().listen_addr());
  const std::vector<std::string> addresses = AddressesOf(servers);
  auto ch = MakeBalanced(addresses);
  ASSERT_TRUE(ch);
  ASSERT_EQ(ch->backends().size(), static_cast<size_t>(kServers));
  for (int i = 0; i < kServers; ++i) EXPECT_EQ(ch->backends()[i]->target(), addresses[i]);
  ASSERT_TRUE(AllConnected(*ch));

  CallEach(*ch, 4 * kServers, "blocking");
  EXPECT_EQ(Served(servers), std::vector<int>(kServers, 4));

  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < 2 * kServers; ++i) {
    calls.push_back(std::make_unique<AsyncCall>());
    AsyncCall* c = calls.back().get();
    ch->CallAsync(kEcho, &c->ctx, Req(absl::StrCat("async ", i)), &c->resp,
                  [c](Status s) { c->result.set_value(s); });
  }
  for (int i = 0; i < 2 * kServers; ++i) {
    const Status s = calls[i]->result.get_future().get();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(calls[i]->resp.data(), absl::StrCat("async ", i));
  }
  EXPECT_EQ(Served(servers), std::vector<int>(kServers, 6));

  // An attachment allocated through the channel goes out with the next call,
  // to the backend it came from, and comes back whole; the turn goes on.
  for (int i = 0; i < kServers; ++i) {
    auto att = ch->AllocateAttachment(20000);
    ASSERT_TRUE(att.ok()) << att.status();
    FillAttachment(att->data(), att->size());
    const uint64_t sum = AttachmentChecksum(att->view());
    ClientContext ctx;
    ctx.set_request_attachment(*std::move(att));
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req("attached"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(ctx.response_attachment().size(), 20000u);
    EXPECT_EQ(AttachmentChecksum(ctx.response_attachment().view()), sum);
    EXPECT_EQ(servers[i]->service.started.load(), 7) << "not where its turn was";
  }
  EXPECT_EQ(Served(servers), std::vector<int>(kServers, 7));
}

// A server that goes away is passed over, and its calls go to the others
// without one failing; once it is back on its address, it gets its turn
// again.
TEST_P(RpcSuite, ABalancedChannelPassesOverADownServerUntilItIsBack) {
  constexpr int kServers = 3;
  auto servers = StartServers(kServers, GetParam().listen_addr());
  const std::vector<std::string> addresses = AddressesOf(servers);
  auto ch = MakeBalanced(addresses);
  ASSERT_TRUE(ch);
  ASSERT_TRUE(AllConnected(*ch));
  CallEach(*ch, kServers, "all up");
  EXPECT_EQ(Served(servers), std::vector<int>(kServers, 1));

  servers[1]->server->Shutdown(absl::ZeroDuration());
  servers[1] = nullptr;
  Channel& down = *ch->backends()[1];
  ASSERT_TRUE(down.WaitForStateChange(ChannelState::kReady, absl::Now() + absl::Seconds(20)));

  CallEach(*ch, 6, "one down");
  EXPECT_EQ(servers[0]->service.started.load(), 1 + 3);
  EXPECT_EQ(servers[2]->service.started.load(), 1 + 3);

  // Back on its address: the channel does not connect a backend on its own,
  // so it is the calls passing it over that have it connect again.
  servers[1] = std::make_unique<TestServer>(addresses[1]);
  ASSERT_TRUE(servers[1]->server);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (down.GetState(/*try_to_connect=*/false) != ChannelState::kReady && absl::Now() < until) {
    CallEach(*ch, 1, "while it comes back");
    down.WaitForStateChange(down.GetState(false), absl::Now() + absl::Milliseconds(20));
  }
  ASSERT_STREQ(ChannelStateName(down.GetState(false)), "READY") << down.stats().last_connect_error;
  std::vector<int> before = Served(servers);
  CallEach(*ch, 2 * kServers, "back");
  for (int& n : before) n += 2;
  EXPECT_EQ(Served(servers), before);
}

// Under least requests, a server busy with a call gets no new one while the
// others have none in flight; with the counts equal again, the calls go in
// turn.
TEST_P(RpcSuite, ALeastRequestsBalancedChannelPassesOverABusyServer) {
  constexpr int kServers = 3;
  auto servers = StartServers(kServers, GetParam().listen_addr());
  auto ch = MakeBalanced(AddressesOf(servers), BalancingPolicy::kLeastRequests);
  ASSERT_TRUE(ch);
  EXPECT_EQ(ch->policy(), BalancingPolicy::kLeastRequests);
  ASSERT_TRUE(AllConnected(*ch));

  // Held by its handler until cancelled: the first call, which goes to the
  // first backend, all counts being 0.
  AsyncCall busy;
  ch->CallAsync(kEcho, &busy.ctx, Req("busy", 60000), &busy.resp,
                [&busy](Status s) { busy.result.set_value(s); });
  AwaitHandlersStarted(servers[0]->service, 1);
  ASSERT_EQ(Served(servers), (std::vector<int>{1, 0, 0}));
  EXPECT_EQ(ch->backends()[0]->calls_in_flight(), 1u);

  CallEach(*ch, 8, "while one is busy");
  EXPECT_EQ(Served(servers), (std::vector<int>{1, 4, 4}));
  for (int i = 1; i < kServers; ++i) EXPECT_EQ(ch->backends()[i]->calls_in_flight(), 0u);

  busy.ctx.TryCancel();
  EXPECT_EQ(busy.result.get_future().get().code(), StatusCode::kCancelled);
  EXPECT_EQ(ch->backends()[0]->calls_in_flight(), 0u);
  CallEach(*ch, 2 * kServers, "none busy");
  EXPECT_EQ(Served(servers), (std::vector<int>{3, 6, 6}));
}

// Under a RetryPolicy a failed attempt is retried on another server that is
// up: the first server here lacks the method, which the policy counts as
// retryable, so each call that starts there ends OK on the second, where
// its context's cancel and deadline follow it. With the second server down,
// the retry stays on the first.
TEST_P(RpcSuite, ABalancedChannelRetriesACallOnAnotherServer) {
  ParkService park;  // no Echo method: UNIMPLEMENTED
  auto lacking = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&park)
                     .BuildAndStart();
  ASSERT_TRUE(lacking.ok()) << lacking.status();
  TestServer echo(GetParam().listen_addr());
  ASSERT_TRUE(echo.server);
  ChannelOptions o;
  o.retry.max_attempts = 2;
  o.retry.initial_backoff = absl::Milliseconds(1);
  o.retry.retryable_codes = {StatusCode::kUnimplemented};
  auto ch = BalancedChannel::Create({(*lacking)->addresses()[0], echo.address}, o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ASSERT_TRUE(AllConnected(**ch));
  Channel& first = *(*ch)->backends()[0];
  Channel& second = *(*ch)->backends()[1];

  // Each call starts on the first server: its retry took the second's turn.
  CallEach(**ch, 4, "retried elsewhere");
  EXPECT_EQ(echo.service.started.load(), 4);
  EXPECT_EQ(first.stats().retries_elsewhere, 4u);
  EXPECT_EQ(first.stats().retries, 4u);
  EXPECT_EQ(second.stats().retries, 0u);
  EXPECT_EQ(first.calls_in_flight() + second.calls_in_flight(), 0u);

  // Moved to the second server, where its handler holds it, a call ends by
  // its context's cancel, and then another by its deadline.
  AsyncCall cancelled;
  cancelled.ctx.set_timeout(absl::Seconds(30));
  (*ch)->CallAsync(kEcho, &cancelled.ctx, Req("cancelled", 60000), &cancelled.resp,
                   [&cancelled](Status s) { cancelled.result.set_value(s); });
  AwaitHandlersStarted(echo.service, 5);
  ASSERT_EQ(echo.service.started.load(), 5);
  EXPECT_EQ(first.stats().retries_elsewhere, 5u);
  EXPECT_EQ(second.calls_in_flight(), 1u);
  cancelled.ctx.TryCancel();
  auto cancelled_f = cancelled.result.get_future();
  ASSERT_EQ(cancelled_f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(cancelled_f.get().code(), StatusCode::kCancelled);

  ClientContext timed;
  timed.set_timeout(absl::Seconds(2));
  EchoResponse resp;
  const Status late = (*ch)->Call(kEcho, &timed, Req("late", 60000), &resp);
  EXPECT_EQ(late.code(), StatusCode::kDeadlineExceeded) << late;
  EXPECT_EQ(echo.service.started.load(), 6);
  EXPECT_EQ(first.stats().retries_elsewhere, 6u);

  echo.server->Shutdown(absl::ZeroDuration());
  ASSERT_TRUE(second.WaitForStateChange(ChannelState::kReady, absl::Now() + absl::Seconds(20)));
  const Status stayed = EchoOn(**ch, "stayed");
  EXPECT_EQ(stayed.code(), StatusCode::kUnimplemented) << stayed;
  EXPECT_EQ(first.stats().retries_elsewhere, 6u);
  EXPECT_EQ(first.stats().retries, 7u);
}

ChannelOptions QuickReconnects() {
  ChannelOptions o;
  o.reconnect_backoff = absl::Milliseconds(20);
  o.reconnect_backoff_max = absl::Milliseconds(200);
  return o;
}

// Starts an Echo call on `on` that is answered with its own data, after
// `sleep_ms` in the handler.
void StartEcho(ChannelInterface& on, AsyncCall* c, const std::string& data, int sleep_ms = 0) {
  on.CallAsync(kEcho, &c->ctx, Req(data, sleep_ms), &c->resp,
               [c](Status s) { c->result.set_value(s); });
}

// Calls made while no server is up wait on the backends they were given.
// Once one server is up, the calls waiting on the other, whose connect
// stalls, go to it too, rather than wait out that connect (gRPC picks
// queued calls again when a backend becomes READY). Some calls are made on
// each backend itself, so that both surely have calls waiting, and some
// through the channel.
TEST_P(RpcSuite, AWaitingCallGoesToTheFirstServerThatIsUp) {
  const StalledAddress stalled = GetParam().stalled();
  ASSERT_FALSE(stalled.address.empty());
  const std::string later = AddressesOf(StartServers(1, GetParam().listen_addr()))[0];
  // Far past the calls' deadlines, which they would meet waiting on it.
  ChannelOptions o = QuickReconnects();
  o.connect_timeout = absl::Seconds(60);
  auto ch = BalancedChannel::Create({stalled.address, later}, o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  Channel& connecting = *(*ch)->backends()[0];
  Channel& up_first = *(*ch)->backends()[1];
  constexpr int kCalls = 8;
  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<AsyncCall>());
    // Calls 1 and 5 are not wait-for-ready: an attempt that failed would
    // end them, so they go where the attempt stalls instead, and wait it
    // out as the others do.
    calls[i]->ctx.set_wait_for_ready(i % 4 != 1);
    calls[i]->ctx.set_timeout(absl::Seconds(8));
    ChannelInterface* on = ch->get();
    if (i % 4 < 2) on = &connecting;
    if (i % 4 == 2) on = &up_first;
    StartEcho(*on, calls[i].get(), absl::StrCat("waits ", i));
  }
  // Steady while no server is up: the one attempt stalls, and the other's
  // fail, its calls waiting on.
  const size_t on_connecting = connecting.calls_in_flight();
  EXPECT_GE(on_connecting, static_cast<size_t>(kCalls / 2));
  EXPECT_EQ(on_connecting + up_first.calls_in_flight(), static_cast<size_t>(kCalls));

  TestServer up(later);
  ASSERT_TRUE(up.server);
  for (int i = 0; i < kCalls; ++i) {
    const Status s = calls[i]->result.get_future().get();
    ASSERT_TRUE(s.ok()) << "call " << i << ": " << s;
    EXPECT_EQ(calls[i]->resp.data(), absl::StrCat("waits ", i));
  }
  EXPECT_EQ(up.service.started.load(), kCalls);
  EXPECT_EQ(connecting.stats().waits_elsewhere, on_connecting);
  EXPECT_EQ(up_first.stats().waits_elsewhere, 0u);
  EXPECT_EQ(connecting.calls_in_flight() + up_first.calls_in_flight(), 0u);
  EXPECT_STREQ(ChannelStateName(connecting.GetState(false)), "CONNECTING")
      << "its calls went before its attempt ended";
  const absl::Time before = absl::Now();
  ch->reset();
  EXPECT_LT(absl::Now() - before, absl::Seconds(30))
      << "destroying the channel waited for its backend's connect attempt";
}

// A call waiting on a backend whose connect then fails goes to one that is
// up, instead of ending UNAVAILABLE (or, wait-for-ready, waiting for a
// server that is gone); its deadline and cancel follow it there.
TEST_P(RpcSuite, ACallWhoseConnectFailsGoesToAServerThatIsUp) {
  const std::string gone = AddressesOf(StartServers(1, GetParam().listen_addr()))[0];
  TestServer up(GetParam().listen_addr());
  ASSERT_TRUE(up.server);
  auto ch = BalancedChannel::Create({gone, up.address}, QuickReconnects());
  ASSERT_TRUE(ch.ok()) << ch.status();
  Channel& failing = *(*ch)->backends()[0];
  Channel& ready = *(*ch)->backends()[1];
  ASSERT_TRUE(ready.WaitForConnected(absl::Now() + absl::Seconds(20)));

  constexpr int kCalls = 4;
  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<AsyncCall>());
    calls[i]->ctx.set_wait_for_ready(i % 2 == 0);
    calls[i]->ctx.set_timeout(absl::Seconds(15));
    StartEcho(failing, calls[i].get(), absl::StrCat("moved ", i));
  }
  for (int i = 0; i < kCalls; ++i) {
    const Status s = calls[i]->result.get_future().get();
    ASSERT_TRUE(s.ok()) << "call " << i << ": " << s;
    EXPECT_EQ(calls[i]->resp.data(), absl::StrCat("moved ", i));
  }
  EXPECT_EQ(up.service.started.load(), kCalls);
  EXPECT_EQ(failing.stats().waits_elsewhere, static_cast<uint64_t>(kCalls));
  EXPECT_GE(failing.stats().connect_failures, 1u);

  // Held by the handler there, a moved call ends by its context's cancel,
  // and another by its deadline.
  AsyncCall cancelled;
  cancelled.ctx.set_timeout(absl::Seconds(30));
  StartEcho(failing, &cancelled, "cancelled", 60000);
  AwaitHandlersStarted(up.service, kCalls + 1);
  ASSERT_EQ(up.service.started.load(), kCalls + 1);
  EXPECT_EQ(ready.calls_in_flight(), 1u);
  cancelled.ctx.TryCancel();
  auto cancelled_f = cancelled.result.get_future();
  ASSERT_EQ(cancelled_f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(cancelled_f.get().code(), StatusCode::kCancelled);

  AsyncCall late;
  late.ctx.set_timeout(absl::Seconds(2));
  StartEcho(failing, &late, "late", 60000);
  const Status late_s = late.result.get_future().get();
  EXPECT_EQ(late_s.code(), StatusCode::kDeadlineExceeded) << late_s;
  EXPECT_EQ(up.service.started.load(), kCalls + 2);
  EXPECT_EQ(failing.stats().waits_elsewhere, static_cast<uint64_t>(kCalls + 2));
  EXPECT_EQ(failing.calls_in_flight() + ready.calls_in_flight(), 0u);
}

// Whether `ch` (a Channel or a BalancedChannel) reaches `want` by
// `deadline`, waiting on its state changes.
template <typename SomeChannel>
bool AwaitState(SomeChannel& ch, ChannelState want, absl::Time deadline) {
  for (;;) {
    const ChannelState state = ch.GetState(/*try_to_connect=*/false);
    if (state == want) return true;
    if (!ch.WaitForStateChange(state, deadline)) return ch.GetState(false) == want;
  }
}

// The channel's state sums up its backends', as gRPC's sums up its
// subchannels': CONNECTING while one connects, TRANSIENT_FAILURE once
// every one's attempt failed, READY once one is. WaitForConnected keeps
// every backend trying, through failed attempts, until one connects.
TEST_P(RpcSuite, ABalancedChannelSumsUpItsBackendsAndWaitsForOneToConnect) {
  const StalledAddress stalled = GetParam().stalled();
  ASSERT_FALSE(stalled.address.empty());
  const std::vector<std::string> down = AddressesOf(StartServers(2, GetParam().listen_addr()));
  ChannelOptions o = QuickReconnects();
  o.connect_timeout = absl::Seconds(60);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  {
    SCOPED_TRACE("one backend failed, one connecting");
    auto ch = BalancedChannel::Create({down[0], stalled.address}, o);
    ASSERT_TRUE(ch.ok()) << ch.status();
    ASSERT_TRUE(AwaitState(*(*ch)->backends()[0], ChannelState::kTransientFailure, until));
    ASSERT_TRUE(AwaitState(*(*ch)->backends()[1], ChannelState::kConnecting, until));
    EXPECT_STREQ(ChannelStateName((*ch)->GetState(false)), "CONNECTING");
    EXPECT_FALSE((*ch)->WaitForConnected(absl::Now() + absl::Milliseconds(300)));
  }
  auto ch = BalancedChannel::Create(down, o);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ASSERT_TRUE(AwaitState(**ch, ChannelState::kTransientFailure, until))
      << ChannelStateName((*ch)->GetState(false));
  for (const auto& backend : (*ch)->backends()) {
    EXPECT_STREQ(ChannelStateName(backend->GetState(false)), "TRANSIENT_FAILURE");
  }
  auto connected = std::async(
      std::launch::async, [&] { return (*ch)->WaitForConnected(absl::Now() + absl::Seconds(30)); });
  // Each backend tries again after its failures, for the wait alone.
  for (const auto& backend : (*ch)->backends()) {
    while (backend->stats().connect_failures < 3 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_GE(backend->stats().connect_failures, 3u);
  }
  ASSERT_EQ(connected.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  TestServer up(down[1]);
  ASSERT_TRUE(up.server);
  ASSERT_EQ(connected.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_TRUE(connected.get());
  EXPECT_STREQ(ChannelStateName((*ch)->GetState(false)), "READY");
  EXPECT_STREQ(ChannelStateName((*ch)->backends()[1]->GetState(false)), "READY");
  EXPECT_TRUE(EchoOn(**ch, "up").ok());
}

// Generated stubs take a BalancedChannel as they take a Channel.
TEST_P(RpcSuite, AGeneratedStubCallsThroughABalancedChannel) {
  GeneratedEcho a, b;
  std::vector<std::unique_ptr<Server>> servers;
  std::vector<std::string> addresses;
  for (GeneratedEcho* service : {&a, &b}) {
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(service)
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    addresses.push_back((*built)->addresses()[0]);
    servers.push_back(*std::move(built));
  }
  auto ch = MakeBalanced(addresses);
  ASSERT_TRUE(ch);
  ASSERT_TRUE(AllConnected(*ch));
  auto stub = examples::Echo::NewStub(ch);
  // Each server counts its own calls: in turn, the two counts rise together.
  for (uint64_t expected : {1u, 1u, 2u, 2u, 3u, 3u}) {
    ClientContext ctx;
    examples::EchoRequest req;
    req.set_payload("balanced");
    examples::EchoResponse resp;
    const Status s = stub->Say(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.payload(), "balanced");
    EXPECT_EQ(resp.server_calls(), expected);
  }
}

// With every server down, a call still goes somewhere and ends UNAVAILABLE,
// naming that server, well before its deadline.
TEST_P(RpcSuite, ABalancedChannelWithEveryServerDownEndsACallUnavailable) {
  auto servers = StartServers(2, GetParam().listen_addr());
  const std::vector<std::string> addresses = AddressesOf(servers);
  servers.clear();
  auto ch = MakeBalanced(addresses);
  ASSERT_TRUE(ch);
  for (int i = 0; i < 4; ++i) {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req("nobody"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), addresses[0]) ||
                absl::StrContains(s.message(), addresses[1]))
        << s;
  }
}

// No address, or one that does not parse, is refused, naming which.
TEST_P(RpcSuite, ABalancedChannelRefusesNoAddressOrABadOneByName) {
  auto none = BalancedChannel::Create({});
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(none.status().message(), "a BalancedChannel needs at least one address");
  auto group = ChannelGroup::Create();
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(BalancedChannel::Create(*group, {}).status().code(), StatusCode::kInvalidArgument);
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto bad = BalancedChannel::Create({ts.address, "rdma://nowhere"});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(bad.status().message(),
                               "BalancedChannel backend 2 of 2: bad address 'rdma://nowhere': "))
      << bad.status();
}

}  // namespace
}  // namespace rdmarpc::testing
