// InlineMutex: a mutex whose uncontended lock and unlock are a few inline
// instructions; a contended lock sleeps in the kernel (futex), as
// std::mutex's does.
//
//   InlineMutex mu;
//   {
//     std::lock_guard<InlineMutex> lock(mu);
//     ...  // short critical section
//   }
//
// Why: the RPC fast path takes a lock around each SEND, each receive and
// each call's bookkeeping, about seven lock/unlock pairs per small call.
// std::mutex goes out of line into pthread_mutex_lock/unlock at ~57
// instructions a pair (counted by callgrind), ~10 here; under the emulator
// the RDMA tests run in, time per round trip follows the instruction count
// (README, Benchmarks).
//
// The design is the third futex mutex of Drepper's "Futexes Are Tricky",
// unlocking with an exchange as glibc's low-level lock does: state 0 is
// free, 1 held, 2 held with possible sleepers; unlock wakes one sleeper
// only from state 2.
//
// What not to rely on: fairness (a thread that unlocks may take it straight
// back); use with std::condition_variable (it needs std::mutex; use
// condition_variable_any); recursion; anything but Linux.
#ifndef RDMARPC_BASE_INLINE_MUTEX_H_
#define RDMARPC_BASE_INLINE_MUTEX_H_

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace rdmarpc {

class InlineMutex {
 public:
  InlineMutex() = default;
  InlineMutex(const InlineMutex&) = delete;
  InlineMutex& operator=(const InlineMutex&) = delete;

  void lock() {
    uint32_t expected = kFree;
    if (!state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      LockContended(expected);
    }
  }

  bool try_lock() {
    uint32_t expected = kFree;
    return state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }

  void unlock() {
    if (state_.exchange(kFree, std::memory_order_release) == kContended) Wake();
  }

 private:
  static constexpr uint32_t kFree = 0;
  static constexpr uint32_t kHeld = 1;
  static constexpr uint32_t kContended = 2;
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
                    std::atomic<uint32_t>::is_always_lock_free,
                "the futex word must be a plain lock-free 32-bit integer");

  // Out of line: the common case should not carry the system calls' code.
  __attribute__((noinline)) void LockContended(uint32_t seen) {
    // Marking the lock contended before sleeping makes the holder's unlock
    // wake us; taking it in state 2 is conservative (one spare wake-up).
    if (seen != kContended) seen = state_.exchange(kContended, std::memory_order_acquire);
    while (seen != kFree) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAIT_PRIVATE, kContended,
              nullptr, nullptr, 0);
      seen = state_.exchange(kContended, std::memory_order_acquire);
    }
  }

  __attribute__((noinline)) void Wake() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
  }

  std::atomic<uint32_t> state_{kFree};
};

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_INLINE_MUTEX_H_
