// SignalStorm: for tests, signals every other thread of the process again
// and again, through a handler installed without SA_RESTART, so that a
// blocking system call in the code under test fails with EINTR as it does
// in a program that takes signals (a profiler's SIGPROF, a timer's
// SIGALRM, a runtime's preemption signal). Code that treats EINTR as an
// error fails under it; code that retries does not notice.
//
//   {
//     SignalStorm storm(absl::Milliseconds(1));
//     ... connect, call, shut down ...
//     EXPECT_GT(storm.delivered(), 1000u);
//   }
//
// What not to rely on: which call a signal interrupts is chance, so a pass
// says little about one rare path; run a path often enough under the storm
// for its blocking calls to be hit. Signals go to the threads that exist at
// each refresh of the list (every few rounds). One storm at a time per
// process: it owns the signal's handler while it lives.
#ifndef RDMARPC_BASE_SIGNAL_STORM_H_
#define RDMARPC_BASE_SIGNAL_STORM_H_

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/threads_of_process.h"

namespace rdmarpc {

class SignalStorm {
 public:
  explicit SignalStorm(absl::Duration period, int signo = SIGUSR1)
      : signo_(signo), before_(Delivered().load()) {
    struct sigaction sa {};
    sa.sa_handler = &SignalStorm::Count;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: interrupted calls fail with EINTR
    sigaction(signo_, &sa, &old_);
    sender_ = std::thread([this, period] { Send(period); });
  }

  SignalStorm(const SignalStorm&) = delete;
  SignalStorm& operator=(const SignalStorm&) = delete;

  ~SignalStorm() { Stop(); }

  // Ends the storm early: no signal is sent after it returns, and the
  // counts below are final. The destructor calls it too.
  void Stop() {
    if (stop_.exchange(true)) return;
    sender_.join();
    // SIG_IGN first discards signals still pending on some thread, which the
    // old disposition (often SIG_DFL: terminate) must never see.
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(signo_, &ignore, nullptr);
    sigaction(signo_, &old_, nullptr);
  }

  // Runs of the handler since this storm began, in every thread.
  uint64_t delivered() const { return Delivered().load(std::memory_order_relaxed) - before_; }
  // Distinct threads that were sent at least one signal.
  size_t threads_signalled() const { return signalled_count_.load(std::memory_order_relaxed); }

 private:
  static std::atomic<uint64_t>& Delivered() {
    static std::atomic<uint64_t> n{0};
    return n;
  }
  static void Count(int) { Delivered().fetch_add(1, std::memory_order_relaxed); }

  void Send(absl::Duration period) {
    const pid_t pid = getpid();
    const pid_t self = static_cast<pid_t>(syscall(SYS_gettid));
    std::set<pid_t> signalled;
    std::vector<pid_t> tids;
    for (int round = 0; !stop_.load(); ++round) {
      // Listing /proc costs more than a round's signals: every 8th round.
      if (round % 8 == 0) tids = ThreadIdsOfThisProcess();
      for (pid_t tid : tids) {
        if (tid == self) continue;
        // ESRCH: the thread ended since the list was read.
        if (syscall(SYS_tgkill, pid, tid, signo_) == 0 && signalled.insert(tid).second) {
          signalled_count_.store(signalled.size(), std::memory_order_relaxed);
        }
      }
      absl::SleepFor(period);
    }
  }

  const int signo_;
  const uint64_t before_;
  struct sigaction old_ {};
  std::atomic<bool> stop_{false};
  std::atomic<size_t> signalled_count_{0};
  std::thread sender_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_SIGNAL_STORM_H_
