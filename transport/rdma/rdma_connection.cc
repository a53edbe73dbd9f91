#include "transport/rdma/rdma_connection.h"

#include <errno.h>
#include <string.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_events.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_connection_internal.h"
#include "transport/rdma/sanitizer_sync.h"

namespace rdmarpc::transport::rdma {
namespace {

using internal::CostsCredit;
using internal::kSignaledBit;
using internal::RevocationRule;
using internal::Rounded;
using internal::WrId;

// A torn-down QP that has not drained by then is freed anyway; blocks that a
// READ might still write into are leaked rather than reused.
constexpr absl::Duration kDrainBound = absl::Seconds(5);

// What rdma_cm leaves a RoCE QP to when peer_timeout_ms is 0: ACK timeout
// 2^19 x 4.096 us (CMA_IBOE_PACKET_LIFETIME 18, plus one), 8 tries.
constexpr uint32_t kRdmaCmDefaultPeerTimeoutMs = 17000;

}  // namespace

RdmaConnection::RdmaConnection(Endpoint* endpoint, rdma_cm_id* id, std::string peer,
                               uint32_t serial, const TransportOptions& options,
                               const Handshake& peer_handshake, uint32_t local_credits,
                               uint32_t rd_atom)
    : endpoint_(endpoint),
      id_(id),
      peer_(std::move(peer)),
      serial_(serial),
      options_(options),
      frame_limit_(endpoint->slot_size()),
      credit_window_(local_credits),
      rd_atom_(std::max<uint32_t>(1, rd_atom)),
      release_timeout_(absl::Milliseconds(endpoint->options().release_timeout_ms)),
      unacked_limit_(absl::Milliseconds(endpoint->options().peer_timeout_ms
                                            ? endpoint->options().peer_timeout_ms
                                            : kRdmaCmDefaultPeerTimeoutMs)),
      shrink_answer_timeout_(absl::Milliseconds(endpoint->options().shrink_answer_timeout_ms)),
      keepalive_(absl::Milliseconds(endpoint->options().keepalive_ms)),
      silent_since_(SteadyNow()) {
  endpoint_->Lend();
  SetPeer(peer_handshake);
}

RdmaConnection::~RdmaConnection() {
  if (!freed_) {
    // Never torn down (setup failed before the connection was used).
    DestroyQp(/*used=*/false);
    ReturnSendSlots(posted_);
    if (id_) rdma_destroy_id(id_);
  }
  endpoint_->EndLoan();
}

void RdmaConnection::ReleaseId() {
  DestroyQp(/*used=*/false);
  id_ = nullptr;
}

void RdmaConnection::TakeQpFromId() { id_->qp = nullptr; }

void RdmaConnection::DestroyQp(bool used) {
  if (qp_ == nullptr) return;
  if (id_ != nullptr && id_->qp == qp_) {
    rdma_destroy_qp(id_);
  } else {
    ibv_destroy_qp(qp_);
  }
  qp_ = nullptr;
  if (used) {
    endpoint_->ReturnCompletionsAfterPoll(cq_, sq_depth_);
  } else {
    endpoint_->ReturnCompletions(cq_, sq_depth_);
  }
}

void RdmaConnection::SetPeer(const Handshake& peer) {
  std::lock_guard<InlineMutex> lock(mu_);
  // Added, not set: a kShrink may be received before the handshake is, and
  // its debt stands.
  credits_ += peer.credits;
  peer_credit_window_ = peer.credits;
  peer_max_credits_ = peer.max_credits;
  peer_release_timeout_ms_ = peer.release_timeout_ms;
  if (peer.slot_size) frame_limit_ = std::min<size_t>(endpoint_->slot_size(), peer.slot_size);
  const size_t derived = frame_limit_ - kHeaderSize;
  read_threshold_ = endpoint_->options().read_threshold
                        ? std::min(endpoint_->options().read_threshold, derived)
                        : derived;
}

std::string RdmaConnection::DescribeTerms() {
  std::lock_guard<InlineMutex> lock(mu_);
  return absl::StrCat(
      "QP ", qp_num_, " (send queue ", sq_depth_, "); credits: we grant ", credit_window_,
      ", the peer ", peer_credit_window_, "; frames up to ", frame_limit_, " bytes (our slots ",
      endpoint_->slot_size(), "), inline up to ", max_inline_, ", payloads over ", read_threshold_,
      " bytes by READ, up to ", rd_atom_, " READs in flight of at most ", read_chunk_,
      " bytes; the peer revokes unreleased responses after ",
      peer_release_timeout_ms_ ? absl::StrCat(peer_release_timeout_ms_, " ms") : "never");
}

absl::Status RdmaConnection::CreateQp() {
  const RdmaOptions& o = endpoint_->options();
  const int max_wr = endpoint_->device_attr().max_qp_wr;
  sq_depth_ = std::min<uint32_t>(SendQueueDepth(o, rd_atom_), max_wr);
  // Every work request the send queue holds may complete (when flushed, even
  // an unsignaled one), so that much room on a shared CQ comes first.
  absl::StatusOr<ibv_cq*> cq = endpoint_->ReserveCompletions(sq_depth_);
  if (!cq.ok()) return cq.status();
  cq_ = *cq;
  ibv_qp_init_attr a{};
  a.send_cq = cq_;
  a.recv_cq = cq_;
  a.srq = endpoint_->srq();
  a.qp_type = IBV_QPT_RC;
  a.sq_sig_all = 0;
  a.cap.max_send_wr = sq_depth_;
  a.cap.max_send_sge = 2;  // header, payload
  a.cap.max_inline_data = 256;
  const auto failed = [&](int err) {
    endpoint_->ReturnCompletions(cq_, sq_depth_);
    return absl::ErrnoToStatus(
        err, absl::StrCat("rdma_create_qp on ", endpoint_->device_name(), " for ", peer_));
  };
  if (FaultInjection::TakeFailedQpCreation()) return failed(ENOMEM);
  if (rdma_create_qp(id_, endpoint_->pd(), &a) != 0) {
    a.cap.max_inline_data = 0;  // some devices have no inline support
    if (rdma_create_qp(id_, endpoint_->pd(), &a) != 0) return failed(errno);
  }
  max_inline_ = std::min(a.cap.max_inline_data, kMaxInlineUsed);
  qp_ = id_->qp;
  qp_num_ = qp_->qp_num;
  ibv_port_attr port{};
  read_chunk_ = 1u << 30;
  if (ibv_query_port(id_->verbs, id_->port_num, &port) == 0 && port.max_msg_sz > 0) {
    read_chunk_ = std::min<size_t>(read_chunk_, port.max_msg_sz);
  }
  free_send_slots_.reserve(o.send_slots);  // so that freeing a slot never allocates
  return absl::OkStatus();
}

absl::StatusOr<Buffer> RdmaConnection::AllocatePayload(size_t size) {
  if (size <= read_threshold_) return endpoint_->SmallBuffer(size);  // gathered by the SEND
  auto block = endpoint_->pool().Get(size, /*remote_read=*/true);
  if (!block.ok()) return block.status();
  return endpoint_->BlockBuffer(*block, size);
}

absl::Status RdmaConnection::Send(OutboundMessage&& msg) {
  RDMARPC_STAGE(kSendEntry);
  absl::Status queued;
  bool took;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    queued = SendLocked(msg);
    took = TakeOutboxLocked();
  }
  return PostIfTaken(took, std::move(queued));
}

absl::Status RdmaConnection::SendWith(OutboundMessage&& msg, size_t payload_size,
                                      absl::FunctionRef<void(char*)> write) {
  RDMARPC_STAGE(kSendEntry);
  // In place only for a frame that goes inline and can be posted now: the
  // provider copies it during the post, so it needs no registered memory.
  // Anything else (credit or SQ room short, a larger payload) is sent as
  // Send sends it, from a payload buffer.
  const size_t frame = kHeaderSize + msg.metadata.size() + payload_size;
  if (frame <= max_inline_ && frame <= frame_limit_ && payload_size <= read_threshold_ &&
      msg.payload.empty()) {
    absl::Status queued;
    bool took = false;
    bool in_place = false;
    {
      std::lock_guard<InlineMutex> lock(mu_);
      SetFrameLengths(msg.header, msg.metadata.size(), payload_size);
      if (!closed_ && backlog_.empty() && CanPostLocked(msg.header)) {
        in_place = true;
        queued = QueueFrameLocked(msg, &write);
        took = TakeOutboxLocked();
      }
    }
    if (in_place) return PostIfTaken(took, std::move(queued));
  }
  return Connection::SendWith(std::move(msg), payload_size, write);
}

absl::Status RdmaConnection::SendLocked(OutboundMessage& m) {
  Header& h = m.header;
  const std::string& metadata = m.metadata;
  Buffer& payload = m.payload;
  if (closed_) return RefusedUnsent(absl::StrCat("connection to ", peer_, " is closed"));
  if (kHeaderSize + metadata.size() > frame_limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("metadata of ", metadata.size(), " bytes does not fit a receive slot of ",
                     frame_limit_, " bytes on ", peer_, " (RdmaOptions::slot_size)"));
  }
  if (payload.size() > kMaxPayloadBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("payload of ", payload.size(), " bytes exceeds the wire limit"));
  }
  SetFrameLengths(h, metadata.size(), payload.size());
  const bool remote = payload.size() > read_threshold_ ||
                      kHeaderSize + metadata.size() + payload.size() > frame_limit_;
  const size_t frame = kHeaderSize + metadata.size() + (remote ? 0 : payload.size());
  if (!backlog_.empty()) {
    // Checked before anything is advertised or taken: a refused frame
    // leaves nothing behind.
    if (absl::Status room = RoomInBacklogLocked(h, frame); !room.ok()) return room;
  }
  if (frame > max_inline_ && send_slots_held_ == 0) {
    // The connection's first slot, taken now: a frame that waits in the
    // backlog for a slot needs one of its own to come back, and one that
    // cannot have any fails here, before anything is advertised.
    if (!TakeSendSlotLocked()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no send slot for a ", frame, "-byte frame to ", peer_, ": all ",
          Endpoint::kMaxSendBlocks, " send slots on ", endpoint_->device_name(),
          " are held by SENDs in flight, or registering more failed (see its log line); frames "
          "up to ",
          max_inline_, " bytes go inline and need none"));
    }
  }
  if (remote) {
    RegisteredPool& pool = endpoint_->pool();
    RegisteredPool::Block* b = pool.Find(payload.data());
    if (b == nullptr || !b->remote_read) {
      // Not from AllocatePayload: one copy into registered memory.
      auto got = pool.Get(payload.size(), /*remote_read=*/true);
      if (!got.ok()) return got.status();
      b = *got;
      memcpy(b->data, payload.data(), payload.size());
      Count(&RdmaCounters::advertised_payload_copies);
      const size_t size = payload.size();
      payload = endpoint_->BlockBuffer(b, size);
    }
    const uint64_t token = next_token_++;
    h.flags |= kFlagRemotePayload;
    h.remote = RemoteDescriptor{reinterpret_cast<uintptr_t>(payload.data()), b->mr->rkey, token};
    Advertised adv;
    adv.block = b;
    adv.kind = h.kind;
    adv.call_id = h.call_id;
    if (pool.memory_windows()) {
      if (free_mws_.empty()) {
        ibv_mw* mw = ibv_alloc_mw(endpoint_->pd(), IBV_MW_TYPE_2);
        if (mw == nullptr) {
          return absl::ResourceExhaustedError(
              absl::StrCat("ibv_alloc_mw on ", endpoint_->device_name(), ": ", strerror(errno)));
        }
        free_mws_.push_back(Window{mw, mw->rkey});
      }
      adv.mw = free_mws_.back().mw;
      adv.rkey = free_mws_.back().rkey;
      free_mws_.pop_back();
    }
    adv.payload = std::move(payload);
    advertised_.emplace(token, std::move(adv));
    if (h.kind == MessageKind::kRequest) request_tokens_.emplace(h.call_id, token);
    Count(&RdmaCounters::payloads_advertised);
  }
  if (!backlog_.empty() || !CanPostLocked(h)) {
    AddToBacklogLocked(std::move(m));
    Count(&RdmaCounters::credit_stalls);
    return absl::OkStatus();
  }
  return QueueFrameLocked(m);
}

size_t RdmaConnection::BacklogBytes(const OutboundMessage& m) {
  return kHeaderSize + m.metadata.size() + m.payload.size();
}

void RdmaConnection::AddToBacklogLocked(OutboundMessage&& m) {
  const size_t bytes = BacklogBytes(m);
  backlog_bytes_ += bytes;
  endpoint_->AddBacklogBytes(bytes);
  backlog_.push_back(std::move(m));
}

void RdmaConnection::BacklogShrankLocked(size_t bytes) {
  backlog_bytes_ -= bytes;
  endpoint_->RemoveBacklogBytes(bytes);
}

absl::Status RdmaConnection::RoomInBacklogLocked(const Header& h, size_t frame) const {
  if (IsControlFrame(h)) return absl::OkStatus();
  const bool error = IsErrorResponse(h);
  const size_t headroom = error ? kQueuedErrorHeadroom : 0;
  const absl::string_view beyond = error ? ", and kQueuedErrorHeadroom of errors beyond it" : "";
  const size_t bound = endpoint_->options().max_backlog_bytes;
  if (backlog_bytes_ + frame > bound + headroom) {
    Count(&RdmaCounters::backlog_refusals);
    return absl::ResourceExhaustedError(
        absl::StrCat("more than ", bound, " bytes of frames wait for credits from ", peer_, " on ",
                     endpoint_->device_name(), " (RdmaOptions::max_backlog_bytes", beyond,
                     "; is the peer returning credits?)"));
  }
  const size_t total_bound = endpoint_->options().max_backlog_bytes_total;
  if (endpoint_->backlog_bytes() + frame > total_bound + headroom) {
    Count(&RdmaCounters::backlog_refusals);
    return absl::ResourceExhaustedError(
        absl::StrCat("more than ", total_bound, " bytes of frames wait for credits on ",
                     endpoint_->device_name(), " over all its connections, ", backlog_bytes_,
                     " of them for ", peer_, " (RdmaOptions::max_backlog_bytes_total", beyond,
                     "; are its peers returning credits?)"));
  }
  return absl::OkStatus();
}

bool RdmaConnection::CanPostLocked(const Header& h) {
  if (h.remote_payload()) hold_reads_ = false;
  if (CostsCredit(h.kind) && credits_ <= 0) return false;
  // A frame that advertises a window needs a second entry for the bind.
  const uint32_t entries = h.remote_payload() ? 2 : 1;
  if (sq_used_ + rd_atom_ + entries > sq_depth_) return false;
  if (h.remote_payload() && endpoint_->binds_wait_for_quiet_queue() && !QueueQuietForBindLocked()) {
    // READs started now would keep the queue from going quiet.
    hold_reads_ = true;
    return false;
  }
  const size_t frame = kHeaderSize + h.metadata_len + (h.remote_payload() ? 0 : h.payload_len);
  if (frame > max_inline_ && free_send_slots_.empty() &&
      !(send_slots_held_ < endpoint_->options().send_slots && TakeSendSlotLocked())) {
    return false;
  }
  if (h.kind != MessageKind::kRequest || !endpoint_->bounds_responses()) return true;
  if (endpoint_->TakeResponseRoom()) return true;
  // Registered before the second try, so that room given back in between
  // either shows in the try or wakes us.
  endpoint_->WaitForResponseRoom(weak_from_this());
  if (endpoint_->TakeResponseRoom()) return true;
  endpoint_->SayRoomRanOut();
  return false;
}

bool RdmaConnection::QueueQuietForBindLocked() {
  if (sq_used_ == invalidating_.size()) return true;
  if (!posted_.empty() && last_signaled_seq_ != next_seq_ - 1 &&
      sq_used_ + rd_atom_ + 1 <= sq_depth_) {
    QueueRetiringWriteLocked();
  }
  return false;
}

void RdmaConnection::QueueRetiringWriteLocked() {
  const uint32_t seq = next_seq_++;
  ibv_send_wr& wr = QueueLocked().wr;
  wr.wr_id = WrId(kWrSend, serial_, seq, true);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  Posted& posted = posted_.emplace_back();
  posted.seq = seq;
  posted.slot = -1;
  ++sq_used_;
  ++signaled_outstanding_;
  last_signaled_seq_ = seq;
}

void RdmaConnection::RetryBacklog() {
  bool queued;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    FlushBacklogLocked();
    queued = !outbox_.empty();
  }
  if (queued) FlushOutbox().IgnoreError();
}

bool RdmaConnection::TakeSendSlotLocked() {
  std::optional<uint32_t> b = endpoint_->TakeSendBlock();
  if (!b) return false;
  ++send_slots_held_;
  free_send_slots_.push_back(*b);
  return true;
}

void RdmaConnection::GiveBackIdleSendSlotLocked() {
  // Only with nothing waiting: a backlogged frame may be counting on the free
  // slot (SendLocked's first-slot rule), and one in flight still needs its own.
  if (!backlog_.empty() || free_send_slots_.size() != send_slots_held_) return;
  ReturnFreeSendSlots();
}

size_t RdmaConnection::send_slots_held() {
  std::lock_guard<InlineMutex> lock(mu_);
  return send_slots_held_;
}

void RdmaConnection::ReturnSendSlots(RingFifo<Posted>& posted) {
  for (; !posted.empty(); posted.pop_front()) {
    if (posted.front().slot >= 0) free_send_slots_.push_back(posted.front().slot);
  }
  ReturnFreeSendSlots();
}

void RdmaConnection::ReturnFreeSendSlots() {
  for (uint32_t slot : free_send_slots_) endpoint_->ReturnSendBlock(slot);
  free_send_slots_.clear();
  send_slots_held_ = 0;
}

RdmaConnection::Outgoing& RdmaConnection::QueueLocked() {
  Outgoing& o = outbox_.emplace_back();
  outbox_waiting_.store(true);  // seq_cst: see PostTaken
  o.wr = ibv_send_wr{};
  o.sge[0] = o.sge[1] = ibv_sge{};
  o.inline_bytes = false;
  o.payload.Reset();
  o.bound_mw = nullptr;
  o.bound_rkey = 0;
  return o;
}

absl::Status RdmaConnection::QueueFrameLocked(OutboundMessage& p,
                                              const absl::FunctionRef<void(char*)>* write) {
  p.header.credits = to_return_.exchange(0, std::memory_order_relaxed);
  if (p.header.credits != 0) credits_sent_.Add(endpoint_->poll_round(), p.header.credits);
  const size_t payload_size = write != nullptr ? p.header.payload_len : p.payload.size();
  const size_t frame = kHeaderSize + p.metadata.size() + payload_size;
  const bool inl = frame <= max_inline_;
  Advertised* adv = nullptr;  // what this frame advertises
  if (p.header.remote_payload()) {
    auto it = advertised_.find(p.header.remote.token);
    if (it != advertised_.end()) adv = &it->second;
  }
  if (adv != nullptr && release_timeout_ > absl::ZeroDuration()) {
    // A response waits for its release; a request with a deadline for its
    // answer, but the peer starts no READ past the deadline, so the timeout
    // then only covers a READ already running. Without windows an expired
    // request would cost the whole connection: it waits for its answer.
    if (p.header.kind == MessageKind::kResponse) {
      adv->release_by = SteadyNow() + release_timeout_;
    } else if (p.header.kind == MessageKind::kRequest && p.header.timeout_us > 0 &&
               adv->mw != nullptr) {
      adv->release_by = SteadyNow() + p.header.timeout() + release_timeout_;
    }
    next_release_due_ = std::min(next_release_due_, adv->release_by);
  }
  const bool bind = adv != nullptr && adv->mw != nullptr;
  // With a window to bind, the bind takes one sequence number and the SEND
  // the next, so completions free them in order.
  const uint32_t bind_seq = bind ? next_seq_++ : 0;
  const uint32_t seq = next_seq_++;
  const bool signaled = ++unsignaled_ >= endpoint_->options().signal_every ||
                        (!inl && free_send_slots_.size() == 1) ||
                        sq_used_ + rd_atom_ + 2 > sq_depth_;
  if (signaled) {
    unsignaled_ = 0;
    last_signaled_seq_ = seq;
  }
  // An advertised payload is exposed only now, through a type-2 window bound
  // to this QP over exactly its bytes; the bind is queued just before the
  // SEND, and the SQ runs in order, so the window exists before the peer
  // can learn of it.
  if (bind) {
    const uint32_t rkey = ibv_inc_rkey(adv->rkey);
    Outgoing& out = QueueLocked();
    out.bound_mw = adv->mw;
    out.bound_rkey = rkey;
    ibv_send_wr& bind = out.wr;
    bind.wr_id = WrId(kWrBind, serial_, bind_seq, false);
    bind.opcode = IBV_WR_BIND_MW;
    bind.bind_mw.mw = adv->mw;
    bind.bind_mw.rkey = rkey;
    bind.bind_mw.bind_info.mr = adv->block->mr;
    bind.bind_mw.bind_info.addr = reinterpret_cast<uintptr_t>(adv->payload.data());
    bind.bind_mw.bind_info.length = adv->payload.size();
    bind.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
    adv->rkey = rkey;
    p.header.remote.rkey = rkey;
    Posted& posted = posted_.emplace_back();
    posted.seq = bind_seq;
    posted.slot = -1;
    ++sq_used_;
  }
  if (p.header.remote_payload() && FaultInjection::TakeCorruptRkey()) {
    p.header.remote.rkey ^= 0x5a5a5a;
  }
  Outgoing& out = QueueLocked();
  int slot = -1;
  char* dst = out.bytes;
  if (!inl) {
    slot = static_cast<int>(free_send_slots_.back());
    free_send_slots_.pop_back();
    dst = endpoint_->SendBlock(slot);
  }
  EncodeHeader(p.header, dst);
  if (!p.metadata.empty()) memcpy(dst + kHeaderSize, p.metadata.data(), p.metadata.size());
  const size_t head = kHeaderSize + p.metadata.size();
  // The payload is sent from where it was serialized: an inline SEND's
  // provider copies it during the post (any memory will do); otherwise the
  // device reads it until completion, so it must be registered and stays
  // held by the posted_ entry until then. Anything else is copied.
  uint32_t payload_lkey = 0;
  const bool gather =
      !p.payload.empty() && (inl || endpoint_->SmallBlockLkey(p.payload.data(), &payload_lkey));
  if (write != nullptr) {
    (*write)(dst + head);  // SendWith: inline, so dst is the outbox entry's bytes
    Count(&RdmaCounters::sends_in_place);
  } else if (!p.payload.empty() && !gather) {
    memcpy(dst + head, p.payload.data(), p.payload.size());
    Count(&RdmaCounters::send_payload_copies);
  }
  out.inline_bytes = inl;
  out.sge[0] =
      ibv_sge{reinterpret_cast<uintptr_t>(dst), static_cast<uint32_t>(gather ? head : frame),
              inl ? 0u : endpoint_->SendBlockLkey(slot)};
  out.wr.num_sge = 1;
  Buffer held;
  if (gather) {
    out.sge[1] = ibv_sge{reinterpret_cast<uintptr_t>(p.payload.data()),
                         static_cast<uint32_t>(p.payload.size()), payload_lkey};
    out.wr.num_sge = 2;
    (inl ? out.payload : held) = std::move(p.payload);
  }
  out.wr.wr_id = WrId(kWrSend, serial_, seq, signaled);
  out.wr.opcode = IBV_WR_SEND;
  out.wr.send_flags = (inl ? IBV_SEND_INLINE : 0) | (signaled ? IBV_SEND_SIGNALED : 0);
  Posted& posted = posted_.emplace_back();
  posted.seq = seq;
  posted.slot = slot;
  posted.payload = std::move(held);
  ++sq_used_;
  if (signaled) ++signaled_outstanding_;
  if (CostsCredit(p.header.kind)) --credits_;
  if (p.header.kind == MessageKind::kRequest && endpoint_->bounds_responses()) {
    ++responses_awaited_;  // its room was taken by CanPostLocked
  }
  Count(&RdmaCounters::sends);
  if (inl) Count(&RdmaCounters::sends_inline);
  return absl::OkStatus();
}

absl::Status RdmaConnection::FlushOutbox() {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (!TakeOutboxLocked()) return absl::OkStatus();
  }
  return PostTaken();
}

bool RdmaConnection::TakeOutboxLocked() {
  if (outbox_.empty() || post_token_.exchange(true)) return false;
  posting_.swap(outbox_);
  outbox_waiting_.store(false);
  return true;
}

absl::Status RdmaConnection::PostTaken() {
  absl::Status result;
  for (;;) {
    for (size_t i = 0; i < posting_.size(); ++i) {
      Outgoing& o = posting_[i];
      if (o.wr.num_sge > 0) o.wr.sg_list = o.sge;
      if (o.inline_bytes) o.sge[0].addr = reinterpret_cast<uintptr_t>(o.bytes);
      o.wr.next = i + 1 < posting_.size() ? &posting_[i + 1].wr : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const bool fail = FaultInjection::BeforePost();
    RDMARPC_STAGE(kPostBegin);
    if (!fail) sanitizer_sync::SentOn(qp_);
    const int rc = fail ? ENOMEM : ibv_post_send(qp_, &posting_[0].wr, &bad);
    RDMARPC_STAGE(kPostEnd);
    if (fail) bad = &posting_[0].wr;
    for (Outgoing& o : posting_) {
      if (rc != 0 && &o.wr == bad) break;
      if (o.bound_mw != nullptr) o.bound_mw->rkey = o.bound_rkey;
    }
    if (rc != 0) {
      result = absl::UnavailableError(
          absl::StrCat("ibv_post_send to ", peer_, " failed: ", strerror(rc)));
      uint32_t lost_signaled = 0;
      for (ibv_send_wr* w = bad; w != nullptr; w = w->next) {
        if (w->send_flags & IBV_SEND_SIGNALED) ++lost_signaled;
      }
      {
        std::lock_guard<InlineMutex> lock(mu_);
        closed_ = true;
        signaled_outstanding_ -= lost_signaled;
      }
      // Calls whose frames were lost end when the connection does.
      if (auto self = weak_from_this().lock()) {
        endpoint_->RunOnPoller([self, result] { self->Fail(result); });
      }
    }
    posting_.clear();
    post_token_.store(false);
    // A sender that queued while this thread held the token found the token
    // taken and left its frames to this thread. Its store to outbox_waiting_
    // precedes its exchange of the token, which read true and so precedes
    // the store just above; all are seq_cst, so the load below sees it. Then
    // the lock is taken only when frames are waiting, not after every post.
    if (!outbox_waiting_.load()) return result;
    std::lock_guard<InlineMutex> lock(mu_);
    if (!TakeOutboxLocked()) return result;
  }
}

void RdmaConnection::FlushBacklogLocked() {
  if (ask_to_send_ != 0 || answer_to_send_ != 0) SendShrinkLocked();
  while (!backlog_.empty() && !closed_ && CanPostLocked(backlog_.front().header)) {
    const size_t bytes = BacklogBytes(backlog_.front());  // before the payload moves out
    if (!QueueFrameLocked(backlog_.front()).ok()) return;
    BacklogShrankLocked(bytes);
    backlog_.pop_front();
  }
}

bool RdmaConnection::Delivered() {
  // A SEND is delivered when it completes: the peer's device has placed it
  // and acknowledged it. A close before that flushes it unsent, so a posted
  // SEND counts as undelivered too, and so does what is queued behind
  // credits or the SQ and what the peer has still to READ.
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_) return true;
    if (!advertised_.empty() || !backlog_.empty() || !outbox_.empty()) return false;
    if (posted_.empty()) return true;
    // Unsignaled SENDs complete only with a later signaled work request.
    // With none outstanding, the tail would wait for the idle keepalive (or
    // for ever, with keepalive_ms = 0).
    if (signaled_outstanding_ != 0 || sq_used_ + rd_atom_ + 1 > sq_depth_) return false;
    QueueRetiringWriteLocked();
  }
  FlushOutbox().IgnoreError();
  return false;
}

void RdmaConnection::ReleaseAdvertisedLocked(uint64_t token) {
  auto it = advertised_.find(token);
  if (it == advertised_.end()) return;
  if (it->second.mw == nullptr) {
    advertised_.erase(it);  // the block goes back to the pool
    return;
  }
  // The window still grants the peer access: the block returns to the pool
  // only once a LOCAL_INV has revoked it.
  to_invalidate_.push_back(std::move(it->second));
  advertised_.erase(it);
  FlushInvalidationsLocked();
}

void RdmaConnection::FlushInvalidationsLocked() {
  while (!to_invalidate_.empty() && !closed_ && sq_used_ + rd_atom_ + 1 <= sq_depth_) {
    Advertised& adv = to_invalidate_.front();
    const uint32_t index = next_invalidation_++;
    ibv_send_wr& wr = QueueLocked().wr;
    wr.wr_id = WrId(kWrInvalidate, serial_, index, true);
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = adv.rkey;
    wr.send_flags = IBV_SEND_SIGNALED;
    ++sq_used_;
    ++signaled_outstanding_;
    invalidating_.emplace(index, std::move(adv));
    to_invalidate_.pop_front();
  }
}

void RdmaConnection::FreeWindowsLocked() {
  // Only with the QP out of RTS: nothing can READ through the windows then.
  for (auto& [token, adv] : advertised_)
    if (adv.mw) ibv_dealloc_mw(adv.mw);
  for (auto& adv : to_invalidate_) ibv_dealloc_mw(adv.mw);
  for (auto& [index, adv] : invalidating_) ibv_dealloc_mw(adv.mw);
  for (const Window& w : free_mws_) ibv_dealloc_mw(w.mw);
  advertised_.clear();
  to_invalidate_.clear();
  invalidating_.clear();
  free_mws_.clear();
}

void RdmaConnection::SendControl(MessageKind kind, uint64_t token) {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_) return;
    OutboundMessage p;
    p.header.kind = kind;
    p.header.remote.token = token;
    if (kind == MessageKind::kCredit) {
      // Credit-only frames jump the backlog (they need no credit); if there
      // is no room, the credit goes with a later frame instead.
      if (!CreditWorthSending() || !CanPostLocked(p.header)) return;
      Count(&RdmaCounters::credit_messages);
      QueueFrameLocked(p).IgnoreError();
    } else if (!backlog_.empty() || !CanPostLocked(p.header)) {
      AddToBacklogLocked(std::move(p));
      return;
    } else {
      QueueFrameLocked(p).IgnoreError();
    }
  }
  FlushOutbox().IgnoreError();  // a failed post tears the connection down
}

void RdmaConnection::Close() {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  // Teardown disconnects, on the poller: the only thread that touches the QP
  // after setup, so a disconnect never races with its destruction.
  if (auto self = weak_from_this().lock()) {
    endpoint_->RunOnPoller([self] {
      self->Teardown(
          absl::UnavailableError(absl::StrCat("connection to ", self->peer_, " closed locally")));
    });
  }
}

void RdmaConnection::OnPeerGone(absl::Status why) {
  if (freed_) return;
  // The peer's last frames completed before it disconnected (a server
  // shutting down waits for that), but may still wait on our CQ behind more
  // than one batch; once torn down, this connection would drop them.
  endpoint_->DrainCompletions();
  rdma_disconnect(id_);
  why = RevocationHint(std::move(why));
  Teardown(absl::Status(why.code(), absl::StrCat(why.message(), LocationNote())));
}

void RdmaConnection::FailFromDevice(absl::Status why) {
  if (!freed_) Fail(std::move(why));
}

std::string RdmaConnection::LocationNote() const {
  if (id_ == nullptr) return "";
  return absl::StrCat(DeviceEvents::PortNote(endpoint_->verbs(), id_->port_num),
                      "; our end: ", DescribeLocalEnd(id_));
}

absl::Status RdmaConnection::RevocationHint(absl::Status why) {
  // A READ past its expiry may meet the peer's revocation in the middle of a
  // multi-packet response; the peer's QP then fails without NAKing anything
  // we would complete, and its disconnect is all we see.
  const absl::Time now = SteadyNow();
  for (const auto& [index, op] : reads_) {
    if (op.in_flight == 0 || op.give_up == absl::InfiniteFuture() || now < op.expiry) continue;
    uint32_t peer_release_ms;
    {
      std::lock_guard<InlineMutex> lock(mu_);
      peer_release_ms = peer_release_timeout_ms_;
    }
    return absl::Status(
        why.code(),
        absl::StrCat(why.message(), " while our RDMA READ of its buffer ran past ",
                     op.msg.header.kind == MessageKind::kRequest ? "the request's deadline"
                                                                 : "half its release timeout",
                     " (likely cause: ", RevocationRule(op.msg.header.kind, peer_release_ms), ")"));
  }
  return why;
}

void RdmaConnection::Fail(absl::Status why) {
  if (torn_down_) return;  // ended already, and said why then
  if (accept_probed_ && !established_.load(std::memory_order_acquire)) {
    Count(&RdmaCounters::accepts_unfinished);
    why = absl::Status(
        why.code(),
        absl::StrCat(peer_, " did not complete its connection within ",
                     Rounded(absl::Milliseconds(endpoint_->options().accept_timeout_ms)),
                     " of our accept (no RTU, so rdma_cm never said ESTABLISHED), and its device "
                     "did not answer a probe: its process stopped, or its machine or link went "
                     "down, after its connect request (RdmaOptions::accept_timeout_ms); ",
                     why.message()));
  }
  why = absl::Status(why.code(), absl::StrCat(why.message(), LocationNote()));
  fprintf(stderr, "rdmarpc[%s]: closing connection to %s: %s\n", options_.name.c_str(),
          peer_.c_str(), std::string(why.message()).c_str());
  Teardown(std::move(why));
}

void RdmaConnection::DetachObserver() {
  endpoint_->RunOnPollerAndWait([this] { observer_ = nullptr; });
}

void RdmaConnection::Teardown(absl::Status why) {
  if (torn_down_) return;
  torn_down_ = true;
  if (endpoint_->options().trace) {
    TraceLine(options_.name,
              absl::StrCat(peer_, ": tearing down QP ", qp_num_, ": ", why.ToString()));
  }
  keep_alive_ = shared_from_this();
  teardown_started_ = SteadyNow();
  uint32_t room_back;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    closed_ = true;
    backlog_.clear();
    BacklogShrankLocked(backlog_bytes_);
    room_back = std::exchange(responses_awaited_, 0);
  }
  endpoint_->ReturnResponseRoom(room_back);
  // Moves the QP to the error state: outstanding work flushes and the peer
  // can no longer READ what we advertised. rdma_disconnect does that only
  // for a QP that is still the id's.
  rdma_disconnect(id_);
  if (id_->qp != qp_) {
    ibv_qp_attr error{};
    error.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(qp_, &error, IBV_QP_STATE);
  }
  read_queue_.clear();
  if (observer_) observer_->OnClosed(*this, why);
  // After the observer: a close counted is one its owner has heard of.
  Count(&RdmaCounters::connections_closed);
  endpoint_->AddDraining(this);
}

bool RdmaConnection::FinishTeardown() {
  // What is still queued goes to the QP, which is in the error state by now:
  // it completes as flushed, like everything else outstanding.
  FlushOutbox().IgnoreError();
  bool drained;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    // Every READ is signaled, so this covers all DMA into our memory; an
    // unsignaled SEND only reads a local slot, freed with the QP.
    drained = signaled_outstanding_ == 0;
  }
  if (!drained && SteadyNow() - teardown_started_ < kDrainBound) return false;
  if (endpoint_->options().trace) {
    TraceLine(
        options_.name,
        absl::StrCat(peer_, ": QP ", qp_num_, " ",
                     drained ? "drained" : "not drained (blocks a READ may still write are leaked)",
                     " after ", Rounded(SteadyNow() - teardown_started_), "; freeing it"));
  }
  endpoint_->RemoveConnection(this);
  // Nothing may post from here on (Send refuses since Teardown): the token is
  // taken and never given back.
  while (post_token_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  // Payloads of SENDs that may not have completed (an unsignaled tail, or
  // past kDrainBound) go back only once the QP is gone: until then the
  // device may still read them, and a reused block must never reach this
  // peer.
  RingFifo<Posted> posted;
  {
    // Windows first: rxe holds a QP reference per bound window, so destroying
    // the QP before them would block. The QP is in the error state already,
    // so no READ can use them.
    std::lock_guard<InlineMutex> lock(mu_);
    outbox_.clear();
    outbox_waiting_.store(false);
    FreeWindowsLocked();
    request_tokens_.clear();
    posted.swap(posted_);
  }
  DestroyQp(/*used=*/true);
  {
    // The QP is gone, so the device reads no send slot any more.
    std::lock_guard<InlineMutex> lock(mu_);
    ReturnSendSlots(posted);
  }
  for (auto& [op_id, op] : reads_) {
    // A READ that never drained might still write: leak its block, never reuse it.
    if (op.block && (drained || op.in_flight == 0)) endpoint_->pool().Put(op.block);
  }
  reads_.clear();
  rdma_cm_id* id = std::exchange(id_, nullptr);
  freed_ = true;
  auto self = std::move(keep_alive_);
  if (on_freed_) {
    on_freed_(this, id);
  } else {
    rdma_destroy_id(id);
  }
  return true;
}

}  // namespace rdmarpc::transport::rdma
