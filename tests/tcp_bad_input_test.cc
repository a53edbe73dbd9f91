// Hostile and broken clients over raw TCP: the server answers or drops the bad
// call (or closes that one connection when framing is lost) and keeps serving
// everyone else.
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/cpu_time.h"
#include "gtest/gtest.h"
#include "tests/echo_service.h"
#include "tests/raw_connection.h"
#include "transport/tcp/tcp_counters.h"
#include "transport/transport.h"
#include "transport/wire_format.h"

namespace rdmarpc::testing {
namespace {

using transport::EncodeHeader;
using transport::Header;
using transport::MessageKind;

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<TestServer>("tcp://127.0.0.1:0", /*max_message=*/1 << 20);
    ASSERT_TRUE(server_->server);
    port_ = std::stoi(server_->address.substr(server_->address.rfind(':') + 1));
    auto ch = Channel::Create(server_->address);
    ASSERT_TRUE(ch.ok());
    good_ = *ch;
    ExpectGoodClientServed();
  }
  void ExpectGoodClientServed() {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(10));
    EchoResponse resp;
    Status s = good_->Call(kEcho, &ctx, Req("good"), &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), "good");
  }
  static EchoRequest Req(const std::string& d) {
    EchoRequest r;
    r.set_data(d);
    return r;
  }

  std::unique_ptr<TestServer> server_;
  std::shared_ptr<Channel> good_;
  int port_ = 0;
};

TEST_F(BadInputTest, GarbageInsteadOfAHeaderClosesOnlyThatConnection) {
  const transport::tcp::TcpCounters before = transport::tcp::Counters();
  RawClient bad(port_);
  bad.SendBytes(std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n") + std::string(64, 'z'));
  EXPECT_TRUE(bad.ClosedByPeer());
  ExpectGoodClientServed();
  const transport::tcp::TcpCounters after = transport::tcp::Counters();
  EXPECT_EQ(after.malformed_frames - before.malformed_frames, 1u);
  EXPECT_EQ(after.connections_closed - before.connections_closed, 1u);
}

TEST_F(BadInputTest, LyingLengthBeyondTheWireLimitClosesTheConnection) {
  RawClient bad(port_);
  bad.SendFrame(Request(1, kEcho.id), "", "abc", transport::kMaxPayloadBytes + 1u);
  EXPECT_TRUE(bad.ClosedByPeer());
  ExpectGoodClientServed();
}

TEST_F(BadInputTest, AttachmentLongerThanThePayloadClosesTheConnection) {
  RawClient bad(port_);
  Header h = Request(1, kEcho.id);
  h.attachment_len = 100;
  bad.SendFrame(h, "", std::string(99, 'a'));
  EXPECT_TRUE(bad.ClosedByPeer());
  ExpectGoodClientServed();
}

// The layout as a peer written from wire_format.h alone would send it: the
// attachment's bytes first, then the message.
TEST_F(BadInputTest, AttachmentComesFirstInThePayloadBothWays) {
  RawClient raw(port_);
  Header h = Request(7, kEcho.id);
  const std::string att = "raw attachment bytes";
  h.attachment_len = static_cast<uint32_t>(att.size());
  raw.SendFrame(h, "", att + EchoBytes("the message"));
  auto f = raw.ReadFrame();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->header.call_id, 7u);
  EXPECT_EQ(f->header.status, 0);
  ASSERT_EQ(f->header.attachment_len, att.size());
  EXPECT_EQ(f->payload.substr(0, att.size()), att);
  EchoResponse resp;
  ASSERT_TRUE(resp.ParseFromString(f->payload.substr(att.size())));
  EXPECT_EQ(resp.data(), "the message");
  EXPECT_EQ(resp.attachment_size(), static_cast<int64_t>(att.size()));
}

TEST_F(BadInputTest, TruncatedFrameThenDisconnect) {
  RawClient* bad = new RawClient(port_);
  bad->SendFrame(Request(1, kEcho.id), "", "only a few", 5000);
  delete bad;  // vanishes mid-frame
  RawClient half(port_);
  half.SendBytes(std::string(10, '\x52'));  // half a header, then gone
  ExpectGoodClientServed();
}

TEST_F(BadInputTest, UnknownMethodIdIsAnsweredUnimplemented) {
  RawClient bad(port_);
  bad.SendFrame(Request(7, 0x12345678), "", EchoBytes("x"));
  auto r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.kind, MessageKind::kResponse);
  EXPECT_EQ(r->header.call_id, 7u);
  EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kUnimplemented));
  EXPECT_NE(r->payload.find("0x12345678"), std::string::npos) << r->payload;
  ExpectGoodClientServed();
}

TEST_F(BadInputTest, UnparsableRequestAndMetadataAreInvalidArgument) {
  RawClient bad(port_);
  bad.SendFrame(Request(1, kEcho.id), "", std::string("\xff\xff\xff\xff\xff", 5));
  auto r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kInvalidArgument)) << r->payload;
  // Metadata whose entry claims more bytes than the block holds.
  bad.SendFrame(Request(2, kEcho.id), std::string("\x03\x00\xff\x00\x00\x00key", 9),
                EchoBytes("x"));
  r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.call_id, 2u);
  EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kInvalidArgument)) << r->payload;
  // The same connection still works.
  bad.SendFrame(Request(3, kEcho.id), "", EchoBytes("fine"));
  r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.status, 0);
  ExpectGoodClientServed();
}

TEST_F(BadInputTest, OversizePayloadIsSkippedAndAnsweredResourceExhausted) {
  const transport::tcp::TcpCounters before = transport::tcp::Counters();
  RawClient bad(port_);
  const std::string big(2 << 20, 'q');  // server limit is 1 MiB
  bad.SendFrame(Request(1, kEcho.id), "", big);
  auto r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kResourceExhausted));
  EXPECT_NE(r->payload.find("1048576"), std::string::npos) << r->payload;
  EXPECT_EQ(transport::tcp::Counters().receive_refusals - before.receive_refusals, 1u);
  bad.SendFrame(Request(2, kEcho.id), "", EchoBytes("next"));
  r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.call_id, 2u);
  EXPECT_EQ(r->header.status, 0);
}

TEST_F(BadInputTest, ResponsesAndCancelsForUnknownCallsAreIgnored) {
  RawClient bad(port_);
  Header h = Request(9, kEcho.id);
  h.kind = MessageKind::kResponse;
  bad.SendFrame(h, "", "nonsense");
  h.kind = MessageKind::kCancel;
  bad.SendFrame(h, "", "");
  // An acknowledgment of a GOAWAY the server never sent: the server still
  // serves this connection's calls.
  h.kind = MessageKind::kGoAway;
  bad.SendFrame(h, "", "");
  bad.SendFrame(Request(10, kEcho.id), "", EchoBytes("ok"));
  auto r = bad.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.call_id, 10u);
  EXPECT_EQ(r->header.status, 0);
}

// A TCP peer has no memory to READ from, so a frame that advertises one has
// lost the framing (its payload is not on the stream): that connection ends.
TEST_F(BadInputTest, RemotePayloadOverTcpClosesTheConnection) {
  RawClient bad(port_);
  Header h = Request(1, kEcho.id);
  h.flags = transport::kFlagRemotePayload;
  h.remote = {0x7f0000001000ull, 0x1234, 1};
  h.metadata_len = 0;
  h.payload_len = 4096;
  std::string frame(transport::kHeaderSize, '\0');
  EncodeHeader(h, frame.data());
  bad.SendBytes(frame);
  EXPECT_TRUE(bad.ClosedByPeer());
  ExpectGoodClientServed();
}

// Credit and release frames are RDMA bookkeeping; over TCP they are ignored
// and the connection goes on.
TEST_F(BadInputTest, CreditAndReleaseFramesAreIgnoredOverTcp) {
  RawClient raw(port_);
  Header h = Request(0, 0);
  h.kind = MessageKind::kCredit;
  h.credits = 1000;
  raw.SendFrame(h, "", "");
  h.kind = MessageKind::kRelease;
  h.credits = 0;
  h.remote.token = 42;
  raw.SendFrame(h, "", "");
  raw.SendFrame(Request(5, kEcho.id), "", EchoBytes("still here"));
  auto r = raw.ReadFrame();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->header.call_id, 5u);
  EXPECT_EQ(r->header.status, 0);
  EchoResponse resp;
  ASSERT_TRUE(resp.ParseFromString(r->payload));
  EXPECT_EQ(resp.data(), "still here");
}

// A call id may be reused once its call has ended, not while the call runs:
// the second request is dropped without running, whether handlers run on
// workers or inline (where a call is tracked only once its handler has
// returned without finishing it, see server.cc).
TEST_F(BadInputTest, CallIdReusedWhileItsCallRunsIsDropped) {
  for (int workers : {4, 0}) {
    SCOPED_TRACE(workers == 0 ? "inline handlers" : "workers");
    TestServer ts("tcp://127.0.0.1:0", /*max_message=*/1 << 20, workers);
    ASSERT_TRUE(ts.server);
    RawClient raw(std::stoi(ts.address.substr(ts.address.rfind(':') + 1)));
    EchoRequest slow;
    slow.set_data("first");
    slow.set_sleep_ms(2000);
    raw.SendFrame(Request(7, kEchoLater.id), "", slow.SerializeAsString());
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (ts.service.started.load() == 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    ASSERT_EQ(ts.service.started.load(), 1);
    raw.SendFrame(Request(7, kEcho.id), "", EchoBytes("second"));
    raw.SendFrame(Request(8, kEcho.id), "", EchoBytes("third"));
    // Had the second run, its answer would have come at once, long before
    // the first's: the connection answers in order of completion.
    auto r = raw.ReadFrame();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->header.call_id, 8u);
    r = raw.ReadFrame();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->header.call_id, 7u);
    EXPECT_EQ(r->header.status, 0);
    EchoResponse resp;
    ASSERT_TRUE(resp.ParseFromString(r->payload));
    EXPECT_EQ(resp.data(), "first");
    EXPECT_EQ(ts.service.started.load(), 2) << "the reused id ran";
  }
  ExpectGoodClientServed();
}

TEST_F(BadInputTest, ManyHostileClientsWhileAGoodOneWorks) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> hostile;
  for (int t = 0; t < 4; ++t) {
    hostile.emplace_back([&, t] {
      for (int i = 0; i < 50 && !stop.load(); ++i) {
        RawClient bad(port_);
        std::string junk(64 + (i * 37 + t) % 300, '\0');
        for (size_t k = 0; k < junk.size(); ++k) junk[k] = static_cast<char>((k * 131 + i) & 0xff);
        if (i % 3 == 0) EncodeHeader(Request(i, kEcho.id), junk.data());  // valid header, junk body
        bad.SendBytes(junk);
      }
    });
  }
  for (int i = 0; i < 200; ++i) ExpectGoodClientServed();
  stop = true;
  for (auto& t : hostile) t.join();
  ExpectGoodClientServed();
}

// A server of parked calls, spoken to over raw TCP.
class ServerDeadline : public ::testing::Test {
 protected:
  void SetUp() override {
    auto built = ServerBuilder()
                     .AddListeningPort("tcp://127.0.0.1:0")
                     .RegisterService(&park)
                     .BuildAndStart();
    ASSERT_TRUE(built.ok()) << built.status();
    server_ = std::move(*built);
    const std::string& address = server_->addresses()[0];
    port_ = std::stoi(address.substr(address.rfind(':') + 1));
  }

  ParkService park;
  std::unique_ptr<Server> server_;
  int port_ = 0;
};

// A client that never cancels (one that hangs, or a peer that does not
// implement cancels) still has its parked call cancelled at the deadline it
// sent: the server's own timer runs the OnCancel callback, the handler
// finishes, and the answer is DEADLINE_EXCEEDED.
TEST_F(ServerDeadline, ParkedCallsOfAClientThatNeverCancelsEndAtTheirDeadline) {
  RawClient raw(port_);
  const absl::Time sent = absl::Now();
  Header h = Request(9, ParkService::kPark.id);
  h.timeout_us = 300000;
  raw.SendFrame(h, "", EchoBytes("parked"));
  auto r = raw.ReadFrame();
  ASSERT_TRUE(r) << "no answer: the parked call outlived its deadline";
  const absl::Duration took = absl::Now() - sent;
  EXPECT_EQ(r->header.call_id, 9u);
  EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kDeadlineExceeded));
  EXPECT_EQ(park.cancels.load(), 1);
  EXPECT_GE(took, absl::Milliseconds(300));
  // Released just after its answer went out.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (server_->stats().calls_in_flight > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(server_->stats().calls_in_flight, 0u);
}

// timeout_us is a u64, and no deadline the server can hold is that long: from
// 2^63 microseconds up it reads as the longest one it can, not as one long
// past. Nor may a timeout centuries out keep the server's timer thread
// spinning while the call waits.
TEST_F(ServerDeadline, TimeoutsPastWhatTheServerCanHoldAreFarOffNotPast) {
  RawClient raw(port_);
  uint64_t id = 0;
  for (const uint64_t timeout_us : {~uint64_t{0}, uint64_t{1} << 63, uint64_t{1} << 62}) {
    Header h = Request(++id, ParkService::kPark.id);
    h.timeout_us = timeout_us;
    raw.SendFrame(h, "", EchoBytes("parked"));
  }
  ASSERT_FALSE(raw.Readable(300)) << "a call with a timeout of centuries was answered at once";
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (park.handlers_started.load() < 3 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(park.handlers_started.load(), 3);
  const absl::Duration cpu_before = ProcessCpuTime();
  EXPECT_FALSE(raw.Readable(500)) << "a parked call was answered";
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_LT(cpu, absl::Milliseconds(250)) << "the server spun for " << cpu << " in 500 ms";
  EXPECT_EQ(park.cancels.load(), 0);
}

// A grace of centuries (meant as "until the calls end") waits, asleep, for
// the calls, and ends when they do.
TEST_F(ServerDeadline, AShutdownGraceOfCenturiesWaitsAsleepForTheCalls) {
  auto raw = std::make_unique<RawClient>(port_);
  raw->SendFrame(Request(1, ParkService::kPark.id), "", EchoBytes("parked"));
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (park.handlers_started.load() < 1 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(park.handlers_started.load(), 1);
  auto shut =
      std::async(std::launch::async, [this] { server_->Shutdown(absl::Hours(24 * 365 * 300)); });
  // Past the first second, which waits for acknowledgments of the GOAWAY.
  absl::SleepFor(absl::Milliseconds(1200));
  const absl::Duration cpu_before = ProcessCpuTime();
  EXPECT_EQ(shut.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout)
      << "Shutdown returned with a call parked";
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_LT(cpu, absl::Milliseconds(250)) << "Shutdown spun for " << cpu << " in 500 ms";
  EXPECT_EQ(park.cancels.load(), 0) << "the grace ended at once";
  raw.reset();  // the call is cancelled with its connection, and ends
  EXPECT_EQ(shut.wait_for(std::chrono::seconds(20)), std::future_status::ready);
}

// Shutdown's GOAWAY and a request cross on the wire: the server cannot tell
// a request the client sent before it saw the GOAWAY from one sent after,
// until the client acknowledges it. So it serves every request that comes
// before the acknowledgment and refuses those after, and it returns once
// acknowledged and drained, not at the end of its grace.
TEST(ServerShutdown, ServesRequestsThatComeBeforeTheGoAwayIsAcknowledged) {
  ParkService park;
  EchoService echo;
  auto built = ServerBuilder()
                   .AddListeningPort("tcp://127.0.0.1:0")
                   .RegisterService(&park)
                   .RegisterService(&echo)
                   .BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  const std::string& address = (*built)->addresses()[0];
  RawClient raw(std::stoi(address.substr(address.rfind(':') + 1)));
  // Held until FinishHeld, so that Shutdown waits for it and the connection
  // stays open through what follows.
  EchoRequest held;
  held.set_data("held");
  held.set_tag(3);
  raw.SendFrame(Request(1, ParkService::kPark.id), "", held.SerializeAsString());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (park.parked_calls.load() < 1 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(park.parked_calls.load(), 1);

  absl::Time returned;
  std::thread shutdown([&] {
    (*built)->Shutdown(absl::Seconds(60));
    returned = absl::Now();
  });
  auto go_away = raw.ReadFrame();
  ASSERT_TRUE(go_away);
  EXPECT_EQ(go_away->header.kind, MessageKind::kGoAway);

  raw.SendFrame(Request(2, kEcho.id), "", EchoBytes("before the acknowledgment"));
  auto served = raw.ReadFrame();
  ASSERT_TRUE(served);
  EXPECT_EQ(served->header.call_id, 2u);
  EXPECT_EQ(served->header.status, 0) << served->payload;
  EchoResponse resp;
  ASSERT_TRUE(resp.ParseFromString(served->payload));
  EXPECT_EQ(resp.data(), "before the acknowledgment");

  Header ack;
  ack.kind = MessageKind::kGoAway;
  raw.SendFrame(ack, "", "");
  raw.SendFrame(Request(3, kEcho.id), "", EchoBytes("after the acknowledgment"));
  auto refused = raw.ReadFrame();
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->header.call_id, 3u);
  EXPECT_EQ(refused->header.status, static_cast<uint16_t>(StatusCode::kUnavailable));
  EXPECT_EQ(refused->payload, "server is shutting down");
  EXPECT_EQ(echo.started.load(), 1);

  const absl::Time finished = absl::Now();
  park.FinishHeld();
  auto held_answer = raw.ReadFrame();
  ASSERT_TRUE(held_answer);
  EXPECT_EQ(held_answer->header.call_id, 1u);
  EXPECT_EQ(held_answer->header.status, 0);
  shutdown.join();
  EXPECT_GE(returned, finished);
  EXPECT_LT(returned - finished, absl::Seconds(30)) << "Shutdown waited out its grace";
}

// A client that has sent calls acknowledges the GOAWAY, but a loaded one may
// take longer than the second Shutdown gives a silent peer: the server waits
// for it within its grace and serves what it sends first, rather than close
// the connection under calls on their way. A peer that sent no call holds
// Shutdown no more than that second.
TEST(ServerShutdown, WaitsWithinItsGraceForASlowAcknowledgmentFromAClientThatSentCalls) {
  EchoService echo;
  auto built =
      ServerBuilder().AddListeningPort("tcp://127.0.0.1:0").RegisterService(&echo).BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  const std::string& address = (*built)->addresses()[0];
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  RawClient silent(port);
  RawClient slow(port);
  slow.SendFrame(Request(1, kEcho.id), "", EchoBytes("before the restart"));
  auto first = slow.ReadFrame();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->header.status, 0) << first->payload;

  absl::Time returned;
  std::thread shutdown([&] {
    (*built)->Shutdown(absl::Seconds(60));
    returned = absl::Now();
  });
  auto go_away = slow.ReadFrame();
  ASSERT_TRUE(go_away);
  EXPECT_EQ(go_away->header.kind, MessageKind::kGoAway);
  absl::SleepFor(absl::Milliseconds(1500));  // past the second a silent peer gets
  slow.SendFrame(Request(2, kEcho.id), "", EchoBytes("sent before the acknowledgment"));
  auto served = slow.ReadFrame();
  ASSERT_TRUE(served) << "the connection closed under a call sent before the acknowledgment";
  EXPECT_EQ(served->header.call_id, 2u);
  EXPECT_EQ(served->header.status, 0) << served->payload;

  Header ack;
  ack.kind = MessageKind::kGoAway;
  const absl::Time acked = absl::Now();
  slow.SendFrame(ack, "", "");
  shutdown.join();
  EXPECT_LT(returned - acked, absl::Seconds(10))
      << "Shutdown waited out its grace for the peer that sent no call";
  EXPECT_EQ(echo.started.load(), 2);
}

// A client that stops reading while a 32 MiB answer is on its way: the
// server's send queue (bound: 1 MiB) is full, so the answers after it are
// refused, and each such call is still answered, with the error naming the
// bound, which goes past the bound (transport::kQueuedErrorHeadroom).
class ClientThatStopsReading : public ::testing::Test {
 protected:
  void SetUp() override {
    transport::TransportTunables tunables;
    tunables.tcp.max_queued_send_bytes = 1 << 20;
    server_ = std::make_unique<TestServer>("tcp://127.0.0.1:0", 64u << 20, 4, tunables);
    ASSERT_TRUE(server_->server);
    port_ = std::stoi(server_->address.substr(server_->address.rfind(':') + 1));
  }
  // Asks for the 32 MiB answer, and returns once its first bytes came: it
  // is in the server's queue, far past the bound, until `raw` reads.
  static void StartTheLargeAnswer(RawClient& raw) {
    EchoRequest large;
    large.set_response_size(32 << 20);
    raw.SendFrame(Request(1, kEcho.id), "", large.SerializeAsString());
    ASSERT_TRUE(raw.Readable(10000)) << "the large answer did not start";
  }
  static void ExpectTheLargeAnswer(RawClient& raw) {
    auto f = raw.ReadFrame();
    ASSERT_TRUE(f);
    EXPECT_EQ(f->header.call_id, 1u);
    EXPECT_EQ(f->header.status, 0) << f->payload.substr(0, 200);
    EXPECT_GT(f->payload.size(), size_t{32} << 20);
  }
  static void ExpectRefusedNamingTheBound(const RawConnection::Frame& f) {
    EXPECT_EQ(f.header.kind, MessageKind::kResponse);
    EXPECT_EQ(f.header.status, static_cast<uint16_t>(StatusCode::kResourceExhausted)) << f.payload;
    EXPECT_NE(f.payload.find("TcpOptions::max_queued_send_bytes"), std::string::npos) << f.payload;
  }
  void ExpectOthersServed() {
    auto ch = Channel::Create(server_->address);
    ASSERT_TRUE(ch.ok()) << ch.status();
    EXPECT_TRUE(EchoOn(**ch, "another client").ok());
  }

  std::unique_ptr<TestServer> server_;
  int port_ = 0;
};

TEST_F(ClientThatStopsReading, ACallWhoseAnswerTheQueueRefusesGetsTheError) {
  RawClient raw(port_);
  StartTheLargeAnswer(raw);
  raw.SendFrame(Request(2, kEcho.id), "", EchoBytes("small"));
  // Answered before anything is read: reading drains the queue.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((server_->service.started.load() < 2 || server_->server->stats().calls_in_flight > 0) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ExpectTheLargeAnswer(raw);
  auto refused = raw.ReadFrame();
  ASSERT_TRUE(refused) << "the call whose answer the queue refused got no answer at all";
  EXPECT_EQ(refused->header.call_id, 2u);
  ExpectRefusedNamingTheBound(*refused);
  raw.SendFrame(Request(3, kEcho.id), "", EchoBytes("read again"));
  auto next = raw.ReadFrame();
  ASSERT_TRUE(next);
  EXPECT_EQ(next->header.call_id, 3u);
  EXPECT_EQ(next->header.status, 0) << next->payload;
  ExpectOthersServed();
}

// More refused calls than even their errors have room for: the server
// closes the connection, and what it had queued goes with it (the large
// answer too), rather than leave calls it cannot answer pending; the client's
// calls then end UNAVAILABLE.
TEST_F(ClientThatStopsReading, ErrorsPastTheirHeadroomCloseTheConnection) {
  RawClient raw(port_);
  StartTheLargeAnswer(raw);
  // Calls, in batches and reading nothing, until the server closes: each
  // error is more than a header, so the first `enough` cannot all have room.
  const size_t enough = transport::kQueuedErrorHeadroom / transport::kHeaderSize + 100;
  const std::string payload = EchoBytes("small");
  size_t calls = 0;
  bool closed = false;
  while (!closed && calls < 4 * enough) {
    std::string batch;
    for (int i = 0; i < 1000; ++i) {
      std::string frame(transport::kHeaderSize, '\0');
      Header h = Request(2 + calls++, kEcho.id);
      h.payload_len = static_cast<uint32_t>(payload.size());
      transport::EncodeHeader(h, frame.data());
      batch += frame + payload;
    }
    closed = !raw.SendBytesUnlessClosed(batch);
  }
  // The socket buffers can take all of them before the server has read the
  // `enough` that make it close (a slow server: a sanitizer's, a busy
  // machine's): wait for it, unread, since reading would make room.
  closed = closed || raw.HungUpUnread(20000);
  ASSERT_TRUE(closed) << calls << " calls the server could not answer, and it did not close";
  const std::optional<size_t> got = raw.ReadUntilClosed();
  ASSERT_TRUE(got) << "the server's end closed, and reading it did not end";
  EXPECT_LT(*got, size_t{32} << 20) << "the queue was sent, not dropped with the connection";
  printf("%zu bytes came before the server closed the connection\n", *got);
  ExpectOthersServed();
}

// Clients that each send a large request at once hold no more of the
// server's memory than TcpOptions::max_receive_bytes: past it, a request is
// answered RESOURCE_EXHAUSTED naming the bound, while smaller calls and
// other clients are served, and once the held requests are done the same
// request is served. A client's own bound ends a call whose response would
// pass it the same way.
TEST(ReceiveBound, LargeRequestsPastTheServersBoundAreRefusedAndOthersServed) {
  constexpr size_t kMiB = size_t{1} << 20;
  constexpr size_t kBound = 8 * kMiB;
  ParkService park;
  EchoService echo;
  transport::TransportTunables tunables;
  tunables.tcp.max_receive_bytes = kBound;
  auto built = ServerBuilder()
                   .AddListeningPort("tcp://127.0.0.1:0")
                   .RegisterService(&park)
                   .RegisterService(&echo)
                   .SetTransportTunables(tunables)
                   .BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  const std::string address = (*built)->addresses()[0];
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const auto expect_refused = [&](const RawConnection::Frame& f) {
    EXPECT_EQ(f.header.status, static_cast<uint16_t>(StatusCode::kResourceExhausted))
        << f.payload.substr(0, 300);
    for (const std::string& part :
         {std::string("TcpOptions::max_receive_bytes"), std::to_string(kBound)}) {
      EXPECT_NE(f.payload.find(part), std::string::npos)
          << "\"" << part << "\" not in " << f.payload;
    }
  };

  // Two requests of 3 MiB held by their (parked) calls: 6 MiB of 8.
  EchoRequest parked;
  parked.set_tag(3);  // held until FinishHeld
  parked.set_data(std::string(3 * kMiB, 'p'));
  RawClient first(port);
  RawClient second(port);
  first.SendFrame(Request(1, ParkService::kPark.id), "", parked.SerializeAsString());
  second.SendFrame(Request(2, ParkService::kPark.id), "", parked.SerializeAsString());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (park.parked_calls.load() < 2 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(park.parked_calls.load(), 2);

  const std::string large = EchoBytes(std::string(3 * kMiB, 'l'));
  RawClient third(port);
  third.SendFrame(Request(3, kEcho.id), "", large);
  auto refused = third.ReadFrame();
  ASSERT_TRUE(refused) << "the request past the bound got no answer";
  EXPECT_EQ(refused->header.call_id, 3u);
  expect_refused(*refused);
  third.SendFrame(Request(4, kEcho.id), "", EchoBytes("small"));
  auto small = third.ReadFrame();
  ASSERT_TRUE(small) << "the connection of the refused request was not served after it";
  EXPECT_EQ(small->header.call_id, 4u);
  EXPECT_EQ(small->header.status, 0) << small->payload;
  auto channel = Channel::Create(address);
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_TRUE(EchoOn(**channel, "another client").ok());
  EXPECT_EQ(echo.started.load(), 2) << "the refused request reached its handler";

  park.FinishHeld();
  for (RawClient* held : {&first, &second}) {
    auto answer = held->ReadFrame();
    ASSERT_TRUE(answer) << "a held call was not answered";
    EXPECT_EQ(answer->header.status, 0) << answer->payload.substr(0, 300);
  }
  // Their requests are released just after their answers went out.
  uint64_t id = 5;
  std::optional<RawConnection::Frame> served;
  while (absl::Now() < until) {
    third.SendFrame(Request(id, kEcho.id), "", large);
    served = third.ReadFrame();
    ASSERT_TRUE(served) << "no answer to call " << id;
    EXPECT_EQ(served->header.call_id, id++);
    if (served->header.status == 0) break;
    expect_refused(*served);
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(served);
  EXPECT_EQ(served->header.status, 0) << "the bound stayed full after the held calls ended";

  ChannelOptions bounded;
  bounded.transport.tcp.max_receive_bytes = kMiB;
  auto client = Channel::Create(address, bounded);
  ASSERT_TRUE(client.ok()) << client.status();
  EchoRequest ask;
  ask.set_response_size(2 * kMiB);
  EchoResponse answer;
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(20));
  const Status past = (*client)->Call(kEcho, &ctx, ask, &answer);
  EXPECT_EQ(past.code(), StatusCode::kResourceExhausted) << past.message();
  EXPECT_NE(past.message().find("TcpOptions::max_receive_bytes"), std::string::npos)
      << past.message();
  EXPECT_TRUE(EchoOn(**client, "after the refused response").ok());
}

}  // namespace
}  // namespace rdmarpc::testing
