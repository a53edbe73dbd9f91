#include "rpc/channel.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <condition_variable>
#include <cstdio>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "rpc/balanced_channel.h"
#include "rpc/internal/channel_watch.h"
#include "rpc/internal/inline_scope.h"
#include "rpc/internal/own_thread.h"
#include "rpc/internal/payload.h"
#include "rpc/internal/user_code.h"
#include "rpc/retry_info.h"

namespace rdmarpc {

using internal::inline_scopes;
using internal::InlineScope;
using internal::InlineScopeOf;
using internal::RunDeferredAndLeave;
using transport::InboundMessage;
using transport::MessageKind;
using transport::OutboundMessage;

// Read on every call's path: defined here, where that path is, so that it
// is read directly rather than through another unit's TLS wrapper.
thread_local internal::InlineScope* internal::inline_scopes = nullptr;

StatusOr<std::shared_ptr<Channel>> Channel::Create(const std::string& address,
                                                   ChannelOptions options) {
  auto addr = transport::ParseAddress(address);
  if (!addr.ok()) return addr.status();
  if (Status s = CheckOptions(options); !s.ok()) return s;
  auto t = MakeTransport(options, addr->scheme, absl::StrCat("channel ", address));
  if (!t.ok()) return t.status();
  Resources own;
  own.transport = std::move(*t);
  if (options.callback_threads > 0) {
    auto callbacks =
        internal::ThreadPool::Create(options.callback_threads, "rpc-callback",
                                     absl::StrCat("the callbacks of channel ", address));
    if (!callbacks.ok()) return callbacks.status();
    own.callbacks = *std::move(callbacks);
  }
  auto timers =
      internal::TimerQueue::Create("rpc-timer", absl::StrCat("the timers of channel ", address));
  if (!timers.ok()) return timers.status();
  own.timers = *std::move(timers);
  return Own(new Channel(address, *addr, options, std::move(own), /*grouped=*/false));
}

Status Channel::CheckOptions(const ChannelOptions& options) {
  if (options.reconnect_backoff <= absl::ZeroDuration() ||
      options.reconnect_backoff_max < options.reconnect_backoff) {
    return Status(
        StatusCode::kInvalidArgument,
        absl::StrCat("reconnect_backoff is ", absl::FormatDuration(options.reconnect_backoff),
                     " and reconnect_backoff_max ",
                     absl::FormatDuration(options.reconnect_backoff_max),
                     "; the first must be positive and the second no smaller"));
  }
  if (options.callback_threads < 0) {
    return Status(StatusCode::kInvalidArgument,
                  absl::StrCat("callback_threads is ", options.callback_threads,
                               "; 0 runs callbacks inline, more runs them on that many threads"));
  }
  if (options.transport.tcp_fallback_upgrade < absl::ZeroDuration()) {
    return Status(StatusCode::kInvalidArgument,
                  absl::StrCat("transport.tcp_fallback_upgrade is ",
                               absl::FormatDuration(options.transport.tcp_fallback_upgrade),
                               "; zero never tries RDMA again, more tries it that long after"));
  }
  const RetryPolicy& retry = options.retry;
  if (retry.max_attempts < 1 || retry.initial_backoff <= absl::ZeroDuration() ||
      retry.max_backoff < retry.initial_backoff ||
      !(retry.multiplier >= 1.0)) {  // NaN fails every comparison
    return Status(
        StatusCode::kInvalidArgument,
        absl::StrCat("retry policy of max_attempts ", retry.max_attempts, ", initial_backoff ",
                     absl::FormatDuration(retry.initial_backoff), ", max_backoff ",
                     absl::FormatDuration(retry.max_backoff), ", multiplier ", retry.multiplier,
                     ": needs at least 1 attempt, a positive initial backoff no larger "
                     "than the most, and a multiplier of at least 1"));
  }
  return Status();
}

StatusOr<std::unique_ptr<transport::Transport>> Channel::MakeTransport(
    const ChannelOptions& options, const std::string& scheme, std::string name) {
  transport::TransportOptions topts;
  topts.max_message_size = options.max_message_size;
  topts.name = std::move(name);
  return transport::MakeTransport(scheme, topts, options.transport);
}

std::shared_ptr<Channel> Channel::Own(Channel* channel) {
  return std::shared_ptr<Channel>(channel, [](Channel* c) {
    // An inline callback runs on a thread the destructor waits for: the
    // transport's I/O thread (a lone channel's shutdown joins it, a grouped
    // one waits for its connection's OnClosed there), or the connector.
    // Destroyed in one, the channel would wait for itself.
    if (inline_scopes == nullptr) {
      delete c;
      return;
    }
    internal::RunOnOwnThread([c] { delete c; });
  });
}

Channel::Channel(std::string target, transport::Address addr, ChannelOptions options,
                 Resources resources, bool grouped)
    : target_(std::move(target)),
      addr_(std::move(addr)),
      options_(options),
      grouped_(grouped),
      callbacks_(std::move(resources.callbacks)),
      timers_(std::move(resources.timers)),
      transport_(std::move(resources.transport)) {}

Channel::~Channel() {
  // Pending calls on the connection end in OnClosed, the rest here, after
  // the connector's attempt is given up.
  StopConnector(/*shut_transport_down=*/!grouped_);
  if (grouped_) LeaveTransport();
  std::vector<Pending> rest;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    pending_.ForEach([&](uint64_t id, Pending&) {
      rest.emplace_back();
      pending_.Take(id, &rest.back());
    });
    waiting_.clear();  // before the transport their attachments came from
  }
  for (auto& p : rest) Deliver(std::move(p), Status(StatusCode::kUnavailable, "channel destroyed"));
  timers_->CancelAll(this);
  if (!callbacks_) return;
  if (!grouped_) {
    callbacks_->Stop();
  } else if (!callbacks_->InPool()) {
    // On one of the shared threads, the callbacks queued behind the one that
    // destroys the channel could only run after it: they run after the
    // destructor returns instead of deadlocking it.
    std::unique_lock<std::mutex> lock(posted_->mu);
    posted_->none.wait(lock, [&] { return posted_->count == 0; });
  }
}

void Channel::LeaveTransport() {
  std::vector<std::shared_ptr<transport::Connection>> conns;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    for (const Draining& d : draining_) conns.push_back(d.conn);
    if (conn_) conns.push_back(conn_);
  }
  for (auto& conn : conns) conn->Close();
  std::unique_lock<std::mutex> lock(watch_mu_);
  watch_done_.wait(lock, [&] {
    return std::all_of(watches_.begin(), watches_.end(), [](const auto& w) { return w->done; });
  });
}

Status Channel::Call(const MethodInfo& method, ClientContext* ctx,
                     const google::protobuf::MessageLite& request,
                     google::protobuf::MessageLite* response) {
  if (InlineScopeOf(this) != nullptr) {
    return Status(StatusCode::kFailedPrecondition,
                  absl::StrCat(method.full_name,
                               ": a blocking call from an inline callback of the same channel "
                               "(callback_threads = 0) could wait for the thread it blocks; use "
                               "CallAsync, or callback threads"));
  }
  // On the stack. A completion on another thread does all its work, notify
  // included, under `mu`, and this thread takes `mu` before returning, so the
  // completion is done with `result` by then (POSIX allows destroying an
  // unlocked mutex and a condition variable nobody waits on). A completion on
  // this thread (driven here, or a call that failed to start) needs neither.
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    std::atomic<bool> done{false};
    bool done_here = false;
    Status status;
    const std::thread::id caller = std::this_thread::get_id();
  } result;
  auto conn = Start(method, ctx, request, response,
                    [r = &result](Status s) {
                      if (std::this_thread::get_id() == r->caller) {
                        r->status = std::move(s);
                        r->done_here = true;
                        r->done.store(true, std::memory_order_relaxed);
                        return;
                      }
                      std::lock_guard<std::mutex> lock(r->mu);
                      r->status = std::move(s);
                      r->done.store(true, std::memory_order_release);
                      r->cv.notify_one();
                    },
                    /*inline_done=*/true);
  const auto done = [&result] { return result.done.load(std::memory_order_acquire); };
  // Run-to-completion where the transport offers it: the response is picked
  // up on this thread instead of being handed over by the I/O thread.
  if (conn && !done()) conn->Drive(done);
  RDMARPC_STAGE(kCallReturn);
  if (!result.done_here) {
    std::unique_lock<std::mutex> lock(result.mu);
    result.cv.wait(lock, done);
  }
  return std::move(result.status);
}

void Channel::CallAsync(const MethodInfo& method, ClientContext* ctx,
                        const google::protobuf::MessageLite& request,
                        google::protobuf::MessageLite* response, CallCallback done) {
  Start(method, ctx, request, response, std::move(done), /*inline_done=*/false);
}

std::shared_ptr<transport::Connection> Channel::Start(
    const MethodInfo& method, ClientContext* ctx, const google::protobuf::MessageLite& request,
    google::protobuf::MessageLite* response, CallCallback done, bool inline_done) {
  RDMARPC_STAGE(kCallStart);
  Pending p;
  p.method = method.full_name;
  p.response = response;
  p.done = std::move(done);
  p.inline_done = inline_done;
  if (!ctx->BeginCall()) {
    // Ended without its context: the other call's cancel hook, metadata and
    // results stay as they are, and no interceptor sees this one.
    Deliver(std::move(p),
            Status(StatusCode::kFailedPrecondition,
                   absl::StrCat(method.full_name,
                                ": its ClientContext belongs to a call that has not ended; "
                                "each call needs a ClientContext of its own")));
    return nullptr;
  }
  p.ctx = ctx;
  const auto fail = [&](StatusCode code, const std::string& msg) {
    Deliver(std::move(p), Status(code, absl::StrCat(method.full_name, ": ", msg)));
    return nullptr;
  };
  if (!options_.interceptors.empty() && !InterceptStart(*ctx, method, p)) {
    return fail(StatusCode::kUnknown, "an interceptor threw an exception");
  }

  // No clock read for a call without deadline (the common case): in a VM a
  // clock read is not free.
  const absl::Time deadline = ctx->steady_deadline();
  const bool has_deadline = deadline != absl::InfiniteFuture();
  if (has_deadline && SteadyNow() >= deadline) {
    return fail(StatusCode::kDeadlineExceeded, "deadline passed before the call started");
  }
  const bool has_metadata = !ctx->metadata().empty();
  if (Status s = has_metadata ? transport::ValidateMetadata(ctx->metadata()) : Status(); !s.ok()) {
    return fail(s.code(), std::string(s.message()));
  }
  const size_t size = request.ByteSizeLong();
  Attachment attachment = std::move(ctx->request_attachment_);
  if (size + attachment.size() > options_.max_message_size) {
    return fail(StatusCode::kResourceExhausted,
                absl::StrCat("request of ", size, " bytes",
                             attachment.empty()
                                 ? std::string()
                                 : absl::StrCat(" with an attachment of ", attachment.size(),
                                                " bytes"),
                             " exceeds max_message_size ", options_.max_message_size));
  }
  // Under a RetryPolicy the call keeps a copy of its request for the next
  // attempts; this one is sent from `request`, as any other.
  if (options_.retry.max_attempts > 1 && ctx->retryable() && attachment.empty()) {
    p.retry = MakeRetry(method, *ctx, request, size);
    if (p.retry == nullptr) {
      const Status none = transport::OutOfMemory(size, "the request's copy kept for retries");
      return fail(none.code(), std::string(none.message()));
    }
  }
  // Tracked first, so that from here on everything that ends the call goes
  // through Complete; with a connection up, one lock does both. Behind calls
  // that wait for the connector, a call waits too: it would overtake them.
  std::shared_ptr<transport::Connection> conn;
  Watch* watch = nullptr;
  uint64_t id = 0;
  bool cancelled = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (conn_ && !queueing_) {
      conn = conn_;
      watch = BeginSendLocked();
      id = TrackLocked(std::move(p), conn.get(), &cancelled);
    }
  }
  if (!conn) {
    Wait(method, std::move(p), request, size, std::move(attachment));
    return nullptr;
  }

  OutboundMessage msg;
  if (has_metadata) msg.metadata = transport::EncodeMetadata(ctx->metadata());
  msg.header.kind = MessageKind::kRequest;
  msg.header.method_id = method.id;
  msg.header.call_id = id;
  if (has_deadline) {
    msg.header.timeout_us = std::max<int64_t>(1, absl::ToInt64Microseconds(deadline - SteadyNow()));
  }
  // A call cancelled before it was sent ends unsent. (One that timed out
  // meanwhile is sent; its late response is dropped.)
  if (cancelled) {
    CancelHook(this, id);
    EndSend(watch, *conn);
    return nullptr;
  }
  RDMARPC_STAGE(kCallSend);
  const bool had_attachment = !attachment.empty();
  Status sent =
      internal::SendWithMessage(*conn, std::move(msg), std::move(attachment), request, size);
  if (ABSL_PREDICT_FALSE(!sent.ok())) {
    NotSent(method, id, *conn, watch, sent, had_attachment, request, size);
    return nullptr;
  }
  EndSend(watch, *conn);
  return conn;
}

void Channel::NotSent(const MethodInfo& method, uint64_t id, transport::Connection& conn,
                      Watch* watch, const Status& why, bool had_attachment,
                      const google::protobuf::MessageLite& request, size_t size) {
  // Refused unsent as its connection closed: the server never saw it. Not
  // one with an attachment, whose memory went with the refused send. Before
  // EndSend, after which the connection's loss ends the calls left on it.
  if (!had_attachment && transport::NeverSent(why)) {
    SendAgainUnsent(method, id, conn, why, request, size);
  } else {
    Complete(id, why, nullptr, false);
  }
  EndSend(watch, conn);
}

void Channel::SendAgainUnsent(const MethodInfo& method, uint64_t id, transport::Connection& conn,
                              const Status& why, const google::protobuf::MessageLite& request,
                              size_t size) {
  Waiting w;
  w.id = id;
  w.method_id = method.id;
  const bool kept = internal::SerializeForLater(request, size, &w.request);
  w.sent_again = true;
  std::shared_ptr<transport::Connection> idle;
  bool pending = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    // Its context lives while the call is pending, and only under mu_ is
    // that sure: its deadline may end it on another thread.
    if (Pending* p = pending_.Get(id); p != nullptr) {
      pending = true;
      // With or without the copy to send it again, no call may follow it
      // onto the connection that refused it.
      LetGoOfUnsentLocked(*p, conn, why, &idle);
      if (kept) {
        if (!p->ctx->metadata().empty()) w.metadata = transport::EncodeMetadata(p->ctx->metadata());
        w.wait_for_ready = p->ctx->wait_for_ready();
        waiting_.push_back(std::move(w));
        queueing_ = true;
        ++stats_.transparent_retries;
      }
    }
  }
  conn.Close();
  if (idle) idle->Close();
  if (!pending) return;
  if (!kept) {
    Complete(id, transport::OutOfMemory(size, "the request's copy kept to send it again"), nullptr,
             false);
    return;
  }
  WakeConnector();
}

void Channel::LetGoOfUnsentLocked(Pending& p, transport::Connection& conn, const Status& why,
                                  std::shared_ptr<transport::Connection>* idle) {
  if (!draining_.empty()) *idle = LeaveDrainingLocked(p.conn);
  p.conn = nullptr;  // a cancel meanwhile has no server to tell
  if (conn_.get() != &conn) return;
  // Closing (OnClosed follows): no call goes on it any more.
  conn_.reset();
  faster_give_up_.store(true, std::memory_order_relaxed);
  conn_watch_ = nullptr;
  conn_cleared_why_ = Status(StatusCode::kUnavailable, why.message());
  StateChangedLocked();
}

void Channel::CancelHook(void* channel, uint64_t call_id) {
  static_cast<Channel*>(channel)->Complete(
      call_id, Status(StatusCode::kCancelled, "cancelled by the client"), nullptr, true);
}

void Channel::Wait(const MethodInfo& method, Pending&& p,
                   const google::protobuf::MessageLite& request, size_t size,
                   Attachment attachment) {
  Waiting w;
  w.method_id = method.id;
  if (!internal::SerializeForLater(request, size, &w.request)) {
    const Status none =
        transport::OutOfMemory(size, "the request's copy kept until a connection is up");
    Deliver(std::move(p),
            Status(none.code(), absl::StrCat(method.full_name, ": ", none.message())));
    return;
  }
  ClientContext* const ctx = p.ctx;
  if (!ctx->metadata().empty()) w.metadata = transport::EncodeMetadata(ctx->metadata());
  w.attachment = std::move(attachment);
  w.wait_for_ready = ctx->wait_for_ready();
  bool cancelled = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    w.id = TrackLocked(std::move(p), nullptr, &cancelled);
    if (!cancelled) {
      waiting_.push_back(std::move(w));
      queueing_ = true;
    }
  }
  if (cancelled) {
    CancelHook(this, w.id);
    return;
  }
  WakeConnector();
}

StatusOr<Attachment> Channel::AllocateAttachment(size_t size, size_t message_room) {
  auto bytes = internal::AttachmentMemorySize(size, message_room, options_.max_message_size);
  if (!bytes.ok()) return bytes.status();
  auto conn = EnsureConnected();
  if (!conn.ok()) return conn.status();
  auto memory = (*conn)->AllocatePayload(*bytes);
  if (!memory.ok()) return memory.status();
  return Attachment(std::move(*memory), size);
}

uint64_t Channel::TrackLocked(Pending&& p, transport::Connection* conn, bool* cancelled) {
  p.conn = conn;
  ClientContext* const ctx = p.ctx;
  const absl::Time deadline = ctx->steady_deadline();
  const uint64_t id = pending_.Insert(std::move(p));
  calls_in_flight_.store(pending_.size(), std::memory_order_relaxed);
  *cancelled = ctx->SetCancelHook(&Channel::CancelHook, this, id);
  if (*cancelled) {
    // It ends unsent, so its cancel has no server to tell: a kCancel would
    // name a call id the server never saw.
    pending_.Get(id)->conn = nullptr;
    return id;
  }
  if (deadline != absl::InfiniteFuture()) {
    pending_.Get(id)->timer = timers_->Schedule(
        deadline,
        [this, id] {
          Complete(id, Status(StatusCode::kDeadlineExceeded, "deadline exceeded"), nullptr, true);
        },
        this);
  }
  return id;
}

ChannelStats Channel::stats() const {
  std::lock_guard<InlineMutex> lock(mu_);
  return stats_;
}

void Channel::Complete(uint64_t id, Status status, InboundMessage* msg, bool tell_server) {
  Pending p;
  std::shared_ptr<transport::Connection> conn;
  std::shared_ptr<transport::Connection> idle;  // a draining connection this call was last on
  // Decoded before the retry decision, which reads the status payloads
  // (rpc/retry_info.h). Most responses carry none.
  std::optional<StatusOr<Metadata>> md;
  if (msg != nullptr && !msg->metadata.empty()) {
    md = transport::DecodeMetadata(msg->metadata);
    if (md->ok()) {
      if (Status taken = transport::TakeStatusPayloads(&**md, &status); !taken.ok()) *md = taken;
    }
  }
  {
    std::unique_lock<InlineMutex> lock(mu_);
    // A cancel or the deadline (tell_server) ends a call for good.
    if (options_.retry.max_attempts > 1 && !tell_server && !status.ok() &&
        RetryLocked(id, status, &idle)) {
      lock.unlock();
      if (idle) idle->Close();
      return;
    }
    if (!pending_.Take(id, &p)) return;  // already ended (late response, timer, cancel)
    calls_in_flight_.store(pending_.size(), std::memory_order_relaxed);
    if (!draining_.empty()) idle = LeaveDrainingLocked(p.conn);
    if (p.conn == nullptr && status.code() == StatusCode::kDeadlineExceeded) {
      status =
          Status(StatusCode::kDeadlineExceeded,
                 absl::StrCat("deadline exceeded while connecting to ", target_,
                              backoff_ == absl::ZeroDuration()
                                  ? std::string()
                                  : absl::StrCat("; the last attempt: ", last_failure_.message())));
    }
    // Only a cancel needs the connection; copying it for every response
    // cost two atomic read-modify-writes per call.
    if (tell_server && p.conn != nullptr) {
      if (conn_.get() == p.conn) {
        conn = conn_;
      } else {
        for (const Draining& d : draining_) {
          if (d.conn.get() == p.conn) conn = d.conn;
        }
      }
    }
  }
  if (status.ok() && options_.retry.max_attempts > 1 && options_.retry.throttle) {
    options_.retry.throttle->RecordSuccess();
  }
  if (p.timer != 0) timers_->Cancel(p.timer);
  if (conn) {
    OutboundMessage cancel;
    cancel.header.kind = MessageKind::kCancel;
    cancel.header.call_id = id;
    conn->Send(std::move(cancel)).IgnoreError();  // best effort: the call is over here
  }
  if (idle) idle->Close();
  // Errors made here get the method's name; a handler's own status reaches
  // the caller unchanged. UNIMPLEMENTED is the server runtime's, which knows
  // only the method id.
  bool made_here = msg == nullptr;
  if (md && !md->ok()) {
    status = Status(StatusCode::kInternal, absl::StrCat("bad response metadata from ", target_,
                                                        ": ", md->status().message()));
    made_here = true;
  } else if (md) {
    p.ctx->server_metadata_ = std::move(**md);
  }
  if (msg != nullptr && status.ok()) {
    // The payload is the attachment, then the message.
    const size_t att = msg->header.attachment_len;
    if (att > msg->payload.size()) {  // a transport's bug, not the server's
      status = Status(StatusCode::kInternal,
                      absl::StrCat("response from ", target_, " has an attachment of ", att,
                                   " bytes in a payload of ", msg->payload.size()));
      made_here = true;
    } else if (const internal::Parsed parsed = internal::ParseMessage(
                   *p.response,
                   absl::string_view(msg->payload.data() + att, msg->payload.size() - att));
               parsed != internal::Parsed::kOk) {
      status = parsed == internal::Parsed::kMalformed
                   ? Status(StatusCode::kInternal,
                            absl::StrCat("response from ", target_, " does not parse as ",
                                         p.response->GetTypeName()))
                   : transport::OutOfMemory(msg->payload.size() - att,
                                            absl::StrCat("a response from ", target_, " (",
                                                         p.response->GetTypeName(), ")"));
      made_here = true;
    } else if (att > 0) {
      // Kept in place unless it sits in a receive slot, which the SRQ needs
      // back; those are small, so the copy is cheap.
      if (msg->payload_on_loan) {
        p.ctx->response_attachment_ =
            Attachment::CopyOf(absl::string_view(msg->payload.data(), att));
      } else {
        p.ctx->response_attachment_ = Attachment(std::move(msg->payload), att);
      }
    }
  }
  if (!status.ok() && (made_here || status.code() == StatusCode::kUnimplemented) &&
      status.message().find(p.method) == absl::string_view::npos) {
    Status named(status.code(), absl::StrCat(p.method, ": ", status.message()));
    status.ForEachPayload([&named](absl::string_view type_url, const absl::Cord& payload) {
      named.SetPayload(type_url, payload);
    });
    status = std::move(named);
  }
  RDMARPC_STAGE(kResponseParsed);
  Deliver(std::move(p), std::move(status));
}

bool Channel::InterceptStart(ClientContext& ctx, const MethodInfo& method, Pending& p) {
  for (const auto& interceptor : options_.interceptors) {
    ++p.intercepted;
    if (!internal::RunUserCode("an interceptor's OnStart", method.full_name,
                               [&] { interceptor->OnStart(ctx, method.full_name); })) {
      return false;
    }
  }
  return true;
}

std::unique_ptr<Channel::Retry> Channel::MakeRetry(const MethodInfo& method,
                                                   const ClientContext& ctx,
                                                   const google::protobuf::MessageLite& request,
                                                   size_t size) {
  auto retry = std::make_unique<Retry>();
  retry->method_id = method.id;
  if (!internal::SerializeForLater(request, size, &retry->request)) return nullptr;
  if (!ctx.metadata().empty()) retry->metadata = transport::EncodeMetadata(ctx.metadata());
  retry->wait_for_ready = ctx.wait_for_ready();
  retry->backoff = options_.retry.initial_backoff;
  return retry;
}

bool Channel::RetryLocked(uint64_t id, const Status& status,
                          std::shared_ptr<transport::Connection>* idle) {
  Pending* p = pending_.Get(id);
  const RetryPolicy& policy = options_.retry;
  if (p == nullptr || std::find(policy.retryable_codes.begin(), policy.retryable_codes.end(),
                                status.code()) == policy.retryable_codes.end()) {
    return false;
  }
  // Every call's failure counts, the ones that are never retried included:
  // they say as much about the server.
  const bool throttled = policy.throttle != nullptr && !policy.throttle->RecordFailure();
  if (p->retry == nullptr) return false;
  Retry& retry = *p->retry;
  if (retry.attempts >= policy.max_attempts) return false;
  const std::optional<absl::Duration> pushback = RetryDelay(status);
  if (pushback && *pushback < absl::ZeroDuration()) return false;
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  const absl::Time at = SteadyNow() + (pushback ? *pushback : retry.backoff * jitter(jitter_));
  if (at >= p->ctx->steady_deadline()) return false;
  if (throttled) {
    ++stats_.retries_throttled;
    return false;
  }
  ++retry.attempts;
  retry.backoff = pushback ? policy.initial_backoff
                           : std::min(retry.backoff * policy.multiplier, policy.max_backoff);
  ++stats_.retries;
  if (!draining_.empty()) *idle = LeaveDrainingLocked(p->conn);
  p->conn = nullptr;  // a cancel meanwhile has no server to tell
  // The id stays the call's: its deadline timer and cancel hook still find
  // it, and a retry finds nothing once either has ended it.
  timers_->Schedule(
      at, [this, id] { Resend(id); }, this);
  return true;
}

void Channel::Resend(uint64_t id) {
  if (balancer_ != nullptr && ResendElsewhere(id)) return;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    Pending* p = pending_.Get(id);
    if (p == nullptr) return;  // ended while it backed off
    waiting_.push_back(Waiting::ForRetry(id, *p->retry));
    queueing_ = true;
  }
  WakeConnector();
}

bool Channel::ResendElsewhere(uint64_t id) {
  std::vector<Pending> cancelled;
  {
    // Held throughout, so that the BalancedChannel, and with it `other`,
    // outlives the move: its destructor waits for the link.
    std::lock_guard<std::mutex> link(balancer_->mu);
    if (balancer_->owner == nullptr) return false;
    Channel* other = balancer_->owner->PickForRetry(*this);
    if (other == nullptr) return false;
    MoveToLocked(id, nullptr, *other, &ChannelStats::retries_elsewhere, &cancelled);
  }
  // Out of the link: the callback may destroy the BalancedChannel.
  EndCancelled(cancelled);
  return true;
}

void Channel::GiveWaitingElsewhere(std::vector<Waiting>& calls) {
  std::vector<Pending> cancelled;
  {
    std::lock_guard<std::mutex> link(balancer_->mu);
    if (balancer_->owner == nullptr) return;
    GiveWaitingLocked(*balancer_->owner, calls, &cancelled);
  }
  EndCancelled(cancelled);
}

void Channel::TakeWaitingOfOthers() {
  std::vector<Pending> cancelled;
  {
    std::lock_guard<std::mutex> link(balancer_->mu);
    BalancedChannel* owner = balancer_->owner;
    if (owner == nullptr) return;
    for (const auto& backend : owner->backends()) {
      if (backend.get() != this) backend->OfferWaitingLocked(*owner, &cancelled);
    }
  }
  // Here, not on the backends they waited on, which may go once the link is
  // let go of; the backends share their group's options and threads.
  EndCancelled(cancelled);
}

void Channel::OfferWaitingLocked(BalancedChannel& owner, std::vector<Pending>* cancelled) {
  std::vector<Waiting> movable;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (conn_) return;  // its connector sends them
    auto stays = std::stable_partition(waiting_.begin(), waiting_.end(),
                                       [](const Waiting& w) { return !w.attachment.empty(); });
    movable.assign(std::make_move_iterator(stays), std::make_move_iterator(waiting_.end()));
    waiting_.erase(stays, waiting_.end());
  }
  if (movable.empty()) return;
  GiveWaitingLocked(owner, movable, cancelled);
  if (movable.empty()) return;
  {
    // None was READY after all (the new connection lost already): they wait
    // here again, ahead of the calls that came meanwhile.
    std::lock_guard<InlineMutex> lock(mu_);
    waiting_.insert(waiting_.begin(), std::make_move_iterator(movable.begin()),
                    std::make_move_iterator(movable.end()));
    queueing_ = true;
  }
  WakeConnector();
}

void Channel::GiveWaitingLocked(BalancedChannel& owner, std::vector<Waiting>& calls,
                                std::vector<Pending>* cancelled) {
  std::vector<Waiting> stay;
  for (Waiting& w : calls) {
    Channel* other = w.attachment.empty() ? owner.PickForRetry(*this) : nullptr;
    if (other == nullptr) {
      stay.push_back(std::move(w));
      continue;
    }
    MoveToLocked(w.id, &w, *other, &ChannelStats::waits_elsewhere, cancelled);
  }
  calls.swap(stay);
}

void Channel::MoveToLocked(uint64_t id, Waiting* w, Channel& other, uint64_t ChannelStats::*moves,
                           std::vector<Pending>* cancelled) {
  Pending p;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (!pending_.Take(id, &p)) return;  // ended while it waited or backed off
    calls_in_flight_.store(pending_.size(), std::memory_order_relaxed);
    ++(stats_.*moves);
  }
  if (p.timer != 0) timers_->Cancel(p.timer);
  Waiting moved = w != nullptr ? std::move(*w) : Waiting::ForRetry(0, *p.retry);
  // A TryCancel from here on finds nothing here, and one after
  // ClearCancelHook no hook: the first is seen now, the second by Adopt.
  if (p.ctx->ClearCancelHook() || !other.Adopt(p, std::move(moved))) {
    cancelled->push_back(std::move(p));
  }
}

void Channel::EndCancelled(std::vector<Pending>& cancelled) {
  for (Pending& p : cancelled) {
    Deliver(std::move(p), Status(StatusCode::kCancelled, "cancelled by the client"));
  }
}

bool Channel::Adopt(Pending& p, Waiting w) {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    bool cancelled = false;
    w.id = TrackLocked(std::move(p), nullptr, &cancelled);
    if (cancelled) {
      pending_.Take(w.id, &p);
      calls_in_flight_.store(pending_.size(), std::memory_order_relaxed);
      return false;
    }
    waiting_.push_back(std::move(w));
    queueing_ = true;
  }
  WakeConnector();
  return true;
}

void Channel::InterceptEnd(const Pending& p, const Status& status) {
  for (size_t i = p.intercepted; i-- > 0;) {
    internal::RunUserCode("an interceptor's OnEnd", p.method,
                          [&] { options_.interceptors[i]->OnEnd(*p.ctx, p.method, status); });
  }
}

void Channel::Deliver(Pending&& p, Status status) {
  if (p.ctx != nullptr) p.ctx->EndCall();
  if (p.intercepted != 0) InterceptEnd(p, status);
  if (p.inline_done) {  // the blocking Call's own, which does not throw
    std::move(p.done)(std::move(status));
    return;
  }
  // Wherever it runs (a callback thread, the I/O thread, the timer thread),
  // a throw would end the process; its call has ended already.
  auto run = [done = std::move(p.done), status = std::move(status), method = p.method]() mutable {
    internal::RunUserCode("the callback", method, [&] { std::move(done)(std::move(status)); });
  };
  if (callbacks_) {
    if (grouped_) {
      PostCounted(std::move(run));
    } else {
      callbacks_->Post(std::move(run));
    }
    return;
  }
  if (InlineScope* running = InlineScopeOf(this)) {
    running->deferred.push_back(std::move(run));
    return;
  }
  InlineScope scope{this, inline_scopes, {}};
  inline_scopes = &scope;
  std::move(run)();
  RunDeferredAndLeave(scope);
}

void Channel::PostCounted(absl::AnyInvocable<void() &&> run) {
  {
    std::lock_guard<std::mutex> lock(posted_->mu);
    ++posted_->count;
  }
  const auto finished = [](Posted& posted) {
    std::lock_guard<std::mutex> lock(posted.mu);
    if (--posted.count == 0) posted.none.notify_all();
  };
  // Holds the count, not the channel, which the callback may destroy.
  if (!callbacks_->Post([posted = posted_, run = std::move(run), finished]() mutable {
        std::move(run)();
        finished(*posted);
      })) {
    finished(*posted_);
  }
}

void Channel::OnMessage(transport::Connection& conn, InboundMessage&& msg) {
  if (msg.header.kind != MessageKind::kResponse) {
    fprintf(stderr, "rdmarpc[channel %s]: ignoring message kind %d from %s\n", target_.c_str(),
            static_cast<int>(msg.header.kind), conn.peer().c_str());
    return;
  }
  const uint16_t code = msg.header.status;
  if (!msg.payload_status.ok()) {
    Complete(msg.header.call_id, std::move(msg.payload_status), nullptr, false);
  } else if (code != 0) {
    const absl::string_view text(msg.payload.data(), msg.payload.size());
    // A code from a newer or broken peer ends the call UNKNOWN, as in gRPC,
    // with the number kept for whoever reads the error.
    Status s = code <= static_cast<uint16_t>(StatusCode::kUnauthenticated)
                   ? Status(static_cast<StatusCode>(code), text)
                   : Status(StatusCode::kUnknown,
                            absl::StrCat("status code ", code, " from ", conn.peer(),
                                         ", unknown here: ", text));
    msg.payload.Reset();
    Complete(msg.header.call_id, std::move(s), &msg, false);
  } else {
    Complete(msg.header.call_id, Status(), &msg, false);
  }
}

void Channel::OnGoAway(Watch& watch, transport::Connection& conn) {
  // The next call connects anew: to the server's successor, or it fails to
  // connect (waits, if wait-for-ready) instead of being refused by a server
  // that is going away.
  {
    std::lock_guard<InlineMutex> lock(mu_);
    // Counted as it comes, whatever becomes of its connection: once the
    // count shows it, the channel knows.
    if (!std::exchange(watch.go_away, true)) ++stats_.go_aways;
    // Not conn_: draining already, or not adopted yet (EnsureConnected
    // and TryFasterWay then see go_away).
    if (conn_.get() != &conn) return;
    DrainLocked(std::move(conn_));  // leaves conn_ null
    faster_give_up_.store(true, std::memory_order_relaxed);
    conn_cleared_why_ =
        Status(StatusCode::kUnavailable, absl::StrCat(target_, " is shutting down (GOAWAY)"));
    StateChangedLocked();
    conn_watch_ = nullptr;
    // With a send under way there is a call on it, and EndSend acks.
    if (watch.sending.fetch_or(Watch::kGoAwayBit, std::memory_order_acq_rel) != 0) return;
  }
  AckGoAway(conn, /*tell_server=*/true);
}

void Channel::DrainLocked(std::shared_ptr<transport::Connection> conn) {
  size_t calls = 0;
  pending_.ForEach([&](uint64_t, Pending& p) {
    if (p.conn == conn.get()) ++calls;
  });
  draining_.push_back(Draining{std::move(conn), calls});
}

std::shared_ptr<transport::Connection> Channel::LeaveDrainingLocked(
    const transport::Connection* conn) {
  if (conn == nullptr || conn == conn_.get()) return nullptr;
  for (Draining& d : draining_) {
    if (d.conn.get() != conn) continue;
    assert(d.calls > 0 && "only the calls counted by DrainLocked leave a draining connection");
    return --d.calls == 0 && d.acknowledged ? d.conn : nullptr;
  }
  return nullptr;
}

Channel::Watch* Channel::BeginSendLocked() {
  conn_watch_->sending.fetch_add(Watch::kSender, std::memory_order_relaxed);
  return conn_watch_;
}

void Channel::EndSend(Watch* watch, transport::Connection& conn) {
  const uint32_t before = watch->sending.fetch_sub(Watch::kSender, std::memory_order_acq_rel);
  // The last send with a bit set: kSender plus 1 to 3. One comparison on the
  // fast path.
  if (before - (Watch::kSender + 1) < Watch::kSender - 1) EndLastSend(*watch, conn, before);
}

void Channel::EndLastSend(Watch& watch, transport::Connection& conn, uint32_t bits) {
  if (bits & Watch::kGoAwayBit) AckGoAway(conn, /*tell_server=*/!watch.moved);
  if (bits & Watch::kLostBit) EndLostCalls(watch, conn);
}

void Channel::AckGoAway(transport::Connection& conn, bool tell_server) {
  if (tell_server) {
    OutboundMessage ack;
    ack.header.kind = MessageKind::kGoAway;
    conn.Send(std::move(ack)).IgnoreError();  // lost with its connection, which ends the wait
  }
  // Closed here when no call is left on it: none was when the GOAWAY came,
  // or the last ended while the acknowledgment waited for a send. Else the
  // last call to leave closes it.
  bool idle = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    for (Draining& d : draining_) {
      if (d.conn.get() != &conn) continue;
      d.acknowledged = true;
      idle = d.calls == 0;
    }
  }
  if (idle) conn.Close();
}

void Channel::OnClosed(Watch& watch, transport::Connection& conn, const absl::Status& why) {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    watch.lost = true;
    watch.lost_why = Status(StatusCode::kUnavailable,
                            absl::StrCat("connection to ", conn.peer(), " lost: ", why.message()));
    if (conn_.get() == &conn) {
      conn_.reset();
      faster_give_up_.store(true, std::memory_order_relaxed);
      conn_cleared_why_ =
          Status(StatusCode::kUnavailable,
                 absl::StrCat("connection to ", conn.peer(), " lost (", why.message(), ")"));
      conn_watch_ = nullptr;
      StateChangedLocked();
    }
    draining_.erase(std::remove_if(draining_.begin(), draining_.end(),
                                   [&](const Draining& d) { return d.conn.get() == &conn; }),
                    draining_.end());
    if (watch.sending.fetch_or(Watch::kLostBit, std::memory_order_acq_rel) >= Watch::kSender) {
      return;  // the last send under way ends the calls (EndSend)
    }
  }
  EndLostCalls(watch, conn);
}

void Channel::EndLostCalls(Watch& watch, transport::Connection& conn) {
  std::vector<uint64_t> lost;
  Status why;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    why = watch.lost_why;
    pending_.ForEach([&](uint64_t id, Pending& p) {
      if (p.conn == &conn) lost.push_back(id);
    });
  }
  for (uint64_t id : lost) Complete(id, why, nullptr, false);
  // Last: once `done` is seen, the channel may be destroyed.
  std::lock_guard<std::mutex> lock(watch_mu_);
  watch.done = true;
  watch_done_.notify_all();
}

}  // namespace rdmarpc
