#include "transport/auto_transport.h"

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/new_thread.h"
#include "base/steady_clock.h"
#include "transport/attempt_errors.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::transport {
namespace {

// How long an auto:// connect with no deadline waits for RDMA's answer
// before it tries TCP.
constexpr absl::Duration kLongestRdmaWait = absl::Seconds(10);

// An ephemeral port that RDMA took may be a TCP port in use: the pair is
// made again, on another port, this many times.
constexpr int kPortPairTries = 8;

// How often an auto:// listener that went over TCP alone, as no RDMA
// device was usable, looks for one. A look is a scan of sysfs.
constexpr absl::Duration kDeviceCheck = absl::Seconds(1);

// An auto:// connect that RDMA keeps waiting this long asks the target's
// TCP port whether TCP alone listens there. Where RDMA works its answer
// comes well before (a few ms on a NIC, tens under Soft-RoCE in a VM), so
// servers with RDMA are seldom asked; a host without RDMA never answers
// rdma_cm, and its server's kHello ends the wait.
constexpr absl::Duration kAskTcpAfter = absl::Milliseconds(200);

Address WithScheme(Address addr, const char* scheme) {
  addr.scheme = scheme;
  return addr;
}

// What `t` makes of a connect to `addr`, given up once `*give_up` is true
// (never, when null).
absl::StatusOr<std::shared_ptr<Connection>> ConnectOn(Transport& t, const Address& addr,
                                                      ConnectionObserver* observer,
                                                      absl::Time deadline,
                                                      const std::atomic<bool>* give_up) {
  if (give_up == nullptr) return t.Connect(addr, observer, deadline);
  return t.ConnectUnless(addr, observer, deadline, *give_up);
}

bool GivenUp(const std::atomic<bool>* give_up) {
  return give_up != nullptr && give_up->load(std::memory_order_relaxed);
}

// Asks, on a thread of its own from `start` until `deadline`, whether TCP
// alone listens at `addr` (TcpListensAlone); tcp_alone() turns true if so.
// ends_rdma(), what the RDMA attempt beside it is given up on, turns true
// then too, or once the caller's `give_up` (unless null) is: the thread
// watches that flag, every kGiveUpCheck, until the probe is destroyed, as
// RDMA's ConnectUnless watches one flag alone. Destroying it cuts a
// question under way short, and joins the thread.
class TcpAloneProbe {
 public:
  TcpAloneProbe(Address addr, absl::Time start, absl::Time deadline,
                const std::atomic<bool>* give_up)
      : stop_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), give_up_(give_up) {
    // Out of descriptors or threads, it asks nothing: RDMA's answer or its
    // deadline decides (and RDMA is given up on with the caller's flag).
    if (stop_fd_ < 0) return;
    auto thread = NewThread("auto-tcp-probe", "asking whether TCP alone listens",
                            [this, addr = std::move(addr), start, deadline] {
                              if (!WaitUntil(start)) return;
                              auto alone = TcpListensAlone(addr, stop_fd_, give_up_, deadline);
                              if (alone.ok() && *alone) {
                                tcp_alone_.store(true, std::memory_order_relaxed);
                                ends_rdma_.store(true, std::memory_order_relaxed);
                                return;
                              }
                              if (give_up_ != nullptr) WaitUntil(absl::InfiniteFuture());
                            });
    if (thread.ok()) thread_ = *std::move(thread);
  }
  ~TcpAloneProbe() {
    if (stop_fd_ < 0) return;
    const uint64_t one = 1;
    (void)!write(stop_fd_, &one, sizeof one);
    if (thread_.joinable()) thread_.join();
    close(stop_fd_);
  }
  TcpAloneProbe(const TcpAloneProbe&) = delete;
  TcpAloneProbe& operator=(const TcpAloneProbe&) = delete;

  // Where the probe could not start its thread, the caller's flag itself.
  const std::atomic<bool>& ends_rdma() const {
    return thread_.joinable() || give_up_ == nullptr ? ends_rdma_ : *give_up_;
  }
  bool tcp_alone() const { return tcp_alone_.load(std::memory_order_relaxed); }

 private:
  // Waits until `until`; false when stopped or given up first (and then
  // ends_rdma_ is true if given up).
  bool WaitUntil(absl::Time until) {
    for (;;) {
      if (GivenUp(give_up_)) {
        ends_rdma_.store(true, std::memory_order_relaxed);
        return false;
      }
      const absl::Duration left = until - SteadyNow();
      if (left <= absl::ZeroDuration()) return true;
      const absl::Duration wait = give_up_ != nullptr ? std::min(left, kGiveUpCheck) : left;
      pollfd p{stop_fd_, POLLIN, 0};
      const int rc = poll(
          &p, 1,
          static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(wait), INT_MAX - 1)) + 1);
      if (rc > 0) return false;
      if (rc < 0 && errno != EINTR) return true;
    }
  }

  const int stop_fd_;
  const std::atomic<bool>* const give_up_;
  std::atomic<bool> tcp_alone_{false};
  std::atomic<bool> ends_rdma_{false};
  std::thread thread_;
};

// Stops accepting on both when destroyed. Reports the auto:// address of
// the port: what reaches it from any client, over RDMA where the client's
// device can, over TCP where not.
class PairedListener : public Listener {
 public:
  PairedListener(std::unique_ptr<Listener> rdma, std::unique_ptr<Listener> tcp)
      : rdma_(std::move(rdma)),
        tcp_(std::move(tcp)),
        address_(WithScheme(rdma_->address(), "auto")) {
    tcp_->SharePortWithRdma();
  }
  const Address& address() const override { return address_; }

 private:
  std::unique_ptr<Listener> rdma_;
  std::unique_ptr<Listener> tcp_;
  const Address address_;
};

// An auto:// listener made while no RDMA device was usable: TCP alone at
// first, its kHello saying so, and a thread that looks for a device every
// kDeviceCheck. Once the RDMA transport can be made, it listens over RDMA
// on the TCP port too, tells its TCP clients (SharePortWithRdma, so their
// auto:// channels move to RDMA), logs one line, and its thread ends. Where
// RDMA cannot take that port (rdma_cm's port in use, the address on a
// device-less interface), it says why, once per reason, and looks again.
// `rdma_at` is the address asked for with the port TCP took: a host name
// stays a name, so RDMA listens on each of its addresses as TCP does.
class TcpUntilRdmaListener : public Listener {
 public:
  using MakeRdma = std::function<absl::StatusOr<Transport*>()>;

  TcpUntilRdmaListener(std::unique_ptr<Listener> tcp, Address rdma_at)
      : tcp_(std::move(tcp)),
        rdma_at_(std::move(rdma_at)),
        address_(WithScheme(tcp_->address(), "auto")) {}
  ~TcpUntilRdmaListener() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    stopped_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  // Starts the thread that looks for a device; fails without one.
  absl::Status Start(MakeRdma rdma, AcceptCallback on_accept, std::string who) {
    auto thread = NewThread("auto-rdma-seek",
                            absl::StrCat("looking for an RDMA device for ", address_.ToString()),
                            [this, rdma = std::move(rdma), on_accept = std::move(on_accept),
                             who = std::move(who)] { LookForRdma(rdma, on_accept, who); });
    if (!thread.ok()) return thread.status();
    thread_ = *std::move(thread);
    return absl::OkStatus();
  }
  const Address& address() const override { return address_; }

 private:
  void LookForRdma(const MakeRdma& make_rdma, const AcceptCallback& on_accept,
                   const std::string& who) {
    std::string said;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (stopped_.wait_for(lock, absl::ToChronoMilliseconds(kDeviceCheck),
                              [this] { return stop_; })) {
          return;
        }
      }
      absl::StatusOr<Transport*> rdma = make_rdma();
      // No device yet (MakeTransport said so once), or its transport cannot
      // be made (Rdma() says so once).
      if (!rdma.ok()) continue;
      auto listener = (*rdma)->Listen(rdma_at_, on_accept);
      if (!listener.ok()) {
        if (listener.status().message() != said) {
          said = std::string(listener.status().message());
          fprintf(stderr,
                  "rdmarpc[%s]: %s cannot listen over RDMA yet, though a device is usable: %s; "
                  "it goes on over TCP alone and tries again every %s\n",
                  who.c_str(), address_.ToString().c_str(), said.c_str(),
                  absl::FormatDuration(kDeviceCheck).c_str());
        }
        continue;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      rdma_ = *std::move(listener);
      // Said before the clients are told, so that whoever sees them told
      // (a test) finds it said.
      fprintf(stderr,
              "rdmarpc[%s]: %s listens over RDMA too now (%s); its TCP clients are told, and "
              "their auto:// channels move to RDMA\n",
              who.c_str(), address_.ToString().c_str(), rdma_->address().ToString().c_str());
      tcp_->SharePortWithRdma();
      return;
    }
  }

  // Destroyed after the thread has ended, rdma_ (taken last) first.
  const std::unique_ptr<Listener> tcp_;
  const Address rdma_at_;
  const Address address_;
  std::mutex mu_;
  std::condition_variable stopped_;
  bool stop_ = false;               // guarded by mu_
  std::unique_ptr<Listener> rdma_;  // guarded by mu_ until the thread ends
  std::thread thread_;
};

}  // namespace

AutoTransport::AutoTransport(std::unique_ptr<Transport> rdma, MakeRdma make_rdma, MakeTcp make_tcp,
                             std::string who, absl::Duration remember, FallbackMemory* memory)
    : make_rdma_(std::move(make_rdma)),
      make_tcp_(std::move(make_tcp)),
      who_(std::move(who)),
      remember_(remember),
      memory_(*memory),
      rdma_(std::move(rdma)) {}

absl::StatusOr<Transport*> AutoTransport::Tcp() {
  std::lock_guard<std::mutex> lock(mu_);
  if (tcp_) return tcp_.get();
  absl::StatusOr<std::unique_ptr<Transport>> made = make_tcp_();
  if (!made.ok()) return made.status();
  tcp_ = *std::move(made);
  return tcp_.get();
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectTcp(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>* give_up) {
  absl::StatusOr<Transport*> tcp = Tcp();
  if (!tcp.ok()) return tcp.status();
  return ConnectOn(**tcp, WithScheme(addr, "tcp"), observer, deadline, give_up);
}

absl::StatusOr<std::unique_ptr<Listener>> AutoTransport::ListenTcp(const Address& addr,
                                                                   AcceptCallback on_accept) {
  absl::StatusOr<Transport*> tcp = Tcp();
  if (!tcp.ok()) return tcp.status();
  return (*tcp)->Listen(addr, std::move(on_accept));
}

absl::StatusOr<Transport*> AutoTransport::Rdma() {
  std::lock_guard<std::mutex> lock(mu_);
  if (rdma_) return rdma_.get();
  if (shut_down_) return absl::UnavailableError(absl::StrCat(who_, ": the transport is shut down"));
  absl::StatusOr<std::unique_ptr<Transport>> made = make_rdma_();
  if (!made.ok()) {
    // Every connect and every look of a listener tries again: one line for
    // all of them, not one each.
    const bool not_made = made.status().GetPayload(kRdmaNotMade).has_value();
    if (not_made && !told_not_made_) {
      fprintf(stderr, "rdmarpc[%s]: %s; auto:// goes on over TCP and tries RDMA again\n",
              who_.c_str(), std::string(made.status().message()).c_str());
    }
    told_not_made_ = not_made;
    return made.status();
  }
  rdma_ = *std::move(made);
  return rdma_.get();
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::Connect(const Address& addr,
                                                                   ConnectionObserver* observer,
                                                                   absl::Time deadline) {
  return ConnectWith(addr, observer, deadline, nullptr);
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectUnless(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>& give_up) {
  return ConnectWith(addr, observer, deadline, &give_up);
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectWith(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>* give_up) {
  if (addr.scheme == "tcp") return ConnectTcp(addr, observer, deadline, give_up);
  absl::StatusOr<Transport*> rdma = Rdma();
  if (addr.scheme != "auto") {
    if (!rdma.ok()) return rdma.status();
    return ConnectOn(**rdma, addr, observer, deadline, give_up);
  }
  // No device yet: MakeTransport said so once, when it fell back to TCP.
  if (!rdma.ok()) return ConnectTcp(addr, observer, deadline, give_up);
  const std::string target = addr.ToString();
  if (!memory_.FellBackWithin(target, remember_, SteadyNow())) {
    return ConnectRdmaFirst(**rdma, addr, target, observer, deadline, give_up);
  }
  auto tcp = ConnectTcp(addr, observer, deadline, give_up);
  if (tcp.ok() || GivenUp(give_up)) return tcp;
  // Something changed there (a restart with RDMA alone, say): RDMA first
  // again, with what is left.
  memory_.Forget(target);
  if (SteadyNow() < deadline) {
    return ConnectRdmaFirst(**rdma, addr, target, observer, deadline, give_up);
  }
  return absl::Status(tcp.status().code(),
                      absl::StrCat("over TCP, as RDMA could not reach ", target,
                                   " lately: ", tcp.status().message()));
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectRdmaFirst(
    Transport& rdma, const Address& addr, const std::string& target, ConnectionObserver* observer,
    absl::Time deadline, const std::atomic<bool>* give_up) {
  // A host without RDMA never answers rdma_cm: RDMA gets part of the time,
  // and TCP what is left.
  const absl::Time now = SteadyNow();
  const absl::Time rdma_deadline =
      deadline == absl::InfiniteFuture() ? now + kLongestRdmaWait : now + (deadline - now) / 2;
  absl::StatusOr<std::shared_ptr<Connection>> conn;
  bool tcp_alone = false;
  if (rdma_deadline - now > kAskTcpAfter) {
    TcpAloneProbe probe(WithScheme(addr, "tcp"), now + kAskTcpAfter, rdma_deadline, give_up);
    conn = rdma.ConnectUnless(addr, observer, rdma_deadline, probe.ends_rdma());
    tcp_alone = probe.tcp_alone();
  } else {
    conn = ConnectOn(rdma, addr, observer, rdma_deadline, give_up);
  }
  if (conn.ok() || GivenUp(give_up)) return conn;
  std::string why;
  if (tcp_alone) {
    why = "its server listens over TCP alone, as its kHello says";
  } else if (const auto payload = conn.status().GetPayload(kNotReachableThisWay)) {
    why = std::string(*payload);
  } else if (absl::IsDeadlineExceeded(conn.status()) && SteadyNow() < deadline) {
    why =
        absl::StrCat("no answer within ",
                     absl::FormatDuration(absl::Trunc(rdma_deadline - now, absl::Milliseconds(1))));
  } else {
    return conn;
  }
  if (memory_.FirstMention(target)) {
    fprintf(stderr, "rdmarpc[%s]: %s cannot be reached over RDMA (%s); auto:// connects over TCP\n",
            who_.c_str(), target.c_str(), why.c_str());
  }
  auto tcp = ConnectTcp(addr, observer, deadline, give_up);
  if (tcp.ok()) {
    memory_.Remember(target, SteadyNow());
    return tcp;
  }
  // Each way's failure with what to do about it, but what both say (a host
  // that answered neither way: ~190 characters) once, at the end.
  FailedAttempts both(FailedAttempts::Unshared::kWithItsAttempt);
  both.Add("over RDMA", conn.status());
  both.Add("then over TCP", tcp.status());
  return both.Error();
}

bool AutoTransport::MayGoFaster(const Address& addr, const Connection& conn) const {
  return addr.scheme == "auto" && absl::StartsWith(conn.peer(), "tcp://") && !conn.ServerTcpAlone();
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectFaster(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>& give_up) {
  absl::StatusOr<Transport*> rdma = Rdma();
  if (!rdma.ok()) return rdma.status();
  auto conn = (*rdma)->ConnectUnless(WithScheme(addr, "rdma"), observer, deadline, give_up);
  // RDMA reaches the target again: the next connections try it first.
  if (conn.ok()) memory_.Forget(addr.ToString());
  return conn;
}

absl::StatusOr<std::unique_ptr<Listener>> AutoTransport::Listen(const Address& addr,
                                                                AcceptCallback on_accept) {
  if (addr.scheme == "tcp") return ListenTcp(addr, std::move(on_accept));
  absl::StatusOr<Transport*> rdma_transport = Rdma();
  if (!rdma_transport.ok() && addr.scheme == "auto") {
    // No device yet: MakeTransport said so once, when it fell back to TCP.
    auto tcp = ListenTcp(WithScheme(addr, "tcp"), on_accept);
    if (!tcp.ok()) return tcp.status();
    Address rdma_at = WithScheme(addr, "rdma");
    rdma_at.port = (*tcp)->address().port;
    auto listener = std::make_unique<TcpUntilRdmaListener>(*std::move(tcp), std::move(rdma_at));
    absl::Status started = listener->Start([this] { return Rdma(); }, std::move(on_accept), who_);
    if (!started.ok()) return started;
    return std::unique_ptr<Listener>(std::move(listener));
  }
  if (!rdma_transport.ok()) return rdma_transport.status();
  absl::Status last;
  for (int i = 0; i < kPortPairTries; ++i) {
    auto rdma = (*rdma_transport)->Listen(WithScheme(addr, "rdma"), on_accept);
    if (!rdma.ok() || addr.scheme != "auto") return rdma;
    Address tcp_addr = WithScheme(addr, "tcp");
    tcp_addr.port = (*rdma)->address().port;
    auto tcp = ListenTcp(tcp_addr, on_accept);
    if (tcp.ok()) {
      return std::unique_ptr<Listener>(new PairedListener(std::move(*rdma), std::move(*tcp)));
    }
    last = tcp.status();
    if (addr.port != 0) break;  // the port asked for is taken over TCP: no other will do
  }
  return absl::Status(
      last.code(), absl::StrCat(addr.ToString(),
                                ": auto:// listens over RDMA and TCP on one port, "
                                "and TCP could not take it: ",
                                last.message(), " (an rdma:// address listens over RDMA alone)"));
}

void AutoTransport::Shutdown() {
  Transport* rdma;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down_ = true;
    rdma = rdma_.get();
  }
  if (rdma != nullptr) rdma->Shutdown();
  std::lock_guard<std::mutex> lock(mu_);
  if (tcp_) tcp_->Shutdown();
}

}  // namespace rdmarpc::transport
