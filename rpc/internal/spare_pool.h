// SparePool<T>: bounded stacks of spare T objects, one per thread (no lock)
// in front of a process-wide one, so that a steady stream of calls reuses the
// same few objects instead of going to the allocator for every call.
//
//   T* t = SparePool<T>::Take();   // a spare one, or a new one
//   ...
//   SparePool<T>::Give(t);         // kept for the next Take, or deleted
//
// Why: a served call needs a call object and a request/response pair; with
// them pooled the small-call path makes no heap allocation in steady state
// (tests/rdma_fast_path_test.cc counts). Pooled protobuf messages also keep
// the capacity of their strings and repeated fields, so parsing into them
// stops allocating too.
//
// What not to rely on: which object Take() returns, or what state it is in
// beyond what the caller restored before Give(); that anything is kept (at
// most min(kMaxSpare, 16) per thread and kMaxSpare shared are, the rest are
// deleted); that an object given on one thread is soon taken on another (it
// stays in the giver's stack until that overflows or the thread exits). A
// caller that gives back objects holding much memory pins it: decide before
// Give() whether an object is worth keeping. Spare objects live until the
// process exits (the shared stack is a never-destroyed static, as a call may
// still finish on some thread while statics are being torn down).
//
// SpareAllocator<T> puts the same pooling under std::allocate_shared, for
// objects that are shared_ptr-owned.
//
// Under AddressSanitizer the spare storage of SpareAllocator is poisoned
// while it waits in the pool, so a use of a freed shared object is still
// reported. Pooled objects that own memory (a protobuf message) are not
// poisoned: LeakSanitizer does not look for pointers in poisoned memory and
// would report what they own as leaked.
#ifndef RDMARPC_RPC_INTERNAL_SPARE_POOL_H_
#define RDMARPC_RPC_INTERNAL_SPARE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define RDMARPC_SPARE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define RDMARPC_SPARE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define RDMARPC_SPARE_POISON(p, n) ((void)(p), (void)(n))
#define RDMARPC_SPARE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace rdmarpc::internal {

template <typename T, size_t kMaxSpare = 128>
class SparePool {
  // Raw storage owns nothing, so it can be poisoned while spare.
  static constexpr bool kPoisonSpares = std::is_trivially_destructible_v<T>;
  static constexpr size_t kLocalSpare = kMaxSpare < 16 ? kMaxSpare : 16;

 public:
  static T* Take() {
    if (Local* local = Mine(); local != nullptr && local->count > 0) {
      return Unpoisoned(local->items[--local->count]);
    }
    Shared& s = GetShared();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count > 0) return Unpoisoned(s.items[--s.count]);
    }
    return new T;
  }

  static void Give(T* t) {
    if (Local* local = Mine(); local != nullptr && local->count < kLocalSpare) {
      local->items[local->count++] = Poisoned(t);
      return;
    }
    GiveShared(t);
  }

 private:
  // This thread's own spares, taken and given without a lock: with inline
  // handlers a call's objects come back to the thread that took them. Its
  // destructor, at thread exit, hands what it holds to the shared stack.
  struct Local {
    explicit Local(uint8_t* state) : state(state) { *state = kLive; }
    ~Local() {
      *state = kGone;
      while (count > 0) GiveShared(Unpoisoned(items[--count]));
    }
    uint8_t* const state;
    size_t count = 0;
    T* items[kLocalSpare];
  };
  enum : uint8_t { kUnused, kLive, kGone };

  // Null once this thread's Local is destroyed: a call may still finish on a
  // thread that is exiting, after its thread_locals with destructors ran.
  static Local* Mine() {
    static thread_local uint8_t state = kUnused;  // trivially destructible: readable until the end
    if (state == kGone) return nullptr;
    static thread_local Local local(&state);
    return &local;
  }

  struct Shared {
    std::mutex mu;
    size_t count = 0;
    T* items[kMaxSpare];
  };
  static Shared& GetShared() {
    static Shared* shared = new Shared;
    return *shared;
  }
  static void GiveShared(T* t) {
    Shared& s = GetShared();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count < kMaxSpare) {
        s.items[s.count++] = Poisoned(t);
        return;
      }
    }
    delete t;
  }

  static T* Poisoned(T* t) {
    if (kPoisonSpares) RDMARPC_SPARE_POISON(t, sizeof(T));
    return t;
  }
  static T* Unpoisoned(T* t) {
    if (kPoisonSpares) RDMARPC_SPARE_UNPOISON(t, sizeof(T));
    return t;
  }
};

template <size_t kSize, size_t kAlign>
struct SpareStorage {
  alignas(kAlign) unsigned char bytes[kSize];
};

template <typename T>
class SpareAllocator {
 public:
  using value_type = T;

  SpareAllocator() = default;
  template <typename U>
  SpareAllocator(const SpareAllocator<U>&) noexcept {}  // NOLINT: rebinding must be implicit

  T* allocate(size_t n) {
    if (n != 1) return std::allocator<T>().allocate(n);
    return reinterpret_cast<T*>(SparePool<Storage>::Take());
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n != 1) return std::allocator<T>().deallocate(p, n);
    SparePool<Storage>::Give(reinterpret_cast<Storage*>(p));
  }

  friend bool operator==(const SpareAllocator&, const SpareAllocator&) { return true; }
  friend bool operator!=(const SpareAllocator&, const SpareAllocator&) { return false; }

 private:
  using Storage = SpareStorage<sizeof(T), alignof(T)>;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_SPARE_POOL_H_
