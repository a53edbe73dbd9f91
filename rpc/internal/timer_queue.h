// TimerQueue: one thread that runs callbacks at deadlines (call timeouts).
//
// Cancel() is O(log n), so calls that finish early leave nothing behind.
// Callbacks run on the timer thread and must be short (they only complete a
// call, which hands user code to a pool).
#ifndef RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_
#define RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace rdmarpc::internal {

class TimerQueue {
 public:
  TimerQueue();
  ~TimerQueue();

  // Returns an id for Cancel(); never 0.
  uint64_t Schedule(absl::Time when, absl::AnyInvocable<void() &&> fn);
  // Drops a timer that has not fired; a no-op otherwise.
  void Cancel(uint64_t id);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<absl::Time, uint64_t>, absl::AnyInvocable<void() &&>> timers_;
  std::unordered_map<uint64_t, absl::Time> when_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_
