#include "transport/rdma/registered_pool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/locked_memory.h"
#include "transport/transport.h"

namespace rdmarpc::transport::rdma {

namespace {

ibv_mr* RegisterMemory(ibv_pd* pd, void* addr, size_t length, int access) {
  if (FaultInjection::TakeFailedRegistration()) {
    errno = ENOMEM;
    return nullptr;
  }
  return ibv_reg_mr(pd, addr, length, access);
}

// Every pool of the process. Its mutex is taken before a pool's own, and
// held while another pool's idle blocks are destroyed, so that the pool
// cannot be destroyed meanwhile.
struct Pools {
  std::mutex mu;
  std::vector<RegisteredPool*> all;  // guarded by mu
};

Pools& AllPools() {
  static auto* pools = new Pools;  // never destroyed: pools may outlive static destructors
  return *pools;
}

}  // namespace

// Idle blocks of `first` (when not null), then of the process's other pools
// (those that share the quota `of`, when not null), destroyed until `bytes`
// are or none is left; returns the bytes destroyed.
size_t GiveBackIdleBlocks(size_t bytes, RegisteredPool* first, const MemoryQuota* of) {
  Pools& pools = AllPools();
  std::lock_guard<std::mutex> lock(pools.mu);
  size_t freed = first != nullptr ? first->DestroyIdle(bytes) : 0;
  for (RegisteredPool* pool : pools.all) {
    if (freed >= bytes) break;
    if (pool != first && (of == nullptr || pool->quota_.get() == of)) {
      freed += pool->DestroyIdle(bytes - freed);
    }
  }
  return freed;
}

ibv_mr* RegisterWithinLockedLimit(ibv_pd* pd, void* addr, size_t length, int access,
                                  RegisteredPool* first) {
  ibv_mr* mr = RegisterMemory(pd, addr, length, access);
  if (mr != nullptr || errno != ENOMEM) return mr;
  if (GiveBackIdleBlocks(length, first, nullptr) == 0) {
    errno = ENOMEM;
    return nullptr;
  }
  return RegisterMemory(pd, addr, length, access);
}

absl::Status RegistrationError(size_t bytes, const std::string& what, const std::string& device,
                               int err) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "ibv_reg_mr of ", bytes, " bytes for ", what, " on ", device, " failed: ", strerror(err),
      err == ENOMEM ? absl::StrCat(" (", LockedMemoryAdvice(), ")") : ""));
}

RegisteredPool::RegisteredPool(ibv_pd* pd, size_t max_bytes, std::string device,
                               bool memory_windows, std::shared_ptr<MemoryQuota> quota)
    : pd_(pd),
      max_bytes_(max_bytes),
      device_(std::move(device)),
      memory_windows_(memory_windows),
      quota_(std::move(quota)) {
  if (quota_) {
    MemoryQuota::SetReclaimer(
        [](size_t bytes, const MemoryQuota* of) { return GiveBackIdleBlocks(bytes, nullptr, of); });
  }
  Pools& pools = AllPools();
  std::lock_guard<std::mutex> lock(pools.mu);
  pools.all.push_back(this);
}

RegisteredPool::~RegisteredPool() {
  {
    Pools& pools = AllPools();
    std::lock_guard<std::mutex> lock(pools.mu);
    pools.all.erase(std::find(pools.all.begin(), pools.all.end(), this));
  }
  for (const auto& [data, b] : by_data_) Destroy(b);
}

void RegisteredPool::Destroy(Block* block) {
  if (ibv_dereg_mr(block->mr) != 0) {
    // The device may still reach the memory (a memory window left bound to
    // it would be a bug of ours): it is kept, never handed out again.
    fprintf(stderr,
            "rdmarpc: %s: ibv_dereg_mr of a %zu-byte payload buffer at %p failed: %s; its memory "
            "is leaked rather than freed under the device\n",
            device_.c_str(), block->capacity, static_cast<void*>(block->data), strerror(errno));
  } else {
    free(block->data);
  }
  Uncount(&RdmaCounters::registered_bytes, block->capacity);
  if (quota_) quota_->Release(block->capacity);
  delete block;
}

size_t RegisteredPool::IdleBytesLocked() const {
  size_t idle = 0;
  for (const auto& kind : free_) {
    for (int cls = 0; cls < kSizeClasses; ++cls) idle += kind[cls].size() * ClassBytes(cls);
  }
  return idle;
}

std::vector<RegisteredPool::Block*> RegisteredPool::EvictLocked(size_t bytes) {
  std::vector<Block*> evicted;
  size_t freed = 0;
  for (int cls = kSizeClasses - 1; cls >= 0 && freed < bytes; --cls) {
    for (auto& kind : free_) {
      std::vector<Block*>& list = kind[cls];
      while (!list.empty() && freed < bytes) {
        Block* b = list.back();
        list.pop_back();
        by_data_.erase(b->data);
        registered_ -= b->capacity;
        freed += b->capacity;
        evicted.push_back(b);
      }
    }
  }
  return evicted;
}

size_t RegisteredPool::DestroyIdle(size_t bytes) {
  std::vector<Block*> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = EvictLocked(bytes);
  }
  size_t freed = 0;
  for (Block* b : idle) {
    freed += b->capacity;
    Destroy(b);
  }
  return freed;
}

absl::StatusOr<RegisteredPool::Block*> RegisteredPool::Get(size_t size, bool remote_read) {
  const int cls = SizeClassOf(size);
  if (cls == kSizeClasses) {
    return absl::ResourceExhaustedError(
        absl::StrCat("buffer of ", size, " bytes exceeds the largest pool class (1 GiB)"));
  }
  const size_t capacity = ClassBytes(cls);
  std::vector<Block*> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[remote_read][cls];
    if (!list.empty()) {
      Block* b = list.back();
      list.pop_back();
      return b;
    }
    if (registered_ + capacity > max_bytes_) {
      const size_t idle = IdleBytesLocked();
      if (registered_ - idle + capacity > max_bytes_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "registered memory on ", device_, " would exceed its bound of ", max_bytes_,
            " bytes (RdmaOptions::max_registered_bytes; ", registered_ - idle,
            " in use by payloads now, ", capacity, " more needed)"));
      }
      evicted = EvictLocked(registered_ + capacity - max_bytes_);
    }
    registered_ += capacity;  // reserved; undone below on failure
  }
  for (Block* b : evicted) Destroy(b);
  if (quota_ && !quota_->Reserve(capacity)) {
    std::lock_guard<std::mutex> lock(mu_);
    registered_ -= capacity;
    return quota_->Exceeded(capacity, absl::StrCat("a payload block on ", device_));
  }
  void* mem = nullptr;
  if (posix_memalign(&mem, 4096, capacity) != 0) {
    if (quota_) quota_->Release(capacity);
    std::lock_guard<std::mutex> lock(mu_);
    registered_ -= capacity;
    return OutOfMemory(
        capacity, absl::StrCat("a payload block on ", device_,
                               remote_read ? " for the peer to READ" : " to READ a payload into"));
  }
  const int remote = memory_windows_ ? IBV_ACCESS_MW_BIND : IBV_ACCESS_REMOTE_READ;
  const int access = IBV_ACCESS_LOCAL_WRITE | (remote_read ? remote : 0);
  ibv_mr* mr = RegisterWithinLockedLimit(pd_, mem, capacity, access, this);
  if (mr == nullptr) {
    const int err = errno;
    free(mem);
    if (quota_) quota_->Release(capacity);
    std::lock_guard<std::mutex> lock(mu_);
    registered_ -= capacity;
    return RegistrationError(capacity, "payload buffers", device_, err);
  }
  Count(&RdmaCounters::registered_bytes, capacity);
  auto* b = new Block{static_cast<char*>(mem), capacity, mr, cls, remote_read};
  std::lock_guard<std::mutex> lock(mu_);
  by_data_[b->data] = b;
  return b;
}

void RegisteredPool::Put(Block* block) {
  std::lock_guard<std::mutex> lock(mu_);
  free_[block->remote_read][block->size_class].push_back(block);
}

RegisteredPool::Block* RegisteredPool::Find(const char* data) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_data_.find(data);
  return it == by_data_.end() ? nullptr : it->second;
}

size_t RegisteredPool::registered_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return registered_;
}

}  // namespace rdmarpc::transport::rdma
