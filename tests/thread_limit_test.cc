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
#include <dirent.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/steady_clock.h"
#include "base/threads_of_process.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "rpc/interceptor.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "transport/fallback_memory.h"
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

bool Empty(const char* dir) {
  DIR* d = opendir(dir);
  if (d == nullptr) return false;
  int entries = 0;
  while (const dirent* e = readdir(d)) entries += e->d_name[0] != '.';
  closedir(d);
  return entries == 0;
}

// This process in a cgroup of its own, whose pids.max the test sets; on a
// host (not the VM), it goes back to its own cgroup afterwards.
class ThreadLimit {
 public:
  static ::testing::AssertionResult Enter() {
    if (access(absl::StrCat(kRoot, "/cgroup.controllers").c_str(), F_OK) != 0) {
      // Nothing is mounted there in the VM; on a host, cgroup v1 may be.
      if (!Empty(kRoot) || mount("cgroup2", kRoot, "cgroup2", 0, nullptr) != 0) {
        return ::testing::AssertionFailure()
               << "no cgroup v2 tree at " << kRoot
               << ": run the test as root on a host with cgroup v2, or in the VM "
                  "(RDMARPC_VM=always make test)";
      }
    }
    std::ifstream in("/proc/self/cgroup");
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("0::", 0) == 0) home_ = line.substr(3);
    }
    if (!Write(absl::StrCat(kRoot, "/cgroup.subtree_control"), "+pids")) {
      return ::testing::AssertionFailure() << "no pids controller, or not root";
    }
    mkdir(kGroup, 0755);
    if (!Write(absl::StrCat(kGroup, "/cgroup.procs"), std::to_string(getpid()))) {
      return ::testing::AssertionFailure() << "cannot move into " << kGroup;
    }
    return ::testing::AssertionSuccess();
  }
  static void Leave() {
    Write(absl::StrCat(kRoot, home_ == "/" ? "" : home_, "/cgroup.procs"),
          std::to_string(getpid()));
    rmdir(kGroup);
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
  // Threads refused so far for the limit (pids.events).
  static long long Refusals() {
    std::ifstream in(absl::StrCat(kGroup, "/pids.events"));
    std::string key;
    long long n = -1;
    while (in >> key >> n && key != "max") n = -1;
    return n;
  }

 private:
  static inline std::string home_ = "/";  // the cgroup this process came from
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

// Whether no thread named `name` is left within 10 s. A connector ends on its
// own once connected; gone only after a limit was set at the count that
// still held it, it would leave room for a thread the test means to refuse.
bool NoThreadNamed(const char* name) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ThreadsNamed(name) > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return ThreadsNamed(name) == 0;
}

// What a failure for want of a thread must say: what lacked it, the limit,
// and what to do, once.
::testing::AssertionResult SaysTheLimit(absl::string_view text) {
  for (const char* part : {"no thread for ", "Resource temporarily unavailable",
                           "rdmarpc-thread-limit allows ", "pids.max", "Raise the limit"}) {
    if (text.find(part) == absl::string_view::npos) {
      return ::testing::AssertionFailure() << "no \"" << part << "\" in: " << text;
    }
  }
  if (text.find("Raise the limit") != text.rfind("Raise the limit")) {
    return ::testing::AssertionFailure() << "the advice more than once in: " << text;
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

template <typename Test>
class UnderThreadLimit : public Test {
 protected:
  static void SetUpTestSuite() { ASSERT_TRUE(ThreadLimit::Enter()); }
  static void TearDownTestSuite() { ThreadLimit::Leave(); }
  void TearDown() override { ThreadLimit::Lift(); }
};

class AtTheThreadLimit : public UnderThreadLimit<::testing::TestWithParam<std::string>> {};
class AnAutoChannelAtTheThreadLimit : public UnderThreadLimit<::testing::Test> {};

INSTANTIATE_TEST_SUITE_P(Transports, AtTheThreadLimit, ::testing::Values("rdma", "tcp", "auto"),
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

// A channel group's threads start with it, and a transport's with the
// group's first channel of its kind: where they cannot, the group or the
// channel is not made, and no transport without its thread is kept for the
// channels that come once the limit is lifted.
TEST_P(AtTheThreadLimit, AChannelGroupAndItsFirstChannelNeedTheirThreads) {
  TestServer server(Address(GetParam()));
  ASSERT_TRUE(server.server);
  ThreadLimit::Allow(0);
  auto refused = ChannelGroup::Create();
  ThreadLimit::Lift();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(SaysTheLimit(refused.status().message()));
  EXPECT_NE(refused.status().message().find("a channel group"), std::string::npos)
      << refused.status();

  auto group = ChannelGroup::Create();
  ASSERT_TRUE(group.ok()) << group.status();
  ThreadLimit::Allow(0);
  auto first = (*group)->NewChannel(server.address);
  ThreadLimit::Lift();
  ASSERT_FALSE(first.ok());
  EXPECT_TRUE(SaysTheLimit(first.status().message()));
  auto second = (*group)->NewChannel(server.address);
  ASSERT_TRUE(second.ok()) << second.status();
  const Status s = EchoOn(**second, "through the group");
  EXPECT_TRUE(s.ok()) << s;
}

// A channel dropped in its own inline callback is destroyed on a thread of
// its own (rpc/internal/own_thread.h). Where none can be had, it waits, and
// goes with the next channel destroyed that way once one can.
TEST_P(AtTheThreadLimit, AChannelDroppedInItsOwnCallbackGoesOnceAThreadCanBeHad) {
  TestServer server(Address(GetParam()));
  ASSERT_TRUE(server.server);
  // A connected channel whose call's callback drops the last reference to
  // it. Its options hold `alive`, which expires as the channel goes.
  struct Dropped {
    std::weak_ptr<ClientInterceptor> alive;
    std::shared_ptr<Channel> channel;
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    std::promise<Status> ended;
  };
  const auto connect = [&](Dropped& d) {
    ChannelOptions options;
    options.callback_threads = 0;
    auto alive = std::make_shared<ClientInterceptor>();
    d.alive = alive;
    options.interceptors.push_back(std::move(alive));
    auto made = Channel::Create(server.address, std::move(options));
    ASSERT_TRUE(made.ok()) << made.status();
    ASSERT_TRUE(EchoOn(**made, "connects first").ok());
    d.channel = *std::move(made);
  };
  const auto drop_in_callback = [&](Dropped& d) {
    Channel* raw = d.channel.get();
    d.ctx.set_timeout(absl::Seconds(20));
    d.req.set_data("last");
    raw->CallAsync(kEcho, &d.ctx, d.req, &d.resp, [&d](Status s) {
      d.channel.reset();
      d.ended.set_value(s);
    });
    auto ended = d.ended.get_future();
    ASSERT_EQ(ended.wait_for(std::chrono::seconds(20)), std::future_status::ready);
    EXPECT_TRUE(ended.get().ok());
  };
  const auto gone = [](const Dropped& d) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (!d.alive.expired() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    return d.alive.expired();
  };
  Dropped first;
  ASSERT_NO_FATAL_FAILURE(connect(first));
  ASSERT_TRUE(NoThreadNamed("rpc-connector"));
  ::testing::internal::CaptureStderr();
  ThreadLimit::Allow(0);
  drop_in_callback(first);
  ThreadLimit::Lift();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(SaysTheLimit(log)) << log;
  EXPECT_NE(log.find("no thread for work that cannot run where it was started"), std::string::npos)
      << log;
  // Deferred, not lost, and not done on the callback's thread: nothing else
  // could destroy it now.
  EXPECT_FALSE(first.alive.expired()) << "the first channel went without a thread";
  Dropped second;
  ASSERT_NO_FATAL_FAILURE(connect(second));
  drop_in_callback(second);
  EXPECT_TRUE(gone(second));
  EXPECT_TRUE(gone(first)) << "the first channel was never destroyed";
}

// An auto:// channel over TCP to a server that listens over RDMA too tries
// RDMA from time to time (ChannelOptions::transport.tcp_fallback_upgrade).
// A try that cannot start its thread is put off as one that failed, saying
// so, and the channel moves to RDMA once a try can have its thread. Before,
// such a try was dropped, and the channel stayed on TCP for good.
TEST_F(AnAutoChannelAtTheThreadLimit, MovesToRdmaOnceATryCanHaveItsThread) {
  TestServer server(Address("auto"));
  ASSERT_TRUE(server.server);
  // Over TCP first, as after a device went away.
  transport::FallbackMemory::Process().Remember(server.address, SteadyNow());
  ChannelOptions options;
  // The first try comes 1 to 2 s after the connection: well after the
  // limit is set below, even under a sanitizer.
  options.transport.tcp_fallback_upgrade = absl::Seconds(2);
  auto channel = Channel::Create(server.address, options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  ASSERT_TRUE(EchoOn(**channel, "over TCP").ok());
  ASSERT_EQ((*channel)->stats().upgrades, 0u) << "not over TCP first";
  // The connector that made the connection ends on its own: a try of RDMA
  // needs a thread of its own again.
  ASSERT_TRUE(NoThreadNamed("rpc-connector"));

  ::testing::internal::CaptureStderr();
  const long long refused = ThreadLimit::Refusals();
  ThreadLimit::Allow(0);
  const absl::Time tried_by = absl::Now() + absl::Seconds(10);
  while (ThreadLimit::Refusals() == refused && absl::Now() < tried_by) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_GT(ThreadLimit::Refusals(), refused) << "no try of RDMA within 10 s";
  EXPECT_EQ((*channel)->stats().upgrades, 0u) << "moved to RDMA without a thread";
  ThreadLimit::Lift();
  const absl::Time moved_by = absl::Now() + absl::Seconds(20);
  while ((*channel)->stats().upgrades == 0 && absl::Now() < moved_by) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ((*channel)->stats().upgrades, 1u) << "still over TCP once threads could be had";
  // Which limit it names is not asked here: the limit may be lifted as the
  // error is written (SaysTheLimit is checked where the limit stays).
  const size_t line = log.find(absl::StrCat(
      "rdmarpc[channel ", server.address, "]: no try of the faster way now (no thread for the ",
      "connector of channel ", server.address, ": Resource temporarily unavailable."));
  ASSERT_NE(line, std::string::npos) << log;
  EXPECT_NE(log.find("); the next in 4s\n", line), std::string::npos) << log;
  const Status s = EchoOn(**channel, "over RDMA");
  EXPECT_TRUE(s.ok()) << s;
}

}  // namespace
}  // namespace rdmarpc::testing
