#include "rpc/client_context.h"

namespace rdmarpc {

void ClientContext::TryCancel() {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    hook = cancel_hook_;
  }
  if (hook) hook();
}

bool ClientContext::SetCancelHook(std::function<void()> hook) {
  bool cancel_now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_now = cancelled_;
    if (!cancel_now) cancel_hook_ = std::move(hook);
  }
  if (cancel_now) hook();
  return cancel_now;
}

void ClientContext::ClearCancelHook() {
  std::lock_guard<std::mutex> lock(mu_);
  cancel_hook_ = nullptr;
}

}  // namespace rdmarpc
