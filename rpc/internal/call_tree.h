// CallTree: the calls a handler makes with ClientContext::FromServerContext,
// linked to the call it serves, so that cancelling that call cancels them.
//
// Shared (shared_ptr) by the ServerContext and each ClientContext made from
// it, so that either may be destroyed first: a child unregisters itself when
// it is destroyed, and a tree whose ServerContext is gone is never cancelled.
//
// What not to rely on: order. CancelAll runs each child's TryCancel under
// the tree's lock, which is recursive because an inline callback
// (callback_threads = 0) may run inside TryCancel and destroy that child or
// another; a child destroyed on another thread meanwhile waits for CancelAll.
#ifndef RDMARPC_RPC_INTERNAL_CALL_TREE_H_
#define RDMARPC_RPC_INTERNAL_CALL_TREE_H_

#include <mutex>
#include <vector>

namespace rdmarpc {

class ClientContext;

namespace internal {

class CallTree {
 public:
  // Registers `child`; false when the tree was cancelled already (the child
  // is then not registered and should be cancelled by the caller).
  bool Add(ClientContext* child);
  void Remove(ClientContext* child);
  // Cancels every child registered, and refuses those that come later.
  void CancelAll();

 private:
  std::recursive_mutex mu_;
  bool cancelled_ = false;                // guarded by mu_
  std::vector<ClientContext*> children_;  // guarded by mu_
};

}  // namespace internal
}  // namespace rdmarpc

#endif  // RDMARPC_RPC_INTERNAL_CALL_TREE_H_
