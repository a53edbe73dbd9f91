// Channel groups, which share one transport's threads among channels to
// many servers, and channels destroyed from their own callbacks (see
// rpc_suite.h).

#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/threads_of_process.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"

namespace rdmarpc::testing {
namespace {

using test::EchoResponse;

int ThreadCount() { return static_cast<int>(ThreadIdsOfThisProcess().size()); }

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
// the call must succeed and the reference be gone. It drops it only once
// CallAsync has returned (ChannelOptions::callback_threads): it may run
// before then, on another thread, while CallAsync still uses the channel.
void ExpectDroppedByItsOwnCallback(std::shared_ptr<Channel> last) {
  Channel* raw = last.get();
  ClientContext ctx;
  EchoResponse resp;
  std::promise<Status> result;
  std::promise<void> returned;
  raw->CallAsync(kEcho, &ctx, Req("last"), &resp,
                 [&, call_returned = returned.get_future()](Status s) {
                   // Bounded: a call that fails to start calls back on this thread.
                   call_returned.wait_for(std::chrono::seconds(20));
                   last.reset();
                   result.set_value(s);
                 });
  returned.set_value();
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

}  // namespace
}  // namespace rdmarpc::testing
