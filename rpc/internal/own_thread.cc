#include "rpc/internal/own_thread.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/new_thread.h"

namespace rdmarpc::internal {
namespace {

using Work = absl::AnyInvocable<void() &&>;

class Joiner {
 public:
  // At exit: joins every thread, also those started while it joins.
  ~Joiner() {
    for (;;) {
      std::vector<Started> all;
      std::vector<Work> deferred;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (started_.empty() && deferred_.empty()) {
          closed_ = true;
          return;
        }
        all.swap(started_);
        deferred.swap(deferred_);
      }
      for (Started& s : all) s.thread.join();
      for (Work& work : deferred) std::move(work)();
    }
  }

  void Start(Work work) {
    std::vector<Work> batch;
    {
      // Work that found no thread goes first, on this one.
      std::lock_guard<std::mutex> lock(mu_);
      batch.swap(deferred_);
    }
    batch.push_back(std::move(work));
    // Shared, so that a thread that cannot start leaves the work here.
    auto shared = std::make_shared<std::vector<Work>>(std::move(batch));
    auto done = std::make_shared<std::atomic<bool>>(false);
    auto thread = NewThread(
        "rpc-own-thread",
        "work that cannot run where it was started (a channel dropped in its own callback)",
        [shared, done] {
          for (Work& w : *shared) std::move(w)();
          done->store(true, std::memory_order_release);
        });
    std::vector<Started> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!thread.ok()) {
        fprintf(stderr, "rdmarpc: %s; it runs with the next that gets one, or at exit\n",
                std::string(thread.status().message()).c_str());
        for (Work& w : *shared) deferred_.push_back(std::move(w));
        return;
      }
      if (closed_) {
        thread->detach();
        return;
      }
      // Those that have ended are joined here (at once), so that the list
      // holds only what runs.
      auto running = std::partition(started_.begin(), started_.end(), [](const Started& s) {
        return !s.done->load(std::memory_order_acquire);
      });
      finished.assign(std::make_move_iterator(running), std::make_move_iterator(started_.end()));
      started_.erase(running, started_.end());
      started_.push_back(Started{*std::move(thread), std::move(done)});
    }
    for (Started& s : finished) s.thread.join();
  }

 private:
  struct Started {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex mu_;
  std::vector<Started> started_;  // guarded by mu_
  std::vector<Work> deferred_;    // guarded by mu_: found no thread
  bool closed_ = false;           // guarded by mu_: the exit has joined
};

}  // namespace

void RunOnOwnThread(absl::AnyInvocable<void() &&> work) {
  static Joiner joiner;
  joiner.Start(std::move(work));
}

}  // namespace rdmarpc::internal
