#include "transport/auto_transport.h"

#include <cstdio>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"

namespace rdmarpc::transport {
namespace {

// How long an auto:// connect with no deadline waits for RDMA's answer
// before it tries TCP.
constexpr absl::Duration kLongestRdmaWait = absl::Seconds(10);

// An ephemeral port that RDMA took may be a TCP port in use: the pair is
// made again, on another port, this many times.
constexpr int kPortPairTries = 8;

Address WithScheme(Address addr, const char* scheme) {
  addr.scheme = scheme;
  return addr;
}

// Stops accepting on both when destroyed. Reports the auto:// address of
// the port: what reaches it from any client, over RDMA where the client's
// device can, over TCP where not.
class PairedListener : public Listener {
 public:
  PairedListener(std::unique_ptr<Listener> rdma, std::unique_ptr<Listener> tcp)
      : rdma_(std::move(rdma)),
        tcp_(std::move(tcp)),
        address_(WithScheme(rdma_->address(), "auto")) {}
  const Address& address() const override { return address_; }

 private:
  std::unique_ptr<Listener> rdma_;
  std::unique_ptr<Listener> tcp_;
  const Address address_;
};

}  // namespace

AutoTransport::AutoTransport(std::unique_ptr<Transport> rdma,
                             std::function<std::unique_ptr<Transport>()> make_tcp, std::string who,
                             absl::Duration remember, FallbackMemory* memory)
    : rdma_(std::move(rdma)),
      make_tcp_(std::move(make_tcp)),
      who_(std::move(who)),
      remember_(remember),
      memory_(*memory) {}

Transport& AutoTransport::Tcp() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!tcp_) tcp_ = make_tcp_();
  return *tcp_;
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::Connect(const Address& addr,
                                                                   ConnectionObserver* observer,
                                                                   absl::Time deadline) {
  if (addr.scheme == "tcp") return Tcp().Connect(addr, observer, deadline);
  if (addr.scheme != "auto") return rdma_->Connect(addr, observer, deadline);
  const std::string target = addr.ToString();
  if (!memory_.FellBackWithin(target, remember_, SteadyNow())) {
    return ConnectRdmaFirst(addr, target, observer, deadline);
  }
  auto tcp = Tcp().Connect(WithScheme(addr, "tcp"), observer, deadline);
  if (tcp.ok()) return tcp;
  // Something changed there (a restart with RDMA alone, say): RDMA first
  // again, with what is left.
  memory_.Forget(target);
  if (SteadyNow() < deadline) return ConnectRdmaFirst(addr, target, observer, deadline);
  return absl::Status(tcp.status().code(),
                      absl::StrCat("over TCP, as RDMA could not reach ", target,
                                   " lately: ", tcp.status().message()));
}

absl::StatusOr<std::shared_ptr<Connection>> AutoTransport::ConnectRdmaFirst(
    const Address& addr, const std::string& target, ConnectionObserver* observer,
    absl::Time deadline) {
  // A host without RDMA never answers rdma_cm: RDMA gets part of the time,
  // and TCP what is left.
  const absl::Time now = SteadyNow();
  const absl::Time rdma_deadline =
      deadline == absl::InfiniteFuture() ? now + kLongestRdmaWait : now + (deadline - now) / 2;
  auto conn = rdma_->Connect(addr, observer, rdma_deadline);
  if (conn.ok()) return conn;
  std::string why;
  if (const auto payload = conn.status().GetPayload(kNotReachableThisWay)) {
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
  auto tcp = Tcp().Connect(WithScheme(addr, "tcp"), observer, deadline);
  if (tcp.ok()) {
    memory_.Remember(target, SteadyNow());
    return tcp;
  }
  return absl::Status(tcp.status().code(),
                      absl::StrCat("over RDMA: ", conn.status().message(),
                                   "; then over TCP: ", tcp.status().message()));
}

absl::StatusOr<std::unique_ptr<Listener>> AutoTransport::Listen(const Address& addr,
                                                                AcceptCallback on_accept) {
  if (addr.scheme == "tcp") return Tcp().Listen(addr, std::move(on_accept));
  absl::Status last;
  for (int i = 0; i < kPortPairTries; ++i) {
    auto rdma = rdma_->Listen(WithScheme(addr, "rdma"), on_accept);
    if (!rdma.ok() || addr.scheme != "auto") return rdma;
    Address tcp_addr = WithScheme(addr, "tcp");
    tcp_addr.port = (*rdma)->address().port;
    auto tcp = Tcp().Listen(tcp_addr, on_accept);
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
  rdma_->Shutdown();
  std::lock_guard<std::mutex> lock(mu_);
  if (tcp_) tcp_->Shutdown();
}

}  // namespace rdmarpc::transport
