#include "rpc/internal/thread_pool.h"

#include <algorithm>

namespace rdmarpc::internal {

ThreadPool::ThreadPool(int threads) {
  threads = std::max(threads, 1);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

bool ThreadPool::Post(absl::AnyInvocable<void() &&> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
  return true;
}

void ThreadPool::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) {
      t.detach();  // stopping from a task: cannot join oneself
    } else if (t.joinable()) {
      t.join();
    }
  }
  threads_.clear();
}

bool ThreadPool::InPool() const {
  for (const auto& t : threads_)
    if (t.get_id() == std::this_thread::get_id()) return true;
  return false;
}

void ThreadPool::Run() {
  for (;;) {
    absl::AnyInvocable<void() &&> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace rdmarpc::internal
