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
#ifndef RDMARPC_RPC_INTERNAL_SPARE_POOL_H_
#define RDMARPC_RPC_INTERNAL_SPARE_POOL_H_

#include <cstddef>
#include <memory>
#include <mutex>

namespace rdmarpc::internal {

template <typename T, size_t kMaxSpare = 128>
class SparePool {
 public:
  static T* Take() {
    Spares& s = Get();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count > 0) return s.items[--s.count];
    }
    return new T;
  }

  static void Give(T* t) {
    Spares& s = Get();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.count < kMaxSpare) {
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
