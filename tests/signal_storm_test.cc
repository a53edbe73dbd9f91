// Calls over tcp:// and rdma:// in a process whose threads are signalled
// every millisecond through a handler without SA_RESTART (base/signal_storm.h),
// as a program with a profiler's SIGPROF or a timer's SIGALRM is. Every
// blocking system call the library makes (poll, epoll_wait, reads of its
// event channels, socket I/O, futex waits) then fails with EINTR now and
// then; none may turn that into a failed connection, a lost call or a
// deadline missed.
#include "base/signal_storm.h"

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "gtest/gtest.h"
#include "rpc/attachment.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

constexpr int64_t kLarge = 4 << 20;

class SignalStormCalls : public ::testing::TestWithParam<std::string> {
 protected:
  std::string ListenAddress() {
    return GetParam() + "://" + rdma::testing::RequireRdmaTestAddress() + ":0";
  }
};

// What a round of calls on a fresh channel got wrong, or "".
std::string CallRound(const std::string& address, int round) {
  auto ch = Channel::Create(address);
  if (!ch.ok()) return ch.status().ToString();
  Channel& channel = **ch;
  std::string wrong;
  const auto check = [&](const std::string& what, const Status& s, bool right) {
    if (wrong.empty() && (!s.ok() || !right)) {
      wrong = absl::StrCat("round ", round, ", ", what, ": ", s.ToString());
    }
  };
  for (int i = 0; i < 8; ++i) {
    EchoRequest req;
    req.set_tag(i);
    req.set_data(std::string(64, 'q'));
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    const Status s = channel.Call(kEcho, &ctx, req, &resp);
    check("small call", s, resp.tag() == i && resp.data() == req.data());
  }
  {
    // Both directions of a large payload: the request's and the response's
    // bytes (pulled by RDMA READ over rdma://).
    EchoRequest req;
    req.set_data(std::string(kLarge, 'd'));
    req.set_response_size(kLarge);
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    const Status s = channel.Call(kEcho, &ctx, req, &resp);
    check("4 MiB each way", s, resp.data() == std::string(kLarge, 'r'));
  }
  {
    auto att = channel.AllocateAttachment(kLarge);
    if (!att.ok()) return att.status().ToString();
    FillAttachment(att->data(), kLarge);
    const uint64_t sum = AttachmentChecksum(absl::string_view(att->data(), kLarge));
    EchoRequest req;
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    ctx.set_request_attachment(std::move(*att));
    const Status s = channel.Call(kEcho, &ctx, req, &resp);
    check("4 MiB attachment", s,
          resp.attachment_checksum() == sum && ctx.response_attachment().size() == kLarge);
  }
  {
    // Concurrent asynchronous calls, some finished by handlers that sleep.
    constexpr int kAsync = 16;
    struct Slot {
      EchoRequest req;
      EchoResponse resp;
      ClientContext ctx;
      Status status;
    };
    std::vector<Slot> slots(kAsync);
    std::atomic<int> left{kAsync};
    // Not absl::Notification: TSan sees only what is built with it, and
    // Debian's abseil is not.
    std::promise<void> all_done;
    for (int i = 0; i < kAsync; ++i) {
      Slot& slot = slots[i];
      slot.req.set_tag(100 + i);
      if (i % 4 == 0) slot.req.set_sleep_ms(50);
      slot.ctx.set_timeout(absl::Seconds(30));
      channel.CallAsync(i % 2 == 0 ? kEcho : kEchoLater, &slot.ctx, slot.req, &slot.resp,
                        [&slot, &left, &all_done](Status s) {
                          slot.status = s;
                          if (left.fetch_sub(1) == 1) all_done.set_value();
                        });
    }
    if (all_done.get_future().wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
      return absl::StrCat("round ", round, ": asynchronous calls never ended");
    }
    for (int i = 0; i < kAsync; ++i) {
      check(absl::StrCat("asynchronous call ", i), slots[i].status, slots[i].resp.tag() == 100 + i);
    }
  }
  {
    // A deadline neither ends a call early nor lets it run late: an
    // interrupted wait must go back to sleep for what is left, not all of it
    // nor none of it.
    EchoRequest req;
    req.set_sleep_ms(5000);
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Milliseconds(300));
    const absl::Time start = SteadyNow();
    const Status s = channel.Call(kEcho, &ctx, req, &resp);
    const absl::Duration took = SteadyNow() - start;
    if (wrong.empty() && (s.code() != StatusCode::kDeadlineExceeded ||
                          took < absl::Milliseconds(300) || took > absl::Seconds(3))) {
      wrong = absl::StrCat("round ", round, ", a 300 ms deadline on a 5 s handler ended ",
                           s.ToString(), " after ", absl::FormatDuration(took));
    }
  }
  return wrong;
}

// Servers start, channels connect (a fresh one per round), small, large,
// attachment, asynchronous and timed-out calls run, and the server shuts
// down gracefully under a call: all as without the signals.
TEST_P(SignalStormCalls, EveryCallAndConnectionSucceedsAsWithoutSignals) {
  SignalStorm storm(absl::Milliseconds(1));
  auto server = std::make_unique<TestServer>(ListenAddress());
  ASSERT_TRUE(server->server);
  for (int round = 0; round < 3; ++round) {
    const std::string wrong = CallRound(server->address, round);
    EXPECT_EQ(wrong, "");
  }
  auto ch = Channel::Create(server->address);
  ASSERT_TRUE(ch.ok()) << ch.status();
  EchoRequest warm;
  EchoResponse warm_resp;
  ClientContext warm_ctx;
  ASSERT_TRUE((*ch)->Call(kEcho, &warm_ctx, warm, &warm_resp).ok());
  // Shutdown's grace serves the call under way.
  EchoRequest req;
  req.set_sleep_ms(300);
  req.set_tag(7);
  EchoResponse resp;
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(30));
  std::promise<Status> ended;
  const int started = server->service.started.load();
  (*ch)->CallAsync(kEcho, &ctx, req, &resp, [&](Status s) { ended.set_value(std::move(s)); });
  const absl::Time until = SteadyNow() + absl::Seconds(20);
  while (server->service.started.load() == started && SteadyNow() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  server->server->Shutdown(absl::Seconds(10));
  auto last = ended.get_future();
  ASSERT_EQ(last.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const Status status = last.get();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(resp.tag(), 7);
  server.reset();
  storm.Stop();
  printf("%s: %llu signals delivered to %zu threads\n", GetParam().c_str(),
         static_cast<unsigned long long>(storm.delivered()), storm.threads_signalled());
  // The storm reached the library's threads (I/O, pollers, callbacks,
  // workers), not just this one.
  EXPECT_GE(storm.threads_signalled(), 6u);
  EXPECT_GE(storm.delivered(), 1000u);
}

INSTANTIATE_TEST_SUITE_P(Transports, SignalStormCalls, ::testing::Values("tcp", "rdma"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rdmarpc::testing
