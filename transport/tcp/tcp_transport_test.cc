// TcpTransport against a raw socket peer: what a peer that stops reading can
// make a sender hold, and that it is not taken for dead; closing a
// connection from our side, and a connect that waits on a peer that does not
// answer; the keepalive and peer timeout the connection's socket gets; a
// connect that returns only once the server took the connection (kHello);
// Delivered waiting for the peer's acknowledgment; what the kHello said of
// the server's port, even to a client that reads slowly; a listener
// destroyed while its events are due; a server out of file descriptors; the
// bound on what all connections queue, and on the payloads received and
// held; and what the counters (tcp_counters.h) count of these.
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/cpu_time.h"
#include "gtest/gtest.h"
#include "transport/attempt_errors.h"
#include "transport/tcp/tcp_counters.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport {
namespace {

// 127.0.0.1:`port`, for a raw socket.
sockaddr_in Loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  return a;
}

class NoObserver : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    call_ids_.push_back(msg.header.call_id);
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.push_back(why);
  }
  // The call id of the first frame that came, or 0 when none came `within`.
  uint64_t FirstCallId(absl::Duration within) {
    const absl::Time until = absl::Now() + within;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!call_ids_.empty()) return call_ids_.front();
      }
      if (absl::Now() > until) return 0;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  // How the connection ended, each time OnClosed was called, once none more
  // came for a moment.
  std::vector<absl::Status> Closed(absl::Duration within) {
    const absl::Time until = absl::Now() + within;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!closed_.empty() || absl::Now() > until) break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    absl::SleepFor(absl::Milliseconds(50));
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

 private:
  std::mutex mu_;
  std::vector<absl::Status> closed_;
  std::vector<uint64_t> call_ids_;
};

// A listening socket on loopback with a small receive buffer, so that a peer
// that does not read fills it quickly. With a backlog of 0 and one connection
// waiting to be accepted, the SYNs of further ones go unanswered.
class SilentPeer {
 public:
  explicit SilentPeer(int backlog = 1) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 64 << 10;
    setsockopt(listen_fd_, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);  // accepted ones inherit
    sockaddr_in a = Loopback(0);
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << strerror(errno);
    EXPECT_EQ(listen(listen_fd_, backlog), 0) << strerror(errno);
    socklen_t len = sizeof a;
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    sockaddr_ = a;
  }
  ~SilentPeer() {
    if (fd_ >= 0) close(fd_);
    if (filler_fd_ >= 0) close(filler_fd_);
    close(listen_fd_);
  }
  Address address() const { return *ParseAddress(absl::StrCat("tcp://127.0.0.1:", port_)); }
  int port() const { return port_; }
  // Connects a plain socket, never accepted; closed with the peer.
  void FillAcceptQueue() {
    filler_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(connect(filler_fd_, reinterpret_cast<sockaddr*>(&sockaddr_), sizeof sockaddr_), 0)
        << strerror(errno);
  }
  // Takes the next connection; with `greet`, sends the kHello that tells
  // its Connect the server took it.
  bool Accept(bool greet = true) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 10000) <= 0) return false;
    fd_ = accept(listen_fd_, nullptr, nullptr);
    if (fd_ < 0 || !greet) return fd_ >= 0;
    Header h;
    h.kind = MessageKind::kHello;
    char frame[kHeaderSize];
    EncodeHeader(h, frame);
    return write(fd_, frame, sizeof frame) == static_cast<ssize_t>(sizeof frame);
  }
  // Writes `bytes` to the accepted connection.
  bool Write(const std::string& bytes) {
    return write(fd_, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
  }
  void CloseAccepted() {
    close(fd_);
    fd_ = -1;
  }
  // True when the sender closed the connection (EOF within 10 s).
  bool SeesEof() {
    pollfd p{fd_, POLLIN, 0};
    char c;
    return poll(&p, 1, 10000) > 0 && read(fd_, &c, 1) == 0;
  }
  // Reads until `bytes` have arrived or 20 s pass; what arrived.
  size_t ReadUpTo(size_t bytes) {
    std::string chunk(1 << 16, '\0');
    size_t got = 0;
    while (got < bytes) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20000) <= 0) break;
      const ssize_t n = read(fd_, chunk.data(), chunk.size());
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    return got;
  }

 private:
  int listen_fd_ = -1;
  int fd_ = -1;
  int filler_fd_ = -1;
  int port_ = 0;
  sockaddr_in sockaddr_{};
};

// `client` connected to `peer`, which takes the connection meanwhile.
absl::StatusOr<std::shared_ptr<Connection>> ConnectTaken(TcpTransport& client, SilentPeer& peer,
                                                         ConnectionObserver* observer) {
  auto connecting = std::async(std::launch::async, [&] {
    return client.Connect(peer.address(), observer, SteadyNow() + absl::Seconds(10));
  });
  EXPECT_TRUE(peer.Accept());
  return connecting.get();
}

// Sends a request frame of `payload_bytes` on `conn`.
absl::Status SendRequest(Connection& conn, size_t payload_bytes) {
  auto payload = conn.AllocatePayload(payload_bytes);
  if (!payload.ok()) return payload.status();
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  m.payload = std::move(*payload);
  return conn.Send(std::move(m));
}

// A peer that stops reading pins at most TcpOptions::max_queued_send_bytes of the
// sender's memory: Send refuses RESOURCE_EXHAUSTED naming the bound, loses
// nothing it took, and takes frames again once the peer reads. A cancel is
// taken past the bound: refused, the server would work on for nothing.
// The counters show the refusals, the frames that waited and the frames and
// bytes that went.
TEST(TcpTransport, PeerThatStopsReadingPinsNoMoreThanTheQueueBound) {
  const tcp::TcpCounters before = tcp::Counters();
  SilentPeer peer;
  NoObserver observer;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "queue-bound-client";
  TcpOptions tcp;
  tcp.max_queued_send_bytes = 1 << 20;
  TcpTransport client(options, tcp);
  auto conn = ConnectTaken(client, peer, &observer);
  ASSERT_TRUE(conn.ok()) << conn.status();
  constexpr size_t kPayload = 64 << 10;
  constexpr size_t kFrame = kHeaderSize + kPayload;
  auto send_one = [&] { return SendRequest(**conn, kPayload); };
  // The socket buffers take a few MiB at most; 128 MiB would mean no bound.
  size_t taken = 0;
  absl::Status refused;
  while (taken < 2048) {
    refused = send_one();
    if (!refused.ok()) break;
    ++taken;
  }
  ASSERT_FALSE(refused.ok()) << taken << " frames of " << kFrame << " bytes queued without bound";
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("more than 1048576 bytes queued"), absl::string_view::npos)
      << refused;
  EXPECT_NE(refused.message().find("TcpOptions::max_queued_send_bytes"), absl::string_view::npos)
      << refused;
  printf("%zu frames of %zu bytes taken before the bound refused one\n", taken, kFrame);
  // Header-only requests fill the queue to within a header of the bound.
  size_t headers = 0;
  while (SendRequest(**conn, 0).ok()) ++headers;
  OutboundMessage cancel;
  cancel.header.kind = MessageKind::kCancel;
  cancel.header.call_id = 1;
  EXPECT_TRUE((*conn)->Send(std::move(cancel)).ok()) << "a full queue refused a cancel";
  EXPECT_FALSE(SendRequest(**conn, 0).ok()) << "the cancel reopened the queue to requests";

  EXPECT_EQ(tcp::Counters().Since(before).send_refusals, 3u);

  const size_t sent = taken * kFrame + (headers + 1) * kHeaderSize;
  EXPECT_EQ(peer.ReadUpTo(sent), sent) << "frames Send took were lost";
  EXPECT_TRUE(send_one().ok()) << "the connection stayed refused after its peer read";
  EXPECT_EQ(peer.ReadUpTo(kFrame), kFrame);
  // A frame is counted once its last bytes went, which the peer may read
  // first: wait for the count.
  const uint64_t frames = taken + headers + 2;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (tcp::Counters().Since(before).frames_sent < frames && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const tcp::TcpCounters counted = tcp::Counters().Since(before);
  EXPECT_EQ(counted.frames_sent, frames);
  EXPECT_EQ(counted.bytes_sent, sent + kFrame);
  EXPECT_EQ(counted.send_refusals, 3u);
  // All but those the socket took whole at once, before it filled.
  EXPECT_GE(counted.frames_queued, headers + 1);
  EXPECT_LT(counted.frames_queued, frames);
  EXPECT_EQ(counted.connections_opened, 1u);
  EXPECT_EQ(counted.connections_closed, 0u);
}

// Peers that stop reading pin at most TcpOptions::max_queued_send_bytes_total
// of the sender's memory together, whatever their number: once their
// queues hold that much, a Send on a connection with something queued is
// refused naming the transport's bound; a cancel still goes; once a peer
// reads, the others' connections take frames again, and nothing stays
// counted once every queue has drained.
TEST(TcpTransport, PeersThatStopReadingPinNoMoreThanTheTransportsQueueBound) {
  SilentPeer first_peer;
  SilentPeer second_peer;
  NoObserver observer;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "total-queue-bound-client";
  TcpOptions tcp;
  tcp.max_queued_send_bytes = 1 << 20;
  tcp.max_queued_send_bytes_total = 3 << 19;  // 1.5 MiB
  TcpTransport client(options, tcp);
  auto first = ConnectTaken(client, first_peer, &observer);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ConnectTaken(client, second_peer, &observer);
  ASSERT_TRUE(second.ok()) << second.status();
  constexpr size_t kPayload = 64 << 10;
  constexpr size_t kFrame = kHeaderSize + kPayload;
  // Frames on `conn` until one is refused (at most 2048: 128 MiB would mean
  // no bound); how many were taken, and the refusal.
  const auto fill = [&](Connection& conn, absl::Status* refused) {
    size_t taken = 0;
    while (taken < 2048) {
      *refused = SendRequest(conn, kPayload);
      if (!refused->ok()) break;
      ++taken;
    }
    return taken;
  };
  absl::Status refused;
  const size_t first_taken = fill(**first, &refused);
  ASSERT_FALSE(refused.ok()) << "the first connection queued without bound";
  EXPECT_NE(refused.message().find("(TcpOptions::max_queued_send_bytes;"), absl::string_view::npos)
      << "one connection's 1 MiB is within the transport's 1.5: " << refused;
  EXPECT_GE(client.queued_send_bytes(), size_t{1} << 19);
  EXPECT_LE(client.queued_send_bytes(), size_t{1} << 20);

  const size_t second_taken = fill(**second, &refused);
  ASSERT_FALSE(refused.ok()) << "the second connection queued without bound";
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  for (const char* part :
       {"more than 1572864 bytes queued for the peers of total-queue-bound-client",
        "TcpOptions::max_queued_send_bytes_total"}) {
    EXPECT_NE(refused.message().find(part), absl::string_view::npos)
        << "\"" << part << "\" not in: " << refused;
  }
  EXPECT_LE(client.queued_send_bytes(), size_t{3} << 19);
  printf("%zu and %zu frames of %zu bytes taken before the bounds refused one\n", first_taken,
         second_taken, kFrame);
  OutboundMessage cancel;
  cancel.header.kind = MessageKind::kCancel;
  cancel.header.call_id = 1;
  EXPECT_TRUE((*second)->Send(std::move(cancel)).ok()) << "a full transport refused a cancel";

  // The first peer reads: the second connection takes frames again.
  EXPECT_EQ(first_peer.ReadUpTo(first_taken * kFrame), first_taken * kFrame);
  const absl::Time until = absl::Now() + absl::Seconds(10);
  absl::Status again = SendRequest(**second, kPayload);
  while (!again.ok() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
    again = SendRequest(**second, kPayload);
  }
  EXPECT_TRUE(again.ok()) << "the transport stayed full after a peer read: " << again;
  const size_t second_sent = (second_taken + 1) * kFrame + kHeaderSize;
  EXPECT_EQ(second_peer.ReadUpTo(second_sent), second_sent);
  while (client.queued_send_bytes() != 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(client.queued_send_bytes(), 0u) << "bytes stayed counted after every queue drained";
}

// Keeps every message, payload and all, until told to let them go.
class Keeper : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    kept_.push_back(std::move(msg));
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_.push_back(why);
  }
  // Whether the message `call_id` came within 10 s; *status is its
  // payload_status, *size its payload's size and *metadata_size (unless
  // null) its metadata's.
  bool Await(uint64_t call_id, absl::Status* status, size_t* size,
             size_t* metadata_size = nullptr) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const InboundMessage& m : kept_) {
          if (m.header.call_id != call_id) continue;
          *status = m.payload_status;
          *size = m.payload.size();
          if (metadata_size != nullptr) *metadata_size = m.metadata.size();
          return true;
        }
      }
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  void LetGo(uint64_t call_id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (InboundMessage& m : kept_) {
      if (m.header.call_id == call_id) m.payload.Reset();
    }
  }
  size_t closed() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_.size();
  }

 private:
  std::mutex mu_;
  std::vector<InboundMessage> kept_;
  std::vector<absl::Status> closed_;
};

// A response frame's header for `call_id`, announcing `payload` bytes.
std::string ResponseHeader(uint64_t call_id, size_t payload) {
  Header h;
  h.kind = MessageKind::kResponse;
  h.call_id = call_id;
  h.payload_len = static_cast<uint32_t>(payload);
  std::string bytes(kHeaderSize, '\0');
  EncodeHeader(h, bytes.data());
  return bytes;
}

// TcpOptions::max_receive_bytes bounds the payloads one transport holds
// received, across its connections, counted as their bytes arrive and until
// they are released. A frame that would pass it is skipped and reported
// RESOURCE_EXHAUSTED naming the bound, whether that shows at its header or
// part way through its bytes (another connection filled the bound
// meanwhile), and its connection goes on. A frame announced and not yet
// sent holds none of it, so it cannot keep other peers' messages out.
TEST(TcpTransport, ReceivedPayloadsHeldAreBoundedAcrossConnections) {
  const tcp::TcpCounters before = tcp::Counters();
  constexpr size_t kMiB = size_t{1} << 20;
  constexpr size_t kBound = 4 * kMiB;
  const std::string mib(kMiB, 'r');
  SilentPeer slow;
  SilentPeer fast;
  Keeper keeper;  // outlives the transport: it keeps a payload past it
  TransportOptions options;
  options.name = "receive-bound-client";
  TcpOptions tcp;
  tcp.max_receive_bytes = kBound;
  TcpTransport client(options, tcp);
  auto slow_conn = ConnectTaken(client, slow, &keeper);
  ASSERT_TRUE(slow_conn.ok()) << slow_conn.status();
  auto fast_conn = ConnectTaken(client, fast, &keeper);
  ASSERT_TRUE(fast_conn.ok()) << fast_conn.status();
  const auto held_becomes = [&](size_t bytes) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (client.received_bytes_held() != bytes && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return client.received_bytes_held() == bytes;
  };
  const auto expect_taken = [&](uint64_t call_id, size_t payload) {
    absl::Status status;
    size_t size = 0;
    ASSERT_TRUE(keeper.Await(call_id, &status, &size)) << "frame " << call_id << " never came";
    EXPECT_TRUE(status.ok()) << "frame " << call_id << ": " << status;
    EXPECT_EQ(size, payload) << "frame " << call_id;
  };
  const auto expect_refused = [&](uint64_t call_id) {
    absl::Status status;
    size_t size = 0;
    ASSERT_TRUE(keeper.Await(call_id, &status, &size)) << "frame " << call_id << " never came";
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted)
        << "frame " << call_id << ": " << status;
    EXPECT_EQ(size, 0u) << "frame " << call_id;
    for (const std::string& part :
         {std::string("TcpOptions::max_receive_bytes"), std::to_string(kBound)}) {
      EXPECT_NE(status.message().find(part), absl::string_view::npos)
          << "\"" << part << "\" not in: " << status;
    }
  };

  // 3 MiB announced, 1 MiB of it sent: 1 MiB held, not 3.
  ASSERT_TRUE(slow.Write(ResponseHeader(1, 3 * kMiB) + mib));
  EXPECT_TRUE(held_becomes(kMiB)) << client.received_bytes_held() << " held";
  ASSERT_TRUE(fast.Write(ResponseHeader(2, 3 * kMiB) + mib + mib + mib));
  expect_taken(2, 3 * kMiB);
  EXPECT_EQ(client.received_bytes_held(), kBound);
  // The rest of frame 1 no longer fits: refused part way.
  ASSERT_TRUE(slow.Write(mib + mib));
  expect_refused(1);
  EXPECT_TRUE(held_becomes(3 * kMiB)) << client.received_bytes_held() << " held";
  ASSERT_TRUE(slow.Write(ResponseHeader(3, kMiB) + mib));
  expect_taken(3, kMiB);
  // Refused at its header: 4 MiB held, kept by the observer.
  ASSERT_TRUE(fast.Write(ResponseHeader(4, kMiB) + mib));
  expect_refused(4);
  EXPECT_EQ(client.received_bytes_held(), kBound);

  keeper.LetGo(3);
  EXPECT_EQ(client.received_bytes_held(), 3 * kMiB);
  keeper.LetGo(2);
  EXPECT_EQ(client.received_bytes_held(), 0u);
  ASSERT_TRUE(fast.Write(ResponseHeader(5, kBound + 1) + std::string(kBound + 1, 'r')));
  expect_refused(5);
  ASSERT_TRUE(fast.Write(ResponseHeader(6, kBound) + std::string(kBound, 'r')));
  expect_taken(6, kBound);
  ASSERT_TRUE(slow.Write(ResponseHeader(7, 0)));  // no payload: taken with the bound full
  expect_taken(7, 0);
  EXPECT_EQ(keeper.closed(), 0u) << "a refused frame closed its connection";
  const tcp::TcpCounters counted = tcp::Counters().Since(before);
  EXPECT_EQ(counted.receive_refusals, 3u);
  EXPECT_EQ(counted.frames_received, 7u);
  EXPECT_EQ(counted.bytes_received, 7 * kHeaderSize + 8 * kMiB + 2 * kBound + 1);
  EXPECT_EQ(counted.connections_opened, 2u);
  EXPECT_EQ(counted.connections_closed, 0u);
}

// This process's resident memory, in bytes.
int64_t ResidentBytes() {
  FILE* f = fopen("/proc/self/statm", "r");
  long long pages = 0;
  long long resident = 0;
  if (f != nullptr) {
    if (fscanf(f, "%lld %lld", &pages, &resident) != 2) resident = 0;
    fclose(f);
  }
  return resident * sysconf(_SC_PAGESIZE);
}

// A frame takes memory as its bytes arrive, not when its header announces
// them: peers that each announce the most metadata a frame may carry
// (kMaxMetadataBytes), or a 4 MiB payload, and send none of it cost a server
// next to nothing each, so its memory stays flat however many such
// connections it holds. A frame whose metadata does come is delivered with
// all of it.
TEST(TcpTransport, AnnouncedBytesTakeNoMemoryUntilTheyCome) {
  constexpr size_t kPeers = 300;  // of each kind
  constexpr uint32_t kPayload = 4 << 20;
  rlimit files{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  if (files.rlim_cur < 6 * kPeers) {
    rlimit more = files;
    more.rlim_cur = std::min<rlim_t>(files.rlim_max, 6 * kPeers);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &more), 0) << strerror(errno);
  }
  Keeper keeper;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "announcements-server";
  TcpTransport server(options);
  auto listener =
      server.Listen(*ParseAddress("tcp://127.0.0.1:0"),
                    [&](std::shared_ptr<Connection>) -> ConnectionObserver* { return &keeper; });
  ASSERT_TRUE(listener.ok()) << listener.status();
  const sockaddr_in to = Loopback((*listener)->address().port);
  std::vector<int> peers;
  // kPeers more peers, each sending a request header announcing
  // `metadata_len` and `payload_len` bytes and nothing more; how much the
  // process's resident memory grew once the server read them all.
  const auto announce = [&](uint32_t metadata_len, uint32_t payload_len) -> int64_t {
    Header h;
    h.kind = MessageKind::kRequest;
    h.call_id = 1;
    h.metadata_len = metadata_len;
    h.payload_len = payload_len;
    char header[kHeaderSize];
    EncodeHeader(h, header);
    const tcp::TcpCounters before = tcp::Counters();
    const int64_t resident_before = ResidentBytes();
    for (size_t i = 0; i < kPeers; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      EXPECT_GE(fd, 0) << strerror(errno);
      peers.push_back(fd);
      EXPECT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to), 0)
          << strerror(errno);
      EXPECT_EQ(write(fd, header, sizeof header), static_cast<ssize_t>(sizeof header));
    }
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (tcp::Counters().Since(before).bytes_received < kPeers * kHeaderSize &&
           absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(tcp::Counters().Since(before).bytes_received, kPeers * kHeaderSize)
        << "the server did not read every header";
    const int64_t grown = ResidentBytes() - resident_before;
    printf(
        "%zu connections announcing %u bytes of metadata and %u of payload: %lld bytes more "
        "resident\n",
        kPeers, metadata_len, payload_len, static_cast<long long>(grown));
    return grown;
  };
  // Taken at once, the metadata would be 19 MiB and the payloads 1.2 GiB;
  // what each connection costs besides comes to 0.2-5 KiB here, and up to
  // 20 KiB under the sanitizers.
  EXPECT_LT(announce(kMaxMetadataBytes, 0), static_cast<int64_t>(kPeers * kMaxMetadataBytes / 2))
      << "announced metadata took memory before it came";
  EXPECT_LT(announce(0, kPayload), static_cast<int64_t>(kPeers * kPayload / 16))
      << "announced payloads took memory before they came";
  EXPECT_EQ(server.received_bytes_held(), 0u);

  const std::string metadata(kMaxMetadataBytes, 'm');
  const size_t first = metadata.size() / 3;
  ASSERT_EQ(write(peers[0], metadata.data(), first), static_cast<ssize_t>(first));
  ASSERT_EQ(write(peers[0], metadata.data() + first, metadata.size() - first),
            static_cast<ssize_t>(metadata.size() - first));
  absl::Status status;
  size_t size = 1;
  size_t metadata_size = 0;
  ASSERT_TRUE(keeper.Await(1, &status, &size, &metadata_size)) << "the frame never came";
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(size, 0u);
  EXPECT_EQ(metadata_size, kMaxMetadataBytes);
  for (const int fd : peers) close(fd);
  setrlimit(RLIMIT_NOFILE, &files);
}

// A peer that stops reading but whose kernel answers (a handler running
// inline on its I/O thread, a stalled process) closes its window; the
// connection waits for it past the peer timeout, as RDMA waits out a
// receiver without buffers, and delivers everything once it reads. Linux's
// TCP_USER_TIMEOUT would have ended it a timeout after its first window
// probe.
TEST(TcpTransport, APeerThatStopsReadingIsNotTakenForDead) {
  SilentPeer peer;
  NoObserver observer;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "stalled-peer-client";
  TcpOptions tcp;
  tcp.peer_timeout_ms = 300;
  TcpTransport client(options, tcp);
  auto conn = ConnectTaken(client, peer, &observer);
  ASSERT_TRUE(conn.ok()) << conn.status();
  constexpr size_t kPayload = 64 << 10;
  constexpr size_t kFrames = 64;  // 4 MiB: past the socket buffers of both ends
  for (size_t i = 0; i < kFrames; ++i) ASSERT_TRUE(SendRequest(**conn, kPayload).ok());
  const std::vector<absl::Status> closed = observer.Closed(absl::Seconds(3));
  EXPECT_TRUE(closed.empty()) << "a peer that only stopped reading was taken for dead: "
                              << closed.front();
  EXPECT_FALSE((*conn)->Delivered()) << "the peer's window never closed: this tests nothing";
  EXPECT_EQ(peer.ReadUpTo(kFrames * (kHeaderSize + kPayload)), kFrames * (kHeaderSize + kPayload));
  EXPECT_TRUE(observer.Closed(absl::Milliseconds(100)).empty());
}

// Close ends the connection from our side: the peer sees it closed, the
// observer hears of it once, and a Send after it fails UNAVAILABLE.
TEST(TcpTransport, CloseEndsTheConnectionOnceAndRefusesLaterSends) {
  const tcp::TcpCounters before = tcp::Counters();
  SilentPeer peer;
  NoObserver observer;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "closing-client";
  TcpTransport client(options);
  auto conn = ConnectTaken(client, peer, &observer);
  ASSERT_TRUE(conn.ok()) << conn.status();
  (*conn)->Close();
  EXPECT_TRUE(peer.SeesEof()) << "the peer never saw the connection close";
  EXPECT_EQ(observer.Closed(absl::Seconds(10)).size(), 1u) << "OnClosed not called exactly once";
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  const absl::Status late = (*conn)->Send(std::move(m));
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  EXPECT_NE(late.message().find("is closed"), absl::string_view::npos) << late;
  const tcp::TcpCounters counted = tcp::Counters().Since(before);
  EXPECT_EQ(counted.connections_opened, 1u);
  EXPECT_EQ(counted.connections_closed, 1u);
  EXPECT_EQ(counted.peer_timeouts, 0u);
}

// A connect with no deadline to a peer whose SYNs go unanswered (here: its
// accept queue is full) waits asleep until the transport shuts down.
TEST(TcpTransport, AConnectWithNoDeadlineWaitsAsleep) {
  SilentPeer peer(/*backlog=*/0);
  peer.FillAcceptQueue();
  NoObserver observer;
  TcpTransport client(TransportOptions{});
  auto connecting = std::async(std::launch::async, [&] {
    return client.Connect(peer.address(), &observer, absl::InfiniteFuture());
  });
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Duration cpu_before = ProcessCpuTime();
  ASSERT_EQ(connecting.wait_for(std::chrono::milliseconds(500)), std::future_status::timeout)
      << "the connect ended though its SYN cannot be answered";
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_LT(cpu, absl::Milliseconds(250)) << "the connect spun for " << cpu << " in 500 ms";
  client.Shutdown();
  ASSERT_EQ(connecting.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_FALSE(connecting.get().ok());
}

// A connect whose SYN nothing answers (a full accept queue again; a host
// that is down or a firewall that drops the port alike) ends at its
// deadline, saying what to check.
TEST(TcpTransport, AConnectNothingAnswersEndsAtItsDeadlineSayingWhatToCheck) {
  SilentPeer peer(/*backlog=*/0);
  peer.FillAcceptQueue();
  NoObserver observer;
  TcpTransport client(TransportOptions{});
  auto conn = client.Connect(peer.address(), &observer, SteadyNow() + absl::Milliseconds(300));
  ASSERT_FALSE(conn.ok()) << "a connect nothing answered was returned";
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable) << conn.status();
  EXPECT_TRUE(absl::StartsWith(
      conn.status().message(),
      absl::StrCat("connect to ", peer.address().ToString(), ": timed out. Nothing answered")))
      << conn.status();
  EXPECT_TRUE(absl::EndsWith(conn.status().message(), "not too busy to take connections."))
      << conn.status();
  // Kept apart too, so that auto://, which tries RDMA first, says it once.
  EXPECT_TRUE(conn.status().GetPayload(kWhatToDo).has_value()) << conn.status();
}

// A connect given up from another thread (ConnectUnless: what a channel
// does as it goes, whose transport is shared and stays up) ends CANCELLED
// within moments, wherever it waits: for the answer to its SYN (a full
// accept queue), or for the server's kHello (a server that took the
// connection in the kernel alone). One given up before it starts ends so
// too, though the server, which a plain Connect reaches, would take it.
TEST(TcpTransport, AConnectGivenUpEndsWhereverItWaits) {
  NoObserver observer;
  TcpTransport client(TransportOptions{});
  SilentPeer unanswered(/*backlog=*/0);
  unanswered.FillAcceptQueue();
  SilentPeer ungreeting;
  for (SilentPeer* peer : {&unanswered, &ungreeting}) {
    SCOPED_TRACE(peer == &unanswered ? "waiting for the SYN's answer" : "waiting for the kHello");
    std::atomic<bool> give_up{false};
    auto connecting = std::async(std::launch::async, [&] {
      return client.ConnectUnless(peer->address(), &observer, SteadyNow() + absl::Seconds(60),
                                  give_up);
    });
    if (peer == &ungreeting) {
      ASSERT_TRUE(ungreeting.Accept(/*greet=*/false));
    }
    ASSERT_EQ(connecting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
        << "the connect ended before it was given up";
    give_up.store(true);
    ASSERT_EQ(connecting.wait_for(std::chrono::seconds(10)), std::future_status::ready)
        << "a connect given up went on";
    const auto conn = connecting.get();
    EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
    EXPECT_NE(conn.status().message().find("given up"), absl::string_view::npos) << conn.status();
  }
  SilentPeer greeting;
  auto connecting = std::async(std::launch::async, [&] {
    return client.Connect(greeting.address(), &observer, SteadyNow() + absl::Seconds(60));
  });
  ASSERT_TRUE(greeting.Accept());
  ASSERT_TRUE(connecting.get().ok());
  const std::atomic<bool> given_up{true};
  const auto conn = client.ConnectUnless(greeting.address(), &observer,
                                         SteadyNow() + absl::Seconds(60), given_up);
  EXPECT_TRUE(absl::IsCancelled(conn.status())) << conn.status();
}

// This process's socket connected to 127.0.0.1:`port`, or -1.
int SocketConnectedTo(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    const int fd = atoi(e->d_name);
    sockaddr_in a{};
    socklen_t len = sizeof a;
    if (fd > 2 && getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0 &&
        a.sin_family == AF_INET && ntohs(a.sin_port) == port) {
      found = fd;
    }
  }
  closedir(dir);
  return found;
}

int IntOption(int fd, int level, int name) {
  int value = -1;
  socklen_t len = sizeof value;
  EXPECT_EQ(getsockopt(fd, level, name, &value, &len), 0) << strerror(errno);
  return value;
}

// TcpOptions reach the connection's socket; values past what Linux takes
// are cut to its limits, not refused by it, which would leave the kernel's
// defaults (2 hours idle). The kernel's count of keepalive probes ends a
// connection only after the peer watch would have (1.5 timeouts and a
// second); TCP_USER_TIMEOUT stays off, as it ends connections to peers that
// merely stopped reading (peer_watch.h).
TEST(TcpTransport, KeepaliveAndPeerTimeoutReachTheSocketCutToLinuxLimits) {
  struct Case {
    uint32_t keepalive_ms, peer_timeout_ms;
    int idle_s, interval_s, probes;
  };
  for (const Case& c : {Case{1000, 2000, 1, 1, 5}, Case{1500, 7000, 1, 1, 12},
                        Case{40'000'000, 3'000'000'000u, 32767, 32767, 127}}) {
    SCOPED_TRACE(
        absl::StrCat("keepalive_ms ", c.keepalive_ms, ", peer_timeout_ms ", c.peer_timeout_ms));
    SilentPeer peer;
    NoObserver observer;  // outlives the transport, which calls it
    TransportOptions options;
    options.name = "keepalive-client";
    TcpOptions tcp;
    tcp.keepalive_ms = c.keepalive_ms;
    tcp.peer_timeout_ms = c.peer_timeout_ms;
    TcpTransport client(options, tcp);
    auto conn = ConnectTaken(client, peer, &observer);
    ASSERT_TRUE(conn.ok()) << conn.status();
    const int fd = SocketConnectedTo(peer.port());
    ASSERT_GE(fd, 0) << "no socket connected to port " << peer.port();
    EXPECT_EQ(IntOption(fd, SOL_SOCKET, SO_KEEPALIVE), 1);
    EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPIDLE), c.idle_s);
    EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPINTVL), c.interval_s);
    EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_KEEPCNT), c.probes);
    EXPECT_EQ(IntOption(fd, IPPROTO_TCP, TCP_USER_TIMEOUT), 0);
  }
}

// Connect returns a connection only once the server has taken it (its
// kHello came): a TCP connect completes in the kernel before the server
// sees it, and calls sent into a connection it then refuses or resets were
// lost. Anything else from the peer fails the connect, saying what came.
TEST(TcpTransport, ConnectReturnsOnlyOnceTheServerTookTheConnection) {
  NoObserver observer;  // outlives the transport, which calls it
  TcpTransport client(TransportOptions{});
  const auto connect_to = [&](SilentPeer& peer, absl::Duration timeout,
                              const std::function<void()>& server_side) {
    auto connecting = std::async(std::launch::async, [&] {
      return client.Connect(peer.address(), &observer, SteadyNow() + timeout);
    });
    server_side();
    return connecting.get();
  };
  {
    SilentPeer peer;
    auto conn = connect_to(peer, absl::Seconds(10), [&] {
      ASSERT_TRUE(peer.Accept(/*greet=*/false));
      peer.CloseAccepted();
    });
    ASSERT_FALSE(conn.ok()) << "a connection the server closed untaken was returned";
    EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable) << conn.status();
    EXPECT_NE(conn.status().message().find("closed the connection before it took it"),
              absl::string_view::npos)
        << conn.status();
  }
  {
    SilentPeer peer;
    auto conn = connect_to(peer, absl::Seconds(10), [&] {
      ASSERT_TRUE(peer.Accept(/*greet=*/false));
      Header go_away;
      go_away.kind = MessageKind::kGoAway;
      std::string frame(kHeaderSize, '\0');
      EncodeHeader(go_away, frame.data());
      ASSERT_TRUE(peer.Write(frame));
    });
    ASSERT_FALSE(conn.ok()) << "a connection that opened with a GOAWAY was returned";
    EXPECT_NE(conn.status().message().find("first frame is of kind 6, not an empty kHello"),
              absl::string_view::npos)
        << conn.status();
  }
  {
    SilentPeer peer;
    auto conn = connect_to(peer, absl::Milliseconds(300),
                           [&] { ASSERT_TRUE(peer.Accept(/*greet=*/false)); });
    ASSERT_FALSE(conn.ok()) << "a connection the server never took was returned";
    EXPECT_NE(conn.status().message().find("timed out waiting for the server to take"),
              absl::string_view::npos)
        << conn.status();
  }
}

// A connection the server's runtime refuses (on_accept returns null: it is
// shutting down) fails the client's Connect, and one it takes carries frames;
// the counters count each.
TEST(TcpTransport, AConnectionTheServerRefusesFailsTheConnect) {
  const tcp::TcpCounters before = tcp::Counters();
  NoObserver client_observer;
  NoObserver server_observer;
  std::atomic<bool> refuse{true};
  TransportOptions server_options;
  server_options.name = "refusing-server";
  TcpTransport server(server_options);
  auto listener = server.Listen(*ParseAddress("tcp://127.0.0.1:0"),
                                [&](std::shared_ptr<Connection>) -> ConnectionObserver* {
                                  return refuse.load() ? nullptr : &server_observer;
                                });
  ASSERT_TRUE(listener.ok()) << listener.status();
  TcpTransport client(TransportOptions{});
  auto refused =
      client.Connect((*listener)->address(), &client_observer, SteadyNow() + absl::Seconds(10));
  ASSERT_FALSE(refused.ok()) << "a connection the server refused was returned";
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("before it took it"), absl::string_view::npos)
      << refused.status();
  refuse = false;
  auto taken =
      client.Connect((*listener)->address(), &client_observer, SteadyNow() + absl::Seconds(10));
  ASSERT_TRUE(taken.ok()) << taken.status();
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  m.header.call_id = 7;
  ASSERT_TRUE((*taken)->Send(std::move(m)).ok());
  EXPECT_EQ(server_observer.FirstCallId(absl::Seconds(10)), 7u) << "the frame never arrived";
  // The refused connection counts nothing else; the taken one carried the
  // server's kHello and the request, a sendmsg each.
  const tcp::TcpCounters counted = tcp::Counters().Since(before);
  EXPECT_EQ(counted.accepts_refused, 1u);
  EXPECT_EQ(counted.connections_opened, 2u) << "the taken connection, at each end";
  EXPECT_EQ(counted.frames_sent, 2u);
  EXPECT_EQ(counted.sendmsg_calls, 2u);
  EXPECT_EQ(counted.bytes_sent, 2 * kHeaderSize);
  // The client's Connect reads the kHello itself, before its connection.
  EXPECT_EQ(counted.frames_received, 1u);
  EXPECT_EQ(counted.bytes_received, kHeaderSize);
  EXPECT_EQ(counted.frames_queued, 0u);
}

// A client's connection knows what the server's kHello said of its port:
// that TCP alone listens there (a tcp:// server, or an auto:// one that has
// no device yet), or not (one beside an RDMA listener), which is what lets
// an auto:// client try RDMA again later. A listener that comes to share
// its port with RDMA tells the connections it took, once, in order with
// their frames, and says so in the kHello of those it takes after.
TEST(TcpTransport, AConnectionKnowsWhetherTcpAloneListensAtTheServer) {
  class Told : public NoObserver {
   public:
    void OnMayGoFaster(Connection&) override { ++told; }
    std::atomic<int> told{0};
  };
  NoObserver server_observer;
  TcpTransport server(TransportOptions{});
  std::mutex mu;
  std::vector<std::shared_ptr<Connection>> taken;  // guarded by mu
  auto listener = server.Listen(*ParseAddress("tcp://127.0.0.1:0"),
                                [&](std::shared_ptr<Connection> c) -> ConnectionObserver* {
                                  std::lock_guard<std::mutex> lock(mu);
                                  taken.push_back(std::move(c));
                                  return &server_observer;
                                });
  ASSERT_TRUE(listener.ok()) << listener.status();
  Told early_observer;
  Told late_observer;
  TcpTransport client(TransportOptions{});
  const auto send_to = [&](size_t i, uint64_t call_id) {
    OutboundMessage m;
    m.header.kind = MessageKind::kRequest;
    m.header.call_id = call_id;
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_GT(taken.size(), i);
    EXPECT_TRUE(taken[i]->Send(std::move(m)).ok());
  };

  auto early =
      client.Connect((*listener)->address(), &early_observer, SteadyNow() + absl::Seconds(10));
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_TRUE((*early)->ServerTcpAlone());
  (*listener)->SharePortWithRdma();
  (*listener)->SharePortWithRdma();
  send_to(0, 9);
  EXPECT_EQ(early_observer.FirstCallId(absl::Seconds(10)), 9u) << "the frame never arrived";
  EXPECT_EQ(early_observer.told.load(), 1);
  EXPECT_FALSE((*early)->ServerTcpAlone());

  auto late =
      client.Connect((*listener)->address(), &late_observer, SteadyNow() + absl::Seconds(10));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_FALSE((*late)->ServerTcpAlone());
  send_to(1, 10);
  EXPECT_EQ(late_observer.FirstCallId(absl::Seconds(10)), 10u) << "the frame never arrived";
  EXPECT_EQ(late_observer.told.load(), 0) << "a kHello that said nothing new was reported";
}

// The kHello that tells a connection's client RDMA now listens beside TCP
// is taken even when the client has not read a full queue: refused, that
// client would have stayed on TCP for good.
TEST(TcpTransport, AClientThatReadsSlowlyStillHearsThatRdmaListens) {
  NoObserver server_observer;
  TcpOptions tcp;
  tcp.max_queued_send_bytes = 1 << 20;
  TcpTransport server(TransportOptions{}, tcp);
  std::mutex mu;
  std::shared_ptr<Connection> taken;  // guarded by mu
  auto listener = server.Listen(*ParseAddress("tcp://127.0.0.1:0"),
                                [&](std::shared_ptr<Connection> c) -> ConnectionObserver* {
                                  std::lock_guard<std::mutex> lock(mu);
                                  taken = std::move(c);
                                  return &server_observer;
                                });
  ASSERT_TRUE(listener.ok()) << listener.status();

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const int small = 64 << 10;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  sockaddr_in a = Loopback((*listener)->address().port);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << strerror(errno);
  // Reads one frame's header and skips its body; false on EOF or 20 s of
  // silence.
  const auto read_frame = [fd](Header* h) {
    std::string bytes;
    const auto read_n = [&](size_t n) {
      bytes.resize(n);
      for (size_t got = 0; got < n;) {
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, 20000) <= 0) return false;
        const ssize_t r = read(fd, bytes.data() + got, n - got);
        if (r <= 0) return false;
        got += static_cast<size_t>(r);
      }
      return true;
    };
    if (!read_n(kHeaderSize) || !DecodeHeader(bytes.data(), bytes.size(), h).ok()) return false;
    return read_n(h->metadata_len + h->payload_len);
  };
  Header first;
  ASSERT_TRUE(read_frame(&first));
  ASSERT_EQ(first.kind, MessageKind::kHello);
  ASSERT_EQ(first.call_id, kHelloTcpAlone);

  std::shared_ptr<Connection> conn;
  {
    std::lock_guard<std::mutex> lock(mu);
    conn = taken;
  }
  ASSERT_NE(conn, nullptr);
  size_t responses = 0;
  absl::Status refused;
  while (responses < 2048) {
    auto payload = conn->AllocatePayload(64 << 10);
    ASSERT_TRUE(payload.ok()) << payload.status();
    OutboundMessage m;
    m.header.kind = MessageKind::kResponse;
    m.payload = std::move(*payload);
    refused = conn->Send(std::move(m));
    if (!refused.ok()) break;
    ++responses;
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted)
      << "the queue never filled: this tests nothing; " << refused;
  // Header-only responses fill it to within a header of the bound.
  for (;;) {
    OutboundMessage m;
    m.header.kind = MessageKind::kResponse;
    if (!conn->Send(std::move(m)).ok()) break;
    ++responses;
  }
  (*listener)->SharePortWithRdma();

  for (size_t i = 0; i < responses; ++i) {
    Header h;
    ASSERT_TRUE(read_frame(&h)) << "response " << i << " of " << responses << " never came";
    ASSERT_EQ(h.kind, MessageKind::kResponse);
  }
  Header hello;
  ASSERT_TRUE(read_frame(&hello)) << "no kHello followed the queue the client had not read";
  EXPECT_EQ(hello.kind, MessageKind::kHello);
  EXPECT_EQ(hello.call_id & kHelloTcpAlone, 0u);
  close(fd);
}

// Delivered means acknowledged by the peer, not written to the socket: a
// server shutting down closes once its connections are delivered, and a
// close that turns into a reset drops what the kernel still held.
TEST(TcpTransport, DeliveredWaitsUntilThePeerHasTheBytes) {
  SilentPeer peer;
  NoObserver observer;  // outlives the transport, which calls it
  TcpTransport client(TransportOptions{});
  auto conn = ConnectTaken(client, peer, &observer);
  ASSERT_TRUE(conn.ok()) << conn.status();
  constexpr size_t kPayload = 256 << 10;
  auto payload = (*conn)->AllocatePayload(kPayload);
  ASSERT_TRUE(payload.ok()) << payload.status();
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  m.payload = std::move(*payload);
  ASSERT_TRUE((*conn)->Send(std::move(m)).ok());
  const absl::Time until = absl::Now() + absl::Milliseconds(500);
  while (absl::Now() < until) {
    ASSERT_FALSE((*conn)->Delivered()) << "delivered while the peer has read nothing";
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(peer.ReadUpTo(kHeaderSize + kPayload), kHeaderSize + kPayload);
  const absl::Time settle = absl::Now() + absl::Seconds(10);
  while (!(*conn)->Delivered() && absl::Now() < settle) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_TRUE((*conn)->Delivered()) << "not delivered once the peer read every byte";
}

// A listener destroyed while the I/O thread is busy, with a connection
// arriving behind the destruction: the batch that runs the destruction's
// task also reports the listener readable, and that event must not reach
// the listener, which its owner frees as soon as the task has run (ASan
// reported the use after free).
TEST(TcpTransport, AListenerDestroyedMidBatchGetsNoMoreEvents) {
  class Blocking : public ConnectionObserver {
   public:
    void OnMessage(Connection&, InboundMessage&&) override {
      std::unique_lock<std::mutex> lock(mu_);
      blocked_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return released_; });
    }
    void OnClosed(Connection&, const absl::Status&) override {}
    void AwaitBlocked() {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return blocked_; });
    }
    void Release() {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
      cv_.notify_all();
    }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool blocked_ = false;
    bool released_ = false;
  };
  Blocking blocking;
  NoObserver client_observer;
  TcpTransport server(TransportOptions{});
  std::atomic<int> accepted{0};
  const auto take = [&](std::shared_ptr<Connection>) -> ConnectionObserver* {
    ++accepted;
    return &blocking;
  };
  auto busy = server.Listen(*ParseAddress("tcp://127.0.0.1:0"), take);
  ASSERT_TRUE(busy.ok()) << busy.status();
  auto doomed = server.Listen(*ParseAddress("tcp://127.0.0.1:0"), take);
  ASSERT_TRUE(doomed.ok()) << doomed.status();
  const int doomed_port = (*doomed)->address().port;

  TcpTransport client(TransportOptions{});
  auto conn = client.Connect((*busy)->address(), &client_observer, SteadyNow() + absl::Seconds(10));
  ASSERT_TRUE(conn.ok()) << conn.status();
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  ASSERT_TRUE((*conn)->Send(std::move(m)).ok());
  blocking.AwaitBlocked();  // the I/O thread is in OnMessage now

  auto destroying = std::async(std::launch::async, [&] { doomed->reset(); });
  absl::SleepFor(absl::Milliseconds(50));  // its task is queued, the wake-up fd readable
  const int raw = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = Loopback(doomed_port);
  ASSERT_EQ(connect(raw, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << strerror(errno);
  blocking.Release();
  ASSERT_EQ(destroying.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  close(raw);
  EXPECT_EQ(accepted.load(), 1) << "the destroyed listener accepted a connection";
}

// The process out of file descriptors: a low limit (256 at most), filled
// with copies of a descriptor; Free, or going, gives them back.
class DescriptorsRunOut {
 public:
  // Whether the descriptors ran out (the next one fails with EMFILE).
  bool Fill(int fd) {
    if (getrlimit(RLIMIT_NOFILE, &old_limit_) != 0) return false;
    rlimit low = old_limit_;
    low.rlim_cur = limit();
    if (setrlimit(RLIMIT_NOFILE, &low) != 0) return false;
    lowered_ = true;
    for (int copy; (copy = dup(fd)) >= 0;) fillers_.push_back(copy);
    return errno == EMFILE;
  }
  // Closes `n` of the copies: that many descriptors are free.
  void Spare(size_t n) {
    for (; n > 0 && !fillers_.empty(); --n) {
      close(fillers_.back());
      fillers_.pop_back();
    }
  }
  // The limit it set.
  rlim_t limit() const { return std::min<rlim_t>(old_limit_.rlim_cur, 256); }
  void Free() {
    for (int fd : fillers_) close(fd);
    fillers_.clear();
    if (lowered_) setrlimit(RLIMIT_NOFILE, &old_limit_);
    lowered_ = false;
  }
  ~DescriptorsRunOut() { Free(); }

 private:
  rlimit old_limit_{};
  bool lowered_ = false;
  std::vector<int> fillers_;
};

// A server out of file descriptors (accept4: EMFILE) leaves the connection
// in the kernel's backlog and tries again now and then, asleep: its listening
// socket stays readable, and a listener that kept watching it would spin the
// I/O thread that serves every connection. Once a descriptor is free, the
// waiting client is taken. It says so once, not at each try.
TEST(TcpTransport, AServerOutOfDescriptorsWaitsAsleepAndTakesTheClientLater) {
  const tcp::TcpCounters before = tcp::Counters();
  NoObserver server_observer;  // outlives the transport, which calls it
  TransportOptions options;
  options.name = "starved-server";
  TcpTransport server(options);
  auto listener = server.Listen(
      *ParseAddress("tcp://127.0.0.1:0"),
      [&](std::shared_ptr<Connection>) -> ConnectionObserver* { return &server_observer; });
  ASSERT_TRUE(listener.ok()) << listener.status();
  sockaddr_in to = Loopback((*listener)->address().port);
  const int client = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(client, 0) << strerror(errno);

  // Made before, what the test needs later (the client's socket, the file
  // stderr goes to).
  ::testing::internal::CaptureStderr();
  DescriptorsRunOut run_out;
  ASSERT_TRUE(run_out.Fill(client));

  const int connected = connect(client, reinterpret_cast<sockaddr*>(&to), sizeof to);
  const int connect_errno = errno;
  absl::SleepFor(absl::Milliseconds(50));  // the server has tried and failed by now
  const absl::Duration cpu_before = ProcessCpuTime();
  absl::SleepFor(absl::Milliseconds(500));
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  pollfd early{client, POLLIN, 0};
  const int taken_early = poll(&early, 1, 0);
  run_out.Free();
  ASSERT_EQ(connected, 0) << strerror(connect_errno);
  EXPECT_EQ(taken_early, 0) << "the server took a connection it had no descriptor for";
  EXPECT_LT(cpu, absl::Milliseconds(250)) << "the server spun for " << cpu << " in 500 ms";

  // The hello that says the server took the connection.
  pollfd p{client, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10000), 1) << "the server never took the waiting client";
  char frame[kHeaderSize];
  ASSERT_EQ(recv(client, frame, sizeof frame, MSG_WAITALL), static_cast<ssize_t>(sizeof frame));
  Header hello;
  ASSERT_TRUE(DecodeHeader(frame, sizeof frame, &hello).ok());
  EXPECT_EQ(hello.kind, MessageKind::kHello);
  close(client);
  listener->reset();
  const std::string log = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = 0; (at = log.find("Too many open files", at)) != std::string::npos; ++at) {
    ++lines;
  }
  EXPECT_EQ(lines, 1u) << log.substr(0, 2000);
  EXPECT_NE(log.find("raise `ulimit -n`"), std::string::npos) << log.substr(0, 2000);
  EXPECT_NE(log.find("accepting on tcp://127.0.0.1:"), std::string::npos) << log.substr(0, 2000);
  const tcp::TcpCounters counted = tcp::Counters().Since(before);
  // The wait was ~550 ms, a pause each kAcceptPause (100 ms).
  EXPECT_GE(counted.accept_pauses, 1u);
  EXPECT_LE(counted.accept_pauses, 10u);
  EXPECT_EQ(counted.connections_opened, 1u);
}

// A client out of file descriptors (socket: EMFILE), as one that holds as
// many connections as its limit allows, fails the connect saying the limit
// and how to raise it, and connects once a descriptor is free.
TEST(TcpTransport, AClientOutOfDescriptorsSaysWhatToRaise) {
  NoObserver server_observer;
  NoObserver client_observer;
  TcpTransport server(TransportOptions{});
  auto listener = server.Listen(
      *ParseAddress("tcp://127.0.0.1:0"),
      [&](std::shared_ptr<Connection>) -> ConnectionObserver* { return &server_observer; });
  ASSERT_TRUE(listener.ok()) << listener.status();
  TcpTransport client(TransportOptions{});
  DescriptorsRunOut run_out;
  ASSERT_TRUE(run_out.Fill(STDIN_FILENO));
  auto failed =
      client.Connect((*listener)->address(), &client_observer, SteadyNow() + absl::Seconds(10));
  run_out.Free();
  ASSERT_FALSE(failed.ok()) << "connected with no descriptor free";
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  for (const std::string& part :
       {std::string("socket: Too many open files"),
        absl::StrCat("This process may open ", run_out.limit(), " files: raise `ulimit -n`.")}) {
    EXPECT_TRUE(absl::StrContains(failed.status().message(), part))
        << "\"" << part << "\" not in: " << failed.status();
  }
  auto connected =
      client.Connect((*listener)->address(), &client_observer, SteadyNow() + absl::Seconds(10));
  EXPECT_TRUE(connected.ok()) << connected.status();
}

// A transport made with no descriptor free (for its epoll set, then with
// one free for its wake-up's eventfd) has no I/O thread: each Connect and
// Listen says what it lacked and the limit, rather than waiting for ever on
// a loop that cannot be woken (before, its thread spun on a failed
// epoll_wait and Listen hung). A transport made once descriptors are free
// serves as ever.
TEST(TcpTransport, ATransportMadeOutOfDescriptorsSaysWhatItLacked) {
  NoObserver observer;
  for (const auto& [spare, lacked] :
       {std::pair<size_t, const char*>{0, "epoll_create1"}, {1, "eventfd"}}) {
    SCOPED_TRACE(lacked);
    DescriptorsRunOut run_out;
    ASSERT_TRUE(run_out.Fill(STDIN_FILENO));
    run_out.Spare(spare);
    TransportOptions options;
    options.name = "starved";
    TcpTransport starved(options);
    run_out.Free();
    const std::string said = absl::StrCat(lacked,
                                          " for the I/O thread of starved: Too many open "
                                          "files. This process may open ",
                                          run_out.limit(), " files: raise `ulimit -n`.");
    auto listener = starved.Listen(
        *ParseAddress("tcp://127.0.0.1:0"),
        [&](std::shared_ptr<Connection>) -> ConnectionObserver* { return &observer; });
    ASSERT_FALSE(listener.ok());
    EXPECT_EQ(listener.status().code(), absl::StatusCode::kUnavailable) << listener.status();
    EXPECT_TRUE(absl::StrContains(listener.status().message(), said)) << listener.status();
    auto conn = starved.Connect(*ParseAddress("tcp://127.0.0.1:9"), &observer,
                                SteadyNow() + absl::Seconds(10));
    ASSERT_FALSE(conn.ok());
    EXPECT_TRUE(absl::StrContains(conn.status().message(), said)) << conn.status();
  }
  TcpTransport server(TransportOptions{});
  auto listener =
      server.Listen(*ParseAddress("tcp://127.0.0.1:0"),
                    [&](std::shared_ptr<Connection>) -> ConnectionObserver* { return &observer; });
  ASSERT_TRUE(listener.ok()) << listener.status();
  TcpTransport client(TransportOptions{});
  auto conn = client.Connect((*listener)->address(), &observer, SteadyNow() + absl::Seconds(10));
  EXPECT_TRUE(conn.ok()) << conn.status();
}

}  // namespace
}  // namespace rdmarpc::transport
