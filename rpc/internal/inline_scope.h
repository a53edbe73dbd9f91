// InlineScope: the inline callbacks (ChannelOptions::callback_threads = 0)
// running on this thread, innermost first. A callback that ends a call of
// its own channel on its own thread (a call it starts fails at once) finds
// its scope here and queues that call's callback on it, to run after its own
// has returned: inline, a retry loop would otherwise nest one frame deeper
// per retry. A thread in a scope of a channel never waits for that
// channel's connection: the thread it would wait for may be its own.
#ifndef RDMARPC_RPC_INTERNAL_INLINE_SCOPE_H_
#define RDMARPC_RPC_INTERNAL_INLINE_SCOPE_H_

#include <utility>

#include "absl/functional/any_invocable.h"
#include "base/ring_fifo.h"

namespace rdmarpc {

class Channel;

namespace internal {

struct InlineScope {
  const Channel* channel;
  InlineScope* outer;
  RingFifo<absl::AnyInvocable<void() &&>> deferred;
};
// Defined in rpc/channel.cc.
extern thread_local InlineScope* inline_scopes;

inline InlineScope* InlineScopeOf(const Channel* channel) {
  for (InlineScope* s = inline_scopes; s != nullptr; s = s->outer) {
    if (s->channel == channel) return s;
  }
  return nullptr;
}

// Runs what callbacks of `scope` deferred, in order, then leaves it. Touches
// nothing of the channel, which one of them may destroy.
inline void RunDeferredAndLeave(InlineScope& scope) {
  while (!scope.deferred.empty()) {
    auto next = std::move(scope.deferred.front());
    scope.deferred.pop_front();
    std::move(next)();
  }
  inline_scopes = scope.outer;
}

}  // namespace internal
}  // namespace rdmarpc

#endif  // RDMARPC_RPC_INTERNAL_INLINE_SCOPE_H_
