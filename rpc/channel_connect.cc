// The channel's connecting: the connector thread that makes one attempt for
// the calls waiting for a connection, the reconnect backoff, the states that
// GetState and WaitForConnected report, and the move of an auto:// channel
// from a connection that went the slower way (TCP) to one the faster way
// (RDMA). The call path, GOAWAY and loss are in rpc/channel.cc.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/new_thread.h"
#include "base/steady_clock.h"
#include "rpc/balanced_channel.h"
#include "rpc/channel.h"
#include "rpc/internal/channel_watch.h"
#include "rpc/internal/inline_scope.h"
#include "rpc/internal/payload.h"

namespace rdmarpc {

using internal::inline_scopes;
using internal::InlineScope;
using internal::InlineScopeOf;
using internal::RunDeferredAndLeave;
using transport::MessageKind;
using transport::OutboundMessage;

void Channel::WakeConnector(bool faster) {
  std::lock_guard<std::mutex> lock(connector_->mu);
  // A timer or an I/O thread's call as the channel goes: StopConnector may
  // have returned, and a connector started now would outlive the channel.
  if (connector_->stop) return;
  if (faster) {
    connector_->faster = true;
  } else {
    connector_->wanted = true;
  }
  if (connector_->running) return;
  auto thread = NewThread("rpc-connector", absl::StrCat("the connector of channel ", target_),
                          [this, connector = connector_] { RunConnector(this, connector); });
  if (thread.ok()) {
    connector_->running = true;
    thread->detach();
    return;
  }
  // No attempt without a thread: the calls waiting fail as after an attempt
  // that failed, and the next attempt, after the backoff, tries for a thread
  // again; a try of the faster way is put off as after one that failed. On
  // the timer thread, where calls end at their deadlines: whoever woke the
  // connector (a call, an I/O thread) may hold what ending a call takes.
  // Under connector_->mu, not stopped: ~Channel's CancelAll drops it.
  timers_->Schedule(
      SteadyNow(), [this, why = thread.status()] { FailWithoutConnector(why); }, this);
}

void Channel::FailWithoutConnector(const Status& why) {
  bool wanted;
  bool faster;
  {
    std::lock_guard<std::mutex> lock(connector_->mu);
    // A connector that started meanwhile does what was asked.
    if (connector_->stop || connector_->running) return;
    wanted = std::exchange(connector_->wanted, false);
    faster = std::exchange(connector_->faster, false);
  }
  if (faster) {
    absl::Duration next = absl::ZeroDuration();
    {
      std::lock_guard<InlineMutex> lock(mu_);
      if (TryFasterLaterLocked()) next = faster_wait_;
    }
    if (next > absl::ZeroDuration()) {
      fprintf(stderr, "rdmarpc[channel %s]: no try of the faster way now (%s); the next in %s\n",
              target_.c_str(), std::string(why.message()).c_str(),
              absl::FormatDuration(next).c_str());
    }
  }
  if (!wanted) return;
  const Status failure(StatusCode::kUnavailable,
                       absl::StrCat("cannot reach ", target_, ": ", why.message()));
  std::shared_ptr<transport::Connection> conn;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    conn = conn_;  // made meanwhile by another way (a faster one's try)
    if (!conn) {
      ++stats_.connect_attempts;
      EndFailedAttemptLocked(SteadyNow(), failure);
    }
  }
  SendWaiting(conn ? StatusOr<std::shared_ptr<transport::Connection>>(std::move(conn)) : failure,
              /*refused_by_go_away=*/false);
}

void Channel::RunConnector(Channel* channel, std::shared_ptr<Connector> connector) {
  for (;;) {
    bool wanted;
    bool faster;
    {
      std::lock_guard<std::mutex> lock(connector->mu);
      if (connector->stop || (!connector->wanted && !connector->faster)) {
        connector->running = false;
        connector->idle.notify_all();
        return;
      }
      wanted = std::exchange(connector->wanted, false);
      faster = std::exchange(connector->faster, false);
    }
    // Calls waiting for a connection first: they wait on no other thread.
    if (wanted) channel->ConnectForWaiting();
    if (faster) channel->TryFasterWay();
  }
}

Channel::Watch* Channel::NewWatch() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  // One with a send under way is still in use: EndSend reads it.
  watches_.erase(std::remove_if(watches_.begin(), watches_.end(),
                                [](const auto& w) {
                                  return w->done && w->sending.load(std::memory_order_acquire) <
                                                        Watch::kSender;
                                }),
                 watches_.end());
  watches_.push_back(std::make_unique<Watch>(this));
  return watches_.back().get();
}

void Channel::ScheduleFasterLocked(absl::Duration wait) {
  timers_->Cancel(faster_timer_);
  faster_timer_ = timers_->Schedule(
      SteadyNow() + wait, [this] { WakeConnector(/*faster=*/true); }, this);
}

bool Channel::TryFasterLaterLocked() {
  if (!StillSlowerLocked()) return false;
  faster_wait_ = std::min(faster_wait_ * 2, options_.transport.tcp_fallback_upgrade * 12);
  ScheduleFasterLocked(faster_wait_);
  return true;
}

void Channel::OnMayGoFaster(Watch& watch, transport::Connection& conn) {
  if (options_.transport.tcp_fallback_upgrade <= absl::ZeroDuration()) return;
  std::lock_guard<InlineMutex> lock(mu_);
  if (conn_watch_ != &watch || conn_.get() != &conn || slower_conn_ != nullptr ||
      !transport_->MayGoFaster(addr_, conn)) {
    return;
  }
  slower_conn_ = &conn;
  faster_wait_ = options_.transport.tcp_fallback_upgrade;
  // Every TCP client of that server hears it at once: their first tries
  // spread over the second half of the wait rather than come together.
  ScheduleFasterLocked(faster_wait_ * std::uniform_real_distribution<double>(0.5, 1.0)(jitter_));
}

void Channel::TryFasterWay() {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (!StillSlowerLocked()) return;
  }
  // Not beside another attempt: EnsureConnected sets conn_ too. It waits
  // only where conn_ was lost, which ends this try (faster_give_up_).
  std::lock_guard<std::mutex> connecting(connect_mu_);
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (!StillSlowerLocked()) return;
    faster_give_up_.store(false);
  }
  {
    // After the store above: StopConnector sets stop, then gives up.
    std::lock_guard<std::mutex> lock(connector_->mu);
    if (connector_->stop) return;
  }
  Watch* watch = NewWatch();
  auto conn = transport_->ConnectFaster(addr_, watch, SteadyNow() + options_.connect_timeout,
                                        faster_give_up_);
  if (!conn.ok()) {
    {
      std::lock_guard<std::mutex> lock(watch_mu_);
      watch->done = true;
    }
    std::lock_guard<InlineMutex> lock(mu_);
    TryFasterLaterLocked();
    return;
  }
  std::shared_ptr<transport::Connection> slower;
  size_t calls = 0;
  bool end_drain = false;
  bool acknowledge = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (watch->go_away) {
      // As in EnsureConnected: the server's GOAWAY came first; it waits for
      // the acknowledgment.
      watch->sending.fetch_or(Watch::kGoAwayBit, std::memory_order_acq_rel);
      acknowledge = true;
      DrainLocked(*conn);
    } else if (!watch->lost && StillSlowerLocked()) {
      slower = std::move(conn_);
      Watch* slower_watch = conn_watch_;
      slower_watch->moved = true;
      DrainLocked(slower);
      calls = draining_.back().calls;
      conn_ = *conn;
      conn_watch_ = watch;
      slower_conn_ = nullptr;
      ++stats_.upgrades;
      // With a send under way there is a call on it, and EndSend ends the drain.
      end_drain = slower_watch->sending.fetch_or(Watch::kGoAwayBit, std::memory_order_acq_rel) == 0;
    } else {
      TryFasterLaterLocked();  // lost as soon as it was made
    }
  }
  if (acknowledge) AckGoAway(**conn, /*tell_server=*/true);  // and closes it: no call went on it
  if (!slower) {
    if (!acknowledge) (*conn)->Close();  // conn_ was lost or replaced meanwhile
    return;
  }
  const std::string closes =
      calls == 0
          ? std::string("now")
          : absl::StrCat("once its ", calls, calls == 1 ? " call has" : " calls have", " ended");
  fprintf(stderr,
          "rdmarpc[channel %s]: %s reaches the server again: new calls go there, and the "
          "connection %s closes %s\n",
          target_.c_str(), (*conn)->peer().c_str(), slower->peer().c_str(), closes.c_str());
  if (end_drain) AckGoAway(*slower, /*tell_server=*/false);
}

void Channel::ConnectForWaiting() {
  bool once;
  // Whether anyone still wants an attempt: a call that has not ended (a
  // deadline or a cancel ends one while it waits), WaitForConnected, or the
  // GetState(true) taken here. Needs mu_.
  const auto wanted_locked = [&] {
    waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(),
                                  [&](const Waiting& w) { return pending_.Get(w.id) == nullptr; }),
                   waiting_.end());
    if (!waiting_.empty()) return true;
    queueing_ = false;
    return !conn_ && (connect_waiters_ > 0 || once);
  };
  absl::Time retry_after;
  bool was_ready;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    once = std::exchange(connect_once_, false);
    if (!wanted_locked()) return;
    retry_after = retry_after_;
    was_ready = conn_ != nullptr;
  }
  if (retry_after != absl::InfinitePast()) {
    // Not before the backoff after a failed attempt ends; calls wait for it.
    std::unique_lock<std::mutex> lock(connector_->mu);
    WaitUntil(connector_->wake, lock, retry_after, [&] { return connector_->stop; });
    if (connector_->stop) return;
  }
  // Bounded by connect_timeout alone, not by the calls' deadlines: calls
  // that come while it runs may have later ones. A deadline ends its call by
  // the call's timer.
  bool refused_by_go_away = false;
  auto connected = EnsureConnected(&refused_by_go_away, wanted_locked);
  // The calls ended meanwhile, or the channel goes (its destructor ends them).
  if (absl::IsCancelled(connected.status())) return;
  {
    // The destructor ends the waiting calls.
    std::lock_guard<std::mutex> lock(connector_->mu);
    if (connector_->stop) return;
  }
  SendWaiting(connected, refused_by_go_away);
  if (connected.ok() && !was_ready && balancer_ != nullptr) TakeWaitingOfOthers();
}

void Channel::SendWaiting(const StatusOr<std::shared_ptr<transport::Connection>>& connected,
                          bool refused_by_go_away) {
  std::vector<Waiting> batch;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    batch.swap(waiting_);
  }
  // Inline callbacks (callback_threads = 0) run after every call of the
  // batch is sent or ended, not between: what one does to the channel (a
  // new call, dropping it) finds the batch done.
  InlineScope scope{this, inline_scopes, {}};
  inline_scopes = &scope;
  // Under a BalancedChannel, the calls that this attempt failed go to a
  // backend that is READY, if one is, rather than fail or wait here.
  if (!connected.ok() && balancer_ != nullptr) GiveWaitingElsewhere(batch);
  // A call that found no connection ends with `why`, unless it is
  // wait-for-ready: then it waits for the next attempt (unless nothing ever
  // could connect). One kept from being sent by a connection that it was
  // about to go on (drained by a GOAWAY, lost, or closed under the send)
  // waits for the next attempt once in any case: the server never saw it,
  // and a call made a moment later would get that attempt too (gRPC's
  // transparent retry).
  std::vector<Waiting> again;
  Status last_not_sent;
  uint64_t unseen_again = 0;
  const auto not_sent = [&](Waiting& w, const Status& why, bool unseen) {
    if ((w.wait_for_ready && !absl::IsInvalidArgument(why)) ||
        (unseen && !std::exchange(w.sent_again, true))) {
      unseen_again += unseen;
      last_not_sent = why;
      again.push_back(std::move(w));
    } else {
      Complete(w.id, why, nullptr, false);
    }
  };
  for (Waiting& w : batch) {
    if (!connected.ok()) {
      not_sent(w, connected.status(), refused_by_go_away);
      continue;
    }
    OutboundMessage msg;
    msg.header.kind = MessageKind::kRequest;
    msg.header.method_id = w.method_id;
    msg.header.call_id = w.id;
    // Over conn_, which OnClosed clears before it ends the calls on it: the
    // connection made above may be lost already.
    std::shared_ptr<transport::Connection> conn;
    Watch* watch = nullptr;
    Status cleared_why;
    {
      std::lock_guard<InlineMutex> lock(mu_);
      Pending* p = pending_.Get(w.id);
      if (p == nullptr) continue;  // ended while waiting: a deadline, a cancel
      conn = conn_;
      if (conn) {
        p->conn = conn.get();
        watch = BeginSendLocked();
      } else {
        cleared_why = conn_cleared_why_;
      }
      const absl::Time deadline = p->ctx->steady_deadline();
      if (deadline != absl::InfiniteFuture()) {
        msg.header.timeout_us =
            std::max<int64_t>(1, absl::ToInt64Microseconds(deadline - SteadyNow()));
      }
    }
    if (!conn) {
      not_sent(w,
               Status(StatusCode::kUnavailable,
                      absl::StrCat(cleared_why.message(), " before the call was sent")),
               /*unseen=*/true);
      continue;
    }
    // A copy: a send refused unsent leaves the call what it needs for the
    // next connection (but for an attachment, which goes with the send).
    msg.metadata = w.metadata;
    const bool had_attachment = !w.attachment.empty();
    Status sent =
        internal::SendWithSerialized(*conn, std::move(msg), std::move(w.attachment), w.request);
    if (sent.ok() || had_attachment || !transport::NeverSent(sent)) {
      if (!sent.ok()) Complete(w.id, sent, nullptr, false);
      EndSend(watch, *conn);
      continue;
    }
    // Refused unsent: the call leaves the connection before EndSend, after
    // which the connection's loss ends the calls left on it (as in Call).
    std::shared_ptr<transport::Connection> idle;
    bool pending;
    {
      std::lock_guard<InlineMutex> lock(mu_);
      Pending* p = pending_.Get(w.id);
      pending = p != nullptr;
      if (pending) LetGoOfUnsentLocked(*p, *conn, sent, &idle);
    }
    EndSend(watch, *conn);
    conn->Close();
    if (idle) idle->Close();
    if (pending) not_sent(w, sent, /*unseen=*/true);
  }
  // A connection lost (or drained) before it carried a call is no success,
  // whether its calls wait here again or go elsewhere: without a backoff, a
  // server that accepts and drops would be tried again at once. (The calls
  // of an attempt that failed went elsewhere above, if they could.)
  const bool lost_unused = connected.ok() && !again.empty();
  if (lost_unused && balancer_ != nullptr) GiveWaitingElsewhere(again);
  bool another_round;
  absl::Time retry_after;
  {
    // Calls that came meanwhile wait for the next round, in order, behind
    // those that wait again.
    std::lock_guard<InlineMutex> lock(mu_);
    waiting_.insert(waiting_.begin(), std::make_move_iterator(again.begin()),
                    std::make_move_iterator(again.end()));
    stats_.transparent_retries += unseen_again;
    queueing_ = !waiting_.empty();
    if (lost_unused && backoff_ == absl::ZeroDuration()) {
      StartBackoffLocked(SteadyNow(), last_not_sent);
    }
    another_round = !again.empty() || (!conn_ && connect_waiters_ > 0);
    retry_after = retry_after_;
  }
  if (another_round) {
    std::lock_guard<std::mutex> lock(connector_->mu);
    connector_->wanted = true;
    // Not on the connector's thread (FailWithoutConnector): it tries for
    // one again once the backoff ends.
    if (!connector_->running && !connector_->stop) {
      timers_->Schedule(
          std::max(retry_after, SteadyNow()), [this] { WakeConnector(); }, this);
    }
  }
  RunDeferredAndLeave(scope);
}

void Channel::StopConnector(bool shut_transport_down) {
  {
    std::lock_guard<std::mutex> lock(connector_->mu);
    connector_->stop = true;
    connector_->wake.notify_all();
  }
  faster_give_up_.store(true);
  connect_give_up_.store(true);
  if (shut_transport_down) transport_->Shutdown();
  // Never on the connector thread: Own moves a destruction out of the
  // inline callbacks it runs.
  std::unique_lock<std::mutex> lock(connector_->mu);
  connector_->idle.wait(lock, [&] { return !connector_->running; });
}

StatusOr<std::shared_ptr<transport::Connection>> Channel::EnsureConnected(
    bool* go_away, absl::FunctionRef<bool()> wanted_locked) {
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (conn_) return conn_;
  }
  // An inline callback may be running on the very thread that connecting
  // waits for (the transport's I/O or connection-event thread).
  if (InlineScopeOf(this) != nullptr) {
    return Status(StatusCode::kUnavailable,
                  absl::StrCat("not connected to ", target_,
                               ", and an inline callback (callback_threads = 0) does not wait "
                               "for a connection; connect from another thread"));
  }
  std::lock_guard<std::mutex> connecting(connect_mu_);
  const absl::Time start = SteadyNow();
  {
    std::lock_guard<InlineMutex> lock(mu_);
    if (conn_) return conn_;  // another caller connected meanwhile
    if (Status s = BackoffLocked(start); !s.ok()) return s;
    if (!wanted_locked()) {
      return Status(StatusCode::kCancelled, "no call waits for a connection any more");
    }
    connecting_ = true;
    ++stats_.connect_attempts;
    StateChangedLocked();
  }
  Watch* watch = NewWatch();
  auto conn =
      transport_->ConnectUnless(addr_, watch, start + options_.connect_timeout, connect_give_up_);
  Status failure;
  if (!conn.ok()) {
    {
      // A connection that Connect did not return gets no callback.
      std::lock_guard<std::mutex> lock(watch_mu_);
      watch->done = true;
    }
    if (connect_give_up_.load()) {
      // No failure of the server's: the channel goes, and ends the calls.
      std::lock_guard<InlineMutex> lock(mu_);
      connecting_ = false;
      StateChangedLocked();
      return Status(StatusCode::kCancelled, absl::StrCat("the channel to ", target_, " goes"));
    }
    // A configuration that cannot work (a GID named on a device that does
    // not exist, or of the wrong address family) stays INVALID_ARGUMENT:
    // UNAVAILABLE would invite retries that can never succeed.
    failure =
        absl::IsInvalidArgument(conn.status())
            ? Status(StatusCode::kInvalidArgument,
                     absl::StrCat("cannot connect to ", target_, ": ", conn.status().message()))
            : Status(StatusCode::kUnavailable,
                     absl::StrCat("cannot reach ", target_, ": ", conn.status().message()));
  }
  bool acknowledge = false;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    connecting_ = false;
    StateChangedLocked();
    if (failure.ok() && watch->lost) {
      failure = Status(StatusCode::kUnavailable,
                       absl::StrCat("connection to ", target_, " lost as soon as it was made"));
    } else if (failure.ok() && watch->go_away) {
      // The server began to shut down as we connected, and its GOAWAY came
      // before we took the connection. It takes no call: it is acknowledged
      // (the server waits for that; nothing was sent on it, so the
      // acknowledgment is ours) and then closed.
      watch->sending.fetch_or(Watch::kGoAwayBit, std::memory_order_acq_rel);
      acknowledge = true;
      DrainLocked(*conn);
      failure =
          Status(StatusCode::kUnavailable,
                 absl::StrCat(target_, " is shutting down (GOAWAY as the connection was made)"));
      if (go_away != nullptr) *go_away = true;
    }
    if (failure.ok()) {
      backoff_ = absl::ZeroDuration();
      retry_after_ = absl::InfinitePast();
      stats_.last_connect_error = Status();
      conn_ = *conn;
      conn_watch_ = watch;
      // Under mu_: a server that comes to listen the faster way as this
      // runs is seen here, or by OnMayGoFaster once conn_ is set.
      const bool may_go_faster = options_.transport.tcp_fallback_upgrade > absl::ZeroDuration() &&
                                 transport_->MayGoFaster(addr_, *conn_);
      slower_conn_ = may_go_faster ? conn_.get() : nullptr;
      if (may_go_faster) {
        faster_wait_ = options_.transport.tcp_fallback_upgrade;
        ScheduleFasterLocked(faster_wait_);
      }
      return conn_;
    }
    EndFailedAttemptLocked(start, failure);
  }
  if (acknowledge) AckGoAway(**conn, /*tell_server=*/true);  // and closes it: no call went on it
  return failure;
}

void Channel::EndFailedAttemptLocked(absl::Time start, const Status& failure) {
  StartBackoffLocked(start, failure);
  ++stats_.connect_failures;
  stats_.last_connect_error = failure;
}

void Channel::StartBackoffLocked(absl::Time start, const Status& failure) {
  // As gRPC: the wait runs from the start of the failed attempt, grows by
  // 1.6 per further failure, and varies by +-20% so that clients cut off
  // together do not come back together.
  backoff_ = backoff_ == absl::ZeroDuration()
                 ? options_.reconnect_backoff
                 : std::min(backoff_ * 1.6, options_.reconnect_backoff_max);
  retry_after_ = start + backoff_ * std::uniform_real_distribution<double>(0.8, 1.2)(jitter_);
  last_failure_ = failure;
  StateChangedLocked();
}

Status Channel::BackoffLocked(absl::Time now) const {
  if (now >= retry_after_) return Status();
  return Status(
      last_failure_.code(),
      absl::StrCat(last_failure_.message(), "; not trying again for ",
                   absl::FormatDuration(absl::Ceil(retry_after_ - now, absl::Milliseconds(1))),
                   " (ChannelOptions::reconnect_backoff)"));
}

const char* ChannelStateName(ChannelState state) {
  switch (state) {
    case ChannelState::kIdle:
      return "IDLE";
    case ChannelState::kConnecting:
      return "CONNECTING";
    case ChannelState::kReady:
      return "READY";
    case ChannelState::kTransientFailure:
      return "TRANSIENT_FAILURE";
  }
  return "UNKNOWN";
}

ChannelState Channel::StateLocked() const {
  if (conn_) return ChannelState::kReady;
  if (connecting_) return ChannelState::kConnecting;
  // A success resets the backoff: one that is running follows a failure.
  if (backoff_ != absl::ZeroDuration()) return ChannelState::kTransientFailure;
  return ChannelState::kIdle;
}

void Channel::StateChangedLocked() {
  state_changed_.notify_all();
  if (balancer_ != nullptr) balancer_->StateChanged();
}

ChannelState Channel::GetState(bool try_to_connect) {
  ChannelState state;
  {
    std::lock_guard<InlineMutex> lock(mu_);
    state = StateLocked();
    if (!try_to_connect || state == ChannelState::kReady || state == ChannelState::kConnecting) {
      return state;
    }
    connect_once_ = true;
  }
  WakeConnector();
  return state;
}

bool Channel::WaitForStateChange(ChannelState last, absl::Time deadline) {
  std::unique_lock<InlineMutex> lock(mu_);
  return WaitUntil(state_changed_, lock, FromWallClock(deadline),
                   [&] { return StateLocked() != last; });
}

bool Channel::WaitForConnected(absl::Time deadline) {
  std::unique_lock<InlineMutex> lock(mu_);
  if (conn_) return true;
  if (InlineScopeOf(this) != nullptr) {
    connect_once_ = true;
    lock.unlock();
    WakeConnector();
    return false;
  }
  ++connect_waiters_;
  lock.unlock();
  WakeConnector();
  lock.lock();
  const bool connected =
      WaitUntil(state_changed_, lock, FromWallClock(deadline), [&] { return conn_ != nullptr; });
  --connect_waiters_;
  return connected;
}

}  // namespace rdmarpc
