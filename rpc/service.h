// Service: how a service's methods plug into a Server.
//
// Generated code (codegen/) derives from Service and adds one Method per rpc;
// users derive from the generated class and override handlers. Writing a
// Service by hand works the same way:
//
//   class Echo : public rdmarpc::Service {
//    public:
//     Echo() {
//       AddMethod("/demo.Echo/Say", rdmarpc::UnaryHandler<Req, Resp>(
//           [](ServerContext* ctx, const Req* req, Resp* resp, DoneCallback done) {
//             resp->set_text(req->text());
//             std::move(done)(rdmarpc::Status());
//           }));
//     }
//   };
//
// A handler runs on a server worker thread and must call Finish (through
// `done` above) exactly once, from any thread, now or later.
//
// A handler that throws, or that lets `done` go without calling it, does not
// take the server down or leave its client waiting: the call ends UNKNOWN
// (UnaryHandler), as in gRPC's synchronous server, and the exception is
// logged on stderr. What it wrote into the response is not sent.
#ifndef RDMARPC_RPC_SERVICE_H_
#define RDMARPC_RPC_SERVICE_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "rpc/internal/payload.h"
#include "rpc/internal/spare_pool.h"
#include "rpc/internal/user_code.h"
#include "rpc/method_id.h"
#include "rpc/server_context.h"
#include "rpc/status.h"

namespace rdmarpc {

// One call being served.
class ServerCall {
 public:
  virtual ~ServerCall() = default;
  virtual ServerContext* context() = 0;
  // The serialized request (valid until Finish).
  virtual absl::string_view request() const = 0;
  // Sends the response (only when `status` is OK and `response` non-null) or
  // the error. Exactly once; the ServerCall is gone afterwards.
  virtual void Finish(const Status& status, const google::protobuf::MessageLite* response) = 0;
};

using DoneCallback = absl::AnyInvocable<void(Status) &&>;
using MethodHandler = std::function<void(ServerCall*)>;

class Service {
 public:
  struct Method {
    std::string full_name;  // "/package.Service/Method"
    uint32_t id;            // MethodId(full_name)
    MethodHandler handler;
  };

  virtual ~Service() = default;
  const std::vector<Method>& methods() const { return methods_; }
  // The .proto file that declares the service and every file it imports,
  // each after its imports, as serialized google.protobuf.FileDescriptorProto:
  // what the reflection service (rpc/reflection.h) describes it by.
  // Generated code sets them; a Service written by hand has none unless it
  // sets them.
  const std::vector<absl::string_view>& proto_files() const { return proto_files_; }

 protected:
  void AddMethod(std::string full_name, MethodHandler handler) {
    const uint32_t id = MethodId(full_name);
    methods_.push_back(Method{std::move(full_name), id, std::move(handler)});
  }
  // `files` must outlive the Service (generated code passes static data).
  void SetProtoFiles(std::vector<absl::string_view> files) { proto_files_ = std::move(files); }

 private:
  std::vector<Method> methods_;
  std::vector<absl::string_view> proto_files_;
};

namespace internal {

// The `done` UnaryHandler gives a handler: called, it finishes the call with
// the handler's status and response; destroyed uncalled (the handler threw,
// or dropped it), it finishes the call UNKNOWN, so that the client gets an
// answer and the call and its messages are freed; called again, it does
// nothing. `State` holds the response until the call is finished.
template <typename State>
class FinishOnce {
 public:
  FinishOnce(ServerCall* call, State state) : call_(call), state_(std::move(state)) {}
  FinishOnce(FinishOnce&& other) noexcept
      : call_(std::exchange(other.call_, nullptr)), state_(std::move(other.state_)) {}
  FinishOnce& operator=(FinishOnce&&) = delete;
  ~FinishOnce() {
    if (call_ == nullptr) return;
    const std::string& method = call_->context()->method();
    std::exchange(call_, nullptr)
        ->Finish(Status(StatusCode::kUnknown,
                        std::uncaught_exceptions() > 0
                            ? absl::StrCat(method, ": the handler threw an exception")
                            : absl::StrCat(method, ": the handler did not call done")),
                 nullptr);
  }

  void operator()(Status status) {
    if (call_ == nullptr) {  // the call may be gone: nothing of it is touched
      fprintf(stderr, "rdmarpc: a handler ran done a second time; ignored\n");
      return;
    }
    std::exchange(call_, nullptr)->Finish(status, status.ok() ? &state_->response : nullptr);
  }

 private:
  ServerCall* call_;
  State state_;
};

}  // namespace internal

// Adapts a typed asynchronous handler
//   void(ServerContext*, const Req*, Resp*, DoneCallback)
// to a MethodHandler: parses the request (INVALID_ARGUMENT if it does not
// parse), keeps Req and Resp alive until `done` runs, then finishes the call
// (UNKNOWN if the handler throws or drops `done` uncalled).
//
// The Req/Resp pair comes from a pool and goes back to it after `done` (the
// response cleared; the next parse replaces the request), unless either
// message was larger than kMaxPooledMessageBytes (then it is freed, so that
// one huge call does not pin its memory).
inline constexpr size_t kMaxPooledMessageBytes = 64 * 1024;

template <typename Req, typename Resp, typename Fn>
MethodHandler UnaryHandler(Fn fn) {
  return [fn = std::move(fn)](ServerCall* call) mutable {
    struct State {
      Req request;
      Resp response;
      size_t request_bytes = 0;
    };
    using Pool = internal::SparePool<State>;
    struct Recycle {
      void operator()(State* s) const {
        if (s->request_bytes > kMaxPooledMessageBytes ||
            s->response.ByteSizeLong() > kMaxPooledMessageBytes) {
          delete s;
          return;
        }
        // The request is not cleared: the next call's ParseFromArray does that.
        s->response.Clear();
        Pool::Give(s);
      }
    };
    std::unique_ptr<State, Recycle> state(Pool::Take());
    const absl::string_view bytes = call->request();
    state->request_bytes = bytes.size();
    switch (internal::ParseMessage(state->request, bytes)) {
      case internal::Parsed::kOk:
        break;
      case internal::Parsed::kMalformed:
        call->Finish(
            Status(StatusCode::kInvalidArgument,
                   std::string("request does not parse as ") + state->request.GetTypeName()),
            nullptr);
        return;
      case internal::Parsed::kOutOfMemory:
        call->Finish(transport::OutOfMemory(bytes.size(),
                                            "a request (" + state->request.GetTypeName() + ")"),
                     nullptr);
        return;
    }
    State* s = state.get();
    ServerContext* ctx = call->context();
    // The method table's name: it outlives the call, which may be gone once
    // the handler returns or throws.
    const std::string& method = ctx->method();
    using Done = internal::FinishOnce<decltype(state)>;
    // Kept in the DoneCallback itself, not in memory allocated for it.
    static_assert(sizeof(Done) <= 2 * sizeof(void*) && std::is_nothrow_move_constructible_v<Done>);
    internal::RunUserCode("the handler", method, [&] {
      fn(ctx, &s->request, &s->response, Done(call, std::move(state)));
    });
  };
}

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_SERVICE_H_
