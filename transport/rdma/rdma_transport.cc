#include "transport/rdma/rdma_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/steady_clock.h"
#include "transport/listen_on_each.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/fault_injection.h"

namespace rdmarpc::transport::rdma {
namespace {

bool IsWildcard(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

bool IsLoopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr) >> 24) == 127;
  }
  const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
}

// Said with a failure to reach a loopback address (or the unspecified one,
// which means this host as a destination): rdma_cm binds such a connection
// to a device, but Soft-RoCE (and devices without loopback) finds no route
// for it.
const char* kLoopbackHint =
    " (a loopback or unspecified address: this device has no RDMA path over it; use the "
    "address of an interface with an RDMA port, or tcp://, or auto://, which falls back to TCP "
    "there)";

const char* kTry =
    "Try: `rdma link` and `ibv_devinfo` to see devices and ports; make sure the address "
    "belongs to an interface with an active RDMA port (Soft-RoCE: `rdma link add rxe0 type "
    "rxe netdev <if>`); that the server listens there; or use tcp:// (or auto://).";

// Said with EINVAL from rdma_create_qp or rdma_accept for a connect
// request: the kernel's CM no longer holds it as pending (so rdma_cm will
// not move a QP to INIT for it, nor send its reply), as it stops doing when
// the client cancels it.
const char* kClientGaveUpHint =
    " (most likely the client gave up on this connect before it was accepted: its deadline "
    "passed, it was given up or it shut down)";

// How soon a ConnectUnless sees its give_up.
constexpr absl::Duration kGiveUpCheck = absl::Milliseconds(10);

std::string EncodeRefusal(const std::string& why) {
  std::string text = absl::StrCat(kRefusalPrefix, why);
  text.resize(std::min(text.size(), kMaxRefusalBytes));
  return text;
}

// Why the server refused, from a REJ's private data, or nullopt when the
// refusal is not an rdmarpc server's (or has no reason).
std::optional<std::string> DecodeRefusal(const void* data, size_t len) {
  absl::string_view text(static_cast<const char*>(data), data == nullptr ? 0 : len);
  text = text.substr(0, text.find('\0'));
  if (!absl::ConsumePrefix(&text, kRefusalPrefix) || text.empty()) return std::nullopt;
  return std::string(text);
}

}  // namespace

// ------------------------------------------------------------------ pieces

struct RdmaTransport::Attempt {
  rdma_cm_id* id = nullptr;
  std::string target;
  bool loopback = false;  // the target is 127.0.0.0/8, ::1, 0.0.0.0 or ::
  ConnectionObserver* observer = nullptr;
  std::shared_ptr<RdmaConnection> conn;
  std::promise<absl::Status> done;
  bool finished = false;

  void Finish(absl::Status s) {
    if (finished) return;
    finished = true;
    done.set_value(std::move(s));
  }
};

// A listener on one address. Bound to a specific address, its rdma_cm id is
// bound to the device that serves it; when that device is removed the id is
// useless (rdma_cm delivers nothing more to it), so it is destroyed and the
// listener tries every kRelistenInterval to listen on the same address and
// port again (RelistenDue), on whatever device serves the address by then.
// A wildcard listener needs none of this: rdma_cm itself listens on devices
// that come after it.
class RdmaTransport::RdmaListener : public Listener {
 public:
  RdmaListener(RdmaTransport* t, rdma_cm_id* id, Address bound, AcceptCallback cb)
      : transport_(t),
        id_(id),
        bound_(std::move(bound)),
        bound_at_(CopySockaddr(rdma_get_local_addr(id))),
        on_accept_(std::move(cb)) {}
  ~RdmaListener() override {
    transport_->RunOnCmAndWait([this] {
      transport_->orphaned_listeners_.erase(this);
      if (id_ == nullptr) return;
      transport_->cm_targets_.erase(id_);
      rdma_destroy_id(id_);
    });
  }
  const Address& address() const override { return bound_; }
  AcceptCallback& on_accept() { return on_accept_; }

  // CM thread: the listener's id, null while its device is gone.
  void set_id(rdma_cm_id* id) { id_ = id; }
  // The address and port it listens on, to listen there again.
  const sockaddr_storage& bound_at() const { return bound_at_; }
  // CM thread: when RelistenDue tries next.
  std::chrono::steady_clock::time_point relisten_at;

 private:
  static sockaddr_storage CopySockaddr(const sockaddr* sa) {
    sockaddr_storage copy{};
    memcpy(&copy, sa, sa->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    return copy;
  }

  RdmaTransport* const transport_;
  rdma_cm_id* id_;
  const Address bound_;
  const sockaddr_storage bound_at_;
  AcceptCallback on_accept_;
};

// --------------------------------------------------------------- transport

RdmaTransport::RdmaTransport(TransportOptions options, RdmaOptions rdma, bool server)
    : options_(std::move(options)), rdma_(std::move(rdma)), server_(server) {
  channel_ = rdma_create_event_channel();
  channel_errno_ = channel_ ? 0 : errno;
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (channel_) {
    fcntl(channel_->fd, F_SETFL, fcntl(channel_->fd, F_GETFL) | O_NONBLOCK);
    cm_thread_ = std::thread([this] { CmLoop(); });
    cm_thread_id_.store(cm_thread_.get_id());
  } else {
    cm_exited_ = true;
  }
}

RdmaTransport::~RdmaTransport() {
  Shutdown();
  if (channel_) rdma_destroy_event_channel(channel_);
  close(wake_fd_);
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
    return absl::UnavailableError(absl::StrCat("rdma_create_id: ", strerror(errno)));
  }
  if (rdma_bind_addr(id, reinterpret_cast<sockaddr*>(at)) != 0 || rdma_listen(id, 1024) != 0) {
    absl::Status failed = absl::UnavailableError(strerror(errno));
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
                                 options_.name);
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

Handshake RdmaTransport::LocalHandshake(uint32_t credits) const {
  Handshake hs;
  hs.credits = credits;
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
  if (absl::Status s = CheckRdmaOptions(rdma_); !s.ok()) return s;
  if (!channel_) {
    return absl::UnavailableError(
        absl::StrCat("rdma_create_event_channel failed: ", strerror(channel_errno_),
                     ". Devices: ", DescribeDevices(), ". ", kTry));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return absl::FailedPreconditionError("transport is shut down");
  }
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  auto src = NamedGidAddress(rdma_, 0);
  if (!src.ok()) return src.status();
  std::vector<SocketAddress> reachable = *addresses;
  if (src->has_value()) {
    // A named GID reaches the addresses of its own family only.
    reachable.erase(std::remove_if(reachable.begin(), reachable.end(),
                                   [&](const SocketAddress& a) {
                                     return a.storage.ss_family != (*src)->ss_family;
                                   }),
                    reachable.end());
  }
  if (reachable.empty()) {
    const auto family = [](const sockaddr_storage& a) {
      return a.ss_family == AF_INET ? "IPv4" : "IPv6";
    };
    const sockaddr_storage& dst = addresses->front().storage;
    return absl::InvalidArgumentError(absl::StrCat(
        "connect to ", addr.ToString(), ": RdmaOptions names device ", rdma_.device, " gid_index ",
        rdma_.gid_index, ", whose address ",
        SockaddrHost(reinterpret_cast<const sockaddr*>(&**src)), " is ", family(**src),
        " and cannot reach an ", family(dst), " address. Name the GID that holds an ", family(dst),
        " address (`rdma link`, `ibv_devinfo -v`; an IPv4 one reads ::ffff:a.b.c.d), "
        "or name no GID."));
  }
  // Each address in turn, sharing the deadline: a name may resolve to an
  // address no device routes, or one the server does not listen on ([::1]
  // for "localhost", where the server took 127.0.0.1).
  auto conn = TryEachAddress<std::shared_ptr<Connection>>(
      reachable, deadline, /*name_each=*/false,
      [&](const SocketAddress& a, absl::Time by) {
        return ConnectTo(a.storage, *src, observer, by, give_up);
      },
      [](const absl::Status& s) { return absl::IsFailedPrecondition(s) || absl::IsCancelled(s); });
  if (conn.ok() || reachable.size() == 1) return conn;
  absl::Status each(conn.status().code(),
                    absl::StrCat("connect to ", addr.ToString(), ", each of its ", reachable.size(),
                                 " addresses in turn: ", conn.status().message()));
  conn.status().ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { each.SetPayload(url, payload); });
  return each;
}

absl::StatusOr<std::shared_ptr<Connection>> RdmaTransport::ConnectTo(
    sockaddr_storage dst, std::optional<sockaddr_storage> src, ConnectionObserver* observer,
    absl::Time deadline, const std::atomic<bool>& give_up) {
  auto at = std::make_shared<Attempt>();
  at->target = absl::StrCat("rdma://", SockaddrString(reinterpret_cast<sockaddr*>(&dst)));
  at->loopback = IsLoopback(reinterpret_cast<sockaddr*>(&dst)) ||
                 IsWildcard(reinterpret_cast<sockaddr*>(&dst));
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
          ": ", strerror(err), at->loopback ? kLoopbackHint : "", ". ", kTry));
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
    gave_up = !ready && give_up.load(std::memory_order_relaxed);
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
                         : absl::DeadlineExceededError(
                               absl::StrCat("connecting to ", at->target, " timed out")));
    });
  }
  absl::Status s = result.get();
  if (!s.ok()) return s;
  return std::shared_ptr<Connection>(at->conn);
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
  if (absl::Status s = CheckRdmaOptions(rdma_); !s.ok()) return s;
  if (!channel_) {
    return absl::UnavailableError(
        absl::StrCat("rdma_create_event_channel failed: ", strerror(channel_errno_),
                     ". Devices: ", DescribeDevices(), ". ", kTry));
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
          return IsWildcard(sa) || SockaddrHost(sa) == gid_host;
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
    return ListenAt(a, listening, on_accept);
  });
  if (!listener.ok()) {
    return absl::Status(
        listener.status().code(),
        absl::StrCat("listen on ", addr.ToString(), ": ", listener.status().message(),
                     ". Devices: ", DescribeDevices(), ". ", kTry));
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
  });
  if (!status.ok()) return status;
  return std::unique_ptr<Listener>(std::move(listener));
}

void RdmaTransport::HandleEvent(rdma_cm_event* ev) {
  // Everything that may touch ev->id happens before the ack: until then
  // rdma_destroy_id on that id (from a poller) waits.
  const rdma_cm_event_type type = ev->event;
  rdma_cm_id* id = ev->id;
  auto it = cm_targets_.find(type == RDMA_CM_EVENT_CONNECT_REQUEST ? ev->listen_id : id);
  if (it == cm_targets_.end()) {
    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) rdma_reject(id, nullptr, 0);
    rdma_ack_cm_event(ev);
    return;
  }
  CmTarget target = it->second;
  if (target.listener) {
    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) OnConnectRequest(ev, target.listener);
    if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
      // Nothing else would say why RDMA clients cannot connect meanwhile
      // (README, "A device removed").
      fprintf(stderr,
              "rdmarpc[%s]: RDMA device %s was removed under the listener on %s: it takes no "
              "RDMA connections until a device serves that address again (it tries every %lld "
              "ms)\n",
              options_.name.c_str(), id->verbs ? ibv_get_device_name(id->verbs->device) : "?",
              target.listener->address().ToString().c_str(),
              static_cast<long long>(kRelistenInterval.count()));
      cm_targets_.erase(it);
      retired_ids_.push_back(id);
      target.listener->set_id(nullptr);
      target.listener->relisten_at = std::chrono::steady_clock::now() + kRelistenInterval;
      orphaned_listeners_.insert(target.listener);
    }
    rdma_ack_cm_event(ev);
    return;
  }
  if (auto conn = target.conn.lock()) {
    if (rdma_.trace) {
      TraceLine(options_.name, absl::StrCat(conn->peer(), ": ", rdma_event_str(type),
                                            type == RDMA_CM_EVENT_ESTABLISHED
                                                ? absl::StrCat("; ", conn->DescribeRetryPolicy())
                                                : ""));
    }
    switch (type) {
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
      case RDMA_CM_EVENT_REJECTED:
      case RDMA_CM_EVENT_UNREACHABLE:
      case RDMA_CM_EVENT_CONNECT_ERROR:
        // On the poller, which alone destroys the QP: rdma_disconnect here
        // could race with that.
        conn->endpoint()->RunOnPoller([conn, type] {
          conn->OnPeerGone(absl::UnavailableError(absl::StrCat(
              "connection to ", conn->peer(), " lost (", rdma_event_str(type), ")")));
        });
        break;
      case RDMA_CM_EVENT_ESTABLISHED:  // an accepted connection
        conn->MarkEstablished();
        conn->endpoint()->RunOnPoller([conn] { conn->endpoint()->OnEstablished(); });
        break;
      default:
        break;
    }
    rdma_ack_cm_event(ev);
    return;
  }
  if (!target.attempt) {
    rdma_ack_cm_event(ev);
    return;
  }
  Attempt* at = target.attempt.get();
  const int status = ev->status;
  // `no_path`: a step that found no RDMA path there (a route that cannot
  // be resolved) failed, whatever the event.
  auto fail = [&](const std::string& what, bool no_path = false) {
    // No RDMA path there, or no RDMA listener: TCP may still reach the peer.
    // A refusal with our private data, or a peer that is not an rdmarpc
    // server, says the peer is there.
    const bool not_rdma_there =
        no_path || type == RDMA_CM_EVENT_ADDR_ERROR || type == RDMA_CM_EVENT_ROUTE_ERROR ||
        type == RDMA_CM_EVENT_UNREACHABLE ||
        (type == RDMA_CM_EVENT_REJECTED &&
         !DecodeRefusal(ev->param.conn.private_data, ev->param.conn.private_data_len));
    // A negative status is an errno (ENODEV: the device was removed); a
    // positive one, a REJ's reason.
    const std::string event = status < 0
                                  ? absl::StrCat(rdma_event_str(type), ": ", strerror(-status))
                                  : rdma_event_str(type);
    absl::Status why = absl::UnavailableError(
        absl::StrCat("rdma_cm could not connect to ", at->target, ": ", what,
                     not_rdma_there && at->loopback ? kLoopbackHint : "", " (", event, ", status ",
                     status, "). Devices: ", DescribeDevices(), ". ", kTry));
    if (not_rdma_there) why.SetPayload(kNotReachableThisWay, absl::Cord(no_path ? what : event));
    if (rdma_.trace)
      TraceLine(options_.name, absl::StrCat(at->target, ": connect failed: ", why.message()));
    AbandonAttempt(at);
    at->Finish(std::move(why));
  };
  if (rdma_.trace && type != RDMA_CM_EVENT_ESTABLISHED) {
    TraceLine(options_.name, absl::StrCat(at->target, ": ", rdma_event_str(type)));
  }
  switch (type) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      if (rdma_resolve_route(id, static_cast<int>(rdma_.connect_timeout_ms)) != 0) {
        fail(absl::StrCat("rdma_resolve_route: ", strerror(errno)), /*no_path=*/true);
      }
      break;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      auto ep = EndpointFor(id);
      if (!ep.ok()) {
        fail(std::string(ep.status().message()));
        break;
      }
      const ibv_device_attr& dev = (*ep)->device_attr();
      const uint32_t credits = LocalCredits(**ep);
      if (credits == 0) {
        AbandonAttempt(at);
        at->Finish(absl::ResourceExhaustedError(
            absl::StrCat("cannot connect to ", at->target, " on ", (*ep)->device_name(), ": ",
                         (*ep)->DescribeStrictRefusal(), " or close a connection")));
        break;
      }
      const uint32_t rd_atom = std::max(
          1, std::min<int>(static_cast<int>(rdma_.max_reads_in_flight), dev.max_qp_init_rd_atom));
      auto conn = std::make_shared<RdmaConnection>(*ep, id, at->target, next_serial_++, options_,
                                                   Handshake{}, credits, rd_atom);
      if (absl::Status s = conn->CreateQp(); !s.ok()) {
        // Never opened, so not torn down: the id stays the attempt's, and is
        // given up with it on this thread.
        conn->ReleaseId();
        fail(std::string(s.message()));
        break;
      }
      at->conn = conn;
      conn->set_observer(at->observer);
      Track(conn);
      (*ep)->RunOnPollerAndWait([&] { (*ep)->AddConnection(conn); });
      const Handshake hs = LocalHandshake(credits);
      rdma_conn_param param{};
      param.private_data = &hs;
      param.private_data_len = sizeof hs;
      param.responder_resources = static_cast<uint8_t>(std::min(255, dev.max_qp_rd_atom));
      param.initiator_depth = static_cast<uint8_t>(rd_atom);
      // The passive side's QP takes the same retry count from this request.
      param.retry_count = kTransportRetries;
      param.rnr_retry_count = 7;  // infinite: the safety net behind credits
      SetAckTimeout(id);
      if (rdma_.trace) {
        TraceLine(options_.name,
                  absl::StrCat(at->target, ": ", DescribeChoice(id), "; QP ", conn->qp_num(),
                               " created; connecting, we grant ", hs.credits, " credits and take ",
                               rd_atom, " READs in flight"));
      }
      if (rdma_connect(id, &param) != 0) fail(absl::StrCat("rdma_connect: ", strerror(errno)));
      break;
    }
    case RDMA_CM_EVENT_ESTABLISHED: {
      Handshake hs;
      const auto* pd = static_cast<const uint8_t*>(ev->param.conn.private_data);
      if (pd == nullptr || ev->param.conn.private_data_len < sizeof hs) {
        fail("the server sent no rdmarpc handshake (not an rdmarpc server?)");
        break;
      }
      memcpy(&hs, pd, sizeof hs);
      if (hs.magic != Handshake::kMagic) {
        fail("the server sent no rdmarpc handshake (not an rdmarpc server?)");
        break;
      }
      if (hs.version != Handshake::kVersion) {
        fail(absl::StrCat("the server speaks rdmarpc handshake version ", hs.version, ", we speak ",
                          Handshake::kVersion));
        break;
      }
      if (absl::Status s = CheckGidIndex(id, rdma_); !s.ok()) {
        fail(std::string(s.message()));
        break;
      }
      auto conn = at->conn;
      SetRnrWait(id);
      conn->LearnRetryPolicy();
      conn->MarkEstablished();
      DescribeOnce(conn->endpoint(), id, *conn);
      conn->SetPeer(hs);
      if (rdma_.trace) {
        TraceLine(options_.name, absl::StrCat(at->target, ": established: ", conn->DescribeTerms(),
                                              "; ", conn->DescribeRetryPolicy()));
      }
      cm_targets_[id] = CmTarget{nullptr, nullptr, conn};
      at->Finish(absl::OkStatus());
      break;
    }
    case RDMA_CM_EVENT_REJECTED:
      if (std::optional<std::string> why =
              DecodeRefusal(ev->param.conn.private_data, ev->param.conn.private_data_len)) {
        fail(absl::StrCat("the server refused the connection: ", *why));
      } else {
        fail("rejected (no rdmarpc server listens there?)");
      }
      break;
    default:
      fail("connection setup failed");
      break;
  }
  rdma_ack_cm_event(ev);
}

void RdmaTransport::OnConnectRequest(rdma_cm_event* ev, RdmaListener* listener) {
  rdma_cm_id* child = ev->id;
  const std::string peer = PeerOf(child);
  auto reject = [&](const std::string& why) {
    fprintf(stderr, "rdmarpc[%s]: refusing connection from %s: %s\n", options_.name.c_str(),
            peer.c_str(), why.c_str());
    const std::string refusal = EncodeRefusal(why);
    rdma_reject(child, refusal.data(), static_cast<uint8_t>(refusal.size()));
  };
  auto refuse = [&](const std::string& why) {
    reject(why);
    retired_ids_.push_back(child);
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return refuse("shutting down");
  }
  Handshake hs;
  if (ev->param.conn.private_data == nullptr || ev->param.conn.private_data_len < sizeof hs) {
    return refuse("no rdmarpc handshake in the private data (not an rdmarpc client?)");
  }
  memcpy(&hs, ev->param.conn.private_data, sizeof hs);
  if (hs.magic != Handshake::kMagic) {
    return refuse("no rdmarpc handshake in the private data (not an rdmarpc client?)");
  }
  if (hs.version != Handshake::kVersion) {
    return refuse(absl::StrCat("it speaks rdmarpc handshake version ", hs.version, ", we speak ",
                               Handshake::kVersion));
  }
  if (rdma_.trace) {
    TraceLine(options_.name,
              absl::StrCat("connection request from ", peer, ": it grants ", hs.credits,
                           " credits, has slots of ", hs.slot_size, " bytes, takes ",
                           static_cast<int>(ev->param.conn.responder_resources),
                           " READs in flight and serves ",
                           static_cast<int>(ev->param.conn.initiator_depth), " of ours"));
  }
  if (hs.slot_size < kMinSlotSize) return refuse("peer's slot size is too small");
  auto ep = EndpointFor(child);
  if (!ep.ok()) return refuse(std::string(ep.status().message()));
  const ibv_device_attr& dev = (*ep)->device_attr();
  // A connect request's READ limits are from our side (rdma_accept(3)):
  // initiator_depth is how many of our READs the peer's device serves at
  // once, responder_resources how many of its own it will have in flight.
  const uint32_t rd_atom = std::max(
      1, std::min({static_cast<int>(rdma_.max_reads_in_flight),
                   static_cast<int>(ev->param.conn.initiator_depth), dev.max_qp_init_rd_atom}));
  const uint32_t credits = LocalCredits(**ep);
  if (credits == 0) return refuse((*ep)->DescribeStrictRefusal());
  auto conn = std::make_shared<RdmaConnection>(*ep, child, peer, next_serial_++, options_, hs,
                                               credits, rd_atom);
  if (absl::Status s = conn->CreateQp(); !s.ok()) {
    conn->ReleaseId();  // the id goes after the ack instead
    return refuse(absl::StrCat(s.message(), absl::IsInvalidArgument(s) ? kClientGaveUpHint : ""));
  }
  ConnectionObserver* observer = listener->on_accept()(conn);
  if (observer == nullptr) {
    conn->ReleaseId();
    return refuse("its accept callback refused it (a server shutting down?)");
  }
  conn->set_observer(observer);
  (*ep)->RunOnPollerAndWait([&] { (*ep)->AddConnection(conn); });
  Track(conn);
  cm_targets_[child] = CmTarget{nullptr, nullptr, conn};
  const Handshake ours = LocalHandshake(credits);
  rdma_conn_param param{};
  param.private_data = &ours;
  param.private_data_len = sizeof ours;
  param.responder_resources =
      static_cast<uint8_t>(std::min<int>(ev->param.conn.responder_resources, dev.max_qp_rd_atom));
  param.initiator_depth = static_cast<uint8_t>(rd_atom);
  param.rnr_retry_count = 7;
  SetAckTimeout(child);
  const bool accept_fails = FaultInjection::TakeFailedAccept();
  if (accept_fails || rdma_accept(child, &param) != 0) {
    // The client hears it now, not at its connect timeout; the id goes with
    // the connection.
    const int err = accept_fails ? ENOMEM : errno;
    const std::string why =
        absl::StrCat("rdma_accept: ", strerror(err), err == EINVAL ? kClientGaveUpHint : "");
    reject(why);
    (*ep)->RunOnPoller([conn, why] { conn->Teardown(absl::UnavailableError(why)); });
    return;
  }
  if (absl::Status s = CheckGidIndex(child, rdma_); !s.ok()) {
    fprintf(stderr, "rdmarpc[%s]: closing connection from %s: %s\n", options_.name.c_str(),
            peer.c_str(), std::string(s.message()).c_str());
    (*ep)->RunOnPoller([conn, s] { conn->Teardown(s); });
    return;
  }
  SetRnrWait(child);
  conn->LearnRetryPolicy();
  DescribeOnce(*ep, child, *conn);
  if (rdma_.trace) {
    TraceLine(options_.name, absl::StrCat(peer, ": accepted on ", DescribeChoice(child), "; ",
                                          conn->DescribeTerms()));
  }
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
