// ThreadPool: a fixed set of threads running queued tasks in FIFO order.
//
// Server handlers and client callbacks run here, never on a transport's I/O
// thread, so a slow handler cannot stall the network. Stop() runs what is
// already queued, then joins; tasks posted after Stop() are refused.
//
// A process at its limit on threads gets no pool: Create says which limit
// (base/new_thread.h), rather than a pool with fewer threads than asked for.
//
// A task may destroy the pool (a callback that drops the last reference to
// the channel that owns it): its own thread cannot be joined then, so it is
// detached, and it finishes with the queue's state, which it shares, after
// the pool is gone.
#ifndef RDMARPC_RPC_INTERNAL_THREAD_POOL_H_
#define RDMARPC_RPC_INTERNAL_THREAD_POOL_H_

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/new_thread.h"
#include "base/ring_fifo.h"

namespace rdmarpc::internal {

class ThreadPool {
 public:
  // A pool of max(threads, 1) threads named `name`, which run `what` ("the
  // callbacks of channel x"), named in the error when they cannot all be
  // started.
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(int threads, ThreadName name,
                                                            absl::string_view what);
  ~ThreadPool() { Stop(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // False when the pool is stopping (the task is dropped).
  bool Post(absl::AnyInvocable<void() &&> task);
  void Stop();
  // True on one of this pool's threads.
  bool InPool() const;

 private:
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    RingFifo<absl::AnyInvocable<void() &&>> tasks;  // guarded by mu
    bool stopping = false;                          // guarded by mu
  };
  ThreadPool() = default;
  static void Run(const std::shared_ptr<Queue>& queue);

  const std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  std::vector<std::thread> threads_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_THREAD_POOL_H_
