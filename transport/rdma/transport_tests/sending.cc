// How frames go out: no lock held across a post, when a frame counts as
// delivered, credits and the backlog behind them, a SEND that finds the SRQ
// empty (retried and counted), and strict credits that keep the windows
// within the SRQ.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/transport_tests/fixture.h"

namespace rdmarpc::transport::rdma::transport_test {
namespace {

// No lock is held across ibv_post_send: while one thread is stopped inside
// its post (on purpose), another thread's Send on the same connection returns
// at once, and its frame goes out when the first post finishes. The server
// answers request 2 only once request 3 is in, and the client's keepalive is
// off, so nothing but that first poster can have sent request 3: no response
// reaches the client to flush its outbox meanwhile.
TEST(RdmaTransport, SendDoesNotWaitForAnotherThreadsPost) {
  struct AnswersTwoAfterThree : EchoObserver {
    void OnMessage(Connection& conn, InboundMessage&& msg) override {
      const uint64_t id = msg.header.call_id;
      if (id == 2) {
        std::lock_guard<std::mutex> lock(mu);
        two = std::move(msg);
        return;
      }
      EchoObserver::OnMessage(conn, std::move(msg));
      if (id != 3) return;
      std::optional<InboundMessage> held;
      {
        std::lock_guard<std::mutex> lock(mu);
        held = std::move(two);
        saw_three = true;
      }
      cv.notify_all();
      if (held) EchoObserver::OnMessage(conn, std::move(*held));
    }
    std::mutex mu;
    std::condition_variable cv;
    std::optional<InboundMessage> two;  // guarded by mu
    bool saw_three = false;             // guarded by mu
  } server_side;
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  fx.server_observer = &server_side;
  RdmaOptions client_opts;
  client_opts.keepalive_ms = 0;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_opts));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(Call(**conn, waiter, 1, Filled(**conn, 100, 1)).ok());
  auto send = [&](uint64_t id) { return (*conn)->Send(Request(id, Filled(**conn, 100, id))); };
  auto first_response = waiter.Expect(2);
  auto second_response = waiter.Expect(3);
  std::thread first([&] {
    FaultInjection::HoldNextPostOfThisThread();
    EXPECT_TRUE(send(2).ok());
  });
  FaultInjection::WaitUntilPostHeld();
  auto second = std::async(std::launch::async, [&] { return send(3); });
  const bool returned = second.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  FaultInjection::ReleaseHeldPost();
  first.join();
  EXPECT_TRUE(returned) << "Send waited while another thread was inside ibv_post_send";
  EXPECT_TRUE(second.get().ok());
  {
    std::unique_lock<std::mutex> lock(server_side.mu);
    ASSERT_TRUE(server_side.cv.wait_for(lock, std::chrono::seconds(20), [&] {
      return server_side.saw_three;
    })) << "request 3 stayed queued after the post it waited behind had finished";
  }
  for (auto* f : {&first_response, &second_response}) {
    ASSERT_EQ(f->wait_for(std::chrono::seconds(60)), std::future_status::ready);
  }
  InboundMessage r2 = first_response.get(), r3 = second_response.get();
  EXPECT_TRUE(r2.payload_status.ok() && Matches(r2.payload, 100, 2));
  EXPECT_TRUE(r3.payload_status.ok() && Matches(r3.payload, 100, 3));
  (*conn)->Close();
}

// Delivered() holds a frame undelivered until its SEND has completed, not
// only until it is posted: a close before the completion flushes it unsent.
// A small SEND goes unsignaled (signal_every), and on a connection with no
// keepalive and nothing else to send nothing would ever complete it, so
// Delivered() itself must get the tail completed. A server shutting down
// polls it before it closes its connections.
TEST(RdmaTransport, DeliveredWaitsUntilTheLastSendHasCompleted) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  RdmaOptions client_opts;
  client_opts.keepalive_ms = 0;
  client_opts.signal_every = 64;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_opts));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(Call(**conn, waiter, 1, Filled(**conn, 100, 1)).ok());
  auto response = waiter.Expect(2);
  ASSERT_TRUE((*conn)->Send(Request(2, Filled(**conn, 100, 2))).ok());
  EXPECT_FALSE((*conn)->Delivered()) << "a SEND just posted, unsignaled, counted as delivered";
  const absl::Time until = absl::Now() + absl::Seconds(20);
  bool delivered = false;
  while (!(delivered = (*conn)->Delivered()) && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(delivered) << "an unsignaled SEND on an idle connection never completed";
  ASSERT_EQ(response.wait_for(std::chrono::seconds(60)), std::future_status::ready);
  InboundMessage r = response.get();
  EXPECT_TRUE(r.payload_status.ok() && Matches(r.payload, 100, 2));
  (*conn)->Close();
  EXPECT_TRUE((*conn)->Delivered()) << "a closed connection has nothing more to deliver";
}

// An echo whose server I/O thread stops in the first request until Open():
// meanwhile that server neither refills its SRQ nor returns credit.
class HeldEcho : public EchoObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    std::unique_lock<std::mutex> lock(gate_mu);
    if (!first_seen) {
      first_seen = true;
      gate_cv.notify_all();
      gate_cv.wait(lock, [&] { return open; });
    }
    lock.unlock();
    EchoObserver::OnMessage(conn, std::move(msg));
  }
  bool WaitForFirst() {
    std::unique_lock<std::mutex> lock(gate_mu);
    return gate_cv.wait_for(lock, std::chrono::seconds(30), [&] { return first_seen; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(gate_mu);
    open = true;
    gate_cv.notify_all();
  }

 private:
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool first_seen = false;  // guarded by gate_mu
  bool open = false;        // guarded by gate_mu
};

// Every request came back, its 64 bytes echoed.
void ExpectEchoed(std::vector<std::future<InboundMessage>>& responses) {
  for (size_t k = 0; k < responses.size(); ++k) {
    ASSERT_EQ(responses[k].wait_for(std::chrono::seconds(60)), std::future_status::ready)
        << "request " << k << " never got its response";
    InboundMessage r = responses[k].get();
    EXPECT_TRUE(r.payload_status.ok() && Matches(r.payload, 64, r.header.call_id));
  }
}

void PrintRnrNaks(const DeviceRnrNaks& before, const DeviceRnrNaks& after) {
  printf("device RNR NAKs received %lld -> %lld, sent %lld -> %lld\n",
         static_cast<long long>(before.received), static_cast<long long>(after.received),
         static_cast<long long>(before.sent), static_cast<long long>(after.sent));
}

// A sender out of credit keeps its frames in a backlog, in order, and sends
// them as credit returns: small ones, ones with metadata, and ones whose
// payload goes by READ (advertised when queued, exposed when sent). Here the
// server is held in the first request while the client sends three times
// its credits' worth.
TEST(RdmaTransport, FramesBeyondTheCreditsWaitInTheBacklogAndAllArrive) {
  constexpr uint32_t kCredits = 4;
  constexpr int kFrames = 3 * kCredits;
  HeldEcho held;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.credits = kCredits;
  ASSERT_TRUE(fx.Start(server_opts));
  Waiter& waiter = fx.NewWaiter();
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t by_read = RdmaOptions().slot_size + 1;
  const auto size_of = [&](int i) -> size_t { return i % 3 == 0 ? by_read : 64 + i; };
  const uint64_t stalls_before = Counters().credit_stalls;
  const uint64_t reads_before = Counters().reads;
  std::vector<std::future<InboundMessage>> responses;
  for (int i = 0; i < kFrames; ++i) {
    const uint64_t id = 1000 + i;
    responses.push_back(waiter.Expect(id));
    std::string metadata = i % 2 == 0 ? absl::StrCat("frame-", i) : std::string();
    ASSERT_TRUE(
        (*conn)->Send(Request(id, Filled(**conn, size_of(i), id), std::move(metadata))).ok());
    if (i == 0) {
      ASSERT_TRUE(held.WaitForFirst());
    }
  }
  EXPECT_GE(Counters().credit_stalls - stalls_before, uint64_t{kFrames - kCredits})
      << "frames beyond the credits should have waited";
  held.Open();
  for (int i = 0; i < kFrames; ++i) {
    ASSERT_EQ(responses[i].wait_for(std::chrono::seconds(60)), std::future_status::ready)
        << "frame " << i << " was lost; counters: " << Counters().ToString();
    InboundMessage r = responses[i].get();
    ASSERT_TRUE(r.payload_status.ok()) << i << ": " << r.payload_status;
    EXPECT_TRUE(Matches(r.payload, size_of(i), 1000 + i)) << "frame " << i;
  }
  // Each large frame's request and response were pulled.
  EXPECT_GE(Counters().reads - reads_before, uint64_t{2 * (kFrames / 3)});
  (*conn)->Close();
}

// A server's observer that keeps the requests it is given, for the test to
// answer from its own thread: a handler that runs off the I/O thread.
class AnswersLater : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kRequest) return;
    std::lock_guard<std::mutex> lock(mu_);
    kept_.emplace_back(&conn, std::move(msg));
    ++received_;
    cv_.notify_all();
  }
  void OnClosed(Connection&, const absl::Status&) override {}
  // Whether `n` requests came in all, within 30 s.
  bool WaitFor(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(30), [&] { return received_ >= n; });
  }
  // Echoes every request kept so far, on the connection it came on.
  void AnswerAll() {
    std::vector<std::pair<Connection*, InboundMessage>> kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      kept.swap(kept_);
    }
    for (auto& [conn, msg] : kept) echo_.OnMessage(*conn, std::move(msg));
  }

 private:
  EchoObserver echo_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<Connection*, InboundMessage>> kept_;  // guarded by mu_
  int received_ = 0;                                          // guarded by mu_
};

// One client connection to a server whose connections get windows of
// `window` frames and whose requests wait for the test (AnswersLater).
struct ToALateAnswerer {
  AnswersLater server;
  Fixture fx;  // after `server`, which it calls until it shuts down
  Waiter* waiter = nullptr;
  std::shared_ptr<Connection> conn;
  // False, with the test failed and the reason said, when either fails.
  bool Start(uint32_t window) {
    fx.server_observer = &server;
    RdmaOptions server_opts;
    server_opts.credits = window;
    if (!fx.Start(server_opts)) return false;
    waiter = &fx.NewWaiter();
    auto c = fx.Connect(waiter);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return false;
    conn = std::move(*c);
    return true;
  }
};

// At the windows of 2 and 3 that 124 to 186 connections sharing a server's
// default slots get, a call answered off the server's I/O thread costs no kCredit
// frame: its client still holds credit while it waits, and the answer
// brings the request's back. (Returning it at once would double the server's
// SENDs.) One call at a time, 40 per window.
TEST(RdmaTransport, CallsAnsweredOffTheIoThreadAtSmallWindowsCostNoCreditFrame) {
  for (uint32_t window : {2u, 3u}) {
    SCOPED_TRACE(absl::StrCat("window ", window));
    ToALateAnswerer t;
    ASSERT_TRUE(t.Start(window));
    const uint64_t before = Counters().credit_messages;
    for (int id = 1; id <= 40; ++id) {
      std::future<InboundMessage> response = t.waiter->Expect(id);
      ASSERT_TRUE(t.conn->Send(Request(id, Filled(*t.conn, 64, id))).ok());
      ASSERT_TRUE(t.server.WaitFor(id)) << "request " << id << " never reached the server";
      t.server.AnswerAll();
      ASSERT_EQ(response.wait_for(std::chrono::seconds(30)), std::future_status::ready)
          << "call " << id << " never got its response";
      EXPECT_TRUE(Matches(response.get().payload, 64, id)) << "call " << id;
    }
    EXPECT_EQ(Counters().credit_messages - before, 0u)
        << "kCredit frames went beside the answers; counters: " << Counters().ToString();
    t.conn->Close();
  }
}

// A client that sends more than its window before any answer comes still
// gets its credit back in kCredit frames: at once when it holds none (a
// window of 1), else in twos, not a frame at a time. The server answers
// only once all 40 requests are in, which they can be only by kCredit.
TEST(RdmaTransport, APeerPastItsWindowGetsCreditBackWithoutAnswers) {
  constexpr int kFrames = 40;
  for (uint32_t window : {1u, 2u, 3u}) {
    SCOPED_TRACE(absl::StrCat("window ", window));
    ToALateAnswerer t;
    ASSERT_TRUE(t.Start(window));
    const uint64_t before = Counters().credit_messages;
    std::vector<std::future<InboundMessage>> responses;
    for (int id = 1; id <= kFrames; ++id) {
      responses.push_back(t.waiter->Expect(id));
      ASSERT_TRUE(t.conn->Send(Request(id, Filled(*t.conn, 64, id))).ok());
    }
    ASSERT_TRUE(t.server.WaitFor(kFrames))
        << "the requests past the window never got their credit; counters: "
        << Counters().ToString();
    const uint64_t credit_frames = Counters().credit_messages - before;
    if (window > 1) {
      EXPECT_LE(credit_frames, uint64_t{kFrames / 2})
          << credit_frames << " kCredit frames: credit went back a frame at a time";
    }
    t.server.AnswerAll();
    ExpectEchoed(responses);
    t.conn->Close();
  }
}

// A listening transport shares its SRQ's slots among its connections, but
// each connection may send at least one frame: past as many connections as
// the slots hold frames, a burst from all of them at once can empty the SRQ.
// Then the device answers RNR NAK, the sender retries, and nothing is lost;
// the device counts the NAKs. Here 16 slots (2 of refill lag, 3 for control
// frames) hold 11 frames, and 20 connections burst while the server's I/O
// thread is held in the first request's handler, so it cannot refill.
TEST(RdmaTransport, EmptySrqIsRetriedAndCounted) {
  HeldEcho held;
  constexpr int kConns = 20, kFrames = 4;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 16;
  server_opts.credits = 8;
  ASSERT_TRUE(fx.Start(server_opts));
  // The twelfth connection's one frame no longer fits, which the server
  // says once, with what to change.
  const std::string overcommitted = "connections share 16 receive slots";
  std::vector<std::shared_ptr<Connection>> conns;
  for (int i = 0; i < kConns; ++i) {
    ::testing::internal::CaptureStderr();
    auto c = fx.Connect(&fx.NewWaiter());
    const std::string said = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
    if (i != 11) {
      EXPECT_EQ(said.find(overcommitted), std::string::npos) << "connection " << i + 1 << said;
      continue;
    }
    const std::string device =
        std::static_pointer_cast<RdmaConnection>(*c)->endpoint()->device_name();
    for (const std::string& part :
         {absl::StrCat("test-server]: ", device, ": 12 ", overcommitted,
                       ", and each may send at least one frame: their windows no longer fit "
                       "the 11 frames"),
          std::string("retry each frame after 640 us"),
          std::string("raise RdmaOptions::server_receive_slots, or set "
                      "RdmaOptions::strict_credits")}) {
      EXPECT_NE(said.find(part), std::string::npos) << part << " not in: " << said;
    }
  }
  const DeviceRnrNaks before = ReadDeviceRnrNaks();
  std::vector<std::future<InboundMessage>> responses;
  for (int c = 0; c < kConns; ++c) {
    for (int i = 1; i <= kFrames; ++i) {
      const uint64_t id = static_cast<uint64_t>(c * 100 + i);
      responses.push_back(fx.waiters[c].Expect(id));
      ASSERT_TRUE(conns[c]->Send(Request(id, Filled(*conns[c], 64, id))).ok());
    }
  }
  ASSERT_TRUE(held.WaitForFirst());
  // The retries go on while the server is held; give the device a moment
  // to have NAKed the frames beyond the 16 slots.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  DeviceRnrNaks during = ReadDeviceRnrNaks();
  while (during.received >= 0 && during.received == before.received && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
    during = ReadDeviceRnrNaks();
  }
  held.Open();
  for (int k = 0; k < static_cast<int>(responses.size()); ++k) {
    ASSERT_EQ(responses[k].wait_for(std::chrono::seconds(60)), std::future_status::ready)
        << "frame " << k << " was lost";
    InboundMessage r = responses[k].get();
    EXPECT_TRUE(r.payload_status.ok() && Matches(r.payload, 64, r.header.call_id));
  }
  const DeviceRnrNaks after = ReadDeviceRnrNaks();
  PrintRnrNaks(before, after);
  // Soft-RoCE counts both sides; a hardware NIC may not.
  if (access("/sys/class/infiniband/rxe0", F_OK) == 0) {
    ASSERT_GE(after.received, 0) << "rxe's rcvd_rnr_err was not read";
    ASSERT_GE(after.sent, 0) << "rxe's send_rnr_err was not read";
  }
  if (after.received >= 0) {
    EXPECT_GT(after.received, before.received) << "frames beyond the SRQ's slots were not NAKed";
  } else {
    printf("this device exposes no count of RNR NAKs received; delivery was checked\n");
  }
  EXPECT_EQ(Counters().rnr_retry_exhausted, 0u);
  for (auto& c : conns) c->Close();
}

// Credits cannot keep a client's SRQ from running empty: its connections
// share it, and each server grants its own window. So a client endpoint
// sends no more requests at once than its posted slots hold responses
// (Endpoint::TakeResponseRoom): here 4 connections with windows of 16 want
// 64 requests out at once over 32 slots, 21 go (32, less 4 of refill lag
// and, for control frames, 5 per connection but at most a quarter of the
// 28 left), the rest wait in their backlogs and go as
// responses come back, and no response meets an empty SRQ.
TEST(RdmaTransport, AClientSendsNoMoreRequestsThanItsSlotsHoldResponses) {
  HeldEcho held;
  constexpr int kConns = 4, kFrames = 16;
  constexpr size_t kRoom = 21;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.credits = kFrames;
  RdmaOptions client_opts;
  client_opts.client_receive_slots = 32;
  ASSERT_TRUE(fx.Start(server_opts, client_opts));
  std::vector<std::shared_ptr<Connection>> conns;
  for (int i = 0; i < kConns; ++i) {
    auto c = fx.Connect(&fx.NewWaiter());
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
  }
  Endpoint* const client = std::static_pointer_cast<RdmaConnection>(conns[0])->endpoint();
  // The poller counts a connection in once it is established on our side.
  for (const absl::Time by = absl::Now() + absl::Seconds(10);
       client->ResponseRoomLimit() != kRoom && absl::Now() < by;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(client->ResponseRoomLimit(), kRoom);
  const DeviceRnrNaks before = ReadDeviceRnrNaks();
  const uint64_t stalls_before = Counters().credit_stalls;
  std::vector<std::future<InboundMessage>> responses;
  ::testing::internal::CaptureStderr();
  for (int i = 1; i <= kFrames; ++i) {
    for (int c = 0; c < kConns; ++c) {
      const uint64_t id = static_cast<uint64_t>(c * 100 + i);
      responses.push_back(fx.waiters[c].Expect(id));
      ASSERT_TRUE(conns[c]->Send(Request(id, Filled(*conns[c], 64, id))).ok());
    }
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  fputs(said.c_str(), stderr);
  // Said once, with the bound and what to raise.
  const std::string ran_out = "21 calls in flight fill the room for responses in 32 receive slots";
  const size_t at = said.find(ran_out);
  EXPECT_NE(at, std::string::npos) << said;
  EXPECT_EQ(said.find("fill the room", at + ran_out.size()), std::string::npos) << said;
  EXPECT_NE(said.find("raise RdmaOptions::client_receive_slots"), std::string::npos) << said;
  ASSERT_TRUE(held.WaitForFirst());
  // The server answers nothing yet: what went out is all the room there is.
  EXPECT_EQ(client->responses_awaited(), kRoom);
  EXPECT_GE(Counters().credit_stalls - stalls_before, uint64_t{kConns * kFrames - kRoom});
  held.Open();
  ExpectEchoed(responses);
  EXPECT_EQ(client->responses_awaited(), 0u);
  const DeviceRnrNaks after = ReadDeviceRnrNaks();
  PrintRnrNaks(before, after);
  EXPECT_EQ(after.received, before.received) << "a response met the client's empty SRQ";
  EXPECT_EQ(after.sent, before.sent);
  for (auto& c : conns) c->Close();
}

// A listening transport keeps the credits its peers hold within its SRQ's
// slots, however many connect: each new connection shrinks the windows, and
// a peer that holds more than its window gives the difference back
// (kShrink), idle or not; as connections leave, the windows grow again, as
// the peers send.
// Here 64 slots (8 of refill lag, 5 per connection for control frames, at
// most 14) and windows of 32: one connection gets 32, two 23 each, three 14,
// four 10, and the four may hold 42 in all. They then burst 32 requests
// each while the server's I/O thread is held: every frame finds a posted
// slot, no RNR NAK, where windows of 32 each would send 128 frames into 64
// slots.
TEST(RdmaTransport, AServerSharesItsSlotsAmongItsConnections) {
  HeldEcho held;
  constexpr int kConns = 4, kFrames = 32;
  constexpr uint32_t kWindows[kConns] = {32, 23, 14, 10};
  constexpr int64_t kBudget = 42;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 64;
  server_opts.credits = kFrames;
  RdmaOptions client_opts;
  client_opts.client_receive_slots = 512;  // room for every response: the server's slots are tested
  ASSERT_TRUE(fx.Start(server_opts, client_opts));
  const uint64_t shrinks_before = Counters().credit_shrinks;
  std::vector<std::shared_ptr<Connection>> conns;
  std::vector<std::shared_ptr<RdmaConnection>> accepted;
  for (int i = 0; i < kConns; ++i) {
    auto c = fx.Connect(&fx.NewWaiter());
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
    accepted.push_back(std::static_pointer_cast<RdmaConnection>(fx.LastAccepted()));
    ASSERT_NE(accepted.back(), nullptr);
    EXPECT_EQ(accepted.back()->credit_window(), kWindows[i]) << "connection " << i + 1;
  }
  Endpoint* const server = accepted[0]->endpoint();
  const auto holds = [&] {
    std::vector<int64_t> h;
    server->RunOnPollerAndWait([&] {
      for (const auto& a : accepted) h.push_back(a->peer_holds());
    });
    return h;
  };
  const auto held_in_all = [&] {
    const std::vector<int64_t> h = holds();
    return std::accumulate(h.begin(), h.end(), int64_t{0});
  };
  // The first three, idle since they connected, gave back what the later
  // ones took past the budget, the largest holders first.
  for (const absl::Time by = absl::Now() + absl::Seconds(10);
       held_in_all() > kBudget && absl::Now() < by;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(held_in_all(), kBudget);
  EXPECT_GE(Counters().credit_shrinks - shrinks_before, 3u);

  const DeviceRnrNaks before = ReadDeviceRnrNaks();
  std::vector<std::future<InboundMessage>> responses;
  for (int i = 1; i <= kFrames; ++i) {
    for (int c = 0; c < kConns; ++c) {
      const uint64_t id = static_cast<uint64_t>(c * 100 + i);
      responses.push_back(fx.waiters[c].Expect(id));
      ASSERT_TRUE(conns[c]->Send(Request(id, Filled(*conns[c], 64, id))).ok());
    }
  }
  ASSERT_TRUE(held.WaitForFirst());
  // Time for every frame the windows allow to land (and any beyond the
  // slots to be NAKed) while the server cannot refill.
  absl::SleepFor(absl::Milliseconds(500));
  const DeviceRnrNaks during = ReadDeviceRnrNaks();
  held.Open();
  ExpectEchoed(responses);
  PrintRnrNaks(before, during);
  EXPECT_EQ(during.received, before.received) << "a request met the server's empty SRQ";
  EXPECT_EQ(during.sent, before.sent);

  // Alone again, the first connection's window grows back to all of 32,
  // topped up with the answer to its next request.
  for (int c = 1; c < kConns; ++c) conns[c]->Close();
  accepted.resize(1);
  const auto window = [&] {
    uint32_t w = 0;
    server->RunOnPollerAndWait([&] { w = server->CreditWindow(); });
    return w;
  };
  // The server's ends go once their queue pairs have drained.
  for (const absl::Time by = absl::Now() + absl::Seconds(20);
       window() != kWindows[0] && absl::Now() < by;) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(window(), kWindows[0]);
  ASSERT_TRUE(Call(*conns[0], fx.waiters[0], 1000, Filled(*conns[0], 64, 1000)).ok());
  EXPECT_EQ(holds(), std::vector<int64_t>{kWindows[0]}) << "the window did not grow back";
  conns[0]->Close();
}

// rxe's count of frames its devices sent again because no ACK came in time
// (completer_retry_err), device-wide; -1 without rxe.
int64_t DeviceResends() {
  FILE* f = fopen("/sys/class/infiniband/rxe0/ports/1/hw_counters/completer_retry_err", "r");
  if (f == nullptr) return -1;
  long long n = -1;
  if (fscanf(f, "%lld", &n) != 1) n = -1;
  fclose(f);
  return n;
}

// Both ends' count of the credits a server's clients hold: the server's,
// per connection (read on its poller), and the clients' own.
struct CreditLedger {
  std::vector<std::shared_ptr<Connection>> clients;
  std::vector<std::shared_ptr<Connection>> servers;  // the same connections' server ends

  // Waits (up to 10 s) until the server has accepted every client.
  bool FindServerEnds(Fixture& fx) {
    for (const absl::Time by = absl::Now() + absl::Seconds(10);
         (servers = fx.Accepted()).size() < clients.size() && absl::Now() < by;) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    return servers.size() == clients.size();
  }
  std::vector<int64_t> AtServer() const {
    std::vector<int64_t> held;
    std::static_pointer_cast<RdmaConnection>(servers[0])->endpoint()->RunOnPollerAndWait([&] {
      for (const auto& s : servers) {
        held.push_back(std::static_pointer_cast<RdmaConnection>(s)->peer_holds());
      }
    });
    return held;
  }
  int64_t ServerTotal() const {
    const std::vector<int64_t> held = AtServer();
    return std::accumulate(held.begin(), held.end(), int64_t{0});
  }
  int64_t ClientTotal() const {
    int64_t held = 0;
    for (const auto& c : clients)
      held += std::static_pointer_cast<RdmaConnection>(c)->credits_held();
    return held;
  }
  // Waits (up to 20 s) until the server counts at most `budget` and the
  // clients agree.
  void Settle(int64_t budget) const {
    for (const absl::Time by = absl::Now() + absl::Seconds(20);
         (ServerTotal() > budget || ClientTotal() != ServerTotal()) && absl::Now() < by;) {
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
};

// Connections that join at once: each shrinks the windows of those before
// it, some of which rdma_cm has not yet established. Their peers are asked
// back their excess only once established (a kShrink sent before the
// client's QP can receive is dropped, and resent after the ACK timeout),
// and then they are asked: the budget holds again, with no frame resent.
// The clients' credits agree with what the server counts them to hold,
// even where a kShrink overtook the handshake at the client. Ten
// connections over 64 slots, as above, share 42 credits.
TEST(RdmaTransport, ConnectionsThatJoinAtOnceGiveBackOnceEstablished) {
  constexpr int kConns = 10;
  constexpr int64_t kBudget = 42;
  Fixture fx;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 64;
  server_opts.credits = 32;
  RdmaOptions client_opts;
  client_opts.client_receive_slots = 512;
  ASSERT_TRUE(fx.Start(server_opts, client_opts));
  for (int i = 0; i < kConns; ++i) fx.NewWaiter();
  const int64_t resends_before = DeviceResends();
  std::vector<absl::StatusOr<std::shared_ptr<Connection>>> conns(kConns);
  {
    std::vector<std::thread> connecting;
    for (int i = 0; i < kConns; ++i) {
      connecting.emplace_back([&, i] { conns[i] = fx.Connect(&fx.waiters[i]); });
    }
    for (auto& t : connecting) t.join();
  }
  CreditLedger ledger;
  for (const auto& c : conns) {
    ASSERT_TRUE(c.ok()) << c.status();
    ledger.clients.push_back(*c);
  }
  ASSERT_TRUE(ledger.FindServerEnds(fx));
  ledger.Settle(kBudget);
  EXPECT_EQ(ledger.ServerTotal(), kBudget);
  EXPECT_EQ(ledger.ClientTotal(), ledger.ServerTotal());
  const int64_t resends_after = DeviceResends();
  if (access("/sys/class/infiniband/rxe0", F_OK) == 0) {
    ASSERT_GE(resends_after, 0) << "rxe's completer_retry_err was not read";
  }
  printf("device resends while connecting: %lld\n",
         static_cast<long long>(resends_after - resends_before));
  EXPECT_EQ(resends_after, resends_before) << "a frame reached a peer before it could receive";
  for (int i = 0; i < kConns; ++i) {
    ASSERT_TRUE(Call(**conns[i], fx.waiters[i], 1 + i, Filled(**conns[i], 64, 1 + i)).ok());
  }
  for (auto& c : conns) (*c)->Close();
}

// A peer that cannot answer a kShrink (its process stopped; here its
// client's I/O thread is held) while another connection sends. A joins
// alone (window 32) and holds its I/O thread; B, C and D join from another
// client transport, shrinking the windows to 10, and A is asked back its
// excess in vain. B then sends 64 requests. With shrink_answer_timeout_ms
// (`timeout_ms`), what A holds past its window stops counting against the
// slots once it is overdue, which the server says once, and B's burst
// leaves B's peer topped up to its window, where with A's 32 counted it is
// held to 1. Either way, once A's thread runs again, A answers, is asked
// for what it still holds past its window, and the credits the clients
// hold agree with what the server counts, within the budget.
void PeerThatCannotAnswerAShrink(uint32_t timeout_ms) {
  constexpr int64_t kBudget = 42;
  constexpr uint32_t kWindow = 10;
  HeldReceiver held;  // outlives the client transports, which call it
  Fixture fx;
  HeldReceiver::OpenAtExit open_at_exit{held};
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 64;
  server_opts.credits = 32;
  server_opts.shrink_answer_timeout_ms = timeout_ms;
  RdmaOptions client_opts;
  client_opts.client_receive_slots = 512;
  ASSERT_TRUE(fx.Start(server_opts, client_opts));
  auto a = fx.Connect(&held);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Call(**a, held, 1, Filled(**a, 64, 1)).ok());
  ASSERT_TRUE(
      (*a)->Send(Request(HeldReceiver::kFirst, Filled(**a, 64, HeldReceiver::kFirst))).ok());
  {
    std::unique_lock<std::mutex> lock(held.mu);
    ASSERT_TRUE(held.cv.wait_for(lock, std::chrono::seconds(20), [&] { return held.received > 0; }))
        << "A's I/O thread was never held";
  }
  TransportOptions co;
  co.name = "test-client-2";
  RdmaTransport others(co, client_opts, false);
  std::vector<std::shared_ptr<Connection>> conns = {*a};
  const uint64_t overdue_before = Counters().credit_shrinks_overdue;
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 3; ++i) {
    auto c = others.Connect(fx.addr, &fx.NewWaiter(), SteadyNow() + absl::Seconds(30));
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
  }
  // Counted once the line is out.
  for (const absl::Time by = absl::Now() + absl::Seconds(timeout_ms ? 20 : 1);
       Counters().credit_shrinks_overdue == overdue_before && absl::Now() < by;) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::string said = ::testing::internal::GetCapturedStderr();
  fputs(said.c_str(), stderr);
  const uint64_t overdue = timeout_ms ? 1 : 0;
  ASSERT_EQ(Counters().credit_shrinks_overdue - overdue_before, overdue);
  EXPECT_EQ(said.find("test-server]: rdma://") != std::string::npos &&
                said.find("has not answered a request for") != std::string::npos,
            overdue == 1)
      << said;

  CreditLedger ledger{conns, {}};
  ASSERT_TRUE(ledger.FindServerEnds(fx));
  std::vector<std::future<InboundMessage>> responses;
  for (uint64_t id = 1; id <= 64; ++id) {
    responses.push_back(fx.waiters[0].Expect(id));
    ASSERT_TRUE(conns[1]->Send(Request(id, Filled(*conns[1], 64, id))).ok());
  }
  ExpectEchoed(responses);
  EXPECT_EQ(ledger.AtServer()[1], timeout_ms ? int64_t{kWindow} : 1)
      << "what B's peer holds after its burst";

  held.Open();
  ledger.Settle(kBudget);
  EXPECT_LE(ledger.ServerTotal(), kBudget);
  EXPECT_EQ(ledger.ClientTotal(), ledger.ServerTotal());
  EXPECT_EQ(Counters().credit_shrinks_overdue - overdue_before, overdue);
  ASSERT_TRUE(Call(**a, held, 2, Filled(**a, 64, 2)).ok());
  for (auto& c : conns) c->Close();
}

TEST(RdmaTransport, APeerThatCannotAnswerAShrinkHoldsNoOneBack) {
  PeerThatCannotAnswerAShrink(200);
}

TEST(RdmaTransport, APeerThatAnswersAShrinkLateIsAskedAgain) { PeerThatCannotAnswerAShrink(0); }

// The window the server granted on the connection it accepted last.
uint32_t ServerWindowOfLastAccepted(Fixture& fx) {
  return std::static_pointer_cast<RdmaConnection>(fx.LastAccepted())->credit_window();
}

// strict_credits on a server: windows that fit the SRQ together, a connect
// request refused (saying why) when none fits, and the room back once a
// connection closes. With 32 slots, 4 of them refill lag
// (Endpoint::StrictUnpostedSlots), and windows of 16, each taking three
// more slots for kCredit frames: 16, 6, then nothing; without the option the
// third would connect too, and a burst from the three would overrun the
// SRQ. A burst from the two, with the server's poller held, finds a posted
// slot for every frame: no RNR NAK, and every frame answered; and so do 40
// bursts with the server answering as they come (the worst case of the
// refill lag needs timing that this does not force).
TEST(RdmaTransport, StrictCreditsGrantOnlyWhatTheSrqHoldsAndRefuseTheRest) {
  HeldEcho held;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 32;
  server_opts.credits = 16;
  server_opts.strict_credits = true;
  ASSERT_TRUE(fx.Start(server_opts));
  std::vector<std::shared_ptr<Connection>> conns;
  for (uint32_t expected : {16u, 6u}) {
    auto c = fx.Connect(&fx.NewWaiter());
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
    EXPECT_EQ(ServerWindowOfLastAccepted(fx), expected) << "connection " << conns.size();
    // What the handshake told the client, before it sent anything.
    const std::string terms = std::static_pointer_cast<RdmaConnection>(*c)->DescribeTerms();
    EXPECT_NE(terms.find(absl::StrCat("the peer ", expected, ";")), std::string::npos) << terms;
  }
  ::testing::internal::CaptureStderr();
  auto refused = fx.Connect(&fx.NewWaiter());
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(refused.ok()) << "a third window was granted";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  const std::string why =
      "strict_credits: no receive slots left to grant (2 connections hold 28 of 32, 4 cover "
      "refills); raise server_receive_slots";
  EXPECT_NE(
      refused.status().message().find(absl::StrCat("the server refused the connection: ", why)),
      std::string::npos)
      << refused.status();
  EXPECT_NE(said.find("test-server]: refusing connection from "), std::string::npos) << said;
  EXPECT_NE(said.find(why), std::string::npos) << said;
  // The client's transport may say its own windows overcommit; the server's
  // never do.
  const std::string device =
      std::static_pointer_cast<RdmaConnection>(conns[0])->endpoint()->device_name();
  EXPECT_EQ(said.find(absl::StrCat("test-server]: ", device, ": the")), std::string::npos) << said;

  const DeviceRnrNaks before = ReadDeviceRnrNaks();
  std::vector<std::future<InboundMessage>> responses;
  for (size_t c = 0; c < conns.size(); ++c) {
    for (uint64_t i = 1; i <= 16; ++i) {
      const uint64_t id = c * 100 + i;
      responses.push_back(fx.waiters[c].Expect(id));
      ASSERT_TRUE(conns[c]->Send(Request(id, Filled(*conns[c], 64, id))).ok());
    }
  }
  ASSERT_TRUE(held.WaitForFirst());
  // Time for NAKs to show, had a frame found no slot (EmptySrqIsRetriedAndCounted
  // sees them within this).
  const absl::Time until = absl::Now() + absl::Seconds(2);
  while (absl::Now() < until && ReadDeviceRnrNaks().received == before.received) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const DeviceRnrNaks during = ReadDeviceRnrNaks();
  held.Open();
  for (auto& r : responses) {
    ASSERT_EQ(r.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    InboundMessage m = r.get();
    EXPECT_TRUE(m.payload_status.ok() && Matches(m.payload, 64, m.header.call_id));
  }
  EXPECT_EQ(during.received, before.received) << "a frame found the SRQ empty";
  // Then as in normal operation, the server answering as frames come and
  // each answer bringing its connection's next frames: still none.
  uint64_t id = 1000;
  for (int round = 0; round < 40; ++round) {
    responses.clear();
    for (size_t c = 0; c < conns.size(); ++c) {
      for (int i = 0; i < 16; ++i, ++id) {
        responses.push_back(fx.waiters[c].Expect(id));
        ASSERT_TRUE(conns[c]->Send(Request(id, Filled(*conns[c], 64, id))).ok());
      }
    }
    for (auto& r : responses) {
      ASSERT_EQ(r.wait_for(std::chrono::seconds(60)), std::future_status::ready);
    }
  }
  EXPECT_EQ(ReadDeviceRnrNaks().received, before.received) << "a frame found the SRQ empty";

  // The first connection's window (and its three) come back once it is gone.
  conns[0]->Close();
  absl::StatusOr<std::shared_ptr<Connection>> again = absl::UnavailableError("not tried");
  for (const absl::Time by = absl::Now() + absl::Seconds(20); !again.ok() && absl::Now() < by;) {
    ::testing::internal::CaptureStderr();
    again = fx.Connect(&fx.NewWaiter());
    ::testing::internal::GetCapturedStderr();
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(again.ok()) << "the closed connection's slots never came back: " << again.status();
  EXPECT_EQ(ServerWindowOfLastAccepted(fx), 16u);
  auto r = Call(**again, fx.waiters.back(), 1, Filled(**again, 64, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  for (auto& c : conns) c->Close();
  (*again)->Close();
}

// strict_credits on a client: its SRQ (client_receive_slots) is shared by
// its connections as a server's is, so a connect that would find no slots
// left for its window fails RESOURCE_EXHAUSTED, naming the option to raise,
// before the server hears of it.
TEST(RdmaTransport, StrictCreditsOnAClientFailTheConnectThatFindsNoSlots) {
  Fixture fx;
  RdmaOptions client_opts;
  client_opts.client_receive_slots = 32;
  client_opts.credits = 16;
  client_opts.strict_credits = true;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_opts));
  std::vector<std::shared_ptr<Connection>> conns;
  for (uint32_t expected : {16u, 6u}) {
    auto c = fx.Connect(&fx.NewWaiter());
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
    EXPECT_EQ(std::static_pointer_cast<RdmaConnection>(*c)->credit_window(), expected);
    const std::string terms =
        std::static_pointer_cast<RdmaConnection>(fx.LastAccepted())->DescribeTerms();
    EXPECT_NE(terms.find(absl::StrCat("the peer ", expected, ";")), std::string::npos) << terms;
  }
  auto refused = fx.Connect(&fx.NewWaiter());
  ASSERT_FALSE(refused.ok()) << "a third window was granted";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find(
                "no receive slots left to grant (2 connections hold 28 of 32, 4 cover refills); "
                "raise client_receive_slots or close a connection"),
            std::string::npos)
      << refused.status();
  for (size_t c = 0; c < conns.size(); ++c) {
    auto r = Call(*conns[c], fx.waiters[c], 1, Filled(*conns[c], 64, 1));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  for (auto& c : conns) c->Close();
}

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
