#include "rpc/internal/thread_pool.h"

#include <algorithm>

#include "base/new_thread.h"

namespace rdmarpc::internal {

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(int threads, ThreadName name,
                                                               absl::string_view what) {
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  for (int i = 0; i < std::max(threads, 1); ++i) {
    auto t = NewThread(name, what, [queue = pool->queue_] { Run(queue); });
    if (!t.ok()) return t.status();  // the pool's destructor stops those started
    pool->threads_.push_back(*std::move(t));
  }
  return pool;
}

bool ThreadPool::Post(absl::AnyInvocable<void() &&> task) {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    if (queue_->stopping) return false;
    queue_->tasks.push_back(std::move(task));
  }
  queue_->cv.notify_one();
  return true;
}

void ThreadPool::Stop() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    if (queue_->stopping && threads_.empty()) return;
    queue_->stopping = true;
  }
  queue_->cv.notify_all();
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

void ThreadPool::Run(const std::shared_ptr<Queue>& queue) {
  for (;;) {
    absl::AnyInvocable<void() &&> task;
    {
      std::unique_lock<std::mutex> lock(queue->mu);
      queue->cv.wait(lock, [&] { return queue->stopping || !queue->tasks.empty(); });
      if (queue->tasks.empty()) return;
      task = std::move(queue->tasks.front());
      queue->tasks.pop_front();
    }
    std::move(task)();
  }
}

}  // namespace rdmarpc::internal
