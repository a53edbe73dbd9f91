// RdmaConnection's receive path: frames taken off the shared receive queue
// (OnRecv), the credits they carry and the ones this side grants back,
// the RDMA READs that pull advertised payloads (StartReads, DeliverRead),
// and the completions of everything posted on the QP (OnCompletion). The
// send path, teardown and loss are in rdma_connection.cc; the clocks in
// rdma_connection_timeouts.cc.
#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_connection_internal.h"

namespace rdmarpc::transport::rdma {

using internal::CostsCredit;
using internal::kSignaledBit;
using internal::RevocationRule;
using internal::Rounded;
using internal::WrId;

// Inline, ahead of OnRecv: it runs for every frame, and a call that returns
// a struct costs more than the checks themselves (bench/fast_path_ir.sh).
inline RdmaConnection::CreditBreach RdmaConnection::CheckCreditRulesLocked(
    const Header& h, uint32_t shrink_asked) const {
  if (CostsCredit(h.kind)) {
    if (const int64_t over = OverdrawnLocked(); over > 0) {
      return {CreditBreach::kFrameWithoutCredit, over, credit_window_};
    }
  }
  if (shrink_asked != 0) {
    if (const int64_t unanswered = AskedTooSoonLocked(); unanswered > 0) {
      return {CreditBreach::kShrinkOutOfTurn, unanswered, 0};
    }
  }
  // The handshake's bound is known from the start on a server, and once
  // rdma_cm reports the server's on a client: a frame before that is
  // checked with the next one after.
  if (h.credits != 0 && peer_max_credits_ != 0) {
    const int64_t held = credits_ - int64_t{shrink_asked} + h.credits;
    if (const int64_t past = held - peer_max_credits_; past > 0) {
      return {CreditBreach::kCreditPastWindow, past, peer_max_credits_};
    }
  }
  return {};
}

void RdmaConnection::OnRecv(uint32_t slot, const char* data, uint32_t length) {
  RDMARPC_STAGE(kRecvDecode);
  ++heard_;
  InboundMessage m;
  const Header& h = m.header;
  static_assert(std::is_trivially_copyable_v<Header>, "h is read after m is moved from");
  if (absl::Status s = DecodeHeader(data, length, &m.header); !s.ok()) {
    endpoint_->ReleaseSlot(slot);
    return Fail(
        absl::InternalError(absl::StrCat("malformed frame from ", peer_, ": ", s.message())));
  }
  const size_t expected = kHeaderSize + h.metadata_len + (h.remote_payload() ? 0 : h.payload_len);
  if (length != expected) {
    endpoint_->ReleaseSlot(slot);
    return Fail(absl::InternalError(absl::StrCat("malformed frame from ", peer_, ": ", length,
                                                 " bytes received, header says ", expected)));
  }
  if (h.kind == MessageKind::kCredit && h.credits == 0) {
    endpoint_->ReleaseSlot(slot);
    return Fail(absl::InternalError(
        absl::StrCat("malformed frame from ", peer_, ": a kCredit that returns no credit")));
  }
  // A frame on credit, or our kShrink's answer, gives back what it took
  // off the endpoint's budget; another connection may be waiting for it.
  int64_t given_back = CostsCredit(h.kind) ? 1 : 0;
  uint32_t shrink_asked = 0;  // what a kShrink asks back: a count of credits, as a window is
  bool answered = false;
  if (h.kind == MessageKind::kShrink) {
    if (shrink_asked_ != 0 && h.call_id != shrink_asked_) {
      endpoint_->ReleaseSlot(slot);
      return Fail(
          absl::InternalError(absl::StrCat("malformed frame from ", peer_, ": a kShrink answering ",
                                           shrink_asked_, " credits says ", h.call_id)));
    }
    if (h.call_id == 0) {
      endpoint_->ReleaseSlot(slot);
      return Fail(absl::InternalError(
          absl::StrCat("malformed frame from ", peer_, ": a kShrink that asks for no credit")));
    }
    if (shrink_asked_ != 0) {
      given_back += shrink_asked_;
      shrink_asked_ = 0;
      shrink_overdue_ = false;
      answered = true;
    } else {
      shrink_asked = static_cast<uint32_t>(std::min<uint64_t>(h.call_id, UINT32_MAX));
    }
  }
  peer_holds_ -= given_back;
  if (endpoint_->shares_credits()) {
    // What was written off went back to the budget then; an answer means
    // the peer is back, and what it still holds past its window counts
    // again.
    const int64_t repaid = std::min(written_off_, given_back);
    written_off_ -= repaid;
    endpoint_->GiveBackCredits(given_back - repaid);
    if (answered) {
      endpoint_->TakeCredits(static_cast<size_t>(std::exchange(written_off_, 0)));
      // What was asked may no longer cover what the budget lacks (windows
      // shrank since, connections wait), and only a Reshare asks for more.
      endpoint_->QueueReshare();
    }
  }
  bool queued = false;
  uint32_t peer_release_ms = 0;
  uint32_t room_back = 0;
  CreditBreach breach;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    breach = CheckCreditRulesLocked(h, shrink_asked);
    if (breach.rule == CreditBreach::kNone) {
      peer_release_ms = peer_release_timeout_ms_;
      if (shrink_asked != 0) {
        // What the peer takes back may have been spent already: the debt is
        // paid from the credits it returns next. Answered ahead of the
        // backlog, which may wait for those very credits.
        ++asks_received_;
        credits_ -= shrink_asked;
        answer_to_send_ += shrink_asked;
        SendShrinkLocked();
      }
      // Only for a response some request awaits: a peer that sends others
      // cannot make room that was never taken.
      if (h.kind == MessageKind::kResponse && responses_awaited_ > 0) {
        --responses_awaited_;
        room_back = 1;
      }
      if (h.credits) {
        credits_ += h.credits;
        FlushBacklogLocked();
      }
      if (given_back != 0) TopUpLocked();
      if (h.kind == MessageKind::kRelease) ReleaseAdvertisedLocked(h.remote.token);
      if (h.kind == MessageKind::kResponse && !request_tokens_.empty()) {
        auto range = request_tokens_.equal_range(h.call_id);
        for (auto it = range.first; it != range.second; ++it) ReleaseAdvertisedLocked(it->second);
        request_tokens_.erase(range.first, range.second);
      }
      queued = !outbox_.empty();
    }
  }
  if (breach.rule != CreditBreach::kNone) {
    endpoint_->ReleaseSlot(slot);
    return FailForBreach(breach);
  }
  endpoint_->ReturnResponseRoom(room_back);
  if (queued) FlushOutbox().IgnoreError();
  // At its window, the connection left what came back to the others.
  if (endpoint_->shares_credits() && given_back != 0 && peer_holds_ >= PeerWindow()) {
    endpoint_->WakeCreditWaiters();
  }
  if (h.kind == MessageKind::kCredit || h.kind == MessageKind::kRelease ||
      h.kind == MessageKind::kShrink) {
    endpoint_->ReleaseSlot(slot);
  } else {
    if (h.metadata_len > 0) m.metadata.assign(data + kHeaderSize, h.metadata_len);
    if (!h.remote_payload()) {
      m.payload = endpoint_->SlotBuffer(slot, kHeaderSize + h.metadata_len, h.payload_len);
      m.payload_on_loan = true;
      RDMARPC_STAGE(kRecvDeliver);
      if (observer_) observer_->OnMessage(*this, std::move(m));
    } else {
      endpoint_->ReleaseSlot(slot);
      const uint32_t op_id = next_read_op_++;
      ReadOp& op = reads_[op_id];
      op.remote_addr = h.remote.addr;
      op.rkey = h.remote.rkey;
      if (FaultInjection::TakeStaleRead() && last_remote_.second != 0) {
        op.remote_addr = last_remote_.first;  // test only: replay the previous one
        op.rkey = last_remote_.second;
      }
      last_remote_ = {h.remote.addr, h.remote.rkey};
      if (h.kind == MessageKind::kRequest && h.timeout_us) {
        op.expiry = SteadyNow() + h.timeout();
        if (peer_release_ms > 0) {
          op.give_up = op.expiry + absl::Milliseconds(peer_release_ms) * 2;
          next_give_up_ = std::min(next_give_up_, op.give_up);
        }
      } else if (h.kind == MessageKind::kResponse && peer_release_ms > 0) {
        // The peer revokes it at its release timeout, counted from before
        // it sent; half leaves room for the READ itself.
        const absl::Time now = SteadyNow();
        op.expiry = now + absl::Milliseconds(peer_release_ms) / 2;
        op.give_up = now + absl::Milliseconds(peer_release_ms) * 2;
        next_give_up_ = std::min(next_give_up_, op.give_up);
      }
      absl::Status admitted;
      if (h.payload_len > options_.max_message_size) {
        op.msg = std::move(m);
        op.msg.payload_status = absl::ResourceExhaustedError(
            absl::StrCat("message of ", h.payload_len, " bytes exceeds max_message_size ",
                         options_.max_message_size));
        DeliverRead(op_id);
      } else if (observer_ && !(admitted = observer_->AdmitRemotePayload(*this, h)).ok()) {
        op.msg = std::move(m);
        op.msg.payload_status = std::move(admitted);
        DeliverRead(op_id);
      } else {
        op.msg = std::move(m);
        read_queue_.push_back(op_id);
        StartReads();
      }
    }
  }
  if (CreditWorthSending()) SendControl(MessageKind::kCredit, 0);
}

uint32_t RdmaConnection::PeerWindow() const {
  return endpoint_->shares_credits() ? endpoint_->CreditWindow() : credit_window_;
}

void RdmaConnection::FailForBreach(const CreditBreach& breach) {
  constexpr absl::string_view kWhy =
      "; the connection ends, so that its frames cannot empty the receive queue that other "
      "connections share";
  switch (breach.rule) {
    case CreditBreach::kNone:
      return;
    case CreditBreach::kFrameWithoutCredit:
      Count(&RdmaCounters::frames_without_credit);
      return Fail(absl::InternalError(
          absl::StrCat("frame without credit from ", peer_, ": it sent ", breach.by,
                       breach.by == 1 ? " frame" : " frames", " past its window of ", breach.limit,
                       " and the credits we had sent it", kWhy)));
    case CreditBreach::kShrinkOutOfTurn:
      Count(&RdmaCounters::unwarranted_control_frames);
      return Fail(absl::InternalError(absl::StrCat(
          "kShrink out of turn from ", peer_,
          ": it asked for credit back again before our answer to its last ask could reach it",
          kWhy)));
    case CreditBreach::kCreditPastWindow:
      Count(&RdmaCounters::unwarranted_control_frames);
      return Fail(absl::InternalError(
          absl::StrCat("credit past its window from ", peer_, ": it returned ", breach.by,
                       breach.by == 1 ? " credit" : " credits", " more than its largest window, ",
                       breach.limit, ", lets us hold", kWhy)));
  }
}

int64_t RdmaConnection::OverdrawnLocked() const {
  // peer_holds_ counts every credit granted; the peer can have spent only
  // those sent before this frame's batch was polled, not those still to go
  // out (to_return_) nor those sent since (in this round).
  const int64_t not_yet_sent =
      to_return_.load(std::memory_order_relaxed) + credits_sent_.InRound(endpoint_->poll_round());
  return not_yet_sent - peer_holds_;
}

int64_t RdmaConnection::AskedTooSoonLocked() const {
  // A peer asks again only once our answer to its last ask has reached it,
  // so before this frame's poll round.
  const int64_t answered_before =
      asks_answered_.total() - asks_answered_.InRound(endpoint_->poll_round());
  return asks_received_ - answered_before;
}

void RdmaConnection::TopUpLocked() {
  const uint32_t window = PeerWindow();
  if (closed_ || peer_holds_ >= window) return;
  int64_t room = window - peer_holds_;
  if (endpoint_->shares_credits()) {
    // One frame at least, whatever the budget: a peer with none could never
    // send again (past as many connections as the budget holds frames, the
    // endpoint has said so once, AddConnection).
    room = std::min<int64_t>(
        room, std::max<int64_t>(1 - peer_holds_, static_cast<int64_t>(std::min<size_t>(
                                                     endpoint_->FreeCredits(), window))));
    endpoint_->TakeCredits(static_cast<size_t>(room));
  }
  peer_holds_ += room;
  to_return_.store(to_return_.load(std::memory_order_relaxed) + static_cast<uint32_t>(room),
                   std::memory_order_relaxed);
  if (peer_holds_ < window && !waiting_for_credits_) {
    waiting_for_credits_ = true;
    endpoint_->WaitForCredits(weak_from_this(), window - peer_holds_);
  }
}

bool RdmaConnection::CreditWorthSending() const {
  // In half windows of at least two frames, as a peer's
  // kCreditFramesPerWindow counts on; but at once to a peer that holds none
  // at all. Never for one frame to a peer that still holds credit: a peer
  // that waits for an answer gets it back in the answer, while at the
  // windows of 2 and 3 that 124 to 186 connections sharing a server's
  // default slots get, one kCredit per request answered off the I/O thread
  // doubled the server's SENDs.
  const uint32_t due = to_return_.load(std::memory_order_relaxed);
  if (due == 0) return false;
  return due >= std::max<uint32_t>(2, PeerWindow() / 2) || peer_holds_ == static_cast<int64_t>(due);
}

void RdmaConnection::TopUpCredits() {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    waiting_for_credits_ = false;
    TopUpLocked();
  }
  if (CreditWorthSending()) SendControl(MessageKind::kCredit, 0);
}

int64_t RdmaConnection::credits_held() {
  std::lock_guard<InlineMutex> lock(mu_);
  return credits_;
}

int64_t RdmaConnection::CreditsOverWindow() const {
  // Not before rdma_cm says the peer is connected: until its QP is ready to
  // receive, which may be after ours is ready to send, its device drops the
  // kShrink and ours resends it only after the ACK timeout.
  if (shrink_asked_ != 0 || !established_.load(std::memory_order_acquire)) return 0;
  return std::max<int64_t>(0, peer_holds_ - PeerWindow());
}

void RdmaConnection::AskForCreditsBack(uint32_t count) {
  if (shrink_asked_ != 0 || count == 0) return;
  bool queued;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_) return;
    shrink_asked_ = count;
    shrink_asked_at_ = SteadyNow();
    ask_to_send_ = count;
    Count(&RdmaCounters::credit_shrinks);
    SendShrinkLocked();
    queued = !outbox_.empty();
  }
  if (queued) FlushOutbox().IgnoreError();
}

void RdmaConnection::SendShrinkLocked() {
  for (uint32_t* count : {&ask_to_send_, &answer_to_send_}) {
    if (*count == 0 || closed_) continue;
    OutboundMessage p;
    p.header.kind = MessageKind::kShrink;
    p.header.call_id = *count;
    // Without room now, FlushBacklogLocked sends it when room comes.
    if (!CanPostLocked(p.header)) return;
    *count = 0;
    if (count == &answer_to_send_) {
      asks_answered_.Add(endpoint_->poll_round(), asks_received_ - asks_answered_.total());
    }
    QueueFrameLocked(p).IgnoreError();
  }
}

void RdmaConnection::StartReads() {
  // Not behind a keepalive: on Soft-RoCE (Linux 6.1) READs posted while the
  // keepalive was a zero-byte READ once never completed nor failed (seen
  // under ASan, where calls are slow enough for a keepalive to go out
  // mid-call; not reproduced in isolation, so kept for the WRITE). Its
  // completion starts them, one round trip later.
  if (keepalive_outstanding_) return;
  bool queued = false;
  while (!read_queue_.empty() && reads_in_flight_.size() < rd_atom_ && !torn_down_) {
    const uint32_t op_id = read_queue_.front();
    ReadOp& op = reads_[op_id];
    const size_t len = op.msg.header.payload_len;
    if (op.block == nullptr) {
      if (SteadyNow() > op.expiry) {
        if (op.msg.header.kind == MessageKind::kRequest) {
          op.msg.payload_status =
              absl::DeadlineExceededError("deadline passed before the request's payload was read");
        } else {
          std::lock_guard<InlineMutex> lock(mu_);
          op.msg.payload_status = absl::DeadlineExceededError(
              absl::StrCat("the response's payload from ", peer_,
                           " was not read in time: the server revokes it ",
                           peer_release_timeout_ms_, " ms after sending (its release_timeout_ms)"));
          Count(&RdmaCounters::late_reads_skipped);
        }
        read_queue_.pop_front();
        DeliverRead(op_id);
        continue;
      }
      auto block = endpoint_->pool().Get(len, /*remote_read=*/false);
      if (!block.ok()) {
        op.msg.payload_status = block.status();
        read_queue_.pop_front();
        DeliverRead(op_id);
        continue;
      }
      op.block = *block;
    }
    const size_t chunk_max = read_chunk_;
    std::lock_guard<InlineMutex> lock(mu_);
    while (op.next < len && reads_in_flight_.size() < rd_atom_ && !hold_reads_) {
      const size_t chunk = std::min(len - op.next, chunk_max);
      Outgoing& out = QueueLocked();
      out.sge[0] = ibv_sge{reinterpret_cast<uintptr_t>(op.block->data + op.next),
                           static_cast<uint32_t>(chunk), op.block->mr->lkey};
      ibv_send_wr& wr = out.wr;
      wr.wr_id = WrId(kWrRead, serial_, op_id, true);
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_READ;
      wr.send_flags = IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = op.remote_addr + op.next;
      wr.wr.rdma.rkey = op.rkey;
      ++sq_used_;
      ++signaled_outstanding_;
      op.next += chunk;
      ++op.in_flight;
      if (reads_in_flight_.empty()) oldest_read_since_ = SteadyNow();
      reads_in_flight_.push_back(static_cast<uint32_t>(chunk));
      queued = true;
      Count(&RdmaCounters::reads);
    }
    if (op.next < len) break;  // no more room now
    read_queue_.pop_front();
  }
  if (queued) FlushOutbox().IgnoreError();
}

void RdmaConnection::DeliverRead(uint32_t op_id) {
  auto node = reads_.extract(op_id);
  ReadOp& op = node.mapped();
  const bool is_response = op.msg.header.kind == MessageKind::kResponse;
  const uint64_t token = op.msg.header.remote.token;
  if (op.block != nullptr && op.msg.payload_status.ok()) {
    op.msg.payload = endpoint_->BlockBuffer(op.block, op.msg.header.payload_len);
    Count(&RdmaCounters::bytes_read, op.msg.header.payload_len);
  } else if (op.block != nullptr) {
    endpoint_->pool().Put(op.block);
  }
  // The peer may reuse its response buffer now: we will not READ it again.
  if (is_response) SendControl(MessageKind::kRelease, token);
  if (observer_) observer_->OnMessage(*this, std::move(op.msg));
}

void RdmaConnection::OnCompletion(const ibv_wc& wc) {
  const uint64_t kind = wc.wr_id >> 60;
  const uint32_t index = static_cast<uint32_t>(wc.wr_id);
  if (wc.status == IBV_WC_SUCCESS) ++heard_;
  if (wc.wr_id & kSignaledBit) {
    std::lock_guard<InlineMutex> lock(mu_);
    --signaled_outstanding_;
  }
  bool queued = false;
  if (kind == kWrSend) {
    std::lock_guard<InlineMutex> lock(mu_);
    while (!posted_.empty() && static_cast<int32_t>(posted_.front().seq - index) <= 0) {
      const int slot = posted_.front().slot;
      if (slot >= 0 && free_send_slots_.empty()) {
        free_send_slots_.push_back(slot);
      } else if (slot >= 0) {
        // One free slot is kept for the next frame (until the connection
        // falls idle, GiveBackIdleSendSlotLocked); more would make send
        // memory grow with connections rather than with frames in flight.
        endpoint_->ReturnSendBlock(slot);
        --send_slots_held_;
      }
      posted_.pop_front();
      --sq_used_;
    }
    if (wc.status == IBV_WC_SUCCESS) {
      FlushInvalidationsLocked();
      FlushBacklogLocked();
    }
    queued = !outbox_.empty();
  } else if (kind == kWrInvalidate) {
    bool expired = false;
    {
      std::lock_guard<InlineMutex> lock(mu_);
      --sq_used_;
      auto node = invalidating_.extract(index);
      if (!node.empty() && wc.status == IBV_WC_SUCCESS) {
        free_mws_.push_back(Window{node.mapped().mw, node.mapped().rkey});
        node.mapped().mw = nullptr;  // its block returns to the pool with the node
        expired = node.mapped().expired;
      } else if (!node.empty()) {
        invalidating_.insert(std::move(node));  // freed with the QP at teardown
      }
      if (wc.status == IBV_WC_SUCCESS) {
        FlushInvalidationsLocked();
        FlushBacklogLocked();
      }
      queued = !outbox_.empty();
    }
    // Counted once the block is back in the pool.
    if (expired) Count(&RdmaCounters::releases_expired);
  } else if (kind == kWrRead || kind == kWrKeepalive) {
    {
      // The room this work request held may be what a waiting frame needs.
      std::lock_guard<InlineMutex> lock(mu_);
      --sq_used_;
      if (wc.status == IBV_WC_SUCCESS) FlushBacklogLocked();
      queued = !outbox_.empty();
    }
    auto it = reads_.end();
    if (kind == kWrKeepalive) {
      keepalive_outstanding_ = false;
    } else {
      reads_in_flight_.pop_front();
      oldest_read_since_ = SteadyNow();
      it = reads_.find(index);
    }
    if (it != reads_.end()) {
      --it->second.in_flight;
      if (wc.status == IBV_WC_SUCCESS && it->second.in_flight == 0 &&
          it->second.next == it->second.msg.header.payload_len && !torn_down_) {
        DeliverRead(index);
      }
    }
    if (wc.status == IBV_WC_SUCCESS) StartReads();
  }
  if (queued) FlushOutbox().IgnoreError();
  // The queue may have gone quiet for a frame that held READs back.
  if (wc.status == IBV_WC_SUCCESS && (kind == kWrSend || kind == kWrInvalidate)) StartReads();
  if (wc.status != IBV_WC_SUCCESS && !torn_down_) {
    if (wc.status == IBV_WC_RNR_RETRY_EXC_ERR) Count(&RdmaCounters::rnr_retry_exhausted);
    const char* what = kind == kWrRead         ? "RDMA READ from"
                       : kind == kWrKeepalive  ? "keepalive (a zero-byte RDMA WRITE) to"
                       : kind == kWrBind       ? "memory-window bind for"
                       : kind == kWrInvalidate ? "memory-window invalidation for"
                                               : "SEND to";
    std::string hint;
    if (wc.status == IBV_WC_REM_ACCESS_ERR) {
      hint = " (the peer advertised a bad rkey, address or length, or released the buffer)";
      auto it = kind == kWrRead ? reads_.find(index) : reads_.end();
      std::lock_guard<InlineMutex> lock(mu_);
      if (it != reads_.end() && it->second.give_up != absl::InfiniteFuture()) {
        hint =
            absl::StrCat(" (", RevocationRule(it->second.msg.header.kind, peer_release_timeout_ms_),
                         "; or it advertised a bad rkey, address or length)");
      }
    } else if (wc.status == IBV_WC_WR_FLUSH_ERR) {
      // The first error we see, yet only a flush: something else moved the
      // QP to the error state, and a responder's failure completes nothing.
      hint =
          " (the queue pair had already failed with no error completion here: the peer "
          "disconnected, or this side failed as its responder, e.g. the peer READ a buffer we "
          "had revoked or bytes we never advertised)";
    } else if (wc.status == IBV_WC_RETRY_EXC_ERR) {
      std::lock_guard<InlineMutex> lock(mu_);
      hint = absl::StrCat(" (not acknowledged for ~", Rounded(unacked_limit_),
                          ", RdmaOptions::peer_timeout_ms: the peer's machine, device or link "
                          "is down; if it never worked, on RoCE check the GID index: `",
                          "rdmarpc_devices --to ", peer_, "` lists the GIDs and the one a ",
                          "connection takes, RDMARPC_RDMA_GID_INDEX picks another)");
    }
    Fail(absl::UnavailableError(
        absl::StrCat(what, " ", peer_, " failed: ", ibv_wc_status_str(wc.status), hint)));
  }
}

}  // namespace rdmarpc::transport::rdma
