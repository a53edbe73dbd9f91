// Interceptors, user code that throws, and retry policies (see rpc_suite.h).
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/channel.h"
#include "rpc/interceptor.h"
#include "rpc/retry_info.h"
#include "rpc/retry_throttle.h"
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

// Starts `*server` on the suite's transport, serving `echo` behind
// `interceptor`; returns its address ("" when it did not start).
std::string ServeBehind(std::shared_ptr<ServerInterceptor> interceptor, EchoService* echo,
                        std::unique_ptr<Server>* server) {
  auto started = ServerBuilder()
                     .AddListeningPort(RpcSuite::GetParam().listen_addr())
                     .RegisterService(echo)
                     .AddInterceptor(std::move(interceptor))
                     .BuildAndStart();
  EXPECT_TRUE(started.ok()) << started.status();
  if (!started.ok()) return "";
  *server = std::move(*started);
  return (*server)->addresses()[0];
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
  std::unique_ptr<Server> server;
  const std::string address = ServeBehind(flaky, &echo, &server);
  ASSERT_TRUE(server);
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

// A throttle shared by two channels stops their retries while most calls
// fail, counting every call's retryable failure (the non-retryable calls'
// too) and every success, and lets them go again once successes have
// brought its tokens back; other codes, and a channel without retries, leave
// it as it is.
TEST_P(RpcSuite, ARetryThrottleStopsRetriesWhileMostCallsFail) {
  auto flaky = std::make_shared<FlakyInterceptor>();
  EchoService echo;
  std::unique_ptr<Server> server;
  const std::string address = ServeBehind(flaky, &echo, &server);
  ASSERT_TRUE(server);
  // 4 tokens: retries stop at 2 or fewer; a success gives back 1.
  auto throttle = RetryThrottle::Create(4, 1.0);
  ASSERT_TRUE(throttle.ok()) << throttle.status();
  ChannelOptions options;
  options.retry.max_attempts = 3;
  options.retry.initial_backoff = absl::Milliseconds(10);
  options.retry.throttle = *throttle;
  auto a = MakeChannel(address, options);
  auto b = MakeChannel(address, options);
  ChannelOptions no_retries;
  no_retries.retry.throttle = *throttle;
  auto c = MakeChannel(address, no_retries);
  const auto call = [&](std::shared_ptr<Channel>& channel, int failures, bool retryable = true,
                        StatusCode fail_code = StatusCode::kOk) {
    flaky->failures = failures;
    flaky->seen = 0;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    ctx.set_retryable(retryable);
    EchoRequest req = Req("throttled");
    req.set_fail_code(static_cast<int>(fail_code));
    EchoResponse resp;
    const StatusCode code = channel->Call(kEcho, &ctx, req, &resp).code();
    return std::make_pair(code, flaky->seen.load());
  };
  using Result = std::pair<StatusCode, int>;
  constexpr int kAlways = 1000;

  EXPECT_EQ(call(a, kAlways), Result(StatusCode::kUnavailable, 2)) << "4 -> 3, then 3 -> 2";
  EXPECT_EQ((*throttle)->tokens(), 2);
  EXPECT_EQ(call(b, kAlways), Result(StatusCode::kUnavailable, 1)) << "shared: 2 -> 1";
  EXPECT_EQ((*throttle)->tokens(), 1);
  EXPECT_EQ(a->stats().retries, 1u);
  EXPECT_EQ(a->stats().retries_throttled, 1u);
  EXPECT_EQ(b->stats().retries, 0u);
  EXPECT_EQ(b->stats().retries_throttled, 1u);

  for (int i = 0; i < 3; ++i) EXPECT_EQ(call(b, 0), Result(StatusCode::kOk, 1));
  EXPECT_EQ((*throttle)->tokens(), 4);
  EXPECT_EQ(call(c, kAlways), Result(StatusCode::kUnavailable, 1));
  EXPECT_EQ(call(a, 0, true, StatusCode::kInternal), Result(StatusCode::kInternal, 1));
  EXPECT_EQ((*throttle)->tokens(), 4) << "counted what it should not";
  EXPECT_EQ(call(a, 1), Result(StatusCode::kOk, 2)) << "4 -> 3, then served: 4";
  EXPECT_EQ((*throttle)->tokens(), 4);
  EXPECT_EQ(call(a, 1, /*retryable=*/false), Result(StatusCode::kUnavailable, 1));
  EXPECT_EQ((*throttle)->tokens(), 3);
  EXPECT_EQ(call(a, kAlways), Result(StatusCode::kUnavailable, 1)) << "3 -> 2: throttled";
  EXPECT_EQ((*throttle)->tokens(), 2);
  EXPECT_EQ(a->stats().retries, 2u);
  EXPECT_EQ(a->stats().retries_throttled, 2u);
  EXPECT_EQ(c->stats().retries_throttled, 0u);
}

// Refuses calls UNAVAILABLE as its script says, one entry a call, each with
// the retry pushback it holds (none for nullopt); serves once it is empty.
class PushbackInterceptor : public ServerInterceptor {
 public:
  Status OnRequest(ServerContext&) override {
    std::lock_guard<std::mutex> lock(mu);
    ++seen;
    if (script.empty()) return Status();
    Status refused(StatusCode::kUnavailable, "busy");
    if (script.front()) SetRetryDelay(&refused, *script.front());
    script.pop_front();
    return refused;
  }
  std::mutex mu;
  std::deque<std::optional<absl::Duration>> script;  // guarded by mu
  int seen = 0;                                      // guarded by mu
};

// The server's retry pushback (rpc/retry_info.h) decides when a RetryPolicy
// sends a call again: after its delay instead of the backoff, then backing
// off from initial_backoff again; never, for a negative one, or for one past
// the deadline.
TEST_P(RpcSuite, AServersRetryPushbackDecidesWhenACallIsSentAgain) {
  auto pushback = std::make_shared<PushbackInterceptor>();
  EchoService echo;
  std::unique_ptr<Server> server;
  const std::string address = ServeBehind(pushback, &echo, &server);
  ASSERT_TRUE(server);
  // Its own second backoff, 5 s, would end past every deadline here.
  ChannelOptions options;
  options.retry.max_attempts = 4;
  options.retry.initial_backoff = absl::Milliseconds(50);
  options.retry.multiplier = 100;
  options.retry.max_backoff = absl::Seconds(5);
  auto ch = MakeChannel(address, options);
  const auto run = [&](std::deque<std::optional<absl::Duration>> script, int* attempts,
                       absl::Duration* took) {
    {
      std::lock_guard<std::mutex> lock(pushback->mu);
      pushback->script = std::move(script);
      pushback->seen = 0;
    }
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(3));
    EchoResponse resp;
    const absl::Time began = absl::Now();
    Status s = ch->Call(kEcho, &ctx, Req("pushed"), &resp);
    *took = absl::Now() - began;
    std::lock_guard<std::mutex> lock(pushback->mu);
    *attempts = pushback->seen;
    return s;
  };
  int attempts = 0;
  absl::Duration took;

  // Backoff 50 ms; pushback 300 ms, after which the backoff is 50 ms again,
  // not the 5 s that came next.
  Status s = run({std::nullopt, absl::Milliseconds(300), std::nullopt}, &attempts, &took);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(attempts, 4);
  EXPECT_GE(took, absl::Milliseconds(300)) << "the pushback was not waited";

  s = run({kDoNotRetry}, &attempts, &took);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(s.message(), "busy");
  EXPECT_EQ(RetryDelay(s), kDoNotRetry) << s;
  EXPECT_EQ(attempts, 1) << "sent again though the server said not to";

  s = run({absl::Seconds(10)}, &attempts, &took);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(attempts, 1);
  EXPECT_LT(took, absl::Seconds(3)) << "waited for a retry its deadline ruled out";
  EXPECT_EQ(echo.started.load(), 1);
}

}  // namespace
}  // namespace rdmarpc::testing
