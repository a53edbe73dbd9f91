// Connecting: calls that wait for a connection, reconnects with their
// backoff, wait-for-ready, the channel's state, and the channel options that
// govern them (see rpc_suite.h).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <future>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "rpc/internal/send_faults.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"

namespace rdmarpc::testing {
namespace {

using test::EchoResponse;

// A call started while the channel has no connection returns at once and
// waits for one: its deadline runs and TryCancel ends it meanwhile, and
// destroying the channel ends it without waiting for the connect attempt.
TEST_P(RpcSuite, AsyncCallsWaitForAConnectionWithoutBlockingTheCaller) {
  const StalledAddress stalled = GetParam().stalled();
  ASSERT_FALSE(stalled.address.empty());
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("callback_threads ", callback_threads));
    ChannelOptions o;
    o.callback_threads = callback_threads;
    o.connect_timeout = absl::Seconds(60);
    auto ch = MakeChannel(stalled.address, o);
    ASSERT_TRUE(ch);
    AsyncCall cancelled, timed, left;
    timed.ctx.set_timeout(absl::Milliseconds(300));
    std::vector<std::future<Status>> results;
    for (AsyncCall* c : {&cancelled, &timed, &left}) {
      ch->CallAsync(kEcho, &c->ctx, Req("x"), &c->resp, [c](Status s) { c->result.set_value(s); });
      results.push_back(c->result.get_future());
      ASSERT_EQ(results.back().wait_for(std::chrono::seconds(0)), std::future_status::timeout)
          << "CallAsync returned after its call ended: it waited for the connect attempt";
    }
    cancelled.ctx.TryCancel();
    for (auto [f, code] : {std::pair{&results[0], StatusCode::kCancelled},
                           std::pair{&results[1], StatusCode::kDeadlineExceeded}}) {
      ASSERT_EQ(f->wait_for(std::chrono::seconds(20)), std::future_status::ready);
      const Status s = f->get();
      EXPECT_EQ(s.code(), code) << s;
      if (code == StatusCode::kDeadlineExceeded) {
        EXPECT_NE(s.message().find("while connecting to " + stalled.address),
                  absl::string_view::npos)
            << s;
      }
    }
    EXPECT_EQ(results[2].wait_for(std::chrono::seconds(0)), std::future_status::timeout);
    const absl::Time before = absl::Now();
    ch.reset();
    EXPECT_LT(absl::Now() - before, absl::Seconds(30))
        << "destroying the channel waited for its connect attempt";
    ASSERT_EQ(results[2].wait_for(std::chrono::seconds(0)), std::future_status::ready);
    const Status s = results[2].get();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("channel destroyed"), absl::string_view::npos) << s;
  }
}

// Calls that wait for the connection go out on it with all they carry:
// message, metadata, attachment and deadline; those that ended while
// waiting are not sent.
TEST_P(RpcSuite, CallsThatWaitedForTheConnectionGoOutWhole) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  constexpr int kCalls = 16;
  std::vector<std::unique_ptr<AsyncCall>> calls;
  std::vector<std::string> attachments;
  AsyncCall cancelled;
  cancelled.ctx.TryCancel();
  ch->CallAsync(kEcho, &cancelled.ctx, Req("never sent"), &cancelled.resp,
                [&](Status s) { cancelled.result.set_value(s); });
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<AsyncCall>());
    AsyncCall* c = calls.back().get();
    c->ctx.AddMetadata("echo-me", absl::StrCat("call ", i));
    c->ctx.set_timeout(absl::Seconds(30));
    attachments.push_back(std::string(size_t{1} << (i % 12), static_cast<char>('a' + i)));
    c->ctx.set_request_attachment(Attachment::CopyOf(attachments.back()));
    ch->CallAsync(kEcho, &c->ctx, Req(absl::StrCat("data ", i)), &c->resp,
                  [c](Status s) { c->result.set_value(s); });
  }
  for (int i = 0; i < kCalls; ++i) {
    SCOPED_TRACE(absl::StrCat("call ", i));
    AsyncCall& c = *calls[i];
    auto f = c.result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    const Status s = f.get();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(c.resp.data(), absl::StrCat("data ", i));
    ASSERT_EQ(c.ctx.server_metadata().size(), 1u);
    EXPECT_EQ(c.ctx.server_metadata()[0].second, absl::StrCat("call ", i));
    EXPECT_EQ(c.resp.attachment_checksum(), AttachmentChecksum(attachments[i]));
    EXPECT_TRUE(c.ctx.response_attachment().view() == attachments[i]);
  }
  auto f = cancelled.result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kCancelled);
  EXPECT_EQ(ts.service.started.load(), kCalls) << "a call that ended while waiting was sent";
}

// The connector may run the inline callback that drops the last reference
// to its channel. A grouped channel, which cannot shut the shared transport
// down, gives its attempt up when destroyed, rather than wait it out, and
// ends its calls. A call that the attempt's end ends says what to check.
TEST_P(RpcSuite, ChannelsDestroyedWhileConnecting) {
  const StalledAddress stalled = GetParam().stalled();
  ASSERT_FALSE(stalled.address.empty());
  {
    ChannelOptions o = InlineCallbacks();
    o.connect_timeout = absl::Milliseconds(300);
    std::shared_ptr<Channel> ch = MakeChannel(stalled.address, o);
    ASSERT_TRUE(ch);
    AsyncCall c;
    ch->CallAsync(kEcho, &c.ctx, Req("x"), &c.resp, [&](Status s) {
      ch.reset();
      c.result.set_value(s);
    });
    auto f = c.result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    const Status s = f.get();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("cannot reach"), absl::string_view::npos) << s;
    // Once, though auto:// tried both ways.
    const size_t advice = s.message().find("Nothing answered in time: ");
    EXPECT_NE(advice, absl::string_view::npos) << "what to check is not said: " << s;
    EXPECT_EQ(s.message().find("Nothing answered", advice + 1), absl::string_view::npos) << s;
    EXPECT_EQ(ch, nullptr);
  }
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("grouped, callback_threads ", callback_threads));
    ChannelOptions o;
    o.callback_threads = callback_threads;
    o.connect_timeout = absl::Seconds(60);
    auto group = ChannelGroup::Create(o);
    ASSERT_TRUE(group.ok()) << group.status();
    auto ch = (*group)->NewChannel(stalled.address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    AsyncCall c;
    (*ch)->CallAsync(kEcho, &c.ctx, Req("x"), &c.resp, [&](Status s) { c.result.set_value(s); });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while ((*ch)->stats().connect_attempts == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ((*ch)->stats().connect_attempts, 1u);
    const absl::Time before = absl::Now();
    ch->reset();
    EXPECT_LT(absl::Now() - before, absl::Seconds(30))
        << "destroying the grouped channel waited for its connect attempt";
    auto f = c.result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
        << "the channel's destructor returned with a call pending";
    const Status s = f.get();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("channel destroyed"), absl::string_view::npos) << s;
  }
}

// The callbacks of calls that a lost connection ends run on a transport
// thread; a call one starts waits for the channel's connector instead of
// connecting on a thread that connecting may need, and ends UNAVAILABLE when
// the server is gone.
TEST_P(RpcSuite, InlineCallbackStartingACallAfterTheConnectionIsLost) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  ChannelOptions o = InlineCallbacks();
  o.connect_timeout = absl::Seconds(60);
  auto ch = MakeChannel(ts->address, o);
  EchoResponse resp;
  {
    ClientContext ctx;
    ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("connect"), &resp).ok());
  }
  ClientContext ctx, next_ctx;
  EchoResponse next_resp;
  std::promise<Status> lost, next;
  ch->CallAsync(kEcho, &ctx, Req("slow", 60000), &resp, [&](Status s) {
    lost.set_value(s);
    ch->CallAsync(kEcho, &next_ctx, Req("next"), &next_resp,
                  [&](Status again) { next.set_value(again); });
  });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (ts->service.started.load() < 2 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  ts->server->Shutdown(absl::ZeroDuration());
  ts.reset();
  auto f = lost.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const Status s = f.get();
  EXPECT_TRUE(s.code() == StatusCode::kCancelled || s.code() == StatusCode::kUnavailable) << s;
  auto g = next.get_future();
  ASSERT_EQ(g.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(g.get().code(), StatusCode::kUnavailable);
}

TEST_P(RpcSuite, NegativeCallbackThreadsAndBackoffsOrRetriesThatCannotWorkAreRefused) {
  ChannelOptions o;
  o.callback_threads = -1;
  auto ch = Channel::Create(GetParam().listen_addr(), o);
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ch.status().code(), StatusCode::kInvalidArgument) << ch.status();
  EXPECT_NE(ch.status().message().find("callback_threads is -1"), absl::string_view::npos)
      << ch.status();
  for (auto [initial, max] : {std::pair{absl::ZeroDuration(), absl::Seconds(1)},
                              std::pair{absl::Seconds(2), absl::Seconds(1)}}) {
    ChannelOptions b;
    b.reconnect_backoff = initial;
    b.reconnect_backoff_max = max;
    auto refused = Channel::Create(GetParam().listen_addr(), b);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("reconnect_backoff"), absl::string_view::npos)
        << refused.status();
  }
  ChannelOptions u;
  u.transport.tcp_fallback_upgrade = absl::Seconds(-1);
  auto no_upgrade = Channel::Create(GetParam().listen_addr(), u);
  ASSERT_FALSE(no_upgrade.ok());
  EXPECT_EQ(no_upgrade.status().code(), StatusCode::kInvalidArgument) << no_upgrade.status();
  EXPECT_NE(no_upgrade.status().message().find("tcp_fallback_upgrade is -1s"),
            absl::string_view::npos)
      << no_upgrade.status();
  for (int bad = 0; bad < 4; ++bad) {
    ChannelOptions r;
    r.retry.max_attempts = bad == 0 ? 0 : 3;
    if (bad == 1) r.retry.initial_backoff = absl::ZeroDuration();
    if (bad == 2) r.retry.multiplier = 0.5;
    if (bad == 3) r.retry.multiplier = std::numeric_limits<double>::quiet_NaN();
    auto refused = Channel::Create(GetParam().listen_addr(), r);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("retry policy"), absl::string_view::npos)
        << refused.status();
  }
}

TEST_P(RpcSuite, ChannelReconnectsAfterServerRestart) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  const std::string address = ts->address;
  auto ch = MakeChannel(address);
  EchoResponse resp;
  {
    ClientContext ctx;
    ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("before"), &resp).ok());
  }
  // A call pending when the server goes ends with a status, not a hang.
  ClientContext pending_ctx;
  std::promise<Status> pending;
  ch->CallAsync(kEcho, &pending_ctx, Req("slow", 60000), &resp,
                [&](Status s) { pending.set_value(s); });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (ts->service.started.load() < 2 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  ts->server->Shutdown(absl::ZeroDuration());
  ts.reset();
  auto f = pending.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const Status lost = f.get();
  EXPECT_TRUE(lost.code() == StatusCode::kCancelled || lost.code() == StatusCode::kUnavailable)
      << lost;
  {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(5));
    EXPECT_EQ(ch->Call(kEcho, &ctx, Req("down"), &resp).code(), StatusCode::kUnavailable);
  }
  // Same address again, most likely within the reconnect backoff after the
  // failed attempt of "down": the next call waits for it.
  TestServer again(address);
  ASSERT_TRUE(again.server);
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  Status s = ch->Call(kEcho, &ctx, Req("after"), &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.data(), "after");
}

// Listens, learns a free port, stops: nothing listens there now.
std::string AddressNobodyListensOn(const std::string& listen_addr) {
  TestServer ts(listen_addr);
  EXPECT_TRUE(ts.server);
  return ts.address;
}

// A call whose connection closed as its request was sent, so that the
// transport refused the request unsent, goes on the next connection, and
// the server sees it once: a plain call once more, a wait-for-ready call as
// often as it takes (there is no RetryPolicy here). SendFaults opens that
// window, microseconds wide in a real close, on purpose.
TEST_P(RpcSuite, ACallRefusedUnsentAsItsConnectionClosedGoesOnTheNextOne) {
  internal::SendFaults::Disarm disarm;
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  const auto call = [&](const std::string& data, ClientContext& ctx) {
    ctx.set_timeout(absl::Seconds(30));
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req(data), &resp);
    EXPECT_TRUE(!s.ok() || resp.data() == data) << data;
    return s;
  };
  {
    ClientContext ctx;
    ASSERT_TRUE(call("first", ctx).ok());
  }
  ASSERT_EQ(ch->stats().connect_attempts, 1u);

  internal::SendFaults::RefuseRequests() = 1;
  {
    ClientContext ctx;
    const Status s = call("refused once", ctx);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(internal::SendFaults::RefuseRequests().load(), 0) << "nothing was refused";
  EXPECT_EQ(ts.service.started.load(), 2);
  ChannelStats stats = ch->stats();
  EXPECT_EQ(stats.connect_attempts, 2u) << "the refusing connection was used again";
  EXPECT_EQ(stats.transparent_retries, 1u);
  EXPECT_EQ(stats.retries, 0u);

  // Its one more attempt refused too, a plain call ends, naming why; the
  // server never saw it.
  internal::SendFaults::RefuseRequests() = 2;
  {
    ClientContext ctx;
    const Status s = call("refused twice", ctx);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("is closed (SendFaults"), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find(kEcho.full_name), absl::string_view::npos) << s;
  }
  EXPECT_EQ(internal::SendFaults::RefuseRequests().load(), 0);
  EXPECT_EQ(ts.service.started.load(), 2);
  EXPECT_EQ(ch->stats().transparent_retries, 2u);

  internal::SendFaults::RefuseRequests() = 3;
  {
    ClientContext ctx;
    ctx.set_wait_for_ready(true);
    const Status s = call("refused three times, waiting for ready", ctx);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(ts.service.started.load(), 3);
  EXPECT_EQ(ch->stats().transparent_retries, 5u);

  // A request attachment goes with the refused send: that call ends.
  internal::SendFaults::RefuseRequests() = 1;
  {
    ClientContext ctx;
    ctx.set_request_attachment(Attachment::CopyOf("attached"));
    const Status s = call("with an attachment", ctx);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  }
  EXPECT_EQ(ts.service.started.load(), 3);
  {
    ClientContext ctx;
    const Status s = call("last", ctx);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(ts.service.started.load(), 4);
}

// The same, where the channel hears of the loss first: the connection is
// lost after the channel took it for the call and before the transport
// refused the request. The calls sent on it end as lost (here one parked in
// its handler); the one refused unsent goes on the next connection.
TEST_P(RpcSuite, ACallWhoseConnectionWasLostBeforeItsRequestWentOutGoesOnTheNextOne) {
  internal::SendFaults::Disarm disarm;
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ASSERT_TRUE(EchoOn(*ch, "first").ok());
  AsyncCall parked;
  parked.ctx.set_timeout(absl::Seconds(60));
  ch->CallAsync(kEcho, &parked.ctx, Req("parked", 30000), &parked.resp,
                [&](Status s) { parked.result.set_value(s); });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (ts.service.started.load() < 2 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(ts.service.started.load(), 2) << "the parked call never reached its handler";

  bool heard = false;
  internal::SendFaults::BeforeRefusal() = [&](transport::Connection& conn) {
    conn.Close();
    heard = ch->WaitForStateChange(ChannelState::kReady, absl::Now() + absl::Seconds(10));
  };
  internal::SendFaults::RefuseRequests() = 1;
  {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req("lost before it went out"), &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "lost before it went out");
  }
  EXPECT_TRUE(heard) << "the channel did not hear of the loss before the refusal";
  EXPECT_EQ(internal::SendFaults::RefuseRequests().load(), 0) << "nothing was refused";
  auto f = parked.result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status lost = f.get();
  EXPECT_EQ(lost.code(), StatusCode::kUnavailable) << lost;
  EXPECT_NE(lost.message().find("lost"), absl::string_view::npos) << lost;
  EXPECT_EQ(ts.service.started.load(), 3);
  const ChannelStats stats = ch->stats();
  EXPECT_EQ(stats.connect_attempts, 2u);
  EXPECT_EQ(stats.transparent_retries, 1u);
}

// After a failed attempt the channel does not try again before the backoff
// ends, even for a call that comes meanwhile: that call waits for the next
// attempt and its deadline ends it; destroying the channel wakes the wait.
TEST_P(RpcSuite, ReconnectAttemptsWaitForTheBackoff) {
  const std::string address = AddressNobodyListensOn(GetParam().listen_addr());
  ChannelOptions o;
  o.reconnect_backoff = o.reconnect_backoff_max = absl::Seconds(60);
  auto ch = MakeChannel(address, o);
  EchoResponse resp;
  {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(10));
    const Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("cannot reach"), absl::string_view::npos) << s;
  }
  TestServer again(address);
  ASSERT_TRUE(again.server);
  {
    // An attempt now would connect.
    ClientContext ctx;
    ctx.set_timeout(absl::Milliseconds(300));
    const Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("while connecting"), absl::string_view::npos) << s;
  }
  EXPECT_EQ(again.service.started.load(), 0) << "the channel tried again before its backoff ended";
  AsyncCall waiting;
  ch->CallAsync(kEcho, &waiting.ctx, Req("x"), &waiting.resp,
                [&](Status s) { waiting.result.set_value(s); });
  const absl::Time before = absl::Now();
  ch.reset();
  EXPECT_LT(absl::Now() - before, absl::Seconds(30))
      << "destroying the channel waited out the backoff";
  auto f = waiting.result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kUnavailable);
}

// Waits while the channel's state is one of `passing`; returns the first
// other, or the last seen at `deadline`.
ChannelState StateAfter(Channel& ch, std::initializer_list<ChannelState> passing,
                        absl::Time deadline) {
  ChannelState state = ch.GetState(false);
  while (std::find(passing.begin(), passing.end(), state) != passing.end() &&
         ch.WaitForStateChange(state, deadline)) {
    state = ch.GetState(false);
  }
  return state;
}

// A wait-for-ready call outlasts failed attempts, each after its backoff,
// and goes out once the server is there; a plain call made with it ends
// with the first failure.
TEST_P(RpcSuite, WaitForReadyCallsWaitThroughFailedAttempts) {
  const std::string address = AddressNobodyListensOn(GetParam().listen_addr());
  ChannelOptions o;
  o.reconnect_backoff = absl::Milliseconds(50);
  o.reconnect_backoff_max = absl::Milliseconds(200);
  auto ch = MakeChannel(address, o);
  EXPECT_EQ(ch->GetState(false), ChannelState::kIdle);
  AsyncCall ready, plain;
  ready.ctx.set_wait_for_ready(true);
  ready.ctx.set_timeout(absl::Seconds(60));
  plain.ctx.set_timeout(absl::Seconds(60));
  ch->CallAsync(kEcho, &ready.ctx, Req("ready"), &ready.resp,
                [&](Status s) { ready.result.set_value(s); });
  ch->CallAsync(kEcho, &plain.ctx, Req("plain"), &plain.resp,
                [&](Status s) { plain.result.set_value(s); });
  auto plain_f = plain.result.get_future();
  ASSERT_EQ(plain_f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status plain_status = plain_f.get();
  EXPECT_EQ(plain_status.code(), StatusCode::kUnavailable) << plain_status;
  EXPECT_NE(plain_status.message().find("cannot reach"), absl::string_view::npos) << plain_status;
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ch->stats().connect_failures < 3 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GE(ch->stats().connect_failures, 3u);
  const Status why = ch->stats().last_connect_error;
  EXPECT_EQ(why.code(), StatusCode::kUnavailable) << why;
  EXPECT_NE(why.message().find(absl::StrCat("cannot reach ", address)), absl::string_view::npos)
      << why;
  const ChannelState state = ch->GetState(false);
  EXPECT_TRUE(state == ChannelState::kTransientFailure || state == ChannelState::kConnecting)
      << ChannelStateName(state);
  auto ready_f = ready.result.get_future();
  EXPECT_EQ(ready_f.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the wait-for-ready call ended with a failed attempt";
  EXPECT_EQ(ch->calls_in_flight(), 1u) << "a call waiting for a connection is in flight";
  TestServer again(address);
  ASSERT_TRUE(again.server);
  ASSERT_EQ(ready_f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status s = ready_f.get();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ready.resp.data(), "ready");
  EXPECT_EQ(ch->GetState(false), ChannelState::kReady);
  EXPECT_EQ(again.service.started.load(), 1) << "only the wait-for-ready call was left to send";
  EXPECT_EQ(ch->calls_in_flight(), 0u);
  const ChannelStats stats = ch->stats();
  EXPECT_EQ(stats.connect_attempts, stats.connect_failures + 1);
  EXPECT_TRUE(stats.last_connect_error.ok()) << "connected, yet " << stats.last_connect_error;
}

// The backoff spaces a waiting call's attempts: 100 ms after the first
// failure, then 1.6 times longer each, +-20%, so within 1.5 s they start
// at 0, 80-120, 208-312, 413-619, 740-1111 and perhaps 1264 ms: 5 or 6,
// not one per refusal. Nobody wanting a connection any more, none follows.
TEST_P(RpcSuite, BackoffSpacesTheAttemptsOfAWaitForReadyCall) {
  const std::string address = AddressNobodyListensOn(GetParam().listen_addr());
  auto ch = MakeChannel(address);
  ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_timeout(absl::Milliseconds(1500));
  EchoResponse resp;
  const Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("the last attempt: cannot reach"), absl::string_view::npos) << s;
  const ChannelStats stats = ch->stats();
  // Fewer where an attempt itself is slow (sanitizers in the VM).
  EXPECT_GE(stats.connect_attempts, 3u);
  EXPECT_LE(stats.connect_attempts, 6u);
  absl::SleepFor(absl::Milliseconds(1500));
  const ChannelStats later = ch->stats();
  EXPECT_EQ(later.connect_attempts, stats.connect_attempts) << "attempts went on for nobody";
  EXPECT_EQ(later.connect_failures, later.connect_attempts);
  EXPECT_EQ(ch->GetState(false), ChannelState::kTransientFailure);
}

// GetState and WaitForConnected connect ahead of the first call, and the
// state follows the connection: READY, IDLE once it is lost (with no
// attempt until asked), TRANSIENT_FAILURE after an attempt fails.
TEST_P(RpcSuite, GetStateAndWaitForConnectedFollowTheConnection) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  const std::string address = ts->address;
  auto ch = MakeChannel(address);
  EXPECT_EQ(ch->GetState(false), ChannelState::kIdle);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(ch->GetState(false), ChannelState::kIdle) << "connected before anyone asked";
  EXPECT_EQ(ch->stats().connect_attempts, 0u);
  ASSERT_TRUE(ch->WaitForConnected(absl::Now() + absl::Seconds(20)));
  EXPECT_EQ(ch->GetState(false), ChannelState::kReady);
  {
    ClientContext ctx;
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(ch->stats().connect_attempts, 1u) << "the call did not use the connection made for it";
  ts->server->Shutdown(absl::ZeroDuration());
  ts.reset();
  const absl::Time until = absl::Now() + absl::Seconds(20);
  EXPECT_EQ(StateAfter(*ch, {ChannelState::kReady}, until), ChannelState::kIdle);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(ch->stats().connect_attempts, 1u) << "reconnected with nobody asking";
  EXPECT_EQ(ch->GetState(/*try_to_connect=*/true), ChannelState::kIdle);
  const ChannelState state =
      StateAfter(*ch, {ChannelState::kIdle, ChannelState::kConnecting}, until);
  EXPECT_EQ(state, ChannelState::kTransientFailure) << ChannelStateName(state);
  EXPECT_EQ(ch->stats().connect_attempts, 2u);
  EXPECT_EQ(ch->stats().connect_failures, 1u);
}

// WaitForConnected gives up at its deadline; the attempt goes on, and
// destroying the channel cuts it short.
TEST_P(RpcSuite, WaitForConnectedEndsAtItsDeadlineWhileTheAttemptGoesOn) {
  const StalledAddress stalled = GetParam().stalled();
  ChannelOptions o;
  o.connect_timeout = absl::Seconds(60);
  auto ch = MakeChannel(stalled.address, o);
  const absl::Time start = absl::Now();
  EXPECT_FALSE(ch->WaitForConnected(start + absl::Milliseconds(300)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  const ChannelState state =
      StateAfter(*ch, {ChannelState::kIdle}, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(state, ChannelState::kConnecting) << ChannelStateName(state);
  EXPECT_EQ(ch->stats().connect_attempts, 1u);
  const absl::Time before = absl::Now();
  ch.reset();
  EXPECT_LT(absl::Now() - before, absl::Seconds(30)) << "destruction waited for the attempt";
}

TEST_P(RpcSuite, UnreachableServerIsUnavailable) {
  const std::string address = AddressNobodyListensOn(GetParam().listen_addr());
  auto ch = MakeChannel(address);
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(10));
  EchoResponse resp;
  Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(address.substr(address.find("://") + 3)), absl::string_view::npos)
      << "the error should name the server: " << s;
}

// An inline callback may run on the thread the channel's connection attempts
// need: here the connector's, whose failed attempt ended the call. From
// there WaitForConnected starts an attempt and returns without waiting for
// it, and AllocateAttachment, which connects on its caller's thread, fails
// saying why; waiting would wait for the callback's own thread.
TEST_P(RpcSuite, AnInlineCallbackNeverWaitsForItsChannelsConnection) {
  auto ch = MakeChannel(AddressNobodyListensOn(GetParam().listen_addr()), InlineCallbacks());
  struct Seen {
    Status call;
    bool connected = true;
    absl::Duration waited;
    Status attachment;
  };
  std::promise<Seen> seen;
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  EchoResponse resp;
  ch->CallAsync(kEcho, &ctx, Req("x"), &resp, [&](Status s) {
    Seen got;
    got.call = s;
    const absl::Time start = absl::Now();
    got.connected = ch->WaitForConnected(start + absl::Seconds(30));
    got.waited = absl::Now() - start;
    got.attachment = ch->AllocateAttachment(1024).status();
    seen.set_value(got);
  });
  auto f = seen.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready)
      << "the callback never ended";
  const Seen got = f.get();
  EXPECT_EQ(got.call.code(), StatusCode::kUnavailable) << got.call;
  EXPECT_FALSE(got.connected);
  EXPECT_LT(got.waited, absl::Seconds(10)) << "WaitForConnected waited in an inline callback";
  EXPECT_EQ(got.attachment.code(), StatusCode::kUnavailable) << got.attachment;
  EXPECT_NE(got.attachment.message().find("inline callback"), absl::string_view::npos)
      << got.attachment;
}

}  // namespace
}  // namespace rdmarpc::testing
