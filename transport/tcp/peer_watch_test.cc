// PeerWatch's rule, on readings made up as TCP_INFO gives them: a peer that
// owes an answer and sends no ACK for the timeout is dead; one that answers,
// if only window probes, is not, however long it does not read.
// tcp_transport_test shows the rule on a real connection.
#include "transport/tcp/peer_watch.h"

#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(2);
const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

PeerSignals Owing(bool data, bool probe, absl::Time last_ack) {
  PeerSignals s;
  s.data_unacknowledged = data;
  s.probe_unanswered = probe;
  s.last_ack = last_ack;
  return s;
}

TEST(PeerWatch, APeerThatOwesNothingIsNeverDead) {
  PeerWatch watch(kTimeout);
  for (int i = 0; i < 100; ++i) {
    const absl::Time now = kStart + i * absl::Seconds(1);
    EXPECT_FALSE(watch.Dead(Owing(false, false, kStart - absl::Hours(1)), now)) << i;
  }
}

// Bulk data always has some in flight; ACKs keep coming.
TEST(PeerWatch, APeerThatKeepsAcknowledgingIsNotDead) {
  PeerWatch watch(kTimeout);
  for (int i = 0; i < 100; ++i) {
    const absl::Time now = kStart + i * absl::Milliseconds(500);
    EXPECT_FALSE(watch.Dead(Owing(true, false, now - absl::Milliseconds(1)), now)) << i;
  }
}

// A send after an hour without traffic (no keepalive) owes from the first
// reading that sees it, not from the hour-old ACK.
TEST(PeerWatch, DataUnacknowledgedForTheTimeoutMeansDead) {
  PeerWatch watch(kTimeout);
  const absl::Time old_ack = kStart - absl::Hours(1);
  EXPECT_FALSE(watch.Dead(Owing(true, false, old_ack), kStart));
  EXPECT_FALSE(watch.Dead(Owing(true, false, old_ack), kStart + kTimeout - absl::Milliseconds(1)));
  EXPECT_TRUE(watch.Dead(Owing(true, false, old_ack), kStart + kTimeout));
}

TEST(PeerWatch, AnAckWhileOwingStartsTheWaitAgain) {
  PeerWatch watch(kTimeout);
  EXPECT_FALSE(watch.Dead(Owing(true, false, kStart), kStart));
  const absl::Time ack = kStart + absl::Milliseconds(1500);
  EXPECT_FALSE(watch.Dead(Owing(true, false, ack), kStart + kTimeout));
  EXPECT_FALSE(watch.Dead(Owing(true, false, ack), ack + kTimeout - absl::Milliseconds(1)));
  EXPECT_TRUE(watch.Dead(Owing(true, false, ack), ack + kTimeout));
}

// A peer that does not read: its window stays closed and the kernel's
// probes, further and further apart, are each answered an RTT later. A
// reading in that RTT sees a probe out and the last ACK a long gap ago.
TEST(PeerWatch, APeerAnsweringWindowProbesIsNotDeadHoweverLongItDoesNotRead) {
  PeerWatch watch(kTimeout);
  absl::Time answered = kStart;
  absl::Duration gap = absl::Milliseconds(200);
  for (int probe = 0; probe < 12; ++probe) {
    const absl::Time sent = answered + gap;
    EXPECT_FALSE(watch.Dead(Owing(false, false, answered), sent - absl::Milliseconds(1)));
    EXPECT_FALSE(watch.Dead(Owing(false, true, answered), sent + absl::Microseconds(10)))
        << "probe " << probe << ", " << gap << " after the last answer";
    answered = sent + absl::Microseconds(50);
    gap *= 2;
  }
}

// The same peer dies with its window closed: the next probe goes
// unanswered, and a timeout later the connection is dead.
TEST(PeerWatch, APeerThatDiesWithItsWindowClosedIsDeadATimeoutAfterAProbeGoesUnanswered) {
  PeerWatch watch(kTimeout);
  const absl::Time answered = kStart;
  const absl::Time probe = kStart + absl::Seconds(6);
  EXPECT_FALSE(watch.Dead(Owing(false, false, answered), probe - absl::Milliseconds(1)));
  EXPECT_FALSE(watch.Dead(Owing(false, true, answered), probe));
  EXPECT_FALSE(watch.Dead(Owing(false, true, answered), probe + kTimeout - absl::Milliseconds(1)));
  EXPECT_TRUE(watch.Dead(Owing(false, true, answered), probe + kTimeout));
}

// Linux leaves a probe unanswered when it answered one less than
// tcp_invalid_ratelimit (500 ms) before; the next probe, up to twice as far
// out, is answered. A short timeout does not take that for death.
TEST(PeerWatch, AProbeLeftUnansweredByTheRateLimitIsNotDeathUnderAShortTimeout) {
  PeerWatch watch(absl::Milliseconds(300));
  const absl::Time answered = kStart;
  const absl::Time probe = kStart + absl::Milliseconds(420);
  EXPECT_FALSE(watch.Dead(Owing(false, true, answered), probe));
  EXPECT_FALSE(watch.Dead(Owing(false, true, answered), probe + absl::Milliseconds(865)));
  EXPECT_TRUE(watch.Dead(Owing(false, true, answered), probe + PeerWatch::kProbeGrace));
  PeerWatch data_watch(absl::Milliseconds(300));
  EXPECT_FALSE(data_watch.Dead(Owing(true, false, answered), probe));
  EXPECT_TRUE(data_watch.Dead(Owing(true, false, answered), probe + absl::Milliseconds(300)))
      << "unacknowledged data gets no grace";
}

TEST(PeerWatch, ThePeriodIsAQuarterOfTheTimeoutWithinBounds) {
  EXPECT_EQ(PeerWatch::Period(absl::Seconds(2)), absl::Milliseconds(500));
  EXPECT_EQ(PeerWatch::Period(absl::Milliseconds(20)), absl::Milliseconds(10));
  EXPECT_EQ(PeerWatch::Period(absl::Hours(1)), absl::Seconds(1));
}

}  // namespace
}  // namespace rdmarpc::transport
