// EchoService, ParkService and TestServer: the services and server the
// runtime tests use.
#ifndef RDMARPC_TESTS_ECHO_SERVICE_H_
#define RDMARPC_TESTS_ECHO_SERVICE_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "rpc/attachment.h"
#include "rpc/channel.h"
#include "rpc/channel_interface.h"
#include "rpc/server.h"
#include "rpc/service.h"
#include "tests/proto/test_service.pb.h"

namespace rdmarpc::testing {

using test::EchoRequest;
using test::EchoResponse;
inline constexpr MethodInfo kEcho{"/rdmarpc.test.Echo/Echo", MethodId("/rdmarpc.test.Echo/Echo")};
inline constexpr MethodInfo kEchoLater{"/rdmarpc.test.Echo/EchoLater",
                                MethodId("/rdmarpc.test.Echo/EchoLater")};
inline constexpr MethodInfo kMissing{"/rdmarpc.test.Echo/Missing", MethodId("/rdmarpc.test.Echo/Missing")};

// The bytes tests fill attachments with: position-dependent, so that a copy
// at the wrong offset or of the wrong length shows.
inline char AttachmentByte(size_t i) { return static_cast<char>((i * 131 + i / 4096) & 0xff); }

inline void FillAttachment(char* data, size_t size) {
  for (size_t i = 0; i < size; ++i) data[i] = AttachmentByte(i);
}

inline uint64_t AttachmentChecksum(absl::string_view bytes) {
  uint64_t sum = 0;
  for (size_t i = 0; i < bytes.size(); ++i) sum += (i + 1) * static_cast<uint8_t>(bytes[i]);
  return sum;
}

// Echo: copies data back, sleeps, fails on request, and records what it saw;
// answers an attachment with a copy of it, or with one it writes in place.
class EchoService : public Service {
 public:
  EchoService() {
    AddMethod(kEcho.full_name,
              UnaryHandler<EchoRequest, EchoResponse>(
                  [this](ServerContext* ctx, const EchoRequest* req, EchoResponse* resp,
                         DoneCallback done) { CountAndAnswer(Handle(ctx, *req, resp), done); }));
    // Finishes from a thread of its own, as an asynchronous handler may.
    AddMethod(kEchoLater.full_name,
              UnaryHandler<EchoRequest, EchoResponse>([this](ServerContext* ctx,
                                                             const EchoRequest* req,
                                                             EchoResponse* resp,
                                                             DoneCallback done) {
                std::lock_guard<std::mutex> lock(mu_);
                threads_.emplace_back([this, ctx, req, resp, done = std::move(done)]() mutable {
                  CountAndAnswer(Handle(ctx, *req, resp), done);
                });
              }));
  }
  ~EchoService() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : threads_) t.join();
  }

  Status Handle(ServerContext* ctx, const EchoRequest& req, EchoResponse* resp) {
    started.fetch_add(1);
    for (const auto& [k, v] : ctx->client_metadata()) {
      if (k == "echo-me") ctx->AddResponseMetadata("echoed", v);
      if (k == "respond-with-key") ctx->AddResponseMetadata(v, "x");
    }
    if (req.response_metadata_size() > 0) {
      ctx->AddResponseMetadata("padding",
                               std::string(static_cast<size_t>(req.response_metadata_size()), 'm'));
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(req.sleep_ms());
    while (std::chrono::steady_clock::now() < until) {
      if (ctx->IsCancelled()) {
        saw_cancel.fetch_add(1);
        return Status(StatusCode::kCancelled, "handler saw the cancellation");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (req.fail_code() != 0) {
      Status failed(static_cast<StatusCode>(req.fail_code()), req.fail_message());
      for (const test::StatusPayload& p : req.fail_payloads()) {
        failed.SetPayload(p.type_url(), absl::Cord(p.value()));
      }
      return failed;
    }
    if (req.response_size() > 0) {
      resp->mutable_data()->assign(static_cast<size_t>(req.response_size()), 'r');
    } else if (!req.data().empty()) {  // setting even "" allocates
      resp->set_data(req.data());
    }
    resp->set_tag(req.tag());
    const absl::string_view att = ctx->request_attachment();
    if (!att.empty()) {
      resp->set_attachment_size(static_cast<int64_t>(att.size()));
      resp->set_attachment_checksum(AttachmentChecksum(att));
    }
    if (req.response_attachment_size() > 0) {
      const size_t n = static_cast<size_t>(req.response_attachment_size());
      auto out = ctx->AllocateResponseAttachment(n);
      if (!out.ok()) return out.status();
      FillAttachment(out->data(), n);
      ctx->set_response_attachment(std::move(*out));
    } else if (!att.empty()) {
      ctx->set_response_attachment(Attachment::CopyOf(att));
    }
    return Status();
  }

  std::atomic<int> started{0};
  std::atomic<int> saw_cancel{0};
  // Handlers that have returned, counted before their call is answered.
  std::atomic<int> finished{0};

 private:
  void CountAndAnswer(Status s, DoneCallback& done) {
    finished.fetch_add(1);
    std::move(done)(std::move(s));
  }

  std::mutex mu_;
  std::vector<std::thread> threads_;
};

struct TestServer {
  EchoService service;
  std::unique_ptr<Server> server;
  std::string address;

  explicit TestServer(const std::string& listen, size_t max_message = 64u << 20,
                      int workers = 4, transport::TransportTunables tunables = {}) {
    auto s = ServerBuilder()
                 .AddListeningPort(listen)
                 .RegisterService(&service)
                 .SetWorkerThreads(workers)
                 .SetMaxMessageSize(max_message)
                 .SetTransportTunables(std::move(tunables))
                 .BuildAndStart();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    server = std::move(*s);
    address = server->addresses()[0];
  }
};

// An EchoRequest / EchoResponse of `data`, serialized, for raw peers.
inline std::string EchoBytes(const std::string& data) {
  EchoRequest r;
  r.set_data(data);
  return r.SerializeAsString();
}
inline std::string EchoResponseBytes(const std::string& data) {
  EchoResponse r;
  r.set_data(data);
  return r.SerializeAsString();
}

// One Echo call of `data` on `channel`: its status, or INTERNAL when what
// came back is not `data`.
inline Status EchoOn(ChannelInterface& channel, const std::string& data,
                     absl::Duration timeout = absl::Seconds(20)) {
  EchoRequest req;
  req.set_data(data);
  EchoResponse resp;
  ClientContext ctx;
  ctx.set_timeout(timeout);
  Status s = channel.Call(kEcho, &ctx, req, &resp);
  if (s.ok() && resp.data() != data) return Status(StatusCode::kInternal, "wrong echo");
  return s;
}

// Parks each call until it is cancelled, as a long poll does, and finishes
// it from ServerContext::OnCancel. With tag 1 it registers the callback
// only once its call is cancelled (so it runs at once, on the handler's
// thread); with tag 2 it registers it and then answers, so it must never run;
// with tag 3 the call is also held for FinishHeld to answer.
class ParkService : public Service {
 public:
  static constexpr MethodInfo kPark{"/rdmarpc.test.Park/Park", MethodId("/rdmarpc.test.Park/Park")};
  ParkService() {
    AddMethod(
        kPark.full_name,
        UnaryHandler<EchoRequest, EchoResponse>([this](ServerContext* ctx, const EchoRequest* req,
                                                       EchoResponse* resp, DoneCallback done) {
          handlers_started.fetch_add(1);
          if (req->tag() == 1) {
            const absl::Time until = absl::Now() + absl::Seconds(20);
            while (!ctx->IsCancelled() && absl::Now() < until) {
              absl::SleepFor(absl::Milliseconds(1));
            }
          }
          auto parked = std::make_shared<Parked>(std::move(done));
          const std::thread::id handler_thread = std::this_thread::get_id();
          ctx->OnCancel([this, parked, handler_thread] {
            on_handler_thread.store(std::this_thread::get_id() == handler_thread);
            cancelled_at.store(absl::ToUnixMicros(absl::Now()));
            cancels.fetch_add(1);
            parked->Finish(Status(StatusCode::kCancelled, "parked call cancelled"));
          });
          if (req->tag() == 2) {
            resp->set_data(req->data());
            parked->Finish(Status());
          } else if (req->tag() == 3) {
            resp->set_data(req->data());
            std::lock_guard<std::mutex> lock(mu_);
            held_.push_back(parked);
          }
          parked_calls.fetch_add(1);
        }));
  }

  // Answers the calls parked with tag 3 (OK, their data echoed).
  void FinishHeld() {
    std::vector<std::shared_ptr<Parked>> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.swap(held_);
    }
    for (auto& parked : held) parked->Finish(Status());
  }

  // Waits up to 20 s for `n` cancellations.
  bool WaitForCancels(int n) {
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (cancels.load() < n && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    return cancels.load() >= n;
  }

  std::atomic<int> handlers_started{0};
  std::atomic<int> parked_calls{0};
  std::atomic<int> cancels{0};
  std::atomic<bool> on_handler_thread{false};
  std::atomic<int64_t> cancelled_at{0};  // unix us

 private:
  struct Parked {
    explicit Parked(DoneCallback d) : done(std::move(d)) {}
    void Finish(Status s) {
      if (!finished.exchange(true)) std::move(done)(std::move(s));
    }
    std::atomic<bool> finished{false};
    DoneCallback done;
  };
  std::mutex mu_;
  std::vector<std::shared_ptr<Parked>> held_;  // guarded by mu_
};

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_ECHO_SERVICE_H_
