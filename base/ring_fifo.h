// RingFifo<T>: a first-in-first-out queue in one ring of slots that doubles
// when full and never shrinks.
//
//   RingFifo<Task> q;
//   q.push_back(std::move(task));
//   Task next = std::move(q.front());
//   q.pop_front();
//
// Why: std::deque allocates a block whenever its end crosses a block
// boundary and frees one whenever its front does, so a queue that stays
// short but moves all the time (the worker queue, the posted-SEND list) pays
// an allocation every few dozen elements forever. This ring allocates only
// while it grows to the longest the queue has been.
//
// What not to rely on: capacity ever going down; references staying valid
// across push_back (growth moves the elements). pop_front() assigns T{} to the
// vacated slot so that whatever it held (a callback's captures) is released
// then, not when the slot is next written. T must be default constructible
// and move assignable.
#ifndef RDMARPC_BASE_RING_FIFO_H_
#define RDMARPC_BASE_RING_FIFO_H_

#include <cassert>
#include <cstddef>
#include <utility>
#include <vector>

namespace rdmarpc {

template <typename T>
class RingFifo {
 public:
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }

  T& front() {
    assert(size_ > 0);
    return slots_[head_];
  }
  const T& front() const {
    assert(size_ > 0);
    return slots_[head_];
  }

  void push_back(T value) {
    if (size_ == slots_.size()) Grow();
    slots_[(head_ + size_) & (slots_.size() - 1)] = std::move(value);
    ++size_;
  }

  // Appends an element for the caller to fill in place, without a temporary
  // to move in: a default-constructed one, or one that pop_front reset to T{}.
  T& emplace_back() {
    if (size_ == slots_.size()) Grow();
    return slots_[(head_ + size_++) & (slots_.size() - 1)];
  }

  void pop_front() {
    assert(size_ > 0);
    slots_[head_] = T{};
    head_ = (head_ + 1) & (slots_.size() - 1);
    --size_;
  }

  void clear() {
    while (!empty()) pop_front();
  }

  void swap(RingFifo& other) noexcept {
    slots_.swap(other.slots_);
    std::swap(head_, other.head_);
    std::swap(size_, other.size_);
  }

 private:
  static constexpr size_t kFirstCapacity = 16;
  static_assert((kFirstCapacity & (kFirstCapacity - 1)) == 0, "capacity is a power of two");

  void Grow() {
    std::vector<T> bigger(slots_.empty() ? kFirstCapacity : 2 * slots_.size());
    for (size_t i = 0; i < size_; ++i) {
      bigger[i] = std::move(slots_[(head_ + i) & (slots_.size() - 1)]);
    }
    slots_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;  // size is zero or a power of two
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_RING_FIFO_H_
