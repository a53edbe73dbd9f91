// Endpoint: what one RdmaTransport shares across all its connections on one
// device: the protection domain, its completion queues, one Shared Receive
// Queue with its receive slots, the registered payload pool, and the poller
// thread that drives them.
//
// Why one SRQ: receive memory must not grow with the number of connections.
// The SRQ keeps about `target` slots posted; a slot consumed by a SEND is
// handed to the runtime as the message's payload (no copy), and spare slots
// are posted in its place in batches (kSrqRefillBatch; at once while the SRQ
// is short of spares). When the runtime releases the message, the slot
// becomes a spare again. Slots are fixed-size pieces of a few registered
// regions that grow (by kSlotsPerRegion) up to target + max_held_slots.
//
// Small payloads on the way out live in registered blocks of slot size
// (SmallBuffer), so a SEND gathers them where they were serialized; large
// ones come from the registered pool and are READ by the peer. Blocks of the
// same kind, in a stock of their own, are connections' send slots
// (TakeSendBlock), for frames too large to go inline: a connection takes one
// only when none of its own is free and gives back all but one as their
// SENDs complete, and the last one when it falls idle, so send memory, like
// receive memory, grows with the frames in flight, not with the number of
// connections.
//
// I/O context: one thread at a time polls the CQ, runs posted tasks, refills
// the SRQ, and calls connections (and through them the runtime's observers).
// That is the poller thread, whose sleep policy is RdmaOptions::poll_mode —
// or, run-to-completion, a caller blocked on a response (Drive): it polls the
// CQ itself, so the response needs no hand-off between threads (on Soft-RoCE
// with two cores that hand-off was most of a small call's round trip). One
// caller drives at a time: callers blocked meanwhile sleep until whoever
// polls hands them their responses, since only one thread can poll the CQ
// and the others would spin a core each for nothing. While a caller drives,
// and for kDriveGrace after, the poller thread sleeps so it does not compete
// for the core; completions that arrive in that gap, with no caller driving,
// wait up to kDriveGrace (plus a wake-up) for the poller. A driver that
// leaves while responses are still awaited (other callers', asynchronous
// calls') gives no grace: the poller thread takes over at once.
// Whoever owns the I/O context is "the poller" below; code that runs there
// must not assume which thread it is.
//
// Lifetime: every Buffer handed to the runtime (receive slot, small payload,
// pool block) is a loan on its Endpoint, so is every RdmaConnection on it,
// and the shared_ptr owners together hold one more; the last loan to end
// deletes the Endpoint, so its registered memory outlives every message and
// connection the runtime still holds. A loan is one atomic
// count, not a shared_ptr in the Buffer's releaser: a releaser captures
// plain pointers and indices only (transport/buffer.h), so that moving a
// Buffer, several times per message, is a copy of a few words. Stop() ends
// the poller; the last loan frees the verbs resources, on whichever thread
// releases it.
//
// Completion-queue capacity: a CQ takes the completions of its QPs' send
// queues and of the SRQ receives that arrive through them. A CQ that
// overflows goes into error on hardware, and every connection of the
// endpoint with it (rxe reports the CQ in error and drops the completion),
// so room is reserved before it can be needed: the receives the SRQ keeps
// posted (any of them may complete on any CQ), and per QP its send queue's
// depth (a work request completes at most once; a flushed one always does,
// signaled or not).
// A new QP goes to the first CQ with room. When none has any, one grows
// (ibv_resize_cq) up to RdmaOptions::max_cq_entries or the device's max_cqe;
// when none can grow, a new CQ is opened, up to max_completion_queues; past
// that the QP is refused with RESOURCE_EXHAUSTED, and the connection with
// it, while the others go on. A device that cannot resize (siw answers
// EOPNOTSUPP; a driver may answer success and leave the CQ as it was, as
// qedr's once did) gets a new CQ instead, each twice the size of the last;
// a resize that fails otherwise (ENOMEM) is tried again next time. Most
// endpoints never open a second CQ: on a NIC the first holds millions of
// entries. A destroyed QP's room comes back only once a poll has found its
// CQ empty: its last completions may still be queued behind others.
//
// Work-request ids: RECV wr_id is the slot index; every other wr_id is
// (connection serial << 32 | per-connection index), looked up in a map, so a
// completion that arrives for a connection already gone is simply dropped.
#ifndef RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_
#define RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "base/free_index_stack.h"
#include "transport/buffer.h"
#include "transport/rdma/device_hold.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/registered_pool.h"

namespace rdmarpc::transport::rdma {

class RdmaConnection;

class Endpoint {
  static constexpr uint32_t kBlocksPerRegion = 64;
  static constexpr uint32_t kMaxSmallRegions = 8;
  static constexpr uint32_t kMaxSendRegions = 64;

 public:
  // Receive slots are registered this many at a time.
  static constexpr uint32_t kSlotsPerRegion = 64;
  // After a registration fails, that memory is not grown again for this
  // long: ibv_reg_mr is slow, and what would retry it (every refill of a
  // short SRQ, every frame that finds no free block) must not pay for it
  // each time, nor give up for good when the failure passes (the
  // locked-memory limit reached for a while).
  static constexpr std::chrono::milliseconds kRegistrationRetry{100};
  // Small payload blocks registered at most (SmallBuffer).
  static constexpr uint32_t kMaxSmallBlocks = kBlocksPerRegion * kMaxSmallRegions;
  // Send slots registered at most, for all connections together.
  static constexpr uint32_t kMaxSendBlocks = kBlocksPerRegion * kMaxSendRegions;

  // Whose connections the endpoint holds: a server's (the peers send calls)
  // or a client's (the peers send responses to our calls). It decides which
  // RdmaOptions field sizes the SRQ and what the endpoint tells its user to try.
  enum class Side { kServer, kClient };
  // `quota` (null: none) bounds the payload pool together with other
  // transports' (transport/memory_quota.h).
  static absl::StatusOr<std::shared_ptr<Endpoint>> Create(ibv_context* verbs,
                                                          const RdmaOptions& options, Side side,
                                                          const std::string& owner,
                                                          std::shared_ptr<MemoryQuota> quota);
  // Stops the poller thread (joins it); connections must be gone. Idempotent;
  // never from the poller thread itself.
  void Stop();
  // A loan keeps the Endpoint, though not its poller, alive (Lifetime
  // above): a connection the runtime still holds may outlive the transport's
  // use of the endpoint (RdmaTransport::LetGoOfRemovedDevices).
  void Lend() { loans_.fetch_add(1, std::memory_order_relaxed); }
  void EndLoan();
  // Whether the device is being removed (DeviceHold::Removed).
  bool device_removed() const { return hold_->Removed(); }

  ibv_context* verbs() const { return verbs_; }
  ibv_pd* pd() const { return pd_; }
  // The first completion queue; connections may be on others (HasCq).
  ibv_cq* cq() const { return cqs_[0].cq; }
  bool HasCq(const ibv_cq* cq) const;
  ibv_srq* srq() const { return srq_; }
  RegisteredPool& pool() { return *pool_; }
  const RdmaOptions& options() const { return options_; }
  const std::string& device_name() const { return device_name_; }
  const ibv_device_attr& device_attr() const { return device_attr_; }
  size_t slot_size() const { return options_.slot_size; }
  // Bytes registered for receive slots: flat in the number of connections.
  size_t receive_bytes() const;

  // Room for `entries` more completions (a QP's send queue depth) on a CQ,
  // which the QP is then created on: the first with room, grown or newly
  // opened if it must be; RESOURCE_EXHAUSTED naming the device, the bounds
  // and what to try when none can be, and FailAll's status once that ran.
  // Any thread.
  absl::StatusOr<ibv_cq*> ReserveCompletions(uint32_t entries);
  // Gives room on `cq` back at once: its QP is gone and never had work
  // posted. Any thread.
  void ReturnCompletions(ibv_cq* cq, uint32_t entries);
  // Gives room on `cq` back after the next poll that empties it: its QP is
  // gone, and completions of it may still be queued. I/O context only.
  void ReturnCompletionsAfterPoll(ibv_cq* cq, uint32_t entries);
  struct CompletionQueueUse {
    size_t queues = 0;    // CQs open
    size_t entries = 0;   // their sizes, as the device made them, summed
    size_t reserved = 0;  // room promised to the SRQ (on each) and the QPs
  };
  CompletionQueueUse completion_queue_use() const;

  // Device events (device_events.h), from the thread that reads them. The
  // connection of queue pair `qp_num`, if any, ends UNAVAILABLE for `why`.
  void FailQueuePair(uint32_t qp_num, std::string why);
  // Every connection ends with `why`, and no new one is made: the CQ, the
  // SRQ or the device has failed.
  void FailAll(absl::Status why);

  void RunOnPoller(std::function<void()> task);
  void RunOnPollerAndWait(std::function<void()> task);
  // Whether tasks wait for the I/O context. Tests hold the I/O thread and
  // watch this to know that another thread (rdma_cm's) has handed it work.
  bool HasQueuedTasks() const { return has_tasks_.load(std::memory_order_acquire); }
  // Handles every completion waiting on the CQs, however many batches that
  // takes: a round of polling handles one batch per CQ before its tasks, so
  // a task that ends a connection calls this first, or what the peer sent
  // last and the device already placed would be dropped. I/O context only.
  void DrainCompletions();
  // Counts the batches of completions taken off the CQs: bumped after each
  // ibv_poll_cq that finds any, before they are handled (release). A
  // connection stamps the credits it sends with it (acquire), so that its
  // credit check counts only those sent before a frame's batch was polled,
  // which the peer may have had. Any thread.
  uint64_t poll_round() const { return poll_round_.load(std::memory_order_acquire); }
  // True on the thread that owns the I/O context right now.
  bool OwnsIo() const {
    return io_thread_.load(std::memory_order_relaxed) == std::this_thread::get_id();
  }
  // Run-to-completion: the calling thread takes turns owning the I/O context
  // until done() (true) or, in adaptive mode, spin_us without a completion,
  // or the endpoint stops (false). False at once in event mode or when called
  // from the I/O context. done() must become true through I/O or another
  // thread, never by itself blocking.
  bool Drive(absl::FunctionRef<bool()> done);

  // Poller thread only. A listening endpoint's first connection past as
  // many as its budget holds frames is told on stderr (see "Shared
  // windows").
  void AddConnection(std::shared_ptr<RdmaConnection> conn);
  void RemoveConnection(RdmaConnection* conn);
  // RdmaOptions::strict_credits: the window a new connection may be granted,
  // at most `wanted`, 0 when the slots not spoken for hold not one frame
  // (StrictCreditWindow); and why such a connection is refused. On the
  // transport's rdma_cm thread, the only one that adds connections, so that
  // what is spoken for can only shrink (connections leaving) between this
  // and the new connection's AddConnection.
  uint32_t StrictWindow(uint32_t wanted) const;
  std::string DescribeStrictRefusal() const;
  // Shared windows (a listening endpoint without strict_credits). Credits
  // are per connection and the SRQ is not, so the credits our peers hold or
  // have in flight, over all connections, are kept within the SRQ's budget
  // (ShareReceiveBudget): a connection tops its peer up to its window
  // (CreditWindow) only as far as the budget has room (FreeCredits, taken
  // with TakeCredits), and otherwise waits with WaitForCredits for credits
  // to come back (GiveBackCredits). Windows shrink as connections join;
  // peers over their windows are asked for credits back (kShrink, Reshare),
  // as many as the budget is overdrawn by, or a waiter lacks. The windows
  // that grow as connections leave are topped up as their peers send. Not
  // sharing, the window is the one granted and the room has no bound.
  // I/O context, but JoiningWindow: the rdma_cm thread's, for the handshake
  // of the connection about to join.
  bool shares_credits() const { return shares_credits_; }
  // RdmaOptions::credits, at most half the slots.
  uint32_t ConfiguredWindow() const;
  uint32_t CreditWindow() const { return credit_share_.window; }
  uint32_t JoiningWindow() const;
  size_t FreeCredits() const {
    if (!shares_credits_) return SIZE_MAX;
    const auto budget = static_cast<int64_t>(credit_share_.budget);
    return credits_out_ < budget ? static_cast<size_t>(budget - credits_out_) : 0;
  }
  void TakeCredits(size_t n) { credits_out_ += static_cast<int64_t>(n); }
  void GiveBackCredits(int64_t n) { credits_out_ -= n; }
  void WaitForCredits(std::weak_ptr<RdmaConnection> conn, int64_t short_by);
  // Reshare, as a task of its own (at most one queued): for callers amid
  // a connection's work.
  void QueueReshare();
  // Tops up the connections that wait, first come first, while there is
  // room. Inline, for the receive path, which calls it on every frame.
  void WakeCreditWaiters() {
    if (!credit_waiters_.empty()) ServeCreditWaiters();
  }
  // rdma_cm said a connection is established: its peer can receive now, so
  // what it holds past its window may be asked back.
  void OnEstablished();
  // Response room (client endpoints): every response our requests await
  // takes a posted receive slot, wherever it comes from, so the requests in
  // flight over all connections are bounded by the slots the SRQ keeps
  // posted, less its refill lag and kControlFramesPerConnection per
  // connection (ShareReceiveBudget's budget): then no response finds the
  // SRQ empty, however many channels share it. Credits
  // cannot promise that (they are per connection), and RNR retry is no
  // safety net (rdma_connection.h, "Flow control"). A request without room
  // waits in its connection's backlog; the connection registers with
  // WaitForResponseRoom and is flushed when room comes back. Any thread.
  bool bounds_responses() const { return side_ == Side::kClient; }
  // Whether a frame that binds a memory window waits until nothing that
  // goes on the wire is outstanding ahead of it on its queue pair. Soft-RoCE
  // (Linux 6.1) runs a bind again when it retries its send queue from a
  // work request ahead of it (after an RNR NAK or an ACK timeout); the
  // second run finds the window bound under its new rkey, fails, and takes
  // the queue pair down (MW_BIND_ERR, or a flush with no error completion).
  // A bind with only local work ahead of it is retired before any retry.
  // Hardware runs a bind once, so there frames do not wait. Set at Init.
  bool binds_wait_for_quiet_queue() const { return binds_wait_for_quiet_queue_; }
  bool TakeResponseRoom();
  void ReturnResponseRoom(uint32_t n);
  void WaitForResponseRoom(std::weak_ptr<RdmaConnection> conn);
  // The first time a request waits for room, says so on stderr, with the
  // bound and what to raise.
  void SayRoomRanOut();
  // The bound TakeResponseRoom keeps to, now; and the room taken.
  size_t ResponseRoomLimit() const;
  size_t responses_awaited() const { return responses_awaited_.load(); }
  // Bytes waiting in the backlogs of all its connections, which
  // RdmaOptions::max_backlog_bytes_total bounds: a connection adds what it
  // holds there and takes it back as frames leave. Off the fast path: only
  // a frame without credit, a send slot or queue room waits. Any thread.
  size_t backlog_bytes() const { return backlog_bytes_.load(std::memory_order_relaxed); }
  void AddBacklogBytes(size_t n) { backlog_bytes_.fetch_add(n, std::memory_order_relaxed); }
  void RemoveBacklogBytes(size_t n) { backlog_bytes_.fetch_sub(n, std::memory_order_relaxed); }
  // A torn-down connection waiting for its queue pair to drain; the poller
  // retries it every loop until RdmaConnection::FinishTeardown says done.
  void AddDraining(RdmaConnection* conn) { draining_.push_back(conn); }
  void ReleaseSlot(uint32_t slot);

  // A receive slot's bytes as a Buffer: releasing it makes the slot a spare.
  // 0 < offset <= slot_size (a payload follows a header).
  Buffer SlotBuffer(uint32_t slot, size_t offset, size_t length);
  // `size` bytes of a pool block as a Buffer: releasing it returns the block.
  Buffer BlockBuffer(RegisteredPool::Block* block, size_t size);
  // A payload that travels inside a SEND (size <= slot_size): a slot-sized
  // block of registered memory, reused when released, so that a small
  // message costs no allocation and is sent from where it was serialized (a
  // second gather entry of the SEND) instead of being copied into the frame.
  // With kMaxSmallBlocks in use it falls back to heap memory, which the
  // send path copies. Any thread.
  Buffer SmallBuffer(size_t size);
  // The lkey of the registered small block that holds `p`; false when `p` is
  // in none. Any thread.
  bool SmallBlockLkey(const char* p, uint32_t* lkey) const;
  // A slot-sized block for a connection's send slot, held until it gives it
  // back (ReturnSendBlock, never while a posted SEND may read it), or
  // nullopt with all kMaxSendBlocks held or registering more failed. A
  // loan, as a Buffer is. Apart from the payload blocks, so that payloads
  // the runtime holds never keep a connection from sending. Any thread.
  std::optional<uint32_t> TakeSendBlock();
  void ReturnSendBlock(uint32_t index);
  char* SendBlock(uint32_t index) const { return BlockOf(send_, index); }
  uint32_t SendBlockLkey(uint32_t index) const {
    return send_.regions[index / kBlocksPerRegion].mr->lkey;
  }

 private:
  Endpoint(ibv_context* verbs, const RdmaOptions& options, Side side, std::string owner,
           std::shared_ptr<MemoryQuota> quota);
  ~Endpoint();  // through EndLoan only
  absl::Status Init();
  absl::Status GrowSlots();  // poller thread or Init
  // Registered memory that slots or small payload blocks are carved from.
  struct Region {
    char* base;
    ibv_mr* mr;
  };
  // `bytes` of page-aligned memory registered on pd_ with `access`.
  absl::StatusOr<Region> NewRegion(size_t bytes, int access, const char* what) const;
  static void FreeRegion(const Region& r);
  // The region among `regions[0, count)`, each `region_bytes` long, that
  // holds `p`; null if none does.
  static const Region* RegionHolding(const Region* regions, size_t count, size_t region_bytes,
                                     const char* p);
  void PollLoop();
  bool TryOwnIo();
  void ReleaseIo();
  // One round of I/O work; true when there was any. I/O context only.
  bool PollOnce(int* completions = nullptr);
  // Handles one batch of completions from each CQ, or with `until_empty`
  // as many as they hold; returns how many. I/O context only.
  int PollCompletions(bool until_empty);
  bool DrivenRecently() const;
  // Timers (RdmaConnection::ExpireTimeouts: release timeouts, stalled
  // READs, keepalives), looked at every
  // kSweepEveryPolls rounds and before the poller sleeps, at most every
  // sweep_interval_: the fast path reads no clock for them.
  void SweepIfDue();
  void SleepUntilWoken(int timeout_ms);
  void HandleCompletion(const ibv_wc& wc);
  // by_qp_[qp_num] through the one-entry cache; null when none.
  RdmaConnection* ReceiverOf(uint32_t qp_num);
  void RefillSrq();
  void Wake();

  ibv_context* const verbs_;
  // Keeps verbs_ open until the destructor has destroyed what is made on it.
  std::unique_ptr<DeviceHold> hold_;
  const RdmaOptions options_;
  const Side side_;
  const size_t target_;        // slots kept posted
  const size_t refill_below_;  // RefillSrq once posted_ is below it
  const char* const receive_slots_option_;  // the RdmaOptions field target_ comes from
  const std::string owner_;
  const std::shared_ptr<MemoryQuota> memory_quota_;  // for pool_, made in Init
  std::string device_name_;
  ibv_device_attr device_attr_{};
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  struct CompletionQueue {
    ibv_cq* cq = nullptr;
    size_t entries = 0;    // cq_mu_
    size_t reserved = 0;   // cq_mu_
    size_t returning = 0;  // poller only: given back at the next poll that empties it
  };
  // Opens cqs_[cq_count_] with `entries` and publishes it. Holds cq_mu_.
  absl::Status OpenCompletionQueue(size_t entries);
  CompletionQueue& QueueOf(const ibv_cq* cq);
  // Written under cq_mu_, a slot before cq_count_ (release) counts it, so
  // the poller reads cqs_[0, cq_count_) without the lock.
  std::array<CompletionQueue, kMaxCompletionQueues> cqs_;
  std::atomic<size_t> cq_count_{0};
  mutable std::mutex cq_mu_;
  size_t cq_bound_ = 0;    // max_cq_entries, or the device's max_cqe
  size_t cq_initial_ = 0;  // what each CQ begins with
  size_t srq_room_ = 0;    // reserved on each CQ for the SRQ's receives
  bool cq_resizable_ = true;  // cq_mu_; false once the device said it cannot
  absl::Status failed_;    // cq_mu_; FailAll's reason
  ibv_srq* srq_ = nullptr;
  std::unique_ptr<RegisteredPool> pool_;
  int wake_fd_ = -1;

  // Receive slots.
  std::vector<Region> regions_;  // poller only
  std::atomic<uint32_t> slot_count_{0};
  size_t posted_ = 0;  // poller thread
  uint64_t refills_failed_ = 0;  // poller thread; in a row
  // Slots neither posted nor held: any thread gives them back (a released
  // Buffer), the poller takes them to post; at most target_ + max_held_slots.
  FreeIndexStack spare_;
  std::atomic<bool> short_{false};

  // Growth of receive slots or blocks whose registration failed, put off
  // for kRegistrationRetry.
  struct GrowthBackoff {
    absl::Status failed;  // the last growth's error; OK when it worked
    std::chrono::steady_clock::time_point retry_at;
    // The error to return instead of trying now, or OK to try.
    absl::Status Wait() const {
      if (failed.ok() || std::chrono::steady_clock::now() >= retry_at) return absl::OkStatus();
      return failed;
    }
  };
  GrowthBackoff slot_growth_;  // poller only

  // Slot-sized blocks: regions of kBlocksPerRegion blocks, each region one
  // MR with local access only (a SEND reads it; no peer can). Block i is
  // piece i % kBlocksPerRegion of region i / kBlocksPerRegion. Blocks are
  // taken and given back often, from different threads, so the free ones
  // sit on a lock-free stack; only growth takes grow_mu. A region is written
  // before its blocks are pushed and before region_count publishes it, so
  // lkey lookups and whoever pops a block read it without the lock.
  struct BlockStock {
    BlockStock(const char* what, uint32_t max_regions)
        : what(what),
          max_regions(max_regions),
          regions(new Region[max_regions]{}),
          free(max_regions * kBlocksPerRegion) {}
    const char* const what;
    const uint32_t max_regions;
    const std::unique_ptr<Region[]> regions;
    std::atomic<size_t> region_count{0};
    FreeIndexStack free;
    std::mutex grow_mu;
    GrowthBackoff growth;  // guarded by grow_mu
  };
  // A free block of `stock`, growing it by a region if none is free.
  std::optional<uint32_t> TakeBlock(BlockStock& stock);
  std::optional<uint32_t> GrowBlocks(BlockStock& stock);
  char* BlockOf(const BlockStock& stock, uint32_t index) const;
  BlockStock small_{"small payloads", kMaxSmallRegions};
  BlockStock send_{"send slots", kMaxSendRegions};
  // Buffers lent out, plus one for the shared_ptr owners (see "Lifetime").
  std::atomic<int64_t> loans_{1};

  // How long the poller thread stays off the CQ after a Drive finished.
  static constexpr std::chrono::milliseconds kDriveGrace{1};

  std::thread poller_;
  std::atomic<bool> stop_{false};
  std::atomic<std::thread::id> io_thread_{};  // owner of the I/O context; none: free
  std::atomic<int> drivers_{0};
  std::atomic<int64_t> last_driven_ns_{0};  // steady_clock; 0: no grace
  std::mutex tasks_mu_;
  std::vector<std::function<void()>> tasks_;  // guarded by tasks_mu_
  std::atomic<bool> has_tasks_{false};
  std::unordered_map<uint32_t, std::shared_ptr<RdmaConnection>> by_qp_;  // poller thread
  std::unordered_map<uint32_t, RdmaConnection*> by_serial_;              // poller thread
  // The credit windows granted at the handshake to the connections in
  // by_qp_ (for strict credits), and whether the one past the budget has
  // been told.
  size_t granted_credits_ = 0;       // poller thread
  bool told_overcommitted_ = false;  // poller thread
  // Shared windows: the budget and each connection's window for the
  // connections in by_qp_ (PublishCommitted), the credits their peers hold
  // or have in flight, and the connections waiting for room with what each
  // lacked when it asked (in all, waiters_short_). I/O context.
  bool shares_credits_ = false;  // set once, at construction
  bool binds_wait_for_quiet_queue_ = false;  // set once, at Init
  ReceiveShare credit_share_;
  int64_t credits_out_ = 0;
  std::deque<std::pair<std::weak_ptr<RdmaConnection>, int64_t>> credit_waiters_;
  int64_t waiters_short_ = 0;
  bool reshare_queued_ = false;  // QueueReshare's task
  void ServeCreditWaiters();
  // Asks peers over their windows for what the budget lacks (its overdraft
  // and what the waiters lack), less what kShrinks already sent will bring
  // back; largest excess first. Peers not yet established are not asked
  // (RdmaConnection::CreditsOverWindow): OnEstablished asks again.
  void Reshare();
  // Strict credits: the slots the connections in by_qp_ hold (their windows
  // and kCreditFramesPerWindow each), published by the poller thread for
  // StrictWindow on the rdma_cm thread; and the slots that may be consumed,
  // with their credit back at the peer, before a refill posts them again
  // (PollOnce refills as soon as posted_ falls below refill_below_).
  struct Committed {
    uint32_t slots = 0;
    uint32_t connections = 0;
  };
  static_assert(std::atomic<Committed>::is_always_lock_free);
  std::atomic<Committed> committed_{Committed{}};
  void PublishCommitted();
  size_t StrictUnpostedSlots() const;
  // Response room: responses awaited over all connections, and the
  // connections whose backlogs wait for room.
  std::atomic<size_t> responses_awaited_{0};
  std::atomic<size_t> backlog_bytes_{0};
  std::mutex room_waiters_mu_;
  std::vector<std::weak_ptr<RdmaConnection>> room_waiters_;  // guarded by room_waiters_mu_
  std::atomic<bool> has_room_waiters_{false};
  std::atomic<bool> told_room_ran_out_{false};
  void WakeRoomWaiters();
  // by_qp_'s entry for the last receive: frames come in runs from one
  // connection, and a hash lookup per frame is ~40 instructions. Reset
  // whenever by_qp_ changes; poller thread.
  uint32_t last_receiver_qp_ = 0;
  RdmaConnection* last_receiver_ = nullptr;
  std::vector<RdmaConnection*> draining_;                                // poller thread
  static constexpr uint32_t kSweepEveryPolls = 256;
  // A quarter of release_timeout_ms, within [1 ms, 100 ms]; 100 ms without
  // one (the peer's still matters: ReadOp::give_up).
  const std::chrono::nanoseconds sweep_interval_;
  uint32_t polls_since_sweep_ = 0;                    // I/O context
  // Completions taken off a CQ at once, before any is handled: a batch is
  // what the credit check (RdmaConnection::OverdrawnLocked) sees together.
  // A peer that floods past its credit while the poller lags has its frames
  // waiting in the CQ; taken a few at a time, each few would be checked
  // against the credit returned while the ones before were handled, and a
  // flood that stays that far ahead would never show. 12 KB, here rather
  // than on the stack of whichever thread drives; one buffer will do, as
  // nothing polls while a completion is handled (Drive refuses on the
  // thread that owns the I/O context, DrainCompletions runs from tasks).
  static constexpr int kCompletionsPerPoll = 256;
  std::array<ibv_wc, kCompletionsPerPoll> polled_{};  // I/O context
  std::atomic<uint64_t> poll_round_{0};               // written in I/O context
  std::chrono::steady_clock::time_point last_sweep_;  // I/O context
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_
