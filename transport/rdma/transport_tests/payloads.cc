// How payloads travel: sizes around every threshold (inline, in a SEND,
// by READ), frames written in place, small payload blocks and their
// fallbacks, buffers the runtime holds past its transport, and what a
// sender wrote reaching its receiver whole.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
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

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
