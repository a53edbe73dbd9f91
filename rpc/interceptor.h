// Interceptors: code that runs around every call of a server or a channel,
// for what cuts across services: authentication from metadata, metrics,
// logging, tracing.
//
//   class RequireToken : public rdmarpc::ServerInterceptor {
//    public:
//     rdmarpc::Status OnRequest(rdmarpc::ServerContext& ctx) override {
//       for (const auto& [key, value] : ctx.client_metadata()) {
//         if (key == "token" && value == secret_) return rdmarpc::Status();
//       }
//       return rdmarpc::Status(rdmarpc::StatusCode::kUnauthenticated, "no token");
//     }
//     ...
//   };
//   ServerBuilder().AddInterceptor(std::make_shared<RequireToken>())...
//
//   class AddToken : public rdmarpc::ClientInterceptor {
//    public:
//     void OnStart(rdmarpc::ClientContext& ctx, absl::string_view method) override {
//       ctx.AddMetadata("token", secret_);
//     }
//   };
//   rdmarpc::ChannelOptions options;
//   options.interceptors.push_back(std::make_shared<AddToken>());
//
// Interceptors run in the order they were added on the way in (OnRequest,
// OnStart) and in the reverse order on the way out (OnResponse, OnEnd), so
// that the first added wraps the others. They run on the threads that carry
// the call, some of them the transport's I/O thread: they must be quick and
// never block. One interceptor object serves every call of its server or
// channel, from many threads at once.
//
// An interceptor that throws does not take its process down; the exception
// is logged on stderr. On a server, a throw from OnRequest refuses the call
// UNKNOWN (as a status other than OK would), one from OnResponse leaves the
// answer as it was. On a channel, a throw from OnStart ends the call UNKNOWN
// before anything is sent (the OnEnd of that interceptor and those before it
// run, as for any call), one from OnEnd leaves the call's status as it was.
//
// What they see: every call that a server's handler would run, and every
// call a channel starts. A server refuses some requests before any
// interceptor runs: an unknown method, a malformed request, one over a
// limit (ServerBuilder::SetMaxConcurrentCalls), one during Shutdown.
#ifndef RDMARPC_RPC_INTERCEPTOR_H_
#define RDMARPC_RPC_INTERCEPTOR_H_

#include "absl/strings/string_view.h"
#include "rpc/client_context.h"
#include "rpc/server_context.h"
#include "rpc/status.h"

namespace rdmarpc {

class ServerInterceptor {
 public:
  virtual ~ServerInterceptor() = default;
  // Before the handler; ctx.method(), ctx.peer(), ctx.client_metadata() and
  // the deadline are known. A status other than OK answers the call with it
  // at once: the handler and the later interceptors' OnRequest do not run,
  // and the OnResponse of this one and those before it do.
  virtual Status OnRequest(ServerContext& ctx) {
    (void)ctx;
    return Status();
  }
  // As the answer goes out, with the status the client gets; may add
  // response metadata (ServerContext::AddResponseMetadata). Runs once for
  // every call whose OnRequest ran, however it ended: answered, refused by
  // an interceptor, cancelled, past its deadline.
  virtual void OnResponse(ServerContext& ctx, const Status& status) {
    (void)ctx;
    (void)status;
  }
};

class ClientInterceptor {
 public:
  virtual ~ClientInterceptor() = default;
  // As the call starts, before anything is checked or sent; may add
  // metadata (ClientContext::AddMetadata) or set the deadline. `method` is
  // "/package.Service/Method".
  virtual void OnStart(ClientContext& ctx, absl::string_view method) {
    (void)ctx;
    (void)method;
  }
  // Once for every started call, as it ends with `status` and before its
  // callback runs or its blocking caller returns: after a response, a
  // failure to send, a cancel, a deadline, a lost connection.
  virtual void OnEnd(const ClientContext& ctx, absl::string_view method, const Status& status) {
    (void)ctx;
    (void)method;
    (void)status;
  }
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_INTERCEPTOR_H_
