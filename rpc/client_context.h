// ClientContext: per-call settings and results on the client side.
//
// One ClientContext per call (do not reuse it); it must outlive the call. A
// call made with a context whose call has not ended fails
// FAILED_PRECONDITION at once and leaves that call alone.
//
//   rdmarpc::ClientContext ctx;
//   ctx.set_timeout(absl::Milliseconds(200));
//   ctx.AddMetadata("request-id", "42");
//   rdmarpc::Status s = stub.Echo(&ctx, req, &resp);
//   for (const auto& [k, v] : ctx.server_metadata()) ...
//
// Raw bytes beside the message go as an attachment (rpc/attachment.h):
// set_request_attachment before the call, response_attachment after it.
//
// TryCancel() may be called from any thread at any time: a pending call ends
// with CANCELLED (a call that already finished is not affected) and the
// server is told to stop working on it.
//
// A handler that calls other services makes their contexts with
// FromServerContext, so that they carry its deadline and end CANCELLED when
// its own call is cancelled (by its client, a lost connection, or the
// server's shutdown):
//
//   auto child = rdmarpc::ClientContext::FromServerContext(*server_ctx);
//   rdmarpc::Status s = backend_stub->Lookup(child.get(), lookup_req, &lookup_resp);
#ifndef RDMARPC_RPC_CLIENT_CONTEXT_H_
#define RDMARPC_RPC_CLIENT_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "rpc/attachment.h"
#include "rpc/internal/call_tree.h"
#include "transport/wire_format.h"

namespace rdmarpc {

using Metadata = transport::Metadata;

class ServerContext;

class ClientContext {
 public:
  ClientContext() = default;
  ClientContext(const ClientContext&) = delete;
  ClientContext& operator=(const ClientContext&) = delete;
  ~ClientContext();

  // A context for a call made on behalf of the call `parent` serves: with
  // its deadline (set_deadline may change it), cancelled when it is
  // cancelled, at once if it is already. Not its metadata: what to pass on
  // is the handler's to choose. It may outlive `parent`.
  static std::unique_ptr<ClientContext> FromServerContext(ServerContext& parent);

  // A wall-clock time, as absl::Now() gives it. The call keeps it as the
  // time left, so a step of the wall clock afterwards neither ends the call
  // early nor keeps it waiting longer (base/steady_clock.h).
  void set_deadline(absl::Time deadline) { deadline_ = FromWallClock(deadline); }
  void set_timeout(absl::Duration timeout) { deadline_ = SteadyNow() + timeout; }
  absl::Time deadline() const { return ToWallClock(deadline_); }  // InfiniteFuture() if unset

  // Keys: 1..256 bytes of [a-z0-9-_.], not starting "rdmarpc-" (the
  // runtime's own, transport/wire_format.h); invalid metadata fails the call
  // with INVALID_ARGUMENT. TCP carries up to 64 KiB of encoded metadata a call;
  // over RDMA it goes with the header in one receive slot (8 KiB by default,
  // RdmaOptions::slot_size, the smaller of both ends'), and more fails the
  // call RESOURCE_EXHAUSTED naming the slot.
  void AddMetadata(std::string key, std::string value) {
    metadata_.emplace_back(std::move(key), std::move(value));
  }
  const Metadata& metadata() const { return metadata_; }

  // What the server's handler added with ServerContext::AddResponseMetadata;
  // valid once the call has completed.
  const Metadata& server_metadata() const { return server_metadata_; }

  // Sent after the request message; the call takes it (the context no
  // longer holds it once the call has started).
  void set_request_attachment(Attachment attachment) {
    request_attachment_ = std::move(attachment);
  }
  // What the server's handler set with ServerContext::set_response_attachment;
  // valid once the call has completed OK, and held until the context is
  // destroyed. Empty when the server sent none or the call failed.
  const Attachment& response_attachment() const { return response_attachment_; }

  // What a call does when the channel cannot connect. By default (false) a
  // call gets one connect attempt, the one running when it is made or the
  // next (after the reconnect backoff), and ends UNAVAILABLE if that attempt
  // fails. With true it waits through failed attempts, each after its
  // backoff, until one connects or its deadline, TryCancel or the channel's
  // destruction ends it; options that can never connect (INVALID_ARGUMENT)
  // still end it. Either way a call that was sent is not sent again, unless
  // the channel's RetryPolicy (ChannelOptions::retry) does.
  void set_wait_for_ready(bool wait) { wait_for_ready_ = wait; }
  bool wait_for_ready() const { return wait_for_ready_; }

  // Whether the channel's RetryPolicy (ChannelOptions::retry) may send this
  // call again; set it false for a call that must not run twice.
  void set_retryable(bool retryable) { retryable_ = retryable; }
  bool retryable() const { return retryable_; }

  void TryCancel();

 private:
  friend class Channel;
  // As a call starts: marks the context as its own. False, changing nothing,
  // when a call that has not ended holds it already.
  bool BeginCall() { return (state_.fetch_or(kInCall) & kInCall) == 0; }
  // Set by the channel under the lock that tracks the call, so that nothing
  // ends the call before its hook is set; cleared when it ends. True when
  // the context was cancelled already: the hook has not run, and the caller
  // ends the call (once it has let go of that lock, which the hook takes). A
  // plain function and its two arguments, not a std::function: every call
  // sets and clears it, and a std::function pays a type-erased manager call
  // for each.
  using CancelHook = void (*)(void* owner, uint64_t call_id);
  bool SetCancelHook(CancelHook hook, void* owner, uint64_t call_id);
  // As the call ends: clears the hook and frees the context for BeginCall.
  void EndCall();
  // As the call moves to another channel (a BalancedChannel's retry), which
  // sets a hook of its own: clears this one. True when the context was
  // cancelled already: a TryCancel runs, or ran, the old hook, and the
  // caller ends the call instead of moving it (a hook set now could be read
  // half old, half new).
  bool ClearCancelHook() { return (state_.fetch_and(~kHookSet) & kCancelled) != 0; }

  absl::Time steady_deadline() const { return deadline_; }

  absl::Time deadline_ = absl::InfiniteFuture();  // on SteadyNow()'s clock
  bool wait_for_ready_ = false;
  bool retryable_ = true;
  // The tree of the call this one is made for (FromServerContext), if any.
  std::shared_ptr<internal::CallTree> parent_;
  Metadata metadata_;
  Metadata server_metadata_;
  Attachment request_attachment_;
  Attachment response_attachment_;
  // Cancellation without a lock (every call sets and clears the hook): the
  // hook's fields are written before kHookSet is published, and whichever of
  // SetCancelHook and TryCancel sets its bit second runs the hook (for
  // SetCancelHook, its caller), so it runs once however the two race. A hook
  // may still run just after EndCall (as with a lock, which would release
  // before calling it); the channel's hook ignores a call id that has ended.
  // kInCall is a bit of its own, not kHookSet: a call holds its context from
  // its start, before it is tracked and its hook set.
  static constexpr uint32_t kCancelled = 1;
  static constexpr uint32_t kHookSet = 2;
  static constexpr uint32_t kInCall = 4;
  std::atomic<uint32_t> state_{0};
  std::atomic<CancelHook> cancel_hook_{nullptr};
  std::atomic<void*> cancel_owner_{nullptr};
  std::atomic<uint64_t> cancel_call_id_{0};
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_CLIENT_CONTEXT_H_
