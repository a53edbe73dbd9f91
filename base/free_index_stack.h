// FreeIndexStack: a lock-free stack of free indices in [0, capacity), for
// pools whose items are numbered (pieces of preallocated memory).
//
//   FreeIndexStack free(512);
//   free.Push(7);
//   if (std::optional<uint32_t> i = free.Pop()) Use(*i);
//
// Why: a pool that any thread takes from and gives back to pays a mutex per
// operation, and under an emulator an uncontended std::mutex lock and unlock
// costs as much as ~50 ordinary instructions (README, Benchmarks). Here a Pop
// or a Push is one compare-and-swap on the head in the common case.
//
// How: a Treiber stack whose links live in a side array (next_[i] is what
// lies under i), with the head packed as (tag << 32 | index + 1). Every
// successful Push and Pop bumps the tag, so a Pop that read a head and its
// link before other threads popped and pushed the same index back fails its
// compare-and-swap instead of installing a stale link (the ABA problem).
//
// What not to rely on: order (it is LIFO, which keeps recently used memory
// warm, but callers must not depend on it); that an index is pushed at most
// once - pushing one that is already free corrupts the stack, and nothing
// here checks. Pop may retry under contention; it never blocks.
#ifndef RDMARPC_BASE_FREE_INDEX_STACK_H_
#define RDMARPC_BASE_FREE_INDEX_STACK_H_

#include <atomic>
#include <cassert>
#include <cstdint>
#include <memory>
#include <optional>

namespace rdmarpc {

class FreeIndexStack {
 public:
  // Empty; indices up to capacity - 1 may be pushed. The capacity is fixed:
  // the links are one array, read by Pop without a lock.
  explicit FreeIndexStack(uint32_t capacity)
      : capacity_(capacity), next_(new std::atomic<uint32_t>[capacity]) {
    assert(capacity < UINT32_MAX);  // index + 1 fits 32 bits
    for (uint32_t i = 0; i < capacity; ++i) next_[i].store(kEmpty, std::memory_order_relaxed);
  }
  FreeIndexStack(const FreeIndexStack&) = delete;
  FreeIndexStack& operator=(const FreeIndexStack&) = delete;

  // `index` must be below the capacity and not on the stack already.
  void Push(uint32_t index) {
    assert(index < capacity_);
    uint64_t head = head_.load(std::memory_order_relaxed);
    uint64_t desired;
    do {
      next_[index].store(Top(head), std::memory_order_relaxed);
      desired = Pack(Tag(head) + 1, index + 1);
    } while (!head_.compare_exchange_weak(head, desired, std::memory_order_release,
                                          std::memory_order_relaxed));
  }

  // The most recently pushed free index, or nothing when none is free.
  std::optional<uint32_t> Pop() {
    uint64_t head = head_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t top = Top(head);
      if (top == kEmpty) return std::nullopt;
      // May be stale if another thread pops `top` meanwhile; then the tag has
      // moved and the compare-and-swap below fails.
      const uint32_t under = next_[top - 1].load(std::memory_order_relaxed);
      if (head_.compare_exchange_weak(head, Pack(Tag(head) + 1, under),
                                      std::memory_order_acquire, std::memory_order_acquire)) {
        return top - 1;
      }
    }
  }

 private:
  static constexpr uint32_t kEmpty = 0;  // a link or head naming no index
  static uint64_t Pack(uint32_t tag, uint32_t top) { return uint64_t{tag} << 32 | top; }
  static uint32_t Tag(uint64_t head) { return static_cast<uint32_t>(head >> 32); }
  static uint32_t Top(uint64_t head) { return static_cast<uint32_t>(head); }

  const uint32_t capacity_;
  std::atomic<uint64_t> head_{Pack(0, kEmpty)};
  const std::unique_ptr<std::atomic<uint32_t>[]> next_;  // index + 1 of what lies under i
};

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_FREE_INDEX_STACK_H_
