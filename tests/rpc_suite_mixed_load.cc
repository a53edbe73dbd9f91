// The suite's mixed-load test: every kind of call at once (see rpc_suite.h).
//
// The other suite tests each drive one feature. Users drive them all at once:
// small and large messages (over RDMA, SENDs into the SRQ beside READs),
// attachments both ways, handlers inline and on threads of their own, handler
// errors, and deadlines and cancels racing all of it, from several threads
// over more than one connection. What must hold then is what holds for each
// alone: every call ends exactly once, with its own answer (bytes and
// metadata that name it, so that a mix-up shows) or with the status its fate
// allows; afterwards the server holds no call and still serves.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "tests/echo_service.h"
#include "tests/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

// Sizes on both sides of every threshold the transports have: RDMA's receive
// slot (8 KiB by default, the READ threshold just under it) and TCP's read
// chunks, up to payloads that take several READs.
constexpr size_t kSmallSizes[] = {0, 1, 100, 4095, 4096, 4097, 8000, 8191, 8192, 8193};
constexpr size_t kLargeSizes[] = {16384, 65536, 262145, 1 << 20};

// Bytes that name their call: a copy from another call, or from the wrong
// offset, differs.
std::string Pattern(uint64_t call, size_t size) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>((call * 2654435761u + i * 131) >> 3);
  return s;
}

struct MixedCall {
  enum class Fate { kAnswer, kFail, kCancel, kDeadline };
  Fate fate = Fate::kAnswer;
  uint64_t id = 0;
  EchoRequest request;
  size_t attachment_size = 0;
  uint64_t attachment_checksum = 0;
  ClientContext ctx;
  EchoResponse response;
  std::atomic<int> completions{0};
  Status status;
};

size_t PickSize(std::mt19937& rng) {
  if (rng() % 8 == 0) return kLargeSizes[rng() % std::size(kLargeSizes)];
  return kSmallSizes[rng() % std::size(kSmallSizes)];
}

// Builds call `id` and its fate from `rng`.
std::unique_ptr<MixedCall> MakeCall(Channel& ch, uint64_t id, std::mt19937& rng) {
  auto c = std::make_unique<MixedCall>();
  c->id = id;
  switch (rng() % 10) {
    case 0:
      c->fate = MixedCall::Fate::kFail;
      break;
    case 1:
    case 2:
      c->fate = MixedCall::Fate::kCancel;
      break;
    case 3:
    case 4:
      c->fate = MixedCall::Fate::kDeadline;
      break;
    default:
      break;
  }
  c->request.set_tag(static_cast<int64_t>(id));
  if (rng() % 4 == 0) {
    c->request.set_response_size(static_cast<int64_t>(PickSize(rng)));
  } else {
    c->request.set_data(Pattern(id, PickSize(rng)));
  }
  if (rng() % 10 == 0) c->request.set_sleep_ms(1 + static_cast<int>(rng() % 2));
  if (c->fate == MixedCall::Fate::kFail) {
    c->request.set_fail_code(static_cast<int>(StatusCode::kFailedPrecondition));
    c->request.set_fail_message(absl::StrCat("refused call ", id));
  }
  if (c->fate == MixedCall::Fate::kDeadline) {
    c->ctx.set_timeout(absl::Microseconds(rng() % 5000));
  }
  c->ctx.AddMetadata("echo-me", absl::StrCat(id));
  if (rng() % 4 == 0) {
    const std::string bytes = Pattern(~id, std::max<size_t>(1, PickSize(rng)));
    c->attachment_size = bytes.size();
    c->attachment_checksum = AttachmentChecksum(bytes);
    // Half in transport memory, as a user would write it; AllocateAttachment
    // does not wait out a restart (UNAVAILABLE), and CopyOf stands in then.
    bool in_place = false;
    if (rng() % 2 == 0) {
      auto att = ch.AllocateAttachment(bytes.size());
      if (att.ok()) {
        std::copy(bytes.begin(), bytes.end(), att->data());
        c->ctx.set_request_attachment(std::move(*att));
        in_place = true;
      } else {
        EXPECT_EQ(att.status().code(), StatusCode::kUnavailable) << att.status();
      }
    }
    if (!in_place) c->ctx.set_request_attachment(Attachment::CopyOf(bytes));
  }
  if (c->attachment_size == 0 && rng() % 8 == 0) {
    c->request.set_response_attachment_size(static_cast<int64_t>(1 + PickSize(rng)));
  }
  return c;
}

// What call `c` must have ended with; empty when it did.
std::string CheckCall(const MixedCall& c) {
  const std::string who = absl::StrCat("call ", c.id, ": ");
  if (c.completions.load() != 1) {
    return who + absl::StrCat("ended ", c.completions.load(), " times");
  }
  const StatusCode code = c.status.code();
  switch (c.fate) {
    case MixedCall::Fate::kFail:
      if (code != StatusCode::kFailedPrecondition ||
          c.status.message() != absl::StrCat("refused call ", c.id)) {
        return who + "expected the handler's own status, got " + c.status.ToString();
      }
      return "";
    case MixedCall::Fate::kCancel:
      if (code == StatusCode::kCancelled) return "";
      break;
    case MixedCall::Fate::kDeadline:
      if (code == StatusCode::kDeadlineExceeded) return "";
      break;
    case MixedCall::Fate::kAnswer:
      break;
  }
  if (!c.status.ok()) return who + "expected OK, got " + c.status.ToString();
  const EchoResponse& r = c.response;
  if (r.tag() != static_cast<int64_t>(c.id)) return who + absl::StrCat("tag ", r.tag());
  if (c.request.response_size() > 0) {
    if (r.data() != std::string(static_cast<size_t>(c.request.response_size()), 'r')) {
      return who + absl::StrCat("response of ", r.data().size(), " bytes, not ",
                                c.request.response_size(), " r's");
    }
  } else if (r.data() != c.request.data()) {
    return who + absl::StrCat("echo of ", r.data().size(), " bytes differs from the ",
                              c.request.data().size(), " sent");
  }
  if (r.attachment_size() != static_cast<int64_t>(c.attachment_size) ||
      r.attachment_checksum() != c.attachment_checksum) {
    return who + absl::StrCat("the handler saw an attachment of ", r.attachment_size(),
                              " bytes (checksum ", r.attachment_checksum(), "), not ",
                              c.attachment_size, " (", c.attachment_checksum, ")");
  }
  const absl::string_view back = c.ctx.response_attachment().view();
  if (c.request.response_attachment_size() > 0) {
    std::string want(static_cast<size_t>(c.request.response_attachment_size()), '\0');
    FillAttachment(want.data(), want.size());
    if (back != want) return who + absl::StrCat("response attachment of ", back.size(), " bytes");
  } else if (back.size() != c.attachment_size ||
             AttachmentChecksum(back) != c.attachment_checksum) {
    return who + absl::StrCat("attachment echoed as ", back.size(), " bytes");
  }
  const Metadata& md = c.ctx.server_metadata();
  if (md.size() != 1 || md[0].first != "echoed" || md[0].second != absl::StrCat(c.id)) {
    return who + "response metadata does not name the call";
  }
  return "";
}

struct MixedLoad {
  int threads = 4;
  int calls_per_thread = 150;
  int in_flight_per_thread = 8;
  // Every call waits through lost connections and restarts (a server that
  // is down refuses nothing then).
  bool wait_for_ready = false;
};

// Runs `load` over `channels` (thread t on channels[t % size]), and `during`
// on this thread meanwhile, given the count of calls ended so far. Returns
// the calls once every one has ended.
std::vector<std::unique_ptr<MixedCall>> RunMixedLoad(
    const std::vector<std::shared_ptr<Channel>>& channels, const MixedLoad& load,
    const std::function<void(const std::atomic<int>& ended)>& during) {
  std::vector<std::unique_ptr<MixedCall>> calls(load.threads * load.calls_per_thread);
  std::atomic<int> ended{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < load.threads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1000 + t);
      Channel& ch = *channels[t % channels.size()];
      std::mutex mu;
      std::condition_variable cv;
      int in_flight = 0;
      std::vector<MixedCall*> to_cancel;
      for (int i = 0; i < load.calls_per_thread; ++i) {
        {
          std::unique_lock<std::mutex> lock(mu);
          cv.wait(lock, [&] { return in_flight < load.in_flight_per_thread; });
          ++in_flight;
        }
        const uint64_t id = static_cast<uint64_t>(t) * load.calls_per_thread + i;
        calls[id] = MakeCall(ch, id, rng);
        MixedCall* c = calls[id].get();
        c->ctx.set_wait_for_ready(load.wait_for_ready);
        const MethodInfo& method = rng() % 10 == 0 ? kEchoLater : kEcho;
        ch.CallAsync(method, &c->ctx, c->request, &c->response, [&, c](Status s) {
          c->status = std::move(s);
          c->completions.fetch_add(1);
          ended.fetch_add(1);
          std::lock_guard<std::mutex> lock(mu);
          --in_flight;
          cv.notify_one();
        });
        if (c->fate == MixedCall::Fate::kCancel) {
          if (rng() % 3 == 0) {
            c->ctx.TryCancel();
          } else {
            to_cancel.push_back(c);
          }
        }
        // Later cancels land wherever their calls are by then, ended ones
        // included (a no-op).
        if (!to_cancel.empty() && rng() % 2 == 0) {
          to_cancel[rng() % to_cancel.size()]->ctx.TryCancel();
        }
      }
      for (MixedCall* c : to_cancel) c->ctx.TryCancel();
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return in_flight == 0; });
    });
  }
  during(ended);
  for (auto& th : threads) th.join();
  EXPECT_EQ(ended.load(), static_cast<int>(calls.size()));
  absl::SleepFor(absl::Milliseconds(100));  // a second completion would show now
  return calls;
}

// Checks every call (CheckCall) and prints how they ended.
void ExpectEachEndedAsItsFateAllows(const std::vector<std::unique_ptr<MixedCall>>& calls) {
  std::map<StatusCode, int> ends;
  int wrong_calls = 0;
  for (const auto& c : calls) {
    const std::string wrong = CheckCall(*c);
    EXPECT_EQ(wrong, "");
    if (!wrong.empty() && ++wrong_calls == 10) break;
    ++ends[c->status.code()];
  }
  for (const auto& [code, n] : ends) {
    printf("%s: %d calls\n", absl::StatusCodeToString(code).c_str(), n);
  }
  // The races were run, not just set up: some cancels and deadlines won.
  EXPECT_GT(ends[StatusCode::kCancelled], 0);
  EXPECT_GT(ends[StatusCode::kDeadlineExceeded], 0);
}

// The server holds no call once its clients have none, and `channels` are
// still served.
void ExpectServedAfterwards(Server& server, const std::vector<std::shared_ptr<Channel>>& channels) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (server.stats().calls_in_flight > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server.stats().calls_in_flight, 0u) << "the server still holds calls";
  for (const auto& ch : channels) {
    ClientContext ctx;
    EchoResponse resp;
    EchoRequest req;
    req.set_data(Pattern(7, 100000));
    const Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), req.data());
  }
}

// A lone channel with callback threads and one whose callbacks run inline.
std::vector<std::shared_ptr<Channel>> TwoChannels(const std::string& address) {
  std::vector<std::shared_ptr<Channel>> channels;
  ChannelOptions inline_callbacks;
  inline_callbacks.callback_threads = 0;
  for (const ChannelOptions& o : {ChannelOptions(), inline_callbacks}) {
    auto ch = Channel::Create(address, o);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (ch.ok()) channels.push_back(*ch);
  }
  return channels;
}

TEST_P(RpcSuite, MixedLoadEndsEveryCallOnceWithItsOwnAnswer) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  const auto channels = TwoChannels(ts.address);
  ASSERT_EQ(channels.size(), 2u);
  ExpectEachEndedAsItsFateAllows(RunMixedLoad(channels, MixedLoad(), [](const auto&) {}));
  ExpectServedAfterwards(*ts.server, channels);
}

// The load over a group's channels, a connection each, that share one
// transport, at its defaults: over RDMA one SRQ of 64 slots for all the
// servers' responses, with 256 calls wanting to be in flight. The client
// holds back the requests whose responses would find no slot; before it
// did, those responses met an empty SRQ, and on Soft-RoCE the RNR retry
// stalled the READs behind them until the servers ended the connections
// (bench/RESULTS.md, "RNR retry is no safety net on Soft-RoCE").
TEST_P(RpcSuite, MixedLoadOverTheChannelsOfAGroup) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  MixedLoad load;
  load.threads = 8;
  load.calls_per_thread = 100;
  load.in_flight_per_thread = 32;
  auto group = ChannelGroup::Create();
  ASSERT_TRUE(group.ok()) << group.status();
  std::vector<std::shared_ptr<Channel>> channels;
  for (int t = 0; t < load.threads; ++t) {
    auto ch = (*group)->NewChannel(ts.address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    channels.push_back(*ch);
  }
  ExpectEachEndedAsItsFateAllows(RunMixedLoad(channels, load, [](const auto&) {}));
  ExpectServedAfterwards(*ts.server, channels);
}

// The same load through graceful restarts: with wait-for-ready, a restart
// costs no call its answer (large ones pulled across the GOAWAY included).
TEST_P(RpcSuite, MixedLoadThroughGracefulRestartsLosesNoCall) {
  auto ts = std::make_unique<TestServer>(GetParam().listen_addr());
  ASSERT_TRUE(ts->server);
  const std::string address = ts->address;
  const auto channels = TwoChannels(address);
  ASSERT_EQ(channels.size(), 2u);
  MixedLoad load;
  load.wait_for_ready = true;
  constexpr int kRestarts = 3;
  const int total = load.threads * load.calls_per_thread;
  const auto calls = RunMixedLoad(channels, load, [&](const std::atomic<int>& ended) {
    for (int r = 1; r <= kRestarts; ++r) {
      const absl::Time until = absl::Now() + absl::Seconds(60);
      while (ended.load() < total * r / (kRestarts + 1) && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ts->server->Shutdown(absl::Seconds(30));
      ts.reset();
      ts = std::make_unique<TestServer>(address);
      ASSERT_TRUE(ts->server) << "restart " << r;
    }
  });
  ASSERT_TRUE(ts->server);
  ExpectEachEndedAsItsFateAllows(calls);
  uint64_t go_aways = 0;
  for (const auto& ch : channels) go_aways += ch->stats().go_aways;
  printf("%d restarts drained %llu connections\n", kRestarts,
         static_cast<unsigned long long>(go_aways));
  // A channel that had no connection at a restart (it lost the race to
  // reconnect after the last one) gets no GOAWAY there.
  EXPECT_GE(go_aways, static_cast<uint64_t>(kRestarts));
  ExpectServedAfterwards(*ts->server, channels);
}

}  // namespace
}  // namespace rdmarpc::testing
