// ServerContext: what a handler knows about the call it serves.
//
//   Status Echo(ServerContext* ctx, const EchoRequest* req, EchoResponse* resp) {
//     if (ctx->IsCancelled()) return Status(StatusCode::kCancelled, "gave up");
//     for (const auto& [k, v] : ctx->client_metadata()) ...
//     ctx->AddResponseMetadata("served-by", "node-3");
//     absl::string_view raw = ctx->request_attachment();  // rpc/attachment.h
//   }
//
// IsCancelled() turns true when the client cancels, the deadline passes, the
// connection is lost, or the server shuts down past its grace period; a
// long-running handler should poll it and stop early (its response is then
// discarded). A handler that parks its call instead (a long poll, a wait for
// an event) learns of it through OnCancel:
//
//   auto parked = std::make_shared<Parked>(std::move(done));  // runs done once
//   ctx->OnCancel([parked] { parked->Finish(Status(StatusCode::kCancelled, "gave up")); });
//   waiters_.Add(parked);  // the event finishes it otherwise
//
// All methods are thread-safe. Calls the handler makes with
// ClientContext::FromServerContext(*ctx) carry its deadline and are cancelled
// with it.
#ifndef RDMARPC_RPC_SERVER_CONTEXT_H_
#define RDMARPC_RPC_SERVER_CONTEXT_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "rpc/attachment.h"
#include "rpc/internal/call_tree.h"
#include "transport/transport.h"
#include "transport/wire_format.h"

namespace rdmarpc {

using Metadata = transport::Metadata;

class ServerContext {
 public:
  // Made by the runtime. `method` and `peer` are referenced, not copied: the
  // runtime passes the method table's name and the connection's address,
  // both of which outlive the call (a copy of each was a heap allocation per
  // call). `conn` and the bytes `request_attachment` views outlive the call
  // too. `max_message_size` is the server's; `deadline` is on SteadyNow()'s
  // clock.
  ServerContext(const std::string& method, transport::Connection& conn, size_t max_message_size,
                absl::Time deadline, Metadata client_md, absl::string_view request_attachment)
      : method_(method),
        peer_(conn.peer()),
        conn_(conn),
        max_message_size_(max_message_size),
        deadline_(deadline),
        client_metadata_(std::move(client_md)),
        request_attachment_(request_attachment) {}

  // A wall-clock time, as absl::Now() gives it; InfiniteFuture() if none.
  absl::Time deadline() const { return ToWallClock(deadline_); }
  bool IsCancelled() const {
    return cancelled_.load() || (deadline_ != absl::InfiniteFuture() && SteadyNow() >= deadline_);
  }
  const Metadata& client_metadata() const { return client_metadata_; }
  // "/package.Service/Method"
  const std::string& method() const { return method_; }
  // The client's address, e.g. "tcp://10.0.0.2:51234".
  const std::string& peer() const { return peer_; }

  // Keys as ClientContext::AddMetadata takes them; metadata that is not
  // valid turns an OK answer into INTERNAL, naming what is wrong, and more
  // than the transport carries (ClientContext::AddMetadata) turns it into
  // RESOURCE_EXHAUSTED. An error carries it too, beside its status payloads
  // (rpc/status.h), and goes without either where it cannot.
  void AddResponseMetadata(std::string key, std::string value) {
    std::lock_guard<std::mutex> lock(mu_);
    response_metadata_.emplace_back(std::move(key), std::move(value));
    has_response_metadata_.store(true, std::memory_order_release);
  }
  // Most handlers add none: then no lock is taken. Metadata added after the
  // handler finished is not sent either way.
  Metadata TakeResponseMetadata() {
    if (!has_response_metadata_.load(std::memory_order_acquire)) return {};
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(response_metadata_);
  }

  // The request's attachment (rpc/attachment.h) where the transport put it,
  // not copied: valid until the handler is done (returns, or runs `done`).
  // Empty when the client sent none.
  absl::string_view request_attachment() const { return request_attachment_; }

  // Memory for a response attachment that the transport sends as it is
  // (registered memory over RDMA), with room after it for a response message
  // of up to `message_room` bytes. RESOURCE_EXHAUSTED beyond the server's
  // max_message_size or the transport's memory bound.
  absl::StatusOr<Attachment> AllocateResponseAttachment(
      size_t size, size_t message_room = kDefaultAttachmentMessageRoom);
  // Sent after the response message when the handler succeeds; dropped with
  // an error. Set before the handler is done.
  void set_response_attachment(Attachment attachment) {
    std::lock_guard<std::mutex> lock(mu_);
    response_attachment_ = std::move(attachment);
    has_response_attachment_.store(true, std::memory_order_release);
  }
  Attachment TakeResponseAttachment() {
    if (!has_response_attachment_.load(std::memory_order_acquire)) return Attachment();
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(response_attachment_);
  }

  // Runs `on_cancel` once if the call is cancelled before it is answered:
  // the client cancels or its deadline passes (the server watches it too,
  // for a client that never sends its cancel), the connection is lost, or
  // the server shuts down past its grace period. Now, on this thread, if it
  // is cancelled already; never, once the handler is done. The handler must
  // still run `done` (the answer is discarded), and may do so from
  // `on_cancel`. It runs on the thread that saw the cancellation (an I/O
  // thread, the server's timer thread, the one in Server::Shutdown), so it
  // must not block, and an exception out of it is logged and goes no
  // further. One per call: a second replaces the first. Call it before the
  // handler is done, as everything on this context.
  void OnCancel(absl::AnyInvocable<void() &&> on_cancel);

  // Cancels the call, and the calls made from it (FromServerContext), and
  // runs the OnCancel callback. For the runtime.
  void MarkCancelled();

 private:
  friend class ClientContext;
  friend class ServerCallImpl;
  absl::Time steady_deadline() const { return deadline_; }
  // The runtime's: `watch(owner)` makes sure MarkCancelled runs at the
  // deadline. Called at most once, by the first OnCancel of a call with a
  // deadline: only a callback needs that, so other calls pay for no timer.
  using DeadlineWatch = void (*)(void* owner);
  void SetDeadlineWatch(DeadlineWatch watch, void* owner) {
    deadline_watch_ = watch;
    watch_owner_ = owner;
  }
  // The call is answered: its OnCancel callback is dropped. False if it was
  // answered already.
  bool MarkAnswered() {
    if (answered_.exchange(true)) return false;
    if (has_on_cancel_.load()) DropOnCancel();
    return true;
  }
  void DropOnCancel();
  // Made on the first FromServerContext: most calls make none.
  std::shared_ptr<internal::CallTree> CallTreeForChildren() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call_tree_) call_tree_ = std::make_shared<internal::CallTree>();
    return call_tree_;
  }

  const std::string& method_;
  const std::string& peer_;
  transport::Connection& conn_;
  const size_t max_message_size_;
  const absl::Time deadline_;  // on SteadyNow()'s clock (base/steady_clock.h)
  const Metadata client_metadata_;
  const absl::string_view request_attachment_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> answered_{false};
  std::atomic<bool> has_on_cancel_{false};
  DeadlineWatch deadline_watch_ = nullptr;
  void* watch_owner_ = nullptr;
  std::atomic<bool> has_response_metadata_{false};
  std::atomic<bool> has_response_attachment_{false};
  std::mutex mu_;
  Metadata response_metadata_;      // guarded by mu_
  Attachment response_attachment_;  // guarded by mu_
  std::shared_ptr<internal::CallTree> call_tree_;  // guarded by mu_
  absl::AnyInvocable<void() &&> on_cancel_;        // guarded by mu_
  bool deadline_watched_ = false;                  // guarded by mu_
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_SERVER_CONTEXT_H_
