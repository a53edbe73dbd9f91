// Helpers shared by the files of the runtime's conformance suite
// (tests/rpc_suite_*.cc): a channel, a request, calls started in bulk, a
// generated service. A helper that one file alone uses stays in that file.
#ifndef RDMARPC_TESTS_RPC_SUITE_UTIL_H_
#define RDMARPC_TESTS_RPC_SUITE_UTIL_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"

namespace rdmarpc::testing {

inline std::shared_ptr<Channel> MakeChannel(const std::string& address, ChannelOptions o = {}) {
  auto ch = Channel::Create(address, o);
  EXPECT_TRUE(ch.ok()) << ch.status();
  return ch.ok() ? *ch : nullptr;
}

inline test::EchoRequest Req(const std::string& data, int sleep_ms = 0) {
  test::EchoRequest r;
  r.set_data(data);
  r.set_sleep_ms(sleep_ms);
  return r;
}

// Callbacks run where their calls end: no callback threads.
inline ChannelOptions InlineCallbacks() {
  ChannelOptions o;
  o.callback_threads = 0;
  return o;
}

// Waits (up to 20 s) until `service` has started `n` handlers in all.
inline void AwaitHandlersStarted(const EchoService& service, int n) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (service.started.load() < n && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
}

// Starts a 30 s call to `method`, cancels it once its handler is running
// (`started` past `started_before`), and expects the call to end CANCELLED
// and the handler to see the cancel. `while_running`, if any, runs with the
// call's context just before the cancel.
inline void ExpectCancelReachesRunningHandler(
    Channel& ch, EchoService& service, const MethodInfo& method, int started_before,
    const std::function<void(ClientContext&)>& while_running = nullptr) {
  ClientContext ctx;
  test::EchoResponse resp;
  std::promise<Status> result;
  ch.CallAsync(method, &ctx, Req("slow", 30000), &resp, [&](Status s) { result.set_value(s); });
  AwaitHandlersStarted(service, started_before + 1);
  if (while_running) while_running(ctx);
  ctx.TryCancel();
  auto f = result.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kCancelled);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (service.saw_cancel.load() == 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(service.saw_cancel.load(), 1) << "server handler never saw the cancel";
}

// An asynchronous call whose result a test waits for.
struct AsyncCall {
  ClientContext ctx;
  test::EchoResponse resp;
  std::promise<Status> result;
};

// Starts `n` calls to `method`; call i asks its handler to sleep sleep_ms(i).
inline std::vector<std::unique_ptr<AsyncCall>> StartCalls(Channel& ch, const MethodInfo& method,
                                                          int n,
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

// A generated service (proto/echo.proto) that finishes each call on a thread
// of its own, and tells each caller how many calls it has served.
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

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_RPC_SUITE_UTIL_H_
