// RegisteredPool: registered buffers by power-of-two size class, for one PD.
//
// Why: registering memory (ibv_reg_mr) costs far more than a call, so every
// buffer is registered once, when the pool first grows to need it, and then
// recycled through a free list; the fast path only pops and pushes. Growth is
// bounded by max_bytes: past it Get() fails with RESOURCE_EXHAUSTED naming
// the bound, instead of the allocator deciding for us.
//
// Each block has a registration of its own, so an rkey handed to a peer for
// one block never covers a neighbouring block. Remote-readable blocks
// (IBV_ACCESS_REMOTE_READ) and local-only ones are kept apart.
//
// What not to rely on: a block keeps its rkey for its whole life; once put
// back it may carry someone else's bytes. Callers must not Put() a block a
// peer may still READ (see the buffer-lifetime rule in rdma_connection.h).
// Memory is never returned to the system before the pool is destroyed.
#ifndef RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_
#define RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_

#include <infiniband/verbs.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace rdmarpc::transport::rdma {

class RegisteredPool {
 public:
  struct Block {
    char* data;
    size_t capacity;
    ibv_mr* mr;
    int size_class;
    bool remote_read;
  };

  static constexpr size_t kMinBlock = 16 * 1024;
  static constexpr int kClasses = 17;  // 16 KiB .. 1 GiB
  static_assert((kMinBlock << (kClasses - 1)) == (size_t{1} << 30), "classes reach 1 GiB");

  RegisteredPool(ibv_pd* pd, size_t max_bytes, std::string device);
  ~RegisteredPool();
  RegisteredPool(const RegisteredPool&) = delete;
  RegisteredPool& operator=(const RegisteredPool&) = delete;

  absl::StatusOr<Block*> Get(size_t size, bool remote_read);
  void Put(Block* block);
  // The block that starts at `data`, or null if none does.
  Block* Find(const char* data) const;

  size_t registered_bytes() const;

 private:
  ibv_pd* const pd_;
  const size_t max_bytes_;
  const std::string device_;
  mutable std::mutex mu_;
  size_t registered_ = 0;                        // guarded by mu_
  std::vector<Block*> free_[2][kClasses];        // [remote_read][class], guarded by mu_
  std::vector<Block*> all_;                      // guarded by mu_
  std::unordered_map<const char*, Block*> by_data_;  // guarded by mu_
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_REGISTERED_POOL_H_
