// The transport-parameterized runtime suite (see rpc_suite.h).
#include "tests/rpc_suite.h"

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/echo.rdmarpc.pb.h"
#include "proto/health.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "rpc/health.h"
#include "rpc/internal/send_faults.h"
#include "rpc/server.h"
#include "rpc/service.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"

namespace rdmarpc::testing {
namespace {

using test::EchoRequest;
using test::EchoResponse;

std::shared_ptr<Channel> MakeChannel(const std::string& address, ChannelOptions o = {}) {
  auto ch = Channel::Create(address, o);
  EXPECT_TRUE(ch.ok()) << ch.status();
  return ch.ok() ? *ch : nullptr;
}

EchoRequest Req(const std::string& data, int sleep_ms = 0) {
  EchoRequest r;
  r.set_data(data);
  r.set_sleep_ms(sleep_ms);
  return r;
}

// Starts a 30 s call to `method`, cancels it once its handler is running
// (`started` past `started_before`), and expects the call to end CANCELLED
// and the handler to see the cancel. `while_running`, if any, runs with the
// call's context just before the cancel.
void ExpectCancelReachesRunningHandler(
    Channel& ch, EchoService& service, const MethodInfo& method, int started_before,
    const std::function<void(ClientContext&)>& while_running = nullptr) {
  ClientContext ctx;
  EchoResponse resp;
  std::promise<Status> result;
  ch.CallAsync(method, &ctx, Req("slow", 30000), &resp, [&](Status s) { result.set_value(s); });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (service.started.load() <= started_before && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  if (while_running) while_running(ctx);
  ctx.TryCancel();
  auto f = result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kCancelled);
  while (service.saw_cancel.load() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(service.saw_cancel.load(), 1) << "server handler never saw the cancel";
}

// An asynchronous call whose result a test waits for.
struct AsyncCall {
  ClientContext ctx;
  EchoResponse resp;
  std::promise<Status> result;
};

// Starts `n` calls to `method`; call i asks its handler to sleep sleep_ms(i).
std::vector<std::unique_ptr<AsyncCall>> StartCalls(Channel& ch, const MethodInfo& method, int n,
                                                   const std::function<int(int)>& sleep_ms) {
  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < n; ++i) {
    auto c = std::make_unique<AsyncCall>();
    AsyncCall* raw = c.get();
    ch.CallAsync(method, &raw->ctx, Req("x", sleep_ms(i)), &raw->resp,
                 [raw](Status s) { raw->result.set_value(s); });
    calls.push_back(std::move(c));
  }
  return calls;
}

TEST_P(RpcSuite, EchoCarriesBytesAndMetadataBothWays) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext ctx;
  ctx.AddMetadata("echo-me", "value-1");
  EchoResponse resp;
  const std::string data(1000, '\x7f');
  Status s = ch->Call(kEcho, &ctx, Req(data), &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.data(), data);
  ASSERT_EQ(ctx.server_metadata().size(), 1u);
  EXPECT_EQ(ctx.server_metadata()[0], (std::pair<std::string, std::string>("echoed", "value-1")));
}

// Response metadata that cannot go on the wire is not dropped quietly: an
// OK answer becomes INTERNAL naming it; an error answer keeps its status.
TEST_P(RpcSuite, InvalidResponseMetadataIsAnErrorNotDroppedQuietly) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (const std::string& key : {std::string("Upper-Case"), std::string(), std::string(300, 'k')}) {
    SCOPED_TRACE(key.substr(0, 20));
    ClientContext ctx;
    ctx.AddMetadata("respond-with-key", key);
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("the server's response metadata: metadata key '" + key + "'"),
              absl::string_view::npos)
        << s;
    EXPECT_TRUE(ctx.server_metadata().empty());
  }
  {
    ClientContext ctx;
    ctx.AddMetadata("respond-with-key", "Upper-Case");
    EchoRequest req = Req("x");
    req.set_fail_code(static_cast<int>(StatusCode::kNotFound));
    req.set_fail_message("no such thing");
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
    EXPECT_EQ(s.message(), "no such thing");
  }
  ClientContext ctx;
  ctx.AddMetadata("respond-with-key", "fine-key");
  EchoResponse resp;
  Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(ctx.server_metadata().size(), 1u);
  EXPECT_EQ(ctx.server_metadata()[0], (std::pair<std::string, std::string>("fine-key", "x")));
}

TEST_P(RpcSuite, ManyThreadsThousandsOfCallsInFlight) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  constexpr int kThreads = 8;
  constexpr int kPerThread = 500;
  std::atomic<int> ok{0}, bad{0}, done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      struct Call {
        ClientContext ctx;
        EchoResponse resp;
        std::string expect;
      };
      std::vector<std::unique_ptr<Call>> calls;
      for (int i = 0; i < kPerThread; ++i) {
        auto c = std::make_unique<Call>();
        c->expect = absl::StrCat("t", t, "-call", i);
        c->ctx.set_timeout(absl::Seconds(60));
        Call* raw = c.get();
        ch->CallAsync(kEcho, &raw->ctx, Req(raw->expect), &raw->resp, [&, raw](Status s) {
          (s.ok() && raw->resp.data() == raw->expect ? ok : bad).fetch_add(1);
          done.fetch_add(1);
        });
        calls.push_back(std::move(c));
      }
      while (done.load() < kThreads * kPerThread) std::this_thread::yield();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kPerThread);
  EXPECT_EQ(bad.load(), 0);
}

ChannelOptions InlineCallbacks() {
  ChannelOptions o;
  o.callback_threads = 0;
  return o;
}

// Chains of asynchronous calls, each started from its predecessor's callback,
// with callbacks running where their calls end (no callback threads).
TEST_P(RpcSuite, InlineCallbacksChainCalls) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address, InlineCallbacks());
  constexpr int kChains = 8;
  constexpr int kPerChain = 200;
  struct Chain {
    Channel* ch;
    int n = 0;
    std::unique_ptr<ClientContext> ctx;  // one per call, made in the previous call's callback
    EchoResponse resp;
    std::string expect;
    std::promise<Status> end;
    void Next() {
      ctx = std::make_unique<ClientContext>();
      ctx->set_timeout(absl::Seconds(60));
      expect = absl::StrCat("call", n);
      ch->CallAsync(kEcho, ctx.get(), Req(expect), &resp, [this](Status s) {
        if (s.ok() && resp.data() != expect) s = Status(StatusCode::kInternal, "wrong echo");
        if (!s.ok() || ++n == kPerChain) return end.set_value(s);
        Next();
      });
    }
  };
  std::vector<std::unique_ptr<Chain>> chains;
  for (int c = 0; c < kChains; ++c) {
    chains.push_back(std::make_unique<Chain>());
    chains.back()->ch = ch.get();
  }
  for (auto& c : chains) c->Next();
  for (auto& c : chains) {
    auto f = c->end.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    const Status s = f.get();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(c->n, kPerChain);
  }
}

// A call that fails to start ends on the caller's thread before CallAsync
// returns. From its callback a blocking call fails at once instead of
// waiting for the thread it holds, an asynchronous call on the unconnected
// channel waits for the connection without holding the callback up, and a
// retry loop of calls failing at once runs callback after callback without
// growing the stack.
TEST_P(RpcSuite, InlineCallbacksNeitherBlockNorNest) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  ChannelOptions o = InlineCallbacks();
  o.max_message_size = 100;
  auto ch = MakeChannel(ts.address, o);
  constexpr int kRetries = 100000;
  const EchoRequest too_big_request = Req(std::string(1000, 'b'));
  ClientContext ctx;
  EchoResponse resp;
  Status too_big, blocking;
  AsyncCall unconnected;
  int retries = 0;
  uintptr_t lowest = UINTPTR_MAX, highest = 0;
  std::function<void(Status)> retry = [&](Status s) {
    int here;
    lowest = std::min(lowest, reinterpret_cast<uintptr_t>(&here));
    highest = std::max(highest, reinterpret_cast<uintptr_t>(&here));
    if (s.code() != StatusCode::kResourceExhausted || ++retries == kRetries) return;
    ch->CallAsync(kEcho, &ctx, too_big_request, &resp, [&](Status again) { retry(again); });
  };
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  ch->CallAsync(kEcho, &ctx, too_big_request, &resp, [&](Status s) {
    ran_on = std::this_thread::get_id();
    too_big = s;
    ClientContext inner;
    EchoResponse inner_resp;
    blocking = ch->Call(kEcho, &inner, Req("x"), &inner_resp);
    ch->CallAsync(kEcho, &unconnected.ctx, Req("waited"), &unconnected.resp,
                  [&](Status s) { unconnected.result.set_value(s); });
    retry(s);
  });
  EXPECT_EQ(ran_on, caller) << "the callback did not run on the caller's thread";
  EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted) << too_big;
  EXPECT_EQ(blocking.code(), StatusCode::kFailedPrecondition) << blocking;
  EXPECT_EQ(retries, kRetries);
  EXPECT_LT(highest - lowest, 64u << 10) << "inline callbacks nested";
  auto f = unconnected.result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const Status s = f.get();
  ASSERT_TRUE(s.ok()) << "the call that waited for the connection: " << s;
  EXPECT_EQ(unconnected.resp.data(), "waited");
}

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
// to its channel; a grouped channel, which cannot shut the shared transport
// down, lets its attempt end and then ends its calls.
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
    EXPECT_EQ(ch, nullptr);
  }
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("grouped, callback_threads ", callback_threads));
    ChannelOptions o;
    o.callback_threads = callback_threads;
    o.connect_timeout = absl::Milliseconds(300);
    auto group = ChannelGroup::Create(o);
    ASSERT_TRUE(group.ok()) << group.status();
    auto ch = (*group)->NewChannel(stalled.address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    AsyncCall c;
    (*ch)->CallAsync(kEcho, &c.ctx, Req("x"), &c.resp, [&](Status s) { c.result.set_value(s); });
    // Time for the connector to begin its attempt; destroyed before that,
    // the channel has no attempt to wait for, and the call ends all the same.
    absl::SleepFor(absl::Milliseconds(100));
    ch->reset();
    auto f = c.result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
        << "the channel's destructor returned with a call pending";
    EXPECT_EQ(f.get().code(), StatusCode::kUnavailable);
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

TEST_P(RpcSuite, HandlerErrorReachesClientUnchanged) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  EchoRequest req;
  req.set_fail_code(static_cast<int>(StatusCode::kPermissionDenied));
  req.set_fail_message("no entry for you");
  ClientContext ctx;
  EchoResponse resp;
  Status s = ch->Call(kEcho, &ctx, req, &resp);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "no entry for you");
}

TEST_P(RpcSuite, UnknownMethodIsUnimplemented) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext ctx;
  EchoResponse resp;
  Status s = ch->Call(kMissing, &ctx, Req("x"), &resp);
  EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
  EXPECT_NE(s.message().find("/rdmarpc.test.Echo/Missing"), absl::string_view::npos) << s;
}

TEST_P(RpcSuite, AsyncHandlerFinishingOnAnotherThread) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext ctx;
  EchoResponse resp;
  Status s = ch->Call(kEchoLater, &ctx, Req("later", 5), &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.data(), "later");
}

// Inline handlers (SetWorkerThreads(0)) that finish on another thread: the
// server tracks such a call only once its handler has returned (server.cc),
// racing with the finish; every call ends once, and a cancel still reaches a
// handler that is still running.
TEST_P(RpcSuite, InlineHandlerFinishingLaterCanBeCancelled) {
  TestServer ts(GetParam().listen_addr(), /*max_message=*/64u << 20, /*workers=*/0);
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (int i = 0; i < 50; ++i) {
    ClientContext ctx;
    EchoResponse resp;
    const std::string data = absl::StrCat("later ", i);
    Status s = ch->Call(kEchoLater, &ctx, Req(data, i % 3), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), data);
  }
  ExpectCancelReachesRunningHandler(*ch, ts.service, kEchoLater, /*started_before=*/50);
}

TEST_P(RpcSuite, DeadlineExceededEndsCallAndTellsServer) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext warm;
  EchoResponse resp;
  ASSERT_TRUE(ch->Call(kEcho, &warm, Req("warm"), &resp).ok());

  ClientContext ctx;
  ctx.set_timeout(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  Status s = ch->Call(kEcho, &ctx, Req("slow", 10000), &resp);
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the deadline did not end the call";
  // The server learns of it (deadline in the header, or the cancel message)
  // and its handler stops early.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (ts.service.saw_cancel.load() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(ts.service.saw_cancel.load(), 1);
}

TEST_P(RpcSuite, ExpiredDeadlineFailsWithoutSending) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext ctx;
  ctx.set_deadline(absl::Now() - absl::Seconds(1));
  EchoResponse resp;
  EXPECT_EQ(ch->Call(kEcho, &ctx, Req("x"), &resp).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ts.service.started.load(), 0);
}

TEST_P(RpcSuite, CancelledBeforeTheCallEndsItWithoutSending) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ClientContext cancelled;
  cancelled.TryCancel();
  EchoResponse resp;
  EXPECT_EQ(ch->Call(kEcho, &cancelled, Req("never"), &resp).code(), StatusCode::kCancelled);
  // The next call on the same connection reaches the handler, and is its first.
  ClientContext ctx;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("after"), &resp).ok());
  EXPECT_EQ(resp.data(), "after");
  EXPECT_EQ(ts.service.started.load(), 1);
}

// A key the wire format refuses fails its call at the start, naming the key,
// and nothing reaches the server; the channel's next call goes through.
TEST_P(RpcSuite, MetadataWithABadKeyFailsWithoutSending) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  EchoResponse resp;
  ClientContext bad;
  bad.AddMetadata("Request-Id", "42");
  const Status s = ch->Call(kEcho, &bad, Req("never"), &resp);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("Request-Id"), absl::string_view::npos) << s;
  ClientContext ctx;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("after"), &resp).ok());
  EXPECT_EQ(ts.service.started.load(), 1);
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

// Destroying a channel ends each of its pending calls with UNAVAILABLE before
// the destructor returns, on callback threads or inline; the server's
// handlers learn that their client is gone, and the server serves the next
// channel.
TEST_P(RpcSuite, DestroyingAChannelEndsItsPendingCalls) {
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("callback_threads ", callback_threads));
    constexpr int kCalls = 8;
    TestServer ts(GetParam().listen_addr(), /*max_message=*/64u << 20, /*workers=*/kCalls);
    ASSERT_TRUE(ts.server);
    std::vector<std::unique_ptr<AsyncCall>> calls;
    {
      ChannelOptions o;
      o.callback_threads = callback_threads;
      auto ch = MakeChannel(ts.address, o);
      ASSERT_TRUE(ch);
      calls = StartCalls(*ch, kEcho, kCalls, [](int) { return 30000; });
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (ts.service.started.load() < kCalls && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ASSERT_EQ(ts.service.started.load(), kCalls);
    }
    for (auto& c : calls) {
      auto f = c->result.get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
          << "the channel's destructor returned with a call pending";
      const Status s = f.get();
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    }
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (ts.service.saw_cancel.load() < kCalls && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(ts.service.saw_cancel.load(), kCalls);
    auto next = MakeChannel(ts.address);
    ClientContext ctx;
    EchoResponse resp;
    const Status s = next->Call(kEcho, &ctx, Req("next"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "next");
  }
}

TEST_P(RpcSuite, CancelStopsThePendingCallAndTheHandler) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ExpectCancelReachesRunningHandler(*ch, ts.service, kEcho, /*started_before=*/0);
}

// A ClientContext serves one call at a time: a call made with one whose call
// is still pending fails FAILED_PRECONDITION at once, blocking or not,
// unsent, and the pending call keeps its context: TryCancel still reaches it.
TEST_P(RpcSuite, ACallWithAContextStillInUseFailsAndLeavesTheOtherCallAlone) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  ExpectCancelReachesRunningHandler(*ch, ts.service, kEcho, 0, [&](ClientContext& busy) {
    EchoResponse resp;
    Status s = ch->Call(kEcho, &busy, Req("second"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("each call needs a ClientContext of its own"), std::string::npos)
        << s;
    // Shared: on the old code the call was sent, and its callback could
    // come after this returned.
    auto async = std::make_shared<std::promise<Status>>();
    EchoResponse async_resp;
    ch->CallAsync(kEcho, &busy, Req("third"), &async_resp,
                  [async](Status st) { async->set_value(std::move(st)); });
    auto f = async->get_future();
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "the asynchronous call with a context in use did not end at once";
    } else {
      EXPECT_EQ(f.get().code(), StatusCode::kFailedPrecondition);
    }
    EXPECT_EQ(ts.service.started.load(), 1) << "a call with a context in use reached the server";
  });
}

// Cancels and deadlines racing with responses: every call ends exactly once,
// with OK or the racing status, never anything else and never twice.
TEST_P(RpcSuite, CancelAndDeadlineRaceWithResponses) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  constexpr int kCalls = 2000;
  struct Call {
    ClientContext ctx;
    EchoResponse resp;
    std::atomic<int> completions{0};
    Status status;
    bool cancel = false;
  };
  std::vector<std::unique_ptr<Call>> calls(kCalls);
  std::atomic<int> done{0};
  std::mt19937 rng(42);
  for (int i = 0; i < kCalls; ++i) {
    calls[i] = std::make_unique<Call>();
    Call* c = calls[i].get();
    c->cancel = i % 2 == 0;
    if (!c->cancel) c->ctx.set_timeout(absl::Microseconds(rng() % 3000));
    ch->CallAsync(kEcho, &c->ctx, Req(std::to_string(i), static_cast<int>(rng() % 3)), &c->resp,
                  [c, &done](Status s) {
                    c->status = s;
                    c->completions.fetch_add(1);
                    done.fetch_add(1);
                  });
    if (c->cancel && rng() % 4 != 0) c->ctx.TryCancel();
  }
  for (int i = 0; i < kCalls; i += 2) calls[i]->ctx.TryCancel();
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (done.load() < kCalls && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(done.load(), kCalls) << "some calls never ended";
  absl::SleepFor(absl::Milliseconds(100));  // a second completion would show now
  for (int i = 0; i < kCalls; ++i) {
    Call& c = *calls[i];
    EXPECT_EQ(c.completions.load(), 1) << "call " << i;
    const StatusCode racing = c.cancel ? StatusCode::kCancelled : StatusCode::kDeadlineExceeded;
    EXPECT_TRUE(c.status.ok() || c.status.code() == racing) << "call " << i << ": " << c.status;
    if (c.status.ok()) {
      EXPECT_EQ(c.resp.data(), std::to_string(i));
    }
  }
  // The server is still fine.
  ClientContext ctx;
  EchoResponse resp;
  EXPECT_TRUE(ch->Call(kEcho, &ctx, Req("after"), &resp).ok());
  // An ended call leaves no cancel hook in its context, not even one whose
  // deadline ended it as it started: a cancel now, with the channel gone,
  // touches nothing (ASan would see a hook run on the freed channel).
  ch.reset();
  for (auto& c : calls) c->ctx.TryCancel();
}

TEST_P(RpcSuite, OversizeMessagesAreResourceExhaustedNamingTheLimit) {
  TestServer ts(GetParam().listen_addr(), /*max_message=*/64 * 1024);
  ASSERT_TRUE(ts.server);
  ChannelOptions small;
  small.max_message_size = 32 * 1024;
  auto ch = MakeChannel(ts.address, small);
  EchoResponse resp;
  {  // Too big for the channel: refused before sending.
    ClientContext ctx;
    Status s = ch->Call(kEcho, &ctx, Req(std::string(40 * 1024, 'a')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("32768"), absl::string_view::npos) << s;
  }
  auto big = MakeChannel(ts.address);
  {  // Too big for the server: that call fails, the connection stays.
    ClientContext ctx;
    Status s = big->Call(kEcho, &ctx, Req(std::string(100 * 1024, 'b')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("65536"), absl::string_view::npos) << s;
  }
  {  // A response too big for the server to send.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_size(80 * 1024);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  }
  {  // A response too big for the channel to accept.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_size(40 * 1024);
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  }
  ClientContext ctx;
  EXPECT_TRUE(big->Call(kEcho, &ctx, Req("still fine"), &resp).ok());
}

// Attachments at sizes on both sides of the RDMA transport's SEND/READ
// threshold (the default slot of 8 KiB less header), both ways, next to a
// message that must arrive intact too.
TEST_P(RpcSuite, AttachmentsTravelBothWaysBesideTheMessage) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (size_t size : {size_t{1}, size_t{4000}, size_t{8127}, size_t{8128}, size_t{8129},
                      size_t{65536}, size_t{1} << 20, size_t{8} << 20}) {
    for (bool in_place : {true, false}) {
      SCOPED_TRACE(absl::StrCat(size, in_place ? " bytes, allocated" : " bytes, copied"));
      std::string bytes(size, '\0');
      FillAttachment(bytes.data(), size);
      ClientContext ctx;
      if (in_place) {
        auto att = ch->AllocateAttachment(size);
        ASSERT_TRUE(att.ok()) << att.status();
        ASSERT_EQ(att->size(), size);
        FillAttachment(att->data(), size);
        ctx.set_request_attachment(std::move(*att));
      } else {
        ctx.set_request_attachment(Attachment::CopyOf(bytes));
      }
      EchoRequest req = Req("the message " + std::to_string(size));
      req.set_tag(static_cast<int64_t>(size));
      EchoResponse resp;
      Status s = ch->Call(kEcho, &ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(resp.data(), req.data());
      EXPECT_EQ(resp.tag(), req.tag());
      EXPECT_EQ(resp.attachment_size(), static_cast<int64_t>(size));
      EXPECT_EQ(resp.attachment_checksum(), AttachmentChecksum(bytes));
      ASSERT_EQ(ctx.response_attachment().size(), size);
      EXPECT_TRUE(ctx.response_attachment().view() == bytes);
    }
  }
}

TEST_P(RpcSuite, ResponseAttachmentWrittenInPlaceAndMessagesBeyondTheRoom) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (size_t size : {size_t{100}, size_t{3} << 20}) {
    SCOPED_TRACE(size);
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(static_cast<int64_t>(size));
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.attachment_size(), 0) << "no request attachment was sent";
    std::string expected(size, '\0');
    FillAttachment(expected.data(), size);
    EXPECT_TRUE(ctx.response_attachment().view() == expected);
  }
  // A message larger than the room left after the attachment still goes,
  // with the attachment copied once.
  const std::string message(5000, 'm');
  for (size_t size : {size_t{10}, size_t{1} << 20}) {
    SCOPED_TRACE(size);
    auto att = ch->AllocateAttachment(size, /*message_room=*/0);
    ASSERT_TRUE(att.ok()) << att.status();
    FillAttachment(att->data(), size);
    const uint64_t checksum = AttachmentChecksum(att->view());
    ClientContext ctx;
    ctx.set_request_attachment(std::move(*att));
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, Req(message), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), message);
    EXPECT_EQ(resp.attachment_size(), static_cast<int64_t>(size));
    EXPECT_EQ(resp.attachment_checksum(), checksum);
  }
}

TEST_P(RpcSuite, AttachmentsCountAgainstMaxMessageSize) {
  TestServer ts(GetParam().listen_addr(), /*max_message=*/64 * 1024);
  ASSERT_TRUE(ts.server);
  ChannelOptions small;
  small.max_message_size = 32 * 1024;
  auto ch = MakeChannel(ts.address, small);
  {
    auto att = ch->AllocateAttachment(40 * 1024);
    EXPECT_EQ(att.status().code(), StatusCode::kResourceExhausted) << att.status();
  }
  EchoResponse resp;
  {  // Attachment and message fit alone, not together.
    ClientContext ctx;
    ctx.set_request_attachment(Attachment::CopyOf(std::string(30 * 1024, 'a')));
    Status s = ch->Call(kEcho, &ctx, Req(std::string(3 * 1024, 'b')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 30720 bytes"), absl::string_view::npos) << s;
  }
  auto big = MakeChannel(ts.address);
  {  // Too big for the server to accept: that call fails, no attachment back.
    ClientContext ctx;
    ctx.set_request_attachment(Attachment::CopyOf(std::string(100 * 1024, 'c')));
    Status s = big->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  {  // A response attachment too big for the server to send.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(80 * 1024);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 81920 bytes"), absl::string_view::npos) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  {  // One no memory could hold: refused by the bound, not tried (a failed
     // allocation there would end the server).
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(int64_t{1} << 62);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 4611686018427387904 bytes exceeds "
                               "max_message_size 65536"),
              absl::string_view::npos)
        << s;
  }
  {  // The room asked for after an attachment is what a frame leaves: a
     // room near SIZE_MAX no longer wraps to a block shorter than the
     // attachment.
    auto att = ch->AllocateAttachment(100, SIZE_MAX);
    ASSERT_TRUE(att.ok()) << att.status();
    ASSERT_EQ(att->size(), 100u);
    FillAttachment(att->data(), 100);
    const uint64_t checksum = AttachmentChecksum(att->view());
    ClientContext ctx;
    ctx.set_request_attachment(std::move(*att));
    Status s = ch->Call(kEcho, &ctx, Req("after a room of SIZE_MAX"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.attachment_size(), 100);
    EXPECT_EQ(resp.attachment_checksum(), checksum);
  }
  {  // One too big for the channel to accept.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(40 * 1024);
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  ClientContext ctx;
  ctx.set_request_attachment(Attachment::CopyOf("fits"));
  ASSERT_TRUE(big->Call(kEcho, &ctx, Req("still fine"), &resp).ok());
  EXPECT_EQ(ctx.response_attachment().view(), "fits");
}

TEST_P(RpcSuite, ShutdownDrainsThenCancelsInFlightCalls) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  auto ch = MakeChannel(ts->address);
  constexpr int kQuick = 20, kSlow = 20;
  auto calls =
      StartCalls(*ch, kEcho, kQuick + kSlow, [](int i) { return i < kQuick ? 50 : 60000; });
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ts->service.started.load() < 4 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
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
  while (ts->service.started.load() < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
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

// After a failed attempt the channel does not try again before the backoff
// ends, even for a call that comes meanwhile: that call waits for the next
// attempt and its deadline ends it; destroying the channel wakes the wait.
// A call whose connection closed as its request was sent, so that the
// transport refused the request unsent, goes on the next connection, and
// the server sees it once: a plain call once more, a wait-for-ready call as
// often as it takes (there is no RetryPolicy here). SendFaults opens that
// window, microseconds wide in a real close, on purpose.
TEST_P(RpcSuite, ACallRefusedUnsentAsItsConnectionClosedGoesOnTheNextOne) {
  struct Disarm {
    ~Disarm() { internal::SendFaults::RefuseRequests() = 0; }
  } disarm;
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
  TestServer again(address);
  ASSERT_TRUE(again.server);
  ASSERT_EQ(ready_f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  const Status s = ready_f.get();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ready.resp.data(), "ready");
  EXPECT_EQ(ch->GetState(false), ChannelState::kReady);
  EXPECT_EQ(again.service.started.load(), 1) << "only the wait-for-ready call was left to send";
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

// Generated code end to end: a generated Stub calls a generated Service in
// all three client forms; the service finishes asynchronously on its own
// thread.
class GeneratedEcho : public examples::Echo::Service {
 public:
  ~GeneratedEcho() override {
    for (auto& t : threads_) t.join();
  }
  void SayAsync(ServerContext*, const examples::EchoRequest* request,
                examples::EchoResponse* response, DoneCallback done) override {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t n = ++calls_;
    threads_.emplace_back([request, response, n, done = std::move(done)]() mutable {
      response->set_payload(request->payload());
      response->set_server_calls(n);
      std::move(done)(Status());
    });
  }

 private:
  std::mutex mu_;
  uint64_t calls_ = 0;
  std::vector<std::thread> threads_;
};

TEST_P(RpcSuite, GeneratedStubCallsGeneratedService) {
  GeneratedEcho service;
  auto built = ServerBuilder()
                   .AddListeningPort(GetParam().listen_addr())
                   .RegisterService(&service)
                   .BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  auto ch = MakeChannel((*built)->addresses()[0]);
  auto stub = examples::Echo::NewStub(ch);
  examples::EchoRequest req;
  req.set_payload("generated");

  ClientContext c1;
  examples::EchoResponse r1;
  Status s = stub->Say(&c1, req, &r1);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(r1.payload(), "generated");

  ClientContext c2;
  examples::EchoResponse r2;
  std::promise<Status> p2;
  stub->AsyncSay(&c2, req, &r2, [&](Status st) { p2.set_value(st); });
  EXPECT_TRUE(p2.get_future().get().ok());
  EXPECT_EQ(r2.payload(), "generated");

  ClientContext c3;
  auto f3 = stub->SayFuture(&c3, req).get();
  ASSERT_TRUE(f3.ok()) << f3.status();
  EXPECT_EQ(f3->payload(), "generated");
  EXPECT_EQ(f3->server_calls(), 3u);
}

// A generated service that throws from its blocking handler for some
// requests and drops `done` for others.
class CarelessEcho : public examples::Echo::Service {
 public:
  Status Say(ServerContext*, const examples::EchoRequest* request,
             examples::EchoResponse* response) override {
    response->set_payload("half written");
    if (request->payload() == "throw") throw std::out_of_range("no entry for 'throw'");
    if (request->payload() == "throw 7") throw 7;
    response->set_payload(request->payload());
    return Status();
  }
  void SayAsync(ServerContext* ctx, const examples::EchoRequest* request,
                examples::EchoResponse* response, DoneCallback done) override {
    if (request->payload() == "drop") return;
    examples::Echo::Service::SayAsync(ctx, request, response, std::move(done));
  }
};

// A handler that throws, or drops `done`, ends its own call UNKNOWN at once;
// the server lives on and serves the next call on the same connection, on
// workers and inline on the I/O thread alike.
TEST_P(RpcSuite, AHandlerThatThrowsOrDropsDoneEndsOnlyItsCall) {
  for (int workers : {2, 0}) {
    SCOPED_TRACE(absl::StrCat(workers, " workers"));
    CarelessEcho service;
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&service)
                     .SetWorkerThreads(workers)
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    auto stub = examples::Echo::NewStub(MakeChannel((*built)->addresses()[0]));
    for (const std::string payload : {"throw", "throw 7", "drop"}) {
      SCOPED_TRACE(payload);
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(30));
      examples::EchoRequest req;
      req.set_payload(payload);
      examples::EchoResponse resp;
      Status s = stub->Say(&ctx, req, &resp);
      EXPECT_EQ(s.code(), StatusCode::kUnknown) << s;
      EXPECT_EQ(s.message(), payload == "drop"
                                 ? "/rdmarpc.examples.Echo/Say: the handler did not call done"
                                 : "/rdmarpc.examples.Echo/Say: the handler threw an exception");
      EXPECT_EQ(resp.payload(), "");
    }
    ClientContext ctx;
    examples::EchoRequest req;
    req.set_payload("fine");
    examples::EchoResponse resp;
    Status s = stub->Say(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.payload(), "fine");
  }
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
// is refused RESOURCE_EXHAUSTED, its handler not run, while health checks
// still answer; once the slow calls end, calls go through again. With
// workers, and with inline handlers that finish on threads of their own.
TEST_P(RpcSuite, CallsOverTheServersLimitAreRefusedAndHealthChecksAreNot) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    EchoService service;
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&service)
                     .SetWorkerThreads(workers)
                     .SetMaxConcurrentCalls(2)
                     .EnableHealthService()
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

// A front end that relays Echo to a backend, as a handler that calls
// another service does: with a context made by FromServerContext, whose
// deadline it records. With tag 1 it first waits for its own call to be
// cancelled, then relays; with tag 2 it relays asynchronously over a
// channel with inline callbacks, and the callback destroys the context (as
// the cancel runs it, inside CallTree::CancelAll).
class RelayService : public Service {
 public:
  static constexpr MethodInfo kRelay{"/rdmarpc.test.Relay/Relay",
                                     MethodId("/rdmarpc.test.Relay/Relay")};
  RelayService(std::shared_ptr<Channel> backend, std::shared_ptr<Channel> backend_inline)
      : backend_(std::move(backend)), backend_inline_(std::move(backend_inline)) {
    AddMethod(
        kRelay.full_name,
        UnaryHandler<EchoRequest, EchoResponse>([this](ServerContext* ctx, const EchoRequest* req,
                                                       EchoResponse* resp, DoneCallback done) {
          started.fetch_add(1);
          if (req->tag() == 1) {
            const absl::Time until = absl::Now() + absl::Seconds(20);
            while (!ctx->IsCancelled() && absl::Now() < until) {
              absl::SleepFor(absl::Milliseconds(1));
            }
          }
          auto child = ClientContext::FromServerContext(*ctx);
          child_deadline.set_value(child->deadline());
          if (req->tag() == 2) {
            ClientContext* raw = child.get();
            backend_inline_->CallAsync(
                kEcho, raw, *req, resp,
                [this, child = std::move(child), done = std::move(done)](Status s) mutable {
                  child.reset();
                  child_status.set_value(s);
                  std::move(done)(s);
                });
            return;
          }
          const Status s = backend_->Call(kEcho, child.get(), *req, resp);
          child_status.set_value(s);
          std::move(done)(s);
        }));
  }

  std::atomic<int> started{0};
  std::promise<absl::Time> child_deadline;
  std::promise<Status> child_status;

 private:
  const std::shared_ptr<Channel> backend_;
  const std::shared_ptr<Channel> backend_inline_;
};

// Calls a handler makes with ClientContext::FromServerContext carry its
// deadline and end CANCELLED when its call is cancelled, so the backend
// stops too; one made after the cancel ends CANCELLED without being sent.
TEST_P(RpcSuite, CallsMadeForACallFollowItsDeadlineAndCancellation) {
  for (int tag : {0, 1, 2}) {
    SCOPED_TRACE(absl::StrCat("tag ", tag));
    TestServer backend(GetParam().listen_addr());
    ASSERT_TRUE(backend.server);
    RelayService relay(MakeChannel(backend.address),
                       MakeChannel(backend.address, InlineCallbacks()));
    auto front = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&relay)
                     .BuildAndStart();
    ASSERT_TRUE(front.ok()) << front.status();
    auto ch = MakeChannel((*front)->addresses()[0]);
    AsyncCall call;
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    call.ctx.set_deadline(deadline);
    EchoRequest req = Req("relayed", 30000);
    req.set_tag(tag);
    ch->CallAsync(RelayService::kRelay, &call.ctx, req, &call.resp,
                  [&](Status s) { call.result.set_value(s); });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (relay.started.load() < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_EQ(relay.started.load(), 1);
    if (tag != 1) {
      auto child_deadline = relay.child_deadline.get_future();
      ASSERT_EQ(child_deadline.wait_for(std::chrono::seconds(20)), std::future_status::ready);
      // The server's deadline is its arrival plus the time left, in us.
      EXPECT_LT(absl::AbsDuration(child_deadline.get() - deadline), absl::Seconds(2));
      while (backend.service.started.load() < 1 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ASSERT_EQ(backend.service.started.load(), 1);
    }
    call.ctx.TryCancel();
    auto result = call.result.get_future();
    ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    EXPECT_EQ(result.get().code(), StatusCode::kCancelled);
    auto child = relay.child_status.get_future();
    ASSERT_EQ(child.wait_for(std::chrono::seconds(20)), std::future_status::ready)
        << "the relayed call went on after the call it was made for was cancelled";
    const Status child_status = child.get();
    EXPECT_EQ(child_status.code(), StatusCode::kCancelled) << child_status;
    if (tag != 1) {
      while (backend.service.saw_cancel.load() < 1 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      EXPECT_EQ(backend.service.saw_cancel.load(), 1) << "the backend's handler never saw it";
    } else {
      EXPECT_EQ(backend.service.started.load(), 0) << "a call made after the cancel was sent";
    }
    (*front)->Shutdown();
  }
}

// A parked call hears of each way a call is cancelled through OnCancel, and
// is released by finishing from it; an answered call's callback never runs.
TEST_P(RpcSuite, OnCancelTellsAParkedCallEachWayItsCallEnds) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat(workers, " workers"));
    ParkService park;
    auto built = ServerBuilder()
                     .AddListeningPort(GetParam().listen_addr())
                     .RegisterService(&park)
                     .SetWorkerThreads(workers)
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    Server& server = **built;
    const std::string address = server.addresses()[0];
    auto ch = MakeChannel(address);
    const auto start = [&](AsyncCall& call, int tag) {
      EchoRequest req = Req("parked");
      req.set_tag(tag);
      const int before = park.parked_calls.load();
      ch->CallAsync(ParkService::kPark, &call.ctx, req, &call.resp,
                    [&call](Status s) { call.result.set_value(s); });
      if (tag == 1) return;  // parks only once cancelled
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (park.parked_calls.load() == before && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ASSERT_GT(park.parked_calls.load(), before) << "the call never reached its handler";
    };
    const auto result = [](AsyncCall& call) {
      auto f = call.result.get_future();
      EXPECT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
      return f.get();
    };
    const auto released = [&] {
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (server.stats().calls_in_flight > 0 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      return server.stats().calls_in_flight == 0;
    };
    {
      SCOPED_TRACE("the client cancels");
      AsyncCall call;
      start(call, 0);
      call.ctx.TryCancel();
      EXPECT_EQ(result(call).code(), StatusCode::kCancelled);
      ASSERT_TRUE(park.WaitForCancels(1)) << "the parked call never heard of the cancel";
      EXPECT_TRUE(released()) << "the server still holds the cancelled call";
    }
    {
      SCOPED_TRACE("the deadline passes (the client cancels then)");
      AsyncCall call;
      const absl::Time begun = absl::Now();
      // Long enough for the handler to have parked the call first, also
      // under sanitizers in the VM.
      call.ctx.set_timeout(absl::Seconds(1));
      start(call, 0);
      EXPECT_EQ(result(call).code(), StatusCode::kDeadlineExceeded);
      ASSERT_TRUE(park.WaitForCancels(2)) << "the parked call never heard of its deadline";
      EXPECT_GE(absl::FromUnixMicros(park.cancelled_at.load()) - begun, absl::Milliseconds(900))
          << "cancelled before its deadline";
      EXPECT_TRUE(released());
    }
    {
      SCOPED_TRACE("answered: the callback never runs, not even at the deadline");
      AsyncCall call;
      call.ctx.set_timeout(absl::Seconds(1));
      start(call, 2);
      const Status s = result(call);
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(call.resp.data(), "parked");
      absl::SleepFor(absl::Milliseconds(1500));
      EXPECT_EQ(park.cancels.load(), 2);
    }
    if (workers != 0) {  // an inline handler that waits would hold the I/O thread
      SCOPED_TRACE("registered once cancelled: runs at once, on the handler's thread");
      AsyncCall call;
      const int started = park.handlers_started.load();
      start(call, 1);
      // Cancelled before a worker took it up, the call would end without
      // running its handler, and register nothing.
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (park.handlers_started.load() == started && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      call.ctx.TryCancel();
      EXPECT_EQ(result(call).code(), StatusCode::kCancelled);
      ASSERT_TRUE(park.WaitForCancels(3));
      EXPECT_TRUE(park.on_handler_thread.load());
      EXPECT_TRUE(released());
    }
    {
      SCOPED_TRACE("the connection is lost");
      const int before = park.cancels.load();
      auto lost = MakeChannel(address);
      AsyncCall call;
      EchoRequest req = Req("parked");
      const int parked_before = park.parked_calls.load();
      lost->CallAsync(ParkService::kPark, &call.ctx, req, &call.resp,
                      [&call](Status s) { call.result.set_value(s); });
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (park.parked_calls.load() == parked_before && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      lost.reset();
      EXPECT_EQ(result(call).code(), StatusCode::kUnavailable);
      ASSERT_TRUE(park.WaitForCancels(before + 1)) << "the parked call never heard of the loss";
      EXPECT_TRUE(released());
    }
    {
      SCOPED_TRACE("the server shuts down past its grace period");
      const int before = park.cancels.load();
      AsyncCall call;
      start(call, 0);
      server.Shutdown(absl::Milliseconds(100));
      EXPECT_EQ(park.cancels.load(), before + 1) << "Shutdown returned before the callback ran";
      EXPECT_EQ(result(call).code(), StatusCode::kCancelled);
    }
  }
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

// What the interceptors of the test below saw, in order.
class Journal {
 public:
  void Add(std::string line) {
    std::lock_guard<std::mutex> lock(mu_);
    lines_.push_back(std::move(line));
  }
  std::vector<std::string> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(lines_, {});
  }

 private:
  std::mutex mu_;
  std::vector<std::string> lines_;
};

// Logs each call in and out, tags its answer, and with `require_token`
// refuses calls without the token.
class JournalingServerInterceptor : public ServerInterceptor {
 public:
  JournalingServerInterceptor(std::string name, Journal* journal, bool require_token)
      : name_(std::move(name)), journal_(journal), require_token_(require_token) {}
  Status OnRequest(ServerContext& ctx) override {
    journal_->Add(absl::StrCat(name_, " in ", ctx.method()));
    if (!require_token_) return Status();
    for (const auto& [key, value] : ctx.client_metadata()) {
      if (key == "token" && value == "yes") return Status();
    }
    return Status(StatusCode::kUnauthenticated, "no token");
  }
  void OnResponse(ServerContext& ctx, const Status& status) override {
    journal_->Add(absl::StrCat(name_, " out ", absl::StatusCodeToString(status.code())));
    ctx.AddResponseMetadata("seen-by", name_);
  }

 private:
  const std::string name_;
  Journal* const journal_;
  const bool require_token_;
};

class TokenInterceptor : public ClientInterceptor {
 public:
  explicit TokenInterceptor(Journal* journal) : journal_(journal) {}
  void OnStart(ClientContext& ctx, absl::string_view method) override {
    journal_->Add(absl::StrCat("start ", method));
    ctx.AddMetadata("token", "yes");
  }
  void OnEnd(const ClientContext&, absl::string_view method, const Status& status) override {
    journal_->Add(absl::StrCat("end ", method, " ", absl::StatusCodeToString(status.code())));
  }

 private:
  Journal* const journal_;
};

TEST_P(RpcSuite, InterceptorsWrapEveryCallAndMayRefuseOne) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    Journal on_server, on_client;
    EchoService echo;
    auto server =
        ServerBuilder()
            .AddListeningPort(GetParam().listen_addr())
            .RegisterService(&echo)
            .SetWorkerThreads(workers)
            .AddInterceptor(
                std::make_shared<JournalingServerInterceptor>("outer", &on_server, false))
            .AddInterceptor(std::make_shared<JournalingServerInterceptor>("auth", &on_server, true))
            .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    const std::string address = (*server)->addresses()[0];
    const std::string echo_name = kEcho.full_name;

    // Without the token the second interceptor refuses the call: the handler
    // does not run, and both OnResponse see the refusal, innermost first.
    auto plain = MakeChannel(address);
    {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(20));
      EchoResponse resp;
      const Status s = plain->Call(kEcho, &ctx, Req("refused"), &resp);
      EXPECT_EQ(s.code(), StatusCode::kUnauthenticated) << s;
      EXPECT_EQ(s.message(), "no token");
      EXPECT_EQ(echo.started.load(), 0);
      EXPECT_EQ(on_server.Take(), (std::vector<std::string>{
                                      "outer in " + echo_name, "auth in " + echo_name,
                                      "auth out UNAUTHENTICATED", "outer out UNAUTHENTICATED"}));
      EXPECT_EQ(ctx.server_metadata(), (Metadata{{"seen-by", "auth"}, {"seen-by", "outer"}}));
    }

    // The client's interceptor adds it, and sees each call start and end:
    // blocking, asynchronous, and one that ends on the client.
    ChannelOptions options;
    options.interceptors.push_back(std::make_shared<TokenInterceptor>(&on_client));
    auto with_token = MakeChannel(address, options);
    {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(20));
      EchoResponse resp;
      const Status s = with_token->Call(kEcho, &ctx, Req("served"), &resp);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(resp.data(), "served");
      EXPECT_EQ(echo.started.load(), 1);
      EXPECT_EQ(on_server.Take(),
                (std::vector<std::string>{"outer in " + echo_name, "auth in " + echo_name,
                                          "auth out OK", "outer out OK"}));
      EXPECT_EQ(on_client.Take(),
                (std::vector<std::string>{"start " + echo_name, "end " + echo_name + " OK"}));
    }
    {
      AsyncCall call;
      call.ctx.set_timeout(absl::Seconds(20));
      with_token->CallAsync(kEcho, &call.ctx, Req("async"), &call.resp,
                            [&](Status s) { call.result.set_value(s); });
      auto f = call.result.get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
      EXPECT_TRUE(f.get().ok());
      EXPECT_EQ(on_client.Take(),
                (std::vector<std::string>{"start " + echo_name, "end " + echo_name + " OK"}));
    }
    {
      ClientContext ctx;
      ctx.set_deadline(absl::Now() - absl::Seconds(1));
      EchoResponse resp;
      EXPECT_EQ(with_token->Call(kEcho, &ctx, Req("late"), &resp).code(),
                StatusCode::kDeadlineExceeded);
      EXPECT_EQ(on_client.Take(),
                (std::vector<std::string>{"start " + echo_name,
                                          "end " + echo_name + " DEADLINE_EXCEEDED"}));
    }
    EXPECT_EQ(echo.started.load(), 2);
    EXPECT_EQ(on_server.Take(),
              (std::vector<std::string>{"outer in " + echo_name, "auth in " + echo_name,
                                        "auth out OK", "outer out OK"}))
        << "the asynchronous call; the late one never left the client";
  }
}

// Parks each call with tag 1 behind an OnCancel callback whose cleanup
// throws before it can run `done`; answers the others.
class ThrowOnCancelService : public Service {
 public:
  static constexpr MethodInfo kPark{"/rdmarpc.test.ThrowOnCancel/Park",
                                    MethodId("/rdmarpc.test.ThrowOnCancel/Park")};
  ThrowOnCancelService() {
    AddMethod(
        kPark.full_name,
        UnaryHandler<EchoRequest, EchoResponse>([this](ServerContext* ctx, const EchoRequest* req,
                                                       EchoResponse* resp, DoneCallback done) {
          if (req->tag() != 1) {
            resp->set_data(req->data());
            return std::move(done)(Status());
          }
          ctx->OnCancel([this, done = std::move(done)]() mutable {
            cancels.fetch_add(1);
            CleanUp();
            std::move(done)(Status(StatusCode::kCancelled, "cleaned up"));
          });
          parked.fetch_add(1);
        }));
  }
  std::atomic<int> parked{0};
  std::atomic<int> cancels{0};

 private:
  static void CleanUp() { throw std::runtime_error("cleanup failed"); }
};

// An OnCancel callback that throws, on the thread that saw the cancellation
// (the I/O thread for a client's cancel, the timer thread for a deadline),
// is logged; the server serves on, and the call's `done`, dropped with the
// callback, still releases it.
TEST_P(RpcSuite, AnOnCancelCallbackThatThrowsEndsOnlyItsCall) {
  ThrowOnCancelService service;
  auto built = ServerBuilder()
                   .AddListeningPort(GetParam().listen_addr())
                   .RegisterService(&service)
                   .BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  Server& server = **built;
  auto ch = MakeChannel(server.addresses()[0]);
  const auto wait_for = [](const std::atomic<int>& n, int want) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (n.load() < want && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    return n.load() >= want;
  };
  for (bool by_deadline : {false, true}) {
    SCOPED_TRACE(by_deadline ? "the deadline passes" : "the client cancels");
    const int n = by_deadline ? 2 : 1;
    AsyncCall call;
    if (by_deadline) call.ctx.set_timeout(absl::Seconds(1));
    EchoRequest req = Req("parked");
    req.set_tag(1);
    ch->CallAsync(ThrowOnCancelService::kPark, &call.ctx, req, &call.resp,
                  [&call](Status st) { call.result.set_value(st); });
    ASSERT_TRUE(wait_for(service.parked, n)) << "the call never reached its handler";
    if (!by_deadline) call.ctx.TryCancel();
    auto f = call.result.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    EXPECT_EQ(f.get().code(), by_deadline ? StatusCode::kDeadlineExceeded : StatusCode::kCancelled);
    ASSERT_TRUE(wait_for(service.cancels, n)) << "the OnCancel callback never ran";
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (server.stats().calls_in_flight > 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(server.stats().calls_in_flight, 0u) << "the server still holds the call";
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    EchoResponse resp;
    Status s = ch->Call(ThrowOnCancelService::kPark, &ctx, Req("next"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "next");
  }
}

// The value of a call's metadata "throw-in": where the throwing
// interceptors below throw.
std::string ThrowIn(const Metadata& md) {
  for (const auto& [key, value] : md) {
    if (key == "throw-in") return value;
  }
  return "";
}

// Throws where the client's metadata "throw-in" says: "request" in
// OnRequest (as a token parser might on a malformed token), "response" in
// OnResponse. Counts the OnResponse calls it saw.
class ThrowingInterceptor : public ServerInterceptor {
 public:
  Status OnRequest(ServerContext& ctx) override {
    if (ThrowIn(ctx.client_metadata()) == "request") throw std::invalid_argument("malformed token");
    return Status();
  }
  void OnResponse(ServerContext& ctx, const Status&) override {
    responses.fetch_add(1);
    if (ThrowIn(ctx.client_metadata()) == "response") {
      throw std::runtime_error("metrics backend down");
    }
  }
  std::atomic<int> responses{0};
};

// An interceptor that throws in OnRequest refuses that call UNKNOWN (its
// OnResponse still runs); one that throws in OnResponse leaves the answer as
// it was. The server serves on, with workers and inline alike.
TEST_P(RpcSuite, AnInterceptorThatThrowsEndsOnlyItsCall) {
  for (int workers : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("workers ", workers));
    auto throwing = std::make_shared<ThrowingInterceptor>();
    EchoService echo;
    auto server = ServerBuilder()
                      .AddListeningPort(GetParam().listen_addr())
                      .RegisterService(&echo)
                      .SetWorkerThreads(workers)
                      .AddInterceptor(throwing)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    auto ch = MakeChannel((*server)->addresses()[0]);
    const auto call = [&](const std::string& where) {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(20));
      ctx.AddMetadata("throw-in", where);
      EchoResponse resp;
      Status s = ch->Call(kEcho, &ctx, Req(where), &resp);
      if (s.ok()) {
        EXPECT_EQ(resp.data(), where);
      }
      return s;
    };
    Status s = call("request");
    EXPECT_EQ(s.code(), StatusCode::kUnknown) << s;
    EXPECT_EQ(s.message(), absl::StrCat(kEcho.full_name, ": an interceptor threw an exception"));
    EXPECT_EQ(echo.started.load(), 0) << "the handler ran past a refusing interceptor";
    EXPECT_TRUE(call("response").ok());
    EXPECT_TRUE(call("nowhere").ok());
    EXPECT_EQ(echo.started.load(), 2);
    EXPECT_EQ(throwing->responses.load(), 3);
  }
}

// Journals each call's start and end under `name`, and throws where the
// call's metadata "throw-in" says: "start" in OnStart, "end" in OnEnd (as a
// metrics exporter might whose backend is down).
class ThrowingClientInterceptor : public ClientInterceptor {
 public:
  ThrowingClientInterceptor(std::string name, Journal* journal, bool throws)
      : name_(std::move(name)), journal_(journal), throws_(throws) {}
  void OnStart(ClientContext& ctx, absl::string_view) override {
    journal_->Add(name_ + " start");
    if (throws_ && ThrowIn(ctx.metadata()) == "start") throw std::runtime_error("no tracing span");
  }
  void OnEnd(const ClientContext& ctx, absl::string_view, const Status& status) override {
    journal_->Add(absl::StrCat(name_, " end ", absl::StatusCodeToString(status.code())));
    if (throws_ && ThrowIn(ctx.metadata()) == "end")
      throw std::runtime_error("metrics backend down");
  }

 private:
  const std::string name_;
  Journal* const journal_;
  const bool throws_;
};

// The client's side of the rule above: a throw from an interceptor's OnStart
// ends that call UNKNOWN unsent (the OnEnd of it and those before it run),
// one from OnEnd leaves the status as it was, and one from an asynchronous
// callback is logged and goes no further. The channel serves on, with
// callbacks on callback threads and inline (on the I/O thread).
TEST_P(RpcSuite, AClientCallbackOrInterceptorThatThrowsEndsOnlyItsCall) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_NE(ts.server, nullptr);
  EchoService& echo = ts.service;
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("callback_threads ", callback_threads));
    Journal journal;
    // Before the channel, whose destruction ends the calls still pending if
    // the test gives up on them.
    std::atomic<int> ran{0};
    std::vector<std::unique_ptr<ClientContext>> contexts;
    std::vector<EchoResponse> responses(3);
    std::promise<Status> last;
    ChannelOptions options;
    options.callback_threads = callback_threads;
    options.interceptors = {std::make_shared<ThrowingClientInterceptor>("outer", &journal, false),
                            std::make_shared<ThrowingClientInterceptor>("thrower", &journal, true),
                            std::make_shared<ThrowingClientInterceptor>("inner", &journal, false)};
    auto ch = MakeChannel(ts.address, options);
    const int started_before = echo.started.load();
    ::testing::internal::CaptureStderr();

    const auto call = [&](const std::string& where, EchoResponse* resp) {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(20));
      ctx.AddMetadata("throw-in", where);
      return ch->Call(kEcho, &ctx, Req(where), resp);
    };
    EchoResponse resp;
    Status s = call("start", &resp);
    EXPECT_EQ(s.code(), StatusCode::kUnknown) << s;
    EXPECT_EQ(s.message(), absl::StrCat(kEcho.full_name, ": an interceptor threw an exception"));
    EXPECT_EQ(echo.started.load(), started_before) << "a call whose OnStart threw was sent";
    EXPECT_EQ(journal.Take(),
              (std::vector<std::string>{"outer start", "thrower start", "thrower end UNKNOWN",
                                        "outer end UNKNOWN"}));

    s = call("end", &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "end");
    EXPECT_EQ(journal.Take(),
              (std::vector<std::string>{"outer start", "thrower start", "inner start",
                                        "inner end OK", "thrower end OK", "outer end OK"}));

    // Two asynchronous calls whose callbacks throw, then one whose does not.
    for (int i = 0; i < 3; ++i) {
      contexts.push_back(std::make_unique<ClientContext>());
      contexts.back()->set_timeout(absl::Seconds(20));
      ch->CallAsync(kEcho, contexts.back().get(), Req("async"), &responses[i],
                    [&, i](Status status) {
                      ran.fetch_add(1);
                      if (i < 2) throw std::runtime_error("callback bug");
                      last.set_value(std::move(status));
                    });
    }
    auto done = last.get_future();
    if (done.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      ADD_FAILURE() << "the asynchronous call after two throwing callbacks did not end";
    } else {
      EXPECT_TRUE(done.get().ok());
    }
    s = call("nowhere", &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "nowhere");
    journal.Take();
    // Joins the threads the callbacks ran on: every throw is logged by then.
    ch.reset();
    EXPECT_EQ(ran.load(), 3);

    const std::string logged = ::testing::internal::GetCapturedStderr();
    const std::string method = kEcho.full_name;
    for (const std::string& line :
         {"rdmarpc: an interceptor's OnStart threw (call " + method + "): no tracing span",
          "rdmarpc: an interceptor's OnEnd threw (call " + method + "): metrics backend down",
          "rdmarpc: the callback threw (call " + method + "): callback bug"}) {
      EXPECT_NE(logged.find(line), std::string::npos) << line << "\nnot in:\n" << logged;
    }
  }
}

// Refuses the first `failures` calls UNAVAILABLE, as a server that is
// briefly unable to serve would, and counts the calls it saw.
class FlakyInterceptor : public ServerInterceptor {
 public:
  Status OnRequest(ServerContext&) override {
    seen.fetch_add(1);
    if (failures.fetch_sub(1) > 0) return Status(StatusCode::kUnavailable, "flaky");
    return Status();
  }
  std::atomic<int> failures{0};
  std::atomic<int> seen{0};
};

TEST_P(RpcSuite, ARetryPolicySendsACallAgainWhileItsAttemptsAndDeadlineAllow) {
  auto flaky = std::make_shared<FlakyInterceptor>();
  EchoService echo;
  auto server = ServerBuilder()
                    .AddListeningPort(GetParam().listen_addr())
                    .RegisterService(&echo)
                    .AddInterceptor(flaky)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->addresses()[0];
  ChannelOptions options;
  options.retry.max_attempts = 3;
  options.retry.initial_backoff = absl::Milliseconds(20);
  auto ch = MakeChannel(address, options);
  const auto call = [&](std::shared_ptr<Channel>& channel, EchoRequest req,
                        absl::Duration timeout = absl::Seconds(20), bool retryable = true) {
    ClientContext ctx;
    ctx.set_timeout(timeout);
    ctx.set_retryable(retryable);
    EchoResponse resp;
    Status s = channel->Call(kEcho, &ctx, req, &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.data(), req.data());
    }
    return s;
  };
  const auto attempts = [&](int failures) {
    flaky->failures = failures;
    return flaky->seen.exchange(0);
  };

  attempts(2);
  EXPECT_TRUE(call(ch, Req("third time")).ok());
  EXPECT_EQ(attempts(3), 3) << "two refusals, then served";
  EXPECT_EQ(echo.started.load(), 1);
  EXPECT_EQ(ch->stats().retries, 2u);

  Status s = call(ch, Req("never"));
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.message(), "flaky");
  EXPECT_EQ(attempts(0), 3) << "max_attempts, then the last attempt's status";
  EXPECT_EQ(ch->stats().retries, 4u);

  EchoRequest internal = Req("internal");
  internal.set_fail_code(static_cast<int>(StatusCode::kInternal));
  EXPECT_EQ(call(ch, internal).code(), StatusCode::kInternal);
  EXPECT_EQ(attempts(1), 1) << "INTERNAL is not in retryable_codes";

  EXPECT_EQ(call(ch, Req("once"), absl::Seconds(20), /*retryable=*/false).code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(attempts(1), 1) << "set_retryable(false)";

  {
    // Its memory went with the first attempt: never sent again.
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    auto att = ch->AllocateAttachment(1000);
    ASSERT_TRUE(att.ok()) << att.status();
    ctx.set_request_attachment(std::move(*att));
    EchoResponse resp;
    EXPECT_EQ(ch->Call(kEcho, &ctx, Req("attached"), &resp).code(), StatusCode::kUnavailable);
    EXPECT_EQ(attempts(1), 1) << "a call with a request attachment";
  }
  EXPECT_EQ(ch->stats().retries, 4u);

  // A backoff that would end past the deadline is not waited.
  ChannelOptions slow = options;
  slow.retry.initial_backoff = absl::Seconds(5);
  slow.retry.max_backoff = absl::Seconds(5);
  auto slow_ch = MakeChannel(address, slow);
  const absl::Time began = absl::Now();
  EXPECT_EQ(call(slow_ch, Req("late"), absl::Seconds(2)).code(), StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - began, absl::Seconds(2));
  EXPECT_EQ(attempts(1), 1);

  // A cancel during the backoff ends the call; nothing more is sent.
  ChannelOptions patient = options;
  patient.retry.initial_backoff = absl::Milliseconds(300);
  auto patient_ch = MakeChannel(address, patient);
  AsyncCall cancelled;
  cancelled.ctx.set_timeout(absl::Seconds(20));
  patient_ch->CallAsync(kEcho, &cancelled.ctx, Req("cancelled"), &cancelled.resp,
                        [&](Status st) { cancelled.result.set_value(st); });
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (patient_ch->stats().retries < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(patient_ch->stats().retries, 1u);
  cancelled.ctx.TryCancel();
  auto f = cancelled.result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kCancelled);
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_EQ(attempts(0), 1) << "sent again after its cancel";
  EXPECT_EQ(echo.started.load(), 2) << "the served call and the INTERNAL one";
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

// Threads of this process.
int ThreadCount() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// The threads a channel keeps once connected: its connector thread, which
// ends once nothing waits for a connection, may outlive the first call by a
// moment.
int SettledThreadCount(int at_most) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  int n = ThreadCount();
  while (n > at_most && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
    n = ThreadCount();
  }
  return n;
}

std::shared_ptr<ChannelGroup> MakeGroup(int callback_threads = 2) {
  ChannelOptions o;
  o.callback_threads = callback_threads;
  auto group = ChannelGroup::Create(o);
  EXPECT_TRUE(group.ok()) << group.status();
  return group.ok() ? *group : nullptr;
}

// Channels of a group, one per server, each reach their own server, and
// together they add the threads of one channel, not of one per server.
TEST_P(RpcSuite, GroupedChannelsShareThreadsAndEachReachesItsServer) {
  constexpr int kServers = 6;
  std::vector<std::unique_ptr<TestServer>> servers;
  for (int i = 0; i < kServers; ++i) {
    servers.push_back(std::make_unique<TestServer>(GetParam().listen_addr()));
    ASSERT_TRUE(servers.back()->server);
  }
  const auto call_each = [&](const std::vector<std::shared_ptr<Channel>>& channels) {
    for (int i = 0; i < kServers; ++i) {
      const int before = servers[i]->service.started.load();
      ClientContext ctx;
      EchoResponse resp;
      const std::string data = absl::StrCat("to server ", i);
      const Status s = channels[i]->Call(kEcho, &ctx, Req(data), &resp);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(resp.data(), data);
      EXPECT_EQ(servers[i]->service.started.load(), before + 1) << "answered by another server";
    }
  };
  const int at_start = ThreadCount();
  int lone_threads;
  {
    std::vector<std::shared_ptr<Channel>> lone;
    for (auto& ts : servers) lone.push_back(MakeChannel(ts->address));
    call_each(lone);
    lone_threads = ThreadCount() - at_start;
  }
  auto group = MakeGroup();
  ASSERT_TRUE(group);
  const int before_group = ThreadCount();
  std::vector<std::shared_ptr<Channel>> grouped;
  for (auto& ts : servers) {
    auto ch = group->NewChannel(ts->address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    grouped.push_back(*ch);
  }
  call_each(grouped);
  const int group_threads = SettledThreadCount(before_group + 4) - before_group;
  printf("%d channels: %d threads alone, %d in a group (besides its timer and callback threads)\n",
         kServers, lone_threads, group_threads);
  // The group's transport: an I/O thread and a connection thread at most per
  // scheme and device, far from the 3+ per channel of lone channels.
  EXPECT_LE(group_threads, 4);
  EXPECT_GE(lone_threads, 3 * kServers);
}

// Destroying one channel of a group ends its own pending calls before the
// destructor returns and leaves the other channels' calls and connections
// alone; the group may go before its channels.
TEST_P(RpcSuite, DestroyingAGroupedChannelEndsOnlyItsCalls) {
  for (int callback_threads : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("callback_threads ", callback_threads));
    constexpr int kCalls = 4;
    TestServer ts(GetParam().listen_addr(), /*max_message=*/64u << 20, /*workers=*/2 * kCalls);
    ASSERT_TRUE(ts.server);
    auto group = MakeGroup(callback_threads);
    ASSERT_TRUE(group);
    auto doomed = group->NewChannel(ts.address);
    auto kept = group->NewChannel(ts.address);
    ASSERT_TRUE(doomed.ok() && kept.ok());
    group.reset();
    auto doomed_calls = StartCalls(**doomed, kEcho, kCalls, [](int) { return 30000; });
    auto kept_calls = StartCalls(**kept, kEcho, kCalls, [](int) { return 1000; });
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (ts.service.started.load() < 2 * kCalls && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(ts.service.started.load(), 2 * kCalls);
    doomed->reset();
    for (auto& c : doomed_calls) {
      auto f = c->result.get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready)
          << "the channel's destructor returned with a call pending";
      const Status s = f.get();
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    }
    for (auto& c : kept_calls) {
      auto f = c->result.get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
      const Status s = f.get();
      EXPECT_TRUE(s.ok()) << "a call of the other channel: " << s;
    }
    ClientContext ctx;
    ctx.set_timeout(absl::Milliseconds(200));
    EchoResponse resp;
    EXPECT_EQ((*kept)->Call(kEcho, &ctx, Req("late", 5000), &resp).code(),
              StatusCode::kDeadlineExceeded)
        << "deadlines of the surviving channel (the shared timer thread)";
    ClientContext ctx2;
    const Status s = (*kept)->Call(kEcho, &ctx2, Req("after"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "after");
  }
}

// Makes a call whose callback drops `last`, the channel's last reference;
// the call must succeed and the reference be gone.
void ExpectDroppedByItsOwnCallback(std::shared_ptr<Channel> last) {
  Channel* raw = last.get();
  ClientContext ctx;
  EchoResponse resp;
  std::promise<Status> result;
  raw->CallAsync(kEcho, &ctx, Req("last"), &resp, [&](Status s) {
    last.reset();
    result.set_value(s);
  });
  auto f = result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  EXPECT_TRUE(f.get().ok());
  EXPECT_EQ(last, nullptr);
}

// A grouped channel dropped by its own callback (inline: on the transport's
// I/O thread; or on the group's one callback thread) neither deadlocks nor
// stops the group's other channels.
TEST_P(RpcSuite, AGroupedChannelDestroyedByItsOwnCallback) {
  for (int callback_threads : {0, 1}) {
    SCOPED_TRACE(absl::StrCat("callback_threads ", callback_threads));
    TestServer ts(GetParam().listen_addr());
    ASSERT_TRUE(ts.server);
    auto group = MakeGroup(callback_threads);
    ASSERT_TRUE(group);
    auto other = group->NewChannel(ts.address);
    ASSERT_TRUE(other.ok());
    auto ch = group->NewChannel(ts.address);
    ASSERT_TRUE(ch.ok());
    ExpectDroppedByItsOwnCallback(std::move(*ch));
    ClientContext ctx;
    EchoResponse resp;
    const Status s = (*other)->Call(kEcho, &ctx, Req("still here"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "still here");
  }
}

// A lone channel dropped by its own inline callback, which runs on the
// transport's I/O thread for a response: its destructor cannot shut the
// transport down there (it would join the thread it runs on).
TEST_P(RpcSuite, ALoneChannelDestroyedByItsOwnInlineCallback) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  std::shared_ptr<Channel> ch = MakeChannel(ts.address, InlineCallbacks());
  ASSERT_TRUE(ch);
  ClientContext ctx;
  EchoResponse resp;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("connect"), &resp).ok());
  ExpectDroppedByItsOwnCallback(std::move(ch));
}

// A lone channel dropped by its own callback on one of its callback
// threads: its destructor stops that pool from the pool's own thread, which
// it cannot join; the thread ends the callback after the pool is gone.
TEST_P(RpcSuite, ALoneChannelDestroyedByItsOwnCallbackOnACallbackThread) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  std::shared_ptr<Channel> ch = MakeChannel(ts.address);
  ASSERT_TRUE(ch);
  ClientContext ctx;
  EchoResponse resp;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("connect"), &resp).ok());
  ExpectDroppedByItsOwnCallback(std::move(ch));
}

TEST(ChannelGroupTest, RefusesNegativeCallbackThreadsAndBadAddresses) {
  ChannelOptions o;
  o.callback_threads = -1;
  EXPECT_EQ(ChannelGroup::Create(o).status().code(), StatusCode::kInvalidArgument);
  auto group = ChannelGroup::Create();
  ASSERT_TRUE(group.ok());
  auto ch = (*group)->NewChannel("nonsense");
  EXPECT_FALSE(ch.ok());
}

TEST(ServerBuilderTest, RefusesDuplicateMethods) {
  EchoService a, b;
  auto s = ServerBuilder()
               .AddListeningPort("tcp://127.0.0.1:0")
               .RegisterService(&a)
               .RegisterService(&b)
               .BuildAndStart();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("registered twice"), absl::string_view::npos) << s.status();
}

}  // namespace
}  // namespace rdmarpc::testing
