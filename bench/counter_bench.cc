// The transport's counters as threads count at once: per-thread shards
// (transport/rdma/counters.h) against one shared set of atomics, the design
// they replaced, side by side in one run. No RDMA device needed.
//
//   bazel run -c opt //bench:counter_bench [-- --threads=1,2,16 --messages=2000000]
//
// Each thread counts what the fast path counts per message (a SEND, inline,
// and a receive from the SRQ), so the figures are what counting adds to a
// message when that many threads send and receive at once.
//
// Output lines (machine-readable):
//   counters_<n>_threads_shared_ns_per_message <value>
//   counters_<n>_threads_sharded_ns_per_message <value>
//   counters_<n>_threads_shared_over_sharded <value>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/steady_clock.h"
#include "transport/rdma/counters.h"

ABSL_FLAG(std::string, threads, "", "thread counts to run, comma-separated (default: 1,2,cores)");
ABSL_FLAG(int, messages, 2000000, "messages counted per thread");

namespace {

using rdmarpc::transport::rdma::Count;
using rdmarpc::transport::rdma::RdmaCounters;

// The replaced design: one process-wide struct of atomics, so the hot
// counters share cache lines across all threads.
struct SharedCounters {
  std::atomic<uint64_t> sends{0};
  std::atomic<uint64_t> sends_inline{0};
  std::atomic<uint64_t> srq_slots_consumed{0};
};
SharedCounters g_shared;

// `threads` threads, started together, each count `messages`: the wall time
// over `messages` is what counting adds to each thread's message while the
// others count too.
template <typename CountOne>
double NsPerMessage(int threads, int messages, CountOne count_one) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < messages; ++i) count_one();
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const absl::Time start = rdmarpc::SteadyNow();
  go.store(true);
  for (auto& t : pool) t.join();
  return absl::ToDoubleNanoseconds(rdmarpc::SteadyNow() - start) / messages;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> counts;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_threads), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      fprintf(stderr, "--threads: '%s' is not a thread count\n", std::string(s).c_str());
      return 2;
    }
    counts.push_back(n);
  }
  if (counts.empty()) {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    counts = {1, 2};
    if (cores > 2) counts.push_back(cores);
  }
  const int messages = absl::GetFlag(FLAGS_messages);
  const RdmaCounters before = rdmarpc::transport::rdma::Counters();
  uint64_t messages_each_design_counted = 0;
  for (int n : counts) {
    const double shared = NsPerMessage(n, messages, [] {
      g_shared.sends.fetch_add(1);
      g_shared.sends_inline.fetch_add(1);
      g_shared.srq_slots_consumed.fetch_add(1);
    });
    const double sharded = NsPerMessage(n, messages, [] {
      Count(&RdmaCounters::sends);
      Count(&RdmaCounters::sends_inline);
      Count(&RdmaCounters::srq_slots_consumed);
    });
    messages_each_design_counted += uint64_t(n) * messages;
    printf("counters_%d_threads_shared_ns_per_message %.2f\n", n, shared);
    printf("counters_%d_threads_sharded_ns_per_message %.2f\n", n, sharded);
    printf("counters_%d_threads_shared_over_sharded %.2f\n", n, shared / sharded);
  }
  // Both must have counted every message; a figure from lost counts is no figure.
  const RdmaCounters after = rdmarpc::transport::rdma::Counters();
  if (after.sends - before.sends != messages_each_design_counted ||
      g_shared.sends.load() != messages_each_design_counted) {
    fprintf(stderr, "counts lost: sharded %llu, shared %llu, expected %llu\n",
            static_cast<unsigned long long>(after.sends - before.sends),
            static_cast<unsigned long long>(g_shared.sends.load()),
            static_cast<unsigned long long>(messages_each_design_counted));
    return 1;
  }
  return 0;
}
