// ShardedCounts<Counts>: process-wide counters that any thread adds to with a
// few plain instructions, summed on demand. The transports' counters
// (transport/rdma/counters.h, transport/tcp/tcp_counters.h) are made of it.
//
//   struct FrameCounts { uint64_t frames = 0; uint64_t bytes = 0; };
//   using Frames = rdmarpc::base::ShardedCounts<FrameCounts>;
//   constexpr Frames::NamedField kFrameFields[] = {{"frames", &FrameCounts::frames},
//                                                  {"bytes", &FrameCounts::bytes}};
//   static_assert(Frames::ListsEveryFieldOnce(kFrameFields));
//
//   Frames::Add(&FrameCounts::frames);          // on any thread
//   Frames::Add(&FrameCounts::bytes, 4096);
//   FrameCounts now = Frames::Sum(kFrameFields);
//
// Why sharded: counts come on whichever thread sends or receives (callers
// driving their own completions, pollers, I/O threads). One shared set of
// atomics would bounce its cache lines between all those cores on each
// message; so each thread counts in a shard of its own with plain (relaxed,
// unlocked) stores, and Sum adds the shards up. bench/counter_bench.cc
// measures the two side by side.
//
// What not to rely on:
// - Sum is a snapshot, not a fast path (it takes a lock and reads every
//   shard), and counts made on other threads at the same moment may be in it
//   or not; a count made before Sum on the same thread, or on a thread joined
//   or synchronized with since, is in it.
// - A shard outlives its thread and passes to a later thread with its counts
//   in it, so nothing an exited thread counted is lost, and the number of
//   shards is the most threads that ever counted at once. Counts made while a
//   thread exits, after its shard went back, go to one shared shard.
// - A field may serve as a gauge (added to, and taken from with Add(field,
//   -n), possibly on another thread): the shards add up modulo 2^64, so the
//   sum is right although one shard may wrap.
#ifndef RDMARPC_BASE_SHARDED_COUNTS_H_
#define RDMARPC_BASE_SHARDED_COUNTS_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace rdmarpc::base {

// Counts: a struct of uint64_t fields and nothing else, each listed once, by
// a name of its own, in the fields passed to Sum (ListsEveryFieldOnce checks
// it).
template <typename Counts>
class ShardedCounts {
  static_assert(std::is_trivially_copyable_v<Counts> && sizeof(Counts) % sizeof(uint64_t) == 0,
                "Counts must be a struct of uint64_t fields");

 public:
  using Field = uint64_t Counts::*;
  // A field and the name it is shown and exported by (its own, by custom).
  struct NamedField {
    const char* name;
    Field field;
  };

  // Adds n to one counter in the calling thread's shard: no lock, and no
  // read-modify-write shared with other threads (a shard has one writer).
  static void Add(Field field, uint64_t n = 1) {
    Counts* counts = tls_counts_;
    if (__builtin_expect(counts == nullptr, 0)) return AddSlow(field, n);
    uint64_t* v = &(counts->*field);
    __atomic_store_n(v, __atomic_load_n(v, __ATOMIC_RELAXED) + n, __ATOMIC_RELAXED);
  }

  // The sum over every thread's shard, now.
  template <size_t N>
  static Counts Sum(const NamedField (&fields)[N]) {
    Counts sum;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    const auto add = [&](const Shard& s) {
      for (const NamedField& f : fields) {
        sum.*f.field += __atomic_load_n(&(s.counts.*f.field), __ATOMIC_RELAXED);
      }
    };
    for (const Shard* s : r.shards) add(*s);
    add(r.late);
    return sum;
  }

  // Each of `fields` of `counts` under its name, in the order listed.
  template <size_t N>
  static std::vector<std::pair<std::string, uint64_t>> Named(const Counts& counts,
                                                             const NamedField (&fields)[N]) {
    std::vector<std::pair<std::string, uint64_t>> named;
    named.reserve(N);
    for (const NamedField& f : fields) named.emplace_back(f.name, counts.*f.field);
    return named;
  }

  // What was counted from `earlier` to `later`, two snapshots of Sum, field
  // by field. Only for counters that never go down: a gauge's difference
  // wraps when it fell.
  template <size_t N>
  static Counts Difference(const Counts& later, const Counts& earlier,
                           const NamedField (&fields)[N]) {
    Counts diff = later;
    for (const NamedField& f : fields) diff.*f.field -= earlier.*f.field;
    return diff;
  }

  // Whether `fields` lists every field of Counts exactly once, as Sum
  // needs, each under a name no other has.
  template <size_t N>
  static constexpr bool ListsEveryFieldOnce(const NamedField (&fields)[N]) {
    if (sizeof(Counts) != N * sizeof(uint64_t)) return false;
    for (size_t i = 0; i < N; ++i) {
      for (size_t j = i + 1; j < N; ++j) {
        if (fields[i].field == fields[j].field || SameName(fields[i].name, fields[j].name)) {
          return false;
        }
      }
    }
    return true;
  }

 private:
  static constexpr bool SameName(const char* a, const char* b) {
    for (; *a != '\0' && *a == *b; ++a, ++b) {
    }
    return *a == *b;
  }

  // One thread's counts. Its owner writes with relaxed atomic stores of its
  // own load plus n; Sum reads with relaxed loads. The registry's mutex
  // orders the hand-over from an exited thread to a later one.
  struct alignas(64) Shard {
    Counts counts;
    bool in_use = false;  // guarded by Registry::mu
  };
  struct Registry {
    std::mutex mu;
    std::vector<Shard*> shards;  // guarded by mu; never shrinks
    // Counts made by a thread while it exits, after its shard went back:
    // shared, so added to atomically.
    Shard late;
  };
  static Registry& registry() {
    static auto* r = new Registry;  // never destroyed: threads count until the process ends
    return *r;
  }

  // Gives the thread's shard back when the thread exits.
  struct ShardReturn {
    Shard* shard = nullptr;
    ~ShardReturn() {
      std::lock_guard<std::mutex> lock(registry().mu);
      if (shard != nullptr) shard->in_use = false;
      tls_counts_ = nullptr;
      tls_exited_ = true;
    }
  };

  __attribute__((noinline)) static void AddSlow(Field field, uint64_t n) {
    if (tls_exited_) {
      __atomic_fetch_add(&(registry().late.counts.*field), n, __ATOMIC_RELAXED);
      return;
    }
    tls_counts_ = &AcquireShard()->counts;
    Add(field, n);
  }

  static Shard* AcquireShard() {
    thread_local ShardReturn give_back_at_exit;
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    Shard* shard = nullptr;
    for (Shard* s : r.shards) {
      if (!s->in_use) {
        shard = s;
        break;
      }
    }
    if (shard == nullptr) shard = r.shards.emplace_back(new Shard);
    shard->in_use = true;
    give_back_at_exit.shard = shard;
    return shard;
  }

  // The calling thread's shard; null before its first count and after its
  // exit.
  static inline thread_local Counts* tls_counts_ = nullptr;
  static inline thread_local bool tls_exited_ = false;
};

}  // namespace rdmarpc::base

#endif  // RDMARPC_BASE_SHARDED_COUNTS_H_
