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
// discarded). All methods are thread-safe. Calls the handler makes with
// ClientContext::FromServerContext(*ctx) carry its deadline and are cancelled
// with it.
#ifndef RDMARPC_RPC_SERVER_CONTEXT_H_
#define RDMARPC_RPC_SERVER_CONTEXT_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
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
  // too.
  ServerContext(const std::string& method, transport::Connection& conn, absl::Time deadline,
                Metadata client_md, absl::string_view request_attachment)
      : method_(method),
        peer_(conn.peer()),
        conn_(conn),
        deadline_(deadline),
        client_metadata_(std::move(client_md)),
        request_attachment_(request_attachment) {}

  absl::Time deadline() const { return deadline_; }
  bool IsCancelled() const {
    return cancelled_.load() || (deadline_ != absl::InfiniteFuture() && absl::Now() >= deadline_);
  }
  const Metadata& client_metadata() const { return client_metadata_; }
  // "/package.Service/Method"
  const std::string& method() const { return method_; }
  // The client's address, e.g. "tcp://10.0.0.2:51234".
  const std::string& peer() const { return peer_; }

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
  // of up to `message_room` bytes. RESOURCE_EXHAUSTED when the transport's
  // memory bound is reached.
  absl::StatusOr<Attachment> AllocateResponseAttachment(
      size_t size, size_t message_room = kDefaultAttachmentMessageRoom) {
    auto memory = conn_.AllocatePayload(size + message_room);
    if (!memory.ok()) return memory.status();
    return Attachment(std::move(*memory), size);
  }
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

  // Cancels the call, and the calls made from it (FromServerContext).
  void MarkCancelled() {
    cancelled_.store(true);
    std::shared_ptr<internal::CallTree> tree;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tree = call_tree_;
    }
    if (tree) tree->CancelAll();
  }

 private:
  friend class ClientContext;
  // Made on the first FromServerContext: most calls make none.
  std::shared_ptr<internal::CallTree> CallTreeForChildren() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call_tree_) call_tree_ = std::make_shared<internal::CallTree>();
    return call_tree_;
  }

  const std::string& method_;
  const std::string& peer_;
  transport::Connection& conn_;
  const absl::Time deadline_;
  const Metadata client_metadata_;
  const absl::string_view request_attachment_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> has_response_metadata_{false};
  std::atomic<bool> has_response_attachment_{false};
  std::mutex mu_;
  Metadata response_metadata_;      // guarded by mu_
  Attachment response_attachment_;  // guarded by mu_
  std::shared_ptr<internal::CallTree> call_tree_;  // guarded by mu_
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_SERVER_CONTEXT_H_
