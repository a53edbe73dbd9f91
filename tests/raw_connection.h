// RawConnection: one TCP connection that speaks rdmarpc frames by hand, for
// tests that play a hostile or broken peer (tests/tcp_bad_input_test.cc plays
// clients, tests/tcp_bad_server_test.cc plays servers: RawServer).
//
//   RawClient bad(port);                       // connects to 127.0.0.1:port
//   bad.SendFrame(header, "", payload, /*claimed_payload_len=*/5000);
//   auto frame = bad.ReadFrame();              // nullopt after 10 s or EOF
//   EXPECT_TRUE(bad.ClosedByPeer());
#ifndef RDMARPC_TESTS_RAW_CONNECTION_H_
#define RDMARPC_TESTS_RAW_CONNECTION_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "gtest/gtest.h"
#include "transport/wire_format.h"

namespace rdmarpc::testing {

// Headers of the frames a raw peer sends most.
inline transport::Header Request(uint64_t call_id, uint32_t method_id) {
  transport::Header h;
  h.kind = transport::MessageKind::kRequest;
  h.call_id = call_id;
  h.method_id = method_id;
  return h;
}
inline transport::Header Response(uint64_t call_id, uint16_t status = 0) {
  transport::Header h;
  h.kind = transport::MessageKind::kResponse;
  h.call_id = call_id;
  h.status = status;
  return h;
}

class RawConnection {
 public:
  explicit RawConnection(int fd) : fd_(fd) {}
  ~RawConnection() { close(fd_); }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  void SendBytes(const std::string& bytes) {
    // The peer may already have hung up on us: no SIGPIPE for the test, and
    // a test that cares asks ClosedByPeer.
    const ssize_t n = send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n >= 0) {
      ASSERT_EQ(n, static_cast<ssize_t>(bytes.size()));
    }
  }
  // False when the peer has closed the connection (EPIPE, ECONNRESET).
  bool SendBytesUnlessClosed(const std::string& bytes) {
    return send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // The header's lengths are the real ones unless `claimed_payload_len` lies.
  void SendFrame(transport::Header h, const std::string& metadata, const std::string& payload,
                 std::optional<uint32_t> claimed_payload_len = std::nullopt) {
    h.metadata_len = metadata.size();
    h.payload_len = claimed_payload_len.value_or(payload.size());
    std::string frame(transport::kHeaderSize, '\0');
    transport::EncodeHeader(h, frame.data());
    SendBytes(frame + metadata + payload);
  }

  struct Frame {
    transport::Header header;
    std::string metadata;
    std::string payload;
  };
  // What a server sends first on each TCP connection: it took it.
  void SendHello() {
    transport::Header h;
    h.kind = transport::MessageKind::kHello;
    SendFrame(h, "", "");
  }
  // The next whole frame, or nullopt on EOF or a 10 s silence.
  std::optional<Frame> ReadFrame() {
    char hb[transport::kHeaderSize];
    if (!ReadExactly(hb, sizeof hb)) return std::nullopt;
    auto h = transport::DecodeHeader(hb, sizeof hb);
    EXPECT_TRUE(h.ok()) << h.status();
    if (!h.ok()) return std::nullopt;
    Frame f{*h, std::string(h->metadata_len, '\0'), std::string(h->payload_len, '\0')};
    if (!ReadExactly(f.metadata.data(), f.metadata.size()) ||
        !ReadExactly(f.payload.data(), f.payload.size())) {
      return std::nullopt;
    }
    return f;
  }
  // True when there is something to read (or EOF) within `timeout_ms`.
  bool Readable(int timeout_ms) {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, timeout_ms) > 0;
  }
  // Reads until the peer closes this connection (EOF or a reset): the bytes
  // read, or nullopt after a silence of `silence_ms`.
  std::optional<size_t> ReadUntilClosed(int silence_ms = 10000) {
    size_t got = 0;
    char buf[1 << 16];
    for (;;) {
      if (!Readable(silence_ms)) return std::nullopt;
      const ssize_t r = read(fd_, buf, sizeof buf);
      if (r <= 0) return got;
      got += static_cast<size_t>(r);
    }
  }
  // True when the peer has closed its end (a FIN or a reset came) within
  // `timeout_ms`, whatever it sent before is still unread: what a test
  // asks when reading would change what the peer does.
  bool HungUpUnread(int timeout_ms) {
    pollfd p{fd_, POLLRDHUP, 0};
    return poll(&p, 1, timeout_ms) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }
  // True when the peer closed this connection (EOF within `timeout_ms`).
  bool ClosedByPeer(int timeout_ms = 10000) {
    char c;
    return Readable(timeout_ms) && read(fd_, &c, 1) == 0;
  }

 protected:
  int fd() const { return fd_; }

 private:
  bool ReadExactly(char* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 10000) <= 0) return false;
      const ssize_t r = read(fd_, out + got, n - got);
      if (r <= 0) return false;
      got += r;
    }
    return true;
  }

  int fd_;
};

// A connection to a server on 127.0.0.1:port, once the server took it (its
// kHello came).
class RawClient : public RawConnection {
 public:
  explicit RawClient(int port) : RawConnection(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << strerror(errno);
    const auto hello = ReadFrame();
    EXPECT_TRUE(hello && hello->header.kind == transport::MessageKind::kHello)
        << "the server did not open with a kHello";
  }
};

// A server socket on 127.0.0.1, on a port of the kernel's choosing, that
// hands out RawConnections to the clients under test.
class RawServer {
 public:
  // Not `listening`: its port refuses connections until Listen().
  explicit RawServer(bool listening = true) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << strerror(errno);
    if (listening) Listen();
    socklen_t len = sizeof a;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    address_ = "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~RawServer() { close(fd_); }
  const std::string& address() const { return address_; }
  void Listen() { EXPECT_EQ(listen(fd_, 4), 0) << strerror(errno); }

  // The next connection, taken (its kHello sent unless not `hello`), or
  // null when none comes within `timeout_ms`.
  std::unique_ptr<RawConnection> Accept(int timeout_ms = 10000, bool hello = true) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) return nullptr;
    const int c = accept(fd_, nullptr, nullptr);
    if (c < 0) return nullptr;
    auto conn = std::make_unique<RawConnection>(c);
    if (hello) conn->SendHello();
    return conn;
  }

 private:
  int fd_ = -1;
  std::string address_;
};

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_RAW_CONNECTION_H_
