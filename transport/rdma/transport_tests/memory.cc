// Registered memory and queues, and their bounds: one SRQ for hundreds of
// connections, completion queues that grow and multiply, send slots taken
// and given back, the registered-memory bound and the idle memory it takes
// back, slots the application holds, and registrations or refills that fail
// without losing a frame.
#include <errno.h>
#include <string.h>

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/transport_tests/fixture.h"

namespace rdmarpc::transport::rdma::transport_test {
namespace {

TEST(RdmaTransport, TwoHundredConnectionsShareOneSrq) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  std::vector<std::shared_ptr<Connection>> conns;
  size_t receive_with_one = 0;
  uint64_t registered_with_one = 0;
  for (int i = 0; i < 200; ++i) {
    Waiter& waiter = fx.NewWaiter();
    auto c = fx.Connect(&waiter);
    ASSERT_TRUE(c.ok()) << "connection " << i << ": " << c.status();
    conns.push_back(*c);
    auto r = Call(*conns.back(), waiter, 1, Filled(*conns.back(), 100, i));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(Matches(r->payload, 100, i));
    if (i == 0) {
      receive_with_one = fx.server->receive_bytes();
      registered_with_one = Counters().registered_bytes;
    }
  }
  // All 200 at once, then again: the shared SRQ serves them all.
  std::vector<std::future<InboundMessage>> pending;
  for (int i = 0; i < 200; ++i) {
    pending.push_back(fx.waiters[i].Expect(2));
    ASSERT_TRUE(conns[i]->Send(Request(2, Filled(*conns[i], 1000, i))).ok());
  }
  for (int i = 0; i < 200; ++i) {
    ASSERT_EQ(pending[i].wait_for(std::chrono::seconds(60)), std::future_status::ready);
    InboundMessage r = pending[i].get();
    EXPECT_TRUE(r.payload_status.ok()) << r.payload_status;
    EXPECT_TRUE(Matches(r.payload, 1000, i));
  }
  const size_t receive_with_200 = fx.server->receive_bytes();
  printf("server receive memory: %zu bytes with 1 connection, %zu with 200\n", receive_with_one,
         receive_with_200);
  EXPECT_EQ(receive_with_200, receive_with_one) << "receive memory grew with connections";
  // Send memory follows the frames in flight: here a request and a response
  // per connection, each a send slot and a payload block, plus the last
  // region of blocks each side grew (64 blocks), not send_slots per connection.
  const uint64_t registered_with_200 = Counters().registered_bytes;
  const size_t slot = RdmaOptions().slot_size;
  printf("registered memory (both sides): %" PRIu64 " bytes with 1 connection, %" PRIu64
         " with 200\n",
         registered_with_one, registered_with_200);
  EXPECT_LE(registered_with_200 - registered_with_one, 200 * 4 * slot + 2 * 64 * slot)
      << "send memory grew with connections";
  // Each side's one CQ holds room for every connection's whole send queue:
  // past its first 16384 entries it has grown, never been outgrown.
  for (RdmaTransport* t : {fx.server.get(), fx.client.get()}) {
    const Endpoint::CompletionQueueUse cq = t->completion_queue_use();
    printf("completion queue with 200 connections: %zu entries, %zu reserved\n", cq.entries,
           cq.reserved);
    EXPECT_LE(cq.reserved, cq.entries) << "more completions possible than the CQ holds";
    EXPECT_GT(cq.reserved, 200u * RdmaOptions().send_slots) << "a send queue without room";
  }
  for (auto& c : conns) c->Close();
}

// Connections to a Fixture's server, each with its waiter, admitted only
// once a call on it was answered.
struct AnsweringConnections {
  explicit AnsweringConnections(Fixture& f) : fx(f) {}

  Fixture& fx;
  std::vector<std::shared_ptr<Connection>> conns;
  std::vector<Waiter*> waiters;

  absl::Status Add() {
    Waiter& waiter = fx.NewWaiter();
    auto c = fx.Connect(&waiter);
    if (!c.ok()) return c.status();
    auto r = Call(**c, waiter, 1, Filled(**c, 100, conns.size()));
    if (!r.ok()) return r.status();
    conns.push_back(*c);
    waiters.push_back(&waiter);
    return absl::OkStatus();
  }
  // Each connection answers call `id` of 1000 bytes.
  void CallEach(uint64_t id) {
    for (size_t i = 0; i < conns.size(); ++i) {
      auto r = Call(*conns[i], *waiters[i], id, Filled(*conns[i], 1000, i));
      ASSERT_TRUE(r.ok()) << "connection " << i << ", call " << id << ": " << r.status();
      EXPECT_TRUE(Matches(r->payload, 1000, i));
    }
  }
  // Closes the newest connection, and returns once the server's CQs hold
  // `per_connection` less in reserve (a closed QP's room comes back once
  // the poller has emptied its CQ).
  void CloseNewest(size_t per_connection) {
    const size_t before = fx.server->completion_queue_use().reserved;
    conns.back()->Close();
    conns.pop_back();
    waiters.pop_back();
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (fx.server->completion_queue_use().reserved > before - per_connection &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(fx.server->completion_queue_use().reserved, before - per_connection)
        << "a closed connection kept its room on the CQ";
  }
  void CloseAll() {
    for (auto& c : conns) c->Close();
  }
};

// A server whose CQs hold ~9 connections each (on rxe), `queues` of them.
RdmaOptions SmallCompletionQueues(uint32_t queues) {
  RdmaOptions o;
  o.server_receive_slots = 64;
  o.max_cq_entries = 512;
  o.max_completion_queues = queues;
  return o;
}

// On hardware a completion queue that overflows goes into error, and every
// connection of its endpoint with it. So a connection is admitted only with
// room for its whole send queue (a flushed work request completes even
// unsignaled); past RdmaOptions::max_cq_entries, with one CQ allowed, one
// more is refused, naming the bound, the others are served on, and a closed
// connection's room comes back.
TEST(RdmaTransport, ConnectionsPastTheCompletionQueueBoundAreRefused) {
  Fixture fx;
  const RdmaOptions bounded = SmallCompletionQueues(1);
  ASSERT_TRUE(fx.Start(bounded));
  AnsweringConnections conns{fx};
  ASSERT_TRUE(conns.Add().ok());
  const Endpoint::CompletionQueueUse one = fx.server->completion_queue_use();
  ASSERT_TRUE(conns.Add().ok());
  const Endpoint::CompletionQueueUse two = fx.server->completion_queue_use();
  const size_t per_connection = two.reserved - one.reserved;
  const size_t base = one.reserved - per_connection;
  ASSERT_GT(per_connection, RdmaOptions().send_slots) << "no room held for a send queue";
  EXPECT_EQ(base, bounded.server_receive_slots) << "the SRQ's receives have no room";
  // The device may make the CQ larger than asked (rxe: 2^k - 1); it cannot
  // grow past the bound, so what it holds now is all there is.
  ASSERT_GE(two.entries, bounded.max_cq_entries);
  const size_t fit = (two.entries - base) / per_connection;
  printf("CQ of %zu entries: %zu for receives, %zu per connection, room for %zu connections\n",
         two.entries, base, per_connection, fit);
  ASSERT_GE(fit, 3u);
  ASSERT_LT(fit, 40u) << "the bound did not bound";
  while (conns.conns.size() < fit) {
    absl::Status s = conns.Add();
    ASSERT_TRUE(s.ok()) << "connection " << conns.conns.size() << " of " << fit << ": " << s;
  }
  ::testing::internal::CaptureStderr();
  absl::Status refused = conns.Add();
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_FALSE(refused.ok()) << "a connection past the CQ's room was admitted";
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  for (const char* part : {"refused", "completion queue on rxe", "full", "max_cq_entries"}) {
    EXPECT_NE(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused;
  }
  // The reason is longer than a reject carries: the client has its words up
  // to the cut, whole, says it was cut, and nothing of its own devices (the
  // server was reached; the reason is what to act on).
  const std::string server_said = "test-server]: refusing connection from ";
  const size_t line = said.find(server_said);
  ASSERT_NE(line, std::string::npos) << said;
  const size_t reason_at = said.find(": ", line + server_said.size()) + 2;
  const std::string reason = said.substr(reason_at, said.find('\n', reason_at) - reason_at);
  const std::string client_prefix = "the server refused the connection: ";
  const size_t got_at = refused.message().find(client_prefix);
  ASSERT_NE(got_at, absl::string_view::npos) << refused;
  const std::string cut_marker = " ... (cut short to fit rdma_cm's reject: the server's log has";
  const size_t got_end = refused.message().find(cut_marker);
  ASSERT_NE(got_end, absl::string_view::npos) << refused;
  const std::string got(refused.message().substr(got_at + client_prefix.size(),
                                                 got_end - got_at - client_prefix.size()));
  EXPECT_GT(got.size(), 100u) << got;
  EXPECT_EQ(reason.substr(0, got.size()), got) << "server: " << reason;
  EXPECT_EQ(reason[got.size()], ' ') << "cut inside a word: " << got;
  for (const char* part : {"Devices:", "that the server listens there"}) {
    EXPECT_EQ(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" in: " << refused;
  }
  const Endpoint::CompletionQueueUse full = fx.server->completion_queue_use();
  EXPECT_EQ(full.queues, 1u);
  EXPECT_EQ(full.entries, two.entries) << "the CQ grew past its bound";
  EXPECT_EQ(full.reserved, base + fit * per_connection);
  conns.CallEach(2);
  conns.CloseNewest(per_connection);
  absl::Status again = conns.Add();
  EXPECT_TRUE(again.ok()) << "no room after a connection closed: " << again;
  conns.CloseAll();
}

// A connection that no completion queue can grow to fit gets a new CQ, up to
// RdmaOptions::max_completion_queues, and the poller serves them all: the
// connections on the second CQ are answered (the server polls in event mode,
// so it sleeps between calls and wakes for either CQ). Past the last CQ's
// room one more connection is refused, naming the option; a closed
// connection's room on the second CQ comes back.
TEST(RdmaTransport, ConnectionsPastOneCompletionQueueOpenAnother) {
  Fixture fx;
  RdmaOptions bounded = SmallCompletionQueues(2);
  bounded.poll_mode = PollMode::kEvent;
  ASSERT_TRUE(fx.Start(bounded));
  AnsweringConnections conns{fx};
  ASSERT_TRUE(conns.Add().ok());
  const Endpoint::CompletionQueueUse one = fx.server->completion_queue_use();
  ASSERT_EQ(one.queues, 1u);
  while (fx.server->completion_queue_use().queues == 1) {
    ASSERT_LT(conns.conns.size(), 40u) << "no second completion queue";
    absl::Status s = conns.Add();
    ASSERT_TRUE(s.ok()) << "connection " << conns.conns.size() << ": " << s;
  }
  const size_t first_fit = conns.conns.size() - 1;
  const Endpoint::CompletionQueueUse opened = fx.server->completion_queue_use();
  const size_t per_connection = (one.reserved - bounded.server_receive_slots);
  printf("a second CQ opened at connection %zu: %zu entries on 2 queues, %zu reserved\n",
         first_fit + 1, opened.entries, opened.reserved);
  ASSERT_GE(first_fit, 3u);
  EXPECT_EQ(opened.reserved, 2 * bounded.server_receive_slots + (first_fit + 1) * per_connection)
      << "the new CQ holds no room for the SRQ's receives, or the connection's";
  conns.CallEach(2);
  absl::Status refused;
  while ((refused = conns.Add()).ok()) {
    ASSERT_LT(conns.conns.size(), 4 * first_fit) << "the second CQ did not bound";
  }
  // Both CQs were opened alike, at the same size.
  EXPECT_EQ(conns.conns.size(), 2 * first_fit) << refused;
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  for (const char* part : {"refused", "full", "max_completion_queues"}) {
    EXPECT_NE(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused;
  }
  const Endpoint::CompletionQueueUse full = fx.server->completion_queue_use();
  EXPECT_EQ(full.queues, 2u);
  EXPECT_LE(full.reserved, full.entries);
  conns.CallEach(3);
  conns.CloseNewest(per_connection);
  absl::Status again = conns.Add();
  EXPECT_TRUE(again.ok()) << "no room after a connection on the second CQ closed: " << again;
  conns.CallEach(4);
  conns.CloseAll();
}

// A server whose first CQ holds a few connections and a client whose
// CQ never needs to grow, so that every resize is the server's.
struct ResizeFixture {
  Fixture fx;
  bool Start(uint32_t max_queues) {
    RdmaOptions server;
    server.server_receive_slots = 64;
    server.cq_entries = 128;
    server.max_cq_entries = 4096;
    server.max_completion_queues = max_queues;
    RdmaOptions client;
    client.cq_entries = kListeningCqEntries;
    return fx.Start(server, client);
  }
  // The next resize is not made, and answers `answer`.
  static void FakeNextResize(int answer) {
    FaultInjection::CqResizeAnswer() = answer;
    FaultInjection::FakeCqResizes() = 1;
  }
  ~ResizeFixture() { FaultInjection::FakeCqResizes() = 0; }
};

// A device that cannot resize a completion queue still takes connections
// past its first CQ's room: new CQs are opened, each twice the size of the
// last, so that a few hold them all, and no resize is tried again. Such a
// device answers ibv_resize_cq with EOPNOTSUPP (siw), or with success and
// the CQ left as it was (qedr's kernel driver once did).
TEST(RdmaTransport, ADeviceThatCannotResizeCompletionQueuesOpensLargerOnes) {
  constexpr size_t kConnections = 12;
  for (const int answer : {EOPNOTSUPP, 0}) {
    SCOPED_TRACE(answer == 0 ? "success, not resized" : strerror(answer));
    ResizeFixture rf;
    ASSERT_TRUE(rf.Start(/*max_queues=*/8));
    ResizeFixture::FakeNextResize(answer);
    AnsweringConnections conns{rf.fx};
    ASSERT_TRUE(conns.Add().ok());
    Endpoint::CompletionQueueUse last = rf.fx.server->completion_queue_use();
    const size_t first_entries = last.entries;
    while (conns.conns.size() < kConnections) {
      absl::Status s = conns.Add();
      ASSERT_TRUE(s.ok()) << "connection " << conns.conns.size() << ": " << s;
      const Endpoint::CompletionQueueUse now = rf.fx.server->completion_queue_use();
      if (now.entries != last.entries) {
        EXPECT_EQ(now.queues, last.queues + 1)
            << "a CQ was resized after the device said it cannot, at connection "
            << conns.conns.size();
      }
      EXPECT_LE(now.reserved, now.entries);
      last = now;
    }
    EXPECT_EQ(FaultInjection::FakeCqResizes().load(), 0) << "no resize was tried";
    printf("%zu connections on %zu completion queues of %zu entries together (the first %zu)\n",
           kConnections, last.queues, last.entries, first_entries);
    EXPECT_GE(last.queues, 2u);
    EXPECT_LE(last.queues, 4u) << "the new CQs were not larger than the first";
    conns.CallEach(2);
    conns.CloseAll();
  }
}

// A resize that fails otherwise (ENOMEM: the kernel could not allocate the
// larger queue) refuses only the connection that needed it, naming why,
// when no other CQ may be opened; the connections there are served on, and
// the next connection tries the resize again, which then grows the CQ.
TEST(RdmaTransport, AResizeThatFailsRefusesThatConnectionAndIsTriedAgain) {
  ResizeFixture rf;
  ASSERT_TRUE(rf.Start(/*max_queues=*/1));
  AnsweringConnections conns{rf.fx};
  ASSERT_TRUE(conns.Add().ok());
  const Endpoint::CompletionQueueUse first = rf.fx.server->completion_queue_use();
  ResizeFixture::FakeNextResize(ENOMEM);
  absl::Status refused;
  while ((refused = conns.Add()).ok()) {
    ASSERT_LT(conns.conns.size(), 10u) << "the CQ never needed to grow";
    ASSERT_EQ(rf.fx.server->completion_queue_use().entries, first.entries);
  }
  EXPECT_EQ(FaultInjection::FakeCqResizes().load(), 0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  const char* const parts[] = {"refused", "ibv_resize_cq", strerror(ENOMEM)};
  for (const char* part : parts) {
    EXPECT_NE(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused;
  }
  conns.CallEach(2);
  absl::Status again = conns.Add();
  ASSERT_TRUE(again.ok()) << "the resize was not tried again: " << again;
  const Endpoint::CompletionQueueUse grown = rf.fx.server->completion_queue_use();
  EXPECT_EQ(grown.queues, 1u);
  EXPECT_GT(grown.entries, first.entries);
  conns.CallEach(3);
  conns.CloseAll();
}

// A completion queue that starts small grows (ibv_resize_cq) as connections
// need room, while the connections already there go on: each resize happens
// between calls of the others, all of which are answered.
TEST(RdmaTransport, CompletionQueueGrowsAsConnectionsNeedRoom) {
  constexpr int kConnections = 12;
  Fixture fx;
  RdmaOptions small;
  small.server_receive_slots = 64;
  small.cq_entries = 128;
  ASSERT_TRUE(fx.Start(small));
  std::vector<std::shared_ptr<Connection>> conns;
  size_t first_entries = 0;
  for (int i = 0; i < kConnections; ++i) {
    Waiter& waiter = fx.NewWaiter();
    auto c = fx.Connect(&waiter);
    ASSERT_TRUE(c.ok()) << "connection " << i << ": " << c.status();
    conns.push_back(*c);
    for (int j = 0; j <= i; ++j) {
      auto r = Call(*conns[j], fx.waiters[j], i + 1, Filled(*conns[j], 1000, i * 100 + j));
      ASSERT_TRUE(r.ok()) << "connection " << j << " after " << i + 1 << " opened: " << r.status();
      EXPECT_TRUE(Matches(r->payload, 1000, i * 100 + j));
    }
    const Endpoint::CompletionQueueUse cq = fx.server->completion_queue_use();
    ASSERT_LE(cq.reserved, cq.entries) << "with " << i + 1 << " connections";
    if (i == 0) first_entries = cq.entries;
  }
  const Endpoint::CompletionQueueUse cq = fx.server->completion_queue_use();
  printf("completion queue: %zu entries with 1 connection, %zu with %d (%zu reserved)\n",
         first_entries, cq.entries, kConnections, cq.reserved);
  EXPECT_GT(cq.entries, first_entries) << "the CQ never grew";
  EXPECT_GT(cq.reserved, kConnections * size_t{RdmaOptions().send_slots});
  for (auto& c : conns) c->Close();
}

// A connecting transport's completion queue begins at room for its receives
// and two connections, not at a listening one's 16384 entries (4 MiB of
// kernel memory on Soft-RoCE): a client reconnecting again and again stays
// within it, while the server's begins large.
TEST(RdmaTransport, AConnectingTransportsCompletionQueueBeginsSmall) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  const RdmaOptions defaults;
  const size_t expected = InitialCqEntries(defaults, /*listening=*/false);
  EXPECT_EQ(expected, defaults.client_receive_slots +
                          2 * (defaults.send_slots + defaults.max_reads_in_flight + 16));
  size_t entries = 0;
  for (int i = 0; i < 5; ++i) {
    Waiter& waiter = fx.NewWaiter();
    auto c = fx.Connect(&waiter);
    ASSERT_TRUE(c.ok()) << "connection " << i << ": " << c.status();
    auto r = Call(**c, waiter, 1, Filled(**c, 1000, i));
    ASSERT_TRUE(r.ok()) << r.status();
    const Endpoint::CompletionQueueUse cq = fx.client->completion_queue_use();
    EXPECT_GE(cq.entries, expected);
    EXPECT_LE(cq.reserved, cq.entries);
    if (i == 0) entries = cq.entries;
    EXPECT_EQ(cq.entries, entries) << "the client's CQ grew at connection " << i;
    (*c)->Close();
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!waiter.FinishedClosing() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(waiter.FinishedClosing()) << "connection " << i << " did not close";
  }
  const Endpoint::CompletionQueueUse server = fx.server->completion_queue_use();
  printf("completion queue: client %zu entries (%zu asked), server %zu\n", entries, expected,
         server.entries);
  EXPECT_LT(entries, size_t{1024});
  EXPECT_GE(server.entries, kListeningCqEntries);
}

// A connection takes send slots (for frames that do not go inline) from its
// endpoint as it needs them: none while every frame goes inline, and no more
// than the frames it has had in flight at once, not RdmaOptions::send_slots.
// No keepalive, so that no pause of the test lets an idle connection give
// its last slot back (IdleConnectionGivesItsSendSlotBack).
TEST(RdmaTransport, SendSlotsAreTakenAsFramesNeedThem) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  RdmaOptions no_keepalive;
  no_keepalive.keepalive_ms = 0;
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, no_keepalive, no_keepalive);
  ASSERT_TRUE(conn);
  auto& client = static_cast<RdmaConnection&>(*conn);
  const size_t inline_payload = client.max_inline() - kHeaderSize;
  auto r = Call(client, waiter, 1, Filled(client, inline_payload, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  std::shared_ptr<Connection> accepted = fx.LastAccepted();
  ASSERT_NE(accepted, nullptr);
  auto& server = static_cast<RdmaConnection&>(*accepted);
  EXPECT_EQ(client.send_slots_held(), 0u) << "a frame that went inline took a send slot";
  EXPECT_EQ(server.send_slots_held(), 0u) << "a frame that went inline took a send slot";
  // One call at a time: each side has one frame in flight, whose slot comes
  // back with its completion (or the one after).
  const uint64_t sends_before = Counters().sends - Counters().sends_inline;
  for (uint64_t id = 2; id < 50; ++id) {
    r = Call(client, waiter, id, Filled(client, 1000, id));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(Matches(r->payload, 1000, id));
  }
  EXPECT_GE(Counters().sends - Counters().sends_inline - sends_before, 2u * 48)
      << "the 1000-byte frames went inline: nothing here needed a slot";
  for (RdmaConnection* c : {&client, &server}) {
    EXPECT_GE(c->send_slots_held(), 1u);
    EXPECT_LE(c->send_slots_held(), 3u) << "more slots than frames in flight";
  }
  conn->Close();
}

// A connection that falls silent gives the send slot it kept back to the
// transport's stock at its next keepalive, so idle connections hold no send
// memory; its next frame that does not go inline takes one again.
TEST(RdmaTransport, IdleConnectionGivesItsSendSlotBack) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  RdmaOptions keepalive;
  // Far longer than the test takes from a call to its check of the slots.
  keepalive.keepalive_ms = 2000;
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, keepalive, keepalive);
  ASSERT_TRUE(conn);
  auto& client = static_cast<RdmaConnection&>(*conn);
  std::shared_ptr<Connection> accepted = fx.LastAccepted();
  ASSERT_NE(accepted, nullptr);
  auto& server = static_cast<RdmaConnection&>(*accepted);
  const uint64_t keepalives_before = Counters().keepalives;
  auto r = Call(client, waiter, 1, Filled(client, 1000, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  for (RdmaConnection* c : {&client, &server}) {
    EXPECT_EQ(c->send_slots_held(), 1u) << "a connection with nothing in flight keeps one slot";
  }
  // A side gives its slot back, then counts its keepalive (SendKeepalive):
  // both are waited for.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((client.send_slots_held() != 0 || server.send_slots_held() != 0 ||
          Counters().keepalives - keepalives_before < 2) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(client.send_slots_held(), 0u) << "the idle client kept its send slot";
  EXPECT_EQ(server.send_slots_held(), 0u) << "the idle server kept its send slot";
  EXPECT_GE(Counters().keepalives - keepalives_before, 2u) << "each side gave back at a keepalive";
  r = Call(client, waiter, 2, Filled(client, 1000, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 1000, 2));
  for (RdmaConnection* c : {&client, &server}) {
    EXPECT_EQ(c->send_slots_held(), 1u) << "after the next frame that needs a slot";
  }
  EXPECT_FALSE(waiter.closed.load());
  conn->Close();
}

// A frame that needs a send slot when none can be had fails at once,
// RESOURCE_EXHAUSTED saying why, and nothing else on the connection does:
// inline frames need none, and the next frame gets a slot once one is free.
TEST(RdmaTransport, FrameWithNoSendSlotToHaveFailsAloneAndSaysWhy) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  FaultInjection::RefuseSendBlocks().store(1);
  auto r = Call(*conn, waiter, 1, Filled(*conn, 1000, 1));
  FaultInjection::RefuseSendBlocks().store(0);
  ASSERT_FALSE(r.ok()) << "a frame that does not go inline was sent without a send slot";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  for (const char* part : {"no send slot", "send slots on ", fx.addr.host.c_str(), "inline"}) {
    EXPECT_NE(r.status().message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << r.status();
  }
  const size_t inline_payload = static_cast<RdmaConnection&>(*conn).max_inline() - kHeaderSize;
  r = Call(*conn, waiter, 2, Filled(*conn, inline_payload, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  r = Call(*conn, waiter, 3, Filled(*conn, 1000, 3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 1000, 3));
  conn->Close();
}

// RdmaOptions::max_registered_bytes bounds each side's pool of large
// payload buffers. Past it: allocating a payload fails RESOURCE_EXHAUSTED
// naming the bound; a request the server has no room to READ is answered
// RESOURCE_EXHAUSTED without a READ, and the connection goes on; payloads
// that fit still pass both ways.
TEST(RdmaTransport, RegisteredMemoryBoundIsResourceExhaustedNamingIt) {
  constexpr size_t kBound = size_t{4} << 20;
  struct Recorder : ConnectionObserver {
    explicit Recorder(ConnectionObserver* inner) : inner(inner) {}
    void OnMessage(Connection& conn, InboundMessage&& msg) override {
      if (msg.header.kind == MessageKind::kRequest) {
        std::lock_guard<std::mutex> lock(mu);
        statuses.push_back(msg.payload_status);
      }
      inner->OnMessage(conn, std::move(msg));
    }
    void OnClosed(Connection& conn, const absl::Status& why) override {
      inner->OnClosed(conn, why);
    }
    ConnectionObserver* inner;
    std::mutex mu;
    std::vector<absl::Status> statuses;
  };
  Fixture fx;
  Recorder recorder(&fx.echo);
  fx.server_observer = &recorder;
  RdmaOptions bounded;
  bounded.max_registered_bytes = kBound;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, bounded, RdmaOptions());
  ASSERT_TRUE(conn);
  const uint64_t reads_before = Counters().reads;
  auto r = Call(*conn, waiter, 1, Filled(*conn, kBound + 1, 1));
  ASSERT_FALSE(r.ok()) << "the server READ a payload beyond its registered-memory bound";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(Counters().reads, reads_before) << "nothing may be READ without room for it";
  {
    std::lock_guard<std::mutex> lock(recorder.mu);
    ASSERT_EQ(recorder.statuses.size(), 1u);
    const absl::Status& why = recorder.statuses[0];
    EXPECT_EQ(why.code(), absl::StatusCode::kResourceExhausted) << why;
    for (const std::string& part :
         {std::string("max_registered_bytes"), std::to_string(kBound), std::string("rxe")}) {
      EXPECT_NE(why.message().find(part), absl::string_view::npos)
          << "\"" << part << "\" not in: " << why;
    }
  }
  r = Call(*conn, waiter, 2, Filled(*conn, 1 << 20, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 1 << 20, 2));
  EXPECT_FALSE(waiter.closed.load());
  conn->Close();

  // The client's own bound, where the runtime allocates a payload.
  Fixture small;
  Waiter& w2 = small.NewWaiter();
  std::shared_ptr<Connection> c2 = small.StartAndConnect(w2, RdmaOptions(), bounded);
  ASSERT_TRUE(c2);
  auto big = c2->AllocatePayload(kBound + 1);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
  EXPECT_NE(big.status().message().find("max_registered_bytes"), absl::string_view::npos)
      << big.status();
  r = Call(*c2, w2, 3, Filled(*c2, 1 << 20, 3));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 1 << 20, 3));
  c2->Close();
}

// The bound counts what is registered, idle or not; a pool that kept its
// idle blocks of one size would refuse every other size for good once they
// filled it. Idle blocks make room, as far as a request needs and only when
// that is enough; blocks in use are never touched.
TEST(RdmaTransport, IdlePayloadBuffersMakeRoomUnderTheBoundForOtherSizes) {
  constexpr size_t kMiB = size_t{1} << 20;
  constexpr size_t kThreeHalves = 3 * kMiB / 2;  // a block of its own size: a class
  Fixture fx;
  RdmaOptions bounded;
  bounded.max_registered_bytes = 4 * kMiB;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, RdmaOptions(), bounded);
  ASSERT_TRUE(conn);
  const uint64_t base = Counters().registered_bytes;
  Buffer kept = Filled(*conn, kThreeHalves, 1);
  { Buffer dropped = Filled(*conn, kThreeHalves, 2); }
  ASSERT_EQ(Counters().registered_bytes - base, 3 * kMiB)
      << "a 1.5 MiB payload should take a 1.5 MiB block (size_classes.h)";

  auto refused = conn->AllocatePayload(3 * kMiB);  // a 3 MiB block: not without `kept`
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  for (const std::string& part :
       {std::string("max_registered_bytes"), absl::StrCat(kThreeHalves, " in use")}) {
    EXPECT_NE(refused.status().message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused.status();
  }
  EXPECT_EQ(Counters().registered_bytes - base, 3 * kMiB)
      << "an idle block was freed for a request it could not make room for";

  {
    auto other_size = conn->AllocatePayload(2 * kMiB);
    ASSERT_TRUE(other_size.ok()) << other_size.status();
    EXPECT_EQ(Counters().registered_bytes - base, kThreeHalves + 2 * kMiB)
        << "the idle 1.5 MiB block should have made room, and nothing else changed";
  }

  // `kept` is still registered and whole: the server READs it, and the echo
  // is pulled into a block the idle 2 MiB one makes room for (the other
  // kind: a READ target, not a block to advertise).
  auto r = Call(*conn, waiter, 1, std::move(kept));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, kThreeHalves, 1));
  EXPECT_FALSE(waiter.closed.load());
  conn->Close();
}

// Server side: keeps every message (and so its receive slot, on loan) until
// told to let go; from then on drops each as it comes.
class Hoarder : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.push_back(msg.header.call_id);
    if (!let_go_) kept_.push_back(std::move(msg));
  }
  void OnClosed(Connection&, const absl::Status&) override {}
  size_t received() {
    std::lock_guard<std::mutex> lock(mu_);
    return ids_.size();
  }
  std::vector<uint64_t> ids() {
    std::lock_guard<std::mutex> lock(mu_);
    return ids_;
  }
  void LetGo() {
    std::vector<InboundMessage> kept;  // released outside the lock
    std::lock_guard<std::mutex> lock(mu_);
    let_go_ = true;
    kept.swap(kept_);
  }

 private:
  std::mutex mu_;
  bool let_go_ = false;
  std::vector<uint64_t> ids_;
  std::vector<InboundMessage> kept_;
};

// Sends `frames` small requests on `conn` to a Hoarder and returns how many
// it has when no more arrive (the server's receive slots ran out).
size_t HoardUntilSlotsRunOut(Connection& conn, Hoarder& hoarder, uint64_t frames) {
  for (uint64_t id = 1; id <= frames; ++id) {
    EXPECT_TRUE(conn.Send(Request(id, Filled(conn, 100, id))).ok());
  }
  size_t held = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(20); absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(200));
    const size_t now = hoarder.received();
    if (now == held) break;
    held = now;
  }
  return held;
}

// Lets the hoarder go and expects all `frames` to arrive, once and in order.
void ExpectEveryFrameOnceLetGo(Hoarder& hoarder, uint64_t frames) {
  hoarder.LetGo();
  for (const absl::Time until = absl::Now() + absl::Seconds(60);
       hoarder.received() < frames && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const std::vector<uint64_t> ids = hoarder.ids();
  ASSERT_EQ(ids.size(), frames) << "frames were lost";
  for (uint64_t i = 0; i < frames; ++i) ASSERT_EQ(ids[i], i + 1) << "frame " << i;
  EXPECT_EQ(Counters().rnr_retry_exhausted, 0u);
}

// Receive slots the application keeps (a message's payload is on loan) are
// replaced by new ones up to server_receive_slots + max_held_slots; beyond
// that the SRQ runs short (srq_short), the sender's frames wait on RNR retry
// and receive memory grows no further. Once the application lets go, every
// frame arrives, once and in order.
TEST(RdmaTransport, SlotsTheApplicationHoldsAreBoundedAndNothingIsLost) {
  Hoarder hoarder;
  Fixture fx;
  fx.server_observer = &hoarder;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = Endpoint::kSlotsPerRegion;
  server_opts.max_held_slots = Endpoint::kSlotsPerRegion;
  const size_t bound = server_opts.server_receive_slots + server_opts.max_held_slots;
  RdmaOptions client_opts;
  client_opts.keepalive_ms = 0;  // the frames stalled on RNR would hold a probe up
  // Room for the responses of every request sent: the client sends no more
  // requests at once than its slots hold responses (Endpoint::
  // TakeResponseRoom), and the hoarder answers none.
  client_opts.client_receive_slots = 512;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, server_opts, client_opts);
  ASSERT_TRUE(conn);
  const uint64_t short_before = Counters().srq_short;
  constexpr uint64_t kFrames = 3 * 128;
  const size_t held = HoardUntilSlotsRunOut(*conn, hoarder, kFrames);
  printf("the server held %zu frames, %zu bytes of receive slots (bound %zu slots)\n", held,
         fx.server->receive_bytes(), bound);
  EXPECT_GT(held, server_opts.server_receive_slots) << "held slots were not replaced";
  EXPECT_LE(held, bound) << "more slots than server_receive_slots + max_held_slots";
  EXPECT_LE(fx.server->receive_bytes(), bound * server_opts.slot_size);
  EXPECT_GT(Counters().srq_short, short_before) << "the SRQ ran short without being counted";
  ExpectEveryFrameOnceLetGo(hoarder, kFrames);
  conn->Close();
}

// Receive slots that cannot be registered (ibv_reg_mr failing, as past the
// locked-memory limit) leave the SRQ short of what the application holds,
// as the bound does: nothing fails and nothing is lost, and the slots the
// application gives back are posted again.
TEST(RdmaTransport, ReceiveSlotsThatCannotBeRegisteredLoseNothing) {
  Hoarder hoarder;
  Fixture fx;
  fx.server_observer = &hoarder;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = Endpoint::kSlotsPerRegion;
  RdmaOptions client_opts;
  client_opts.keepalive_ms = 0;
  client_opts.client_receive_slots = 512;  // as above
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, server_opts, client_opts);
  ASSERT_TRUE(conn);
  const size_t receive_bytes = fx.server->receive_bytes();
  FaultInjection::FailRegistrations() = 1 << 20;
  constexpr uint64_t kFrames = 2 * Endpoint::kSlotsPerRegion;
  const size_t held = HoardUntilSlotsRunOut(*conn, hoarder, kFrames);
  // Read while registrations still fail: once they work again, the poller's
  // next retry may grow the slots, as it should.
  const size_t receive_bytes_failing = fx.server->receive_bytes();
  const int failed_registrations = (1 << 20) - FaultInjection::FailRegistrations().exchange(0);
  printf("the server held %zu frames; %d registrations failed\n", held, failed_registrations);
  EXPECT_EQ(held, server_opts.server_receive_slots) << "slots grew without registering";
  EXPECT_EQ(receive_bytes_failing, receive_bytes);
  EXPECT_GT(failed_registrations, 0) << "the slots never tried to grow";
  ExpectEveryFrameOnceLetGo(hoarder, kFrames);
  conn->Close();
}

// Payload buffers that cannot be registered: AllocatePayload fails
// RESOURCE_EXHAUSTED saying what to check, a request the server cannot
// register a buffer to READ into is answered RESOURCE_EXHAUSTED, and both
// register again on the next try: the connection goes on.
TEST(RdmaTransport, PayloadBuffersThatCannotBeRegisteredAreAClearErrorAndRetried) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  constexpr size_t kLarge = 1 << 20;  // by READ, one pool class
  FaultInjection::FailRegistrations() = 1;
  auto refused = conn->AllocatePayload(kLarge);
  ASSERT_FALSE(refused.ok()) << "the registration did not fail";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find(
                absl::StrCat("ibv_reg_mr of ", kLarge, " bytes for payload buffers on ")),
            absl::string_view::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("ulimit -l"), absl::string_view::npos)
      << refused.status();
  Buffer payload = Filled(*conn, kLarge, 1);  // registers now
  FaultInjection::FailRegistrations() = 1;    // the server's buffer to READ into
  auto unread = Call(*conn, waiter, 1, std::move(payload));
  EXPECT_EQ(FaultInjection::FailRegistrations().exchange(0), 0) << "nothing registered";
  ASSERT_FALSE(unread.ok()) << "the server READ without a registered buffer";
  EXPECT_EQ(unread.status().code(), absl::StatusCode::kResourceExhausted) << unread.status();
  auto r = Call(*conn, waiter, 2, Filled(*conn, kLarge, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, kLarge, 2));
  conn->Close();
}

// A refill of the SRQ that fails (ibv_post_srq_recv: ENOMEM) is retried as
// the poller runs: the slots it held come back, the SRQ's shortage is
// counted, senders wait on RNR retry meanwhile, and every call is answered.
TEST(RdmaTransport, FailedSrqRefillIsRetriedAndLosesNothing) {
  Fixture fx;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = Endpoint::kSlotsPerRegion;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter, server_opts);
  ASSERT_TRUE(conn);
  const uint64_t short_before = Counters().srq_short;
  constexpr int kFailures = 3;
  FaultInjection::FailSrqPosts() = kFailures;  // the next refills, of either side's SRQ
  constexpr uint64_t kCalls = 4 * Endpoint::kSlotsPerRegion;
  std::vector<std::future<InboundMessage>> answers;
  for (uint64_t id = 1; id <= kCalls; ++id) {
    answers.push_back(waiter.Expect(id));
    ASSERT_TRUE(conn->Send(Request(id, Filled(*conn, 100, id))).ok());
  }
  for (uint64_t id = 1; id <= kCalls; ++id) {
    ASSERT_EQ(answers[id - 1].wait_for(std::chrono::seconds(60)), std::future_status::ready)
        << "call " << id << " was lost";
    const InboundMessage r = answers[id - 1].get();
    EXPECT_TRUE(r.payload_status.ok() && Matches(r.payload, 100, id)) << "call " << id;
  }
  EXPECT_EQ(FaultInjection::FailSrqPosts().load(), 0) << "fewer refills than failures armed";
  EXPECT_GT(Counters().srq_short, short_before) << "the failed refills were not counted";
  EXPECT_EQ(Counters().rnr_retry_exhausted, 0u);
  conn->Close();
}

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
