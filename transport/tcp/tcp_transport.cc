#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <future>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/new_thread.h"
#include "base/steady_clock.h"
#include "transport/address_race.h"
#include "transport/attempt_errors.h"
#include "transport/listen_on_each.h"
#include "transport/tcp/peer_watch.h"
#include "transport/tcp/receive_budget.h"
#include "transport/tcp/tcp_counters.h"

namespace rdmarpc::transport {
namespace {

using tcp::Count;
using tcp::TcpCounters;

constexpr size_t kReadChunk = 64 * 1024;
// What a finishing connection reads away at most (kReadChunk each): more
// than a socket buffers, so a peer that keeps sending cannot hold it.
constexpr int kMaxDrainReads = 256;

std::string ErrnoText(int err) { return strerror(err); }

// How long a listener that ran out of file descriptors (or kernel memory)
// stops watching its socket before it tries again. The connection waits in
// the kernel's backlog meanwhile and is taken once a descriptor is free. A
// listener that kept watching would find its socket readable at once, for
// ever, and spin the I/O thread that serves every connection.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

bool AcceptOutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

// What to try, for the log line of a listener out of resources.
std::string AcceptAdvice(int err) {
  return err == EMFILE ? absl::StrCat(" (", FileLimitAdvice(), ")") : "";
}

// Why socket(2) failed with `err`, with what to do when the process is out
// of descriptors, as it is once it holds as many connections as its limit.
absl::Status SocketError(int err) {
  return WithFileLimitAdvice(absl::UnavailableError(absl::StrCat("socket: ", ErrnoText(err))), err);
}

// The longest TCP_KEEPIDLE and TCP_KEEPINTVL (seconds) and the most
// TCP_KEEPCNT Linux takes. It refuses more, and a refused option leaves the
// kernel's default (2 hours idle), far from what was asked: so more is cut
// to these.
constexpr uint32_t kLongestKeepaliveS = 32767;
constexpr uint32_t kMostKeepaliveProbes = 127;

// Options every connected socket gets: no Nagle delay (frames are whole
// messages), and TcpOptions' keepalive. The peer timeout is PeerWatch's
// (peer_watch.h says why not TCP_USER_TIMEOUT): the kernel's own count of
// unanswered keepalive probes is set to end a connection only after the
// watch would have, up to Linux's limits.
void ConfigureConnectedSocket(int fd, const TcpOptions& options) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (options.keepalive_ms == 0) return;
  const int idle_s =
      static_cast<int>(std::clamp<uint32_t>(options.keepalive_ms / 1000, 1, kLongestKeepaliveS));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
  int interval_s = 1;
  if (options.peer_timeout_ms > 0) {
    // The watch's verdict comes within 1.5 timeouts of the first unanswered
    // probe; a second more is past it.
    const uint64_t outlast_s = uint64_t{options.peer_timeout_ms} * 3 / 2000 + 1;
    const uint64_t interval = (outlast_s + kMostKeepaliveProbes - 1) / kMostKeepaliveProbes;
    interval_s = static_cast<int>(std::min<uint64_t>(interval, kLongestKeepaliveS));
    const int probes = static_cast<int>(
        std::min<uint64_t>((outlast_s + interval_s - 1) / interval_s + 1, kMostKeepaliveProbes));
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  }
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
}

// What ends a connect's waits before its deadline (CANCELLED), besides a
// race lost to another address: `stop_fd` readable (the transport shuts
// down, or a TcpListensAlone is cut short), or `*give_up` true (the
// caller's, through ConnectUnless; never, when null).
struct ConnectStops {
  int stop_fd;
  const std::atomic<bool>* give_up;
};

// Waits until `fd` has `events` (POLLIN, POLLOUT), `deadline` passes, one of
// `stops` comes, or `*lost` turns true (never, when null); the error is
// what ended the wait (CANCELLED for the last two).
absl::Status AwaitSocket(int fd, short events, const ConnectStops& stops,
                         const std::atomic<bool>* lost, absl::Time deadline) {
  const bool flags = lost != nullptr || stops.give_up != nullptr;
  for (;;) {
    if (lost != nullptr && lost->load(std::memory_order_relaxed)) {
      return absl::CancelledError("ended: the connect was won, or given up, on another address");
    }
    if (stops.give_up != nullptr && stops.give_up->load(std::memory_order_relaxed)) {
      return absl::CancelledError("the connect was given up");
    }
    const absl::Duration left = deadline - SteadyNow();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("timed out");
    pollfd p[2] = {{fd, events, 0}, {stops.stop_fd, POLLIN, 0}};
    // Clamped: with no deadline (InfiniteFuture) the cast made -1 of it,
    // and -1 + 1 is a poll that never waits.
    const int64_t wait_ms = std::min<int64_t>(
        absl::ToInt64Milliseconds(flags ? std::min(left, kGiveUpCheck) : left), INT_MAX - 1);
    const int rc = poll(p, 2, static_cast<int>(wait_ms) + 1);
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) return absl::UnavailableError(ErrnoText(errno));
    if (p[1].revents != 0) return absl::CancelledError("transport shutting down");
    if (rc > 0) return absl::OkStatus();
  }
}

// Reads the server's kHello off a connected socket into *hello, and not a
// byte more: a GOAWAY may follow it at once. The error says why the
// connection is no use.
absl::Status AwaitHello(int fd, const ConnectStops& stops, const std::atomic<bool>* lost,
                        absl::Time deadline, Header* hello) {
  char bytes[kHeaderSize];
  size_t got = 0;
  while (got < sizeof bytes) {
    if (absl::Status s = AwaitSocket(fd, POLLIN, stops, lost, deadline); !s.ok()) {
      if (absl::IsDeadlineExceeded(s)) {
        return absl::UnavailableError(
            "timed out waiting for the server to take the connection (no kHello came; is "
            "the peer an rdmarpc server of this version?)");
      }
      return s;
    }
    const ssize_t r = read(fd, bytes + got, sizeof bytes - got);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r <= 0) {
      return absl::UnavailableError(absl::StrCat(
          "the server closed the connection before it took it (shutting down, or refusing "
          "connections)",
          r < 0 ? absl::StrCat(": ", ErrnoText(errno)) : std::string()));
    }
    got += static_cast<size_t>(r);
  }
  Header& h = *hello;
  if (absl::Status s = DecodeHeader(bytes, sizeof bytes, &h); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the peer's first frame is not an rdmarpc kHello: ", s.message()));
  }
  if (h.kind != MessageKind::kHello || h.metadata_len != 0 || h.payload_len != 0) {
    return absl::UnavailableError(absl::StrCat("the peer's first frame is of kind ",
                                               static_cast<int>(h.kind), ", not an empty kHello"));
  }
  return absl::OkStatus();
}

// Why connect(2) failed with `err`, and what to do when nothing listens.
absl::Status ConnectError(int err) {
  absl::Status error = absl::UnavailableError(ErrnoText(err));
  if (err != ECONNREFUSED) return error;
  return WithWhatToDo(std::move(error),
                      "No server listens there: start it, or check the address and port.");
}

// A socket connected to a server that has sent its kHello, and that kHello.
struct ServerSocket {
  int fd;
  Header hello;
};

// A socket connected to `to` whose server has sent its kHello, by
// `deadline`; else why not (CANCELLED once one of `stops` comes or `*lost`
// is true; a null `lost` never is).
absl::StatusOr<ServerSocket> ConnectToServer(const SocketAddress& to, const ConnectStops& stops,
                                             const std::atomic<bool>* lost, absl::Time deadline) {
  const int fd = socket(to.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return SocketError(errno);
  const auto fail = [&](absl::Status s) {
    close(fd);
    return s;
  };
  if (connect(fd, reinterpret_cast<const sockaddr*>(&to.storage), to.len) != 0) {
    if (errno != EINPROGRESS) return fail(ConnectError(errno));
    if (absl::Status s = AwaitSocket(fd, POLLOUT, stops, lost, deadline); !s.ok()) {
      return fail(absl::IsDeadlineExceeded(s) ? NothingAnswered(std::move(s)) : s);
    }
    int err = 0;
    socklen_t elen = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err != 0) return fail(ConnectError(err));
  }
  ServerSocket server{fd, {}};
  if (absl::Status s = AwaitHello(fd, stops, lost, deadline, &server.hello); !s.ok()) {
    return fail(s);
  }
  return server;
}

// A socket connected to the first of `addresses` to answer (address_race.h)
// whose server has sent its kHello; CANCELLED once one of `stops` comes.
absl::StatusOr<ServerSocket> ConnectToAnyAddress(const std::vector<SocketAddress>& addresses,
                                                 const ConnectStops& stops, absl::Time deadline) {
  return TryEachAddress<ServerSocket>(
      addresses, deadline, /*name_each=*/true,
      [&](const SocketAddress& a, const std::atomic<bool>& lost) {
        // A lone address has nothing to lose to: its wait need not wake.
        return ConnectToServer(a, stops, addresses.size() > 1 ? &lost : nullptr, deadline);
      },
      [](ServerSocket&& extra) { close(extra.fd); },
      [](const absl::Status& s) { return absl::IsCancelled(s); });
}

}  // namespace

// ---------------------------------------------------------------- connection

class TcpConnection : public Connection,
                      public TcpTransport::IoHandler,
                      public std::enable_shared_from_this<TcpConnection> {
 public:
  // `server_tcp_alone`: a client's connection whose server's kHello said
  // kHelloTcpAlone. `listener`: a server's, the id of the TcpListener that
  // took it.
  TcpConnection(TcpTransport* transport, int fd, std::string peer, ConnectionObserver* observer,
                bool server_tcp_alone = false, uint64_t listener = 0)
      : transport_(transport),
        fd_(fd),
        peer_(std::move(peer)),
        server_tcp_alone_(server_tcp_alone),
        listener_(listener),
        observer_(observer),
        watch_(absl::Milliseconds(transport->tcp_.peer_timeout_ms)) {}
  ~TcpConnection() override {
    {
      // One refused before it was adopted still counts its held kHello.
      std::lock_guard<std::mutex> lock(send_mu_);
      queued_bytes_ = 0;
      CountQueuedLocked();
    }
    if (fd_ >= 0) close(fd_);
  }

  absl::Status Send(OutboundMessage&& msg) override;
  // Server side, before the runtime sees the connection: queues the kHello
  // (with kHelloTcpAlone if `tcp_alone`), and holds it and every frame sent
  // behind it until SendHello. A connection the runtime refuses is closed
  // with nothing sent, so that its client knows it was never taken.
  void HoldHello(bool tcp_alone);
  // Sends what HoldHello held. I/O thread, once the connection is adopted.
  void SendHello();
  absl::StatusOr<Buffer> AllocatePayload(size_t size) override {
    std::optional<Buffer> memory = Buffer::TryAllocate(size);
    if (!memory) return OutOfMemory(size, absl::StrCat("a message to ", peer_));
    return std::move(*memory);
  }
  void Close() override {
    closing_.store(true);
    shutdown(fd_, SHUT_RDWR);
  }
  // Not just written: acknowledged. A close delivers what the socket holds
  // only if it goes out as a FIN, and a frame the peer sends meanwhile (a
  // cancel) turns it into a reset that drops the unsent rest.
  bool Delivered() override {
    std::lock_guard<std::mutex> lock(send_mu_);
    if (send_closed_) return true;
    int unacknowledged = 0;
    return queue_.empty() && ioctl(fd_, SIOCOUTQ, &unacknowledged) == 0 && unacknowledged == 0;
  }
  const std::string& peer() const override { return peer_; }
  bool ServerTcpAlone() const override { return server_tcp_alone_.load(std::memory_order_relaxed); }
  uint64_t listener() const { return listener_; }

  void OnEvents(uint32_t events) override;
  // I/O thread: ends the connection and tells the observer, once.
  void Finish(absl::Status why);
  // I/O thread, every PeerWatch::Period: Finish()es the connection if its
  // peer is dead by PeerWatch's rule.
  void WatchPeer(absl::Time now);
  int fd() const { return fd_; }
  void set_observer(ConnectionObserver* o) { observer_ = o; }

 private:
  struct Outgoing {
    std::string prefix;  // header + metadata
    Buffer payload;
    size_t sent = 0;     // of prefix + payload
    bool in_error_headroom = false;  // an error taken past the bound
    size_t size() const { return prefix.size() + payload.size(); }
  };

  // Writes as much queued data as the socket takes. Caller holds send_mu_.
  absl::Status FlushLocked();
  // Brings the transport's count of queued bytes (TcpOptions::
  // max_queued_send_bytes_total) up to date with queued_bytes_. Only once a
  // frame stays queued does it touch the shared count: a frame the socket
  // takes at once, the usual case, costs it nothing. Caller holds send_mu_.
  void CountQueuedLocked();
  void OnReadable();
  // Advances the frame parser after `got_` reached the current target.
  absl::Status FrameProgress();
  // Throws the rest of the payload being read away, `refused` being why
  // (the transport's receive bound: receive_budget.h); its call ends with it.
  void SkipPayload(absl::Status refused);
  void Deliver();

  TcpTransport* const transport_;
  const int fd_;
  const std::string peer_;
  std::atomic<bool> server_tcp_alone_;
  const uint64_t listener_;
  ConnectionObserver* observer_;
  std::atomic<bool> closing_{false};
  bool finished_ = false;  // I/O thread
  PeerWatch watch_;        // I/O thread

  std::mutex send_mu_;
  std::deque<Outgoing> queue_;  // guarded by send_mu_
  size_t queued_bytes_ = 0;     // guarded by send_mu_
  // Of queued_bytes_, what TcpTransport::queued_send_bytes_ holds. Guarded
  // by send_mu_.
  size_t queued_counted_ = 0;
  // Of queued_bytes_, the errors taken past the bound. Guarded by send_mu_.
  size_t error_headroom_used_ = 0;
  bool want_out_ = false;       // guarded by send_mu_
  bool send_closed_ = false;    // guarded by send_mu_
  bool hello_held_ = false;     // guarded by send_mu_

  // Receive state (I/O thread only).
  enum class Stage { kHeader, kMetadata, kPayload, kSkip } stage_ = Stage::kHeader;
  char header_bytes_[kHeaderSize];
  size_t got_ = 0;
  InboundMessage in_;
  std::optional<ReceiveBudget::Incoming> incoming_;  // in_'s payload, in Stage::kPayload
  size_t skip_left_ = 0;
};

absl::Status TcpConnection::Send(OutboundMessage&& msg) {
  Header h = msg.header;
  h.flags = 0;
  h.credits = 0;
  h.remote = RemoteDescriptor{};
  if (msg.metadata.size() > kMaxMetadataBytes || msg.payload.size() > kMaxPayloadBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "frame too large for the wire: metadata ", msg.metadata.size(), " (limit ",
        kMaxMetadataBytes, "), payload ", msg.payload.size(), " (limit ", kMaxPayloadBytes, ")"));
  }
  h.metadata_len = static_cast<uint32_t>(msg.metadata.size());
  h.payload_len = static_cast<uint32_t>(msg.payload.size());
  Outgoing out;
  out.prefix.resize(kHeaderSize);
  EncodeHeader(h, out.prefix.data());
  out.prefix += msg.metadata;
  out.payload = std::move(msg.payload);

  std::lock_guard<std::mutex> lock(send_mu_);
  if (send_closed_ || closing_.load()) {
    return RefusedUnsent(absl::StrCat("connection to ", peer_, " is closed"));
  }
  const size_t bound = transport_->tcp_.max_queued_send_bytes;
  const size_t total_bound = transport_->tcp_.max_queued_send_bytes_total;
  const bool over_connection = queued_bytes_ + out.size() > bound;
  if (!IsControlFrame(h) && !queue_.empty() &&
      (over_connection ||
       transport_->queued_send_bytes_.load(std::memory_order_relaxed) + out.size() > total_bound)) {
    const bool error = IsErrorResponse(h);
    if (!error || error_headroom_used_ + out.size() > kQueuedErrorHeadroom) {
      Count(&TcpCounters::send_refusals);
      const absl::string_view headroom =
          error ? ", and kQueuedErrorHeadroom of errors beyond it" : "";
      if (over_connection) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "more than ", bound, " bytes queued for ", peer_, " (TcpOptions::max_queued_send_bytes",
            headroom, "; is the peer reading?)"));
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "more than ", total_bound, " bytes queued for the peers of ", transport_->options_.name,
          ", ", queued_bytes_, " of them for ", peer_, " (TcpOptions::max_queued_send_bytes_total",
          headroom, "; are its peers reading?)"));
    }
    out.in_error_headroom = true;
    error_headroom_used_ += out.size();
  }
  queued_bytes_ += out.size();
  queue_.push_back(std::move(out));
  // Behind the held kHello (which is in the queue), or a pending flush.
  if (queue_.size() > 1) {
    Count(&TcpCounters::frames_queued);
    CountQueuedLocked();
    return absl::OkStatus();
  }
  const absl::Status s = FlushLocked();
  if (!s.ok()) Close();  // the I/O thread reports it via OnClosed
  if (!queue_.empty()) Count(&TcpCounters::frames_queued);
  return absl::OkStatus();
}

void TcpConnection::HoldHello(bool tcp_alone) {
  Header h;
  h.kind = MessageKind::kHello;
  if (tcp_alone) h.call_id = kHelloTcpAlone;
  Outgoing hello;
  hello.prefix.resize(kHeaderSize);
  EncodeHeader(h, hello.prefix.data());
  std::lock_guard<std::mutex> lock(send_mu_);
  hello_held_ = true;
  queued_bytes_ += hello.size();
  queue_.push_front(std::move(hello));
  CountQueuedLocked();
}

void TcpConnection::SendHello() {
  std::lock_guard<std::mutex> lock(send_mu_);
  if (!std::exchange(hello_held_, false) || send_closed_) return;
  if (!FlushLocked().ok()) Close();  // the I/O thread reports it via OnClosed
}

void TcpConnection::CountQueuedLocked() {
  if (queued_bytes_ == queued_counted_) return;
  std::atomic<size_t>& total = transport_->queued_send_bytes_;
  if (queued_bytes_ > queued_counted_) {
    total.fetch_add(queued_bytes_ - queued_counted_, std::memory_order_relaxed);
  } else {
    total.fetch_sub(queued_counted_ - queued_bytes_, std::memory_order_relaxed);
  }
  queued_counted_ = queued_bytes_;
}

absl::Status TcpConnection::FlushLocked() {
  while (!queue_.empty()) {
    iovec iov[64];
    int n = 0;
    for (auto it = queue_.begin(); it != queue_.end() && n < 63; ++it) {
      const size_t sent = it->sent;
      if (sent < it->prefix.size()) {
        iov[n++] = {it->prefix.data() + sent, it->prefix.size() - sent};
        if (!it->payload.empty()) iov[n++] = {it->payload.data(), it->payload.size()};
      } else {
        const size_t off = sent - it->prefix.size();
        iov[n++] = {it->payload.data() + off, it->payload.size() - off};
      }
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = n;
    // MSG_NOSIGNAL: a peer that vanished must cost this connection, not the
    // process (SIGPIPE).
    const ssize_t w = sendmsg(fd_, &mh, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return absl::UnavailableError(absl::StrCat("write to ", peer_, ": ", ErrnoText(errno)));
    }
    Count(&TcpCounters::sendmsg_calls);
    Count(&TcpCounters::bytes_sent, static_cast<uint64_t>(w));
    size_t left = static_cast<size_t>(w);
    while (left > 0 && !queue_.empty()) {
      Outgoing& front = queue_.front();
      const size_t take = std::min(left, front.size() - front.sent);
      front.sent += take;
      left -= take;
      if (front.sent == front.size()) {
        Count(&TcpCounters::frames_sent);
        queued_bytes_ -= front.size();
        if (front.in_error_headroom) error_headroom_used_ -= front.size();
        queue_.pop_front();
      }
    }
  }
  CountQueuedLocked();
  const bool want_out = !queue_.empty();
  if (want_out != want_out_) {
    want_out_ = want_out;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (want_out ? static_cast<uint32_t>(EPOLLOUT) : 0u);
    ev.data.ptr = static_cast<TcpTransport::IoHandler*>(this);
    epoll_ctl(transport_->epoll_fd_, EPOLL_CTL_MOD, fd_, &ev);
  }
  return absl::OkStatus();
}

void TcpConnection::OnEvents(uint32_t events) {
  if (finished_) return;
  if (events & EPOLLOUT) {
    absl::Status s;
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      s = FlushLocked();
    }
    if (!s.ok()) return Finish(s);
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR | EPOLLRDHUP)) OnReadable();
}

void TcpConnection::OnReadable() {
  char scratch[kReadChunk];
  while (!finished_) {
    char* dst = nullptr;
    size_t want = 0;
    switch (stage_) {
      case Stage::kHeader:
        dst = header_bytes_ + got_;
        want = kHeaderSize - got_;
        break;
      case Stage::kMetadata:
        // Through the scratch, appended as it comes: a header announces up
        // to kMaxMetadataBytes, and memory taken then would let peers that
        // send no more hold that much each.
        dst = scratch;
        want = std::min<size_t>(in_.header.metadata_len - got_, sizeof scratch);
        break;
      case Stage::kPayload:
        dst = incoming_->data() + got_;
        want = incoming_->size() - got_;
        break;
      case Stage::kSkip:
        dst = scratch;
        want = std::min(skip_left_, sizeof scratch);
        break;
    }
    ssize_t r = want ? read(fd_, dst, want) : 0;
    if (want > 0) {
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (r < 0 && errno == ETIMEDOUT) {
        Count(&TcpCounters::peer_timeouts);
        return Finish(absl::UnavailableError(
            absl::StrCat("connection to ", peer_,
                         " timed out in the kernel: its retransmissions or keepalive probes "
                         "went unanswered (TcpOptions::keepalive_ms, peer_timeout_ms): the "
                         "peer's machine or link is down")));
      }
      if (r < 0) {
        return Finish(absl::UnavailableError(absl::StrCat("read from ", peer_, ": ",
                                                          ErrnoText(errno))));
      }
      if (r == 0) {
        const bool mid_frame = stage_ != Stage::kHeader || got_ > 0;
        return Finish(absl::UnavailableError(absl::StrCat(
            "connection to ", peer_, closing_.load() ? " closed" : " closed by peer",
            mid_frame ? " in the middle of a frame" : "")));
      }
      Count(&TcpCounters::bytes_received, static_cast<uint64_t>(r));
      if (stage_ == Stage::kSkip) {
        skip_left_ -= r;
      } else if (stage_ == Stage::kMetadata) {
        in_.metadata.append(scratch, r);
        got_ += r;
      } else if (stage_ == Stage::kPayload && !incoming_->Count(r)) {
        got_ += r;
        SkipPayload(transport_->receive_budget_->Exceeded(incoming_->size(), peer_));
      } else {
        got_ += r;
      }
    }
    const absl::Status s = FrameProgress();
    if (!s.ok()) {
      Count(&TcpCounters::malformed_frames);
      fprintf(stderr, "rdmarpc[%s]: closing %s: malformed frame: %s\n",
              transport_->options_.name.c_str(), peer_.c_str(), std::string(s.message()).c_str());
      return Finish(absl::InternalError(
          absl::StrCat("malformed frame from ", peer_, ": ", s.message())));
    }
  }
}

absl::Status TcpConnection::FrameProgress() {
  switch (stage_) {
    case Stage::kHeader: {
      if (got_ < kHeaderSize) return absl::OkStatus();
      in_ = InboundMessage{};
      if (absl::Status s = DecodeHeader(header_bytes_, kHeaderSize, &in_.header); !s.ok()) {
        return s;
      }
      if (in_.header.remote_payload()) {
        return absl::InvalidArgumentError("remote payload over TCP");
      }
      got_ = 0;
      stage_ = Stage::kMetadata;
      return FrameProgress();
    }
    case Stage::kMetadata: {
      if (got_ < in_.header.metadata_len) return absl::OkStatus();
      got_ = 0;
      const uint32_t len = in_.header.payload_len;
      if (len == 0) {
        Deliver();
        return absl::OkStatus();
      }
      ReceiveBudget& budget = *transport_->receive_budget_;
      if (len > transport_->options_.max_message_size) {
        in_.payload_status = absl::ResourceExhaustedError(absl::StrCat(
            "message of ", len, " bytes exceeds max_message_size ",
            transport_->options_.max_message_size));
      } else if (!budget.Fits(len)) {
        in_.payload_status = budget.Exceeded(len, peer_);
      } else if (std::optional<ReceiveBudget::Incoming> memory = budget.Allocate(len)) {
        incoming_ = std::move(*memory);
        stage_ = Stage::kPayload;
        return absl::OkStatus();
      } else {
        in_.payload_status = OutOfMemory(len, absl::StrCat("a message from ", peer_));
        fprintf(stderr, "rdmarpc[%s]: %s; it is skipped, and its call ends with this\n",
                transport_->options_.name.c_str(),
                std::string(in_.payload_status.message()).c_str());
      }
      Count(&TcpCounters::receive_refusals);
      skip_left_ = len;
      stage_ = Stage::kSkip;
      return FrameProgress();
    }
    case Stage::kPayload:
      if (got_ < incoming_->size()) return absl::OkStatus();
      in_.payload = std::move(*incoming_).Take();
      incoming_.reset();
      Deliver();
      return absl::OkStatus();
    case Stage::kSkip:
      if (skip_left_ > 0) return absl::OkStatus();
      Deliver();
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

void TcpConnection::SkipPayload(absl::Status refused) {
  Count(&TcpCounters::receive_refusals);
  skip_left_ = incoming_->size() - got_;
  incoming_.reset();
  in_.payload_status = std::move(refused);
  stage_ = Stage::kSkip;
}

void TcpConnection::Deliver() {
  Count(&TcpCounters::frames_received);
  stage_ = Stage::kHeader;
  got_ = 0;
  InboundMessage msg = std::move(in_);
  in_ = InboundMessage{};
  if (msg.header.kind == MessageKind::kHello) {
    // Past the one Connect read: the server's port is shared with RDMA now.
    if ((msg.header.call_id & kHelloTcpAlone) == 0 && server_tcp_alone_.exchange(false)) {
      observer_->OnMayGoFaster(*this);
    }
    return;
  }
  if (msg.header.kind == MessageKind::kCredit || msg.header.kind == MessageKind::kRelease) {
    return;  // RDMA-only bookkeeping
  }
  observer_->OnMessage(*this, std::move(msg));
}

void TcpConnection::Finish(absl::Status why) {
  if (finished_) return;
  finished_ = true;
  Count(&TcpCounters::connections_closed);
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    send_closed_ = true;
    queue_.clear();
    queued_bytes_ = 0;
    error_headroom_used_ = 0;
    CountQueuedLocked();
  }
  closing_.store(true);
  incoming_.reset();  // gives its bytes back to the receive bound now
  epoll_ctl(transport_->epoll_fd_, EPOLL_CTL_DEL, fd_, nullptr);
  // Bytes left unread make the close a reset, which drops what the socket
  // has not sent yet (the last responses of a server shutting down): read
  // them away first.
  char sink[kReadChunk];
  for (int i = 0; i < kMaxDrainReads && recv(fd_, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
  }
  shutdown(fd_, SHUT_RDWR);
  auto self = shared_from_this();
  transport_->Forget(fd_);
  observer_->OnClosed(*this, why);
}

void TcpConnection::WatchPeer(absl::Time now) {
  if (finished_) return;
  tcp_info info{};
  socklen_t len = sizeof info;
  if (getsockopt(fd_, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return;
  PeerSignals signals;
  signals.data_unacknowledged = info.tcpi_unacked > 0;
  signals.probe_unanswered = info.tcpi_probes > 0;
  signals.last_ack = now - absl::Milliseconds(info.tcpi_last_ack_recv);
  if (!watch_.Dead(signals, now)) return;
  Count(&TcpCounters::peer_timeouts);
  Finish(absl::UnavailableError(
      absl::StrCat("connection to ", peer_, " timed out: nothing acknowledged for ",
                   transport_->tcp_.peer_timeout_ms, " ms (TcpOptions::peer_timeout_ms) while ",
                   signals.data_unacknowledged ? "data sent to it waited for an acknowledgment"
                                               : "a keepalive or window probe waited for an answer",
                   ": the peer's machine or link is down")));
}

// ------------------------------------------------------------------ listener

class TcpListener : public Listener, public TcpTransport::IoHandler {
 public:
  TcpListener(TcpTransport* t, int fd, Address bound, AcceptCallback cb)
      : transport_(t),
        fd_(fd),
        id_(t->next_listener_id_.fetch_add(1) + 1),
        bound_(std::move(bound)),
        on_accept_(std::move(cb)) {}
  ~TcpListener() override {
    transport_->RunInLoopAndWait([this] {
      epoll_ctl(transport_->epoll_fd_, EPOLL_CTL_DEL, fd_, nullptr);
      transport_->listeners_.erase(fd_);
      auto& paused = transport_->paused_accepts_;
      paused.erase(
          std::remove_if(paused.begin(), paused.end(), [&](const auto& p) { return p.fd == fd_; }),
          paused.end());
      transport_->retired_.push_back(this);
    });
    close(fd_);
  }
  const Address& address() const override { return bound_; }
  // On the I/O thread, where connections are taken: none is taken between
  // the flag and the kHellos.
  void SharePortWithRdma() override {
    transport_->RunInLoopAndWait([this] {
      if (std::exchange(beside_rdma_, true)) return;
      for (auto& [fd, conn] : transport_->conns_) {
        if (conn->listener() != id_) continue;
        OutboundMessage hello;
        hello.header.kind = MessageKind::kHello;
        // Refused only where the connection is closing: a full queue takes
        // it (Send), so a client that reads slowly still hears of RDMA.
        (void)conn->Send(std::move(hello));
      }
    });
  }

  void OnEvents(uint32_t) override {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int fd = accept4(fd_, reinterpret_cast<sockaddr*>(&ss), &len,
                             SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        const int err = errno;
        if (err == EINTR || err == ECONNABORTED) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) return;
        if (!AcceptOutOfResources(err)) {
          fprintf(stderr, "rdmarpc[%s]: accept on %s: %s\n", transport_->options_.name.c_str(),
                  bound_.ToString().c_str(), strerror(err));
          return;
        }
        if (!starved_) {
          fprintf(stderr,
                  "rdmarpc[%s]: accept on %s: %s%s; new connections wait in the backlog, "
                  "tried again every %s\n",
                  transport_->options_.name.c_str(), bound_.ToString().c_str(), strerror(err),
                  AcceptAdvice(err).c_str(), absl::FormatDuration(kAcceptPause).c_str());
          starved_ = true;
        }
        transport_->PauseAccepts(this, fd_);
        return;
      }
      if (starved_) {
        fprintf(stderr, "rdmarpc[%s]: accepting on %s again\n", transport_->options_.name.c_str(),
                bound_.ToString().c_str());
        starved_ = false;
      }
      ConfigureConnectedSocket(fd, transport_->tcp_);
      auto conn = std::make_shared<TcpConnection>(
          transport_, fd, absl::StrCat("tcp://", SockaddrString(reinterpret_cast<sockaddr*>(&ss))),
          nullptr, /*server_tcp_alone=*/false, id_);
      conn->HoldHello(/*tcp_alone=*/!beside_rdma_);
      ConnectionObserver* observer = on_accept_(conn);
      if (observer == nullptr) {  // refused: conn closes its fd
        Count(&TcpCounters::accepts_refused);
        continue;
      }
      conn->set_observer(observer);
      transport_->Adopt(conn);
      conn->SendHello();
    }
  }

 private:
  TcpTransport* const transport_;
  const int fd_;
  const uint64_t id_;  // unique in its transport, which its connections name
  const Address bound_;
  AcceptCallback on_accept_;
  bool starved_ = false;      // out of resources since the last accept; I/O thread
  bool beside_rdma_ = false;  // SharePortWithRdma came; I/O thread
};

// ----------------------------------------------------------------- transport

TcpTransport::TcpTransport(TransportOptions options, TcpOptions tcp)
    : options_(std::move(options)),
      tcp_(tcp),
      receive_budget_(ReceiveBudget::New(tcp.max_receive_bytes, options_.memory_quota)) {
  const auto fd_failed = [&](const char* what) {
    const int err = errno;
    return WithFileLimitAdvice(
        absl::UnavailableError(
            absl::StrCat(what, " for the I/O thread of ", options_.name, ": ", ErrnoText(err))),
        err);
  };
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) unusable_ = fd_failed("epoll_create1");
  if (unusable_.ok()) wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (unusable_.ok() && wake_fd_ < 0) unusable_ = fd_failed("eventfd");
  if (unusable_.ok()) stop_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (unusable_.ok() && stop_fd_ < 0) unusable_ = fd_failed("eventfd");
  if (unusable_.ok()) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = nullptr;  // the wake-up fd
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
    auto thread =
        NewThread("tcp-io", absl::StrCat("the I/O of ", options_.name), [this] { Loop(); });
    if (thread.ok()) {
      thread_ = *std::move(thread);
      return;
    }
    unusable_ = thread.status();
  }
  // No loop: whatever would run on it runs where it is asked (Shutdown).
  loop_ended_ = true;
}

TcpTransport::~TcpTransport() {
  Shutdown();
  for (const int fd : {wake_fd_, stop_fd_, epoll_fd_}) {
    if (fd >= 0) close(fd);
  }
  receive_budget_->Drop();  // payloads still held keep it until they are released
}

size_t TcpTransport::received_bytes_held() const { return receive_budget_->held(); }

void TcpTransport::Loop() {
  loop_thread_id_ = std::this_thread::get_id();
  epoll_event events[64];
  while (!loop_exit_) {
    const int n = epoll_wait(epoll_fd_, events, 64, EpollTimeoutMs());
    for (int i = 0; i < n; ++i) {
      if (loop_exit_) break;
      if (events[i].data.ptr == nullptr) {
        uint64_t v;
        while (read(wake_fd_, &v, sizeof v) > 0) {
        }
        std::vector<std::function<void()>> tasks;
        {
          std::lock_guard<std::mutex> lock(tasks_mu_);
          tasks.swap(tasks_);
        }
        for (auto& t : tasks) t();
        continue;
      }
      auto* handler = static_cast<IoHandler*>(events[i].data.ptr);
      if (!retired_.empty() &&
          std::find(retired_.begin(), retired_.end(), handler) != retired_.end()) {
        continue;
      }
      handler->OnEvents(events[i].events);
    }
    // Finished connections die only here, after the batch: a later event of
    // the same batch may still point at one. A listener's owner destroys it
    // as soon as a task of the batch took it out: retired_ skips its events.
    graveyard_.clear();
    retired_.clear();
    ResumeAccepts();
    WatchPeersIfDue();
  }
  // A task queued while the loop ended (a Connect racing Shutdown) still
  // runs, seeing loop_exit_, so that its caller does not wait for ever.
  std::vector<std::function<void()>> late;
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    loop_ended_ = true;
    late.swap(tasks_);
  }
  for (auto& t : late) t();
}

int TcpTransport::EpollTimeoutMs() const {
  absl::Time first =
      conns_.empty() || tcp_.peer_timeout_ms == 0 ? absl::InfiniteFuture() : next_watch_;
  for (const PausedAccept& p : paused_accepts_) first = std::min(first, p.resume);
  if (first == absl::InfiniteFuture()) return -1;
  const absl::Duration left = absl::Ceil(first - SteadyNow(), absl::Milliseconds(1));
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(left)));
}

void TcpTransport::WatchPeersIfDue() {
  if (conns_.empty() || tcp_.peer_timeout_ms == 0) return;
  const absl::Time now = SteadyNow();
  if (now < next_watch_) return;
  next_watch_ = now + PeerWatch::Period(absl::Milliseconds(tcp_.peer_timeout_ms));
  std::vector<std::shared_ptr<TcpConnection>> all;  // WatchPeer may Finish, which Forgets
  all.reserve(conns_.size());
  for (auto& [fd, c] : conns_) all.push_back(c);
  for (auto& c : all) c->WatchPeer(now);
  graveyard_.clear();
}

void TcpTransport::PauseAccepts(IoHandler* listener, int fd) {
  Count(&TcpCounters::accept_pauses);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  paused_accepts_.push_back(PausedAccept{listener, fd, SteadyNow() + kAcceptPause});
}

void TcpTransport::ResumeAccepts() {
  if (paused_accepts_.empty()) return;
  const absl::Time now = SteadyNow();
  auto due = std::partition(paused_accepts_.begin(), paused_accepts_.end(),
                            [&](const PausedAccept& p) { return p.resume > now; });
  for (auto it = due; it != paused_accepts_.end(); ++it) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = it->listener;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, it->fd, &ev);
  }
  paused_accepts_.erase(due, paused_accepts_.end());
}

void TcpTransport::RunInLoopAndWait(std::function<void()> fn) {
  if (std::this_thread::get_id() == loop_thread_id_) {
    fn();
    return;
  }
  std::promise<void> done;
  bool queued = false;
  {
    std::lock_guard<std::mutex> lock(tasks_mu_);
    if (!loop_ended_) {
      tasks_.push_back([&] {
        fn();
        done.set_value();
      });
      queued = true;
    }
  }
  if (!queued) {  // no loop to run it: nothing else touches its state now
    fn();
    return;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  done.get_future().wait();
}

void TcpTransport::Adopt(std::shared_ptr<TcpConnection> conn) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.ptr = static_cast<IoHandler*>(conn.get());
  const int fd = conn->fd();
  Count(&TcpCounters::connections_opened);
  conns_[fd] = std::move(conn);
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
}

void TcpTransport::Forget(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  graveyard_.push_back(std::move(it->second));
  conns_.erase(it);
}

absl::StatusOr<bool> TcpListensAlone(const Address& addr, int stop_fd,
                                     const std::atomic<bool>* give_up, absl::Time deadline) {
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  absl::StatusOr<ServerSocket> server =
      ConnectToAnyAddress(*addresses, ConnectStops{stop_fd, give_up}, deadline);
  if (!server.ok()) return server.status();
  close(server->fd);
  return (server->hello.call_id & kHelloTcpAlone) != 0;
}

absl::StatusOr<std::shared_ptr<Connection>> TcpTransport::Connect(const Address& addr,
                                                                  ConnectionObserver* observer,
                                                                  absl::Time deadline) {
  return ConnectWith(addr, observer, deadline, nullptr);
}

absl::StatusOr<std::shared_ptr<Connection>> TcpTransport::ConnectUnless(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>& give_up) {
  return ConnectWith(addr, observer, deadline, &give_up);
}

absl::StatusOr<std::shared_ptr<Connection>> TcpTransport::ConnectWith(
    const Address& addr, ConnectionObserver* observer, absl::Time deadline,
    const std::atomic<bool>* give_up) {
  if (stopped_.load()) return absl::FailedPreconditionError("transport is shut down");
  if (!unusable_.ok()) return unusable_;
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  const std::string target = addr.ToString();
  // Shutdown's stop_fd_ ends the wait for a handshake (CANCELLED), as
  // `give_up` does.
  absl::StatusOr<ServerSocket> server =
      ConnectToAnyAddress(*addresses, ConnectStops{stop_fd_, give_up}, deadline);
  if (!server.ok()) {
    const bool given_up = give_up != nullptr && give_up->load(std::memory_order_relaxed);
    return Prefixed(given_up ? absl::StatusCode::kCancelled : absl::StatusCode::kUnavailable,
                    absl::StrCat("connect to ", target), server.status());
  }
  ConfigureConnectedSocket(server->fd, tcp_);
  auto conn = std::make_shared<TcpConnection>(this, server->fd, target, observer,
                                              (server->hello.call_id & kHelloTcpAlone) != 0);
  bool adopted = false;
  RunInLoopAndWait([&] {
    if (loop_exit_) return;
    Adopt(conn);
    adopted = true;
  });
  if (!adopted) return absl::FailedPreconditionError("transport is shut down");
  return std::shared_ptr<Connection>(conn);
}

absl::StatusOr<std::unique_ptr<Listener>> TcpTransport::Listen(const Address& addr,
                                                               AcceptCallback on_accept) {
  if (stopped_.load()) return absl::FailedPreconditionError("transport is shut down");
  if (!unusable_.ok()) return unusable_;
  auto addresses = ResolveAddresses(addr);
  if (!addresses.ok()) return addresses.status();
  auto listener = ListenOnEachAddress(*addresses, options_.name, [&](const SocketAddress& a) {
    return ListenSocket(a, addr, on_accept);
  });
  if (!listener.ok()) {
    return Prefixed(listener.status().code(), absl::StrCat("listen on ", addr.ToString()),
                    listener.status());
  }
  return listener;
}

absl::StatusOr<std::unique_ptr<Listener>> TcpTransport::ListenSocket(const SocketAddress& at,
                                                                     const Address& asked,
                                                                     AcceptCallback on_accept) {
  const int fd = socket(at.storage.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return SocketError(errno);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&at.storage), at.len) != 0 ||
      listen(fd, 1024) != 0) {
    const int err = errno;
    close(fd);
    return BindError(err);
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &blen);
  Address bound_addr = asked;
  bound_addr.scheme = "tcp";  // also when asked for auto://
  bound_addr.port = PortOf(bound);
  auto listener = std::make_unique<TcpListener>(this, fd, bound_addr, std::move(on_accept));
  TcpListener* raw = listener.get();
  RunInLoopAndWait([&] {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = static_cast<IoHandler*>(raw);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    listeners_[fd] = raw;
  });
  return std::unique_ptr<Listener>(std::move(listener));
}

void TcpTransport::Shutdown() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!write(stop_fd_, &one, sizeof one);
  RunInLoopAndWait([this] {
    for (auto& [fd, l] : listeners_) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    paused_accepts_.clear();
    std::vector<std::shared_ptr<TcpConnection>> all;
    for (auto& [fd, c] : conns_) all.push_back(c);
    for (auto& c : all) c->Finish(absl::UnavailableError("transport shutting down"));
    loop_exit_ = true;
  });
  if (thread_.joinable()) thread_.join();
}

}  // namespace rdmarpc::transport
