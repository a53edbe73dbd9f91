#include "rpc/client_context.h"

namespace rdmarpc {

void ClientContext::TryCancel() {
  CancelHook hook;
  void* owner;
  uint64_t call_id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    hook = cancel_hook_;
    owner = cancel_owner_;
    call_id = cancel_call_id_;
  }
  if (hook != nullptr) hook(owner, call_id);
}

bool ClientContext::SetCancelHook(CancelHook hook, void* owner, uint64_t call_id) {
  bool cancel_now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_now = cancelled_;
    if (!cancel_now) {
      cancel_hook_ = hook;
      cancel_owner_ = owner;
      cancel_call_id_ = call_id;
    }
  }
  if (cancel_now) hook(owner, call_id);
  return cancel_now;
}

void ClientContext::ClearCancelHook() {
  std::lock_guard<std::mutex> lock(mu_);
  cancel_hook_ = nullptr;
}

}  // namespace rdmarpc
