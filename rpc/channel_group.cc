#include "rpc/channel_group.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/factory.h"

namespace rdmarpc {

StatusOr<std::shared_ptr<ChannelGroup>> ChannelGroup::Create(ChannelOptions options) {
  if (Status s = Channel::CheckOptions(options); !s.ok()) return s;
  std::shared_ptr<internal::ThreadPool> callbacks;
  if (options.callback_threads > 0) {
    auto made = internal::ThreadPool::Create(options.callback_threads, "rpc-callback",
                                             "the callbacks of a channel group");
    if (!made.ok()) return made.status();
    callbacks = *std::move(made);
  }
  auto timers = internal::TimerQueue::Create("rpc-timer", "the timers of a channel group");
  if (!timers.ok()) return timers.status();
  return std::shared_ptr<ChannelGroup>(
      new ChannelGroup(std::move(options), std::move(callbacks), *std::move(timers)));
}

ChannelGroup::ChannelGroup(ChannelOptions options, std::shared_ptr<internal::ThreadPool> callbacks,
                           std::shared_ptr<internal::TimerQueue> timers)
    : options_(std::move(options)), callbacks_(std::move(callbacks)), timers_(std::move(timers)) {}

StatusOr<std::shared_ptr<Channel>> ChannelGroup::NewChannel(const std::string& address) {
  auto addr = transport::ParseAddress(address);
  if (!addr.ok()) return addr.status();
  Channel::Resources shared;
  shared.callbacks = callbacks_;
  shared.timers = timers_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto kind = kinds_.find(addr->scheme);
    if (kind == kinds_.end()) {
      auto resolved = transport::ResolveScheme(addr->scheme, "channel group", options_.transport);
      if (!resolved.ok()) return resolved.status();
      kind = kinds_.emplace(addr->scheme, *std::move(resolved)).first;
    }
    std::shared_ptr<transport::Transport>& t = transports_[kind->second];
    if (!t) {
      auto made = Channel::MakeTransport(options_, kind->second,
                                         absl::StrCat("channel group (", kind->second, ")"));
      if (!made.ok()) {
        transports_.erase(kind->second);
        return made.status();
      }
      t = std::move(*made);
    }
    shared.transport = t;
  }
  return Channel::Own(
      new Channel(address, *std::move(addr), options_, std::move(shared), /*grouped=*/true));
}

}  // namespace rdmarpc
