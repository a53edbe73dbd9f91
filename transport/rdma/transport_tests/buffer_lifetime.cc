// What a peer may READ, and for how long (the buffer-lifetime rule in
// rdma_connection.h): a bad rkey on purpose, an old advertisement replayed,
// a request past its deadline not READ, and buffers revoked after the
// release timeout or the deadline, before or during their READ.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/transport_tests/fixture.h"

namespace rdmarpc::transport::rdma::transport_test {
namespace {

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

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
