// RdmaConnection: one RC queue pair set up by rdma_cm, as a transport
// Connection.
//
// Small frames (header + metadata + payload fit in the peer's slot and the
// payload is at most read_threshold) go by one SEND — inline when the QP's
// max_inline_data allows — into the peer's SRQ. Otherwise the SEND carries
// only header and metadata, with kFlagRemotePayload and (addr, rkey, token)
// of the payload in registered memory, and the receiver pulls the payload by
// RDMA READs split at the device's max_msg_sz, at most `rd_atom` outstanding.
// It starts none for a payload over max_message_size, a request past its
// deadline, or one its observer refuses by the header (AdmitRemotePayload,
// a server over its call limit): such a message is delivered without payload,
// with payload_status saying why.
//
// No copy on the way out. A small payload from AllocatePayload is a block of
// registered memory (Endpoint::SmallBuffer) and the SEND gathers it as a
// second entry after header and metadata: an inline SEND's provider copies it
// during the post, a non-inline SEND's device reads it, and the block is held
// by the posted_ entry until a completion at or after that SEND (or, at
// teardown, until the QP is destroyed). A payload from elsewhere is copied
// into the frame (counted as send_payload_copies). SendWith goes one better
// for a frame that fits inline and can be posted at once: the payload is
// serialized straight into the outbox entry after the header, so the SEND has
// one entry and no block is taken, lent or given back. A large payload from
// AllocatePayload is advertised where it was written, even when the runtime
// made its Buffer shorter (an attachment with room for the message after it,
// rpc/attachment.h); one from elsewhere is copied into a pool block first
// (advertised_payload_copies).
//
// Flow control. Credits count frames: at connect each side grants the other
// a window, carried in the rdma_cm private data. Every frame but kCredit and
// kShrink costs the sender one credit; the receiver returns credits in the
// `credits` field of any frame it sends, or in a kCredit frame once half a
// window is due, two frames at least (at once to a peer left with none: a
// peer that still has credit and waits for an answer gets the credit back
// in it, so at small windows an answer that comes off the I/O thread costs
// no kCredit). kCredit and kShrink
// frames are free, so two peers that both ran out can always unblock each
// other. Frames that find no credit (or no send slot, or a full send queue)
// wait in a backlog, in order (counted as credit_stalls).
//
// Credits are per connection and the SRQ is not, so each endpoint keeps
// what all its peers may send within its posted slots:
//   - a listening one shares its SRQ's budget (ShareReceiveBudget) among its
//     connections: a connection's window is its share, at most
//     RdmaOptions::credits. The peer holds its window at most: we return a
//     frame's credit only while the budget has room (Endpoint::FreeCredits),
//     and otherwise wait for some to come back (Endpoint::WaitForCredits).
//     As connections join, the windows shrink and a peer holding more than
//     its window is asked for the difference in a kShrink; it takes that off
//     its credits, into debt if it already spent them, and answers with a
//     kShrink behind the frames it sent on them, after which the credits
//     are the budget's again. Only as many are asked back as the budget is
//     overdrawn by (or a connection waiting for room lacks), less what
//     kShrinks already out will bring back, largest excess first: each
//     kShrink takes a slot at a peer whose SRQ may serve many of our
//     connections. A peer is asked only once rdma_cm says it is
//     established: before, its QP may not receive yet. A kShrink may reach
//     the peer before the handshake's terms do; its debt stands (SetPeer
//     adds the window). A peer that does not answer in time stops holding
//     the others back (WriteOffUnansweredShrink); each answer is followed
//     by a Reshare, since what it brought back may no longer be what the
//     budget lacks. As connections leave, the windows grow, and
//     are topped up as their peers send. Every peer may hold one credit,
//     whatever the budget: past as many connections as the budget holds
//     frames the windows overcommit the slots, which the endpoint says once
//     (AddConnection);
//   - with RdmaOptions::strict_credits, a listening endpoint grants a new
//     connection what the slots not spoken for hold (Endpoint::
//     StrictWindow), or refuses it, and never takes a window back;
//   - a connecting one sends a request only with response room on the
//     endpoint (Endpoint::TakeResponseRoom; CanPostLocked waits for it as
//     for credit), given back when its response arrives or the connection
//     is torn down: its peers send it responses and control frames only.
// RNR retry (rnr_retry_count 7) is the safety net when the SRQ runs short
// all the same; the device counts those NAKs (ReadDeviceRnrNaks), and the
// sender waits RdmaOptions::rnr_wait_us before each retry, not rdma_cm's
// 655 ms (RdmaTransport::SetRnrWait). Do not lean on it: on Soft-RoCE
// (Linux 6.1) an RNR NAK on a QP with READs outstanding can stall those
// READs until the connection is ended (bench/RESULTS.md, "RNR retry is no
// safety net on Soft-RoCE").
//
// A peer that sends without credit. An SRQ serves every connection of its
// endpoint, so a peer that sent past its credit would take slots the others
// were promised. A frame on credit is checked as it is handled: the frames
// the peer spent, plus the credits its kShrink answers gave back, must not
// exceed its handshake window plus the credits we put in frames before the
// batch of completions that brought it was polled (Endpoint::poll_round;
// the credits granted while handling that batch, or not yet sent, cannot
// have reached it). Past that, the connection ends INTERNAL ("frame without
// credit", counted as frames_without_credit) and the others go on. The
// check never blames an honest peer: a credit counted was queued before the
// batch's poll, and posted after it, if anything. What it cannot see: the
// credit sent while one batch was handled counts for the next, though the
// peer may have sent the next batch's frames before that credit reached
// it, so a peer ahead by no more than that is missed. A flood past the
// window while the poller lags comes as one batch (up to Endpoint::
// kCompletionsPerPoll frames) with more frames than credit, and is caught.
// kCredit and kShrink frames cost no credit, but are bounded all the same
// (counted as unwarranted_control_frames when one breaks its bound):
//   - a peer returns credit only for frames we sent it, so we never hold
//     more than the largest window its handshake says it may grant
//     (Handshake::max_credits). Each kCredit returns one credit at least
//     (one that returns none is malformed), so a peer can send no more of
//     them than we sent it frames, plus that window. Past that bound the
//     connection ends ("credit past its window"). A client learns the
//     bound when rdma_cm reports the server's handshake, and checks credit
//     that came before it with the next frame after;
//   - a kShrink ask asks for one credit at least, and a peer asks again
//     only once our answer to its last ask has reached it: an ask that
//     comes while an earlier one has no answer queued before its batch was
//     polled ends the connection ("kShrink out of turn"). Like the frame
//     check, it can miss an ask that came just after an answer queued
//     while the previous batch was handled, never blame an honest one.
//
// Buffer lifetime (the rule that makes remote memory safe). A payload is
// exposed to the peer only through a type-2 memory window, bound to this
// connection's QP (no other QP can use its rkey) over exactly the payload's
// bytes, by a bind posted just before the SEND that advertises it (on
// Soft-RoCE only once nothing on the wire is outstanding ahead of it:
// Endpoint::binds_wait_for_quiet_queue). It stays
// bound, untouched and out of the pool until
//   - for a request: the response to that call id arrives on this connection
//     (even when the caller already gave up: cancel and timeout do not free
//     it), or, for a request with a deadline, release_timeout_ms after the
//     deadline: the peer starts no READ past the deadline, so this only
//     cuts off a READ that started in time and ran that much longer (which
//     then ends the connection). Without windows it waits for the response;
//   - for a response: the peer's kRelease for its token (sent when its READ
//     is done or when it decided not to READ), or, failing that,
//     RdmaOptions::release_timeout_ms after its SEND was queued: a peer that
//     never releases must not hold our memory (ExpireUnreleased). The peer
//     learns the timeout in the handshake and skips a READ it would start
//     late; a READ still running at the timeout fails and ends its
//     connection (and where the device neither finishes nor fails it, as
//     Soft-RoCE, the peer ends the connection at twice the timeout).
//     Without windows nothing but the QP's leaving RTS revokes access, so
//     there the connection is closed instead;
//   - or the connection is torn down and its QP has left RTS.
// Then a LOCAL_INV revokes the window, and only when that has completed does
// the block return to the pool; a replayed (addr, rkey) is refused by the NIC.
// Each READ targets a local block that is reused only after the READ
// completed or was flushed. Caveat seen on Soft-RoCE (Linux 6.1): rxe checks
// a READ through a window against the underlying block's registration, not
// the window's range, so there the peer of that one QP could read the rest of
// the block while the window is bound; hardware NICs enforce the window.
// Devices without type-2 windows fall back to a REMOTE_READ registration per
// block, which is neither QP-bound nor revocable (logged at start).
//
// Dead peers. A peer whose machine, NIC or link dies sends no disconnect;
// only a work request of ours that its device never acknowledges shows it.
// The QP's ACK timeout (RdmaOptions::peer_timeout_ms) and kTransportRetries
// bound that wait, after which the request fails (RETRY_EXC_ERR) and the
// connection ends UNAVAILABLE. Frames and completions from the peer count as
// signs of life; a connection with none for keepalive_ms sends a zero-byte
// RDMA WRITE, which the peer's device acknowledges without its software. It
// costs the peer no receive slot or credit and, unlike a zero-byte READ,
// none of the READ resources (max_qp_rd_atom) that the peer's own READs of
// our payloads use; zero bytes check no address or rkey (IBA C9-88), so
// nothing of ours needs remote write access. Where the device neither
// acknowledges nor fails it (Soft-RoCE retries for ever when the peer asked
// for 7 retries), the connection ends at twice the device's retry time
// anyway. These clocks, the READ backstops below and the release timeouts
// are in rdma_connection_timeouts.cc.
//
// Stalled READs. A READ in flight with no completion for keepalive_ms also
// gets the keepalive behind it. On Soft-RoCE (Linux 6.1, host CPUs starved)
// an 8 MiB READ and the 1-byte one after it once never completed nor
// failed; the likeliest cause is the device's requester waiting for a
// wake-up that never came, which a new work request gives it (each such
// keepalive is logged and counted, keepalives_behind_reads). A READ the
// device has neither completed nor failed within twice its retry time plus
// its bytes at kSlowestReadBytesPerSecond ends the connection UNAVAILABLE,
// so no call waits on a lost READ for ever.
//
// Threading: Send/AllocatePayload/Close from any thread; everything else runs
// in the endpoint's I/O context (its poller thread or a caller driving it, one
// at a time; see endpoint.h). A mutex guards the send side's bookkeeping, but
// no lock is held across ibv_post_send: work requests are built under the
// mutex into an outbox, in the order their sequence numbers were taken, and
// posted outside it by whichever thread holds the post token (a sender takes
// it with the outbox in the critical section that queued its frame; see
// TakeOutboxLocked and PostTaken); a thread that finds the token taken leaves
// its requests to the holder, who looks again after it lets go. One doorbell
// may carry several requests.
// Teardown takes the token for good before it destroys the QP.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_H_

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "base/inline_mutex.h"
#include "base/ring_fifo.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/sent_by_round.h"
#include "transport/transport.h"

namespace rdmarpc::transport::rdma {

// The rdma_cm private data both sides send (20 bytes, little-endian). Both
// sides must speak the same version: a peer of another one is refused at
// connect, both versions named.
struct Handshake {
  static constexpr uint16_t kMagic = 0x4852;  // "RH"
  // 2: kShrink frames (shared windows); 3: max_credits.
  static constexpr uint8_t kVersion = 3;
  uint16_t magic = kMagic;
  uint8_t version = kVersion;
  uint8_t reserved = 0;
  uint32_t credits = 0;    // frames the sender of this handshake accepts unacked
  uint32_t slot_size = 0;  // largest frame the sender of this handshake receives
  // How long the sender keeps a response payload exposed without a release
  // (RdmaOptions::release_timeout_ms); 0: until released. The receiver does
  // not start a READ of such a payload once half of it has passed.
  uint32_t release_timeout_ms = 0;
  // The largest window the sender may ever grant on this connection (a
  // shared window grows as connections leave), at least `credits`: the
  // receiver may never hold more credits than this, so credit returned
  // past it is refused ("A peer that sends without credit").
  uint32_t max_credits = 0;
};
static_assert(sizeof(Handshake) == 20, "handshake fits any rdma_cm private data (56 bytes)");

// A refused connection request's REJ private data: kRefusalPrefix, then why,
// as text, at most kMaxRefusalBytes in all (IB CM carries 148 and pads them
// with zeros). The client's connect error then says why the server refused.
// A longer reason is cut after its last word that fits and ends in
// kRefusalCut, so that the client can tell it was cut; the server's log line
// has all of it.
inline constexpr char kRefusalPrefix[] = "rdmarpc refused: ";
inline constexpr char kRefusalCut[] = " ...";
inline constexpr size_t kMaxRefusalBytes = 148;
static_assert(kMaxRefusalBytes <= 255, "rdma_reject takes a uint8_t length");

class RdmaConnection : public Connection, public std::enable_shared_from_this<RdmaConnection> {
 public:
  // wr_id kinds (top 4 bits of a non-RECV wr_id).
  enum : uint64_t { kWrSend = 1, kWrRead = 2, kWrBind = 3, kWrInvalidate = 4, kWrKeepalive = 5 };
  // Inline sends' header and metadata are copied into the outbox entry;
  // larger inline limits are not used.
  static constexpr uint32_t kMaxInlineUsed = 512;

  RdmaConnection(Endpoint* endpoint, rdma_cm_id* id, std::string peer, uint32_t serial,
                 const TransportOptions& options, const Handshake& peer_handshake,
                 uint32_t local_credits, uint32_t rd_atom);
  ~RdmaConnection() override;

  // Creates the QP on the endpoint's PD/CQ/SRQ; the status is errno's
  // (absl::ErrnoToStatus).
  absl::Status CreateQp();
  // Before the connection is added to its endpoint.
  void set_observer(ConnectionObserver* observer) { observer_ = observer; }
  // From here the observer hears nothing more, OnClosed included, and frames
  // that arrive are dropped: for a connect given up, whose caller may destroy
  // the observer once Connect returns. Returns once no call into the
  // observer is in progress: it is cleared on the I/O context, which makes
  // those calls.
  void DetachObserver();

  absl::Status Send(OutboundMessage&& msg) override;
  absl::Status SendWith(OutboundMessage&& msg, size_t payload_size,
                        absl::FunctionRef<void(char*)> write) override;
  // Frames up to this many bytes go inline (the QP's max_inline_data, at
  // most kMaxInlineUsed); SendWith writes their payloads in place.
  uint32_t max_inline() const { return max_inline_; }
  // Send slots this connection holds: endpoint blocks taken as frames that
  // do not go inline needed them (at most RdmaOptions::send_slots), given
  // back as their SENDs complete but for one kept free, and that one too
  // once the connection has been silent for RdmaOptions::keepalive_ms.
  size_t send_slots_held();
  absl::StatusOr<Buffer> AllocatePayload(size_t size) override;
  void Close() override;
  bool Delivered() override;
  const std::string& peer() const override { return peer_; }
  bool Drive(absl::FunctionRef<bool()> done) override { return endpoint_->Drive(done); }

  uint32_t serial() const { return serial_; }
  Endpoint* endpoint() const { return endpoint_; }
  // Destroys the QP and gives up the rdma_cm id (its owner destroys it);
  // for a connection refused during setup.
  void ReleaseId();
  // Takes the QP off the rdma_cm id, on the poller while the CM thread
  // waits, for a connect given up after its request went out. librdmacm
  // moves an id's QP inside rdma_get_cm_event as the answer comes, and
  // leaves an id without one alone: so taken, the QP can be torn down at
  // once, and the id destroyed after it, which cancels the request.
  void TakeQpFromId();
  uint32_t qp_num() const { return qp_num_; }
  rdma_cm_id* id() const { return id_; }
  // What we granted the peer at the handshake.
  uint32_t credit_window() const { return credit_window_; }
  // Shared windows (Endpoint::shares_credits), I/O context: the credits the
  // peer holds or has in flight to us; the endpoint's room may let us top
  // the peer up to its window (a kCredit when worth one); and a kShrink
  // asks `count` of what it holds past its window back.
  int64_t peer_holds() const { return peer_holds_; }
  // What of peer_holds counts against the endpoint's budget: all of it but
  // what an unanswered kShrink wrote off (WriteOffUnansweredShrink).
  int64_t credits_on_budget() const { return peer_holds_ - written_off_; }
  // The credits we hold to send on; below 0 while a kShrink's debt is paid
  // back. Any thread.
  int64_t credits_held();
  void TopUpCredits();
  // What the peer holds past its window; 0 while a kShrink is unanswered
  // or before the connection is established.
  int64_t CreditsOverWindow() const;
  // What our unanswered kShrink will bring back to the budget; 0 when none
  // is out, or it was written off.
  uint32_t credits_asked_back() const { return shrink_overdue_ ? 0 : shrink_asked_; }
  void AskForCreditsBack(uint32_t count);

  // I/O context (endpoint.h).
  void OnRecv(uint32_t slot, const char* data, uint32_t length);
  void OnCompletion(const ibv_wc& wc);
  // Ends the connection: observer->OnClosed, then waits for the QP to drain
  // and frees everything. Idempotent.
  void Teardown(absl::Status why);
  // The peer disconnected (rdma_cm event): handle what it sent before,
  // answer its DREQ, then tear down. I/O context.
  void OnPeerGone(absl::Status why);
  // The device reported this QP, or the CQ, SRQ or device it uses, failed
  // (device_events.h): tear down with `why`. I/O context.
  void FailFromDevice(absl::Status why);
  bool torn_down() const { return torn_down_; }
  // Frees the QP and buffers once the QP has drained (or after a bound);
  // true when done. Called by the endpoint's poller.
  bool FinishTeardown();
  // Client side: the server's handshake, once ESTABLISHED.
  void SetPeer(const Handshake& peer);
  // Learns from the QP, once it is connected, how long its device waits for
  // an acknowledgement before it fails a work request (ACK timeout x tries).
  void LearnRetryPolicy();
  // "ACK timeout ..., N tries: a silent peer fails after ~T", for logs.
  std::string DescribeRetryPolicy();
  // The QP and the terms of this connection (credits both ways, frame and
  // inline limits, READs in flight, the peer's release timeout), for
  // RdmaOptions::trace.
  std::string DescribeTerms();
  // rdma_cm says both sides are connected: keepalives may start (one
  // posted before the QP is ready to send would fail the connection), and
  // kShrinks (CreditsOverWindow).
  void MarkEstablished() { established_.store(true, std::memory_order_release); }
  // A listener's connection, before the endpoint sees it: if rdma_cm has
  // not said ESTABLISHED by `deadline` (RdmaOptions::accept_timeout_ms),
  // ExpireTimeouts sends the client a keepalive, and the connection ends
  // when that fails.
  void set_establish_by(absl::Time deadline) { establish_by_ = deadline; }
  // True when ExpireTimeouts has something to do at `now`: a release
  // timeout passed, a READ, keepalive, kShrink answer or accept's RTU
  // overdue, a keepalive to send; cheap. I/O context.
  bool TimeoutsDue(absl::Time now);
  // Revokes the advertised responses whose release timeout passed by `now`
  // (or, without memory windows, closes the connection); closes it too when
  // a READ of the peer's response is still running well past the peer's
  // release timeout, or a keepalive is neither acknowledged nor failed
  // well past the device's retry time. Sends a keepalive when the peer has
  // been silent for RdmaOptions::keepalive_ms. Writes off what a peer
  // holds past its window when it has not answered a kShrink within
  // RdmaOptions::shrink_answer_timeout_ms. Probes an accepted connection
  // its client has not completed by set_establish_by's deadline. I/O
  // context.
  void ExpireTimeouts(absl::Time now);
  // Called (I/O context) when the connection is fully gone, with its
  // rdma_cm id for the owner to destroy; without it the id is destroyed here.
  void set_on_freed(std::function<void(RdmaConnection*, rdma_cm_id*)> f) {
    on_freed_ = std::move(f);
  }
  // Sends what waits in the backlog as far as credit and room allow: the
  // endpoint calls it when response room comes back (Endpoint::
  // TakeResponseRoom). I/O context.
  void RetryBacklog();

 private:
  // Destroys the QP, if any, and gives its room on the CQ back: at once when
  // no work was ever posted on it, else after the poller has emptied the CQ
  // (I/O context only then).
  void DestroyQp(bool used);
  // A memory window and its rkey as we last bound it. The rkey is kept here,
  // not read from ibv_mw: the provider's copy changes only once the bind has
  // been posted, which may be on another thread after we have moved on.
  struct Window {
    ibv_mw* mw = nullptr;
    uint32_t rkey = 0;
  };
  struct Advertised {  // a payload the peer may READ
    Buffer payload;
    RegisteredPool::Block* block = nullptr;
    ibv_mw* mw = nullptr;  // bound when its frame is queued; null without windows
    uint32_t rkey = 0;     // the window's rkey (the new one once bound)
    MessageKind kind = MessageKind::kResponse;  // of the frame that advertises it
    uint64_t call_id = 0;
    // Revoked then if not released (set when its SEND is queued): a response
    // release_timeout_ms later, a request with a deadline that much after it.
    absl::Time release_by = absl::InfiniteFuture();
    bool expired = false;  // revoked at release_by, not released by the peer
  };
  struct Posted {
    uint32_t seq;
    int slot;        // send slot to free on completion, or -1
    Buffer payload;  // read by the device until completion (a gathered SEND)
  };
  // A work request waiting in the outbox. Pointers into the entry itself
  // (sg_list, inline bytes) are set when it is posted: the vector may move.
  struct Outgoing {
    // Not value-initialized: QueueLocked sets every field but `bytes`, of
    // which a frame uses only what it writes.
    Outgoing() {}
    ibv_send_wr wr;
    // A SEND gathers header and metadata (sge[0]) and the payload where it
    // was serialized (sge[1]); see QueueFrameLocked.
    ibv_sge sge[2];
    bool inline_bytes;  // sge[0] covers `bytes`
    Buffer payload;     // an inline SEND's payload, copied by the provider when posted
    // A bind: once posted, the provider's ibv_mw must show the new rkey (the
    // next bind of that window names it by its current rkey).
    ibv_mw* bound_mw;
    uint32_t bound_rkey;
    char bytes[kMaxInlineUsed];
  };
  struct ReadOp {
    InboundMessage msg;
    RegisteredPool::Block* block = nullptr;
    uint64_t remote_addr = 0;
    uint32_t rkey = 0;
    size_t next = 0;  // next offset to post
    int in_flight = 0;
    // Not READ after this: a request's deadline, or for a response half the
    // peer's release timeout.
    absl::Time expiry = absl::InfiniteFuture();
    // The connection fails if the READ is still running then: twice the
    // peer's release timeout after a response arrived or a request's
    // deadline (the peer has revoked the buffer by then).
    absl::Time give_up = absl::InfiniteFuture();
  };

  // `why`, plus the peer's revocation rule when one of our READs is running
  // past its expiry: what most likely took the peer down. I/O context.
  absl::Status RevocationHint(absl::Status why);
  // Fills in the header's lengths, flags and remote descriptor, advertises a
  // payload that goes by READ (moving it out of `m`), then queues the frame
  // or, without credit, send slot or SQ room, moves `m` to the backlog.
  absl::Status SendLocked(OutboundMessage& m);
  // Credit, SQ room, for a frame that binds a window where the device needs
  // it a quiet queue, and, for a frame that does not go inline, a free send
  // slot, taking one more from the endpoint when none is free and fewer than
  // RdmaOptions::send_slots are held; last, for a request on a client
  // endpoint, room for its response, taken (the caller queues the frame).
  bool CanPostLocked(const Header& h);
  // OK when a `frame`-byte frame with header `h` may join a backlog that
  // is not empty (RdmaOptions::max_backlog_bytes), else RESOURCE_EXHAUSTED
  // naming the bound.
  absl::Status RoomInBacklogLocked(const Header& h, size_t frame) const;
  // What a frame in the backlog holds there.
  static size_t BacklogBytes(const OutboundMessage& m);
  // Puts `m` at the end of the backlog, counting what it holds there here
  // and in the endpoint's total.
  void AddToBacklogLocked(OutboundMessage&& m);
  // Takes `bytes` that left the backlog off both counts.
  void BacklogShrankLocked(size_t bytes);
  // True when only LOCAL_INVs (which rxe runs at the head of the queue
  // alone) are outstanding. Otherwise makes sure a completion will retire
  // what is: a signaled zero-byte WRITE behind unsignaled SENDs.
  bool QueueQuietForBindLocked();
  // A signaled zero-byte WRITE: it takes a SEND sequence number, so its
  // completion retires the SENDs before it; it needs no address or rkey
  // (IBA C9-88) and uses no receive slot or credit of the peer's.
  void QueueRetiringWriteLocked();
  // One more send slot from the endpoint, free; false when it has none.
  bool TakeSendSlotLocked();
  // An idle connection (silent long enough for a keepalive) gives its free
  // send slots back to the shared stock, unless a frame waits in the
  // backlog; its next frame that does not go inline takes one again.
  void GiveBackIdleSendSlotLocked();
  // Gives the endpoint back every send slot: the free ones and those of
  // `posted`'s SENDs, which it empties. Only once the QP is gone (the device
  // reads a slot until its SEND completes); mu_ held or no other thread left.
  void ReturnSendSlots(RingFifo<Posted>& posted);
  // Gives the endpoint back the free send slots, when they are all this
  // connection holds (none in a posted SEND); mu_ held as above.
  void ReturnFreeSendSlots();
  // Builds the frame's work requests (bind, SEND) into the outbox.
  // With `write`, the payload is the header's payload_len bytes that it
  // writes into the frame (SendWith; the frame goes inline).
  absl::Status QueueFrameLocked(OutboundMessage& p,
                                const absl::FunctionRef<void(char*)>* write = nullptr);
  // The frame's lengths, no flags, no remote descriptor (SendLocked and
  // SendWith; advertising a payload sets those afterwards).
  // Defined here so that they inline: out of line they cost every SEND ~20
  // instructions (bench/fast_path_ir.sh).
  static void SetFrameLengths(Header& h, size_t metadata_size, size_t payload_size) {
    h.flags = 0;
    h.remote = RemoteDescriptor{};
    h.metadata_len = static_cast<uint32_t>(metadata_size);
    h.payload_len = static_cast<uint32_t>(payload_size);
  }
  // Posts what this thread took from the outbox, if it took it; the
  // queueing error wins over the post's.
  absl::Status PostIfTaken(bool took, absl::Status queued) {
    if (!took) return queued;
    absl::Status posted = PostTaken();
    return queued.ok() ? posted : queued;
  }
  Outgoing& QueueLocked();
  // Posts the outbox if this thread gets the post token; never under mu_.
  // The error is that of a failed post (the connection then tears down).
  absl::Status FlushOutbox();
  // Takes the post token and the outbox's requests into posting_, if there
  // are any and no other thread holds the token; the caller then owes a
  // PostTaken. Under mu_, so a sender queues and takes in one critical
  // section.
  bool TakeOutboxLocked();
  // Posts posting_, lets the token go and posts again while others queued
  // meanwhile; never under mu_.
  absl::Status PostTaken();
  // First the kShrink frames due, then what waits for credit.
  void FlushBacklogLocked();
  // Credit: the peer's window now, topping it up to that as far as the
  // endpoint's room allows (else waiting for room), whether a kCredit frame
  // is worth its receive slot at the peer, and sending kShrink frames.
  uint32_t PeerWindow() const;
  void TopUpLocked();
  bool CreditWorthSending() const;
  // Credit checks (see "A peer that sends without credit" above) of frame
  // `h`, a kShrink asking `shrink_asked` credits back if not 0, before it
  // changes anything but peer_holds_: the rule it broke, if any, by how
  // much, and the limit it went past. A plain struct, not a status: it is
  // made for every frame received. FailForBreach ends the connection
  // saying why. Two of the rules say by how much they were broken (> 0):
  // the frames the peer spent past what it can have had (OverdrawnLocked),
  // and its kShrink asks before this one that no answer of ours queued
  // before this frame's poll round covered (AskedTooSoonLocked).
  struct CreditBreach {
    enum Rule : uint8_t { kNone, kFrameWithoutCredit, kShrinkOutOfTurn, kCreditPastWindow };
    Rule rule = kNone;
    int64_t by = 0;
    int64_t limit = 0;  // the window it went past
  };
  CreditBreach CheckCreditRulesLocked(const Header& h, uint32_t shrink_asked) const;
  void FailForBreach(const CreditBreach& breach);
  int64_t OverdrawnLocked() const;
  int64_t AskedTooSoonLocked() const;
  void SendShrinkLocked();
  void ReleaseAdvertisedLocked(uint64_t token);
  void ExpireUnreleased(absl::Time now);
  // Shared windows: our kShrink has waited shrink_answer_timeout_ms for its
  // answer. A peer that cannot answer (its process stopped, its I/O thread
  // stuck) would otherwise keep the budget overdrawn, and every other
  // connection's peer down to the one frame TopUpLocked always grants. So
  // what it holds past its window stops counting against the budget
  // (written_off_), at the risk that a burst from it when it wakes finds
  // the SRQ empty and waits on RNR retry; the credits it gives back repay
  // the write-off first, and its answer puts what is left of it back.
  bool ShrinkAnswerOverdue(absl::Time now) const;
  void WriteOffUnansweredShrink();
  // The keepalive is still unanswered at twice the device's retry time
  // (the backstop for a device that neither acknowledges nor fails it).
  bool KeepaliveOverdueLocked(absl::Time now) const;
  // The oldest READ in flight has run past ReadAllowanceLocked: the device
  // neither completed nor failed it in twice its retry time plus its bytes
  // at kSlowestReadBytesPerSecond. I/O context.
  bool ReadOverdueLocked(absl::Time now) const;
  absl::Duration ReadAllowanceLocked(uint32_t bytes) const;
  // True when it failed the connection: FailLostRead for a READ past
  // ReadOverdueLocked, FailStalledReads for one past its ReadOp::give_up.
  bool FailLostRead(absl::Time now);
  bool FailStalledReads(absl::Time now);
  bool FailUnansweredKeepalive(absl::Time now);
  void ProbeUnestablished(absl::Time now);
  // True when the peer has been silent for keepalive_ms and neither a
  // keepalive nor a READ (which would be answered or fail the same way) is
  // in flight. Notes whether the peer was heard from since the last look.
  bool KeepaliveDue(absl::Time now);
  void SendKeepalive(absl::Time now);
  void FlushInvalidationsLocked();
  void FreeWindowsLocked();
  void SendControl(MessageKind kind, uint64_t token);
  void StartReads();
  // Says why on stderr and tears down, the status naming where our end is
  // (LocationNote), so that whoever reads it knows which device to check.
  void Fail(absl::Status why);
  // "; our end: device rxe0 port 1 gid_index 1 (::ffff:10.0.0.1, RoCE v2)",
  // after DeviceEvents::PortNote for this connection's port (empty while the
  // port is and has stayed active). Queries the device: failures only.
  std::string LocationNote() const;
  void DeliverRead(uint32_t op_id);

  Endpoint* const endpoint_;
  rdma_cm_id* id_;
  // The QP, also id_->qp unless TakeQpFromId took it off the id.
  ibv_qp* qp_ = nullptr;
  const std::string peer_;
  const uint32_t serial_;
  const TransportOptions options_;
  size_t frame_limit_;            // min(our slot, the peer's slot)
  const uint32_t credit_window_;  // what we granted the peer
  const uint32_t rd_atom_;
  size_t read_threshold_ = 0;
  size_t read_chunk_ = 0;  // the port's max_msg_sz: one READ never exceeds it
  uint32_t qp_num_ = 0;
  uint32_t max_inline_ = 0;
  ConnectionObserver* observer_ = nullptr;

  InlineMutex mu_;        // send side
  bool closed_ = false;   // guarded by mu_
  // Credits the peer granted us, less the frames sent on them; below zero
  // when the peer took back more than we had left (kShrink).
  int64_t credits_ = 0;  // guarded by mu_
  // Requests sent whose response has not come, each holding response room
  // on the endpoint (client endpoints only); given back at teardown.
  uint32_t responses_awaited_ = 0;  // guarded by mu_
  // What the peer granted at the handshake (credits_ starts there), for
  // DescribeTerms: credits_ may have moved by the time it is traced.
  uint32_t peer_credit_window_ = 0;  // guarded by mu_
  // Frames waiting for credit, a send slot or SQ room, as SendLocked left
  // them: a payload still in one travels in the SEND itself (one that goes
  // by READ was advertised and moved out).
  std::deque<OutboundMessage> backlog_;  // guarded by mu_
  // The bytes backlog_ holds (BacklogBytes of each), which
  // RdmaOptions::max_backlog_bytes bounds. Guarded by mu_.
  size_t backlog_bytes_ = 0;
  // Send slots (Endpoint::TakeSendBlock): how many this connection holds,
  // and those not in a posted SEND; the others are in posted_.
  uint32_t send_slots_held_ = 0;           // guarded by mu_
  std::vector<uint32_t> free_send_slots_;  // guarded by mu_
  RingFifo<Posted> posted_;            // guarded by mu_
  uint32_t next_seq_ = 0;              // guarded by mu_
  uint32_t unsignaled_ = 0;            // guarded by mu_
  uint32_t sq_used_ = 0;               // guarded by mu_
  uint32_t signaled_outstanding_ = 0;  // guarded by mu_
  // The last signaled SEND or WRITE: the posted_ entries up to it retire
  // with its completion. Not 0, the first frame's sequence number.
  uint32_t last_signaled_seq_ = ~uint32_t{0};  // guarded by mu_
  // A frame that binds a window waits for a quiet queue
  // (Endpoint::binds_wait_for_quiet_queue): no new READ starts meanwhile.
  bool hold_reads_ = false;  // guarded by mu_
  uint32_t sq_depth_ = 0;
  // The endpoint's CQ this QP is on; its room there is sq_depth_.
  ibv_cq* cq_ = nullptr;
  uint64_t next_token_ = 1;                               // guarded by mu_
  const absl::Duration release_timeout_;                  // ours; zero: none
  absl::Time next_release_due_ = absl::InfiniteFuture();  // earliest release_by; mu_
  uint32_t peer_release_timeout_ms_ = 0;                  // from the peer's handshake; mu_
  // How long the device tries a work request the peer does not acknowledge
  // (LearnRetryPolicy; until then what peer_timeout_ms asks for); mu_.
  absl::Duration unacked_limit_;
  int ack_timeout_exp_ = -1;                               // the QP's, once learnt; mu_
  int retries_ = -1;                                       // the QP's retry count, once learnt; mu_
  uint8_t rnr_timer_ = 0;  // the RNR NAK timer code our QP advertises, once learnt; mu_
  std::unordered_map<uint64_t, Advertised> advertised_;    // token -> payload, mu_
  std::vector<Window> free_mws_;                           // mu_
  std::deque<Advertised> to_invalidate_;                   // released, window still bound; mu_
  std::unordered_map<uint32_t, Advertised> invalidating_;  // LOCAL_INV posted; mu_
  uint32_t next_invalidation_ = 1;                         // mu_
  std::unordered_multimap<uint64_t, uint64_t> request_tokens_;  // call id -> token, mu_
  std::vector<Outgoing> outbox_;                                // built, not yet posted; mu_
  std::atomic<bool> post_token_{false};
  // outbox_ is not empty; written under mu_, read by a poster that has let
  // the token go (PostTaken), without the lock.
  std::atomic<bool> outbox_waiting_{false};
  std::vector<Outgoing> posting_;  // the post token holder's
  // Credits for the peer that the next frame carries (TopUpLocked); written
  // under mu_, read without it to decide on a kCredit frame.
  std::atomic<uint32_t> to_return_{0};
  // The credits put in frames, by poll round (OverdrawnLocked).
  SentByRound credits_sent_;  // guarded by mu_
  // kShrink frames to send ahead of the backlog, as counts: our request
  // (shared windows) and our answer to the peer's.
  uint32_t ask_to_send_ = 0;     // guarded by mu_
  uint32_t answer_to_send_ = 0;  // guarded by mu_
  // The peer's kShrink asks received, and those our queued answers
  // covered, by poll round (AskedTooSoonLocked).
  int64_t asks_received_ = 0;  // guarded by mu_
  SentByRound asks_answered_;  // guarded by mu_
  // The handshake's max_credits: no more credits than this may we hold
  // (CheckCreditRulesLocked). 0 until a client has the server's handshake.
  uint32_t peer_max_credits_ = 0;  // guarded by mu_

  // I/O context (endpoint.h).
  // Credits the peer holds or has in flight to us: what we granted and
  // returned, less the frames on credit we received and what a kShrink
  // took back once answered; and the credits our kShrink asked back, not
  // yet answered. Whether the connection waits for the endpoint's room.
  int64_t peer_holds_ = credit_window_;
  uint32_t shrink_asked_ = 0;
  bool waiting_for_credits_ = false;
  // The unanswered kShrink's clock, whether it ran out, and what of
  // peer_holds_ it took off the budget (WriteOffUnansweredShrink).
  absl::Time shrink_asked_at_;
  bool shrink_overdue_ = false;
  bool told_shrink_overdue_ = false;
  int64_t written_off_ = 0;
  const absl::Duration shrink_answer_timeout_;
  std::map<uint32_t, ReadOp> reads_;  // op id -> op
  std::deque<uint32_t> read_queue_;   // ops waiting for a READ slot
  uint32_t next_read_op_ = 1;
  std::pair<uint64_t, uint32_t> last_remote_{0, 0};  // for FaultInjection::StaleReads
  // Lengths of the READs posted and not completed, oldest first (an RC QP
  // completes them in order), and since when the oldest has been oldest:
  // the clock of the stalled-READ backstop (ReadOverdueLocked).
  RingFifo<uint32_t> reads_in_flight_;
  absl::Time oldest_read_since_;
  absl::Time next_give_up_ = absl::InfiniteFuture();  // earliest ReadOp::give_up
  // Keepalive: completions and frames from the peer so far, the count the
  // last look saw, and since when it has not moved.
  const absl::Duration keepalive_;
  std::atomic<bool> established_{false};
  // set_establish_by's deadline; InfiniteFuture once established_ is seen
  // or the probe sent at the deadline is acknowledged. accept_probed_:
  // that probe is out, and a failure now is its (Fail says so).
  absl::Time establish_by_ = absl::InfiniteFuture();
  bool accept_probed_ = false;
  uint64_t heard_ = 0;
  uint64_t heard_at_check_ = 0;
  absl::Time silent_since_;
  bool keepalive_outstanding_ = false;
  absl::Time keepalive_sent_;
  bool torn_down_ = false;
  absl::Time teardown_started_;
  std::shared_ptr<RdmaConnection> keep_alive_;  // held from Teardown until freed
  std::function<void(RdmaConnection*, rdma_cm_id*)> on_freed_;
  bool freed_ = false;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_CONNECTION_H_
