#include "transport/rdma/endpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/new_thread.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "transport/attempt_errors.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_events.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/locked_memory.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/sanitizer_sync.h"
#include "transport/transport.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport::rdma {
namespace {

// A spinner that finds nothing yields the CPU only every kIdlePollsPerYield
// rounds: a yield per round is a system call per round (+6 us per round trip
// measured on Soft-RoCE), never yielding lets a spinner keep a core for a
// whole time slice when more threads want one than there are cores
// (milliseconds per call).
constexpr int kIdlePollsPerYield = 64;
// What Soft-RoCE (rdma_rxe) reports as its vendor (RXE_VENDOR_ID).
constexpr uint32_t kSoftRoceVendorId = 0xffffff;

void IdleSpin(int& idle_polls) {
  if (++idle_polls % kIdlePollsPerYield == 0) std::this_thread::yield();
}

absl::Status Errno(const std::string& what, const std::string& device) {
  return absl::UnavailableError(absl::StrCat(what, " on ", device, " failed: ", strerror(errno)));
}

// Fork safety. When a process forks (system(), popen()) while memory is
// registered, a kernel that does not copy DMA-pinned pages at fork (before
// Linux 5.13) shares them copy-on-write with the child: the parent's next
// write to one lands in a fresh copy the device never sees. ibv_fork_init
// keeps registered memory out of children instead (MADV_DONTFORK), and only
// works before the process's first registration, so the first endpoint asks
// for it. Kernels that copy such pages report IBV_FORK_UNNEEDED.
void PrepareForFork() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (ibv_is_fork_initialized() != IBV_FORK_DISABLED) return;
    if (const int rc = ibv_fork_init(); rc != 0) {
      fprintf(stderr,
              "rdmarpc: ibv_fork_init: %s. Memory was registered before rdmarpc's first RDMA "
              "endpoint, so a fork (system(), popen()) in this process may corrupt RDMA buffers "
              "on this kernel: set RDMAV_FORK_SAFE=1 or call ibv_fork_init() at startup.\n",
              strerror(rc));
    }
  });
}

// A quarter of the shortest timer the sweep serves, within 1-100 ms.
std::chrono::nanoseconds SweepInterval(const RdmaOptions& o) {
  uint32_t shortest_ms = 400;
  for (uint32_t ms : {o.release_timeout_ms, o.keepalive_ms, o.shrink_answer_timeout_ms}) {
    if (ms != 0) shortest_ms = std::min(shortest_ms, ms);
  }
  return std::max<std::chrono::nanoseconds>(std::chrono::milliseconds(shortest_ms) / 4,
                                            std::chrono::milliseconds(1));
}

}  // namespace

absl::StatusOr<std::shared_ptr<Endpoint>> Endpoint::Create(ibv_context* verbs,
                                                           const RdmaOptions& options, Side side,
                                                           const std::string& owner,
                                                           std::shared_ptr<MemoryQuota> quota) {
  PrepareForFork();
  std::shared_ptr<Endpoint> ep(new Endpoint(verbs, options, side, owner, std::move(quota)),
                               [](Endpoint* e) { e->EndLoan(); });
  if (absl::Status s = ep->Init(); !s.ok()) return s;
  return ep;
}

Endpoint::Endpoint(ibv_context* verbs, const RdmaOptions& options, Side side, std::string owner,
                   std::shared_ptr<MemoryQuota> quota)
    : verbs_(verbs),
      options_(options),
      side_(side),
      target_(side == Side::kServer ? options.server_receive_slots : options.client_receive_slots),
      refill_below_(target_ + 1 - std::clamp<size_t>(target_ / 8, 1, kSrqRefillBatch)),
      receive_slots_option_(side == Side::kServer ? "server_receive_slots"
                                                  : "client_receive_slots"),
      owner_(std::move(owner)),
      memory_quota_(std::move(quota)),
      spare_(static_cast<uint32_t>(target_ + options.max_held_slots)),
      sweep_interval_(SweepInterval(options)) {
  shares_credits_ = side == Side::kServer && !options.strict_credits;
  PublishCommitted();
}

absl::Status Endpoint::Init() {
  device_name_ = ibv_get_device_name(verbs_->device);
  auto hold = DeviceHold::Take(verbs_);
  if (!hold.ok()) return hold.status();
  hold_ = std::move(*hold);
  NoteDeviceInUse(device_name_);
  if (ibv_query_device(verbs_, &device_attr_) != 0) return Errno("ibv_query_device", device_name_);
  if (!(pd_ = ibv_alloc_pd(verbs_))) return Errno("ibv_alloc_pd", device_name_);
  if (!(channel_ = ibv_create_comp_channel(verbs_))) {
    return Errno("ibv_create_comp_channel", device_name_);
  }
  fcntl(channel_->fd, F_SETFL, fcntl(channel_->fd, F_GETFL) | O_NONBLOCK);
  const size_t device_max = static_cast<size_t>(std::max(device_attr_.max_cqe, 1));
  cq_bound_ = options_.max_cq_entries ? std::min(options_.max_cq_entries, device_max) : device_max;
  srq_room_ = std::min<size_t>(target_, device_attr_.max_srq_wr);
  if (srq_room_ > cq_bound_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the completion queue on ", device_name_, " may hold ", cq_bound_,
        " entries, fewer than the ", srq_room_,
        " receives kept posted: raise RdmaOptions::max_cq_entries or lower the receive slots"));
  }
  cq_initial_ = std::clamp(options_.cq_entries, srq_room_, cq_bound_);
  {
    std::lock_guard<std::mutex> lock(cq_mu_);
    if (absl::Status s = OpenCompletionQueue(cq_initial_); !s.ok()) return s;
  }
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = static_cast<uint32_t>(srq_room_);
  sa.attr.max_sge = 1;
  if (!(srq_ = ibv_create_srq(pd_, &sa))) return Errno("ibv_create_srq", device_name_);
  const bool device_windows = device_attr_.device_cap_flags &
                              (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B);
  const bool windows = device_windows && options_.memory_windows;
  if (!windows) {
    fprintf(stderr,
            "rdmarpc[%s]: %s: advertised payloads are exposed through per-block registrations "
            "(whole block, until deregistered): %s\n",
            owner_.c_str(), device_name_.c_str(),
            device_windows ? "RdmaOptions::memory_windows is off"
                           : "the device has no type-2 memory windows");
  }
  pool_ = std::make_unique<RegisteredPool>(pd_, options_.max_registered_bytes, device_name_,
                                           windows, memory_quota_);
  binds_wait_for_quiet_queue_ = windows && device_attr_.vendor_id == kSoftRoceVendorId;
  wake_fd_ = NewWakeFd(FaultInjection::WakeFdOf::kEndpoint);
  if (wake_fd_ < 0) {
    const int err = errno;
    return WithFileLimitAdvice(Errno("eventfd", device_name_), err);
  }
  while (slot_count_.load() < target_) {
    if (absl::Status s = GrowSlots(); !s.ok()) return s;
  }
  if (const std::string notice = LockedMemoryNotice(); !notice.empty()) {
    fprintf(stderr, "rdmarpc[%s]: %s: %s\n", owner_.c_str(), device_name_.c_str(), notice.c_str());
  }
  RefillSrq();
  if (absl::Status s = DeviceEvents::Watch(this); !s.ok()) return s;
  auto poller =
      NewThread("rdma-poll", absl::StrCat("the poller of ", device_name_, " (", owner_, ")"),
                [this] { PollLoop(); });
  if (!poller.ok()) return poller.status();  // Stop lets go of the watch
  poller_ = *std::move(poller);
  return absl::OkStatus();
}

void Endpoint::Stop() {
  DeviceEvents::Unwatch(this);
  if (poller_.joinable()) {
    stop_.store(true);
    Wake();
    poller_.join();
  }
}

void Endpoint::EndLoan() {
  if (loans_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
}

Endpoint::~Endpoint() {
  Stop();
  if (srq_) ibv_destroy_srq(srq_);
  for (const Region& r : regions_) FreeRegion(r);
  pool_.reset();
  for (const BlockStock* stock : {&small_, &send_}) {
    for (size_t i = 0; i < stock->region_count.load(); ++i) FreeRegion(stock->regions[i]);
  }
  for (size_t i = 0; i < cq_count_.load(); ++i) ibv_destroy_cq(cqs_[i].cq);
  if (channel_) ibv_destroy_comp_channel(channel_);
  if (pd_) ibv_dealloc_pd(pd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  hold_.reset();
}

size_t Endpoint::receive_bytes() const { return slot_count_.load() * options_.slot_size; }

absl::Status Endpoint::OpenCompletionQueue(size_t entries) {
  const size_t i = cq_count_.load(std::memory_order_relaxed);
  ibv_cq* cq = ibv_create_cq(verbs_, static_cast<int>(entries), nullptr, channel_, 0);
  if (!cq) return Errno("ibv_create_cq", device_name_);
  // Armed at once: the poller may be asleep on the channel, having armed
  // only the CQs it knew of.
  ibv_req_notify_cq(cq, 0);
  cqs_[i].cq = cq;
  cqs_[i].entries = static_cast<size_t>(cq->cqe);
  cqs_[i].reserved = srq_room_;
  cqs_[i].returning = 0;
  cq_count_.store(i + 1, std::memory_order_release);
  return absl::OkStatus();
}

Endpoint::CompletionQueue& Endpoint::QueueOf(const ibv_cq* cq) {
  const size_t count = cq_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    if (cqs_[i].cq == cq) return cqs_[i];
  }
  fprintf(stderr, "rdmarpc[%s]: room returned to a completion queue %s never opened\n",
          owner_.c_str(), device_name_.c_str());
  abort();
}

bool Endpoint::HasCq(const ibv_cq* cq) const {
  const size_t count = cq_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    if (cqs_[i].cq == cq) return true;
  }
  return false;
}

absl::StatusOr<ibv_cq*> Endpoint::ReserveCompletions(uint32_t entries) {
  std::lock_guard<std::mutex> lock(cq_mu_);
  if (!failed_.ok()) return failed_;
  const size_t count = cq_count_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < count; ++i) {
    if (cqs_[i].reserved + entries <= cqs_[i].entries) {
      cqs_[i].reserved += entries;
      return cqs_[i].cq;
    }
  }
  const auto full = [&](const std::string& why) {
    size_t reserved = 0, total = 0;
    for (size_t i = 0; i < count; ++i) {
      reserved += cqs_[i].reserved;
      total += cqs_[i].entries;
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "completion queue on ", device_name_, " full: ", why,
        "; lower RdmaOptions::send_slots, raise max_cq_entries or max_completion_queues, or "
        "spread connections over more transports (",
        reserved, " of ", total, " entries reserved on ", count, " completion queue",
        count == 1 ? "" : "s", ", ", entries, " more needed)"));
  };
  // Why a CQ could not grow (ENOMEM, say), for the refusal; the next
  // connection tries again.
  std::string resize_failure;
  for (size_t i = 0; i < count && cq_resizable_; ++i) {
    CompletionQueue& q = cqs_[i];
    const size_t needed = q.reserved + entries;
    if (needed > cq_bound_) continue;
    // Doubling, so that a server taking connections one by one resizes
    // rarely; each resize copies the queue.
    const size_t grown = std::min(cq_bound_, std::max(needed, 2 * q.entries));
    // ibv_resize_cq returns the error; errno need not be set.
    const std::optional<int> faked = FaultInjection::TakeFakedCqResize();
    const int err = faked ? *faked : ibv_resize_cq(q.cq, static_cast<int>(grown));
    std::string cannot;
    if (err == EOPNOTSUPP || err == ENOSYS) {
      cannot = absl::StrCat("ibv_resize_cq: ", strerror(err));
    } else if (err == 0 && static_cast<size_t>(q.cq->cqe) < needed) {
      // Success with the queue left as it was: qedr's kernel driver once
      // answered so.
      cannot = absl::StrCat("ibv_resize_cq to ", grown, " entries left it at ", q.cq->cqe);
    }
    if (!cannot.empty()) {
      // From now on a full CQ is followed by a new one, each twice the last.
      cq_resizable_ = false;
      fprintf(stderr,
              "rdmarpc[%s]: %s cannot resize a completion queue (%s); a new one is opened when "
              "those open are full, up to max_completion_queues (%u)\n",
              owner_.c_str(), device_name_.c_str(), cannot.c_str(), options_.max_completion_queues);
      break;
    }
    if (err != 0) {
      resize_failure = absl::StrCat("ibv_resize_cq to ", grown, " entries failed: ", strerror(err));
      continue;
    }
    fprintf(stderr, "rdmarpc[%s]: completion queue %zu on %s grown from %zu to %d entries\n",
            owner_.c_str(), i + 1, device_name_.c_str(), q.entries, q.cq->cqe);
    q.entries = static_cast<size_t>(q.cq->cqe);
    q.reserved = needed;
    return q.cq;
  }
  // The reason leads with the bounds: a client sees only the first ~130
  // characters of it (rdma_cm's reject carries it in its private data).
  const std::string bound = absl::StrCat(
      cq_bound_, options_.max_cq_entries ? " (max_cq_entries)" : " (the device's max_cqe)");
  if (srq_room_ + entries > cq_bound_) {
    return full(absl::StrCat("its bound of ", bound, " is too small for one connection"));
  }
  // Why the CQs open could not take the connection, for the refusal and
  // the log.
  std::string not_grown = absl::StrCat("at their bound of ", bound);
  if (!cq_resizable_) not_grown = "full, and the device cannot resize them";
  if (!resize_failure.empty()) not_grown = absl::StrCat("full (", resize_failure, ")");
  if (count == options_.max_completion_queues) {
    const std::string open = absl::StrCat(count, " open (max_completion_queues)");
    if (!resize_failure.empty()) return full(absl::StrCat(resize_failure, "; ", open));
    return full(absl::StrCat(open, ", ", not_grown));
  }
  // A CQ that will never grow begins as large as the growth would have
  // made it, so that connections do not each need a CQ of their own.
  size_t size = std::max(cq_initial_, srq_room_ + entries);
  if (!cq_resizable_) size = std::min(cq_bound_, std::max(size, 2 * cqs_[count - 1].entries));
  if (absl::Status s = OpenCompletionQueue(size); !s.ok()) {
    return full(std::string(s.message()));
  }
  CompletionQueue& q = cqs_[count];
  fprintf(
      stderr,
      "rdmarpc[%s]: completion queue %zu opened on %s (%zu entries): the %zu before it are %s\n",
      owner_.c_str(), count + 1, device_name_.c_str(), q.entries, count, not_grown.c_str());
  q.reserved += entries;
  return q.cq;
}

void Endpoint::ReturnCompletions(ibv_cq* cq, uint32_t entries) {
  std::lock_guard<std::mutex> lock(cq_mu_);
  QueueOf(cq).reserved -= entries;
}

void Endpoint::ReturnCompletionsAfterPoll(ibv_cq* cq, uint32_t entries) {
  QueueOf(cq).returning += entries;
}

Endpoint::CompletionQueueUse Endpoint::completion_queue_use() const {
  std::lock_guard<std::mutex> lock(cq_mu_);
  CompletionQueueUse use;
  use.queues = cq_count_.load(std::memory_order_relaxed);
  for (size_t i = 0; i < use.queues; ++i) {
    use.entries += cqs_[i].entries;
    use.reserved += cqs_[i].reserved;
  }
  return use;
}

absl::StatusOr<Endpoint::Region> Endpoint::NewRegion(size_t bytes, int access,
                                                     const char* what) const {
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, bytes) != 0) {
    return OutOfMemory(bytes, absl::StrCat(what, " on ", device_name_));
  }
  ibv_mr* mr = RegisterWithinLockedLimit(pd_, mem, bytes, access, pool_.get());
  if (!mr) {
    const int err = errno;
    free(mem);
    return RegistrationError(bytes, what, device_name_, err);
  }
  Count(&RdmaCounters::registered_bytes, bytes);
  return Region{static_cast<char*>(mem), mr};
}

void Endpoint::FreeRegion(const Region& r) {
  Uncount(&RdmaCounters::registered_bytes, r.mr->length);
  ibv_dereg_mr(r.mr);
  free(r.base);
}

const Endpoint::Region* Endpoint::RegionHolding(const Region* regions, size_t count,
                                                size_t region_bytes, const char* p) {
  for (size_t i = 0; i < count; ++i) {
    if (p >= regions[i].base && p < regions[i].base + region_bytes) return &regions[i];
  }
  return nullptr;
}

absl::Status Endpoint::GrowSlots() {
  const size_t bytes = kSlotsPerRegion * options_.slot_size;
  if (slot_count_.load() + kSlotsPerRegion > target_ + options_.max_held_slots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("receive slots on ", device_name_, " reached their bound of ",
                     target_ + options_.max_held_slots, " (RdmaOptions::max_held_slots)"));
  }
  if (absl::Status s = slot_growth_.Wait(); !s.ok()) return s;
  auto region = NewRegion(bytes, IBV_ACCESS_LOCAL_WRITE, "receive slots");
  if (!region.ok()) {
    slot_growth_ = {region.status(), std::chrono::steady_clock::now() + kRegistrationRetry};
    return region.status();
  }
  slot_growth_.failed = absl::OkStatus();
  regions_.push_back(*region);
  const uint32_t first = slot_count_.load();
  for (uint32_t i = 0; i < kSlotsPerRegion; ++i) spare_.Push(first + i);
  slot_count_.fetch_add(kSlotsPerRegion);
  return absl::OkStatus();
}

void Endpoint::RefillSrq() {
  // Spares are taken and posted in bounded batches, one chained post each,
  // so the receive path makes no heap allocation and one provider call per
  // batch.
  constexpr size_t kRefillBatch = 64;
  uint32_t take[kRefillBatch];
  ibv_sge sges[kRefillBatch];
  ibv_recv_wr wrs[kRefillBatch];
  absl::Status failed;
  while (posted_ < target_ && failed.ok()) {
    size_t taken = 0;
    while (posted_ + taken < target_ && taken < kRefillBatch) {
      const std::optional<uint32_t> slot = spare_.Pop();
      if (!slot) break;
      take[taken++] = *slot;
    }
    if (taken == 0) {
      failed = GrowSlots();
      continue;
    }
    for (size_t i = 0; i < taken; ++i) {
      const Region& r = regions_[take[i] / kSlotsPerRegion];
      sges[i] = ibv_sge{
          reinterpret_cast<uintptr_t>(r.base + (take[i] % kSlotsPerRegion) * options_.slot_size),
          static_cast<uint32_t>(options_.slot_size), r.mr->lkey};
      wrs[i] = ibv_recv_wr{};
      wrs[i].wr_id = take[i];
      wrs[i].sg_list = &sges[i];
      wrs[i].num_sge = 1;
      wrs[i].next = i + 1 < taken ? &wrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    size_t posted = taken;
    const bool fail = FaultInjection::TakeFailedSrqPost();
    if (fail) bad = wrs;
    // The error is the return value: providers need not set errno.
    if (const int rc = fail ? ENOMEM : ibv_post_srq_recv(srq_, wrs, &bad); rc != 0) {
      failed = absl::UnavailableError(absl::StrCat("ibv_post_srq_recv: ", strerror(rc)));
      posted = bad != nullptr ? static_cast<size_t>(bad - wrs) : 0;
      for (size_t i = posted; i < taken; ++i) ReleaseSlot(take[i]);
    }
    posted_ += posted;
    Count(&RdmaCounters::srq_slots_posted, posted);
  }
  // Retried as the poller runs, so a failure is logged when it starts and
  // when it ends, not at every try.
  if (!failed.ok() && refills_failed_++ == 0) {
    fprintf(stderr,
            "rdmarpc[%s]: the SRQ on %s cannot be refilled (%zu of its %zu slots posted): %s; "
            "retried as slots come back, senders wait on RNR retry if it empties\n",
            owner_.c_str(), device_name_.c_str(), posted_, target_,
            std::string(failed.message()).c_str());
  } else if (failed.ok() && refills_failed_ > 0) {
    fprintf(stderr, "rdmarpc[%s]: the SRQ on %s is refilled again, after %" PRIu64 " tries\n",
            owner_.c_str(), device_name_.c_str(), refills_failed_);
    refills_failed_ = 0;
  }
  const bool short_now = posted_ < target_;
  if (short_now && !short_.load()) Count(&RdmaCounters::srq_short);
  short_.store(short_now);
}

void Endpoint::ReleaseSlot(uint32_t slot) {
  spare_.Push(slot);
  if (short_.load()) Wake();
}

Buffer Endpoint::SlotBuffer(uint32_t slot, size_t offset, size_t length) {
  if (offset == 0 || offset > options_.slot_size) {
    fprintf(stderr, "rdmarpc[%s]: SlotBuffer offset %zu outside (0, %zu]\n", owner_.c_str(), offset,
            options_.slot_size);
    abort();
  }
  const Region& r = regions_[slot / kSlotsPerRegion];
  char* data = r.base + (slot % kSlotsPerRegion) * options_.slot_size + offset;
  const auto release = [ep = this, slot](char*, size_t) {
    ep->ReleaseSlot(slot);
    ep->EndLoan();
  };
  Lend();
  return Buffer(data, length, release);
}

Buffer Endpoint::SmallBuffer(size_t size) {
  if (size == 0) return Buffer();
  if (size > options_.slot_size) {
    fprintf(stderr, "rdmarpc[%s]: SmallBuffer of %zu bytes exceeds the slot size %zu\n",
            owner_.c_str(), size, options_.slot_size);
    abort();
  }
  std::optional<uint32_t> index = TakeBlock(small_);
  if (!index) {
    return Buffer(new char[options_.slot_size], size, [](char* d, size_t) { delete[] d; });
  }
  const auto release = [ep = this, i = *index](char*, size_t) {
    ep->small_.free.Push(i);
    ep->EndLoan();
  };
  Lend();
  return Buffer(BlockOf(small_, *index), size, release);
}

std::optional<uint32_t> Endpoint::TakeSendBlock() {
  if (FaultInjection::TakeRefusedSendBlock()) return std::nullopt;
  std::optional<uint32_t> index = TakeBlock(send_);
  if (index) Lend();
  return index;
}

void Endpoint::ReturnSendBlock(uint32_t index) {
  send_.free.Push(index);
  EndLoan();
}

std::optional<uint32_t> Endpoint::TakeBlock(BlockStock& stock) {
  if (std::optional<uint32_t> index = stock.free.Pop()) return index;
  return GrowBlocks(stock);
}

// Rare: the blocks only ever grow, up to max_regions regions, so the
// registration under the lock costs the fast path nothing. A registration
// that fails is tried again only after kRegistrationRetry (trying on every
// call would put ibv_reg_mr on the fast path): meanwhile, small payloads that
// find no free block are copied into their SENDs, and a connection that has
// no send slot yet sends only frames that go inline.
std::optional<uint32_t> Endpoint::GrowBlocks(BlockStock& stock) {
  std::lock_guard<std::mutex> lock(stock.grow_mu);
  if (std::optional<uint32_t> index = stock.free.Pop()) return index;  // given back meanwhile
  const size_t regions = stock.region_count.load(std::memory_order_relaxed);
  if (regions == stock.max_regions || !stock.growth.Wait().ok()) return std::nullopt;
  auto region = NewRegion(kBlocksPerRegion * options_.slot_size, 0, stock.what);
  if (!region.ok()) {
    if (stock.growth.failed.ok()) {
      fprintf(stderr,
              "rdmarpc[%s]: %s; no more than the %zu blocks registered for %s until it works\n",
              owner_.c_str(), std::string(region.status().message()).c_str(),
              regions * kBlocksPerRegion, stock.what);
    }
    stock.growth = {region.status(), std::chrono::steady_clock::now() + kRegistrationRetry};
    return std::nullopt;
  }
  if (!stock.growth.failed.ok()) {
    fprintf(stderr, "rdmarpc[%s]: blocks for %s on %s register again\n", owner_.c_str(), stock.what,
            device_name_.c_str());
    stock.growth.failed = absl::OkStatus();
  }
  stock.regions[regions] = *region;
  stock.region_count.store(regions + 1, std::memory_order_release);
  const uint32_t first = static_cast<uint32_t>(regions) * kBlocksPerRegion;
  for (uint32_t i = kBlocksPerRegion; i-- > 1;) stock.free.Push(first + i);
  return first;
}

char* Endpoint::BlockOf(const BlockStock& stock, uint32_t index) const {
  return stock.regions[index / kBlocksPerRegion].base +
         size_t(index % kBlocksPerRegion) * options_.slot_size;
}

bool Endpoint::SmallBlockLkey(const char* p, uint32_t* lkey) const {
  const Region* r =
      RegionHolding(small_.regions.get(), small_.region_count.load(std::memory_order_acquire),
                    kBlocksPerRegion * options_.slot_size, p);
  if (r == nullptr) return false;
  *lkey = r->mr->lkey;
  return true;
}

Buffer Endpoint::BlockBuffer(RegisteredPool::Block* block, size_t size) {
  const auto release = [ep = this, block](char*, size_t) {
    ep->pool_->Put(block);
    ep->EndLoan();
  };
  Lend();
  return Buffer(block->data, size, release);
}

void Endpoint::Wake() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
}

void Endpoint::RunOnPoller(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    tasks_.push_back(std::move(task));
    has_tasks_.store(true, std::memory_order_release);
  }
  Wake();
}

void Endpoint::RunOnPollerAndWait(std::function<void()> task) {
  if (OwnsIo()) return task();
  std::promise<void> done;
  RunOnPoller([&] {
    task();
    done.set_value();
  });
  done.get_future().wait();
}

void Endpoint::FailQueuePair(uint32_t qp_num, std::string why) {
  RunOnPoller([this, qp_num, why = std::move(why)] {
    auto it = by_qp_.find(qp_num);
    if (it == by_qp_.end()) return;
    RdmaConnection& conn = *it->second;
    conn.FailFromDevice(absl::UnavailableError(
        absl::StrCat("the queue pair to ", conn.peer(), " failed: ", why)));
  });
}

void Endpoint::FailAll(absl::Status why) {
  {
    std::lock_guard<std::mutex> lock(cq_mu_);
    if (failed_.ok()) failed_ = why;
  }
  RunOnPoller([this, why = std::move(why)] {
    std::vector<std::shared_ptr<RdmaConnection>> all;
    for (const auto& [qp_num, conn] : by_qp_) all.push_back(conn);
    for (const auto& conn : all) conn->FailFromDevice(why);
  });
}

void Endpoint::AddConnection(std::shared_ptr<RdmaConnection> conn) {
  by_serial_[conn->serial() & 0x07ffffff] = conn.get();
  last_receiver_ = nullptr;
  std::shared_ptr<RdmaConnection>& entry = by_qp_[conn->qp_num()];
  if (entry) {
    granted_credits_ -= entry->credit_window();
    if (shares_credits_) GiveBackCredits(entry->credits_on_budget());
  }
  granted_credits_ += conn->credit_window();
  if (shares_credits_) TakeCredits(conn->credit_window());
  entry = std::move(conn);
  PublishCommitted();
  if (!shares_credits_) return;
  Reshare();
  if (by_qp_.size() <= credit_share_.budget || told_overcommitted_) return;
  told_overcommitted_ = true;
  const unsigned retry_us = RnrTimerMicros(RnrTimerCode(options_.rnr_wait_us));
  fprintf(stderr,
          "rdmarpc[%s]: %s: %zu connections share %zu receive slots, and each may send at "
          "least one frame: their windows no longer fit the %zu frames the slots hold besides "
          "refills and control frames. A burst from all of them would find the SRQ empty, and "
          "their devices retry each frame after %u us (RNR NAK; device_rnr_naks_sent in the "
          "counters). If such bursts are expected, raise RdmaOptions::%s, or set "
          "RdmaOptions::strict_credits to refuse connections past what the slots hold. Said "
          "once.\n",
          owner_.c_str(), device_name_.c_str(), by_qp_.size(), target_, credit_share_.budget,
          retry_us, receive_slots_option_);
}

void Endpoint::RemoveConnection(RdmaConnection* conn) {
  by_serial_.erase(conn->serial() & 0x07ffffff);
  last_receiver_ = nullptr;
  auto it = by_qp_.find(conn->qp_num());
  if (it == by_qp_.end() || it->second.get() != conn) return;
  granted_credits_ -= conn->credit_window();
  if (shares_credits_) GiveBackCredits(conn->credits_on_budget());
  by_qp_.erase(it);
  PublishCommitted();
  // The windows that grew are topped up as their peers send (a kCredit to
  // every idle peer at each close would cost a receive slot for nothing).
  if (shares_credits_) WakeCreditWaiters();
}

RdmaConnection* Endpoint::ReceiverOf(uint32_t qp_num) {
  if (last_receiver_ != nullptr && last_receiver_qp_ == qp_num) return last_receiver_;
  auto it = by_qp_.find(qp_num);
  if (it == by_qp_.end()) return nullptr;
  last_receiver_qp_ = qp_num;
  last_receiver_ = it->second.get();
  return last_receiver_;
}

void Endpoint::HandleCompletion(const ibv_wc& wc) {
  // wc.opcode is undefined for a failed completion; the wr_id tells: only
  // RECVs have no kind in the top bits.
  const bool recv = (wc.wr_id >> 60) == 0;
  if (recv && wc.status == IBV_WC_SUCCESS) {
    RDMARPC_STAGE(kRecvPolled);
    sanitizer_sync::ReceivedOn(wc);
    const uint32_t slot = static_cast<uint32_t>(wc.wr_id);
    --posted_;
    Count(&RdmaCounters::srq_slots_consumed);
    RdmaConnection* conn = ReceiverOf(wc.qp_num);
    if (conn == nullptr || conn->torn_down()) {
      ReleaseSlot(slot);
      return;
    }
    const Region& r = regions_[slot / kSlotsPerRegion];
    conn->OnRecv(slot, r.base + (slot % kSlotsPerRegion) * options_.slot_size, wc.byte_len);
    return;
  }
  if (recv) {
    // An SRQ receive flushed (the SRQ is being destroyed): the slot is gone.
    --posted_;
    return;
  }
  auto it = by_serial_.find(static_cast<uint32_t>((wc.wr_id >> 32) & 0x07ffffff));
  if (it == by_serial_.end()) return;  // its connection is gone
  it->second->OnCompletion(wc);
}

bool Endpoint::TryOwnIo() {
  std::thread::id none;
  return io_thread_.compare_exchange_strong(none, std::this_thread::get_id(),
                                            std::memory_order_acquire);
}

void Endpoint::ReleaseIo() { io_thread_.store(std::thread::id(), std::memory_order_release); }

int Endpoint::PollCompletions(bool until_empty) {
  ibv_wc* wcs = polled_.data();
  int found = 0;
  const size_t queues = cq_count_.load(std::memory_order_acquire);
  for (size_t q = 0; q < queues; ++q) {
    CompletionQueue& cq = cqs_[q];
    int n;
    do {
      n = ibv_poll_cq(cq.cq, kCompletionsPerPoll, wcs);
      if (n > 0) {
        // Credits queued from now on go out after every frame of this
        // batch arrived (RdmaConnection::OverdrawnLocked).
        poll_round_.store(poll_round_.load(std::memory_order_relaxed) + 1,
                          std::memory_order_release);
      }
      for (int i = 0; i < n; ++i) {
        HandleCompletion(wcs[i]);
        // After each completion, not each batch: a frame's credit may go
        // back to its peer while it is handled, and the slot it took must be
        // posted again before more than refill_below_ allows are missing
        // (StrictUnpostedSlots). One compare; the refill itself is batched.
        if (posted_ < refill_below_) RefillSrq();
      }
      found += std::max(n, 0);
      if (cq.returning != 0 && n < kCompletionsPerPoll) {
        ReturnCompletions(cq.cq, static_cast<uint32_t>(cq.returning));
        cq.returning = 0;
      }
    } while (until_empty && n == kCompletionsPerPoll);
  }
  return found;
}

void Endpoint::DrainCompletions() { PollCompletions(/*until_empty=*/true); }

bool Endpoint::PollOnce(int* completions) {
  RDMARPC_STAGE(kPoll);
  const int found = PollCompletions(/*until_empty=*/false);
  if (completions != nullptr) *completions = found;
  std::vector<std::function<void()>> tasks;
  if (has_tasks_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    tasks.swap(tasks_);
    has_tasks_.store(false, std::memory_order_relaxed);
  }
  for (auto& t : tasks) t();
  if (posted_ < refill_below_ || (short_.load(std::memory_order_relaxed) && posted_ < target_)) {
    RefillSrq();
  }
  if (++polls_since_sweep_ >= kSweepEveryPolls) SweepIfDue();
  for (size_t i = 0; i < draining_.size();) {
    if (draining_[i]->FinishTeardown()) {
      draining_[i] = draining_.back();
      draining_.pop_back();
    } else {
      ++i;
    }
  }
  return found > 0 || !tasks.empty();
}

void Endpoint::SweepIfDue() {
  polls_since_sweep_ = 0;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_sweep_ < sweep_interval_) return;
  last_sweep_ = now;
  const absl::Time t = SteadyNow();
  // Collected first: expiring may close a connection, and closing calls out.
  std::vector<std::shared_ptr<RdmaConnection>> due;
  for (auto& [qp, conn] : by_qp_) {
    if (!conn->torn_down() && conn->TimeoutsDue(t)) due.push_back(conn);
  }
  for (auto& conn : due) conn->ExpireTimeouts(t);
}

bool Endpoint::Drive(absl::FunctionRef<bool()> done) {
  if (options_.poll_mode == PollMode::kEvent || OwnsIo()) return false;
  // One driver at a time (see "I/O context" in endpoint.h): the others wait
  // to be told, so that callers blocked at once do not spin a core each.
  if (drivers_.fetch_add(1, std::memory_order_acq_rel) > 0) {
    drivers_.fetch_sub(1, std::memory_order_acq_rel);
    return false;
  }
  const auto spin = std::chrono::microseconds(options_.spin_us);
  auto last_activity = std::chrono::steady_clock::now();
  bool finished = false;
  int idle_polls = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    if (done()) {
      finished = true;
      break;
    }
    if (TryOwnIo()) {
      int completions = 0;
      const bool active = PollOnce(&completions);
      ReleaseIo();
      if (completions > 0) Count(&RdmaCounters::caller_completions, completions);
      if (active) {
        if (options_.poll_mode == PollMode::kAdaptive) {
          last_activity = std::chrono::steady_clock::now();
        }
        continue;
      }
    }
    if (options_.poll_mode == PollMode::kAdaptive &&
        std::chrono::steady_clock::now() - last_activity > spin) {
      break;
    }
    IdleSpin(idle_polls);
  }
  // Finished: the caller will likely drive again soon; keep the poller
  // thread parked for the grace. Giving up, or leaving responses awaited
  // (callers that did not drive, asynchronous calls; counted on a client
  // endpoint, the only kind callers drive): no grace, the poller thread
  // takes the CQ back now, so theirs do not wait for it.
  const bool grace = finished && responses_awaited_.load(std::memory_order_relaxed) == 0;
  last_driven_ns_.store(grace ? std::chrono::steady_clock::now().time_since_epoch().count() : 0,
                        std::memory_order_relaxed);
  drivers_.fetch_sub(1, std::memory_order_acq_rel);
  if (!grace) Wake();
  return finished;
}

bool Endpoint::DrivenRecently() const {
  if (drivers_.load(std::memory_order_acquire) > 0) return true;
  const int64_t last_ns = last_driven_ns_.load(std::memory_order_relaxed);
  if (last_ns == 0) return false;
  const auto last =
      std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(last_ns));
  return std::chrono::steady_clock::now() - last < kDriveGrace;
}

void Endpoint::SleepUntilWoken(int timeout_ms) {
  pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  // What woke us is drained from this poll's own answer: a second poll to
  // ask again is one more system call per wake-up, and the poller wakes
  // every kDriveGrace while a caller drives.
  if (poll(fds, 2, timeout_ms) <= 0) return;
  if (fds[0].revents & POLLIN) {
    ibv_cq* ev_cq;
    void* ctx;
    if (ibv_get_cq_event(channel_, &ev_cq, &ctx) == 0) ibv_ack_cq_events(ev_cq, 1);
  }
  if (fds[1].revents & POLLIN) {
    uint64_t v;
    (void)!read(wake_fd_, &v, sizeof v);
  }
}

void Endpoint::PollLoop() {
  auto last_activity = std::chrono::steady_clock::now();
  const auto spin = std::chrono::microseconds(options_.spin_us);
  int idle_polls = 0;
  while (!stop_.load()) {
    // A caller drives the CQ (run-to-completion): stay off the CPU it needs.
    if (DrivenRecently()) {
      SleepUntilWoken(static_cast<int>(kDriveGrace.count()));
      last_activity = std::chrono::steady_clock::now();
      continue;
    }
    if (!TryOwnIo()) {
      std::this_thread::yield();
      continue;
    }
    const bool active = PollOnce();
    ReleaseIo();
    if (options_.poll_mode == PollMode::kBusy) {
      // No clock reads here: in a VM they can cost more than the poll.
      if (!active) IdleSpin(idle_polls);
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (active) {
      last_activity = now;
      continue;
    }
    if (options_.poll_mode == PollMode::kAdaptive && now - last_activity < spin) {
      IdleSpin(idle_polls);
      continue;
    }
    // Sleep: arm, re-poll to close the race, then wait for an event or a wake.
    if (!TryOwnIo()) continue;
    const size_t queues = cq_count_.load(std::memory_order_acquire);
    for (size_t q = 0; q < queues; ++q) ibv_req_notify_cq(cqs_[q].cq, 0);
    const bool raced = PollOnce();
    SweepIfDue();
    ReleaseIo();
    if (raced) {
      last_activity = std::chrono::steady_clock::now();
      continue;
    }
    Count(&RdmaCounters::poller_sleeps);
    // A bounded sleep keeps timers (drain deadlines, release timeouts) moving.
    SleepUntilWoken(100);
    last_activity = std::chrono::steady_clock::now();
  }
  // Stopping: finish what remains so every connection ends. Drivers see
  // stop_ and leave; wait for the one that may still own the CQ.
  while (!TryOwnIo()) std::this_thread::yield();
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) t();
  ReleaseIo();
}

}  // namespace rdmarpc::transport::rdma
