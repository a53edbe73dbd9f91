// SparePool<T>: a process-wide, bounded stack of spare T objects, so that a
// steady stream of calls reuses the same few objects instead of going to the
// allocator for every call.
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
// most kMaxSpare objects are, the rest are deleted). A caller that gives back
// objects holding much memory pins it: decide before Give() whether an object
// is worth keeping. Spare objects live until the process exits (the pool is a
// never-destroyed static, as a call may still finish on some thread while
// statics are being torn down).
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

 public:
  static T* Take() {
    Spares& s = Get();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count > 0) {
        T* t = s.items[--s.count];
        if (kPoisonSpares) RDMARPC_SPARE_UNPOISON(t, sizeof(T));
        return t;
      }
    }
    return new T;
  }

  static void Give(T* t) {
    Spares& s = Get();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count < kMaxSpare) {
        if (kPoisonSpares) RDMARPC_SPARE_POISON(t, sizeof(T));
        s.items[s.count++] = t;
        return;
      }
    }
    delete t;
  }

 private:
  struct Spares {
    std::mutex mu;
    size_t count = 0;
    T* items[kMaxSpare];
  };
  static Spares& Get() {
    static Spares* spares = new Spares;
    return *spares;
  }
};

// Raw storage for one object of the given size and alignment.
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
