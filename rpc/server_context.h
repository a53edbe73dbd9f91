// ServerContext: what a handler knows about the call it serves.
//
//   Status Echo(ServerContext* ctx, const EchoRequest* req, EchoResponse* resp) {
//     if (ctx->IsCancelled()) return Status(StatusCode::kCancelled, "gave up");
//     for (const auto& [k, v] : ctx->client_metadata()) ...
//     ctx->AddResponseMetadata("served-by", "node-3");
//   }
//
// IsCancelled() turns true when the client cancels, the deadline passes, the
// connection is lost, or the server shuts down past its grace period; a
// long-running handler should poll it and stop early (its response is then
// discarded). All methods are thread-safe.
#ifndef RDMARPC_RPC_SERVER_CONTEXT_H_
#define RDMARPC_RPC_SERVER_CONTEXT_H_

#include <atomic>
#include <mutex>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/wire_format.h"

namespace rdmarpc {

using Metadata = transport::Metadata;

class ServerContext {
 public:
  // `method` and `peer` are referenced, not copied: the runtime passes the
  // method table's name and the connection's address, both of which outlive
  // the call (a copy of each was a heap allocation per call).
  ServerContext(const std::string& method, const std::string& peer, absl::Time deadline,
                Metadata client_md)
      : method_(method),
        peer_(peer),
        deadline_(deadline),
        client_metadata_(std::move(client_md)) {}

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

  void MarkCancelled() { cancelled_.store(true); }

 private:
  const std::string& method_;
  const std::string& peer_;
  const absl::Time deadline_;
  const Metadata client_metadata_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> has_response_metadata_{false};
  std::mutex mu_;
  Metadata response_metadata_;  // guarded by mu_
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_SERVER_CONTEXT_H_
