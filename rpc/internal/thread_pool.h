// ThreadPool: a fixed set of threads running queued tasks in FIFO order.
//
// Server handlers and client callbacks run here, never on a transport's I/O
// thread, so a slow handler cannot stall the network. Stop() runs what is
// already queued, then joins; tasks posted after Stop() are refused.
#ifndef RDMARPC_RPC_INTERNAL_THREAD_POOL_H_
#define RDMARPC_RPC_INTERNAL_THREAD_POOL_H_

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "base/ring_fifo.h"

namespace rdmarpc::internal {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool() { Stop(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // False when the pool is stopping (the task is dropped).
  bool Post(absl::AnyInvocable<void() &&> task);
  void Stop();
  // True on one of this pool's threads.
  bool InPool() const;

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  RingFifo<absl::AnyInvocable<void() &&>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_THREAD_POOL_H_
