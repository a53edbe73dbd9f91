#include "rpc/balanced_channel.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/steady_clock.h"
#include "rpc/internal/inline_scope.h"

namespace rdmarpc {
namespace {

Status NoAddress() {
  return absl::InvalidArgumentError("a BalancedChannel needs at least one address");
}

}  // namespace

StatusOr<std::shared_ptr<BalancedChannel>> BalancedChannel::Create(
    const std::vector<std::string>& addresses, ChannelOptions options, BalancingPolicy policy) {
  // Before the group, whose threads would be started for nothing.
  if (addresses.empty()) return NoAddress();
  auto group = ChannelGroup::Create(std::move(options));
  if (!group.ok()) return group.status();
  return Create(*group, addresses, policy);
}

StatusOr<std::shared_ptr<BalancedChannel>> BalancedChannel::Create(
    const std::shared_ptr<ChannelGroup>& group, const std::vector<std::string>& addresses,
    BalancingPolicy policy) {
  if (addresses.empty()) return NoAddress();
  std::vector<std::shared_ptr<Channel>> backends;
  backends.reserve(addresses.size());
  for (const std::string& address : addresses) {
    auto channel = group->NewChannel(address);
    if (!channel.ok()) {
      return Status(channel.status().code(),
                    absl::StrCat("BalancedChannel backend ", backends.size() + 1, " of ",
                                 addresses.size(), ": ", channel.status().message()));
    }
    backends.push_back(*std::move(channel));
  }
  std::shared_ptr<BalancedChannel> balanced(new BalancedChannel(std::move(backends), policy));
  // Connecting ahead, as gRPC's round_robin does: the first calls find
  // every server that is up READY, not just the first one asked. After the
  // backends know their BalancedChannel, which their connectors read.
  for (const auto& backend : balanced->backends()) backend->GetState(/*try_to_connect=*/true);
  return balanced;
}

BalancedChannel::BalancedChannel(std::vector<std::shared_ptr<Channel>> backends,
                                 BalancingPolicy policy)
    : backends_(std::move(backends)), policy_(policy) {
  link_->owner = this;
  for (const auto& backend : backends_) backend->balancer_ = link_;
}

BalancedChannel::~BalancedChannel() {
  // A retry being moved holds the link: it ends before the backends go.
  std::lock_guard<std::mutex> lock(link_->mu);
  link_->owner = nullptr;
}

Channel& BalancedChannel::Pick(bool take_turn) { return *PickFrom(take_turn, nullptr); }

Channel* BalancedChannel::PickForRetry(const Channel& failed) {
  return backends_.size() > 1 ? PickFrom(/*take_turn=*/true, &failed) : nullptr;
}

Channel* BalancedChannel::PickFrom(bool take_turn, const Channel* instead_of) {
  const size_t n = backends_.size();
  const uint64_t turn = take_turn ? next_.fetch_add(1, std::memory_order_relaxed)
                                  : next_.load(std::memory_order_relaxed);
  const size_t first = static_cast<size_t>(turn % n);
  Channel* ready = nullptr;
  size_t ready_at = 0;  // its distance from the turn
  size_t fewest_calls = 0;
  Channel* not_failed = nullptr;
  for (size_t i = 0; i < n; ++i) {
    Channel& backend = *backends_[(first + i) % n];
    if (&backend == instead_of) continue;
    // try_to_connect: a backend passed over gets its next attempt (after its
    // backoff) without waiting for a call of its own.
    const ChannelState state = backend.GetState(/*try_to_connect=*/true);
    if (state == ChannelState::kReady) {
      if (policy_ == BalancingPolicy::kRoundRobin) {
        ready = &backend;
        ready_at = i;
        break;
      }
      const size_t calls = backend.calls_in_flight();
      if (ready == nullptr || calls < fewest_calls) {
        ready = &backend;
        ready_at = i;
        fewest_calls = calls;
        if (calls == 0) break;  // none has fewer
      }
    } else if (not_failed == nullptr && state != ChannelState::kTransientFailure) {
      not_failed = &backend;
    }
  }
  if (ready != nullptr) {
    if (take_turn && ready_at > 0) next_.fetch_add(ready_at, std::memory_order_relaxed);
    return ready;
  }
  if (instead_of != nullptr) return nullptr;
  return not_failed != nullptr ? not_failed : backends_[first].get();
}

Status BalancedChannel::Call(const MethodInfo& method, ClientContext* ctx,
                             const google::protobuf::MessageLite& request,
                             google::protobuf::MessageLite* response) {
  return Pick(/*take_turn=*/true).Call(method, ctx, request, response);
}

void BalancedChannel::CallAsync(const MethodInfo& method, ClientContext* ctx,
                                const google::protobuf::MessageLite& request,
                                google::protobuf::MessageLite* response, CallCallback done) {
  Pick(/*take_turn=*/true).CallAsync(method, ctx, request, response, std::move(done));
}

ChannelState BalancedChannel::GetState(bool try_to_connect) {
  bool connecting = false;
  bool idle = false;
  bool ready = false;
  for (const auto& backend : backends_) {
    // Each is asked, READY found or not: with try_to_connect, every backend
    // that is not connected starts its attempt, as Create's do.
    switch (backend->GetState(try_to_connect)) {
      case ChannelState::kReady:
        ready = true;
        break;
      case ChannelState::kConnecting:
        connecting = true;
        break;
      case ChannelState::kIdle:
        idle = true;
        break;
      case ChannelState::kTransientFailure:
        break;
    }
  }
  if (ready) return ChannelState::kReady;
  if (connecting) return ChannelState::kConnecting;
  if (idle) return ChannelState::kIdle;
  return ChannelState::kTransientFailure;
}

bool BalancedChannel::WaitForStateChange(ChannelState last, absl::Time deadline) {
  const absl::Time until = FromWallClock(deadline);
  for (;;) {
    // Read before the states: a change after them bumps it, and the wait
    // below returns at once.
    const uint64_t seen = link_->StateChanges();
    if (GetState(/*try_to_connect=*/false) != last) return true;
    if (!link_->WaitForChangeAfter(seen, until)) {
      return GetState(/*try_to_connect=*/false) != last;
    }
  }
}

bool BalancedChannel::WaitForConnected(absl::Time deadline) {
  const absl::Time until = FromWallClock(deadline);
  // Their inline callbacks run on the threads of the group's transports,
  // which the backends' attempts may need.
  const bool inline_callback = std::any_of(
      backends_.begin(), backends_.end(),
      [](const auto& backend) { return internal::InlineScopeOf(backend.get()) != nullptr; });
  for (;;) {
    const uint64_t seen = link_->StateChanges();
    // Asked at each change, a backend whose attempt failed starts its next
    // once its backoff ends, as under Channel::WaitForConnected.
    if (GetState(/*try_to_connect=*/true) == ChannelState::kReady) return true;
    if (inline_callback) return false;
    if (!link_->WaitForChangeAfter(seen, until)) {
      return GetState(/*try_to_connect=*/false) == ChannelState::kReady;
    }
  }
}

StatusOr<Attachment> BalancedChannel::AllocateAttachment(size_t size, size_t message_room) {
  // The turn is left to the call that sends it, which in one thread's
  // calls goes to the same backend.
  return Pick(/*take_turn=*/false).AllocateAttachment(size, message_room);
}

}  // namespace rdmarpc
