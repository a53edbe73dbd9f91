// Hostile and broken servers over raw TCP: what a client's calls end with when
// the peer answers with bytes that do not parse, bad metadata, a status code
// that does not exist, a payload over the channel's limit, answers to calls
// nobody made, or garbage. Each bad answer ends only its own call, with a
// status naming what was wrong; lost framing ends the connection's calls
// UNAVAILABLE, and the channel connects again for the next call; under a
// RetryPolicy the lost call is sent again. A GOAWAY that comes as the
// connection is made is acknowledged, calls it kept from being sent get one
// more connection, and a draining connection is closed once its last call
// ends. Calls a lost connection kept from being sent go on the next one.
// A server that never reads pins no more of the client's memory than the
// channel's TcpOptions allow. An address that is no rdmarpc server's fails
// the connect, naming what came.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/echo_service.h"
#include "tests/raw_connection.h"
#include "transport/wire_format.h"

namespace rdmarpc::testing {
namespace {

using transport::Header;
using transport::MessageKind;

// One asynchronous call and what it ended with. (A std::mutex, not an
// absl::Notification: TSan sees only what is built with it, and Debian's
// abseil is not.)
struct PendingCall {
  // With `tagged`, the request carries metadata "call-data" = `data`.
  PendingCall(Channel& ch, const std::string& data, bool wait_for_ready = false,
              bool tagged = false) {
    ctx.set_timeout(absl::Seconds(20));
    ctx.set_wait_for_ready(wait_for_ready);
    if (tagged) ctx.AddMetadata("call-data", data);
    request.set_data(data);
    ch.CallAsync(kEcho, &ctx, request, &response, [this](Status s) {
      std::lock_guard<std::mutex> lock(mu);
      status = std::move(s);
      done = true;
      cv.notify_all();
    });
  }
  // True when the call ended within `timeout`.
  bool Ended(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [this] { return done; });
  }
  // The final status; DEADLINE_EXCEEDED from the test itself if none came.
  Status Wait() {
    if (!Ended(std::chrono::seconds(30))) {
      return Status(StatusCode::kDeadlineExceeded, "test: the call never ended");
    }
    std::lock_guard<std::mutex> lock(mu);
    return status;
  }

  ClientContext ctx;
  EchoRequest request;
  EchoResponse response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;  // guarded by mu
  Status status;      // guarded by mu
};

// A server's GOAWAY: it is shutting down, no new call on this connection.
Header GoAway() {
  Header h;
  h.kind = MessageKind::kGoAway;
  return h;
}

class BadServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ChannelOptions options;
    options.max_message_size = 1 << 20;
    auto ch = Channel::Create(server_.address(), options);
    ASSERT_TRUE(ch.ok()) << ch.status();
    channel_ = *ch;
  }
  // Starts a call and reads its request on peer_ (accepted first when null).
  std::unique_ptr<PendingCall> StartCall(Header* request, const std::string& data = "hello") {
    auto call = std::make_unique<PendingCall>(*channel_, data);
    if (!peer_) peer_ = server_.Accept();
    EXPECT_TRUE(peer_) << "the channel never connected";
    if (!peer_) return call;
    auto f = peer_->ReadFrame();
    EXPECT_TRUE(f) << "the request never arrived";
    if (f) *request = f->header;
    return call;
  }
  // What one call ends with when the server answers it with this frame.
  Status CallAnsweredWith(uint16_t status, const std::string& metadata,
                          const std::string& payload) {
    Header req;
    auto call = StartCall(&req);
    if (!peer_) return Status(StatusCode::kUnavailable, "test: no connection");
    peer_->SendFrame(Response(req.call_id, status), metadata, payload);
    Status s = call->Wait();
    EXPECT_TRUE(call->ctx.server_metadata().empty());
    return s;
  }
  // A well-formed exchange on the same connection: the bad answer before it
  // ended only its own call.
  void ExpectNextCallServed() {
    Header req;
    auto call = StartCall(&req, "again");
    ASSERT_TRUE(peer_);
    peer_->SendFrame(Response(req.call_id), "", EchoResponseBytes("again"));
    Status s = call->Wait();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(call->response.data(), "again");
  }

  RawServer server_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<RawConnection> peer_;
};

TEST_F(BadServerTest, UnparsableResponseEndsTheCallInternal) {
  Status s = CallAnsweredWith(0, "", std::string("\xff\xff\xff\xff\xff", 5));
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("from " + server_.address() +
                             " does not parse as rdmarpc.test.EchoResponse"),
            absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(kEcho.full_name), absl::string_view::npos) << s;
  ExpectNextCallServed();
}

TEST_F(BadServerTest, BadResponseMetadataEndsTheCallInternalNamingThePeer) {
  // An entry that claims a 255-byte value in a 9-byte block.
  Status s = CallAnsweredWith(0, std::string("\x03\x00\xff\x00\x00\x00key", 9),
                              EchoResponseBytes("hello"));
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("bad response metadata from " + server_.address()),
            absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(kEcho.full_name), absl::string_view::npos) << s;
  ExpectNextCallServed();
}

// Status payloads travel as reserved metadata entries: one whose type URL
// length runs past its end is bad metadata; reserved keys this client does
// not know (a newer server's) are dropped, not handed to the application.
TEST_F(BadServerTest, BadStatusPayloadEndsTheCallInternalAndUnknownReservedKeysAreDropped) {
  const std::string user = transport::EncodeMetadata({{"user-key", "v"}});
  const std::string lying = transport::EncodeMetadata(
      {{std::string(transport::kStatusPayloadKey), std::string("\x09\x00url", 5)}});
  Status s =
      CallAnsweredWith(static_cast<uint16_t>(StatusCode::kAborted), user + lying, "conflict");
  EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("bad response metadata from " + server_.address() +
                             ": a status payload entry of 5 bytes"),
            absl::string_view::npos)
      << s;
  EXPECT_NE(s.message().find(kEcho.full_name), absl::string_view::npos) << s;

  Header req;
  auto call = StartCall(&req, "newer");
  ASSERT_TRUE(peer_);
  absl::Status sent(absl::StatusCode::kAborted, "conflict");
  sent.SetPayload("example.com/Detail", absl::Cord("detail"));
  peer_->SendFrame(Response(req.call_id, static_cast<uint16_t>(StatusCode::kAborted)),
                   user + transport::EncodeMetadata({{"rdmarpc-newer", "x"}}) +
                       transport::EncodeStatusPayloads(sent),
                   "conflict");
  EXPECT_EQ(call->Wait(), sent);
  EXPECT_EQ(call->ctx.server_metadata(), (transport::Metadata{{"user-key", "v"}}));
  ExpectNextCallServed();
}

TEST_F(BadServerTest, StatusCodeThatDoesNotExistEndsTheCallUnknown) {
  Status s = CallAnsweredWith(/*status=*/999, "", "made-up failure");
  EXPECT_EQ(s.code(), StatusCode::kUnknown) << s;
  EXPECT_NE(s.message().find("status code 999 from " + server_.address()),
            absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("made-up failure"), absl::string_view::npos) << s;
  ExpectNextCallServed();
}

TEST_F(BadServerTest, ResponseOverTheChannelLimitEndsTheCallResourceExhausted) {
  Status s = CallAnsweredWith(0, "", EchoResponseBytes(std::string(2 << 20, 'x')));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("1048576"), absl::string_view::npos) << s;
  ExpectNextCallServed();
}

TEST_F(BadServerTest, AnswersToCallsNobodyMadeAreIgnored) {
  Header req;
  auto call = StartCall(&req);
  ASSERT_TRUE(peer_);
  peer_->SendFrame(Response(req.call_id + 1000), "", EchoResponseBytes("stray"));
  Header request_to_client;
  request_to_client.kind = MessageKind::kRequest;
  request_to_client.call_id = req.call_id;
  peer_->SendFrame(request_to_client, "", EchoResponseBytes("wrong way"));
  EXPECT_FALSE(call->Ended(std::chrono::milliseconds(200)));
  peer_->SendFrame(Response(req.call_id), "", EchoResponseBytes("hello"));
  Status s = call->Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(call->response.data(), "hello");
  // A second answer to the call that ended changes nothing.
  peer_->SendFrame(Response(req.call_id, /*status=*/13), "", "late duplicate");
  ExpectNextCallServed();
  EXPECT_TRUE(call->Wait().ok());
}

// A call whose context was cancelled before it started ends CANCELLED and
// puts nothing on the wire, not even a kCancel for the id it never sent.
TEST_F(BadServerTest, ACallCancelledBeforeItStartsSendsNothing) {
  ExpectNextCallServed();  // connected: the call takes the direct path
  ClientContext cancelled;
  cancelled.TryCancel();
  EchoRequest request;
  request.set_data("never");
  EchoResponse response;
  const Status s = channel_->Call(kEcho, &cancelled, request, &response);
  EXPECT_EQ(s.code(), StatusCode::kCancelled) << s;
  Header next;
  auto call = StartCall(&next, "after");
  ASSERT_TRUE(peer_);
  EXPECT_EQ(next.kind, MessageKind::kRequest)
      << "a frame of kind " << static_cast<int>(next.kind) << " came first";
  peer_->SendFrame(Response(next.call_id), "", EchoResponseBytes("after"));
  EXPECT_TRUE(call->Wait().ok());
}

TEST_F(BadServerTest, GarbageEndsPendingCallsUnavailableAndTheChannelReconnects) {
  Header req;
  auto call = StartCall(&req);
  ASSERT_TRUE(peer_);
  peer_->SendBytes(std::string("HTTP/1.1 400 Bad Request\r\n\r\n") + std::string(64, 'z'));
  Status s = call->Wait();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("connection to " + server_.address() + " lost"),
            absl::string_view::npos) << s;
  EXPECT_TRUE(peer_->ClosedByPeer());
  peer_.reset();
  ExpectNextCallServed();  // on a new connection
}

// A tcp:// address that is not an rdmarpc server's (an HTTP server's here)
// fails the connect at the first bytes that come: the call ends UNAVAILABLE
// naming them as no rdmarpc peer's, at once rather than at its deadline.
TEST(NotAnRdmarpcServer, ItsFirstBytesFailTheConnectNamingWhatCame) {
  RawServer server;
  std::optional<PendingCall> call;  // before the channel, which ends it on a way out
  auto ch = Channel::Create(server.address());
  ASSERT_TRUE(ch.ok()) << ch.status();
  call.emplace(**ch, "anyone?");
  auto http = server.Accept(10000, /*hello=*/false);
  ASSERT_TRUE(http);
  // No more than the client reads: it closes with nothing unread, by a FIN.
  std::string answer = "HTTP/1.1 400 Bad Request\r\n\r\n";
  answer.resize(transport::kHeaderSize, 'z');
  http->SendBytes(answer);
  ASSERT_TRUE(call->Ended(std::chrono::seconds(10))) << "the call waited on";
  const Status s = call->Wait();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("not an rdmarpc kHello: bad magic 0x5448 (not an rdmarpc peer?)"),
            absl::string_view::npos)
      << s;
  EXPECT_EQ((*ch)->stats().connect_failures, 1u);
  EXPECT_TRUE(http->ClosedByPeer());
}

// A channel's options that send a failed call once more, 10 ms later.
ChannelOptions RetryOnce() {
  ChannelOptions options;
  options.retry.max_attempts = 2;
  options.retry.initial_backoff = absl::Milliseconds(10);
  return options;
}

// Under a RetryPolicy a call whose connection is lost after its request went
// out is sent again, on a new connection and with the same call id: the
// server sees the request twice (which RetryPolicy warns of), and the call
// succeeds.
TEST(RetryPolicy, ACallWhoseConnectionIsLostIsSentAgainOnANewOne) {
  RawServer server;
  auto ch = Channel::Create(server.address(), RetryOnce());
  ASSERT_TRUE(ch.ok()) << ch.status();
  PendingCall call(**ch, "twice");
  auto first = server.Accept();
  ASSERT_TRUE(first) << "the channel never connected";
  auto sent = first->ReadFrame();
  ASSERT_TRUE(sent) << "the request never arrived";
  first.reset();  // the connection is lost with the call pending
  auto second = server.Accept();
  ASSERT_TRUE(second) << "the call was not sent again";
  auto again = second->ReadFrame();
  ASSERT_TRUE(again) << "the request never arrived again";
  EXPECT_EQ(again->header.kind, MessageKind::kRequest);
  EXPECT_EQ(again->header.call_id, sent->header.call_id);
  EXPECT_EQ(again->payload, sent->payload);
  second->SendFrame(Response(again->header.call_id), "", EchoResponseBytes("twice"));
  const Status s = call.Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(call.response.data(), "twice");
  EXPECT_EQ((*ch)->stats().retries, 1u);
}

// A server that begins to shut down as a channel connects sends its GOAWAY
// at once, and it may come before the channel has taken the new connection
// (the transport's I/O thread reads it while the connecting thread is still
// being woken). Either way the channel acknowledges it and sends no request
// on that connection after the acknowledgment, and a wait-for-ready call
// goes to a new connection. Which order a round gets is up to the threads;
// the rounds that got the early one are counted and printed.
TEST(GoAway, OneThatComesAsTheConnectionIsMadeIsAcknowledged) {
  constexpr int kRounds = 50;
  int early = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    RawServer server;
    ChannelOptions options;
    options.reconnect_backoff = absl::Milliseconds(10);
    options.reconnect_backoff_max = absl::Milliseconds(10);
    auto ch = Channel::Create(server.address(), options);
    ASSERT_TRUE(ch.ok()) << ch.status();
    PendingCall call(**ch, "late", /*wait_for_ready=*/true);
    auto first = server.Accept();
    ASSERT_TRUE(first) << "the channel never connected";
    first->SendFrame(GoAway(), "", "");
    std::optional<RawConnection::Frame> request;  // the call's, if it came on `first`
    bool acknowledged = false;
    while (auto f = first->ReadFrame()) {
      if (f->header.kind == MessageKind::kGoAway) {
        acknowledged = true;
        break;
      }
      EXPECT_EQ(f->header.kind, MessageKind::kRequest);
      request = std::move(f);
    }
    ASSERT_TRUE(acknowledged) << "the GOAWAY was never acknowledged";
    std::unique_ptr<RawConnection> second;
    RawConnection* answering = first.get();
    if (!request) {
      ++early;
      second = server.Accept();
      ASSERT_TRUE(second) << "the call never came on a new connection";
      request = second->ReadFrame();
      ASSERT_TRUE(request) << "the request never arrived";
      answering = second.get();
    }
    answering->SendFrame(Response(request->header.call_id), "", EchoResponseBytes("late"));
    const Status s = call.Wait();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ((*ch)->stats().go_aways, 1u);
  }
  printf("the GOAWAY came before the channel took its connection in %d of %d rounds\n", early,
         kRounds);
}

// Answers request `f` on `peer` with its own bytes and metadata.
void Echo(RawConnection& peer, const RawConnection::Frame& f) {
  peer.SendFrame(Response(f.header.call_id), f.metadata, f.payload);
}

// Sends a GOAWAY on `peer` and echoes each request that comes until the
// acknowledgment (true) or a 10 s silence (false). `answered` counts the
// requests.
bool DrainAndEchoUntilAcknowledged(RawConnection& peer, int* answered) {
  peer.SendFrame(GoAway(), "", "");
  while (auto f = peer.ReadFrame()) {
    if (f->header.kind == MessageKind::kGoAway) return true;
    EXPECT_EQ(f->header.kind, MessageKind::kRequest);
    Echo(peer, *f);
    ++*answered;
  }
  return false;
}

// A channel whose first attempt was refused, and calls that all wait for
// its next one, in one batch. Call 0 made that attempt: wait-for-ready, it
// waits for the next too; else it ended with the refusal. The others are
// wait-for-ready when `rest_wait_for_ready`. `server` listens only once the
// attempt has failed.
struct BatchBehindABackoff {
  static constexpr int kCalls = 1000;

  BatchBehindABackoff(RawServer& server, bool first_waits_for_ready,
                      bool rest_wait_for_ready = false) {
    ChannelOptions options;
    options.reconnect_backoff = absl::Milliseconds(300);
    options.reconnect_backoff_max = absl::Milliseconds(300);
    auto ch = Channel::Create(server.address(), options);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return;
    channel = *ch;
    calls.push_back(std::make_unique<PendingCall>(*channel, "0", first_waits_for_ready,
                                                  /*tagged=*/true));
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (channel->stats().connect_failures == 0 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(channel->stats().connect_failures, 1u) << "the first attempt was not refused";
    server.Listen();
    for (int i = 1; i < kCalls; ++i) {
      calls.push_back(std::make_unique<PendingCall>(*channel, absl::StrCat(i), rest_wait_for_ready,
                                                    /*tagged=*/true));
    }
    // Else the backoff ended before the last call was made (a very slow
    // machine), and they may not all be in one batch.
    in_one_batch = channel->stats().connect_attempts == 1;
  }
  bool AllEnded() {
    for (auto& call : calls) {
      if (!call->Ended(std::chrono::milliseconds(0))) return false;
    }
    return true;
  }
  // The next connection of the batch's calls, as soon as it is made; with
  // `adopted`, once the channel has also taken it for its calls (READY).
  // Null when none comes within `timeout`, or when every call has ended.
  std::unique_ptr<RawConnection> NextConnection(RawServer& server, bool adopted,
                                                absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    std::unique_ptr<RawConnection> peer;
    while (!peer && !AllEnded() && absl::Now() < give_up) peer = server.Accept(10);
    if (peer && adopted) {
      ChannelState state = channel->GetState(false);
      while (state != ChannelState::kReady && absl::Now() < give_up) {
        channel->WaitForStateChange(state, give_up);
        state = channel->GetState(false);
      }
    }
    return peer;
  }
  // Checks how each call ended, from `from` on; an OK one must have been
  // echoed, its own bytes and metadata (which a call sent on a later
  // connection than the one it first waited for still carries).
  void ExpectEnded(int from, const std::function<void(int, const Status&)>& check) {
    for (int i = from; i < kCalls; ++i) {
      const Status s = calls[i]->Wait();
      check(i, s);
      if (s.ok()) {
        EXPECT_EQ(calls[i]->response.data(), absl::StrCat(i));
        EXPECT_EQ(calls[i]->ctx.server_metadata(), Metadata({{"call-data", absl::StrCat(i)}}))
            << "call " << i;
      }
    }
  }

  std::vector<std::unique_ptr<PendingCall>> calls;  // outlive the channel
  std::shared_ptr<Channel> channel;
  bool in_one_batch = false;
};

// Calls that wait for a connection and find it drained, by a GOAWAY as it
// was made or before the connector sent them, were never seen by the
// server: they go on the next connection, wait-for-ready or not, as calls
// made a moment later would. Even rounds drain the connection as soon as it
// is made (the GOAWAY mostly comes before the channel takes it), odd ones
// once the channel has taken it (the GOAWAY comes while the connector sends
// the batch, or after).
TEST(GoAway, CallsItKeptFromBeingSentGoOnTheNextConnection) {
  int exercised[2] = {0, 0};
  for (int round = 0; round < 30 && (exercised[0] < 2 || exercised[1] < 2); ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const bool adopted = round % 2;
    RawServer server(/*listening=*/false);
    BatchBehindABackoff batch(server, /*first_waits_for_ready=*/true);
    ASSERT_TRUE(batch.channel);
    if (!batch.in_one_batch) continue;
    auto first = batch.NextConnection(server, adopted, absl::Seconds(10));
    ASSERT_TRUE(first) << "the channel never connected";
    int answered = 0;
    ASSERT_TRUE(DrainAndEchoUntilAcknowledged(*first, &answered))
        << "the GOAWAY was never acknowledged";
    const int left = BatchBehindABackoff::kCalls - answered;
    if (left > 0) {
      ++exercised[adopted];
      auto second = batch.NextConnection(server, false, absl::Seconds(10));
      ASSERT_TRUE(second) << left << " calls not sent on the drained connection never came again";
      for (int i = 0; i < left; ++i) {
        auto f = second->ReadFrame();
        ASSERT_TRUE(f) << "only " << i << " of the " << left
                       << " calls came on the next connection";
        Echo(*second, *f);
      }
    }
    batch.ExpectEnded(0, [](int i, const Status& s) { EXPECT_TRUE(s.ok()) << i << ": " << s; });
    EXPECT_EQ(batch.channel->stats().go_aways, 1u);
    printf("round %d: %d calls went on the drained connection, %d on the next\n", round, answered,
           left);
  }
  EXPECT_GT(exercised[0], 0) << "no GOAWAY as the connection was made kept a call from it";
  EXPECT_GT(exercised[1], 0) << "the GOAWAY never came before the last call of the batch was sent";
}

// A call gets one more attempt after a GOAWAY, not more: against a server
// that drains every connection, the calls it kept from being sent twice
// end UNAVAILABLE naming the server's shutdown, after two connections.
TEST(GoAway, ACallItKeptFromBeingSentTwiceEndsNamingTheShutdown) {
  int exercised[2] = {0, 0};
  for (int round = 0; round < 30 && (exercised[0] < 2 || exercised[1] < 2); ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const bool adopted = round % 2;
    RawServer server(/*listening=*/false);
    BatchBehindABackoff batch(server, /*first_waits_for_ready=*/false);
    ASSERT_TRUE(batch.channel);
    if (!batch.in_one_batch) continue;
    int answered = 0;
    std::vector<std::unique_ptr<RawConnection>> peers;
    // A third connection is not expected: it is waited for briefly.
    while (auto peer =
               batch.NextConnection(server, adopted, absl::Seconds(peers.size() < 2 ? 10 : 1))) {
      ASSERT_TRUE(DrainAndEchoUntilAcknowledged(*peer, &answered))
          << "the GOAWAY was never acknowledged";
      peers.push_back(std::move(peer));
    }
    int refused = 0;
    batch.ExpectEnded(1, [&](int i, const Status& s) {
      if (s.ok()) return;
      ++refused;
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << i << ": " << s;
      EXPECT_NE(s.message().find("is shutting down (GOAWAY"), std::string::npos) << i << ": " << s;
    });
    if (refused > 0) {
      ++exercised[adopted];
      EXPECT_EQ(peers.size(), 2u) << "calls not sent had more than one more attempt";
    }
    printf("round %d: %d calls answered, %d refused, on %zu connections\n", round, answered,
           refused, peers.size());
  }
  EXPECT_GT(exercised[0], 0) << "no GOAWAY as the connection was made kept a call from it";
  EXPECT_GT(exercised[1], 0) << "the GOAWAY never came before the last call of the batch was sent";
}

// Calls that find their connection lost before the connector sent them go
// on the next one, wait-for-ready or not: the server never saw them. Those
// sent on it end with its loss (without a RetryPolicy a request that went
// out is not sent again).
TEST(LostConnection, CallsItKeptFromBeingSentGoOnTheNextOne) {
  int exercised[2] = {0, 0};
  for (int round = 0; round < 60 && (exercised[0] < 2 || exercised[1] < 2); ++round) {
    const bool wait_for_ready = round % 2;
    SCOPED_TRACE(absl::StrCat("round ", round, wait_for_ready ? ", wait-for-ready" : ""));
    RawServer server(/*listening=*/false);
    BatchBehindABackoff batch(server, /*first_waits_for_ready=*/true, wait_for_ready);
    ASSERT_TRUE(batch.channel);
    if (!batch.in_one_batch) continue;
    // Closed once the channel has taken it: the loss comes while the
    // connector sends the batch, or after.
    ASSERT_TRUE(batch.NextConnection(server, /*adopted=*/true, absl::Seconds(10)))
        << "the channel never connected";
    int on_second = 0;
    if (auto second = batch.NextConnection(server, /*adopted=*/false, absl::Seconds(10))) {
      // Every call ends on the first connection or comes here.
      const absl::Time give_up = absl::Now() + absl::Seconds(20);
      while (!batch.AllEnded() && absl::Now() < give_up) {
        if (!second->Readable(10)) continue;
        auto f = second->ReadFrame();
        ASSERT_TRUE(f) << "the channel closed its new connection";
        Echo(*second, *f);
        ++on_second;
      }
    }
    int lost = 0;
    batch.ExpectEnded(0, [&](int i, const Status& s) {
      if (s.ok()) return;
      ++lost;
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << i << ": " << s;
      EXPECT_EQ(s.message().find("before the call was sent"), std::string::npos)
          << i << " was not sent, and ended instead of waiting for the next connection: " << s;
    });
    EXPECT_EQ(lost + on_second, BatchBehindABackoff::kCalls);
    if (on_second > 0) ++exercised[wait_for_ready];
    printf("round %d: %d calls lost with the connection, %d sent on the next\n", round, lost,
           on_second);
  }
  EXPECT_GT(exercised[0], 0) << "the connection was never lost before the last plain call was sent";
  EXPECT_GT(exercised[1], 0)
      << "the connection was never lost before the last wait-for-ready call was sent";
}

// The channel closes a connection the server drains once the last call on
// it has ended, and at once (after its acknowledgment) when none is: the
// server needs nothing more of it, and it is not held until the server
// closes it at the end of its shutdown.
TEST(GoAway, TheChannelClosesADrainingConnectionOnceItsLastCallEnds) {
  RawServer server;
  auto ch = Channel::Create(server.address(), ChannelOptions());
  ASSERT_TRUE(ch.ok()) << ch.status();
  PendingCall call(**ch, "last");
  auto peer = server.Accept();
  ASSERT_TRUE(peer) << "the channel never connected";
  auto request = peer->ReadFrame();
  ASSERT_TRUE(request) << "the request never arrived";
  peer->SendFrame(GoAway(), "", "");
  auto ack = peer->ReadFrame();
  ASSERT_TRUE(ack) << "the GOAWAY was never acknowledged";
  EXPECT_EQ(ack->header.kind, MessageKind::kGoAway);
  EXPECT_FALSE(peer->ClosedByPeer(200)) << "closed with a call still on it";
  peer->SendFrame(Response(request->header.call_id), "", EchoResponseBytes("last"));
  const Status s = call.Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(peer->ClosedByPeer()) << "the draining connection stayed open after its last call";

  PendingCall next(**ch, "next");
  auto idle = server.Accept();
  ASSERT_TRUE(idle) << "the next call did not connect anew";
  request = idle->ReadFrame();
  ASSERT_TRUE(request) << "the request never arrived";
  idle->SendFrame(Response(request->header.call_id), "", EchoResponseBytes("next"));
  ASSERT_TRUE(next.Wait().ok());
  idle->SendFrame(GoAway(), "", "");
  ack = idle->ReadFrame();
  ASSERT_TRUE(ack) << "the GOAWAY was never acknowledged";
  EXPECT_EQ(ack->header.kind, MessageKind::kGoAway);
  EXPECT_TRUE(idle->ClosedByPeer()) << "a draining connection with no call stayed open";
  EXPECT_EQ((*ch)->stats().go_aways, 2u);
}

// A call that leaves a draining connection for another attempt (a
// RetryPolicy) leaves it as one that ends does: the last one out closes it.
TEST(GoAway, ACallSentAgainElsewhereLeavesItsDrainingConnectionClosed) {
  RawServer server;
  auto ch = Channel::Create(server.address(), RetryOnce());
  ASSERT_TRUE(ch.ok()) << ch.status();
  PendingCall call(**ch, "again");
  auto first = server.Accept();
  ASSERT_TRUE(first) << "the channel never connected";
  auto request = first->ReadFrame();
  ASSERT_TRUE(request) << "the request never arrived";
  first->SendFrame(GoAway(), "", "");
  auto ack = first->ReadFrame();
  ASSERT_TRUE(ack) << "the GOAWAY was never acknowledged";
  first->SendFrame(
      Response(request->header.call_id, static_cast<uint16_t>(StatusCode::kUnavailable)), "",
      "server is shutting down");
  EXPECT_TRUE(first->ClosedByPeer()) << "the draining connection stayed open after the retry";
  auto second = server.Accept();
  ASSERT_TRUE(second) << "the call was not sent again";
  request = second->ReadFrame();
  ASSERT_TRUE(request) << "the request never arrived again";
  second->SendFrame(Response(request->header.call_id), "", EchoResponseBytes("again"));
  const Status s = call.Wait();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*ch)->stats().retries, 1u);
}

// The channel's TcpOptions reach its transport: with a 1 MiB send queue, a
// server that accepts and never reads makes a call fail RESOURCE_EXHAUSTED
// naming the bound after a few MiB (the sockets' buffers and the queue),
// where the default bound (256 MiB) would take all 128 MiB offered here.
TEST(TcpTunables, ChannelsSendQueueBoundLimitsWhatAStalledServerPins) {
  RawServer server;
  std::vector<std::unique_ptr<PendingCall>> calls;  // outlive the channel
  ChannelOptions options;
  options.callback_threads = 0;  // a call that fails to start ends in CallAsync
  options.transport.tcp.max_queued_send_bytes = 1 << 20;
  auto ch = Channel::Create(server.address(), options);
  ASSERT_TRUE(ch.ok()) << ch.status();
  // Connected first, so that every call is sent (or refused) in CallAsync.
  // A call made while the first one waited for the connection would wait
  // behind it and be refused later, on the connector's thread, after the
  // loop below had taken it for queued.
  auto connected = std::async(
      std::launch::async, [&] { return (*ch)->WaitForConnected(absl::Now() + absl::Seconds(10)); });
  auto peer = server.Accept();  // and never read
  ASSERT_TRUE(peer);
  ASSERT_TRUE(connected.get());
  const std::string data(128 << 10, 'q');
  calls.push_back(std::make_unique<PendingCall>(**ch, data));
  while (calls.size() < 1024 && !calls.back()->Ended(std::chrono::milliseconds(0))) {
    calls.push_back(std::make_unique<PendingCall>(**ch, data));
  }
  ASSERT_TRUE(calls.back()->Ended(std::chrono::milliseconds(0)))
      << calls.size() << " calls of 128 KiB queued for a server that does not read";
  const Status refused = calls.back()->Wait();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("TcpOptions::max_queued_send_bytes"), std::string::npos)
      << refused;
  EXPECT_GT(calls.size(), 2u) << "the bound refused a call with nothing queued";
  printf("%zu calls of 128 KiB taken before the bound refused one\n", calls.size() - 1);
  ch->reset();  // ends the calls it took
  for (size_t i = 0; i + 1 < calls.size(); ++i) {
    EXPECT_EQ(calls[i]->Wait().code(), StatusCode::kUnavailable) << i;
  }
}

}  // namespace
}  // namespace rdmarpc::testing
