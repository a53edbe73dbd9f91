#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/new_thread.h"
#include "base/steady_clock.h"
#include "transport/address_race.h"
#include "transport/attempt_errors.h"
#include "transport/listen_on_each.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_transport_internal.h"

namespace rdmarpc::transport::rdma {
namespace {

bool IsLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
}

// Why a connect or listen cannot be made by a transport without a channel:
// `failure` is what failed, with its errno.
absl::Status NoChannel(const std::pair<const char*, int>& failure, internal::Doing doing) {
  const auto& [what, err] = failure;
  absl::Status why = absl::UnavailableError(absl::StrCat(what, " failed: ", strerror(err)));
  // Out of descriptors, the devices are not what to look at.
  if (err == EMFILE) return WithFileLimitAdvice(std::move(why), err);
  return WithWhatToDo(std::move(why), internal::DevicesAndTry(doing));
}

}  // namespace

// --------------------------------------------------------------- transport

RdmaTransport::RdmaTransport(TransportOptions options, RdmaOptions rdma, bool server)
    : options_(std::move(options)), rdma_(std::move(rdma)), server_(server) {
  channel_ = rdma_create_event_channel();
  if (!channel_) channel_failure_ = {"rdma_create_event_channel", errno};
  wake_fd_ = NewWakeFd(FaultInjection::WakeFdOf::kTransport);
  if (channel_ && wake_fd_ < 0) {
    // Without its wake-up the CM thread would see tasks only at its next
    // event or relisten: as good as no channel.
    channel_failure_ = {"eventfd for the rdma_cm thread", errno};
    rdma_destroy_event_channel(channel_);
    channel_ = nullptr;
  }
  if (channel_) {
    fcntl(channel_->fd, F_SETFL, fcntl(channel_->fd, F_GETFL) | O_NONBLOCK);
    auto thread = NewThread("rdma-cm", absl::StrCat("the rdma_cm events of ", options_.name),
                            [this] { CmLoop(); });
    if (thread.ok()) {
      cm_thread_ = *std::move(thread);
      cm_thread_id_.store(cm_thread_.get_id());
    } else {
      no_cm_thread_ = thread.status();
      rdma_destroy_event_channel(channel_);
      channel_ = nullptr;
    }
  }
  if (!channel_) cm_exited_ = true;
}

absl::Status RdmaTransport::Unusable() const {
  if (!no_cm_thread_.ok()) return no_cm_thread_;
  if (channel_ == nullptr && channel_failure_.second == EMFILE) {
    return NoChannel(channel_failure_,
                     server_ ? internal::Doing::kListen : internal::Doing::kConnect);
  }
  return absl::OkStatus();
}

RdmaTransport::~RdmaTransport() {
  Shutdown();
  if (channel_) rdma_destroy_event_channel(channel_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

size_t RdmaTransport::receive_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const auto& [ctx, ep] : endpoints_) total += ep->receive_bytes();
  return total;
}

Endpoint::CompletionQueueUse RdmaTransport::completion_queue_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  Endpoint::CompletionQueueUse total;
  for (const auto& [ctx, ep] : endpoints_) {
    const Endpoint::CompletionQueueUse use = ep->completion_queue_use();
    total.queues += use.queues;
    total.entries += use.entries;
    total.reserved += use.reserved;
  }
  return total;
}

bool RdmaTransport::QueueOnCm(std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    if (cm_exited_) return false;
    tasks_.push_back(std::move(task));
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  return true;
}

void RdmaTransport::RunAfterCm(const std::function<void()>& task) {
  if (std::this_thread::get_id() == cm_thread_id_.load()) return task();  // it holds the lock
  std::lock_guard<std::mutex> lock(late_tasks_mu_);
  task();
}

void RdmaTransport::RunOnCm(std::function<void()> task) {
  if (!QueueOnCm(task)) RunAfterCm(task);
}

void RdmaTransport::RunOnCmAndWait(std::function<void()> task) {
  if (std::this_thread::get_id() == cm_thread_id_.load()) return task();
  std::promise<void> done;
  std::function<void()> queued = [&] {
    task();
    done.set_value();
  };
  if (!QueueOnCm(queued)) return RunAfterCm(task);
  done.get_future().wait();
}

void RdmaTransport::CmLoop() {
  while (!stop_.load()) {
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {channel_->fd, POLLIN, 0}};
    poll(fds, cm_events_stopped_ ? 1 : 2, RelistenDue());
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      (void)!read(wake_fd_, &v, sizeof v);
    }
    std::vector<std::function<void()>> tasks;
    {
      std::lock_guard<std::mutex> lock(tasks_mu_);
      tasks.swap(tasks_);
    }
    for (auto& t : tasks) t();
    DestroyRetiredIds();
    LetGoOfRemovedDevices();
    rdma_cm_event* ev = nullptr;
    while (!cm_events_stopped_ && rdma_get_cm_event(channel_, &ev) == 0) {
      HandleEvent(ev);
      DestroyRetiredIds();
    }
  }
  // The last tasks; any queued later run where they are queued (RunAfterCm),
  // one at a time with these.
  std::lock_guard<std::mutex> late(late_tasks_mu_);
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    tasks.swap(tasks_);
    cm_exited_ = true;
  }
  for (auto& t : tasks) t();
  DestroyRetiredIds();
  // Before the lock goes: a thread that reuses this one's id must take it.
  cm_thread_id_.store(std::thread::id());
}

int RdmaTransport::RelistenDue() {
  using Clock = std::chrono::steady_clock;
  std::chrono::milliseconds wait{1000};
  if (cm_events_stopped_) return static_cast<int>(wait.count());
  const Clock::time_point now = Clock::now();
  for (auto it = orphaned_listeners_.begin(); it != orphaned_listeners_.end();) {
    RdmaListener* listener = *it;
    if (listener->relisten_at > now) {
      wait =
          std::min(wait, std::chrono::ceil<std::chrono::milliseconds>(listener->relisten_at - now));
      ++it;
      continue;
    }
    sockaddr_storage at = listener->bound_at();
    auto id = BindAndListen(&at);
    if (!id.ok()) {
      if (rdma_.trace) {
        TraceLine(options_.name, absl::StrCat("listen again on ", listener->address().ToString(),
                                              ": ", id.status().message()));
      }
      listener->relisten_at = now + kRelistenInterval;
      wait = std::min(wait, kRelistenInterval);
      ++it;
      continue;
    }
    listener->set_id(*id);
    cm_targets_[*id] = CmTarget{nullptr, listener, {}};
    fprintf(stderr,
            "rdmarpc[%s]: RDMA device %s serves the listener on %s again: it takes RDMA "
            "connections\n",
            options_.name.c_str(), ibv_get_device_name((*id)->verbs->device),
            listener->address().ToString().c_str());
    it = orphaned_listeners_.erase(it);
  }
  return static_cast<int>(wait.count());
}

void RdmaTransport::LetGoOfRemovedDevices() {
  const auto now = std::chrono::steady_clock::now();
  if (now < next_device_check_) return;
  next_device_check_ = now + kRemovedDeviceCheck;
  std::vector<std::shared_ptr<Endpoint>> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    for (auto it = endpoints_.begin(); it != endpoints_.end();) {
      Endpoint* ep = it->second.get();
      if (!ep->device_removed() || std::any_of(conns_.begin(), conns_.end(), [ep](const auto& c) {
            return c.second->endpoint() == ep;
          })) {
        ++it;
        continue;
      }
      described_.erase(ep);
      gone.push_back(std::move(it->second));
      it = endpoints_.erase(it);
    }
  }
  for (const std::shared_ptr<Endpoint>& ep : gone) {
    // Connections on it are gone, and new ones are made on this thread: none
    // can be using the poller now.
    ep->Stop();
    fprintf(stderr,
            "rdmarpc[%s]: RDMA device %s was removed: let go of it (its memory and queues go "
            "once the last message received on it is released)\n",
            options_.name.c_str(), ep->device_name().c_str());
  }
}

absl::StatusOr<rdma_cm_id*> RdmaTransport::BindAndListen(sockaddr_storage* at) {
  rdma_cm_id* id = nullptr;
  if (rdma_create_id(channel_, &id, nullptr, RDMA_PS_TCP) != 0) {
    absl::Status failed = absl::UnavailableError(absl::StrCat("rdma_create_id: ", strerror(errno)));
    failed.SetPayload(internal::kEndWithDevices, absl::Cord());
    return failed;
  }
  if (rdma_bind_addr(id, reinterpret_cast<sockaddr*>(at)) != 0 || rdma_listen(id, 1024) != 0) {
    const int err = errno;
    absl::Status failed = BindError(err);
    // A port taken or privileged is no device's doing.
    if (err != EADDRINUSE && err != EACCES) {
      failed.SetPayload(internal::kEndWithDevices, absl::Cord());
    }
    rdma_destroy_id(id);
    return failed;
  }
  return id;
}

void RdmaTransport::DestroyRetiredIds() {
  for (rdma_cm_id* id : retired_ids_) rdma_destroy_id(id);
  retired_ids_.clear();
}

std::string RdmaTransport::PeerOf(rdma_cm_id* id) const {
  return absl::StrCat("rdma://", SockaddrString(rdma_get_peer_addr(id)));
}

absl::StatusOr<Endpoint*> RdmaTransport::EndpointFor(rdma_cm_id* id) {
  if (absl::Status s = CheckDeviceAndPort(id, rdma_); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu_);
  auto& ep = endpoints_[id->verbs];
  if (!ep) {
    RdmaOptions sized = rdma_;
    sized.cq_entries = InitialCqEntries(rdma_, server_);
    auto made = Endpoint::Create(id->verbs, sized,
                                 server_ ? Endpoint::Side::kServer : Endpoint::Side::kClient,
                                 options_.name, options_.memory_quota);
    if (!made.ok()) {
      endpoints_.erase(id->verbs);
      return made.status();
    }
    ep = std::move(*made);
  }
  return ep.get();
}

void RdmaTransport::DescribeOnce(const Endpoint* ep, rdma_cm_id* id, RdmaConnection& conn) {
  if (!described_.insert(ep).second) return;
  fprintf(stderr, "rdmarpc[%s]: RDMA %s, %zu receive slots of %zu bytes on one SRQ; %s\n",
          options_.name.c_str(), DescribeChoice(id).c_str(),
          server_ ? rdma_.server_receive_slots : rdma_.client_receive_slots, rdma_.slot_size,
          conn.DescribeRetryPolicy().c_str());
}

void RdmaTransport::SetAckTimeout(rdma_cm_id* id) {
  const int exp = AckTimeoutExponent(rdma_.peer_timeout_ms);
  if (exp < 0) return;
  uint8_t value = static_cast<uint8_t>(exp);
  if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &value, sizeof value) != 0 &&
      !ack_timeout_warned_) {
    ack_timeout_warned_ = true;
    fprintf(stderr,
            "rdmarpc[%s]: cannot set the QP ACK timeout (rdma_set_option: %s; kernel before "
            "4.17?): RdmaOptions::peer_timeout_ms is not applied, a vanished peer is noticed "
            "after the device's default\n",
            options_.name.c_str(), strerror(errno));
  }
}

void RdmaTransport::SetRnrWait(rdma_cm_id* id) {
  // rdma_cm moves the QP through RTR with min_rnr_timer 0 (655 ms) and has
  // no option for it, but RTS to RTS may change it. On the passive side
  // this runs right after rdma_accept, which sent the REP: a SEND of the
  // peer's that beat it and found the SRQ empty would wait 655 ms once. The
  // active side runs it on ESTABLISHED, before the server can have had
  // anything to answer.
  ibv_qp_attr attr{};
  attr.min_rnr_timer = RnrTimerCode(rdma_.rnr_wait_us);
  if (ibv_modify_qp(id->qp, &attr, IBV_QP_MIN_RNR_TIMER) == 0 || rnr_wait_warned_) return;
  const int err = errno;
  rnr_wait_warned_ = true;
  fprintf(stderr,
          "rdmarpc[%s]: cannot set the RNR NAK timer on %s (ibv_modify_qp: %s): "
          "RdmaOptions::rnr_wait_us is not applied, so a peer whose SEND finds our receive "
          "queue empty waits what rdma_cm set (655 ms); raise server_receive_slots or "
          "client_receive_slots to make that rarer\n",
          options_.name.c_str(), DescribeChoice(id).c_str(), strerror(err));
}

void RdmaTransport::Track(const std::shared_ptr<RdmaConnection>& conn) {
  Count(&RdmaCounters::connections_opened);
  conn->set_on_freed([this](RdmaConnection* c, rdma_cm_id* id) {
    // The CM thread owns the ids: a poller that destroyed one would wait for
    // the CM thread's acks while the CM thread may wait for the poller.
    RunOnCm([this, id] {
      cm_targets_.erase(id);
      rdma_destroy_id(id);
    });
    {
      std::lock_guard<std::mutex> lock(mu_);
      conns_.erase(c);
    }
    cv_.notify_all();
  });
  std::lock_guard<std::mutex> lock(mu_);
  conns_[conn.get()] = conn;
}

uint32_t RdmaTransport::LocalCredits(const Endpoint& ep) const {
  return rdma_.strict_credits ? ep.StrictWindow(ep.ConfiguredWindow()) : ep.JoiningWindow();
}

Handshake RdmaTransport::LocalHandshake(const Endpoint& ep, uint32_t credits) const {
  Handshake hs;
  hs.credits = credits;
  // A shared window grows back as connections leave; any other stays put.
  hs.max_credits = ep.shares_credits() ? std::max(credits, ep.ConfiguredWindow()) : credits;
  hs.slot_size = static_cast<uint32_t>(rdma_.slot_size);
  hs.release_timeout_ms = rdma_.release_timeout_ms;
  return hs;
}

absl::StatusOr<std::shared_ptr<Connection>> RdmaTransport::Connect(const Address& addr,
                                                                   ConnectionObserver* observer,
                                                                   absl::Time deadline) {
  static const std::atomic<bool> never{false};
  return ConnectUnless(addr, observer, deadline, never);
}

absl::StatusOr<std::shared_ptr<Connection>> RdmaTransport::ConnectUnless(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>& give_up) {
  if (absl::Status s = CheckRdmaOptions(rdma_, server_); !s.ok()) return s;
  if (!channel_) {
    return no_cm_thread_.ok() ? NoChannel(channel_failure_, internal::Doing::kConnect)
                              : no_cm_thread_;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return absl::FailedPreconditionError("transport is shut down");
  }
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  auto src = NamedGidAddress(rdma_, 0);
  if (!src.ok()) return src.status();
  std::vector<SocketAddress> reachable = ThisHostForUnspecified(*addresses, *src, addr.port);
  if (src->has_value()) {
    // A named GID reaches the addresses of its own family only, and no
    // loopback one: the kernel would look for that on the GID's interface
    // and wait out the deadline for an ARP answer that never comes.
    reachable.erase(
        std::remove_if(reachable.begin(), reachable.end(),
                       [&](const SocketAddress& a) {
                         return a.storage.ss_family != (*src)->ss_family ||
                                IsLoopback(reinterpret_cast<const sockaddr*>(&a.storage));
                       }),
        reachable.end());
  }
  if (reachable.empty()) {
    const auto family = [](const sockaddr_storage& a) {
      return a.ss_family == AF_INET ? "IPv4" : "IPv6";
    };
    const std::string gid_host = SockaddrHost(reinterpret_cast<const sockaddr*>(&**src));
    const std::string named =
        absl::StrCat("connect to ", addr.ToString(), ": RdmaOptions names device ", rdma_.device,
                     " gid_index ", rdma_.gid_index, ", whose address ", gid_host);
    const bool same_family = std::any_of(
        addresses->begin(), addresses->end(),
        [&](const SocketAddress& a) { return a.storage.ss_family == (*src)->ss_family; });
    if (same_family) {
      return absl::InvalidArgumentError(absl::StrCat(
          named, " is on a real interface and cannot reach a loopback address. Reach this host at ",
          gid_host, ", with its server listening there or on a wildcard, or name no GID."));
    }
    const sockaddr_storage& dst = addresses->front().storage;
    return absl::InvalidArgumentError(
        absl::StrCat(named, " is ", family(**src), " and cannot reach an ", family(dst),
                     " address. Name the GID that holds an ", family(dst),
                     " address (`rdma link`, `ibv_devinfo -v`; an IPv4 one reads ::ffff:a.b.c.d), "
                     "or name no GID."));
  }
  // Each address (address_race.h): a name may resolve to an address no
  // device routes, one the server does not listen on ([::1] for
  // "localhost", where the server took 127.0.0.1), or one that never answers.
  auto conn = TryEachAddress<std::shared_ptr<RdmaConnection>>(
      reachable, deadline, /*name_each=*/false,
      [&](const SocketAddress& a, const std::atomic<bool>& lost) {
        auto made =
            internal::EndWithDevices(ConnectTo(a.storage, *src, observer, deadline, give_up, lost),
                                     internal::Doing::kConnect);
        if (made.ok()) FaultInjection::AfterConnect();
        return made;
      },
      [](std::shared_ptr<RdmaConnection>&& extra) {
        // Its caller never sees it: nor does the observer hear it close.
        extra->DetachObserver();
        extra->Close();
      },
      [](const absl::Status& s) { return absl::IsFailedPrecondition(s) || absl::IsCancelled(s); });
  if (conn.ok()) return std::shared_ptr<Connection>(std::move(*conn));
  if (reachable.size() == 1) return conn.status();
  return Prefixed(conn.status().code(),
                  absl::StrCat("connect to ", addr.ToString(), ", each of its ", reachable.size(),
                               " addresses"),
                  conn.status());
}

absl::StatusOr<std::shared_ptr<RdmaConnection>> RdmaTransport::ConnectTo(
    sockaddr_storage dst, std::optional<sockaddr_storage> src, ConnectionObserver* observer,
    absl::Time deadline, const std::atomic<bool>& give_up, const std::atomic<bool>& lost) {
  auto at = std::make_shared<Attempt>();
  at->target = absl::StrCat("rdma://", SockaddrString(reinterpret_cast<sockaddr*>(&dst)));
  at->loopback = IsLoopback(reinterpret_cast<sockaddr*>(&dst)) ||
                 IsUnspecified(reinterpret_cast<sockaddr*>(&dst));
  at->observer = observer;
  auto result = at->done.get_future();
  const int timeout_ms = static_cast<int>(std::clamp<int64_t>(
      absl::ToInt64Milliseconds(deadline - SteadyNow()), 1, rdma_.connect_timeout_ms));
  RunOnCmAndWait([&] {
    if (cm_events_stopped_) return at->Finish(absl::UnavailableError("transport shutting down"));
    if (rdma_create_id(channel_, &at->id, nullptr, RDMA_PS_TCP) != 0) {
      return at->Finish(absl::UnavailableError(absl::StrCat("rdma_create_id: ", strerror(errno))));
    }
    // Before the route is resolved: rdma_cm puts the class into the path
    // (and the connect request, whose path the server's QP takes).
    if (rdma_.type_of_service >= 0) {
      uint8_t tos = static_cast<uint8_t>(rdma_.type_of_service);
      if (rdma_set_option(at->id, RDMA_OPTION_ID, RDMA_OPTION_ID_TOS, &tos, sizeof tos) != 0) {
        const int err = errno;
        rdma_destroy_id(at->id);
        return at->Finish(absl::UnavailableError(
            absl::StrCat("connect to ", at->target, ": rdma_set_option(RDMA_OPTION_ID_TOS, ",
                         rdma_.type_of_service, "): ", strerror(err),
                         "; set RdmaOptions::type_of_service (RDMARPC_RDMA_TOS) to -1 to use "
                         "rdma_cm's default")));
      }
    }
    cm_targets_[at->id] = CmTarget{at, nullptr, {}};
    sockaddr* from = src.has_value() ? reinterpret_cast<sockaddr*>(&*src) : nullptr;
    if (rdma_.trace) {
      TraceLine(options_.name,
                absl::StrCat(at->target, ": resolving the address",
                             from ? absl::StrCat(" from ", SockaddrString(from), " (gid_index ",
                                                 rdma_.gid_index, ")")
                                  : "; rdma_cm picks the device"));
    }
    if (rdma_resolve_addr(at->id, from, reinterpret_cast<sockaddr*>(&dst), timeout_ms) != 0) {
      const int err = errno;
      cm_targets_.erase(at->id);
      rdma_destroy_id(at->id);
      absl::Status why = absl::UnavailableError(absl::StrCat(
          "rdma_resolve_addr ", at->target,
          from ? absl::StrCat(" from ", SockaddrString(from), " (RdmaOptions::gid_index)") : "",
          ": ", strerror(err), at->loopback ? internal::kLoopbackHint : ""));
      why.SetPayload(internal::kEndWithDevices, absl::Cord());
      // No RDMA path there: TCP may still reach the peer.
      why.SetPayload(kNotReachableThisWay,
                     absl::Cord(absl::StrCat("rdma_resolve_addr: ", strerror(err))));
      at->Finish(std::move(why));
    }
  });
  // In slices, to see give_up: a few wake-ups per connect, off any fast path.
  bool ready = false;
  bool gave_up = false;
  while (!ready && !gave_up && SteadyNow() < deadline) {
    ready = WaitUntilReady(result, std::min(deadline, SteadyNow() + kGiveUpCheck));
    gave_up =
        !ready && (give_up.load(std::memory_order_relaxed) || lost.load(std::memory_order_relaxed));
  }
  if (!ready && !WaitUntilReady(result, absl::InfinitePast())) {
    RunOnCmAndWait([&] {
      if (at->finished) return;
      if (at->conn) {
        // rdma_connect is out, and librdmacm moves the QP (CONNECT_RESPONSE)
        // or errors it (REJECTED) inside rdma_get_cm_event on this thread:
        // off the id, the QP is no longer its to move, and the teardown may
        // destroy it on the poller. The id goes after it, on this thread,
        // and with it the request, which rdma_cm would otherwise repeat
        // for as long as a minute and more.
        const std::shared_ptr<RdmaConnection>& conn = at->conn;
        conn->endpoint()->RunOnPollerAndWait([&] { conn->TakeQpFromId(); });
      }
      AbandonAttempt(at.get());
      at->Finish(gave_up ? absl::CancelledError(
                               absl::StrCat("connecting to ", at->target, ": given up early"))
                         : NothingAnswered(absl::DeadlineExceededError(
                               absl::StrCat("connecting to ", at->target, " timed out"))));
    });
  }
  absl::Status s = result.get();
  if (!s.ok()) return s;
  return at->conn;
}

void RdmaTransport::AbandonAttempt(Attempt* at) {
  // CM thread. The id is either still the attempt's or owned by at->conn.
  // Before the attempt finishes: its caller may then destroy the observer.
  cm_targets_.erase(at->id);
  if (at->conn) {
    auto conn = std::move(at->conn);
    conn->DetachObserver();
    conn->endpoint()->RunOnPoller([conn] {
      conn->Teardown(absl::UnavailableError("connect abandoned"));
    });
  } else {
    retired_ids_.push_back(at->id);
  }
}

absl::StatusOr<std::unique_ptr<Listener>> RdmaTransport::Listen(const Address& addr,
                                                                AcceptCallback on_accept) {
  if (absl::Status s = CheckRdmaOptions(rdma_, server_); !s.ok()) return s;
  if (!channel_) {
    return no_cm_thread_.ok() ? NoChannel(channel_failure_, internal::Doing::kListen)
                              : no_cm_thread_;
  }
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  auto named = NamedGidAddress(rdma_, addr.port);
  if (!named.ok()) return named.status();
  Address listening = addr;
  if (named->has_value()) {
    // The named GID decides where to listen: a wildcard becomes its address,
    // any other name must have it among its addresses.
    const sockaddr_storage& gid_addr = **named;
    const std::string gid_host = SockaddrHost(reinterpret_cast<const sockaddr*>(&gid_addr));
    const bool fits =
        std::any_of(addresses->begin(), addresses->end(), [&](const SocketAddress& a) {
          const sockaddr* sa = reinterpret_cast<const sockaddr*>(&a.storage);
          return IsUnspecified(sa) || SockaddrHost(sa) == gid_host;
        });
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "listen on ", addr.ToString(), ": RdmaOptions names device ", rdma_.device,
          " gid_index ", rdma_.gid_index, ", whose address is ", gid_host,
          ". Listen on that address or on a wildcard (0.0.0.0), or name no GID."));
    }
    SocketAddress only{};
    only.storage = gid_addr;
    only.len = gid_addr.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    *addresses = {only};
    listening.host = gid_host;
  }
  auto listener = ListenOnEachAddress(*addresses, options_.name, [&](const SocketAddress& a) {
    return internal::EndWithDevices(ListenAt(a, listening, on_accept), internal::Doing::kListen);
  });
  if (!listener.ok()) {
    return Prefixed(listener.status().code(), absl::StrCat("listen on ", addr.ToString()),
                    listener.status());
  }
  return listener;
}

absl::StatusOr<std::unique_ptr<Listener>> RdmaTransport::ListenAt(const SocketAddress& at,
                                                                  const Address& asked,
                                                                  AcceptCallback on_accept) {
  absl::Status status;
  std::unique_ptr<RdmaListener> listener;
  RunOnCmAndWait([&] {
    sockaddr_storage local = at.storage;
    auto listening = BindAndListen(&local);
    if (!listening.ok()) {
      status = listening.status();
      return;
    }
    rdma_cm_id* id = *listening;
    Address bound = asked;
    bound.scheme = "rdma";
    bound.port = ntohs(rdma_get_src_port(id));
    listener = std::make_unique<RdmaListener>(this, id, bound, std::move(on_accept));
    if (rdma_.trace) {
      TraceLine(options_.name, absl::StrCat("listening on ", bound.ToString(), " at ",
                                            SockaddrString(rdma_get_local_addr(id))));
    }
    cm_targets_[id] = CmTarget{nullptr, listener.get(), {}};
    if (IsLoopback(reinterpret_cast<const sockaddr*>(&local))) {
      // rdma_cm takes a connection to a loopback address to a device of its
      // choosing, which must loop it back; Soft-RoCE has no path there.
      fprintf(stderr,
              "rdmarpc[%s]: listening over RDMA on %s, a loopback address: only clients on this "
              "host reach it, and only over a device that loops back (Soft-RoCE does not). To "
              "serve RDMA clients, listen on the address of an interface with an RDMA port, or "
              "on 0.0.0.0.\n",
              options_.name.c_str(), SockaddrString(rdma_get_local_addr(id)).c_str());
    }
  });
  if (!status.ok()) return status;
  return std::unique_ptr<Listener>(std::move(listener));
}

void RdmaTransport::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (!channel_) return;
  // From here the CM thread runs tasks but takes no more events: librdmacm
  // moves or errors a connecting QP inside rdma_get_cm_event
  // (CONNECT_RESPONSE, REJECTED), which must not race with the teardowns
  // below destroying QPs on the pollers. Connects in progress end now.
  RunOnCmAndWait([this] {
    cm_events_stopped_ = true;
    for (auto it = cm_targets_.begin(); it != cm_targets_.end();) {
      const std::shared_ptr<Attempt>& at = it->second.attempt;
      // A connection's id goes with it (on_freed), in the teardowns below;
      // its caller hears only how Connect ended.
      if (at && at->conn) at->conn->DetachObserver();
      if (at) at->Finish(absl::UnavailableError("transport shutting down"));
      if (at && !at->conn) {
        retired_ids_.push_back(it->first);
        it = cm_targets_.erase(it);
      } else {
        ++it;
      }
    }
  });
  std::vector<std::shared_ptr<RdmaConnection>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [raw, conn] : conns_) all.push_back(conn);
  }
  for (auto& conn : all) {
    conn->endpoint()->RunOnPoller([conn] {
      conn->Teardown(absl::UnavailableError("transport shutting down"));
    });
  }
  all.clear();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(10), [this] { return conns_.empty(); });
  }
  stop_.store(true);
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  cm_thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [ctx, ep] : endpoints_) ep->Stop();
  endpoints_.clear();  // each goes once the runtime has released its buffers
}

}  // namespace rdmarpc::transport::rdma
