// TimerQueue: one thread that runs callbacks at deadlines (call timeouts).
//
// Cancel() is O(log n), so calls that finish early leave nothing behind.
// Callbacks run on the timer thread and must be short (they only complete a
// call, which hands user code to a pool). One queue may serve several owners
// (the channels of a ChannelGroup): CancelAll(owner) is how an owner that
// goes away makes sure none of its callbacks runs after it. Create fails
// where the process may start no more threads (base/new_thread.h).
#ifndef RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_
#define RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/new_thread.h"

namespace rdmarpc::internal {

class TimerQueue {
 public:
  // The queue and its thread named `name`, which runs `what`'s timers ("the
  // timers of channel x"), named in the error when it cannot be started.
  static absl::StatusOr<std::unique_ptr<TimerQueue>> Create(ThreadName name,
                                                            absl::string_view what);
  ~TimerQueue();

  // Runs `fn` once SteadyNow() reaches `when` (base/steady_clock.h). Returns
  // an id for Cancel(); never 0. `owner` tags the timer for CancelAll.
  uint64_t Schedule(absl::Time when, absl::AnyInvocable<void() &&> fn, const void* owner = nullptr);
  // Drops a timer that has not fired; a no-op otherwise.
  void Cancel(uint64_t id);
  // Drops every timer of `owner` and, unless called from a callback (on the
  // timer thread), waits for one of its callbacks that is running: after it
  // returns, no callback of `owner` runs. O(timers): for an owner's end.
  void CancelAll(const void* owner);

 private:
  TimerQueue() = default;
  void Run();

  struct Timer {
    absl::AnyInvocable<void() &&> fn;
    const void* owner;
  };

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable callback_done_;  // running_owner_ changed
  std::map<std::pair<absl::Time, uint64_t>, Timer> timers_;
  std::unordered_map<uint64_t, absl::Time> when_;
  uint64_t next_id_ = 1;
  bool running_ = false;                 // a callback runs (outside mu_)
  const void* running_owner_ = nullptr;  // its owner
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_TIMER_QUEUE_H_
