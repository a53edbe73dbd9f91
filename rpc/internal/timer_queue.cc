#include "rpc/internal/timer_queue.h"

#include <chrono>

namespace rdmarpc::internal {

TimerQueue::TimerQueue() : thread_([this] { Run(); }) {}

TimerQueue::~TimerQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t TimerQueue::Schedule(absl::Time when, absl::AnyInvocable<void() &&> fn) {
  uint64_t id;
  bool earliest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    timers_.emplace(std::make_pair(when, id), std::move(fn));
    when_[id] = when;
    earliest = timers_.begin()->first.second == id;
  }
  if (earliest) cv_.notify_all();
  return id;
}

void TimerQueue::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = when_.find(id);
  if (it == when_.end()) return;
  timers_.erase({it->second, id});
  when_.erase(it);
}

void TimerQueue::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (timers_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const absl::Time next = timers_.begin()->first.first;
    const absl::Time now = absl::Now();
    if (next > now) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(next - now));
      continue;
    }
    auto node = timers_.extract(timers_.begin());
    when_.erase(node.key().second);
    lock.unlock();
    std::move(node.mapped())();
    lock.lock();
  }
}

}  // namespace rdmarpc::internal
