// Calls across a step of the wall clock, over tcp:// and rdma://. NTP
// setting a clock that was wrong at boot, an administrator's `date -s` or a
// VM resumed from a snapshot steps CLOCK_REALTIME by minutes or hours; what
// the library times (deadlines, how long a peer may READ a buffer,
// keepalives) must go by the time that passed, not by the wall clock
// (base/steady_clock.h).
//
// Steps the clock of the machine it runs on, so it runs only in the
// throw-away Soft-RoCE VM (RDMARPC_VM_ROLE=single), where it is root. On a
// machine's own RDMA device it skips rather than step that machine's clock;
// RDMARPC_VM=always runs it in the VM there too.
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

class ClockStep : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (rdma::testing::Role() != "single") {
      GTEST_SKIP() << "steps the wall clock, so runs only in the Soft-RoCE VM (role \""
                   << rdma::testing::Role() << "\"; RDMARPC_VM=always puts it there)";
    }
    const std::string ip = rdma::testing::RequireRdmaTestAddress();
    ASSERT_FALSE(ip.empty());
    server_ = std::make_unique<TestServer>(GetParam() + "://" + ip + ":0");
    ASSERT_TRUE(server_->server);
    auto ch = Channel::Create(server_->address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    channel_ = std::move(*ch);
    EchoRequest warm;
    EchoResponse resp;
    ClientContext ctx;
    ASSERT_TRUE(channel_->Call(kEcho, &ctx, warm, &resp).ok());
  }

  void TearDown() override {
    if (stepped_ != absl::ZeroDuration()) Step(-stepped_);
  }

  // Steps CLOCK_REALTIME by `by`, as settimeofday would.
  void Step(absl::Duration by) {
    timespec now{};
    ASSERT_EQ(clock_gettime(CLOCK_REALTIME, &now), 0);
    const timespec then = absl::ToTimespec(absl::TimeFromTimespec(now) + by);
    ASSERT_EQ(clock_settime(CLOCK_REALTIME, &then), 0)
        << "clock_settime: " << strerror(errno) << " (the test runs as root in the VM)";
    stepped_ += by;
  }

  Status Call(const EchoRequest& req, absl::Duration timeout, EchoResponse* resp) {
    ClientContext ctx;
    ctx.set_timeout(timeout);
    return channel_->Call(kEcho, &ctx, req, resp);
  }

  std::unique_ptr<TestServer> server_;
  std::shared_ptr<Channel> channel_;
  absl::Duration stepped_;
};

// Forward steps of an hour, every 50 ms, while calls with 20 s to spare run:
// small ones, ones whose handler takes 300 ms, and ones whose 4 MiB
// response the client READs from the server's advertised buffer. A deadline,
// a READ's expiry or a buffer's release timeout kept in wall time would end
// them at the first step.
TEST_P(ClockStep, ForwardStepsEndNoCallEarly) {
  std::atomic<bool> stop{false};
  std::thread stepper([&] {
    while (!stop.load()) {
      Step(absl::Hours(1));
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  int failed = 0;
  std::string first_failure;
  for (int i = 0; i < 30; ++i) {
    EchoRequest req;
    req.set_tag(i);
    if (i % 3 == 1) req.set_sleep_ms(300);
    if (i % 3 == 2) req.set_response_size(4 << 20);
    EchoResponse resp;
    const Status s = Call(req, absl::Seconds(20), &resp);
    if (!s.ok() && failed++ == 0) first_failure = absl::StrCat("call ", i, ": ", s.ToString());
    if (s.ok()) {
      EXPECT_EQ(resp.tag(), i);
    }
  }
  stop = true;
  stepper.join();
  EXPECT_EQ(failed, 0) << "first: " << first_failure << " (the clock stepped forward "
                       << absl::FormatDuration(stepped_) << " in all)";
  EXPECT_GE(stepped_, absl::Hours(5)) << "the calls ran faster than the steps";
}

// New connections after the clock stepped an hour forward (NTP correcting a
// clock that was behind, once the process had started): a connect's wait
// kept on the wall clock would see its deadline an hour gone and give every
// connection up at once.
TEST_P(ClockStep, ConnectionsAreMadeAfterAForwardStep) {
  Step(absl::Hours(1));
  for (int i = 0; i < 5; ++i) {
    auto ch = Channel::Create(server_->address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    EchoRequest req;
    req.set_tag(i);
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    const Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << "connection " << i << ": " << s;
    EXPECT_EQ(resp.tag(), i);
  }
}

// A step back of an hour while a call with a 1 s deadline waits on a
// handler that takes 10 s: the call still ends DEADLINE_EXCEEDED about 1 s
// after it started, and the handler sees its call cancelled then, not an
// hour later.
TEST_P(ClockStep, ABackwardStepHoldsNoDeadline) {
  EchoRequest req;
  req.set_sleep_ms(10000);
  const int started = server_->service.started.load();
  const absl::Time start = SteadyNow();
  auto call = std::async(std::launch::async, [&] {
    EchoResponse resp;
    return Call(req, absl::Seconds(1), &resp);
  });
  while (server_->service.started.load() == started && SteadyNow() < start + absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(server_->service.started.load(), started + 1) << "the handler did not start";
  Step(-absl::Hours(1));
  ASSERT_EQ(call.wait_for(std::chrono::seconds(8)), std::future_status::ready)
      << "the call outlived its 1 s deadline by 8 s after the clock stepped back";
  const Status s = call.get();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(SteadyNow() - start, absl::Seconds(4));
  while (server_->service.saw_cancel.load() == 0 && SteadyNow() < start + absl::Seconds(8)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server_->service.saw_cancel.load(), 1)
      << "the handler did not see its call's deadline pass";
}

INSTANTIATE_TEST_SUITE_P(Transports, ClockStep, ::testing::Values("tcp", "rdma"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace rdmarpc::testing
