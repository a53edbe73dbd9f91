// Calls and their handlers: what a call carries there and back, callbacks
// that run inline, handler errors and handlers that finish later, and the
// generated stub and service end to end (see rpc_suite.h).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/service.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"
#include "transport/wire_format.h"

namespace rdmarpc::testing {
namespace {

using test::EchoRequest;
using test::EchoResponse;

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
  for (const std::string& key : {std::string("Upper-Case"), std::string(), std::string(300, 'k'),
                                 std::string(transport::kStatusPayloadKey)}) {
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

// Metadata larger than an RDMA receive slot (8 KiB) and within the wire's
// limit (64 KiB): TCP carries it; RDMA cannot, and the call still ends, with
// the error naming the slot for a request or an answer, and with the
// handler's own error (as it is, without the metadata) for an error.
TEST_P(RpcSuite, MetadataTheTransportCannotCarryStillEndsTheCall) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  const bool over_tcp = absl::StartsWith(GetParam().name, "tcp");
  constexpr size_t kPadding = 12 << 10;
  for (const bool fails : {false, true}) {
    SCOPED_TRACE(fails ? "an error" : "an answer");
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    EchoRequest req = Req("x");
    req.set_response_metadata_size(kPadding);
    if (fails) {
      req.set_fail_code(static_cast<int>(StatusCode::kNotFound));
      req.set_fail_message("no such thing");
    }
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, req, &resp);
    if (over_tcp) {
      EXPECT_EQ(s.code(), fails ? StatusCode::kNotFound : StatusCode::kOk) << s;
      ASSERT_EQ(ctx.server_metadata().size(), 1u);
      EXPECT_EQ(ctx.server_metadata()[0].second.size(), kPadding);
    } else if (fails) {
      EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
      EXPECT_EQ(s.message(), "no such thing");
      EXPECT_TRUE(ctx.server_metadata().empty());
    } else {
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("does not fit a receive slot"), absl::string_view::npos) << s;
      EXPECT_TRUE(ctx.server_metadata().empty());
    }
  }
  {
    SCOPED_TRACE("a request");
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    ctx.AddMetadata("echo-me", std::string(kPadding, 'c'));
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, Req("x"), &resp);
    if (over_tcp) {
      EXPECT_TRUE(s.ok()) << s;
      ASSERT_EQ(ctx.server_metadata().size(), 1u);
      EXPECT_EQ(ctx.server_metadata()[0].second.size(), kPadding);
    } else {
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("does not fit a receive slot"), absl::string_view::npos) << s;
    }
  }
  EXPECT_TRUE(EchoOn(*ch, "after").ok());
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

// A handler's status payloads (rich error details) reach the client with
// its code, message and response metadata, in every client form; what the
// transport cannot carry leaves the code and message as they were.
TEST_P(RpcSuite, HandlerErrorDetailsReachTheClient) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  constexpr char kErrorInfo[] = "type.googleapis.com/google.rpc.ErrorInfo";
  constexpr char kOwn[] = "example.com/Own";
  const std::string binary("\0\x01\xff\0details", 11);
  std::string large(2000, 'p');
  for (size_t i = 0; i < large.size(); ++i) large[i] = AttachmentByte(i);
  auto failing = [&](StatusCode code, size_t own_size) {
    EchoRequest req = Req("x");
    req.set_fail_code(static_cast<int>(code));
    req.set_fail_message("try later");
    test::StatusPayload* info = req.add_fail_payloads();
    info->set_type_url(kErrorInfo);
    info->set_value(binary);
    test::StatusPayload* own = req.add_fail_payloads();
    own->set_type_url(kOwn);
    own->set_value(own_size == large.size() ? large : std::string(own_size, 'q'));
    return req;
  };
  auto expect_details = [&](const Status& s, const ClientContext& ctx) {
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(s.message(), "try later");
    ASSERT_TRUE(s.GetPayload(kErrorInfo).has_value()) << s;
    EXPECT_EQ(std::string(*s.GetPayload(kErrorInfo)), binary);
    ASSERT_TRUE(s.GetPayload(kOwn).has_value()) << s;
    EXPECT_EQ(std::string(*s.GetPayload(kOwn)), large);
    EXPECT_EQ(ctx.server_metadata(), (transport::Metadata{{"echoed", "with the error"}}));
  };
  {
    SCOPED_TRACE("blocking");
    ClientContext ctx;
    ctx.AddMetadata("echo-me", "with the error");
    EchoResponse resp;
    expect_details(
        ch->Call(kEcho, &ctx, failing(StatusCode::kResourceExhausted, large.size()), &resp), ctx);
  }
  {
    SCOPED_TRACE("callback, finished on the handler's own thread");
    ClientContext ctx;
    ctx.AddMetadata("echo-me", "with the error");
    EchoResponse resp;
    std::promise<Status> done;
    ch->CallAsync(kEchoLater, &ctx, failing(StatusCode::kResourceExhausted, large.size()), &resp,
                  [&done](Status s) { done.set_value(std::move(s)); });
    auto f = done.get_future();
    ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    expect_details(f.get(), ctx);
  }
  {
    SCOPED_TRACE("UNIMPLEMENTED, which the client names the method in");
    ClientContext ctx;
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, failing(StatusCode::kUnimplemented, 10), &resp);
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s;
    EXPECT_EQ(s.message(), absl::StrCat(kEcho.full_name, ": try later"));
    ASSERT_TRUE(s.GetPayload(kErrorInfo).has_value()) << s;
    EXPECT_EQ(std::string(*s.GetPayload(kErrorInfo)), binary);
  }
  // 12 KiB fits TCP's 64 KiB of metadata but not an 8 KiB RDMA receive
  // slot; 70 KiB fits neither.
  const bool over_tcp = absl::StartsWith(GetParam().name, "tcp");
  for (const size_t own_size : {size_t{12} << 10, size_t{70} << 10}) {
    SCOPED_TRACE(own_size);
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    ctx.AddMetadata("echo-me", "with the error");
    EchoResponse resp;
    const Status s = ch->Call(kEcho, &ctx, failing(StatusCode::kAborted, own_size), &resp);
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s;
    EXPECT_EQ(s.message(), "try later");
    if (over_tcp && own_size < transport::kMaxMetadataBytes) {
      ASSERT_TRUE(s.GetPayload(kOwn).has_value()) << s;
      EXPECT_EQ(s.GetPayload(kOwn)->size(), own_size);
      EXPECT_EQ(ctx.server_metadata().size(), 1u);
    } else {
      EXPECT_FALSE(s.GetPayload(kOwn).has_value()) << s;
      EXPECT_FALSE(s.GetPayload(kErrorInfo).has_value()) << s;
      EXPECT_TRUE(ctx.server_metadata().empty());
    }
  }
  ClientContext ctx;
  EchoResponse resp;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("after"), &resp).ok());
  EXPECT_EQ(resp.data(), "after");
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
  ClientContext reserved;
  reserved.AddMetadata("rdmarpc-status-payload", "forged");
  const Status r = ch->Call(kEcho, &reserved, Req("never"), &resp);
  EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << r;
  EXPECT_NE(r.message().find("'rdmarpc-status-payload' is reserved"), absl::string_view::npos) << r;
  ClientContext ctx;
  ASSERT_TRUE(ch->Call(kEcho, &ctx, Req("after"), &resp).ok());
  EXPECT_EQ(ts.service.started.load(), 1);
}

// Generated code end to end: a generated Stub calls a generated Service in
// all three client forms; the service finishes asynchronously on its own
// thread.
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

}  // namespace
}  // namespace rdmarpc::testing
