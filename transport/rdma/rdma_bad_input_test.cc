// Bad input on the RDMA path: a hostile peer that speaks raw verbs (its own
// rdma_cm connection, its own QP, frames written by hand: RawPeer, in
// testing/raw_peer.h) sends what no rdmarpc client would. A frame that breaks
// the wire format ends only that connection, naming the peer; a well-formed
// request that advertises more than the server accepts is answered
// RESOURCE_EXHAUSTED without a READ and the connection goes on, as does a
// server's response that advertises more than the client can take (its buffer
// released at once); a response payload the peer never releases is revoked at
// the server's release timeout; a peer that vanishes without a disconnect, as
// when its machine dies, is noticed by the keepalive, and one that stops before
// its RTU by the probe at the accept timeout; a peer whose rdma_cm private data
// is not our handshake is refused (a client) or named in a clear connect error
// (a server); a peer that grants credits before it posts receives gets every
// response, windows intact, once it does; a peer that sends past its credit,
// returns credit past the largest window it granted or asks for credit back out
// of turn loses its connection, and one that keeps to the rules does not.
// Throughout, a good client is served.
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/testing/raw_peer.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::transport::rdma {
namespace {

using testing::CreditFrame;
using testing::Frame;
using testing::kRawRecvs;
using testing::kRawSlot;
using testing::RawPeer;
using testing::SmallRequest;

// The bytes of a response payload of `size` bytes.
std::string ResponseBytes(size_t size) {
  std::string s(size, '\0');
  for (size_t i = 0; i < size; ++i) s[i] = static_cast<char>(i * 7 + 3);
  return s;
}

// Server side: answers each request with a response carrying the request's
// payload status (and, when response_bytes is set, that many bytes of
// ResponseBytes), and records how connections ended.
class Answerer : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    endpoint_.store(static_cast<RdmaConnection&>(conn).endpoint());
    if (msg.header.kind != MessageKind::kRequest) return;
    OutboundMessage r;
    r.header.kind = MessageKind::kResponse;
    r.header.call_id = msg.header.call_id;
    r.header.status = static_cast<uint16_t>(msg.payload_status.code());
    if (response_bytes > 0) {
      auto b = conn.AllocatePayload(response_bytes);
      ASSERT_TRUE(b.ok()) << b.status();
      const std::string bytes = ResponseBytes(response_bytes);
      memcpy(b->data(), bytes.data(), bytes.size());
      r.payload = std::move(*b);
    }
    const absl::Status sent = conn.Send(std::move(r));
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_;
    if (!sent.ok()) refused_.push_back(sent);
  }
  // The requests answered or refused so far, and the refusals. A request
  // is counted just after its answer is sent: its client may have it first.
  size_t requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  // Whether requests() reaches `n` within 10 s.
  bool AwaitRequests(size_t n) {
    for (const absl::Time until = absl::Now() + absl::Seconds(10);
         requests() < n && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return requests() >= n;
  }
  std::vector<absl::Status> refused() {
    std::lock_guard<std::mutex> lock(mu_);
    return refused_;
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.push_back(why);
  }
  // The next connection end after the first `seen`, waiting up to 10 s.
  std::optional<absl::Status> ClosedAfter(size_t seen) {
    return ClosedWithin(seen, absl::Seconds(10));
  }
  std::optional<absl::Status> ClosedWithin(size_t seen, absl::Duration wait) {
    const absl::Time until = absl::Now() + wait;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (closed_.size() > seen) return closed_[seen];
      }
      if (absl::Now() > until) return std::nullopt;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  size_t closed_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_.size();
  }
  size_t response_bytes = 0;  // set before the first request
  // The server's endpoint, once a frame has come; null before.
  Endpoint* endpoint() const { return endpoint_.load(); }

 private:
  std::atomic<Endpoint*> endpoint_{nullptr};
  std::mutex mu_;
  std::vector<absl::Status> closed_;
  size_t requests_ = 0;
  std::vector<absl::Status> refused_;
};

// A well-behaved client: one request at a time, answered or not.
class GoodClient : public ConnectionObserver {
 public:
  absl::Status Call(Connection& conn, uint64_t id) {
    std::future<uint16_t> f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      answer_ = std::promise<uint16_t>();
      answered_ = false;
      f = answer_.get_future();
    }
    OutboundMessage m;
    m.header.kind = MessageKind::kRequest;
    m.header.call_id = id;
    if (absl::Status s = conn.Send(std::move(m)); !s.ok()) return s;
    if (f.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
      return absl::DeadlineExceededError("the good client was not answered in 30 s");
    }
    const uint16_t status = f.get();
    return status == 0 ? absl::OkStatus() : absl::InternalError(absl::StrCat("status ", status));
  }
  void OnMessage(Connection&, InboundMessage&& msg) override { Answer(msg.header.status); }
  void OnClosed(Connection&, const absl::Status&) override { Answer(1); }

 private:
  void Answer(uint16_t status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (answered_) return;
    answered_ = true;
    answer_.set_value(status);
  }

  std::mutex mu_;
  std::promise<uint16_t> answer_;
  bool answered_ = true;  // no call yet
};

struct Server {
  Answerer answerer;
  std::unique_ptr<RdmaTransport> transport;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<RdmaTransport> client_transport;

  bool Start(size_t max_message_size, const RdmaOptions& server_options = RdmaOptions()) {
    const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
    if (ip.empty()) return false;
    TransportOptions so;
    so.name = "bad-input-server";
    so.listening = true;
    so.max_message_size = max_message_size;
    transport = std::make_unique<RdmaTransport>(so, server_options, true);
    auto l = transport->Listen(*ParseAddress("rdma://" + ip + ":0"),
                               [this](std::shared_ptr<Connection>) { return &answerer; });
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return false;
    listener = std::move(*l);
    TransportOptions co;
    co.name = "good-client";
    client_transport = std::make_unique<RdmaTransport>(co, RdmaOptions(), false);
    return true;
  }
  // A well-behaved client's connection, once Start has succeeded.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectGoodClient(GoodClient* observer) {
    return client_transport->Connect(listener->address(), observer,
                                     SteadyNow() + absl::Seconds(30));
  }
};

TEST(RdmaBadInput, MalformedFramesEndOnlyTheirConnection) {
  GoodClient good_observer;  // outlives the transports, which call it
  Server server;
  ASSERT_TRUE(server.Start(1u << 20));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE(good_observer.Call(**good, 1).ok());

  Header bad_magic = SmallRequest(1, 0);
  Header unknown_kind = SmallRequest(1, 0);
  unknown_kind.kind = static_cast<MessageKind>(99);
  Header empty_advert = SmallRequest(1, 0);
  empty_advert.flags = kFlagRemotePayload;
  Header over_wire_limit = SmallRequest(1, 0);
  over_wire_limit.flags = kFlagRemotePayload;
  over_wire_limit.payload_len = kMaxPayloadBytes + 1;
  Header empty_shrink;
  empty_shrink.kind = MessageKind::kShrink;
  std::string bad_magic_frame = Frame(bad_magic);
  bad_magic_frame[0] ^= 0x5a;
  const struct {
    const char* what;
    std::string frame;
    const char* error;  // what the server's reason says
  } cases[] = {
      {"shorter than a header", std::string(10, 'x'), "truncated header"},
      {"wrong magic", bad_magic_frame, "bad magic"},
      {"unknown message kind", Frame(unknown_kind), "unknown message kind 99"},
      {"payload length longer than the frame", Frame(SmallRequest(1, 100), std::string(10, 'p')),
       "74 bytes received, header says 164"},
      {"payload length shorter than the frame", Frame(SmallRequest(1, 10), std::string(100, 'p')),
       "164 bytes received, header says 74"},
      {"advertised payload of 0 bytes", Frame(empty_advert), "advertises a payload of 0 bytes"},
      {"advertised payload over the wire limit", Frame(over_wire_limit), "exceeds the limit"},
      {"credit frame without credit", CreditFrame(0), "a kCredit that returns no credit"},
      {"kShrink that asks for nothing", Frame(empty_shrink), "a kShrink that asks for no credit"},
  };
  uint64_t good_id = 2;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const size_t closed_before = server.answerer.closed_count();
    const uint64_t reads_before = Counters().reads;
    RawPeer peer;
    ASSERT_EQ(peer.Connect(server.listener->address()), "");
    ASSERT_TRUE(peer.Send(c.frame));
    EXPECT_TRUE(peer.Disconnected(absl::Seconds(10)))
        << "the server kept the connection; other CM events: " << peer.OtherEvents();
    EXPECT_FALSE(peer.NextFrame(absl::Milliseconds(100)).has_value()) << "it was answered";
    auto why = server.answerer.ClosedAfter(closed_before);
    ASSERT_TRUE(why.has_value()) << "the server's side did not end";
    EXPECT_EQ(why->code(), absl::StatusCode::kInternal) << *why;
    EXPECT_NE(why->message().find("malformed frame from rdma://"), std::string::npos) << *why;
    EXPECT_NE(why->message().find(c.error), std::string::npos) << *why;
    EXPECT_EQ(Counters().reads, reads_before) << "a READ was spent on a bad frame";
    EXPECT_TRUE(good_observer.Call(**good, good_id++).ok()) << "the good client was not served";
  }
  (*good)->Close();
}

// A lying length that the wire format allows: the header advertises more
// than the server's max_message_size. The server cannot know whether the
// bytes exist and must not try; it answers that call and keeps the
// connection.
TEST(RdmaBadInput, AdvertisementOverTheMessageLimitIsAnsweredWithoutARead) {
  Server server;
  ASSERT_TRUE(server.Start(1u << 20));
  RawPeer peer;
  ASSERT_EQ(peer.Connect(server.listener->address()), "");
  const uint64_t reads_before = Counters().reads;
  Header lying = SmallRequest(7, 64u << 20);
  lying.flags = kFlagRemotePayload;
  lying.remote = RemoteDescriptor{0x1000, 0x1234, 1};  // nothing there: a READ would fail
  ASSERT_TRUE(peer.Send(Frame(lying)));
  auto answer = peer.NextFrame(absl::Seconds(10));
  ASSERT_TRUE(answer.has_value()) << "not answered";
  EXPECT_EQ(answer->kind, MessageKind::kResponse);
  EXPECT_EQ(answer->call_id, 7u);
  EXPECT_EQ(answer->status, static_cast<uint16_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(Counters().reads, reads_before) << "the server READ an oversize payload";

  // The same connection still serves a good request.
  ASSERT_TRUE(peer.Send(Frame(SmallRequest(8, 3), "abc")));
  auto next = peer.NextFrame(absl::Seconds(10));
  ASSERT_TRUE(next.has_value()) << "the connection stopped serving";
  EXPECT_EQ(next->call_id, 8u);
  EXPECT_EQ(next->status, 0);
  EXPECT_FALSE(peer.Disconnected(absl::Milliseconds(200)));
  EXPECT_EQ(server.answerer.closed_count(), 0u);
}

// True once `counter` exceeds `above`, within 10 s.
bool CountsPast(RdmaCounters::Field counter, uint64_t above) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (Counters().*counter <= above) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

Header Release(uint64_t token) {
  Header h;
  h.kind = MessageKind::kRelease;
  h.remote.token = token;
  return h;
}

constexpr uint32_t kLargeResponse = 64 * 1024;  // goes by READ, fits the raw peer
constexpr uint32_t kReleaseTimeoutMs = 300;

// Sends request `id` to an Answerer with response_bytes = kLargeResponse and
// READs the payload its response advertises; the response's header, or
// nullopt (and a test failure) when a step fails.
std::optional<Header> AskAndRead(RawPeer& peer, uint64_t id) {
  if (!peer.Send(Frame(SmallRequest(id, 0)))) {
    ADD_FAILURE() << "request " << id << " was not sent";
    return std::nullopt;
  }
  auto h = peer.NextFrame(absl::Seconds(10));
  if (!h.has_value() || !h->remote_payload() || h->payload_len != kLargeResponse) {
    ADD_FAILURE() << "request " << id << " was not answered with an advertised payload";
    return std::nullopt;
  }
  std::string bytes;
  const ibv_wc_status status = peer.Read(h->remote, h->payload_len, &bytes);
  if (status != IBV_WC_SUCCESS || bytes != ResponseBytes(kLargeResponse)) {
    ADD_FAILURE() << "READ of response " << id << ": " << ibv_wc_status_str(status);
    return std::nullopt;
  }
  return h;
}

// A client that READs a response and never releases it must not hold the
// server's registered memory: at the release timeout the window is revoked,
// the block goes back to the pool (the next response reuses it, under a new
// rkey), and the old (addr, rkey) no longer reads. A released payload is not
// counted. Other clients are served throughout.
TEST(RdmaBadInput, UnreleasedResponsePayloadIsRevokedAtTheReleaseTimeout) {
  GoodClient good_observer;
  Server server;
  RdmaOptions options;
  options.release_timeout_ms = kReleaseTimeoutMs;
  server.answerer.response_bytes = kLargeResponse;
  ASSERT_TRUE(server.Start(1u << 20, options));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  RawPeer peer;
  ASSERT_EQ(peer.Connect(server.listener->address()), "");
  const uint64_t expired_before = Counters().releases_expired;
  auto released = AskAndRead(peer, 1);
  ASSERT_TRUE(released.has_value());
  ASSERT_TRUE(peer.Send(Frame(Release(released->remote.token))));
  auto kept = AskAndRead(peer, 2);  // and never released
  ASSERT_TRUE(kept.has_value());

  ASSERT_TRUE(CountsPast(&RdmaCounters::releases_expired, expired_before))
      << "an unreleased response payload was never revoked";
  EXPECT_EQ(Counters().releases_expired, expired_before + 1)
      << "a released payload was counted too";
  const uint64_t registered = Counters().registered_bytes;
  ASSERT_TRUE(peer.Send(Frame(SmallRequest(3, 0))));
  auto next = peer.NextFrame(absl::Seconds(10));
  ASSERT_TRUE(next.has_value()) << "not answered";
  EXPECT_EQ(Counters().registered_bytes, registered) << "the revoked block was not reused";
  EXPECT_EQ(next->remote.addr, kept->remote.addr);
  EXPECT_NE(next->remote.rkey, kept->remote.rkey);
  // The stale advertisement reads nothing, though its bytes are exposed
  // again under the new rkey.
  std::string bytes;
  EXPECT_EQ(peer.Read(kept->remote, kept->payload_len, &bytes), IBV_WC_REM_ACCESS_ERR);
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";
  (*good)->Close();
}

// Without memory windows a block's registration exposes it to the peer and
// cannot be revoked for one QP: the unreleased payload's connection is
// closed (which takes the QP out of RTS) and only that one.
TEST(RdmaBadInput, WithoutMemoryWindowsAnUnreleasedResponseClosesItsConnection) {
  GoodClient good_observer;
  Server server;
  RdmaOptions options;
  options.release_timeout_ms = kReleaseTimeoutMs;
  options.memory_windows = false;
  server.answerer.response_bytes = kLargeResponse;
  ASSERT_TRUE(server.Start(1u << 20, options));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  RawPeer peer;
  ASSERT_EQ(peer.Connect(server.listener->address()), "");
  const uint64_t expired_before = Counters().releases_expired;
  ASSERT_TRUE(AskAndRead(peer, 1).has_value());  // and never released
  EXPECT_TRUE(peer.Disconnected(absl::Seconds(10)))
      << "the server kept the connection; other CM events: " << peer.OtherEvents();
  auto why = server.answerer.ClosedAfter(0);
  ASSERT_TRUE(why.has_value()) << "the server's side did not end";
  EXPECT_EQ(why->code(), absl::StatusCode::kDeadlineExceeded) << *why;
  EXPECT_NE(why->message().find("did not release 1 response payload(s) within 300ms"),
            std::string::npos)
      << *why;
  EXPECT_EQ(Counters().releases_expired, expired_before + 1);
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";
  EXPECT_EQ(server.answerer.closed_count(), 1u);
  (*good)->Close();
}

// A peer that grants credits it has not backed with receives (or falls
// behind posting them) makes the server's SENDs meet RNR NAKs, which the
// device retries. Responses queued behind such a SEND advertise payloads
// through windows bound behind it; a retry must not cost them their windows
// (Soft-RoCE on Linux 6.1 executes such a bind again on retry, and the
// second bind fails: MW_BIND_ERR ended the connection). Once the peer posts
// its receives, every response arrives and every payload reads.
TEST(RdmaBadInput, ResponsesQueuedBehindASendThePeerRefusedKeepTheirWindows) {
  GoodClient good_observer;
  Server server;
  server.answerer.response_bytes = kLargeResponse;
  ASSERT_TRUE(server.Start(1u << 20));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  RawPeer peer;
  peer.withhold_receives = true;
  ASSERT_EQ(peer.Connect(server.listener->address()), "");
  const DeviceRnrNaks before = ReadDeviceRnrNaks();
  ASSERT_GE(before.received, 0) << "this test needs the device's count of RNR NAKs (rxe)";
  constexpr int kResponses = 4;
  for (uint64_t id = 1; id <= kResponses; ++id) {
    ASSERT_TRUE(peer.Send(Frame(SmallRequest(id, 0)))) << "request " << id;
  }
  // The first refusal: the device retries from there once the peer's RNR
  // timer has run, with the later responses' binds behind.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (ReadDeviceRnrNaks().received == before.received && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_GT(ReadDeviceRnrNaks().received, before.received)
      << "the server's responses were not refused for want of receives";
  peer.PostReceives();
  for (uint64_t id = 1; id <= kResponses; ++id) {
    auto h = peer.NextFrame(absl::Seconds(10));
    ASSERT_TRUE(h.has_value())
        << "response " << id << " never came; the server's side ended: "
        << server.answerer.ClosedWithin(0, absl::ZeroDuration()).value_or(absl::OkStatus());
    ASSERT_EQ(h->call_id, id);
    ASSERT_TRUE(h->remote_payload());
    std::string bytes;
    EXPECT_EQ(peer.Read(h->remote, h->payload_len, &bytes), IBV_WC_SUCCESS) << "response " << id;
    EXPECT_EQ(bytes, ResponseBytes(kLargeResponse)) << "response " << id;
  }
  EXPECT_EQ(server.answerer.closed_count(), 0u);
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";
  (*good)->Close();
}

// A peer that sends requests and returns no credits: past the credits its
// handshake granted, the answers wait in the server's backlog, which holds at
// most RdmaOptions::max_backlog_bytes; answers past that are refused
// RESOURCE_EXHAUSTED naming the bound (the runtime then sends that error,
// rpc/server.h), and the connection goes on: once the peer returns credits,
// every answer the backlog held comes, in order.
TEST(RdmaBadInput, APeerThatReturnsNoCreditsPinsNoMoreThanTheBacklogBound) {
  GoodClient good_observer;
  Server server;
  constexpr size_t kAnswer = 1000;  // by SEND: too large to go inline, within a slot
  server.answerer.response_bytes = kAnswer;
  RdmaOptions options;
  options.max_backlog_bytes = 64 << 10;
  ASSERT_TRUE(server.Start(1u << 20, options));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  RawPeer peer;
  ASSERT_EQ(peer.Connect(server.listener->address()), "");
  // The first answer to wait is taken whatever its size; each further one
  // while the backlog stays within its bound.
  const size_t held = options.max_backlog_bytes / (kHeaderSize + kAnswer);
  const size_t requests = kRawRecvs + held + 16;
  const uint64_t refusals_before = Counters().backlog_refusals;
  for (uint64_t id = 1; id <= requests; ++id) {
    // Within its credit: the server keeps returning credit (kCredit frames
    // need none of ours), and a peer past it would lose its connection.
    ASSERT_TRUE(peer.AwaitCredits(id > peer.granted_window ? id - peer.granted_window : 0,
                                  absl::Seconds(10)))
        << "no credit for request " << id;
    ASSERT_TRUE(peer.Send(Frame(SmallRequest(id, 0)))) << "request " << id;
  }
  ASSERT_TRUE(server.answerer.AwaitRequests(requests));
  ASSERT_EQ(server.answerer.requests(), requests);
  const std::vector<absl::Status> refused = server.answerer.refused();
  EXPECT_EQ(refused.size(), requests - kRawRecvs - held);
  for (const absl::Status& s : refused) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "RdmaOptions::max_backlog_bytes")) << s;
  }
  EXPECT_EQ(Counters().backlog_refusals - refusals_before, refused.size());
  EXPECT_EQ(server.answerer.closed_count(), 0u);
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";

  // Each answer's credit back as it is taken, as a client would: more than
  // the window it granted would end the connection.
  for (uint64_t id = 1; id <= kRawRecvs + held; ++id) {
    auto h = peer.NextFrame(absl::Seconds(10));
    ASSERT_TRUE(h.has_value()) << "answer " << id << " never came";
    EXPECT_EQ(h->call_id, id);
    EXPECT_EQ(h->payload_len, kAnswer);
    ASSERT_TRUE(peer.Send(CreditFrame(1))) << "credit for answer " << id;
  }
  EXPECT_EQ(server.answerer.closed_count(), 0u);
  (*good)->Close();
}

// Peers that return no credits pin at most RdmaOptions::
// max_backlog_bytes_total of the server's memory together: the first peer's
// backlog fills to its own bound, the second one's only to what the total
// leaves, and the answers past that are refused naming the total. Every
// answer either backlog held still comes once its peer returns credits.
TEST(RdmaBadInput, PeersThatReturnNoCreditsPinNoMoreThanTheTotalBacklogBound) {
  GoodClient good_observer;
  Server server;
  constexpr size_t kAnswer = 1000;  // by SEND: too large to go inline, within a slot
  constexpr size_t kFrame = kHeaderSize + kAnswer;
  server.answerer.response_bytes = kAnswer;
  RdmaOptions options;
  options.max_backlog_bytes = 64 << 10;
  options.max_backlog_bytes_total = 96 << 10;
  ASSERT_TRUE(server.Start(1u << 20, options));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  const size_t held_first = options.max_backlog_bytes / kFrame;
  const size_t held_second = (options.max_backlog_bytes_total - held_first * kFrame) / kFrame;
  ASSERT_LT(held_second, held_first) << "the total would not bind the second peer";
  constexpr size_t kPastTheBounds = 16;
  RawPeer first;
  RawPeer second;
  size_t requests = 0;
  const uint64_t refusals_before = Counters().backlog_refusals;
  // kRawRecvs answers go out, `held` wait, kPastTheBounds are refused; each
  // request within the peer's credit, which the server keeps returning.
  const auto send_requests = [&](RawPeer& peer, size_t held) {
    ASSERT_EQ(peer.Connect(server.listener->address()), "");
    const size_t n = kRawRecvs + held + kPastTheBounds;
    for (uint64_t id = 1; id <= n; ++id) {
      ASSERT_TRUE(peer.AwaitCredits(id > peer.granted_window ? id - peer.granted_window : 0,
                                    absl::Seconds(10)))
          << "no credit for request " << id;
      ASSERT_TRUE(peer.Send(Frame(SmallRequest(id, 0)))) << "request " << id;
    }
    requests += n;
    ASSERT_TRUE(server.answerer.AwaitRequests(requests));
  };
  send_requests(first, held_first);
  std::vector<absl::Status> refused = server.answerer.refused();
  ASSERT_EQ(refused.size(), kPastTheBounds);
  for (const absl::Status& s : refused) {
    EXPECT_TRUE(absl::StrContains(s.message(), "(RdmaOptions::max_backlog_bytes;")) << s;
  }
  send_requests(second, held_second);
  refused = server.answerer.refused();
  ASSERT_EQ(refused.size(), 2 * kPastTheBounds);
  for (size_t i = kPastTheBounds; i < refused.size(); ++i) {
    EXPECT_EQ(refused[i].code(), absl::StatusCode::kResourceExhausted) << refused[i];
    for (const std::string& part : {std::string("RdmaOptions::max_backlog_bytes_total"),
                                    absl::StrCat("more than ", 96 << 10, " bytes")}) {
      EXPECT_TRUE(absl::StrContains(refused[i].message(), part))
          << "\"" << part << "\" not in: " << refused[i];
    }
  }
  EXPECT_EQ(Counters().backlog_refusals - refusals_before, refused.size());
  EXPECT_EQ(server.answerer.closed_count(), 0u);
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";

  for (auto [peer, held] : {std::pair{&first, held_first}, std::pair{&second, held_second}}) {
    for (uint64_t id = 1; id <= kRawRecvs + held; ++id) {
      auto h = peer->NextFrame(absl::Seconds(10));
      ASSERT_TRUE(h.has_value()) << "answer " << id << " never came";
      EXPECT_EQ(h->call_id, id);
      ASSERT_TRUE(peer->Send(CreditFrame(1))) << "credit for answer " << id;
    }
  }
  EXPECT_EQ(server.answerer.closed_count(), 0u);
  (*good)->Close();
}

// Holds an endpoint's I/O thread, in a task that waits, until released or
// destroyed: what peers send meanwhile waits in its CQ.
class IoHold {
 public:
  explicit IoHold(Endpoint* endpoint) {
    endpoint->RunOnPoller([state = state_] {
      std::unique_lock<std::mutex> lock(state->mu);
      state->held = true;
      state->cv.notify_all();
      state->cv.wait(lock, [&] { return state->released; });
    });
  }
  IoHold(const IoHold&) = delete;
  IoHold& operator=(const IoHold&) = delete;
  ~IoHold() { Release(); }
  // Whether the task holds the I/O thread, waiting up to 10 s for it to.
  bool Held() {
    std::unique_lock<std::mutex> lock(state_->mu);
    return state_->cv.wait_for(lock, std::chrono::seconds(10), [&] { return state_->held; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->released = true;
    state_->cv.notify_all();
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool held = false;      // guarded by mu
    bool released = false;  // guarded by mu
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// A server and a good client that has had a call answered, beside which
// raw peers break the credit rules.
struct ServerOfRuleBreakers {
  GoodClient good_observer;  // outlives the transports, which call it
  Server server;
  std::shared_ptr<Connection> good;
  uint64_t good_id = 1;
  Endpoint* endpoint = nullptr;  // the server's

  bool Start() {
    if (!server.Start(1u << 20)) return false;
    auto c = server.ConnectGoodClient(&good_observer);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return false;
    good = *std::move(c);
    ExpectGoodClientServed();
    endpoint = server.answerer.endpoint();
    return endpoint != nullptr;
  }
  ~ServerOfRuleBreakers() {
    if (good) good->Close();
  }

  // The server ends `peer`'s connection, the connection ended after the
  // first `closed_before`: INTERNAL, its reason saying each of `says`.
  void ExpectCut(RawPeer& peer, size_t closed_before, std::initializer_list<std::string> says) {
    EXPECT_TRUE(peer.Disconnected(absl::Seconds(10)))
        << "the server kept the connection; other CM events: " << peer.OtherEvents();
    const std::optional<absl::Status> why = server.answerer.ClosedAfter(closed_before);
    EXPECT_TRUE(why.has_value()) << "the server's side did not end";
    if (why.has_value()) {
      EXPECT_EQ(why->code(), absl::StatusCode::kInternal) << *why;
      for (const std::string& part : says) {
        EXPECT_TRUE(absl::StrContains(why->message(), part)) << *why;
      }
    }
  }
  // Returns once the server has counted the call, so that a test can count
  // the requests that follow.
  void ExpectGoodClientServed() {
    const size_t requests = server.answerer.requests();
    EXPECT_TRUE(good_observer.Call(*good, good_id++).ok()) << "the good client was not served";
    EXPECT_TRUE(server.answerer.AwaitRequests(requests + 1));
  }
};

// A peer that sends past its credit takes receive slots that the server's
// other connections were promised. With the server's I/O thread held, a
// raw peer sends its whole window, and then, on a second connection, one
// frame more: let go, the server finds them all in its CQ at once. The
// first peer is served; the second has its window handled and its
// connection ended at the frame past it, naming the peer. A good client is
// served throughout.
TEST(RdmaBadInput, APeerThatSendsWithoutCreditLosesItsConnection) {
  ServerOfRuleBreakers s;
  ASSERT_TRUE(s.Start());
  Answerer& answerer = s.server.answerer;
  for (const uint32_t past : {0u, 1u}) {
    SCOPED_TRACE(past == 0 ? "its window" : "one frame past its window");
    // The first peer's connection ended once it was gone.
    for (const absl::Time until = absl::Now() + absl::Seconds(10);
         answerer.closed_count() < past && absl::Now() < until;) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    const size_t closed_before = answerer.closed_count();
    ASSERT_EQ(closed_before, past);
    const size_t requests_before = answerer.requests();
    const uint64_t without_credit_before = Counters().frames_without_credit;
    RawPeer peer;
    ASSERT_EQ(peer.Connect(s.server.listener->address()), "");
    const uint32_t window = peer.granted_window;
    ASSERT_GT(window, 0u);
    {
      IoHold hold(s.endpoint);
      ASSERT_TRUE(hold.Held());
      for (uint64_t id = 1; id <= window + past; ++id) {
        ASSERT_TRUE(peer.Send(Frame(SmallRequest(id, 0)))) << "frame " << id;
      }
    }
    answerer.AwaitRequests(requests_before + window);
    if (past == 0) {
      EXPECT_FALSE(peer.Disconnected(absl::Milliseconds(500))) << "an honest peer was dropped";
      EXPECT_EQ(answerer.closed_count(), closed_before);
    } else {
      s.ExpectCut(peer, closed_before,
                  {"frame without credit from rdma://",
                   absl::StrCat("sent 1 frame past its window of ", window)});
    }
    EXPECT_EQ(Counters().frames_without_credit - without_credit_before, past);
    EXPECT_EQ(answerer.requests() - requests_before, window)
        << "the frames within the window were not all handled";
    s.ExpectGoodClientServed();
  }
}

// Free frames are bounded too. A peer returns credit only for frames it
// was sent, so we never hold more than the largest window its handshake
// says it may grant (max_credits); as each kCredit brings one credit at
// least, a peer can send no more of them than we sent it frames, plus that
// window. A raw peer that granted 4 of at most 8 returns 4 more: the server
// holds 8, keeps the connection and answers a request (which spends one).
// Then the peer returns 2, one past 8: the connection ends, naming the
// peer. A good client is served throughout.
TEST(RdmaBadInput, APeerThatReturnsCreditPastItsWindowLosesItsConnection) {
  ServerOfRuleBreakers s;
  ASSERT_TRUE(s.Start());
  const uint64_t unwarranted_before = Counters().unwarranted_control_frames;
  RawPeer peer;
  peer.our_window = 4;
  peer.our_largest_window = 8;
  ASSERT_EQ(peer.Connect(s.server.listener->address()), "");
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(peer.Send(CreditFrame(1))) << "credit " << i;
  ASSERT_TRUE(peer.Send(Frame(SmallRequest(1, 0))));
  const std::optional<Header> answer = peer.NextFrame(absl::Seconds(10));
  ASSERT_TRUE(answer.has_value()) << "a peer at its largest window was not answered";
  EXPECT_EQ(answer->call_id, 1u);
  EXPECT_EQ(s.server.answerer.closed_count(), 0u);
  EXPECT_EQ(Counters().unwarranted_control_frames, unwarranted_before);

  ASSERT_TRUE(peer.Send(CreditFrame(2)));
  s.ExpectCut(peer, 0,
              {"credit past its window from rdma://",
               "returned 1 credit more than its largest window, 8,"});
  EXPECT_EQ(Counters().unwarranted_control_frames - unwarranted_before, 1u);
  s.ExpectGoodClientServed();
}

// A kShrink ask is free too, and takes a frame to answer: a peer asks again
// only once the answer to its last ask has reached it. A raw peer that
// waits for each answer is answered each time; when the server finds two
// asks of its in one batch of completions (its I/O thread held while they
// came), the connection ends at the second, naming the peer. A good client
// is served throughout.
TEST(RdmaBadInput, APeerThatAsksForCreditBackOutOfTurnLosesItsConnection) {
  ServerOfRuleBreakers s;
  ASSERT_TRUE(s.Start());
  const uint64_t unwarranted_before = Counters().unwarranted_control_frames;
  RawPeer peer;
  ASSERT_EQ(peer.Connect(s.server.listener->address()), "");
  Header ask;
  ask.kind = MessageKind::kShrink;
  ask.call_id = 1;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(peer.Send(Frame(ask))) << "ask " << i;
    const std::optional<Header> answer = peer.NextFrame(absl::Seconds(10));
    ASSERT_TRUE(answer.has_value()) << "ask " << i << " was not answered";
    EXPECT_EQ(answer->kind, MessageKind::kShrink);
    EXPECT_EQ(answer->call_id, 1u);
  }
  EXPECT_EQ(s.server.answerer.closed_count(), 0u);
  EXPECT_EQ(Counters().unwarranted_control_frames, unwarranted_before);

  {
    IoHold hold(s.endpoint);
    ASSERT_TRUE(hold.Held());
    ASSERT_TRUE(peer.Send(Frame(ask)));
    ASSERT_TRUE(peer.Send(Frame(ask)));
  }
  s.ExpectCut(peer, 0, {"kShrink out of turn from rdma://", "before our answer to its last ask"});
  EXPECT_EQ(Counters().unwarranted_control_frames - unwarranted_before, 1u);
  s.ExpectGoodClientServed();
}

constexpr uint32_t kKeepaliveMs = 200;
constexpr uint32_t kPeerTimeoutMs = 500;
// keepalive_ms + peer_timeout_ms, the sweep's 100 ms and the VM's slowness,
// with room to spare; rdma_cm's own ACK timeout alone would take ~17 s.
constexpr absl::Duration kNoticedWithin = absl::Seconds(5);

RdmaOptions KeepaliveOptions() {
  RdmaOptions options;
  options.keepalive_ms = kKeepaliveMs;
  options.peer_timeout_ms = kPeerTimeoutMs;
  return options;
}

// A server and a good client connected to it, beside which raw clients
// connect and vanish one at a time.
struct ServerWithGoodClient {
  GoodClient good_observer;
  Server server;
  std::shared_ptr<Connection> good;
  size_t closed = 0;  // connections the server has ended

  bool Start(size_t max_message_size) {
    if (!server.Start(max_message_size, KeepaliveOptions())) return false;
    auto c = server.client_transport->Connect(server.listener->address(), &good_observer,
                                              SteadyNow() + absl::Seconds(30));
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return false;
    good = std::move(*c);
    return true;
  }

  // A raw client that asked for `retry_count` transport retries vanished at
  // `vanished`: the server ends that connection only, UNAVAILABLE within
  // `within`, saying that `what` to the peer failed, through the device's
  // retry counter (6 retries) or, where Soft-RoCE retries for ever (7), by
  // the server's own bound, which says `unbounded`. The good client is still
  // served.
  void ExpectOnlyTheVanishedClientCut(uint8_t retry_count, absl::Time vanished,
                                      absl::Duration within, const std::string& what,
                                      const std::string& unbounded) {
    auto why = server.answerer.ClosedAfter(closed);
    ASSERT_TRUE(why.has_value()) << "the server never noticed";
    EXPECT_LT(absl::Now() - vanished, within);
    EXPECT_EQ(why->code(), absl::StatusCode::kUnavailable) << *why;
    EXPECT_NE(why->message().find(what), std::string::npos) << *why;
    EXPECT_NE(why->message().find("rdma://"), std::string::npos) << *why;
    EXPECT_NE(why->message().find(retry_count == 6 ? "retry counter exceeded" : unbounded),
              std::string::npos)
        << *why;
    EXPECT_EQ(server.answerer.closed_count(), ++closed) << "other connections were closed too";
    EXPECT_TRUE(good_observer.Call(*good, closed).ok()) << "the good client was not served";
  }
};

// A client that stops between its connect request and its RTU: the server
// has accepted, and rdma_cm alone would hold that connection, its QP and
// credits, for minutes (measured: still held after 150 s, as the client's
// kernel answers each REP with an MRA worth 68 s). At accept_timeout_ms the
// server probes it with a keepalive, which the client's QP, never readied,
// does not acknowledge: the server ends that connection alone,
// UNAVAILABLE, and counts it. The client learns it when it goes on.
TEST(RdmaBadInput, ClientThatNeverCompletesItsConnectionIsDroppedAfterTheAcceptTimeout) {
  GoodClient good_observer;
  Server server;
  RdmaOptions options = KeepaliveOptions();
  options.accept_timeout_ms = 1000;
  ASSERT_TRUE(server.Start(1u << 20, options));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  const uint64_t unfinished_before = Counters().accepts_unfinished;
  RawPeer stalled;
  stalled.stall_before_rtu = true;
  ASSERT_EQ(stalled.Connect(server.listener->address(), /*retry_count=*/6), "");
  const absl::Time asked = absl::Now();
  auto why = server.answerer.ClosedAfter(0);
  ASSERT_TRUE(why.has_value()) << "the server still holds the connection after 10 s";
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(900)) << "dropped before its timeout";
  EXPECT_EQ(why->code(), absl::StatusCode::kUnavailable) << *why;
  EXPECT_TRUE(absl::StrContains(why->message(), "did not complete its connection within 1s"))
      << *why;
  EXPECT_TRUE(absl::StrContains(why->message(), "did not answer a probe")) << *why;
  EXPECT_TRUE(absl::StrContains(why->message(), "rdma://")) << *why;
  EXPECT_EQ(Counters().accepts_unfinished, unfinished_before + 1);
  // The good client's connection, made before and so past the timeout
  // too, stays: its client completed it.
  EXPECT_TRUE(good_observer.Call(**good, 1).ok()) << "the good client was not served";
  EXPECT_EQ(server.answerer.closed_count(), 1u) << "other connections were closed too";
  // The server frees the connection's rdma_cm id, which sends the client a
  // REJ, after it has ended the connection (once its QP has drained): the
  // REJ may come before the client goes on, which fails its connect, or
  // after its RTU, which ends the connection it got (seen once, in a
  // clean-clone CI run).
  const rdma_cm_event_type outcome = stalled.GoOn();
  if (outcome == RDMA_CM_EVENT_ESTABLISHED) {
    EXPECT_TRUE(stalled.Disconnected(absl::Seconds(10)))
        << "the client holds a connection the server ended; other events: "
        << stalled.OtherEvents();
  } else {
    EXPECT_EQ(outcome, RDMA_CM_EVENT_CONNECT_ERROR) << rdma_event_str(outcome);
  }
  (*good)->Close();
}

// A client whose RTU is lost: its QP runs, so it acknowledges the probe,
// and the server keeps the connection and serves it (rdma_cm would resend
// the REP for another RTU only after the MRA's 68 s).
TEST(RdmaBadInput, ClientWhoseRtuIsLostKeepsItsConnection) {
  Server server;
  RdmaOptions options = KeepaliveOptions();
  options.accept_timeout_ms = 1000;
  ASSERT_TRUE(server.Start(1u << 20, options));
  const uint64_t keepalives_before = Counters().keepalives;
  RawPeer peer;
  peer.lose_rtu = true;
  ASSERT_EQ(peer.Connect(server.listener->address(), /*retry_count=*/6), "");
  // The probe goes out at the timeout; unanswered, it would end the
  // connection within the device's retry time (peer_timeout_ms, 500 ms).
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (Counters().keepalives == keepalives_before && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GT(Counters().keepalives, keepalives_before) << "no probe in 10 s";
  EXPECT_FALSE(server.answerer.ClosedWithin(0, absl::Seconds(3)).has_value())
      << "a client whose QP runs lost its connection";
  ASSERT_TRUE(peer.Send(Frame(SmallRequest(1, 0))));
  EXPECT_TRUE(peer.NextFrame(absl::Seconds(10)).has_value()) << "not answered";
  EXPECT_EQ(server.answerer.closed_count(), 0u);
}

// A client whose machine vanishes (its QP stops answering, no disconnect
// comes) while the server has nothing to send it: the server's keepalive
// notices, and ends that connection only. Whatever retry count the client
// asked for at connect, which the server's QP takes: 6 fails the keepalive
// on the device, 7 makes Soft-RoCE retry it for ever, and then the server
// gives up at twice the device's retry time.
TEST(RdmaBadInput, ClientThatVanishesIsNoticedByTheServersKeepalive) {
  ServerWithGoodClient s;
  ASSERT_TRUE(s.Start(1u << 20));
  for (const uint8_t retry_count : {uint8_t{6}, uint8_t{7}}) {
    SCOPED_TRACE(absl::StrCat("the client asked for ", retry_count, " retries"));
    RawPeer peer;
    ASSERT_EQ(peer.Connect(s.server.listener->address(), retry_count), "");
    ASSERT_TRUE(peer.Send(Frame(SmallRequest(1, 0))));
    ASSERT_TRUE(peer.NextFrame(absl::Seconds(10)).has_value()) << "not answered";
    const RdmaCounters before = Counters();
    ASSERT_TRUE(peer.Vanish());
    s.ExpectOnlyTheVanishedClientCut(retry_count, absl::Now(), kNoticedWithin, "keepalive",
                                     "neither acknowledged nor failed");
    const RdmaCounters after = Counters();
    EXPECT_GT(after.keepalives, before.keepalives);
    EXPECT_EQ(after.keepalives_behind_reads, before.keepalives_behind_reads)
        << "counted behind a READ with none in flight";
  }
  s.good->Close();
}

// A client that vanishes while the server READs its request's payload: the
// READ gets no answer, and the server ends that connection only. With 6
// retries the device fails the READ (RETRY_EXC_ERR). With 7, Soft-RoCE
// retries it for ever, and the keepalive that goes out behind it cannot
// complete before it, so the server gives up on the READ itself at twice
// the device's retry time plus its bytes at kSlowestReadBytesPerSecond.
TEST(RdmaBadInput, ClientThatVanishesMidReadIsNoticedEvenWhereTheDeviceRetriesForEver) {
  ServerWithGoodClient s;
  // Long enough that the READ is still running, or not yet started, when
  // the client vanishes just after its request went out.
  constexpr uint32_t kPayload = 8u << 20;
  ASSERT_TRUE(s.Start(16u << 20));
  for (const uint8_t retry_count : {uint8_t{6}, uint8_t{7}}) {
    SCOPED_TRACE(absl::StrCat("the client asked for ", retry_count, " retries"));
    RawPeer peer;
    ASSERT_EQ(peer.Connect(s.server.listener->address(), retry_count), "");
    auto exposed = peer.Expose(kPayload);
    ASSERT_TRUE(exposed.has_value()) << "could not register the payload";
    Header request = SmallRequest(1, kPayload);
    request.flags = kFlagRemotePayload;
    request.remote = *exposed;
    const RdmaCounters before = Counters();
    ASSERT_TRUE(peer.Send(Frame(request)));
    ASSERT_TRUE(peer.Vanish());
    // Twice the retry time (~1 s at kPeerTimeoutMs) plus 8 MiB at 4 MiB/s,
    // the sweep and the VM's slowness.
    s.ExpectOnlyTheVanishedClientCut(retry_count, absl::Now(), absl::Seconds(8), "RDMA READ",
                                     "neither completed nor failed");
    const RdmaCounters after = Counters();
    EXPECT_GT(after.reads, before.reads) << "the server never READ";
    // Retried for ~3 s, far past kKeepaliveMs: the READ got a keepalive
    // behind it, as a READ the device left unsent would.
    if (retry_count == 7) {
      EXPECT_GT(after.keepalives_behind_reads, before.keepalives_behind_reads)
          << "no keepalive went out behind the stalled READ";
    }
  }
  s.good->Close();
}

// `client` connects to `raw_server` (listening at `address`), which accepts;
// what Accept said goes to `accepted`.
absl::StatusOr<std::shared_ptr<Connection>> ConnectToRawServer(RdmaTransport& client,
                                                               RawPeer& raw_server,
                                                               const Address& address,
                                                               ConnectionObserver* observer,
                                                               std::string* accepted) {
  auto connecting = std::async(std::launch::async, [&] {
    return client.Connect(address, observer, SteadyNow() + absl::Seconds(30));
  });
  *accepted = raw_server.Accept();
  return connecting.get();
}

// Records how its connection ended, and each message's header and
// payload_status (not its payload, which belongs to the transport).
class EndWatcher : public ConnectionObserver {
 public:
  struct Delivered {
    Header header;
    absl::Status payload_status;
    size_t payload_size = 0;
  };
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    delivered_.push_back({msg.header, msg.payload_status, msg.payload.size()});
  }
  // The next message delivered, or nullopt when none comes within `timeout`.
  std::optional<Delivered> NextWithin(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!delivered_.empty()) {
          Delivered next = std::move(delivered_.front());
          delivered_.erase(delivered_.begin());
          return next;
        }
        if (absl::Now() > until) return std::nullopt;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!why_.has_value()) why_ = why;
  }
  std::optional<absl::Status> EndedWithin(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (why_.has_value() || absl::Now() > until) return why_;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  std::mutex mu_;
  std::optional<absl::Status> why_;
  std::vector<Delivered> delivered_;
};

// An rdmarpc client transport named `name`, connected to a raw server.
struct ClientOfRawServer {
  RawPeer raw_server;
  EndWatcher watcher;  // outlives the transport, which calls it
  std::unique_ptr<RdmaTransport> client;
  std::shared_ptr<Connection> conn;

  // "" or what failed.
  std::string Connect(const char* name, const RdmaOptions& options,
                      TransportOptions co = TransportOptions()) {
    const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
    if (ip.empty()) return "no RDMA test address";
    const std::optional<Address> address = raw_server.Listen(ip);
    if (!address.has_value()) return "the raw server cannot listen";
    co.name = name;
    client = std::make_unique<RdmaTransport>(co, options, false);
    std::string accepted;
    auto connected = ConnectToRawServer(*client, raw_server, *address, &watcher, &accepted);
    if (!accepted.empty()) return "the raw server's accept: " + accepted;
    if (!connected.ok()) return connected.status().ToString();
    conn = *std::move(connected);
    return "";
  }
};

// A server whose machine vanishes while a request waits for its answer:
// nothing of the client's is outstanding on the wire, so only the client's
// keepalive can notice. The connection ends UNAVAILABLE naming the server,
// which ends the calls waiting on it (the runtime's rule). The request has
// no deadline and a large payload still advertised for the server's READ:
// neither may keep the keepalive from going out.
TEST(RdmaBadInput, ServerThatVanishesIsNoticedByTheClientsKeepalive) {
  ClientOfRawServer c;
  ASSERT_EQ(c.Connect("keepalive-client", KeepaliveOptions()), "");
  RawPeer& raw_server = c.raw_server;
  EndWatcher& watcher = c.watcher;
  std::shared_ptr<Connection>& conn = c.conn;
  OutboundMessage request;
  request.header.kind = MessageKind::kRequest;
  request.header.call_id = 1;
  auto payload = conn->AllocatePayload(1u << 20);
  ASSERT_TRUE(payload.ok()) << payload.status();
  request.payload = std::move(*payload);
  ASSERT_TRUE(conn->Send(std::move(request)).ok());
  auto received = raw_server.NextFrame(absl::Seconds(10));
  ASSERT_TRUE(received.has_value() && received->call_id == 1) << "the request never arrived";
  ASSERT_TRUE(received->remote_payload()) << "1 MiB went by SEND, not advertised for READ";
  const uint64_t keepalives_before = Counters().keepalives;
  EXPECT_FALSE(watcher.EndedWithin(absl::Milliseconds(3 * kKeepaliveMs)).has_value())
      << "a live server's connection ended";
  EXPECT_GT(Counters().keepalives, keepalives_before) << "a silent peer was not probed";

  ASSERT_TRUE(raw_server.Vanish());
  const absl::Time vanished = absl::Now();
  auto why = watcher.EndedWithin(kNoticedWithin);
  ASSERT_TRUE(why.has_value()) << "the client never noticed";
  EXPECT_EQ(why->code(), absl::StatusCode::kUnavailable) << *why;
  EXPECT_NE(
      why->message().find("keepalive (a zero-byte RDMA WRITE) to " + std::string(conn->peer())),
      std::string::npos)
      << *why;
  EXPECT_NE(why->message().find("peer_timeout_ms"), std::string::npos) << *why;
  printf("noticed after %s: %s\n", absl::FormatDuration(absl::Now() - vanished).c_str(),
         std::string(why->message()).c_str());
}

// The same check on a client: a server that sends it more frames than its
// window, while the client's I/O thread is held, loses the connection.
TEST(RdmaBadInput, AServerThatSendsWithoutCreditLosesItsConnection) {
  ClientOfRawServer c;
  ASSERT_EQ(c.Connect("credit-client", RdmaOptions()), "");
  const uint32_t window = c.raw_server.granted_window;
  ASSERT_GT(window, 0u);
  const uint64_t without_credit_before = Counters().frames_without_credit;
  {
    IoHold hold(std::static_pointer_cast<RdmaConnection>(c.conn)->endpoint());
    ASSERT_TRUE(hold.Held());
    for (uint64_t id = 1; id <= window + 1; ++id) {
      Header response;
      response.kind = MessageKind::kResponse;
      response.call_id = id;
      ASSERT_TRUE(c.raw_server.Send(Frame(response))) << "frame " << id;
    }
  }
  auto why = c.watcher.EndedWithin(absl::Seconds(10));
  ASSERT_TRUE(why.has_value()) << "the client kept the connection";
  EXPECT_EQ(why->code(), absl::StatusCode::kInternal) << *why;
  EXPECT_TRUE(absl::StrContains(why->message(), "frame without credit from rdma://")) << *why;
  EXPECT_TRUE(
      absl::StrContains(why->message(), absl::StrCat("sent 1 frame past its window of ", window)))
      << *why;
  EXPECT_EQ(Counters().frames_without_credit - without_credit_before, 1u);
}

// The same bound on a client, learnt from the server's handshake once
// rdma_cm reports it: a raw server that granted 4 of at most 8 returns 4
// (kept), then 1 more (the connection ends).
TEST(RdmaBadInput, AServerThatReturnsCreditPastItsWindowLosesItsConnection) {
  ClientOfRawServer c;
  c.raw_server.our_window = 4;
  c.raw_server.our_largest_window = 8;
  ASSERT_EQ(c.Connect("credit-client", RdmaOptions()), "");
  const uint64_t unwarranted_before = Counters().unwarranted_control_frames;
  ASSERT_TRUE(c.raw_server.Send(CreditFrame(4)));
  EXPECT_FALSE(c.watcher.EndedWithin(absl::Milliseconds(500)).has_value())
      << "a server at its largest window lost its connection";
  ASSERT_TRUE(c.raw_server.Send(CreditFrame(1)));
  auto why = c.watcher.EndedWithin(absl::Seconds(10));
  ASSERT_TRUE(why.has_value()) << "the client kept the connection";
  EXPECT_EQ(why->code(), absl::StatusCode::kInternal) << *why;
  EXPECT_TRUE(absl::StrContains(why->message(), "credit past its window from rdma://")) << *why;
  EXPECT_TRUE(
      absl::StrContains(why->message(), "returned 1 credit more than its largest window, 8,"))
      << *why;
  EXPECT_EQ(Counters().unwarranted_control_frames - unwarranted_before, 1u);
}

// Private data that is not an rdmarpc handshake of our version: none at all,
// another protocol's bytes, or a version we do not speak.
std::vector<std::pair<const char*, std::string>> ForeignHandshakes() {
  Handshake other_version;
  other_version.version = Handshake::kVersion + 1;
  other_version.credits = kRawRecvs;
  other_version.slot_size = kRawSlot;
  std::string other(sizeof other_version, '\0');
  memcpy(other.data(), &other_version, sizeof other_version);
  return {{"no private data", ""},
          {"another protocol's bytes", "GET / HTTP/1.1\r\n"},
          {"handshake version kVersion + 1", other}};
}

// A client the server cannot serve is refused at connect (REJECTED, nothing
// allocated for it past the request), the refusal says why, and the server
// goes on serving: one whose rdma_cm private data is not an rdmarpc
// handshake, and one the server cannot create a queue pair for
// (rdma_create_qp failing: ENOMEM).
TEST(RdmaBadInput, ClientsTheServerCannotServeAreRefusedSayingWhy) {
  GoodClient good_observer;  // outlives the transports, which call it
  Server server;
  ASSERT_TRUE(server.Start(1u << 20));
  auto good = server.ConnectGoodClient(&good_observer);
  ASSERT_TRUE(good.ok()) << good.status();
  uint64_t good_id = 1;
  ASSERT_TRUE(good_observer.Call(**good, good_id++).ok());
  auto refused = [&](RawPeer& peer, const std::string& why) {
    EXPECT_EQ(peer.Connect(server.listener->address()), "rejected");
    EXPECT_NE(peer.rejection.find(absl::StrCat(kRefusalPrefix, why)), std::string::npos)
        << "the refusal does not say why: " << peer.rejection;
    EXPECT_TRUE(good_observer.Call(**good, good_id++).ok()) << "the good client was not served";
  };
  for (const auto& [what, bytes] : ForeignHandshakes()) {
    SCOPED_TRACE(what);
    RawPeer peer;
    peer.private_data = bytes;
    const bool versioned = absl::string_view(what).find("version") != absl::string_view::npos;
    refused(peer, versioned
                      ? absl::StrCat("it speaks rdmarpc handshake version ",
                                     Handshake::kVersion + 1, ", we speak ", Handshake::kVersion)
                      : "no rdmarpc handshake in the private data (not an rdmarpc client?)");
  }
  {
    SCOPED_TRACE("a window past its largest");
    RawPeer peer;
    peer.our_window = 8;
    peer.our_largest_window = 4;
    refused(peer, "its handshake grants a window of 8 past its largest, 4");
  }
  {
    SCOPED_TRACE("no queue pair");
    RawPeer peer;  // makes its own queue pair, with verbs
    const size_t reserved = server.transport->completion_queue_use().reserved;
    FaultInjection::FailQpCreations() = 1;
    refused(peer, "rdma_create_qp on ");
    EXPECT_EQ(FaultInjection::FailQpCreations().exchange(0), 0);
    EXPECT_NE(peer.rejection.find(strerror(ENOMEM)), std::string::npos) << peer.rejection;
    EXPECT_EQ(server.transport->completion_queue_use().reserved, reserved)
        << "a queue pair never created kept its room on the completion queue";
  }
  EXPECT_EQ(server.answerer.closed_count(), 0u) << "a refused client got a connection";
  (*good)->Close();
}

// A server's response that advertises more than the client can take: past
// its max_message_size, or past the registered memory it may READ into
// (RdmaOptions::max_registered_bytes). That message comes to the runtime
// RESOURCE_EXHAUSTED naming the bound, with nothing READ, and the server is
// told at once that it may reuse its buffer (a kRelease with the response's
// token) rather than only at its release timeout. The connection goes on:
// a response that fits is READ.
TEST(RdmaBadInput, ResponseTheClientCannotTakeIsRefusedUnreadAndReleased) {
  constexpr uint32_t kMiB = 1u << 20;
  constexpr uint32_t kBound = 4 * kMiB;  // the client's registered memory
  constexpr uint32_t kMaxMessage = 16 * kMiB;
  RdmaOptions options;
  options.max_registered_bytes = kBound;
  TransportOptions co;
  co.max_message_size = kMaxMessage;
  ClientOfRawServer c;
  ASSERT_EQ(c.Connect("response-client", options, co), "");
  // One registered region; each response advertises a length of it.
  const std::optional<RemoteDescriptor> exposed = c.raw_server.Expose(2 * kMaxMessage);
  ASSERT_TRUE(exposed.has_value()) << "could not register the responses";
  struct Case {
    const char* what;
    uint32_t length;
    std::vector<std::string> named;  // in the refusal; none: it fits
  };
  const Case cases[] = {
      {"past max_message_size", 2 * kMaxMessage, {"max_message_size", std::to_string(kMaxMessage)}},
      {"past max_registered_bytes",
       2 * kBound,
       {"registered memory on ", "max_registered_bytes", std::to_string(kBound)}},
      {"within both", kMiB, {}},
  };
  uint64_t call_id = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ++call_id;
    OutboundMessage request;
    request.header.kind = MessageKind::kRequest;
    request.header.call_id = call_id;
    ASSERT_TRUE(c.conn->Send(std::move(request)).ok());
    const std::optional<Header> received = c.raw_server.NextFrame(absl::Seconds(10));
    ASSERT_TRUE(received.has_value() && received->call_id == call_id)
        << "the request never arrived";
    Header response;
    response.kind = MessageKind::kResponse;
    response.call_id = call_id;
    response.flags = kFlagRemotePayload;
    response.payload_len = k.length;
    response.remote = *exposed;
    response.remote.token = 100 + call_id;
    const RdmaCounters before = Counters();
    ASSERT_TRUE(c.raw_server.Send(Frame(response)));
    const auto delivered = c.watcher.NextWithin(absl::Seconds(10));
    ASSERT_TRUE(delivered.has_value()) << "the response never came to the runtime";
    EXPECT_EQ(delivered->header.call_id, call_id);
    const RdmaCounters after = Counters();
    if (k.named.empty()) {
      EXPECT_TRUE(delivered->payload_status.ok()) << delivered->payload_status;
      EXPECT_EQ(delivered->payload_size, k.length);
      EXPECT_EQ(after.bytes_read - before.bytes_read, k.length);
    } else {
      EXPECT_EQ(delivered->payload_status.code(), absl::StatusCode::kResourceExhausted)
          << delivered->payload_status;
      for (const std::string& part : k.named) {
        EXPECT_TRUE(absl::StrContains(delivered->payload_status.message(), part))
            << "\"" << part << "\" not in: " << delivered->payload_status;
      }
      EXPECT_EQ(after.reads, before.reads) << "it READ a payload it had no room for";
    }
    const std::optional<Header> release = c.raw_server.NextFrame(absl::Seconds(10));
    ASSERT_TRUE(release.has_value()) << "the server was never told it may reuse its buffer";
    EXPECT_EQ(release->kind, MessageKind::kRelease);
    EXPECT_EQ(release->remote.token, response.remote.token);
  }
  EXPECT_FALSE(c.watcher.EndedWithin(absl::Milliseconds(100)).has_value())
      << "the connection ended";
}

// A server whose rdma_cm private data is not an rdmarpc handshake, or one
// that breaks its own bound: the connect fails UNAVAILABLE saying so,
// instead of a connection that would misread every frame.
TEST(RdmaBadInput, ServerWithoutOurHandshakeIsAClearConnectError) {
  const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  // The connect's failure, naming the server.
  auto connect_fails = [&](RawPeer& raw_server) -> absl::Status {
    const std::optional<Address> address = raw_server.Listen(ip);
    if (!address.has_value()) return absl::InternalError("the raw server cannot listen");
    EndWatcher watcher;  // outlives the transport, which calls it
    TransportOptions co;
    co.name = "handshake-client";
    RdmaTransport client(co, RdmaOptions(), false);
    std::string accepted;  // "accept" when the client drops it at once
    auto conn = ConnectToRawServer(client, raw_server, *address, &watcher, &accepted);
    EXPECT_FALSE(conn.ok()) << "connected to a server that sent no valid rdmarpc handshake";
    if (conn.ok()) return absl::OkStatus();
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable) << conn.status();
    EXPECT_NE(conn.status().message().find(address->host), absl::string_view::npos)
        << "the error should name the server: " << conn.status();
    return conn.status();
  };
  for (const auto& [what, bytes] : ForeignHandshakes()) {
    SCOPED_TRACE(what);
    RawPeer raw_server;
    raw_server.private_data = bytes;
    const absl::Status failed = connect_fails(raw_server);
    const bool versioned = absl::string_view(what).find("version") != absl::string_view::npos;
    const std::string expected =
        versioned
            ? absl::StrCat("the server speaks rdmarpc handshake version ", Handshake::kVersion + 1)
            : "not an rdmarpc server?";
    EXPECT_TRUE(absl::StrContains(failed.message(), expected)) << failed;
  }
  {
    SCOPED_TRACE("a window past its largest");
    RawPeer raw_server;
    raw_server.our_window = 8;
    raw_server.our_largest_window = 4;
    const absl::Status failed = connect_fails(raw_server);
    EXPECT_TRUE(absl::StrContains(
        failed.message(), "the server's handshake grants a window of 8 past its largest, 4"))
        << failed;
  }
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
