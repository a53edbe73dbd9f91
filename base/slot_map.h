// SlotMap<T>: values kept in a growing array of slots, each known by an id
// that this map hands out and that no later value reuses.
//
//   SlotMap<Pending> calls;
//   uint64_t id = calls.Insert(std::move(p));
//   Pending done;
//   if (calls.Take(id, &done)) ...   // false: taken already, or never here
//
// Why: a client's pending calls are looked up by call id when a response,
// a timer or a cancel comes, and every call inserts and takes one. A hash
// map pays a hash and a probe each time (~120 instructions a call, counted
// by callgrind); here the id names its slot, so a lookup is an index and a
// compare.
//
// How: an id is (generation << 32 | slot + 1). A slot's generation goes up
// each time it is freed, so an id taken once never matches again: a late
// response or timer for a call that ended finds nothing, even when a new
// call sits in the same slot. Ids are never 0. Freed slots are reused last
// in, first out, which keeps the ones in use few and warm.
//
// What not to rely on: the ids' order or values beyond "nonzero, unique
// for 2^32 reuses of one slot"; the order of ForEach. Memory is the most
// values ever held at once; it does not shrink. A taken value's slot keeps
// what the move left behind until the slot is reused (for the standard
// types, nothing: resetting it cost a construction and a second move per
// call). Not thread-safe: the owner locks around it.
#ifndef RDMARPC_BASE_SLOT_MAP_H_
#define RDMARPC_BASE_SLOT_MAP_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace rdmarpc {

template <typename T>
class SlotMap {
 public:
  // Stores `value`; returns its id.
  uint64_t Insert(T&& value) {
    uint32_t index;
    if (free_.empty()) {
      index = static_cast<uint32_t>(slots_.size());
      slots_.emplace_back();
    } else {
      index = free_.back();
      free_.pop_back();
    }
    Slot& s = slots_[index];
    s.value = std::move(value);
    s.used = true;
    ++size_;
    return IdOf(s.generation, index);
  }

  // Moves the value with `id` out to `*out` and frees its slot. False when
  // no value has that id (taken already, or never inserted).
  bool Take(uint64_t id, T* out) {
    Slot* s = Find(id);
    if (s == nullptr) return false;
    *out = std::move(s->value);
    Free(s, static_cast<uint32_t>(id) - 1);
    return true;
  }

  // The value with `id`, or null.
  T* Get(uint64_t id) {
    Slot* s = Find(id);
    return s == nullptr ? nullptr : &s->value;
  }

  // Calls fn(id, value&) for each value held.
  template <typename Fn>
  void ForEach(Fn fn) {
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].used) fn(IdOf(slots_[i].generation, i), slots_[i].value);
    }
  }

  size_t size() const { return size_; }

 private:
  struct Slot {
    T value{};
    uint32_t generation = 0;
    bool used = false;
  };

  static uint64_t IdOf(uint32_t generation, uint32_t index) {
    return uint64_t{generation} << 32 | (uint64_t{index} + 1);
  }
  Slot* Find(uint64_t id) {
    const uint32_t low = static_cast<uint32_t>(id);
    if (low == 0 || low > slots_.size()) return nullptr;
    Slot& s = slots_[low - 1];
    if (!s.used || s.generation != static_cast<uint32_t>(id >> 32)) return nullptr;
    return &s;
  }
  void Free(Slot* s, uint32_t index) {
    s->used = false;
    ++s->generation;
    --size_;
    free_.push_back(index);
  }

  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  size_t size_ = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_SLOT_MAP_H_
