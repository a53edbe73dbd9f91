// Endpoint's flow control: its receive slots shared among its connections
// as credit windows (ShareReceiveBudget, StrictCreditWindow), the
// connections waiting for credits or for room for their responses, and the
// strict_credits refusal. Queues, memory and the poller are in endpoint.cc.
#include <stdio.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rdma_connection.h"

namespace rdmarpc::transport::rdma {

void Endpoint::PublishCommitted() {
  // One store for both, so that StrictWindow never sees a connection's
  // window gone and its kCredit slots still there (or the reverse): a grant
  // that depended on when it looked would be a flaky one.
  const size_t slots = granted_credits_ + kCreditFramesPerWindow * by_qp_.size();
  committed_.store(Committed{static_cast<uint32_t>(std::min<size_t>(slots, UINT32_MAX)),
                             static_cast<uint32_t>(by_qp_.size())},
                   std::memory_order_relaxed);
  credit_share_ =
      ShareReceiveBudget(ConfiguredWindow(), target_, StrictUnpostedSlots(), by_qp_.size());
}

uint32_t Endpoint::ConfiguredWindow() const {
  return static_cast<uint32_t>(
      std::max<size_t>(1, std::min<size_t>(options_.credits, target_ / 2)));
}

uint32_t Endpoint::JoiningWindow() const {
  if (!shares_credits_) return ConfiguredWindow();
  const uint32_t joined = committed_.load(std::memory_order_relaxed).connections + 1;
  return ShareReceiveBudget(ConfiguredWindow(), target_, StrictUnpostedSlots(), joined).window;
}

void Endpoint::WaitForCredits(std::weak_ptr<RdmaConnection> conn, int64_t short_by) {
  credit_waiters_.emplace_back(std::move(conn), short_by);
  waiters_short_ += short_by;
  // The room may be held by peers over windows that shrank since, idle ones
  // too: ask them, once the caller has let go of its connection's lock.
  QueueReshare();
}

void Endpoint::QueueReshare() {
  if (reshare_queued_) return;
  reshare_queued_ = true;
  RunOnPoller([this] {
    reshare_queued_ = false;
    Reshare();
  });
}

void Endpoint::ServeCreditWaiters() {
  // Each waiter tops up what the room allows and, if still short, waits
  // again at the back: the round ends when the room does.
  for (size_t n = credit_waiters_.size(); n > 0 && FreeCredits() > 0; --n) {
    auto [waiter, short_by] = std::move(credit_waiters_.front());
    credit_waiters_.pop_front();
    waiters_short_ -= short_by;
    if (std::shared_ptr<RdmaConnection> conn = waiter.lock()) conn->TopUpCredits();
  }
}

void Endpoint::OnEstablished() {
  if (shares_credits_) Reshare();
}

void Endpoint::Reshare() {
  // Largest excess first: the fewest kShrink frames, each taking a slot at
  // a peer whose SRQ may be shared by many of our connections.
  std::vector<std::pair<int64_t, RdmaConnection*>> over;
  int64_t coming_back = 0;
  for (const auto& [qp_num, conn] : by_qp_) {
    coming_back += conn->credits_asked_back();
    if (const int64_t excess = conn->CreditsOverWindow(); excess > 0) {
      over.emplace_back(excess, conn.get());
    }
  }
  int64_t need =
      credits_out_ + waiters_short_ - static_cast<int64_t>(credit_share_.budget) - coming_back;
  std::sort(over.begin(), over.end(), std::greater<>());
  for (const auto& [excess, conn] : over) {
    if (need <= 0) break;
    const int64_t asked = std::min(excess, need);
    conn->AskForCreditsBack(static_cast<uint32_t>(asked));
    need -= asked;
  }
}

size_t Endpoint::StrictUnpostedSlots() const { return target_ + 1 - refill_below_; }

uint32_t Endpoint::StrictWindow(uint32_t wanted) const {
  return StrictCreditWindow(wanted, target_, StrictUnpostedSlots(),
                            committed_.load(std::memory_order_relaxed).slots);
}

std::string Endpoint::DescribeStrictRefusal() const {
  // Short enough for a REJ's private data (kMaxRefusalBytes), where a
  // client reads it.
  const Committed committed = committed_.load(std::memory_order_relaxed);
  return absl::StrCat("strict_credits: no receive slots left to grant (", committed.connections,
                      " connections hold ", committed.slots, " of ", target_, ", ",
                      StrictUnpostedSlots(), " cover refills); raise ", receive_slots_option_);
}

size_t Endpoint::ResponseRoomLimit() const {
  return ShareReceiveBudget(1, target_, StrictUnpostedSlots(), committed_.load().connections)
      .budget;
}

bool Endpoint::TakeResponseRoom() {
  const size_t limit = ResponseRoomLimit();
  size_t awaited = responses_awaited_.load();
  while (awaited < limit) {
    if (responses_awaited_.compare_exchange_weak(awaited, awaited + 1)) return true;
  }
  return false;
}

void Endpoint::SayRoomRanOut() {
  if (told_room_ran_out_.exchange(true)) return;
  fprintf(stderr,
          "rdmarpc[%s]: %s: %zu calls in flight fill the room for responses in %zu receive "
          "slots (a posted slot for each response, so that none meets an empty SRQ); further "
          "calls wait to be sent until responses come back (credit_stalls in the counters). A "
          "call parked on its server (a long poll) holds its room until it ends. If more calls "
          "must run at once, raise RdmaOptions::client_receive_slots. Said once.\n",
          owner_.c_str(), device_name_.c_str(), ResponseRoomLimit(), target_);
}

void Endpoint::ReturnResponseRoom(uint32_t n) {
  if (n == 0) return;
  responses_awaited_.fetch_sub(n);
  // Seen after the room is back, or the waiter's second try sees the room.
  if (has_room_waiters_.load()) RunOnPoller([this] { WakeRoomWaiters(); });
}

void Endpoint::WaitForResponseRoom(std::weak_ptr<RdmaConnection> conn) {
  std::lock_guard<std::mutex> lock(room_waiters_mu_);
  room_waiters_.push_back(std::move(conn));
  has_room_waiters_.store(true);
}

void Endpoint::WakeRoomWaiters() {
  std::vector<std::weak_ptr<RdmaConnection>> waiters;
  {
    std::lock_guard<std::mutex> lock(room_waiters_mu_);
    waiters.swap(room_waiters_);
    has_room_waiters_.store(false);
  }
  // One that still finds no room registers again.
  for (const auto& weak : waiters) {
    if (auto conn = weak.lock()) conn->RetryBacklog();
  }
}

}  // namespace rdmarpc::transport::rdma
