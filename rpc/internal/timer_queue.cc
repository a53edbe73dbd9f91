#include "rpc/internal/timer_queue.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "base/new_thread.h"
#include "base/steady_clock.h"

namespace rdmarpc::internal {

absl::StatusOr<std::unique_ptr<TimerQueue>> TimerQueue::Create(ThreadName name,
                                                               absl::string_view what) {
  std::unique_ptr<TimerQueue> queue(new TimerQueue());
  auto t = NewThread(name, what, [q = queue.get()] { q->Run(); });
  if (!t.ok()) return t.status();
  queue->thread_ = *std::move(t);
  return queue;
}

TimerQueue::~TimerQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t TimerQueue::Schedule(absl::Time when, absl::AnyInvocable<void() &&> fn,
                              const void* owner) {
  uint64_t id;
  bool earliest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    timers_.emplace(std::make_pair(when, id), Timer{std::move(fn), owner});
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

void TimerQueue::CancelAll(const void* owner) {
  std::unique_lock<std::mutex> lock(mu_);
  for (auto it = timers_.begin(); it != timers_.end();) {
    if (it->second.owner == owner) {
      when_.erase(it->first.second);
      it = timers_.erase(it);
    } else {
      ++it;
    }
  }
  if (std::this_thread::get_id() == thread_.get_id()) return;
  callback_done_.wait(lock, [&] { return !running_ || running_owner_ != owner; });
}

void TimerQueue::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (timers_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const absl::Time next = timers_.begin()->first.first;
    const absl::Time now = SteadyNow();
    if (next > now) {
      cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(next - now, kLongestSteadyWait)));
      continue;
    }
    auto node = timers_.extract(timers_.begin());
    when_.erase(node.key().second);
    running_ = true;
    running_owner_ = node.mapped().owner;
    absl::AnyInvocable<void() &&> fn = std::move(node.mapped().fn);
    lock.unlock();
    std::move(fn)();
    fn = nullptr;  // what it holds goes before CancelAll may return
    lock.lock();
    running_ = false;
    callback_done_.notify_all();
  }
}

}  // namespace rdmarpc::internal
