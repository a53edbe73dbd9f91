// Stage marks: where the time of one round trip goes, stage by stage, taken
// inside the processes themselves (client start, post, the peer's poll,
// handler, ...).
//
// bench/stage_timeline.sh builds rpc_bench and pingpong_probe with
// RDMARPC_STAGE_TRACE defined, runs them in the Soft-RoCE VM and prints the
// median time from each mark of a round trip to the next. Without the define
// every macro below compiles to nothing: the fast path pays for none of it.
//
//   RDMARPC_STAGE(kPostBegin);            // a mark, wherever the stage is
//   RDMARPC_STAGE_RECORD(true);           // bench only: start or stop recording
//   RDMARPC_STAGE_DUMP("rpc_small");      // bench only: write and clear
//
// With the define, a mark is an atomic increment, a TSC read and a store into
// a fixed array; marks past the array's end are dropped. The dump goes to
// $RDMARPC_STAGE_DIR/<name>.stages (nowhere when unset): the stage names,
// ticks per microsecond measured against steady_clock over the recording,
// then one "stage ticks thread" line per mark. x86-64 only (rdtsc). The marks
// add a little to every stage, so compare stages within one build, not with
// the figures of an ordinary build.
#ifndef RDMARPC_BASE_STAGE_TRACE_H_
#define RDMARPC_BASE_STAGE_TRACE_H_

#include <cstdint>

namespace rdmarpc::stage_trace {

// In the order a small call meets them. A frame (rpc_bench --rpc=false) and
// the probe skip the runtime's stages.
#define RDMARPC_STAGES(X)                                                 \
  X(kRoundTripBegin, "round trip begins (bench)")                         \
  X(kCallStart, "Channel::Start")                                         \
  X(kCallSend, "request handed to the transport")                        \
  X(kSendEntry, "RdmaConnection::Send/SendWith")                          \
  X(kPostBegin, "ibv_post_send called")                                   \
  X(kPostEnd, "ibv_post_send returned")                                   \
  X(kRecvPolled, "a poll returned a receive")                             \
  X(kRecvDecode, "RdmaConnection::OnRecv")                                \
  X(kRecvDeliver, "message handed to the runtime")                        \
  X(kHandlerStart, "server call runs its handler")                        \
  X(kHandlerFinish, "handler calls Finish")                               \
  X(kResponseParsed, "response parsed, call completing")                  \
  X(kCallReturn, "Channel::Call returns")                                 \
  X(kRoundTripEnd, "round trip ends (bench)")                             \
  X(kPoll, "a poll of the completion queue (each one)")

enum Stage : uint8_t {
#define RDMARPC_STAGE_ENUM(name, text) name,
  RDMARPC_STAGES(RDMARPC_STAGE_ENUM)
#undef RDMARPC_STAGE_ENUM
};

}  // namespace rdmarpc::stage_trace

#ifndef RDMARPC_STAGE_TRACE

#define RDMARPC_STAGE(stage) ((void)0)
#define RDMARPC_STAGE_RECORD(on) ((void)0)
#define RDMARPC_STAGE_DUMP(name) ((void)0)

#else

#if !defined(__x86_64__)
#error "RDMARPC_STAGE_TRACE reads the TSC: x86-64 only"
#endif

#include <x86intrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace rdmarpc::stage_trace {

struct Mark {
  uint64_t ticks;
  uint32_t thread;
  uint8_t stage;
};

inline constexpr size_t kCapacity = size_t{1} << 21;
inline Mark g_marks[kCapacity];
inline std::atomic<size_t> g_count{0};
inline std::atomic<bool> g_recording{false};
inline std::atomic<uint32_t> g_threads{0};
inline uint64_t g_start_ticks = 0;
inline std::chrono::steady_clock::time_point g_start_time;

inline uint32_t ThreadNumber() {
  thread_local const uint32_t n = g_threads.fetch_add(1, std::memory_order_relaxed) + 1;
  return n;
}

inline void Record(Stage stage) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  const size_t i = g_count.fetch_add(1, std::memory_order_relaxed);
  if (i < kCapacity) g_marks[i] = Mark{__rdtsc(), ThreadNumber(), stage};
}

// Ticks per microsecond are measured from the first start after a dump.
inline void SetRecording(bool on) {
  if (on && g_start_ticks == 0) {
    g_start_time = std::chrono::steady_clock::now();
    g_start_ticks = __rdtsc();
  }
  g_recording.store(on, std::memory_order_relaxed);
}

inline void Dump(const std::string& name) {
  g_recording.store(false, std::memory_order_relaxed);
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() -
                                                              g_start_time)
                        .count();
  const uint64_t ticks = __rdtsc() - g_start_ticks;
  g_start_ticks = 0;
  const size_t n = std::min(g_count.exchange(0), kCapacity);
  const char* dir = getenv("RDMARPC_STAGE_DIR");
  if (dir == nullptr || us <= 0) return;
  FILE* f = fopen((std::string(dir) + "/" + name + ".stages").c_str(), "w");
  if (f == nullptr) return;
#define RDMARPC_STAGE_NAME(name, text) fprintf(f, "stage %d %s %s\n", name, #name, text);
  RDMARPC_STAGES(RDMARPC_STAGE_NAME)
#undef RDMARPC_STAGE_NAME
  fprintf(f, "ticks_per_us %.4f\ndropped %zu\n", ticks / us,
          g_count.load() > kCapacity ? g_count.load() - kCapacity : 0);
  for (size_t i = 0; i < n; ++i) {
    fprintf(f, "%u %llu %u\n", g_marks[i].stage, static_cast<unsigned long long>(g_marks[i].ticks),
            g_marks[i].thread);
  }
  fclose(f);
}

}  // namespace rdmarpc::stage_trace

#define RDMARPC_STAGE(stage) ::rdmarpc::stage_trace::Record(::rdmarpc::stage_trace::stage)
#define RDMARPC_STAGE_RECORD(on) ::rdmarpc::stage_trace::SetRecording(on)
#define RDMARPC_STAGE_DUMP(name) ::rdmarpc::stage_trace::Dump(name)

#endif  // RDMARPC_STAGE_TRACE

#endif  // RDMARPC_BASE_STAGE_TRACE_H_
