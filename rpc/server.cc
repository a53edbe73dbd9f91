#include "rpc/server.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "rpc/internal/payload.h"
#include "rpc/internal/proto_method_name.h"
#include "rpc/internal/spare_pool.h"

namespace rdmarpc {

using transport::Buffer;
using transport::Connection;
using transport::InboundMessage;
using transport::MessageKind;
using transport::OutboundMessage;

namespace {
// Error texts travel as the payload of a failed response; keep them bounded.
constexpr size_t kMaxErrorMessage = 16 * 1024;
// How long Shutdown waits for the acknowledgment of its GOAWAY from a
// connection that sent no call it saw: one round trip for a client of ours.
// A peer that never acknowledges (a probe of the port, a peer that is not
// ours) holds Shutdown no longer than this when it has no call in flight; a
// call it sends later is refused. A connection that sent calls is a client
// of ours, which acknowledges: Shutdown waits for it within its grace, since
// a loaded client may take longer, and calls it sends before the
// acknowledgment must be served, not lost with the connection.
constexpr absl::Duration kGoAwayAckWait = absl::Seconds(1);
}  // namespace

// One call being served. It lives until both the handler has called Finish
// (self_ keeps it alive until then) and the server no longer tracks it; it
// holds its connection from the moment the server tracks it (hold_).
//
// Tracking (Server::inflight_) is what lets a cancel, a closing connection or
// Shutdown reach a call that is running. With workers a call is tracked before
// it is queued. With inline handlers it is tracked only if its handler
// returns without having finished (it went asynchronous): until the handler
// returns, the I/O thread that would deliver a cancel or a close for its
// connection is the one running it, so nothing could reach it anyway, and the
// usual unary call, finished before its handler returns, costs no lock and no
// map entry. `tracking_` settles the race between a handler finishing on
// another thread and the I/O thread tracking the call afterwards.
class ServerCallImpl : public ServerCall {
 public:
  ServerCallImpl(Server* server, Connection& conn, const Service::Method* method, bool counted,
                 InboundMessage&& msg, absl::Time deadline, Metadata&& client_md)
      : limited(counted),
        server_(server),
        conn_(conn),
        method_(method),
        msg_(std::move(msg)),
        ctx_(method->full_name, conn, server->max_message_size_, deadline, std::move(client_md),
             absl::string_view(msg_.payload.data(), msg_.header.attachment_len)) {
    ctx_.SetDeadlineWatch(&ServerCallImpl::WatchDeadline, this);
    if (!server->interceptors_.empty()) intercepted_ = std::make_unique<Intercepted>();
  }

  ServerContext* context() override { return &ctx_; }
  // The payload is the attachment, then the message; HandleRequest checked
  // that it holds attachment_len bytes.
  absl::string_view request() const override {
    const size_t att = msg_.header.attachment_len;
    return absl::string_view(msg_.payload.data() + att, msg_.payload.size() - att);
  }
  void Finish(const Status& status, const google::protobuf::MessageLite* response) override {
    RDMARPC_STAGE(kHandlerFinish);
    Respond(status, response);
    self_.reset();  // may destroy this
  }

  // Sends the one response this call gets; later attempts do nothing.
  void Respond(Status status, const google::protobuf::MessageLite* response) {
    if (!ctx_.MarkAnswered()) return;
    if (const uint64_t timer = deadline_timer_.load(std::memory_order_acquire); timer != 0) {
      server_->timers_->Cancel(timer);
    }
    // Past the deadline the client is no longer waiting for a result, and
    // whatever the handler made of its cancellation, the cause is the deadline.
    if (ctx_.steady_deadline() != absl::InfiniteFuture() && SteadyNow() >= ctx_.steady_deadline()) {
      status = Status(StatusCode::kDeadlineExceeded, "deadline exceeded on the server");
    }
    Attachment attachment;
    size_t size = 0;
    if (status.ok() && response != nullptr) {
      attachment = ctx_.TakeResponseAttachment();
      size = response->ByteSizeLong();
      if (size + attachment.size() > server_->max_message_size_) {
        status = Status(StatusCode::kResourceExhausted,
                        absl::StrCat(method_->full_name, ": response of ", size, " bytes",
                                     attachment.empty()
                                         ? std::string()
                                         : absl::StrCat(" with an attachment of ",
                                                        attachment.size(), " bytes"),
                                     " exceeds max_message_size ",
                                     server_->max_message_size_));
      }
    }
    if (!server_->interceptors_.empty()) InterceptResponse(status);
    server_->Reply(conn_, key().second, status, ctx_.TakeResponseMetadata(),
                   status.ok() ? response : nullptr, std::move(attachment), size);
    if (tracking_.exchange(kFinished, std::memory_order_acq_rel) == kTracked) {
      server_->CallFinished(key());
    }
  }

  enum Tracking : uint8_t { kUntracked, kTracked, kFinished };
  // Needs Server::mu_: a finishing call that sees kTracked goes on to erase
  // its entry, which it must find. False when the call has finished already.
  bool MarkTrackedLocked() {
    uint8_t expected = kUntracked;
    return tracking_.compare_exchange_strong(expected, kTracked, std::memory_order_acq_rel);
  }
  bool finished() const { return tracking_.load(std::memory_order_acquire) == kFinished; }

  Server::CallKey key() const { return {&conn_, msg_.header.call_id}; }
  void Run() {
    RDMARPC_STAGE(kHandlerStart);
    if (ctx_.IsCancelled()) {
      const bool expired = SteadyNow() >= ctx_.steady_deadline();
      return Finish(expired ? Status(StatusCode::kDeadlineExceeded,
                                     "deadline passed before the handler started")
                            : Status(StatusCode::kCancelled, "cancelled before it started"),
                    nullptr);
    }
    const auto& interceptors = server_->interceptors_;
    for (size_t i = 0; i < interceptors.size(); ++i) {
      Status admitted;
      {
        std::lock_guard<std::mutex> lock(intercepted_->mu);
        // Answered meanwhile (Shutdown past its grace): Finish only lets go.
        if (intercepted_->closed) return Finish(Status(StatusCode::kCancelled, ""), nullptr);
        // One that throws refuses the call, as one whose status is not OK.
        if (!internal::RunUserCode("an interceptor's OnRequest", method_->full_name,
                                   [&] { admitted = interceptors[i]->OnRequest(ctx_); })) {
          admitted =
              Status(StatusCode::kUnknown,
                     absl::StrCat(method_->full_name, ": an interceptor threw an exception"));
        }
        intercepted_->entered = i + 1;
      }
      if (!admitted.ok()) return Finish(admitted, nullptr);
    }
    method_->handler(this);
  }

  // The OnResponse of every interceptor whose OnRequest ran, last first.
  // Under Intercepted::mu the two sides agree on how many those are: an
  // answer from another thread (Shutdown) waits for an OnRequest running.
  void InterceptResponse(const Status& status) {
    size_t entered;
    {
      std::lock_guard<std::mutex> lock(intercepted_->mu);
      intercepted_->closed = true;
      entered = intercepted_->entered;
    }
    for (size_t i = entered; i-- > 0;) {
      internal::RunUserCode("an interceptor's OnResponse", method_->full_name,
                            [&] { server_->interceptors_[i]->OnResponse(ctx_, status); });
    }
  }

  // The server cancels the call at its deadline, for ServerContext::OnCancel
  // (the deadline alone is what IsCancelled needs). The timer holds the
  // call weakly: it may fire after the call is gone.
  static void WatchDeadline(void* self) {
    auto* call = static_cast<ServerCallImpl*>(self);
    std::weak_ptr<ServerCallImpl> weak = call->self_;  // set until the handler is done
    call->deadline_timer_.store(call->server_->timers_->Schedule(
                                    call->ctx_.steady_deadline(),
                                    [weak] {
                                      if (auto c = weak.lock()) c->ctx_.MarkCancelled();
                                    },
                                    call->server_),
                                std::memory_order_release);
  }

  std::shared_ptr<ServerCallImpl> self_;
  std::shared_ptr<Connection> hold_;  // set under Server::mu_ when tracked
  const bool limited;                 // counts against SetMaxConcurrentCalls while tracked

 private:
  Server* const server_;
  Connection& conn_;
  const Service::Method* const method_;
  InboundMessage msg_;
  ServerContext ctx_;
  std::atomic<uint64_t> deadline_timer_{0};
  std::atomic<uint8_t> tracking_{kUntracked};
  // Made only when the server has interceptors: a call without them pays
  // for no mutex.
  struct Intercepted {
    std::mutex mu;
    size_t entered = 0;   // interceptors whose OnRequest ran; guarded by mu
    bool closed = false;  // answered: no further OnRequest; guarded by mu
  };
  std::unique_ptr<Intercepted> intercepted_;
};

Server::Server(int workers, size_t max_message_size, size_t max_calls, size_t max_calls_per_conn)
    : max_message_size_(max_message_size),
      max_calls_(max_calls),
      max_calls_per_conn_(max_calls_per_conn),
      inline_handlers_(workers == 0) {}

Server::~Server() { Shutdown(); }

void Server::OnMessage(Connection& conn, InboundMessage&& msg) {
  switch (msg.header.kind) {
    case MessageKind::kRequest:
      return HandleRequest(conn, std::move(msg));
    case MessageKind::kGoAway:
      return OnGoAwayAck(conn);
    case MessageKind::kCancel: {
      std::shared_ptr<ServerCallImpl> call;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = inflight_.find({&conn, msg.header.call_id});
        if (it != inflight_.end()) call = it->second;
      }
      // Outside the lock: it cancels the calls the handler made
      // (ClientContext::FromServerContext), whose callbacks may run inline.
      if (call) call->context()->MarkCancelled();
      return;
    }
    default:
      fprintf(stderr, "rdmarpc[server]: ignoring message kind %d from %s\n",
              static_cast<int>(msg.header.kind), conn.peer().c_str());
  }
}

void Server::HandleRequest(Connection& conn, InboundMessage&& msg) {
  const uint64_t call_id = msg.header.call_id;
  // Its header went through AdmitRemotePayload, which put it in
  // ConnEntry::reading if it let it through (else payload_status says why):
  // every way out of here takes it out again.
  const bool admitted_by_header = msg.header.remote_payload();
  // `conn` is alive while it delivers this message; an answer to a
  // connection that has closed meanwhile is dropped by its Send.
  const auto reply_error = [&](StatusCode code, const std::string& text) {
    if (admitted_by_header) ForgetReading(conn, call_id);
    Reply(conn, call_id, Status(code, text));
  };
  auto m = methods_.find(msg.header.method_id);
  if (m == methods_.end()) {
    return reply_error(StatusCode::kUnimplemented,
                       absl::StrCat("unknown method id 0x", absl::Hex(msg.header.method_id),
                                    ": no registered service has it"));
  }
  const Service::Method* method = m->second.method;
  m->second.calls->fetch_add(1, std::memory_order_relaxed);
  if (!msg.payload_status.ok()) {
    return reply_error(msg.payload_status.code(),
                       absl::StrCat(method->full_name, ": ", msg.payload_status.message()));
  }
  if (msg.header.attachment_len > msg.payload.size()) {  // a transport's bug, not the peer's
    return reply_error(StatusCode::kInternal,
                       absl::StrCat(method->full_name, ": attachment of ",
                                    msg.header.attachment_len, " bytes in a payload of ",
                                    msg.payload.size()));
  }
  Metadata client_md;
  if (!msg.metadata.empty()) {
    auto md = transport::DecodeMetadata(msg.metadata);
    if (!md.ok()) {
      return reply_error(StatusCode::kInvalidArgument,
                         absl::StrCat(method->full_name, ": ", md.status().message()));
    }
    client_md = std::move(*md);
  }
  const absl::Time deadline =
      msg.header.timeout_us == 0 ? absl::InfiniteFuture() : SteadyNow() + msg.header.timeout();
  auto call = std::allocate_shared<ServerCallImpl>(internal::SpareAllocator<ServerCallImpl>(), this,
                                                   conn, method, m->second.limited, std::move(msg),
                                                   deadline, std::move(client_md));
  if (inline_handlers_) {
    if (max_calls_ != 0 || max_calls_per_conn_ != 0) {
      const Status refused = Admit(m->second, limited_in_flight_.load(std::memory_order_acquire),
                                   LimitedCallsOn(conn));
      if (!refused.ok()) {
        if (admitted_by_header) ForgetReading(conn, call_id);
        return Reply(conn, call_id, refused);
      }
    }
    return RunInline(conn, std::move(call), admitted_by_header);
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = conns_.find(&conn);
    if (it == conns_.end()) return;  // closed: nobody to answer
    it->second.sent_calls = true;
    // In the lock that tracks the call: Shutdown, which waits for `reading`
    // to empty, must find it in one or the other.
    if (admitted_by_header) {
      it->second.reading.erase(call_id);
      if (shutting_down_) cv_.notify_all();
    }
    if (shutting_down_ && RefusedByShutdownLocked(it->second, admitted_by_header)) {
      lock.unlock();
      return Reply(conn, call_id, Status(StatusCode::kUnavailable, "server is shutting down"));
    }
    if (max_calls_ != 0 || max_calls_per_conn_ != 0) {
      if (Status refused = Admit(m->second, limited_in_flight_.load(std::memory_order_relaxed),
                                 it->second.limited_in_flight);
          !refused.ok()) {
        lock.unlock();
        return Reply(conn, call_id, refused);
      }
    }
    if (!inflight_.emplace(call->key(), call).second) {
      return DropReusedCallId(conn, call_id);
    }
    tracked_.fetch_add(1, std::memory_order_relaxed);
    if (call->limited) {
      limited_in_flight_.fetch_add(1, std::memory_order_relaxed);
      ++it->second.limited_in_flight;
    }
    call->MarkTrackedLocked();
    call->hold_ = it->second.conn;
  }
  call->self_ = call;
  if (!workers_->Post([call] { call->Run(); })) {
    call->Finish(Status(StatusCode::kUnavailable, "server is shutting down"), nullptr);
  }
}

void Server::RunInline(Connection& conn, std::shared_ptr<ServerCallImpl> call,
                       bool admitted_by_header) {
  const CallKey key = call->key();
  if (shutting_down_.load(std::memory_order_acquire)) {
    bool refused;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = conns_.find(&conn);
      if (it != conns_.end()) it->second.sent_calls = true;
      refused = it == conns_.end() || RefusedByShutdownLocked(it->second, admitted_by_header);
    }
    if (refused) {
      if (admitted_by_header) ForgetReading(conn, key.second);
      return Reply(conn, key.second, Status(StatusCode::kUnavailable, "server is shutting down"));
    }
  }
  // A call id may be reused once its call has ended; while the call runs,
  // a second request with it is dropped. Only tracked calls can be running
  // now (see ServerCallImpl), so with none tracked there is nothing to look up.
  if (tracked_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (inflight_.contains(key)) return DropReusedCallId(conn, key.second);
  }
  call->self_ = call;
  call->Run();
  if (call->finished()) {
    if (admitted_by_header) ForgetReading(conn, key.second);
    return;
  }
  // The handler went asynchronous: track the call from here on, unless it
  // has finished on another thread meanwhile.
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = conns_.find(&conn);
    // Its connection stays open at least until this delivery returns.
    if (it != conns_.end()) {
      it->second.sent_calls = true;
      call->hold_ = it->second.conn;
      // In the lock that tracks it, as in HandleRequest.
      if (admitted_by_header && it->second.reading.erase(key.second) && shutting_down_) {
        cv_.notify_all();
      }
    }
    if (closing_ || it == conns_.end()) {
      cancel = true;  // Shutdown may have collected the calls it cancels already
    } else if (call->MarkTrackedLocked()) {
      inflight_.emplace(key, call);
      tracked_.fetch_add(1, std::memory_order_relaxed);
      if (call->limited) {
        limited_in_flight_.fetch_add(1, std::memory_order_relaxed);
        ++it->second.limited_in_flight;
      }
    }
  }
  if (cancel) {
    call->context()->MarkCancelled();
    call->Respond(Status(StatusCode::kCancelled, "server shutting down"), nullptr);
  }
}

Status Server::Admit(const MethodEntry& method, size_t in_flight, size_t on_conn) {
  if (!method.limited) return Status();
  if (max_calls_ != 0 && in_flight >= max_calls_) {
    refused_over_limit_.fetch_add(1, std::memory_order_relaxed);
    return Status(StatusCode::kResourceExhausted,
                  absl::StrCat("server busy: ", in_flight,
                               " calls in flight, the most it takes "
                               "(ServerBuilder::SetMaxConcurrentCalls); retry later or elsewhere"));
  }
  if (max_calls_per_conn_ != 0 && on_conn >= max_calls_per_conn_) {
    refused_over_connection_limit_.fetch_add(1, std::memory_order_relaxed);
    return Status(StatusCode::kResourceExhausted,
                  absl::StrCat("server busy for this connection: ", on_conn,
                               " of its calls in flight, the most one connection may have "
                               "(ServerBuilder::SetMaxConcurrentCallsPerConnection); wait for "
                               "some to finish"));
  }
  return Status();
}

size_t Server::LimitedCallsOn(Connection& conn) {
  if (max_calls_per_conn_ == 0 || tracked_.load(std::memory_order_acquire) == 0) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(&conn);
  return it == conns_.end() ? 0 : it->second.limited_in_flight;
}

Status Server::AdmitRemotePayload(Connection& conn, const transport::Header& header) {
  if (header.kind != MessageKind::kRequest) return Status();
  auto m = methods_.find(header.method_id);
  if (m == methods_.end()) return Status();  // HandleRequest answers UNIMPLEMENTED
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(&conn);
  if (it == conns_.end()) return Status();  // closed: HandleRequest drops it
  it->second.sent_calls = true;
  if (shutting_down_ && RefusedByShutdownLocked(it->second, false)) {
    return Status(StatusCode::kUnavailable, "server is shutting down");
  }
  if (max_calls_ != 0 || max_calls_per_conn_ != 0) {
    // HandleRequest checks again, exactly, what this lets through.
    if (Status refused = Admit(m->second, limited_in_flight_.load(std::memory_order_relaxed),
                               it->second.limited_in_flight);
        !refused.ok()) {
      return refused;
    }
  }
  it->second.reading.insert(header.call_id);
  return Status();
}

bool Server::RefusedByShutdownLocked(const ConnEntry& entry, bool admitted_by_header) const {
  return closing_ || (entry.go_away_acked && !admitted_by_header);
}

void Server::ForgetReading(Connection& conn, uint64_t call_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(&conn);
  if (it != conns_.end() && it->second.reading.erase(call_id) && shutting_down_) cv_.notify_all();
}

void Server::OnGoAwayAck(Connection& conn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(&conn);
  if (!shutting_down_ || it == conns_.end()) {
    fprintf(stderr, "rdmarpc[server]: %s acknowledged a GOAWAY that was never sent; ignored\n",
            conn.peer().c_str());
    return;
  }
  it->second.go_away_acked = true;
  cv_.notify_all();
}

void Server::DropReusedCallId(Connection& conn, uint64_t call_id) {
  fprintf(stderr, "rdmarpc[server]: %s reused call id %llu while in flight; dropped\n",
          conn.peer().c_str(), static_cast<unsigned long long>(call_id));
}

void Server::Reply(Connection& conn, uint64_t call_id, const Status& status, const Metadata& md,
                   const google::protobuf::MessageLite* message, Attachment attachment,
                   size_t message_size) {
  OutboundMessage out;
  out.header.kind = MessageKind::kResponse;
  out.header.call_id = call_id;
  // code() is out of line in absl; most replies are OK.
  out.header.status = status.ok() ? 0 : static_cast<uint16_t>(status.code());
  if (!md.empty()) {
    // Metadata the handler or an interceptor added that cannot go on the
    // wire: a response sent without it would look complete, so the client
    // gets an error naming it instead (an error already there goes as it is).
    if (Status valid = transport::ValidateMetadata(md); !valid.ok()) {
      if (status.ok()) {
        return Reply(conn, call_id,
                     Status(StatusCode::kInternal,
                            absl::StrCat("the server's response metadata: ", valid.message())));
      }
    } else {
      out.metadata = transport::EncodeMetadata(md);
    }
  }
  if (!status.ok() || message == nullptr) {
    return SendWithoutMessage(conn, call_id, status, std::move(out));
  }
  const Status sent =
      internal::SendWithMessage(conn, std::move(out), std::move(attachment), *message, message_size);
  // Anything but a lost connection (memory for the payload, a frame the
  // transport refused) still gets the client an answer: the error.
  if (!sent.ok() && sent.code() != StatusCode::kUnavailable) Reply(conn, call_id, sent);
}

void Server::SendWithoutMessage(Connection& conn, uint64_t call_id, const Status& status,
                                OutboundMessage&& out) {
  if (!status.ok()) {
    const absl::string_view text = status.message().substr(0, kMaxErrorMessage);
    out.payload = Buffer::CopyOf(text.data(), text.size());
    out.metadata += transport::EncodeStatusPayloads(status);
  }
  // A Status made of the code and message alone has no payloads.
  const auto bare = [&status] { return Status(status.code(), status.message()); };
  if (out.metadata.size() > transport::kMaxMetadataBytes) {
    return Reply(conn, call_id, bare());
  }
  const bool with_metadata = !out.metadata.empty();
  const absl::Status sent = conn.Send(std::move(out));
  // UNAVAILABLE: the connection is gone, and OnClosed deals with that.
  if (sent.ok() || absl::IsUnavailable(sent)) return;
  // The transport cannot take this answer: its metadata does not fit an
  // RDMA receive slot, or a TCP peer has read nothing for so long that
  // even errors have no room. Without the metadata and status payloads,
  // the error goes as it is (as when the metadata cannot go on the wire);
  // failing that, the call could wait for ever, so its connection ends,
  // and with it the peer's calls, UNAVAILABLE.
  if (with_metadata) return Reply(conn, call_id, bare());
  fprintf(stderr,
          "rdmarpc[server]: closing the connection to %s: the answer to call %llu could not be "
          "sent: %s\n",
          conn.peer().c_str(), static_cast<unsigned long long>(call_id),
          std::string(sent.message()).c_str());
  conn.Close();
}

void Server::CallFinished(const CallKey& key) {
  std::shared_ptr<ServerCallImpl> done;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mu_);
  auto it = inflight_.find(key);
  if (it == inflight_.end()) return;
  done = std::move(it->second);
  inflight_.erase(it);
  tracked_.fetch_sub(1, std::memory_order_relaxed);
  if (done->limited) {
    limited_in_flight_.fetch_sub(1, std::memory_order_relaxed);
    // Gone with its connection's close; the call held the Connection, so
    // no newer connection has its address.
    if (auto c = conns_.find(key.first); c != conns_.end()) --c->second.limited_in_flight;
  }
  // Under the lock: once Shutdown sees no call in flight, the Server may be
  // destroyed, and with it cv_. Only Shutdown waits for calls to finish.
  if (shutting_down_) cv_.notify_all();
}

void Server::OnClosed(Connection& conn, const absl::Status&) {
  std::shared_ptr<Connection> keep;  // released outside the lock
  std::vector<std::shared_ptr<ServerCallImpl>> lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, call] : inflight_) {
      if (key.first == &conn) lost.push_back(call);
    }
    auto it = conns_.find(&conn);
    if (it != conns_.end()) {
      keep = std::move(it->second.conn);
      conns_.erase(it);
    }
    if (shutting_down_) cv_.notify_all();  // one fewer acknowledgment to wait for
  }
  // Outside the lock, as for kCancel.
  for (auto& call : lost) call->context()->MarkCancelled();
}

void Server::Shutdown(absl::Duration grace) {
  if (health_) health_->Shutdown();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (shutting_down_) {
      cv_.wait(lock, [this] { return shut_down_; });
      return;
    }
    shutting_down_ = true;
  }
  const absl::Time start = SteadyNow();
  listeners_.clear();
  {
    // Clients send new calls elsewhere (a new connection) once they see
    // this, and acknowledge it; calls already on their way are served.
    std::vector<std::shared_ptr<Connection>> open;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [raw, entry] : conns_) open.push_back(entry.conn);
    }
    for (const auto& conn : open) {
      OutboundMessage go_away;
      go_away.header.kind = MessageKind::kGoAway;
      if (!conn->Send(std::move(go_away)).ok()) {
        // Closed, or not yet able to send: no acknowledgment will come.
        std::lock_guard<std::mutex> lock(mu_);
        if (auto it = conns_.find(conn.get()); it != conns_.end()) it->second.go_away_acked = true;
      }
    }
  }
  std::vector<std::shared_ptr<ServerCallImpl>> rest;
  {
    std::unique_lock<std::mutex> lock(mu_);
    const auto calls_done = [this] {
      if (!inflight_.empty()) return false;
      for (const auto& [raw, entry] : conns_) {
        if (!entry.reading.empty()) return false;
      }
      return true;
    };
    const auto acked = [this](bool only_those_that_sent_calls) {
      for (const auto& [raw, entry] : conns_) {
        if (!entry.go_away_acked && (entry.sent_calls || !only_those_that_sent_calls)) {
          return false;
        }
      }
      return true;
    };
    const absl::Time until = start + grace;
    WaitUntil(cv_, lock, std::min(until, start + kGoAwayAckWait),
              [&] { return acked(false) && calls_done(); });
    WaitUntil(cv_, lock, until, [&] { return acked(true) && calls_done(); });
    closing_ = true;
    for (auto& [key, call] : inflight_) rest.push_back(call);
  }
  for (auto& call : rest) {
    call->context()->MarkCancelled();
    call->Respond(Status(StatusCode::kCancelled, "server shutting down"), nullptr);
  }
  {
    // An answered call may still need its connection: over RDMA the client
    // READs a large response from here after the call ended, and a socket
    // may not have taken all of one yet. Polled, within the grace: nothing
    // reports it, and it takes one round trip.
    std::vector<std::shared_ptr<Connection>> open;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [raw, entry] : conns_) open.push_back(entry.conn);
    }
    const auto delivered = [&] {
      return std::all_of(open.begin(), open.end(), [](const auto& c) { return c->Delivered(); });
    };
    while (!delivered() && SteadyNow() < start + grace) absl::SleepFor(absl::Milliseconds(1));
  }
  // Every call is answered: no deadline needs watching.
  if (timers_) timers_->CancelAll(this);
  for (auto& [scheme, t] : transports_) t->Shutdown();
  if (workers_) workers_->Stop();
  std::lock_guard<std::mutex> lock(mu_);
  shut_down_ = true;
  cv_.notify_all();
}

std::map<std::string, uint64_t> Server::MethodCallCounts() const {
  std::map<std::string, uint64_t> counts;
  for (const auto& [id, entry] : methods_) counts[entry.method->full_name] = entry.calls->load();
  return counts;
}

Server::Stats Server::stats() const {
  Stats s;
  s.calls_in_flight = limited_in_flight_.load(std::memory_order_relaxed);
  s.refused_over_limit = refused_over_limit_.load(std::memory_order_relaxed);
  s.refused_over_connection_limit = refused_over_connection_limit_.load(std::memory_order_relaxed);
  return s;
}

void Server::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return shut_down_; });
}

ServerBuilder& ServerBuilder::AddListeningPort(std::string address, int* selected_port) {
  ports_.emplace_back(std::move(address), selected_port);
  return *this;
}

ServerBuilder& ServerBuilder::RegisterService(Service* service) {
  services_.push_back(service);
  return *this;
}

ServerBuilder& ServerBuilder::SetWorkerThreads(int n) {
  workers_ = n;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxMessageSize(size_t bytes) {
  max_message_size_ = bytes;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxConcurrentCalls(int n) {
  max_calls_ = n;
  return *this;
}

ServerBuilder& ServerBuilder::SetMaxConcurrentCallsPerConnection(int n) {
  max_calls_per_conn_ = n;
  return *this;
}

ServerBuilder& ServerBuilder::SetTransportTunables(transport::TransportTunables tunables) {
  tunables_ = std::move(tunables);
  return *this;
}

ServerBuilder& ServerBuilder::EnableHealthService() {
  health_ = true;
  return *this;
}

ServerBuilder& ServerBuilder::EnableStatsService() {
  stats_ = true;
  return *this;
}

ServerBuilder& ServerBuilder::EnableReflectionService() {
  reflection_ = true;
  return *this;
}

ServerBuilder& ServerBuilder::AddInterceptor(std::shared_ptr<ServerInterceptor> interceptor) {
  interceptors_.push_back(std::move(interceptor));
  return *this;
}

StatusOr<std::unique_ptr<Server>> ServerBuilder::BuildAndStart() {
  if (ports_.empty()) return Status(StatusCode::kInvalidArgument, "no listening port added");
  const int workers =
      workers_ >= 0 ? workers_ : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  for (const auto& [name, n] : {std::pair<const char*, int>{"SetMaxConcurrentCalls", max_calls_},
                                {"SetMaxConcurrentCallsPerConnection", max_calls_per_conn_}}) {
    if (n < 0) {
      return Status(StatusCode::kInvalidArgument,
                    absl::StrCat(name, "(", n, "): the limit is a count of calls, 0 for none"));
    }
  }
  std::unique_ptr<Server> server(new Server(workers, max_message_size_,
                                            static_cast<size_t>(max_calls_),
                                            static_cast<size_t>(max_calls_per_conn_)));
  server->interceptors_ = interceptors_;
  server->memory_quota_ = tunables_.memory_quota;
  // Before any listener: a call may come as soon as one listens.
  auto pool = internal::ThreadPool::Create(workers, "rpc-handler", "the server's handlers");
  if (!pool.ok()) return pool.status();
  server->workers_ = *std::move(pool);
  auto timers = internal::TimerQueue::Create("rpc-deadline", "the server's deadlines");
  if (!timers.ok()) return timers.status();
  server->timers_ = *std::move(timers);
  std::vector<const Service*> services(services_.begin(), services_.end());
  if (health_) {
    server->health_ = std::make_unique<HealthService>();
    for (const Service* service : services_) {
      for (const Service::Method& m : service->methods()) {
        const absl::string_view name = internal::ServiceOfMethod(m.full_name);
        if (!name.empty()) server->health_->SetServingStatus(std::string(name), true);
      }
    }
    services.push_back(server->health_.get());
  }
  if (stats_) {
    server->stats_ = std::make_unique<StatsService>(server.get());
    services.push_back(server->stats_.get());
  }
  if (reflection_) {
    server->reflection_ = std::make_unique<ReflectionService>(services);
    services.push_back(server->reflection_.get());
  }
  for (const Service* service : services) {
    const bool limited = service != server->health_.get() && service != server->stats_.get() &&
                         service != server->reflection_.get();
    for (const Service::Method& m : service->methods()) {
      auto [it, added] = server->methods_.emplace(
          m.id, Server::MethodEntry{&m, std::make_unique<std::atomic<uint64_t>>(0), limited});
      if (added) continue;
      const std::string& other = it->second.method->full_name;
      return Status(StatusCode::kAlreadyExists,
                    other == m.full_name
                        ? absl::StrCat("method ", m.full_name, " registered twice")
                        : absl::StrCat("methods ", other, " and ", m.full_name,
                                       " have the same id 0x", absl::Hex(m.id),
                                       " (rename one; see rpc/method_id.h)"));
    }
  }
  Server* raw = server.get();
  for (const auto& [text, selected] : ports_) {
    auto addr = transport::ParseAddress(text);
    if (!addr.ok()) return addr.status();
    auto found = server->transports_.find(addr->scheme);
    if (found == server->transports_.end()) {
      transport::TransportOptions topts;
      topts.max_message_size = max_message_size_;
      topts.name = "server";
      topts.listening = true;
      auto made = transport::MakeTransport(addr->scheme, topts, tunables_);
      // Nothing goes into transports_ before it is made: ~Server shuts each down.
      if (!made.ok()) return made.status();
      found = server->transports_.emplace(addr->scheme, std::move(*made)).first;
    }
    auto& t = found->second;
    auto listener = t->Listen(*addr, [raw](std::shared_ptr<Connection> c)
                                         -> transport::ConnectionObserver* {
      std::lock_guard<std::mutex> lock(raw->mu_);
      if (raw->shutting_down_) return nullptr;
      raw->conns_[c.get()].conn = std::move(c);
      return raw;
    });
    // The code and the message: the transport's payloads are its own (the
    // advice that ends the message is one, and would be printed twice).
    if (!listener.ok()) return Status(listener.status().code(), listener.status().message());
    if (selected) *selected = (*listener)->address().port;
    server->addresses_.push_back((*listener)->address().ToString());
    server->listeners_.push_back(std::move(*listener));
  }
  return server;
}

}  // namespace rdmarpc
