#include "rpc/internal/own_thread.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace rdmarpc::internal {
namespace {

class Joiner {
 public:
  // At exit: joins every thread, also those started while it joins.
  ~Joiner() {
    for (;;) {
      std::vector<Started> all;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (started_.empty()) {
          closed_ = true;
          return;
        }
        all.swap(started_);
      }
      for (Started& s : all) s.thread.join();
    }
  }

  void Start(absl::AnyInvocable<void() &&> work) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::thread thread([work = std::move(work), done]() mutable {
      std::move(work)();
      done->store(true, std::memory_order_release);
    });
    std::vector<Started> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) {
        thread.detach();
        return;
      }
      // Those that have ended are joined here (at once), so that the list
      // holds only what runs.
      auto running = std::partition(started_.begin(), started_.end(), [](const Started& s) {
        return !s.done->load(std::memory_order_acquire);
      });
      finished.assign(std::make_move_iterator(running), std::make_move_iterator(started_.end()));
      started_.erase(running, started_.end());
      started_.push_back(Started{std::move(thread), std::move(done)});
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
  bool closed_ = false;           // guarded by mu_: the exit has joined
};

}  // namespace

void RunOnOwnThread(absl::AnyInvocable<void() &&> work) {
  static Joiner joiner;
  joiner.Start(std::move(work));
}

}  // namespace rdmarpc::internal
