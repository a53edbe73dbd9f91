// The RDMA transport on real verbs (Soft-RoCE in the VM, or a device): sizes
// around every threshold, one SRQ for hundreds of connections, a bad rkey on
// purpose, a request that expires before its READ, a client killed in the
// middle of a READ, and connect/disconnect cycles that must not leak.
#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/testing/rdma_test_env.h"

extern char** environ;

namespace rdmarpc::transport::rdma {
namespace {

uint8_t Pattern(size_t i, uint64_t seed) {
  return static_cast<uint8_t>((i * 131 + seed * 7) & 0xff);
}

Buffer Filled(Connection& conn, size_t size, uint64_t seed) {
  auto b = conn.AllocatePayload(size);
  EXPECT_TRUE(b.ok()) << b.status();
  for (size_t i = 0; i < size; ++i) b->data()[i] = static_cast<char>(Pattern(i, seed));
  return std::move(*b);
}

bool Matches(const Buffer& b, size_t size, uint64_t seed) {
  if (b.size() != size) return false;
  for (size_t i = 0; i < size; ++i)
    if (static_cast<uint8_t>(b.data()[i]) != Pattern(i, seed)) return false;
  return true;
}

// Server side: answers every request with its own payload, byte for byte.
class EchoObserver : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kRequest) return;
    OutboundMessage r;
    r.header.kind = MessageKind::kResponse;
    r.header.call_id = msg.header.call_id;
    if (!msg.payload_status.ok()) {
      r.header.status = static_cast<uint16_t>(msg.payload_status.code());
    } else if (auto b = conn.AllocatePayload(msg.payload.size()); !b.ok()) {
      // Answered, not dropped: the client's test then shows why.
      fprintf(stderr, "echo: %s\n", b.status().ToString().c_str());
      r.header.status = static_cast<uint16_t>(b.status().code());
    } else {
      // An empty Buffer's data() is null, which memcpy may not be given.
      if (!msg.payload.empty()) memcpy(b->data(), msg.payload.data(), msg.payload.size());
      r.payload = std::move(*b);
    }
    requests.fetch_add(1);
    conn.Send(std::move(r)).IgnoreError();
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu);
    closed.push_back(why);
  }
  std::atomic<int> requests{0};
  std::mutex mu;
  std::vector<absl::Status> closed;
};

// Client side: waits for responses by call id.
class Waiter : public ConnectionObserver {
 public:
  std::future<InboundMessage> Expect(uint64_t call_id) {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_[call_id].get_future();
  }
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = waiting_.find(msg.header.call_id);
    if (it == waiting_.end()) return;
    it->second.set_value(std::move(msg));
    waiting_.erase(it);
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_status = why;
    // Before the waiters wake: a test that saw its call fail may check it.
    closed = true;
    for (auto& [id, p] : waiting_) {
      InboundMessage m;
      m.header.call_id = id;
      m.payload_status = why;
      p.set_value(std::move(m));
    }
    waiting_.clear();
  }
  // True once OnClosed is done with this observer, which the test may then
  // destroy: `closed` turns true while OnClosed is still running.
  bool FinishedClosing() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed.load();
  }
  std::atomic<bool> closed{false};
  absl::Status closed_status;

 private:
  std::mutex mu_;
  std::map<uint64_t, std::promise<InboundMessage>> waiting_;
};

// Server and client transports on the test address. The observers they call
// until they shut down live here, declared before the transports so they are
// destroyed after them: a test's own Waiter declared after the Fixture would
// be gone while the client transport still calls it.
struct Fixture {
  std::string ip;
  EchoObserver echo;
  std::deque<Waiter> waiters;  // a deque: NewWaiter never moves the others
  ConnectionObserver* server_observer = &echo;  // a test may put its own
  std::string listen_host;                      // default: the test address
  std::mutex accepted_mu;
  std::weak_ptr<Connection> last_accepted;
  std::unique_ptr<RdmaTransport> server;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<RdmaTransport> client;
  Address addr;

  bool Start(RdmaOptions server_opts = RdmaOptions(), RdmaOptions client_opts = RdmaOptions()) {
    ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
    if (ip.empty()) return false;
    TransportOptions so;
    so.name = "test-server";
    so.listening = true;
    so.max_message_size = 128u << 20;
    server = std::make_unique<RdmaTransport>(so, server_opts, true);
    auto l =
        server->Listen(*ParseAddress("rdma://" + (listen_host.empty() ? ip : listen_host) + ":0"),
                       [this](std::shared_ptr<Connection> c) {
                         std::lock_guard<std::mutex> lock(accepted_mu);
                         last_accepted = c;
                         return server_observer;
                       });
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return false;
    listener = std::move(*l);
    addr = listener->address();
    TransportOptions co;
    co.name = "test-client";
    co.max_message_size = 128u << 20;
    client = std::make_unique<RdmaTransport>(co, client_opts, false);
    return true;
  }
  Waiter& NewWaiter() { return waiters.emplace_back(); }
  // The server's side of the connection accepted last, while the server keeps it.
  std::shared_ptr<Connection> LastAccepted() {
    std::lock_guard<std::mutex> lock(accepted_mu);
    return last_accepted.lock();
  }
  absl::StatusOr<std::shared_ptr<Connection>> Connect(ConnectionObserver* observer) {
    return client->Connect(addr, observer, absl::Now() + absl::Seconds(30));
  }
  // Start() and one connection for `waiter`; null, with the test failed and
  // the reason said, when either fails.
  std::shared_ptr<Connection> StartAndConnect(Waiter& waiter,
                                              RdmaOptions server_opts = RdmaOptions(),
                                              RdmaOptions client_opts = RdmaOptions()) {
    if (!Start(server_opts, client_opts)) {
      ADD_FAILURE() << "could not start the server and client transports";
      return nullptr;
    }
    auto conn = Connect(&waiter);
    if (!conn.ok()) {
      ADD_FAILURE() << "connect: " << conn.status();
      return nullptr;
    }
    return std::move(*conn);
  }
};

OutboundMessage Request(uint64_t id, Buffer payload, std::string metadata = {}) {
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  m.header.call_id = id;
  m.payload = std::move(payload);
  m.metadata = std::move(metadata);
  return m;
}

absl::StatusOr<InboundMessage> Call(Connection& conn, Waiter& w, uint64_t id, Buffer payload) {
  auto f = w.Expect(id);
  if (absl::Status s = conn.Send(Request(id, std::move(payload))); !s.ok()) return s;
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    return absl::DeadlineExceededError(
        absl::StrCat("no response in 120 s; counters: ", Counters().ToString()));
  }
  InboundMessage r = f.get();
  if (!r.payload_status.ok()) return r.payload_status;
  if (r.header.status != 0) {
    return absl::Status(static_cast<absl::StatusCode>(r.header.status),
                        "the server could not answer (see its log line)");
  }
  return r;
}

// Both ends of one connection, after a call on it was answered (so the
// server has accepted it); the server's end is null if something failed.
struct BothEnds {
  std::shared_ptr<Connection> client, server;
};
BothEnds ConnectAndCall(Fixture& fx) {
  BothEnds ends;
  Waiter& waiter = fx.NewWaiter();
  auto conn = fx.Connect(&waiter);
  EXPECT_TRUE(conn.ok()) << conn.status();
  if (!conn.ok()) return ends;
  ends.client = *conn;
  auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) ends.server = fx.LastAccepted();
  return ends;
}

// What `read` returns for c's rdma_cm id, read on c's poller, the thread
// that tears c down and clears the id (so read in any other thread, it
// races with a teardown); `gone` once c is torn down.
template <typename T>
T OnPoller(Connection& c, T gone, std::function<T(rdma_cm_id*)> read) {
  auto& conn = static_cast<RdmaConnection&>(c);
  T value = gone;
  conn.endpoint()->RunOnPollerAndWait([&] {
    if (conn.id() != nullptr) value = read(conn.id());
  });
  return value;
}

// Waits (up to 20 s) until every connection opened since the counters read
// `opened` and `closed` has closed again, at both ends; false if one stays.
bool EveryConnectionClosedSince(uint64_t opened, uint64_t closed) {
  auto still_open = [&] {
    return Counters().connections_opened - opened - (Counters().connections_closed - closed);
  };
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (still_open() != 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  return still_open() == 0;
}

// The server still serves: a new connection's call of `size` bytes comes
// back whole.
void ExpectServesANewClient(Fixture& fx, size_t size = 100) {
  Waiter& after = fx.NewWaiter();
  auto conn = fx.Connect(&after);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = Call(**conn, after, 1, Filled(**conn, size, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, size, 1));
  (*conn)->Close();
}

TEST(RdmaTransport, PayloadSizesAroundEveryThreshold) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  const size_t slot = RdmaOptions().slot_size;
  const size_t threshold = slot - kHeaderSize;  // largest payload that goes by SEND
  const size_t max_msg = size_t{8} << 20;       // rxe's max_msg_sz: READs split there
  struct Case {
    size_t size;
    bool by_read;
  } cases[] = {{0, false},
               {1, false},
               // Around the inline limits a frame may have (256 B asked of the
               // device, RdmaConnection::kMaxInlineUsed at most).
               {256 - kHeaderSize - 1, false},
               {256 - kHeaderSize, false},
               {256 - kHeaderSize + 1, false},
               {RdmaConnection::kMaxInlineUsed - kHeaderSize, false},
               {RdmaConnection::kMaxInlineUsed - kHeaderSize + 1, false},
               {threshold - 1, false},
               {threshold, false},
               {threshold + 1, true},
               {slot - 1, true},
               {slot, true},
               {slot + 1, true},
               {max_msg - 1, true},
               {max_msg, true},
               {max_msg + 1, true},
               {size_t{64} << 20, true}};
  uint64_t id = 1;
  for (const Case& c : cases) {
    const uint64_t reads_before = Counters().reads;
    const uint64_t consumed_before = Counters().srq_slots_consumed;
    const uint64_t copies_before = Counters().send_payload_copies;
    auto r = Call(*conn, waiter, id, Filled(*conn, c.size, id));
    ASSERT_TRUE(r.ok()) << c.size << ": " << r.status();
    EXPECT_TRUE(Matches(r->payload, c.size, id)) << "bytes differ at size " << c.size;
    const uint64_t reads = Counters().reads - reads_before;
    // Request and response each arrived in an SRQ slot.
    EXPECT_GE(Counters().srq_slots_consumed - consumed_before, 2u) << c.size;
    if (c.by_read) {
      // Request and response each pulled; a payload over max_msg_sz in parts.
      const uint64_t parts = (c.size + max_msg - 1) / max_msg;
      EXPECT_GE(reads, 2 * parts) << "size " << c.size << " should travel by READ";
    } else {
      EXPECT_EQ(reads, 0u) << "size " << c.size << " should travel inside the SEND";
    }
    // Payloads from AllocatePayload go out from where they were written.
    EXPECT_EQ(Counters().send_payload_copies, copies_before) << "size " << c.size;
    ++id;
  }
  printf("counters: %s\n", Counters().ToString().c_str());
  conn->Close();
}

// SendWith: a payload whose frame fits inline is written straight into the
// SEND (counted in place); a larger one goes as Send sends it. Either way
// the peer gets the bytes that `write` wrote, after the metadata if any.
TEST(RdmaTransport, SendWithWritesSmallFramesInPlaceAndLargerOnesAsSendDoes) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  const size_t threshold = RdmaOptions().slot_size - kHeaderSize;
  const size_t inline_max = dynamic_cast<RdmaConnection&>(*conn).max_inline();
  const std::string metadata = EncodeMetadata({{"k", "v"}});
  struct Case {
    size_t size;
    std::string metadata;
  } cases[] = {{0, ""},
               {1, ""},
               {64, metadata},
               // Around the inline limits a frame may have (256 B asked of the
               // device, RdmaConnection::kMaxInlineUsed at most).
               {256 - kHeaderSize, ""},
               {256 - kHeaderSize + 1, ""},
               {RdmaConnection::kMaxInlineUsed - kHeaderSize + 1, ""},
               {threshold, ""},
               {threshold + 1, ""}};  // by READ
  uint64_t id = 1;
  int in_place_cases = 0;
  for (const Case& c : cases) {
    const bool in_place = kHeaderSize + c.metadata.size() + c.size <= inline_max;
    in_place_cases += in_place;
    const RdmaCounters before = Counters();
    auto f = waiter.Expect(id);
    OutboundMessage m = Request(id, Buffer(), c.metadata);
    const uint64_t seed = id;
    ASSERT_TRUE(conn->SendWith(std::move(m), c.size,
                               [&](char* out) {
                                 for (size_t i = 0; i < c.size; ++i) {
                                   out[i] = static_cast<char>(Pattern(i, seed));
                                 }
                               })
                    .ok());
    ASSERT_EQ(f.wait_for(std::chrono::seconds(120)), std::future_status::ready) << c.size;
    InboundMessage r = f.get();
    ASSERT_TRUE(r.payload_status.ok()) << c.size << ": " << r.payload_status;
    // Echoed by the server as it found them after the header and metadata.
    EXPECT_TRUE(Matches(r.payload, c.size, seed)) << "bytes differ at size " << c.size;
    // The request only: the echo answers with Send.
    EXPECT_EQ(Counters().sends_in_place - before.sends_in_place, in_place ? 1u : 0u)
        << "size " << c.size;
    EXPECT_EQ(Counters().send_payload_copies, before.send_payload_copies) << c.size;
    ++id;
  }
  // Soft-RoCE grants the 256 bytes asked; a device with less inline data
  // still passes, with fewer frames written in place.
  printf("max_inline %zu: %d of %zu frames written in place\n", inline_max, in_place_cases,
         std::size(cases));
  conn->Close();
}

// Small payloads are written into registered blocks that the SEND gathers.
// With every block held, more payloads come from the heap and are copied
// into their frames; blocks given back are handed out again. No block is
// ever held twice (the free blocks are a lock-free stack shared by threads).
TEST(RdmaTransport, SmallPayloadBlocksRunOutIntoCopiesAndComeBack) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  constexpr size_t kSize = 2000;  // not inline, so a payload is gathered or copied
  constexpr size_t kHeld = Endpoint::kMaxSmallBlocks + 4;
  uint64_t id = 0;
  for (int round = 0; round < 2; ++round) {
    std::vector<Buffer> held;
    std::set<const char*> distinct;
    for (size_t i = 0; i < kHeld; ++i) {
      held.push_back(Filled(*conn, kSize, ++id));
      distinct.insert(held.back().data());
    }
    EXPECT_EQ(distinct.size(), kHeld) << "a block was handed out twice";
    const uint64_t first = id - kHeld + 1;
    // The first payload sits in a registered block, the last on the heap.
    uint64_t copies = Counters().send_payload_copies;
    auto r = Call(*conn, waiter, first, std::move(held.front()));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(Matches(r->payload, kSize, first));
    EXPECT_EQ(Counters().send_payload_copies, copies);
    r = Call(*conn, waiter, id, std::move(held.back()));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(Matches(r->payload, kSize, id));
    EXPECT_EQ(Counters().send_payload_copies, copies + 1);
    // Given back, the blocks serve the next round (and no more registration).
    held.clear();
    ++id;
    r = Call(*conn, waiter, id, Filled(*conn, kSize, id));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(Counters().send_payload_copies, copies + 1);
  }
  conn->Close();
}

// Small payload blocks that cannot be registered: payloads come from the heap
// and are copied into their frames, registration is not tried again on every
// payload, and once Endpoint::kRegistrationRetry has passed it is.
TEST(RdmaTransport, SmallPayloadBlocksThatCannotBeRegisteredAreTriedAgainLater) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  constexpr size_t kSize = 2000;  // not inline, so a payload is gathered or copied
  auto call_copies = [&](uint64_t id) -> uint64_t {
    const uint64_t before = Counters().send_payload_copies;
    auto r = Call(*conn, waiter, id, Filled(*conn, kSize, id));
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r.ok() && Matches(r->payload, kSize, id));
    return Counters().send_payload_copies - before;
  };
  FaultInjection::FailRegistrations() = 1;  // the client's first block region
  EXPECT_EQ(call_copies(1), 1u) << "a payload without a block was not copied";
  EXPECT_EQ(FaultInjection::FailRegistrations().load(), 0);
  EXPECT_EQ(call_copies(2), 1u) << "tried again at once";
  absl::SleepFor(absl::FromChrono(Endpoint::kRegistrationRetry) + absl::Milliseconds(20));
  EXPECT_EQ(call_copies(3), 0u) << "not tried again after kRegistrationRetry";
  conn->Close();
}

// Every Buffer the transport hands out is a loan on its Endpoint (endpoint.h,
// "Lifetime"): messages and payloads the runtime still holds stay readable
// after the connection and both transports are gone, and releasing them then
// frees what is left. A loan that ended too early is a use-after-free here,
// which the ASan run of this suite reports.
TEST(RdmaTransport, BuffersHeldByTheRuntimeOutliveTheirTransport) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  const size_t small = 100;      // a response that arrives in a receive slot
  const size_t large = 1 << 20;  // a response READ into a pool block
  auto in_slot = Call(*conn, waiter, 1, Filled(*conn, small, 1));
  auto in_block = Call(*conn, waiter, 2, Filled(*conn, large, 2));
  ASSERT_TRUE(in_slot.ok()) << in_slot.status();
  ASSERT_TRUE(in_block.ok()) << in_block.status();
  Buffer unsent_small = Filled(*conn, small, 3);  // a small-payload block
  Buffer unsent_large = Filled(*conn, large, 4);  // a pool block
  conn->Close();
  conn.reset();
  fx.listener.reset();
  fx.client.reset();
  fx.server.reset();
  EXPECT_TRUE(Matches(in_slot->payload, small, 1));
  EXPECT_TRUE(Matches(in_block->payload, large, 2));
  EXPECT_TRUE(Matches(unsent_small, small, 3));
  EXPECT_TRUE(Matches(unsent_large, large, 4));
  in_slot->payload.Reset();
  unsent_small.Reset();
  in_block->payload.Reset();
  unsent_large.Reset();
}

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
  absl::Status refused = conns.Add();
  ASSERT_FALSE(refused.ok()) << "a connection past the CQ's room was admitted";
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  for (const char* part : {"refused", "completion queue on rxe", "full", "max_cq_entries"}) {
    EXPECT_NE(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused;
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
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while ((client.send_slots_held() != 0 || server.send_slots_held() != 0) && absl::Now() < until) {
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

TEST(RdmaTransport, BadRkeyFailsOnlyThatConnection) {
  Fixture fx;
  Waiter& bad_waiter = fx.NewWaiter();
  Waiter& good_waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  auto bad = fx.Connect(&bad_waiter);
  auto good = fx.Connect(&good_waiter);
  ASSERT_TRUE(bad.ok() && good.ok());
  const std::string client_end = OnPoller<std::string>(**bad, "gone", DescribeLocalEnd);
  ASSERT_NE(client_end.find(" gid_index "), std::string::npos) << client_end;
  FaultInjection::CorruptRkeys().store(1);
  auto r = Call(**bad, bad_waiter, 1, Filled(**bad, 100000, 1));
  ASSERT_FALSE(r.ok()) << "a READ with a wrong rkey cannot succeed";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_NE(r.status().message().find("rdma://"), absl::string_view::npos)
      << "the error names the peer: " << r.status();
  EXPECT_NE(r.status().message().find("; our end: " + client_end), absl::string_view::npos)
      << "the error names our device, port and GID: " << r.status();
  EXPECT_TRUE(bad_waiter.closed.load());
  // The server's side of it ends too (its observer may hear of it a little
  // after the client does).
  const absl::Time until = absl::Now() + absl::Seconds(10);
  for (;;) {
    std::lock_guard<std::mutex> lock(fx.echo.mu);
    if (!fx.echo.closed.empty() || absl::Now() > until) break;
  }
  {
    std::lock_guard<std::mutex> lock(fx.echo.mu);
    ASSERT_FALSE(fx.echo.closed.empty());
    EXPECT_NE(fx.echo.closed[0].message().find("remote access error"), std::string::npos)
        << fx.echo.closed[0];
    EXPECT_NE(
        fx.echo.closed[0].message().find(absl::StrCat(
            "; our end: device ",
            std::static_pointer_cast<RdmaConnection>(*good)->endpoint()->device_name(), " port ")),
        std::string::npos)
        << fx.echo.closed[0];
  }
  auto ok = Call(**good, good_waiter, 1, Filled(**good, 100000, 2));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(Matches(ok->payload, 100000, 2));
  (*good)->Close();
}

// An advertisement is revoked once its call is answered: a peer that READs
// an old (addr, rkey) again is refused by the NIC, even though the block is
// still registered (the memory window was invalidated).
TEST(RdmaTransport, ReplayedOldAdvertisementIsRefused) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  Waiter& good_waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  auto conn = fx.Connect(&waiter);
  auto good = fx.Connect(&good_waiter);
  ASSERT_TRUE(conn.ok() && good.ok());
  auto first = Call(**conn, waiter, 1, Filled(**conn, 20000, 3));
  ASSERT_TRUE(first.ok()) << first.status();
  FaultInjection::StaleReads().store(1);
  auto replayed = Call(**conn, waiter, 2, Filled(**conn, 20000, 4));
  FaultInjection::StaleReads().store(0);
  ASSERT_FALSE(replayed.ok()) << "a released advertisement must not be readable";
  EXPECT_EQ(replayed.status().code(), absl::StatusCode::kUnavailable) << replayed.status();
  auto ok = Call(**good, good_waiter, 1, Filled(**good, 20000, 5));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(Matches(ok->payload, 20000, 5));
  (*good)->Close();
}

// A request whose deadline passes while its payload waits for a READ is
// answered DEADLINE_EXCEEDED and never READ. The server allows one READ in
// flight, so the second request's payload waits behind all of the first's
// 32 MiB (milliseconds on a 100 Gb/s NIC, most of a second here) while its
// own deadline is 1 ms.
TEST(RdmaTransport, RequestPastItsDeadlineIsNotRead) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  RdmaOptions one_read;
  one_read.max_reads_in_flight = 1;
  ASSERT_TRUE(fx.Start(one_read));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t big = size_t{32} << 20;
  const size_t late = size_t{1} << 20;
  const uint64_t bytes_read_before = Counters().bytes_read;
  auto first = waiter.Expect(1);
  auto second = waiter.Expect(2);
  ASSERT_TRUE((*conn)->Send(Request(1, Filled(**conn, big, 1))).ok());
  OutboundMessage expiring = Request(2, Filled(**conn, late, 2));
  expiring.header.timeout_us = 1000;
  ASSERT_TRUE((*conn)->Send(std::move(expiring)).ok());
  ASSERT_EQ(second.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  InboundMessage refused = second.get();
  ASSERT_TRUE(refused.payload_status.ok()) << refused.payload_status;
  EXPECT_EQ(refused.header.status, static_cast<uint16_t>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(refused.payload.size(), 0u);
  ASSERT_EQ(first.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  InboundMessage answered = first.get();
  ASSERT_TRUE(answered.payload_status.ok()) << answered.payload_status;
  EXPECT_TRUE(Matches(answered.payload, big, 1));
  // The first request and its response were READ, the late one not at all.
  EXPECT_EQ(Counters().bytes_read - bytes_read_before, 2 * big);
  // The connection goes on serving.
  auto after = Call(**conn, waiter, 3, Filled(**conn, late, 3));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(Matches(after->payload, late, 3));
  (*conn)->Close();
}

// Server side: request 1 is answered after the server pushes a request of
// its own with a 32 MiB payload, so the client, with one READ at a time,
// reaches the response's payload only after that READ. Everything else is
// echoed.
class AnswerBehindABigPush : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kRequest || msg.header.call_id != 1) {
      return echo_.OnMessage(conn, std::move(msg));
    }
    ASSERT_TRUE(conn.Send(Request(kPushId, Filled(conn, kPush, kPushId))).ok());
    OutboundMessage r;
    r.header.kind = MessageKind::kResponse;
    r.header.call_id = 1;
    r.payload = Filled(conn, kAnswer, 1);
    ASSERT_TRUE(conn.Send(std::move(r)).ok());
  }
  void OnClosed(Connection& conn, const absl::Status& why) override { echo_.OnClosed(conn, why); }

  static constexpr uint64_t kPushId = 100;
  static constexpr size_t kPush = size_t{32} << 20;
  static constexpr size_t kAnswer = size_t{64} << 10;

 private:
  EchoObserver echo_;
};

// The server's release timeout travels in the handshake; a client that gets
// to a response's payload after half of it does not READ it (the server may
// have revoked it, and a READ that fails ends the connection): that call
// ends DEADLINE_EXCEEDED, saying why, and the connection goes on.
TEST(RdmaTransport, ResponseReachedAfterTheServersReleaseTimeoutIsNotRead) {
  AnswerBehindABigPush server_side;  // outlives the transports too
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  fx.server_observer = &server_side;
  RdmaOptions server_opts;
  // Half of it, 1 ms, is far less than a 32 MiB READ takes on Soft-RoCE.
  server_opts.release_timeout_ms = 2;
  RdmaOptions one_read;
  one_read.max_reads_in_flight = 1;
  ASSERT_TRUE(fx.Start(server_opts, one_read));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const uint64_t bytes_read_before = Counters().bytes_read;
  const uint64_t skipped_before = Counters().late_reads_skipped;
  auto push = waiter.Expect(AnswerBehindABigPush::kPushId);
  auto answer = waiter.Expect(1);
  ASSERT_TRUE((*conn)->Send(Request(1, Buffer())).ok());
  ASSERT_EQ(answer.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  InboundMessage late = answer.get();
  EXPECT_EQ(late.payload_status.code(), absl::StatusCode::kDeadlineExceeded) << late.payload_status;
  EXPECT_NE(late.payload_status.message().find("was not read in time: the server revokes it 2 ms"),
            std::string::npos)
      << late.payload_status;
  EXPECT_EQ(late.payload.size(), 0u);
  ASSERT_EQ(push.wait_for(std::chrono::seconds(120)), std::future_status::ready);
  InboundMessage pushed = push.get();
  ASSERT_TRUE(pushed.payload_status.ok()) << pushed.payload_status;
  EXPECT_TRUE(Matches(pushed.payload, AnswerBehindABigPush::kPush, AnswerBehindABigPush::kPushId));
  EXPECT_EQ(Counters().bytes_read - bytes_read_before, AnswerBehindABigPush::kPush)
      << "the late response's payload was READ";
  EXPECT_EQ(Counters().late_reads_skipped, skipped_before + 1);
  // The connection goes on (a payload small enough to go by SEND: one that
  // goes by READ would race the 2 ms timeout).
  auto after = Call(**conn, waiter, 3, Filled(**conn, 3, 3));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_TRUE(Matches(after->payload, 3, 3));
  EXPECT_FALSE(waiter.closed.load());
  (*conn)->Close();
}

// A READ still running when the server revokes the response's buffer does
// not complete: the device fails it, or (Soft-RoCE, which retries it for
// ever) the client gives up at twice the server's release timeout. Either
// way the client's connection ends UNAVAILABLE saying why, and the server
// goes on serving (a new connection is answered).
TEST(RdmaTransport, ResponseRevokedDuringItsReadEndsTheConnectionSayingWhy) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  RdmaOptions server_opts;
  // A third of what a 32 MiB READ takes on Soft-RoCE (~100 MiB/s), so the
  // revocation meets the READ. The client must start the READ within half
  // of it or skip it as late: 1 ms of 2 was once too little under ASan.
  server_opts.release_timeout_ms = 100;
  ASSERT_TRUE(fx.Start(server_opts));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t big = size_t{32} << 20;
  auto cut = Call(**conn, waiter, 1, Filled(**conn, big, 1));
  ASSERT_FALSE(cut.ok()) << "the whole payload was READ after its release timeout";
  printf("the call ended: %s\n", cut.status().ToString().c_str());
  EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
  EXPECT_NE(cut.status().message().find("revokes a response's buffer 100 ms after sending it"),
            std::string::npos)
      << cut.status();
  EXPECT_TRUE(waiter.closed.load());
  ExpectServesANewClient(fx, 3);
}

// Server side: takes requests and never answers them; records what it got
// and how connections ended.
class NeverAnswers : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    received_.push_back(msg.payload_status.ok() ? msg.payload.size() : 0);
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.push_back(why);
  }
  // The payload size of the n-th request (0 when its payload failed), after
  // waiting up to 30 s for it; -1 if it did not come.
  int64_t Received(size_t n) {
    return WaitFor([&] { return received_.size() > n; }) ? static_cast<int64_t>(received_[n]) : -1;
  }
  // How the first connection ended, after waiting up to 30 s.
  std::optional<absl::Status> FirstClosed() {
    if (!WaitFor([&] { return !closed_.empty(); })) return std::nullopt;
    return closed_[0];
  }

 private:
  bool WaitFor(const std::function<bool()>& ready) {
    const absl::Time until = absl::Now() + absl::Seconds(30);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (ready()) return true;
      }
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  std::mutex mu_;
  std::vector<size_t> received_;      // guarded by mu_
  std::vector<absl::Status> closed_;  // guarded by mu_
};

// A request that is never answered does not hold the client's registered
// memory for ever: its window is revoked release_timeout_ms after its
// deadline and the block goes back to the pool (the next request reuses
// it). The connection goes on.
TEST(RdmaTransport, UnansweredRequestPayloadIsRevokedAfterItsDeadline) {
  NeverAnswers server_side;
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  fx.server_observer = &server_side;
  RdmaOptions client_opts;
  client_opts.release_timeout_ms = 300;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_opts));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t size = size_t{64} << 10;  // goes by READ
  const uint64_t expired_before = Counters().releases_expired;
  OutboundMessage first = Request(1, Filled(**conn, size, 1));
  first.header.timeout_us = 100000;
  ASSERT_TRUE((*conn)->Send(std::move(first)).ok());
  ASSERT_EQ(server_side.Received(0), static_cast<int64_t>(size)) << "the server did not READ it";
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (Counters().releases_expired == expired_before && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(Counters().releases_expired, expired_before + 1)
      << "the unanswered request's payload was not revoked";
  const uint64_t registered = Counters().registered_bytes;
  OutboundMessage second = Request(2, Filled(**conn, size, 2));
  second.header.timeout_us = 100000;
  ASSERT_TRUE((*conn)->Send(std::move(second)).ok());
  ASSERT_EQ(server_side.Received(1), static_cast<int64_t>(size));
  EXPECT_EQ(Counters().registered_bytes, registered) << "the revoked block was not reused";
  EXPECT_FALSE(waiter.closed.load());
  (*conn)->Close();
}

// The server's side of the same rule: a request READ still running when the
// client revokes the buffer (its deadline plus the client's release timeout)
// does not complete; the server ends that connection UNAVAILABLE saying why
// and serves others.
TEST(RdmaTransport, RequestRevokedDuringItsReadEndsTheConnectionSayingWhy) {
  NeverAnswers server_side;
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  Waiter& second_waiter = fx.NewWaiter();
  fx.server_observer = &server_side;
  RdmaOptions client_opts;
  client_opts.release_timeout_ms = 2;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_opts));
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  OutboundMessage big = Request(1, Filled(**conn, size_t{32} << 20, 1));
  // The server starts the READ within the deadline; the revocation 2 ms
  // after it cuts the READ (~320 ms for 32 MiB on Soft-RoCE). A 1 ms
  // deadline could pass before a slow server began.
  big.header.timeout_us = 100000;
  ASSERT_TRUE((*conn)->Send(std::move(big)).ok());
  auto why = server_side.FirstClosed();
  ASSERT_TRUE(why.has_value()) << "the server kept the connection";
  // Either the READ's own failure, or (when the revocation met a READ in
  // the middle of its response and took the client's QP down) the client's
  // disconnect with the likely cause.
  printf("the server ended the connection: %s\n", why->ToString().c_str());
  EXPECT_EQ(why->code(), absl::StatusCode::kUnavailable) << *why;
  EXPECT_NE(why->message().find("revokes a request's buffer 2 ms after the request's deadline"),
            std::string::npos)
      << *why;
  auto second = fx.Connect(&second_waiter);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->Send(Request(2, Filled(**second, 3, 2))).ok());
  EXPECT_EQ(server_side.Received(0), 3) << "the server did not serve a new connection";
  (*second)->Close();
}

// The device, port and GID table entry that carry `ip` (IPv4 or IPv6) on RoCE.
struct GidPlace {
  std::string device;
  uint32_t port = 0;
  int index = -1;
};
GidPlace FindGidOf(const std::string& ip) {
  // An IPv4 address's GID is the address mapped into IPv6, ::ffff:a.b.c.d.
  in6_addr want{};
  if (in_addr v4{}; inet_pton(AF_INET, ip.c_str(), &v4) == 1) {
    want.s6_addr[10] = want.s6_addr[11] = 0xff;
    memcpy(want.s6_addr + 12, &v4, 4);
  } else if (inet_pton(AF_INET6, ip.c_str(), &want) != 1) {
    return {};
  }
  GidPlace place;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int d = 0; d < n && place.index < 0; ++d) {
    ibv_context* ctx = ibv_open_device(list[d]);
    if (!ctx) continue;
    ibv_device_attr attr{};
    ibv_query_device(ctx, &attr);
    for (uint32_t p = 1; p <= attr.phys_port_cnt && place.index < 0; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) != 0) continue;
      for (int g = 0; g < pa.gid_tbl_len; ++g) {
        ibv_gid_entry e{};
        if (ibv_query_gid_ex(ctx, p, g, &e, 0) != 0) continue;
        if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(e.gid.raw, &want, 16) == 0) {
          place = GidPlace{ibv_get_device_name(list[d]), p, g};
          break;
        }
      }
    }
    ibv_close_device(ctx);
  }
  if (list) ibv_free_device_list(list);
  return place;
}

// The first RoCE v2 GID of place's port whose address is of `family`, or -1.
int FindGidOfFamily(const GidPlace& place, int family) {
  int found = -1;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int d = 0; d < n && found < 0; ++d) {
    if (place.device != ibv_get_device_name(list[d])) continue;
    ibv_context* ctx = ibv_open_device(list[d]);
    if (!ctx) continue;
    ibv_port_attr pa{};
    for (int g = 0; ibv_query_port(ctx, place.port, &pa) == 0 && g < pa.gid_tbl_len; ++g) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(ctx, place.port, g, &e, 0) != 0) continue;
      const bool v4 = IN6_IS_ADDR_V4MAPPED(reinterpret_cast<const in6_addr*>(e.gid.raw));
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && v4 == (family == AF_INET)) {
        found = g;
        break;
      }
    }
    ibv_close_device(ctx);
  }
  if (list) ibv_free_device_list(list);
  return found;
}

// Named explicitly, device, port and GID index are what both sides use; a
// server given a wildcard listens on that GID's address.
TEST(RdmaTransport, NamedDevicePortAndGidAreUsed) {
  const GidPlace place = FindGidOf(::rdmarpc::rdma::testing::RequireRdmaTestAddress());
  ASSERT_GE(place.index, 0) << "no RoCE v2 GID carries the test address. " << DescribeDevices();
  RdmaOptions named;
  named.device = place.device;
  named.device_port = place.port;
  named.gid_index = place.index;
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  fx.listen_host = "0.0.0.0";
  ASSERT_TRUE(fx.Start(named, named));
  EXPECT_EQ(fx.addr.host, fx.ip) << "a wildcard listens on the named GID's address";
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 100, 1));
  rdma_cm_id* id = std::static_pointer_cast<RdmaConnection>(*conn)->id();
  EXPECT_EQ(ibv_get_device_name(id->verbs->device), place.device);
  EXPECT_EQ(id->port_num, place.port);
  EXPECT_EQ(ChosenGidIndex(id), place.index);
  (*conn)->Close();
}

// An IPv6 address is served and reached over the RoCE v2 GID that carries
// it, not over the port's IPv4-mapped or link-local GID, and frames and READ
// pulls both work across it.
TEST(RdmaTransport, Ipv6AddressIsReachedOverItsOwnGid) {
  const std::string ip6 = ::rdmarpc::rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip6.empty());
  const GidPlace place = FindGidOf(ip6);
  ASSERT_GE(place.index, 0) << "no RoCE v2 GID carries " << ip6 << ". " << DescribeDevices();
  Fixture fx;
  fx.listen_host = absl::StrCat("[", ip6, "]");
  Waiter& waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  EXPECT_EQ(fx.addr.host, ip6);
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t large = RdmaOptions().slot_size * 4;
  const uint64_t reads_before = Counters().reads;
  auto small = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(Matches(small->payload, 100, 1));
  EXPECT_EQ(Counters().reads, reads_before) << "a small frame went by READ";
  auto pulled = Call(**conn, waiter, 2, Filled(**conn, large, 2));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(Matches(pulled->payload, large, 2));
  EXPECT_GE(Counters().reads - reads_before, 2u) << "request and response each pulled by READ";
  std::shared_ptr<Connection> server_conn = fx.LastAccepted();
  ASSERT_NE(server_conn, nullptr);
  for (Connection* c : {conn->get(), server_conn.get()}) {
    const GidPlace p = OnPoller<GidPlace>(*c, GidPlace{}, [](rdma_cm_id* id) {
      return GidPlace{ibv_get_device_name(id->verbs->device), id->port_num, ChosenGidIndex(id)};
    });
    EXPECT_EQ(p.device, place.device);
    EXPECT_EQ(p.port, place.port);
    EXPECT_EQ(p.index, place.index) << "not the GID of " << ip6;
  }
  (*conn)->Close();
}

// READ limits are set as rdma_accept(3) reads a connect request: a side
// keeps at most as many READs in flight as the other side's QP serves, and
// the server sets aside responder resources for as many READs as the client
// will have in flight, not for as many as the client's device could serve.
TEST(RdmaTransport, ReadsInFlightAreNegotiatedBothWays) {
  RdmaOptions client_options;
  client_options.max_reads_in_flight = 4;
  Fixture fx;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_options));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  struct Limits {
    int initiator = -1;  // max_rd_atomic: READs this QP has in flight
    int responder = -1;  // max_dest_rd_atomic: the peer's READs it serves
  };
  const auto limits = [](Connection& c) {
    return OnPoller<Limits>(c, Limits{}, [](rdma_cm_id* id) {
      Limits l;
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      if (ibv_query_qp(id->qp, &attr, IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC, &init) ==
          0) {
        l.initiator = attr.max_rd_atomic;
        l.responder = attr.max_dest_rd_atomic;
      }
      return l;
    });
  };
  const Limits client = limits(*ends.client);
  const Limits server = limits(*ends.server);
  EXPECT_EQ(client.initiator, 4) << "the client's own max_reads_in_flight";
  EXPECT_EQ(server.responder, 4) << "the server serves more READs than the client takes";
  EXPECT_LE(server.initiator, client.responder)
      << "the server has more READs in flight than the client's QP serves";
  EXPECT_EQ(server.initiator, std::min<int>(RdmaOptions().max_reads_in_flight, client.responder))
      << "the server took the client's own READ limit for its own";
  ends.client->Close();
}

// A SEND that finds the SRQ empty is retried after the receiver's RNR NAK
// timer, which rdma_cm leaves at code 0: 655 ms. Each side sets its own
// from rnr_wait_us, rounded up to IBA's table (120 us for 100 asked).
TEST(RdmaTransport, EachSideAdvertisesItsOwnRnrWait) {
  RdmaOptions server_options;
  server_options.rnr_wait_us = 100;
  Fixture fx;
  ASSERT_TRUE(fx.Start(server_options, RdmaOptions()));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  const auto rnr_timer = [](Connection& c) {
    return OnPoller<int>(c, -1, [](rdma_cm_id* id) {
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      return ibv_query_qp(id->qp, &attr, IBV_QP_MIN_RNR_TIMER, &init) == 0 ? int{attr.min_rnr_timer}
                                                                           : -1;
    });
  };
  EXPECT_EQ(rnr_timer(*ends.server), 7) << "120 us, the shortest wait of at least 100";
  EXPECT_EQ(rnr_timer(*ends.client), RnrTimerCode(RdmaOptions().rnr_wait_us))
      << "the default, 640 us";
  ends.client->Close();
}

// A client's type_of_service goes into its QP's path and, through the
// connect request, into the server's: a lossless RoCE class (here DSCP 26)
// holds both ways. Without it both keep rdma_cm's default, the same on
// each side. The one log line says the class.
TEST(RdmaTransport, TheClientsTypeOfServiceHoldsBothWays) {
  RdmaOptions client_options;
  client_options.type_of_service = 26 << 2;
  Fixture fx;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_options));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  const auto traffic_class = [](const std::shared_ptr<Connection>& c) {
    return OnPoller<int>(*c, -1, TrafficClass);
  };
  EXPECT_EQ(traffic_class(ends.client), 104);
  EXPECT_EQ(traffic_class(ends.server), 104) << "the server's QP does not answer in its class";
  const std::string described = OnPoller<std::string>(*ends.client, "gone", DescribeChoice);
  EXPECT_TRUE(absl::StrContains(described, "type_of_service 104")) << described;
  ends.client->Close();

  Fixture plain;
  ASSERT_TRUE(plain.Start());
  const BothEnds defaults = ConnectAndCall(plain);
  ASSERT_NE(defaults.server, nullptr);
  EXPECT_GE(traffic_class(defaults.client), 0);
  EXPECT_EQ(traffic_class(defaults.client), traffic_class(defaults.server));
  defaults.client->Close();
}

// The lines RdmaOptions::trace wrote for `who` ("test-client"), in order.
std::vector<std::string> TraceLines(const std::string& captured, const std::string& who) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(captured, '\n')) {
    if (absl::StartsWith(line, absl::StrCat("rdmarpc[", who, "] trace: "))) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

// Each of `expected` is in a line of `lines`, in this order.
void ExpectInOrder(const std::vector<std::string>& lines,
                   const std::vector<std::string>& expected) {
  size_t at = 0;
  for (const std::string& e : expected) {
    while (at < lines.size() && lines[at].find(e) == std::string::npos) ++at;
    EXPECT_LT(at, lines.size()) << "no line with \"" << e << "\" where expected; traced:\n"
                                << absl::StrJoin(lines, "\n");
  }
}

// With RdmaOptions::trace, each side says every step of a connection's life
// with what it chose and agreed: the device, port and GID, the QP, the
// credits each side grants the other, rdma_cm's events, the teardown, and
// that the QP drained before it was freed. Without it, nothing is traced.
TEST(RdmaTransport, TraceFollowsEachConnectionFromResolveToFree) {
  for (const bool trace : {false, true}) {
    SCOPED_TRACE(trace ? "traced" : "not traced");
    RdmaOptions server_options;
    server_options.credits = 24;
    server_options.trace = trace;
    RdmaOptions client_options;
    client_options.credits = 16;
    client_options.trace = trace;
    std::string choice;
    ::testing::internal::CaptureStderr();
    {
      Fixture fx;
      Waiter& waiter = fx.NewWaiter();
      if (!fx.Start(server_options, client_options)) {
        ::testing::internal::GetCapturedStderr();
        FAIL() << "could not start";
      }
      auto conn = fx.Connect(&waiter);
      ASSERT_TRUE(conn.ok()) << conn.status();
      choice = DescribeChoice(std::static_pointer_cast<RdmaConnection>(*conn)->id());
      auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
      EXPECT_TRUE(r.ok()) << r.status();
      const uint64_t closed_before = Counters().connections_closed;
      (*conn)->Close();
      // Both ends, the server's on the client's disconnect, not at shutdown.
      const absl::Time until = absl::Now() + absl::Seconds(30);
      while (Counters().connections_closed < closed_before + 2 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      EXPECT_GE(Counters().connections_closed, closed_before + 2) << "a side never closed";
    }  // the transports shut down: every connection is freed
    const std::string captured = ::testing::internal::GetCapturedStderr();
    const std::vector<std::string> client = TraceLines(captured, "test-client");
    const std::vector<std::string> server = TraceLines(captured, "test-server");
    if (!trace) {
      EXPECT_TRUE(client.empty() && server.empty()) << captured;
      continue;
    }
    ExpectInOrder(client,
                  {"resolving the address; rdma_cm picks the device", "RDMA_CM_EVENT_ADDR_RESOLVED",
                   "RDMA_CM_EVENT_ROUTE_RESOLVED", absl::StrCat(choice, "; QP "),
                   "we grant 16 credits", "established: QP", "credits: we grant 16, the peer 24",
                   "ACK timeout", "tearing down QP", "drained after"});
    ExpectInOrder(server, {"listening on rdma://", "connection request from rdma://",
                           "it grants 16 credits", "accepted on device",
                           "credits: we grant 24, the peer 16", "RDMA_CM_EVENT_ESTABLISHED",
                           "RDMA_CM_EVENT_DISCONNECTED", "tearing down QP", "drained after"});
  }
}

// Names that name nothing fail before any connection is tried, saying what
// exists; a device that rdma_cm does not route to fails naming both.
TEST(RdmaTransport, NamedDeviceOrGidThatDoesNotFitIsAClearError) {
  const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  const GidPlace place = FindGidOf(ip);
  ASSERT_GE(place.index, 0) << DescribeDevices();
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  const auto connect_with = [&](RdmaOptions o) {
    TransportOptions co;
    co.name = "named-client";
    Waiter w;
    RdmaTransport client(co, o, false);
    return client.Connect(fx.addr, &w, absl::Now() + absl::Seconds(30)).status();
  };
  const auto expect_error = [](const absl::Status& s, absl::StatusCode code,
                               const std::vector<std::string>& mentions) {
    EXPECT_EQ(s.code(), code) << s;
    for (const std::string& m : mentions) {
      EXPECT_NE(s.message().find(m), absl::string_view::npos) << "'" << m << "' missing: " << s;
    }
  };
  RdmaOptions o;
  o.device = place.device;
  o.device_port = place.port;
  o.gid_index = 1000000;
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument,
               {"gid_index 1000000", "no such GID", "Devices: " + place.device});
  o.device_port = 99;
  o.gid_index = place.index;
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument, {"no port 99", "Devices:"});
  o.device = "nosuch9";
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument,
               {"nosuch9", "Devices: " + place.device});
  o.device = "";
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument, {"set device"});
  // A GID of the other address family (Soft-RoCE's GID 0 is the port's IPv6
  // link-local address) cannot reach the server's IPv4 address.
  const int v6 = FindGidOfFamily(place, AF_INET6);
  if (place.device.rfind("rxe", 0) == 0) {
    ASSERT_GE(v6, 0) << "Soft-RoCE keeps the port's IPv6 link-local GID at index 0";
  }
  if (v6 >= 0) {
    RdmaOptions ipv6;
    ipv6.device = place.device;
    ipv6.device_port = place.port;
    ipv6.gid_index = v6;
    expect_error(connect_with(ipv6), absl::StatusCode::kInvalidArgument,
                 {absl::StrCat("gid_index ", v6), "is IPv6 and cannot reach an IPv4 address"});
  }
  // A device alone is a check on what rdma_cm picks for the address.
  RdmaOptions other_device;
  other_device.device = "nosuch9";
  expect_error(connect_with(other_device), absl::StatusCode::kUnavailable,
               {"rdma_cm chose device " + place.device, "asks for nosuch9"});
  // A server named a GID cannot listen on another address.
  RdmaOptions named;
  named.device = place.device;
  named.device_port = place.port;
  named.gid_index = place.index;
  TransportOptions so;
  so.listening = true;
  RdmaTransport server(so, named, true);
  auto l = server.Listen(*ParseAddress("rdma://127.0.0.1:0"),
                         [](std::shared_ptr<Connection>) { return nullptr; });
  ASSERT_FALSE(l.ok());
  expect_error(l.status(), absl::StatusCode::kInvalidArgument, {"whose address is " + ip});
  // The server that was there is untouched.
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(Call(**conn, waiter, 1, Filled(**conn, 100, 1)).ok());
  (*conn)->Close();
}

// A process that forks (system(), popen()) while calls are in flight keeps
// its RDMA buffers: the child holds the parent's pages until the calls are
// over, and the parent meanwhile writes new payloads into registered memory
// and the device writes responses into receive slots and READ blocks. On a
// kernel that shares DMA-pinned pages copy-on-write with a child, without
// ibv_fork_init the parent's writes would land in copies the device never
// sees; kernels since 5.13 copy such pages at fork (IBV_FORK_UNNEEDED). The
// test VM's kernel is one of those, so there this checks the rest of the
// stack (poller, descriptors, buffers in flight) across a fork, and the
// ibv_fork_init path itself runs only on older kernels.
TEST(RdmaTransport, ForkingWhileCallsAreInFlightCorruptsNothing) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  EXPECT_NE(ibv_is_fork_initialized(), IBV_FORK_DISABLED);
  uint64_t id = 0;
  for (int round = 0; round < 3; ++round) {
    struct InFlight {
      uint64_t id;
      size_t size;
      std::future<InboundMessage> response;
    };
    std::vector<InFlight> in_flight;
    for (size_t size : {size_t{100}, size_t{5000}, size_t{1} << 20}) {
      for (int k = 0; k < 3; ++k) {
        ++id;
        in_flight.push_back({id, size, waiter.Expect(id)});
        ASSERT_TRUE(conn->Send(Request(id, Filled(*conn, size, id))).ok());
      }
    }
    int hold[2];
    ASSERT_EQ(pipe(hold), 0);
    const pid_t child = fork();
    ASSERT_GE(child, 0) << strerror(errno);
    if (child == 0) {  // only async-signal-safe calls here
      close(hold[1]);
      char c;
      while (read(hold[0], &c, 1) < 0 && errno == EINTR) {
      }
      _exit(0);
    }
    close(hold[0]);
    for (InFlight& f : in_flight) {
      ASSERT_EQ(f.response.wait_for(std::chrono::seconds(120)), std::future_status::ready);
      InboundMessage r = f.response.get();
      ASSERT_TRUE(r.payload_status.ok()) << r.payload_status;
      EXPECT_TRUE(Matches(r.payload, f.size, f.id)) << "call " << f.id << " of " << f.size;
    }
    for (size_t size : {size_t{100}, size_t{1} << 20}) {
      ++id;
      auto r = Call(*conn, waiter, id, Filled(*conn, size, id));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(Matches(r->payload, size, id)) << "call " << id << " of " << size;
    }
    close(hold[1]);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  conn->Close();
}

// A post the device refuses (ibv_post_send failing: ENOMEM, as from a full
// send queue) ends that connection and its calls UNAVAILABLE naming the peer
// and the error, for a small frame and for one advertising a payload to
// READ; the server closes its end, and other connections go on.
TEST(RdmaTransport, FailedPostEndsOnlyItsConnectionSayingWhy) {
  Fixture fx;
  Waiter& other_waiter = fx.NewWaiter();
  std::shared_ptr<Connection> other = fx.StartAndConnect(other_waiter);
  ASSERT_TRUE(other);
  for (const size_t size : {size_t{100}, size_t{1} << 20}) {
    SCOPED_TRACE(size);
    Waiter& waiter = fx.NewWaiter();
    auto conn = fx.Connect(&waiter);
    ASSERT_TRUE(conn.ok()) << conn.status();
    ASSERT_TRUE(Call(**conn, waiter, 1, Filled(**conn, size, 1)).ok());
    const uint64_t opened = Counters().connections_opened;
    const uint64_t closed = Counters().connections_closed;
    auto answer = waiter.Expect(2);
    Buffer payload = Filled(**conn, size, 2);
    // This thread posts its own frame: the connection is idle, so nothing
    // else holds its post token.
    FaultInjection::FailNextPostOfThisThread();
    const absl::Status sent = (*conn)->Send(Request(2, std::move(payload)));
    EXPECT_TRUE(sent.ok() || sent.code() == absl::StatusCode::kUnavailable) << sent;
    ASSERT_EQ(answer.wait_for(std::chrono::seconds(20)), std::future_status::ready)
        << "the call on the failed connection never ended";
    const InboundMessage r = answer.get();
    EXPECT_EQ(r.payload_status.code(), absl::StatusCode::kUnavailable) << r.payload_status;
    EXPECT_NE(r.payload_status.message().find(absl::StrCat("ibv_post_send to ", (*conn)->peer(),
                                                           " failed: ", strerror(ENOMEM))),
              absl::string_view::npos)
        << r.payload_status;
    EXPECT_TRUE(EveryConnectionClosedSince(opened - 2, closed))  // both its ends
        << "the failed connection stayed open";
  }
  auto r = Call(*other, other_waiter, 3, Filled(*other, 100, 3));
  ASSERT_TRUE(r.ok()) << "another connection failed with it: " << r.status();
  EXPECT_TRUE(Matches(r->payload, 100, 3));
  ExpectServesANewClient(fx);
}

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
    ASSERT_TRUE(server_side.cv.wait_for(lock, std::chrono::seconds(20),
                                        [&] { return server_side.saw_three; }))
        << "request 3 stayed queued after the post it waited behind had finished";
  }
  for (auto* f : {&first_response, &second_response}) {
    ASSERT_EQ(f->wait_for(std::chrono::seconds(60)), std::future_status::ready);
  }
  InboundMessage r2 = first_response.get(), r3 = second_response.get();
  EXPECT_TRUE(r2.payload_status.ok() && Matches(r2.payload, 100, 2));
  EXPECT_TRUE(r3.payload_status.ok() && Matches(r3.payload, 100, 3));
  (*conn)->Close();
}

// A frame whose metadata fills the receive slot exactly, with no payload:
// its (empty) payload starts at the slot's very end, and releasing it must
// give back that slot, not the next one. A thousand of them through 512
// slots: every one answered, receive memory where it was.
TEST(RdmaTransport, FullSlotFramesGiveBackTheirSlots) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  ASSERT_TRUE(Call(*conn, waiter, 1, Filled(*conn, 10, 1)).ok());
  const size_t receive_before = fx.server->receive_bytes();
  const size_t metadata = RdmaOptions().slot_size - kHeaderSize;
  for (uint64_t id = 2; id <= 1001; ++id) {
    auto response = waiter.Expect(id);
    ASSERT_TRUE(conn->Send(Request(id, Buffer(), std::string(metadata, 'm'))).ok());
    ASSERT_EQ(response.wait_for(std::chrono::seconds(60)), std::future_status::ready) << id;
    EXPECT_TRUE(response.get().payload_status.ok()) << id;
  }
  EXPECT_EQ(fx.server->receive_bytes(), receive_before) << "receive slots were lost";
  conn->Close();
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

// Credits are per connection and the SRQ is shared, so a burst from many
// connections at once can empty it: then the device answers RNR NAK, the
// sender retries, and nothing is lost; the device counts the NAKs. Here the
// server's I/O thread is held in the first request's handler, so it cannot
// refill its 16 slots while four connections send their 8 credits' worth.
TEST(RdmaTransport, EmptySrqIsRetriedAndCounted) {
  HeldEcho held;
  constexpr int kConns = 4, kFrames = 8;
  Fixture fx;
  fx.server_observer = &held;
  RdmaOptions server_opts;
  server_opts.server_receive_slots = 16;
  server_opts.credits = kFrames;
  ASSERT_TRUE(fx.Start(server_opts));
  // Two windows of 8 fill the 16 slots; the third connection overcommits
  // them, which the server says once, with what to change.
  const std::string overcommitted = "peers may now send";
  std::vector<std::shared_ptr<Connection>> conns;
  for (int i = 0; i < kConns; ++i) {
    ::testing::internal::CaptureStderr();
    auto c = fx.Connect(&fx.NewWaiter());
    const std::string said = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(c.ok()) << c.status();
    conns.push_back(*c);
    if (i != 2) {
      EXPECT_EQ(said.find(overcommitted), std::string::npos) << "connection " << i + 1 << said;
      continue;
    }
    const std::string device =
        std::static_pointer_cast<RdmaConnection>(*c)->endpoint()->device_name();
    for (const std::string& part :
         {absl::StrCat("test-server]: ", device, ": the 3 connections' ", overcommitted,
                       " 24 frames at once into 16 receive slots"),
          std::string("retry each frame after 640 us"),
          std::string("raise RdmaOptions::server_receive_slots to 24 or more, or lower "
                      "RdmaOptions::credits to 5, or set RdmaOptions::strict_credits")}) {
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
  printf("device RNR NAKs received %lld -> %lld, sent %lld -> %lld\n",
         static_cast<long long>(before.received), static_cast<long long>(after.received),
         static_cast<long long>(before.sent), static_cast<long long>(after.sent));
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

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (d && readdir(d)) ++n;
  if (d) closedir(d);
  return n;
}

TEST(RdmaTransport, ThousandConnectDisconnectCyclesDoNotLeak) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  auto cycle = [&](int i) {
    Waiter w;
    auto c = fx.Connect(&w);
    ASSERT_TRUE(c.ok()) << "cycle " << i << ": " << c.status();
    auto r = Call(**c, w, 1, Filled(**c, i % 2 ? 64 : 20000, i));
    ASSERT_TRUE(r.ok()) << "cycle " << i << ": " << r.status();
    (*c)->Close();
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (!w.FinishedClosing() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    ASSERT_TRUE(w.FinishedClosing());
  };
  for (int i = 0; i < 20; ++i) cycle(i);  // warm the pools
  absl::SleepFor(absl::Milliseconds(500));
  const int fds = OpenFds();
  const uint64_t registered = Counters().registered_bytes;
  const uint64_t opened = Counters().connections_opened;
  for (int i = 0; i < 1000; ++i) {
    cycle(i);
    if (HasFatalFailure()) return;
    if (i % 200 == 0)
      printf("cycle %d: %d fds, %llu registered bytes\n", i, OpenFds(),
             static_cast<unsigned long long>(Counters().registered_bytes));
  }
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(Counters().connections_opened - opened, 2000u);  // both ends
  EXPECT_LE(OpenFds(), fds + 2) << "file descriptors leak";
  // Slot-sized memory (small payload blocks, send slots) grows a region at a
  // time, and only when more blocks are held at once than it has: a slow
  // spell (seen under TSan) that keeps one more block waiting for its SEND's
  // completion or its QP's teardown adds a region once, and the count stays
  // flat from then on. A leak adds with the cycles, so 1000 of them take it
  // past one region.
  const uint64_t one_region = uint64_t{Endpoint::kSlotsPerRegion} * RdmaOptions().slot_size;
  EXPECT_LE(Counters().registered_bytes, registered + one_region) << "registered memory grows";
}

// The rdma_cm ids of this process that the kernel tracks (iproute2's
// `rdma resource show cm_id`), or -1 when the tool gives no answer. The
// kernel names the thread that created an id, so any of our threads counts.
int CmIdsOfThisProcess() {
  std::set<std::string> ours;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) ours.insert(absl::StrCat(" pid ", e->d_name, " "));
    closedir(d);
  }
  FILE* f = popen("rdma resource show cm_id 2>&1", "r");
  if (f == nullptr) return -1;
  int n = 0;
  bool answered = false;
  char line[1024];
  while (fgets(line, sizeof line, f) != nullptr) {
    answered = answered || absl::StrContains(line, " pid ");
    for (const std::string& pid : ours) {
      if (absl::StrContains(line, pid)) ++n;
    }
  }
  pclose(f);
  return answered ? n : -1;
}

// A connection the server's accept callback refuses (returns no observer):
// the connect fails UNAVAILABLE with the server's reason, carried in the
// rdma_cm reject, and the server serves the next client.
TEST(RdmaTransport, ConnectionTheServerRefusesSaysWhy) {
  Fixture fx;
  fx.server_observer = nullptr;
  ASSERT_TRUE(fx.Start());
  Waiter& refused_waiter = fx.NewWaiter();
  auto refused = fx.Connect(&refused_waiter);
  ASSERT_FALSE(refused.ok()) << "connected although the server refused";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find(
                "the server refused the connection: its accept callback refused it"),
            absl::string_view::npos)
      << refused.status();
  {
    std::lock_guard<std::mutex> lock(fx.accepted_mu);
    fx.server_observer = &fx.echo;
  }
  ExpectServesANewClient(fx);
}

// CmIdsOfThisProcess once it is back to `before`, or after 20 s: ids given
// up are destroyed soon after, on the CM thread.
int CmIdsOnceBackTo(int before) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  int ids = CmIdsOfThisProcess();
  while (ids != before && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
    ids = CmIdsOfThisProcess();
  }
  return ids;
}

// A connect whose deadline passes first ends DEADLINE_EXCEEDED naming its
// target, at whatever step it was (resolving, connecting, established), and
// leaves nothing behind: its rdma_cm id is destroyed, a connection the
// server accepted for it closes, and the transport connects as usual after.
TEST(RdmaTransport, ConnectsAbandonedAtTheirDeadlineLeaveNothingBehind) {
  std::vector<std::unique_ptr<Waiter>> connected;  // outlive the client, which calls them
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  const int ids_before = CmIdsOfThisProcess();
  ASSERT_GT(ids_before, 0) << "`rdma resource show cm_id` does not list this process's listener";
  const uint64_t opened = Counters().connections_opened;
  const uint64_t closed = Counters().connections_closed;
  int timed_out = 0;
  for (int i = 0; i < 60; ++i) {
    // A failed connect's observer is destroyed when Connect returns, as a
    // caller may: a later call into it is a use after free (ASan round).
    auto observer = std::make_unique<Waiter>();
    auto conn =
        fx.client->Connect(fx.addr, observer.get(), absl::Now() + absl::Microseconds(200 * i));
    if (conn.ok()) {
      (*conn)->Close();
      connected.push_back(std::move(observer));
      continue;
    }
    ++timed_out;
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kDeadlineExceeded) << conn.status();
    EXPECT_NE(conn.status().message().find("connecting to " + fx.addr.ToString() + " timed out"),
              absl::string_view::npos)
        << conn.status();
  }
  EXPECT_GT(timed_out, 0) << "no connect ran past its deadline";
  EXPECT_TRUE(EveryConnectionClosedSince(opened, closed))
      << "connections opened for abandoned connects stayed open";
  const int ids = CmIdsOnceBackTo(ids_before);
  printf("%d of 60 connects timed out; rdma_cm ids %d before, %d after; %llu connections opened\n",
         timed_out, ids_before, ids,
         static_cast<unsigned long long>(Counters().connections_opened - opened));
  EXPECT_EQ(ids, ids_before) << "rdma_cm ids of abandoned connects were left behind";
  ExpectServesANewClient(fx);
}

// A connect whose queue pair cannot be created (rdma_create_qp failing:
// ENOMEM, a device out of QPs) fails UNAVAILABLE naming the call, the device
// and the target, leaves no rdma_cm id behind, and the next connect works.
TEST(RdmaTransport, ConnectWhoseQueuePairCannotBeCreatedFailsCleanly) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  const int ids_before = CmIdsOfThisProcess();
  ASSERT_GT(ids_before, 0) << "`rdma resource show cm_id` does not list this process's listener";
  const uint64_t opened = Counters().connections_opened;
  const uint64_t closed = Counters().connections_closed;
  FaultInjection::FailQpCreations() = 1;  // the client's: it creates its QP before connecting
  auto observer = std::make_unique<Waiter>();
  auto conn = fx.Connect(observer.get());
  observer.reset();  // as a caller may once Connect has failed
  ASSERT_FALSE(conn.ok()) << "connected without a queue pair";
  EXPECT_EQ(FaultInjection::FailQpCreations().exchange(0), 0);
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable) << conn.status();
  EXPECT_NE(conn.status().message().find(absl::StrCat("rdma_create_qp on ")),
            absl::string_view::npos)
      << conn.status();
  EXPECT_NE(conn.status().message().find(
                absl::StrCat(" for ", fx.addr.ToString(), ": ", strerror(ENOMEM))),
            absl::string_view::npos)
      << conn.status();
  EXPECT_TRUE(EveryConnectionClosedSince(opened, closed));
  EXPECT_EQ(CmIdsOnceBackTo(ids_before), ids_before)
      << "the failed connect's rdma_cm id was left behind";
  ExpectServesANewClient(fx);
}

// A connection the server fails to accept (rdma_accept failing) is rejected
// with the reason, so the connect fails at once rather than at its deadline;
// both ends' connections close, and the server serves the next client.
TEST(RdmaTransport, ConnectionTheServerFailsToAcceptIsRejectedSayingWhy) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  const uint64_t opened = Counters().connections_opened;
  const uint64_t closed = Counters().connections_closed;
  FaultInjection::FailAccepts() = 1;
  Waiter& waiter = fx.NewWaiter();
  const absl::Time start = absl::Now();
  auto conn = fx.client->Connect(fx.addr, &waiter, start + absl::Seconds(60));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(FaultInjection::FailAccepts().exchange(0), 0);
  ASSERT_FALSE(conn.ok()) << "connected although the server's accept failed";
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable) << conn.status();
  EXPECT_NE(conn.status().message().find(
                absl::StrCat("the server refused the connection: rdma_accept: ", strerror(ENOMEM))),
            absl::string_view::npos)
      << conn.status();
  EXPECT_LT(took, absl::Seconds(10)) << "the client waited for its connect timeout";
  EXPECT_TRUE(EveryConnectionClosedSince(opened, closed));
  ExpectServesANewClient(fx);
}

// A transport shut down while its connects are at every step (resolving,
// connecting, established) ends each of them, OK or UNAVAILABLE (or refused
// as shut down when it came too late), crashes nothing, and the server
// serves the next client.
TEST(RdmaTransport, ShutdownWhileConnectingEndsEveryConnect) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  const uint64_t opened = Counters().connections_opened;
  const uint64_t closed = Counters().connections_closed;
  for (int round = 0; round < 12; ++round) {
    std::mutex connected_mu;
    std::vector<std::unique_ptr<Waiter>> connected;  // outlive the transport, which calls them
    TransportOptions co;
    co.name = "shutdown-client";
    RdmaTransport client(co, RdmaOptions(), false);
    std::vector<std::future<absl::Status>> connects;
    for (int i = 0; i < 4; ++i) {
      connects.push_back(std::async(std::launch::async, [&] {
        // Destroyed when its connect fails, as a caller may (see the
        // abandoned connects' test).
        auto observer = std::make_unique<Waiter>();
        auto c = client.Connect(fx.addr, observer.get(), absl::Now() + absl::Seconds(30));
        if (!c.ok()) return c.status();
        std::lock_guard<std::mutex> lock(connected_mu);
        connected.push_back(std::move(observer));
        return absl::OkStatus();
      }));
    }
    absl::SleepFor(absl::Microseconds(400 * round));
    client.Shutdown();
    for (auto& f : connects) {
      ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready)
          << "round " << round << ": a connect outlived its transport's shutdown";
      const absl::Status s = f.get();
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable ||
                  s.code() == absl::StatusCode::kFailedPrecondition)
          << "round " << round << ": " << s;
    }
  }
  EXPECT_TRUE(EveryConnectionClosedSince(opened, closed))
      << "connections of shut-down clients stayed open on the server";
  ExpectServesANewClient(fx);
}

// A detached observer (a connect given up: its caller may destroy it) hears
// nothing more: frames that arrive, by SEND or READ, are dropped, and the
// connection's end is not reported.
// TSan cannot see the device, so what a thread wrote before it sent happens
// before the receiving side's observer only through sanitizer_sync.h's
// edges. Plain memory (not atomic, no lock) is written before each send and
// read after each receipt, on both sides, for a small frame and for a payload
// the server fetches by READ: under TSan a missing edge is a reported race;
// in every build the values read are the ones written.
TEST(RdmaTransport, WhatASenderWroteIsVisibleToItsReceiver) {
  struct Relay : ConnectionObserver {
    const int* client_wrote = nullptr;
    int* server_wrote = nullptr;
    int seen = 0;
    void OnMessage(Connection& conn, InboundMessage&& msg) override {
      if (msg.header.kind != MessageKind::kRequest) return;
      seen = *client_wrote;
      *server_wrote = seen + 1;
      OutboundMessage r;
      r.header.kind = MessageKind::kResponse;
      r.header.call_id = msg.header.call_id;
      conn.Send(std::move(r)).IgnoreError();
    }
    void OnClosed(Connection&, const absl::Status&) override {}
  };
  int client_wrote = 0;
  int server_wrote = 0;
  Relay relay;
  relay.client_wrote = &client_wrote;
  relay.server_wrote = &server_wrote;
  Fixture fx;
  fx.server_observer = &relay;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  const size_t by_read = RdmaOptions().slot_size + 1;
  const uint64_t reads_before = Counters().reads;
  for (uint64_t id = 1; id <= 6; ++id) {
    client_wrote = static_cast<int>(100 * id);
    auto r = Call(*conn, waiter, id, Filled(*conn, id % 2 ? 64 : by_read, id));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(server_wrote, client_wrote + 1) << "call " << id;
  }
  EXPECT_EQ(relay.seen, 600);
  EXPECT_EQ(Counters().reads - reads_before, 3u) << "the even calls' payloads go by READ";
  conn->Close();
}

TEST(RdmaTransport, DetachedObserverHearsNothingMore) {
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
  ASSERT_TRUE(conn);
  ASSERT_TRUE(Call(*conn, waiter, 1, Filled(*conn, 100, 1)).ok());
  std::shared_ptr<Connection> accepted = fx.LastAccepted();
  ASSERT_TRUE(accepted);
  auto* server_side = dynamic_cast<RdmaConnection*>(accepted.get());
  ASSERT_NE(server_side, nullptr);
  server_side->DetachObserver();
  const int requests = fx.echo.requests.load();
  const uint64_t opened = Counters().connections_opened;
  const uint64_t closed = Counters().connections_closed;
  const uint64_t bytes_read = Counters().bytes_read;
  constexpr size_t kLarge = 1u << 20;  // by READ
  auto small_answer = waiter.Expect(2);
  auto large_answer = waiter.Expect(3);
  ASSERT_TRUE(conn->Send(Request(2, Filled(*conn, 100, 2))).ok());
  ASSERT_TRUE(conn->Send(Request(3, Filled(*conn, kLarge, 3))).ok());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (Counters().bytes_read - bytes_read < kLarge && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(Counters().bytes_read - bytes_read, kLarge) << "the server never READ the request";
  // The poller calls the observer right after counting the bytes, if at all.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(fx.echo.requests.load(), requests) << "a detached observer was given a request";
  EXPECT_EQ(small_answer.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  EXPECT_EQ(large_answer.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  conn->Close();
  ASSERT_TRUE(EveryConnectionClosedSince(opened - 2, closed))  // both its ends
      << "the connection stayed open";
  {
    std::lock_guard<std::mutex> lock(fx.echo.mu);
    EXPECT_TRUE(fx.echo.closed.empty()) << "a detached observer was told the connection closed";
  }
  ExpectServesANewClient(fx);
}

// A listener destroyed after its transport has shut down (its CM thread
// gone) gives its rdma_cm id back at once instead of waiting for a thread
// that will never run again; the transport refuses to connect.
TEST(RdmaTransport, ListenerDestroyedAfterItsTransportShutDownGoesCleanly) {
  Fixture fx;  // its listener keeps `rdma resource show cm_id` answering
  ASSERT_TRUE(fx.Start());
  const int ids_before = CmIdsOfThisProcess();
  ASSERT_GT(ids_before, 0) << "`rdma resource show cm_id` does not list this process's listener";
  TransportOptions so;
  so.name = "late-listener";
  so.listening = true;
  RdmaTransport server(so, RdmaOptions(), true);
  auto listener = server.Listen(*ParseAddress("rdma://" + fx.ip + ":0"),
                                [](std::shared_ptr<Connection>) { return nullptr; });
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(CmIdsOfThisProcess(), ids_before + 1);
  server.Shutdown();
  auto gone = std::async(std::launch::async, [&] { listener->reset(); });
  ASSERT_EQ(gone.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "destroying the listener waited for the CM thread";
  EXPECT_EQ(CmIdsOnceBackTo(ids_before), ids_before) << "the listener's rdma_cm id was left behind";
  auto late = server.Connect(fx.addr, &fx.NewWaiter(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
}

// A client process that advertises a large request and is killed while the
// server READs it. The server drops that call and keeps serving.
TEST(RdmaTransport, ClientKilledMidReadLeavesServerServing) {
  Fixture fx;
  ASSERT_TRUE(fx.Start());
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  const std::string target =
      absl::StrCat("RDMARPC_DOOMED_CLIENT_TARGET=", fx.ip, ":", fx.addr.port);
  std::vector<std::string> env_store = {target};
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  envp.push_back(env_store[0].data());
  envp.push_back(nullptr);
  char self[] = "/proc/self/exe";
  char* argv[] = {self, nullptr};
  pid_t pid;
  ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", &fa, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  char buf[16] = {};
  ASSERT_GT(read(out[0], buf, sizeof buf - 1), 0) << "the doomed client never sent";
  const uint64_t reads_before = Counters().reads;
  // Let the server get into its READ, then kill the client.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (Counters().reads == reads_before && absl::Now() < until) {
    absl::SleepFor(absl::Microseconds(200));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  close(out[0]);
  printf("doomed client killed after %llu READ(s) were posted\n",
         static_cast<unsigned long long>(Counters().reads - reads_before));
  // Its connection ends on the server...
  const absl::Time closed_by = absl::Now() + absl::Seconds(60);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(fx.echo.mu);
      if (!fx.echo.closed.empty()) break;
    }
    ASSERT_LT(absl::Now(), closed_by) << "the server never noticed the dead client";
    absl::SleepFor(absl::Milliseconds(10));
  }
  // ...and the server still serves others, large payloads included.
  ExpectServesANewClient(fx, 1 << 20);
}

int DoomedClient(const std::string& target) {
  TransportOptions o;
  o.name = "doomed-client";
  Waiter w;  // outlives the transport
  RdmaTransport t(o, RdmaOptions(), false);
  auto c = t.Connect(*ParseAddress("rdma://" + target), &w, absl::Now() + absl::Seconds(30));
  if (!c.ok()) return 2;
  if (!(*c)->Send(Request(1, Filled(**c, 32u << 20, 1))).ok()) return 3;
  (void)!write(1, "sent\n", 5);
  pause();  // until killed
  return 0;
}

}  // namespace
}  // namespace rdmarpc::transport::rdma

int main(int argc, char** argv) {
  if (const char* target = getenv("RDMARPC_DOOMED_CLIENT_TARGET")) {
    return rdmarpc::transport::rdma::DoomedClient(target);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
