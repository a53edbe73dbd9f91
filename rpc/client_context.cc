#include "rpc/client_context.h"

#include "rpc/server_context.h"

namespace rdmarpc {

ClientContext::~ClientContext() {
  if (parent_) parent_->Remove(this);
}

std::unique_ptr<ClientContext> ClientContext::FromServerContext(ServerContext& parent) {
  auto child = std::make_unique<ClientContext>();
  child->deadline_ = parent.steady_deadline();
  child->parent_ = parent.CallTreeForChildren();
  // Registered before the check: a cancel that comes after it finds the
  // child in the tree, one that came before is seen here. A deadline that
  // passed is the child's own to meet: it ends DEADLINE_EXCEEDED.
  if (!child->parent_->Add(child.get()) || parent.cancelled_.load()) child->TryCancel();
  return child;
}

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
  return (state_.fetch_or(kHookSet) & kCancelled) != 0;
}

void ClientContext::EndCall() { state_.fetch_and(~(kHookSet | kInCall)); }

}  // namespace rdmarpc
