// Deadlines and cancellation: every way a call can end before its answer,
// on the client and in the handlers, including calls a handler makes for its
// own call (see rpc_suite.h).
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/channel.h"
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
  while (ts.service.saw_cancel.load() == 0 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(5));
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

}  // namespace
}  // namespace rdmarpc::testing
