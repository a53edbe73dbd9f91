// RdmaConnection's clocks: everything that ends or probes a connection
// because something did not happen in time. TimeoutsDue and ExpireTimeouts
// are its entry points, called by the endpoint's sweep in the I/O context:
//   - the keepalive, a zero-byte WRITE after keepalive_ms of silence, which
//     fails the connection when the device neither acknowledges nor fails it;
//   - the lost-READ backstop ("Stalled READs" in rdma_connection.h);
//   - READs of buffers the peer has revoked (its release_timeout_ms);
//   - our own advertised payloads left unreleased (release_timeout_ms);
//   - a kShrink left unanswered (shrink_answer_timeout_ms);
//   - an accepted connection its client has not completed: probed at
//     accept_timeout_ms, and ended when the probe fails.
// The send path is in rdma_connection.cc, the receive path in
// rdma_connection_receive.cc.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_connection_internal.h"
#include "transport/rdma/rdma_options.h"

namespace rdmarpc::transport::rdma {

using internal::RevocationRule;
using internal::Rounded;
using internal::WrId;

void RdmaConnection::LearnRetryPolicy() {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (qp_ == nullptr ||
      ibv_query_qp(qp_, &attr, IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_MIN_RNR_TIMER, &init) !=
          0) {
    return;
  }
  std::lock_guard<InlineMutex> lock(mu_);
  ack_timeout_exp_ = attr.timeout;
  retries_ = attr.retry_cnt;
  rnr_timer_ = attr.min_rnr_timer;
  // Timeout 0 means the device waits for ever: keep what was asked for, for
  // the keepalive's own bound.
  if (attr.timeout != 0) {
    unacked_limit_ =
        absl::Nanoseconds(4096.0 * std::ldexp(1.0, attr.timeout)) * (attr.retry_cnt + 1);
  }
}

std::string RdmaConnection::DescribeRetryPolicy() {
  std::lock_guard<InlineMutex> lock(mu_);
  if (ack_timeout_exp_ < 0) return "the QP's retry policy could not be read";
  return absl::StrCat("ACK timeout 4.096 us x 2^", ack_timeout_exp_, ", ", retries_ + 1,
                      " tries: a peer that stops answering fails after ~", Rounded(unacked_limit_),
                      ", keepalive after ", Rounded(keepalive_),
                      " of silence; a SEND that finds our SRQ empty is retried after ",
                      RnrTimerMicros(rnr_timer_), " us");
}

bool RdmaConnection::TimeoutsDue(absl::Time now) {
  // ProbeUnestablished clears establish_by_ once the client is in.
  if (now >= establish_by_) return true;
  if (now >= next_give_up_ || KeepaliveDue(now) || ShrinkAnswerOverdue(now)) return true;
  std::lock_guard<InlineMutex> lock(mu_);
  if (KeepaliveOverdueLocked(now) || ReadOverdueLocked(now)) return true;
  return !closed_ && now >= next_release_due_;
}

bool RdmaConnection::KeepaliveOverdueLocked(absl::Time now) const {
  // READs posted before it complete first; while one is in flight, the
  // READ backstop (ReadOverdueLocked) is the one that waits.
  return keepalive_outstanding_ && reads_in_flight_.empty() &&
         now - std::max(keepalive_sent_, oldest_read_since_) >= 2 * unacked_limit_;
}

void RdmaConnection::ExpireTimeouts(absl::Time now) {
  if (FailLostRead(now) || FailStalledReads(now) || FailUnansweredKeepalive(now)) return;
  ProbeUnestablished(now);
  ExpireUnreleased(now);
  if (ShrinkAnswerOverdue(now)) WriteOffUnansweredShrink();
  if (KeepaliveDue(now)) SendKeepalive(now);
}

bool RdmaConnection::ShrinkAnswerOverdue(absl::Time now) const {
  return shrink_asked_ != 0 && !shrink_overdue_ && shrink_answer_timeout_ != absl::ZeroDuration() &&
         now - shrink_asked_at_ >= shrink_answer_timeout_;
}

void RdmaConnection::WriteOffUnansweredShrink() {
  shrink_overdue_ = true;
  const uint32_t window = PeerWindow();
  written_off_ = std::max<int64_t>(0, peer_holds_ - window);
  endpoint_->GiveBackCredits(written_off_);
  if (!told_shrink_overdue_) {
    told_shrink_overdue_ = true;
    fprintf(stderr,
            "rdmarpc[%s]: %s on %s has not answered a request for %u of its credits back in %s "
            "(its process stopped, or its I/O thread stuck?): the %lld it holds past its window "
            "of %u no longer count against the shared receive slots, so that the other "
            "connections are not held to one frame each; a burst from it when it wakes may "
            "find the SRQ empty and wait on RNR retry (device_rnr_naks_sent). Said once per "
            "connection.\n",
            options_.name.c_str(), peer_.c_str(), endpoint_->device_name().c_str(), shrink_asked_,
            Rounded(shrink_answer_timeout_).c_str(), static_cast<long long>(written_off_), window);
  }
  Count(&RdmaCounters::credit_shrinks_overdue);  // after the line, which a test may look for
  endpoint_->WakeCreditWaiters();
}

bool RdmaConnection::KeepaliveDue(absl::Time now) {
  if (keepalive_ == absl::ZeroDuration() || torn_down_) return false;
  if (heard_ != heard_at_check_ || !established_.load(std::memory_order_acquire)) {
    heard_at_check_ = heard_;
    silent_since_ = now;
    return false;
  }
  // Also with READs in flight: silence means none of them has completed for
  // keepalive_ms, and a new work request is what would get Soft-RoCE going
  // again (see "Stalled READs" in the header).
  return !keepalive_outstanding_ && now - silent_since_ >= keepalive_;
}

void RdmaConnection::SendKeepalive(absl::Time now) {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_ || sq_used_ >= sq_depth_) return;
    GiveBackIdleSendSlotLocked();
    ibv_send_wr& wr = QueueLocked().wr;
    wr.wr_id = WrId(kWrKeepalive, serial_, 0, true);
    // Zero bytes: no address or rkey is checked (IBA C9-88).
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    ++sq_used_;
    ++signaled_outstanding_;
  }
  keepalive_outstanding_ = true;
  keepalive_sent_ = now;
  Count(&RdmaCounters::keepalives);
  if (!reads_in_flight_.empty()) {
    // Rare, and the one trace of a READ the device left unsent: if the call
    // then succeeds, the keepalive got it going.
    Count(&RdmaCounters::keepalives_behind_reads);
    fprintf(stderr,
            "rdmarpc[%s]: RDMA READ of %u bytes from %s: no completion on %s for %s; keepalive "
            "posted behind it\n",
            options_.name.c_str(), reads_in_flight_.front(), peer_.c_str(),
            endpoint_->device_name().c_str(), Rounded(now - oldest_read_since_).c_str());
  }
  FlushOutbox().IgnoreError();
}

bool RdmaConnection::FailUnansweredKeepalive(absl::Time now) {
  if (torn_down_) return false;
  absl::Duration limit;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (!KeepaliveOverdueLocked(now)) return false;
    limit = unacked_limit_;
  }
  // The device should have failed it by now (RETRY_EXC_ERR); Soft-RoCE
  // retries for ever when the peer asked for 7 retries at connect.
  Fail(absl::UnavailableError(
      absl::StrCat("keepalive to ", peer_, " neither acknowledged nor failed by the device in ",
                   Rounded(now - keepalive_sent_), " (twice its retry time, ~", Rounded(limit),
                   "): the peer's machine, device or link is down")));
  return true;
}

void RdmaConnection::ProbeUnestablished(absl::Time now) {
  if (torn_down_ || now < establish_by_) return;
  if (established_.load(std::memory_order_acquire)) {
    establish_by_ = absl::InfiniteFuture();
    return;
  }
  if (!accept_probed_) {
    // The client's QP runs once its process has read our REP, and then its
    // device acknowledges a keepalive: only its RTU was lost, and rdma_cm
    // will resend our REP for another. A client stopped before that never
    // acknowledges it, so the keepalive fails and Fail says why.
    SendKeepalive(now);
    accept_probed_ = keepalive_outstanding_;  // not sent (a full queue): next sweep
    return;
  }
  if (keepalive_outstanding_) return;
  // Acknowledged: the connection is its client's, and a later failure
  // is not the accept's.
  establish_by_ = absl::InfiniteFuture();
  accept_probed_ = false;
}

bool RdmaConnection::ReadOverdueLocked(absl::Time now) const {
  return !reads_in_flight_.empty() &&
         now - oldest_read_since_ > ReadAllowanceLocked(reads_in_flight_.front());
}

absl::Duration RdmaConnection::ReadAllowanceLocked(uint32_t bytes) const {
  return 2 * unacked_limit_ +
         absl::Seconds(static_cast<double>(bytes) / kSlowestReadBytesPerSecond);
}

bool RdmaConnection::FailLostRead(absl::Time now) {
  absl::Duration allowed, retry;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (torn_down_ || !ReadOverdueLocked(now)) return false;
    allowed = ReadAllowanceLocked(reads_in_flight_.front());
    retry = unacked_limit_;
  }
  // A dead peer fails the READ within the retry time (RETRY_EXC_ERR), so
  // this is a device that dropped it without a word, or a READ of a buffer
  // the peer revoked (which RevocationHint names).
  Fail(RevocationHint(absl::UnavailableError(absl::StrCat(
      "RDMA READ of ", reads_in_flight_.front(), " bytes from ", peer_,
      " neither completed nor failed by ", endpoint_->device_name(), " in ",
      Rounded(now - oldest_read_since_), " (allowed ", Rounded(allowed),
      ": twice the device's retry time of ~", Rounded(retry), " plus its bytes at ",
      kSlowestReadBytesPerSecond >> 20,
      " MiB/s); the connection ends so that its calls fail instead of waiting for ever"))));
  return true;
}

bool RdmaConnection::FailStalledReads(absl::Time now) {
  if (now < next_give_up_ || torn_down_) return false;
  next_give_up_ = absl::InfiniteFuture();
  const ReadOp* stalled = nullptr;
  for (const auto& [op_id, op] : reads_) {
    if (stalled == nullptr && op.in_flight > 0 && op.give_up <= now) stalled = &op;
    next_give_up_ = std::min(next_give_up_, op.give_up);
  }
  if (stalled == nullptr) return false;
  uint32_t peer_release_ms;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    peer_release_ms = peer_release_timeout_ms_;
  }
  // The peer revoked the buffer under the READ, and the device neither
  // finished nor failed it (Soft-RoCE retries such a READ for ever).
  const MessageKind kind = stalled->msg.header.kind;
  Fail(absl::UnavailableError(absl::StrCat(
      "RDMA READ of a ", kind == MessageKind::kResponse ? "response" : "request", " from ", peer_,
      " not done at twice the peer's release timeout: ", RevocationRule(kind, peer_release_ms))));
  return true;
}

void RdmaConnection::ExpireUnreleased(absl::Time now) {
  size_t responses = 0;
  size_t requests = 0;
  bool windows = true;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_ || now < next_release_due_) return;
    next_release_due_ = absl::InfiniteFuture();
    for (auto it = advertised_.begin(); it != advertised_.end();) {
      auto next = std::next(it);
      Advertised& adv = it->second;
      if (adv.release_by <= now) {
        ++(adv.kind == MessageKind::kRequest ? requests : responses);
        windows = adv.mw != nullptr;
        adv.expired = true;
        if (adv.kind == MessageKind::kRequest) {
          auto range = request_tokens_.equal_range(adv.call_id);
          for (auto t = range.first; t != range.second; ++t) {
            if (t->second == it->first) {
              request_tokens_.erase(t);
              break;
            }
          }
        }
        if (windows) ReleaseAdvertisedLocked(it->first);  // erases only `it`
      } else {
        next_release_due_ = std::min(next_release_due_, adv.release_by);
      }
      it = next;
    }
  }
  if (responses + requests == 0) return;
  const std::string within = absl::FormatDuration(release_timeout_);
  const std::string what = absl::StrCat(
      peer_,
      responses > 0
          ? absl::StrCat(" did not release ", responses, " response payload(s) within ", within)
          : "",
      responses > 0 && requests > 0 ? " and" : "",
      requests > 0 ? absl::StrCat(" did not answer ", requests, " request(s) within ", within,
                                  " after their deadline")
                   : "",
      " (RdmaOptions::release_timeout_ms)");
  const size_t expired = responses + requests;
  if (!windows) {
    // A registration cannot be revoked for one peer: only the QP's leaving
    // RTS ends its access.
    Count(&RdmaCounters::releases_expired, expired);
    return Fail(absl::DeadlineExceededError(
        absl::StrCat(what, "; without memory windows the connection is closed to revoke them")));
  }
  fprintf(stderr, "rdmarpc[%s]: %s; revoked them\n", options_.name.c_str(), what.c_str());
  FlushOutbox().IgnoreError();
}

}  // namespace rdmarpc::transport::rdma
