#include "rpc/client_context.h"

namespace rdmarpc {

void ClientContext::TryCancel() {
  const uint32_t before = state_.fetch_or(kCancelled);
  if ((before & kCancelled) != 0 || (before & kHookSet) == 0) return;
  cancel_hook_.load(std::memory_order_relaxed)(cancel_owner_.load(std::memory_order_relaxed),
                                               cancel_call_id_.load(std::memory_order_relaxed));
}

bool ClientContext::SetCancelHook(CancelHook hook, void* owner, uint64_t call_id) {
  cancel_hook_.store(hook, std::memory_order_relaxed);
  cancel_owner_.store(owner, std::memory_order_relaxed);
  cancel_call_id_.store(call_id, std::memory_order_relaxed);
  if ((state_.fetch_or(kHookSet) & kCancelled) == 0) return false;
  hook(owner, call_id);
  return true;
}

void ClientContext::ClearCancelHook() { state_.fetch_and(~kHookSet); }

}  // namespace rdmarpc
