// PeerWatch: whether a TCP peer is dead, from what the kernel says of the
// connection (TCP_INFO), read every PeerWatch::Period.
//
// Why not TCP_USER_TIMEOUT: Linux applies it to a closed receive window as
// well. A peer that stops reading for peer_timeout_ms (a handler running
// inline on its I/O thread, a stall of its process) fills its socket buffer,
// advertises a zero window, and answers every window probe; the kernel
// still aborts the connection (tcp_probe_timer counts from the first probe,
// answered or not), with every call on it. RFC 1122 (4.2.2.17) keeps such a
// connection open as long as the probes are answered, and so does this
// watch, as RDMA's unbounded RNR retry does for a receiver out of buffers.
//
// The rule: a peer owes an answer while data sent to it is unacknowledged
// or a probe (window or keepalive) is unanswered. One that has owed an
// answer and sent no ACK for the whole timeout is dead. Any ACK, a probe's
// included, starts the wait again. A probe gets kProbeGrace at least: Linux
// leaves a probe unanswered when it answered one less than
// tcp_invalid_ratelimit (500 ms by default) before, and the first window
// probes come faster than that (measured on loopback: a probe sent 420 ms
// after an answer waited 865 ms, for the next one).
//
//   PeerWatch watch(absl::Milliseconds(2000));
//   every Period: if (watch.Dead(signals, SteadyNow())) close the connection
//
// What not to rely on: the verdict comes up to two periods after the
// timeout, since owing is seen at a period's reading, not when it began.
// While a window stays closed, Linux spaces its probes further and further
// apart (doubling, up to 2 minutes): a peer that dies then is noticed a
// timeout after the first probe it leaves unanswered, which can be that long
// after it died. The watch costs one getsockopt per connection per period,
// idle connections included (2 per second each by default).
#ifndef RDMARPC_TRANSPORT_TCP_PEER_WATCH_H_
#define RDMARPC_TRANSPORT_TCP_PEER_WATCH_H_

#include <algorithm>

#include "absl/time/time.h"

namespace rdmarpc::transport {

// What TCP_INFO says of the peer at one reading.
struct PeerSignals {
  bool data_unacknowledged = false;  // tcpi_unacked > 0
  bool probe_unanswered = false;     // tcpi_probes > 0
  absl::Time last_ack;               // now - tcpi_last_ack_recv
};

class PeerWatch {
 public:
  explicit PeerWatch(absl::Duration timeout) : timeout_(timeout) {}

  // How often the signals are read for a timeout: a quarter of it, so that
  // the verdict is late by half of it at most, within bounds that keep the
  // readings cheap and a short timeout meaningful.
  static absl::Duration Period(absl::Duration timeout) {
    return std::clamp(timeout / 4, absl::Milliseconds(10), absl::Seconds(1));
  }

  // A rate-limited probe is answered with the next one, under 1 s later
  // (probes that close together are the first, 200 and 400 ms apart, the
  // interval doubling): twice that.
  static constexpr absl::Duration kProbeGrace = absl::Seconds(2);

  bool Dead(const PeerSignals& s, absl::Time now) {
    if (!s.data_unacknowledged && !s.probe_unanswered) {
      owed_since_ = absl::InfiniteFuture();
      return false;
    }
    if (owed_since_ == absl::InfiniteFuture()) owed_since_ = now;
    const absl::Duration limit = s.data_unacknowledged ? timeout_ : std::max(timeout_, kProbeGrace);
    return now - std::max(owed_since_, s.last_ack) >= limit;
  }

 private:
  const absl::Duration timeout_;
  // Since the first reading that found the peer owing, as long as it owes.
  absl::Time owed_since_ = absl::InfiniteFuture();
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_TCP_PEER_WATCH_H_
