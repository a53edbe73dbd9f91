// RegisteredPool: registered buffers by size class (size_classes.h), for one PD.
//
// Why: registering memory (ibv_reg_mr) costs far more than a call, so every
// buffer is registered once, when the pool first grows to need it, and then
// recycled through a free list; the fast path only pops and pushes. Growth is
// bounded by max_bytes: past it Get() fails with RESOURCE_EXHAUSTED naming
// the bound, instead of the allocator deciding for us.
//
// Each block has a registration of its own. Blocks meant for advertising are
// registered for memory-window binding (IBV_ACCESS_MW_BIND) and carry no
// remote access themselves: a peer only ever gets the rkey of a type-2
// memory window bound to its own QP over exactly the advertised bytes, which
// is invalidated before the block is reused (rdma_connection.h). On a device
// without type-2 windows they fall back to IBV_ACCESS_REMOTE_READ on the
// block, which exposes the whole block for as long as it is registered.
//
// Idle blocks stay registered for the next Get of their class, until a Get
// would pass max_bytes: then idle blocks of other classes (or of the other
// kind) are deregistered and freed, largest first, as far as that Get needs.
// Without that, a process whose payload sizes changed (a burst of 64 MiB
// requests, then 1 MiB responses) would be refused for good, its bound held
// by blocks nobody uses. Blocks in use are never taken back. A registration
// refused for the locked-memory limit (ENOMEM), a block's or an endpoint's
// slots', evicts idle blocks the same way, of its own pool first and then of
// every other pool of the process, and is tried once more: the limit counts
// every registration of the process, so one transport's idle blocks (a
// server's after a burst of large requests) must not starve another's calls
// (a channel's in the same process). A pool given a memory quota (shared
// with other transports, transport/memory_quota.h) reserves each block's
// bytes there too. Where the quota has no room, for a block or for another
// transport's memory (a TCP message), idle blocks of the pools that share
// it are evicted, largest first within each pool (the quota's reclaimer);
// a block fails RESOURCE_EXHAUSTED naming the quota only if that was not
// enough.
//
// What not to rely on: once put back a block may carry someone else's bytes,
// or be freed; callers must not Put() a block a peer may still READ.
// Memory is returned to the system only as above, or when the pool is
// destroyed.
#ifndef RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_
#define RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/memory_quota.h"
#include "transport/rdma/size_classes.h"

namespace rdmarpc::transport::rdma {

class RegisteredPool;

// Every registration of the transport's memory goes through here (the pool's
// blocks, the endpoint's slot regions): ibv_reg_mr, failing on purpose when a
// test asks (FaultInjection::FailRegistrations); refused for the
// locked-memory limit (ENOMEM), tried once more after idle blocks were given
// back: `first`'s (when not null), then other pools', largest first, as far
// as `length` needs and there are any. Null with errno set when it fails.
ibv_mr* RegisterWithinLockedLimit(ibv_pd* pd, void* addr, size_t length, int access,
                                  RegisteredPool* first);
// What a failed registration of `bytes` for `what` on `device` says, with
// `err` its errno: RESOURCE_EXHAUSTED, for ENOMEM naming the locked-memory
// limit and how to raise it (locked_memory.h).
absl::Status RegistrationError(size_t bytes, const std::string& what, const std::string& device,
                               int err);

class RegisteredPool {
 public:
  struct Block {
    char* data;
    size_t capacity;
    ibv_mr* mr;
    int size_class;
    bool remote_read;
  };

  // Each pool is listed process-wide from here to its destructor, for
  // RegisterWithinLockedLimit and for the pools that share `quota` (null:
  // none).
  RegisteredPool(ibv_pd* pd, size_t max_bytes, std::string device, bool memory_windows,
                 std::shared_ptr<MemoryQuota> quota = nullptr);
  ~RegisteredPool();
  RegisteredPool(const RegisteredPool&) = delete;
  RegisteredPool& operator=(const RegisteredPool&) = delete;

  absl::StatusOr<Block*> Get(size_t size, bool remote_read);
  void Put(Block* block);
  // The block that starts at `data`, or null if none does.
  Block* Find(const char* data) const;

  size_t registered_bytes() const;
  bool memory_windows() const { return memory_windows_; }

 private:
  ibv_pd* const pd_;
  const size_t max_bytes_;
  const std::string device_;
  const bool memory_windows_;
  const std::shared_ptr<MemoryQuota> quota_;
  mutable std::mutex mu_;
  size_t registered_ = 0;                        // guarded by mu_
  std::vector<Block*> free_[2][kSizeClasses];    // [remote_read][class], guarded by mu_
  std::unordered_map<const char*, Block*> by_data_;  // every block; guarded by mu_

  // Bytes in the free lists (only when the bound is near: not kept as a sum).
  size_t IdleBytesLocked() const;
  // Takes idle blocks of at least `bytes` in all out of the pool (fewer when
  // fewer are idle), largest first; they are to be destroyed outside mu_.
  std::vector<Block*> EvictLocked(size_t bytes);
  // Evicts as EvictLocked and destroys what it took; returns those bytes.
  size_t DestroyIdle(size_t bytes);
  void Destroy(Block* block);

  friend size_t GiveBackIdleBlocks(size_t bytes, RegisteredPool* first, const MemoryQuota* of);
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_
