// A process at its limit on threads, as under a container's pids limit
// (cgroup pids.max, which root cannot step over either): whatever needed the
// thread fails with a status that names the limit, and nothing crashes,
// hangs or leaks a thread; once the limit is raised, the same server and
// channel serve. Before, std::thread's exception went up through calls that
// return statuses, or ended the process where a thread of the library's
// own (the rdma_cm thread, a channel's connector) started another.
//
// In the Soft-RoCE VM, where the test is root and may make its own cgroup:
// it puts itself in one and sets its pids.max.
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

constexpr char kRoot[] = "/sys/fs/cgroup";
constexpr char kGroup[] = "/sys/fs/cgroup/rdmarpc-thread-limit";

bool Write(const std::string& path, const std::string& value) {
  std::ofstream out(path);
  out << value;
  out.close();
  return static_cast<bool>(out);
}

long long ReadNumber(const std::string& path) {
  std::ifstream in(path);
  long long n = -1;
  in >> n;
  return n;
}

// This process in a cgroup of its own, whose pids.max the test sets.
class ThreadLimit {
 public:
  static ::testing::AssertionResult Enter() {
    if (access(absl::StrCat(kRoot, "/cgroup.controllers").c_str(), F_OK) != 0 &&
        mount("cgroup2", kRoot, "cgroup2", 0, nullptr) != 0) {
      return ::testing::AssertionFailure() << "mount cgroup2: " << strerror(errno);
    }
    if (!Write(absl::StrCat(kRoot, "/cgroup.subtree_control"), "+pids")) {
      return ::testing::AssertionFailure() << "the kernel has no pids controller";
    }
    mkdir(kGroup, 0755);
    if (!Write(absl::StrCat(kGroup, "/cgroup.procs"), std::to_string(getpid()))) {
      return ::testing::AssertionFailure() << "cannot move into " << kGroup;
    }
    return ::testing::AssertionSuccess();
  }
  // Threads (tasks) of this process now: the cgroup holds nothing else.
  static int Threads() {
    return static_cast<int>(ReadNumber(absl::StrCat(kGroup, "/pids.current")));
  }
  // Lets the process run `more` threads beyond those it runs now.
  static void Allow(int more) {
    ASSERT_TRUE(Write(absl::StrCat(kGroup, "/pids.max"), std::to_string(Threads() + more)));
  }
  static void Lift() { ASSERT_TRUE(Write(absl::StrCat(kGroup, "/pids.max"), "max")); }
};

// Threads that end on their own (a connector, work on a thread of its own)
// may take a moment to go.
bool ThreadsBecome(int n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (ThreadLimit::Threads() != n && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return ThreadLimit::Threads() == n;
}

// What a failure for want of a thread must say: what lacked it, the limit,
// and what to do.
::testing::AssertionResult SaysTheLimit(absl::string_view text) {
  for (const char* part : {"no thread for ", "Resource temporarily unavailable",
                           "rdmarpc-thread-limit allows ", "pids.max", "Raise the limit"}) {
    if (text.find(part) == absl::string_view::npos) {
      return ::testing::AssertionFailure() << "no \"" << part << "\" in: " << text;
    }
  }
  return ::testing::AssertionSuccess();
}

// The same for a status, or, for a connection the server refused for want of
// a thread, the server's log line: the refusal that reaches the client is
// cut to rdma_cm's 148 bytes.
::testing::AssertionResult SaysTheLimit(const Status& s, const std::string& log) {
  if (s.code() != StatusCode::kResourceExhausted && s.code() != StatusCode::kUnavailable) {
    return ::testing::AssertionFailure() << "code: " << s;
  }
  if (s.message().find("the server refused the connection: no thread for ") == std::string::npos) {
    return SaysTheLimit(s.message());
  }
  const size_t line = log.find("refusing connection from ");
  if (line == std::string::npos) return ::testing::AssertionFailure() << "no refusal in: " << log;
  return SaysTheLimit(absl::string_view(log).substr(line, log.find('\n', line) - line));
}

std::string Address(const std::string& scheme) {
  return absl::StrCat(scheme, "://", rdma::testing::RequireRdmaTestAddress(), ":0");
}

class AtTheThreadLimit : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() { ASSERT_TRUE(ThreadLimit::Enter()); }
  void TearDown() override { ThreadLimit::Lift(); }
};

INSTANTIATE_TEST_SUITE_P(Transports, AtTheThreadLimit, ::testing::Values("rdma", "tcp"),
                         [](const auto& info) { return info.param; });

// With room for 0, 1, 2, ... threads more, a server is started, a channel
// made and a call made, until all of it fits: each step that finds no
// thread fails saying so, and each limit stops the same step as the one
// before or a later one, until none is stopped. After each, with the limit
// lifted, what was made serves, and everything goes without leaving a
// thread behind.
TEST_P(AtTheThreadLimit, EachThreadThatCannotStartFailsItsStepSayingWhy) {
  ASSERT_FALSE(rdma::testing::RequireRdmaTestAddress().empty());
  EchoService service;
  const int before = ThreadLimit::Threads();
  enum Step { kServer, kChannel, kCall, kAll };
  const char* const kStepNames[] = {"the server", "the channel", "the call"};
  int stopped_at[kAll] = {};
  Step last = kServer;
  for (int room = 0;; ++room) {
    SCOPED_TRACE(absl::StrCat("room for ", room, " threads"));
    ASSERT_LT(room, 64) << "more than 64 threads, or a step that never stops failing";
    ::testing::internal::CaptureStderr();
    ThreadLimit::Allow(room);
    Step failed = kAll;
    Status why;
    auto built = ServerBuilder()
                     .AddListeningPort(Address(GetParam()))
                     .RegisterService(&service)
                     .SetWorkerThreads(2)
                     .BuildAndStart();
    std::unique_ptr<Server> server;
    if (built.ok()) server = *std::move(built);
    auto made = server ? Channel::Create(server->addresses()[0]) : built.status();
    std::shared_ptr<Channel> channel;
    if (!server) {
      failed = kServer;
      why = built.status();
    } else if (!made.ok()) {
      failed = kChannel;
      why = made.status();
    } else {
      channel = *std::move(made);
      if (Status s = EchoOn(*channel, "small", absl::Seconds(10)); !s.ok()) {
        failed = kCall;
        why = s;
      }
    }
    ThreadLimit::Lift();
    const std::string log = ::testing::internal::GetCapturedStderr();
    if (failed == kAll) break;
    ++stopped_at[failed];
    EXPECT_TRUE(SaysTheLimit(why, log)) << kStepNames[failed];
    EXPECT_GE(failed, last) << kStepNames[failed] << " stopped after " << kStepNames[last];
    last = failed;
    if (channel) {
      // Past its backoff, the same channel connects and serves, small and
      // large (over RDMA, a READ).
      for (const size_t size : {size_t{5}, size_t{100000}}) {
        ClientContext ctx;
        ctx.set_timeout(absl::Seconds(20));
        ctx.set_wait_for_ready(true);
        EchoRequest req;
        req.set_data(std::string(size, 'A'));
        EchoResponse resp;
        const Status after = channel->Call(kEcho, &ctx, req, &resp);
        EXPECT_TRUE(after.ok()) << "once the limit was lifted: " << after;
        EXPECT_EQ(resp.data(), req.data());
      }
    }
    channel.reset();
    server.reset();
    ASSERT_TRUE(ThreadsBecome(before))
        << ThreadLimit::Threads() << " threads, " << before << " before " << kStepNames[failed];
  }
  for (int step = kServer; step < kAll; ++step) {
    EXPECT_GT(stopped_at[step], 0) << "no limit stopped " << kStepNames[step];
  }
}

// A call whose channel cannot start its connector's thread fails as after
// a failed connect attempt, and one that waits for ready waits: the
// channel tries again after its backoff, and connects once it can.
TEST_P(AtTheThreadLimit, AChannelThatCannotStartItsConnectorTriesAgainAfterItsBackoff) {
  ASSERT_FALSE(rdma::testing::RequireRdmaTestAddress().empty());
  TestServer server(Address(GetParam()));
  ASSERT_TRUE(server.server);
  auto channel = Channel::Create(server.address);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ThreadLimit::Allow(0);

  const Status plain = EchoOn(**channel, "plain", absl::Seconds(10));
  EXPECT_EQ(plain.code(), StatusCode::kUnavailable) << plain;
  EXPECT_TRUE(SaysTheLimit(plain.message()));
  EXPECT_NE(plain.message().find("no thread for the connector of channel " + server.address),
            std::string::npos)
      << plain;
  const ChannelStats failed = (*channel)->stats();
  EXPECT_GE(failed.connect_failures, 1u);
  EXPECT_EQ(failed.last_connect_error.code(), StatusCode::kUnavailable);

  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  ctx.set_wait_for_ready(true);
  EchoRequest req;
  req.set_data("waits");
  EchoResponse resp;
  std::promise<Status> ended;
  (*channel)->CallAsync(kEcho, &ctx, req, &resp, [&](Status s) { ended.set_value(s); });
  auto result = ended.get_future();
  // Failed attempts, one per backoff, while the limit stands.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*channel)->stats().connect_failures < failed.connect_failures + 2 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GE((*channel)->stats().connect_failures, failed.connect_failures + 2);
  EXPECT_EQ(result.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "a wait-for-ready call ended while the limit stood";
  ThreadLimit::Lift();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const Status s = result.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.data(), "waits");
}

}  // namespace
}  // namespace rdmarpc::testing
