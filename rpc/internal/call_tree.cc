#include "rpc/internal/call_tree.h"

#include <algorithm>

#include "rpc/client_context.h"

namespace rdmarpc::internal {

bool CallTree::Add(ClientContext* child) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (cancelled_) return false;
  children_.push_back(child);
  return true;
}

void CallTree::Remove(ClientContext* child) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = std::find(children_.begin(), children_.end(), child);
  if (it != children_.end()) children_.erase(it);
}

void CallTree::CancelAll() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  cancelled_ = true;
  // Each child leaves the list before its TryCancel, whose inline callback
  // may destroy it (Remove then finds nothing) or another (Remove takes it
  // off the list here, under the lock this thread holds).
  while (!children_.empty()) {
    ClientContext* child = children_.back();
    children_.pop_back();
    child->TryCancel();
  }
}

}  // namespace rdmarpc::internal
