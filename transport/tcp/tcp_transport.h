// TcpTransport: the transport interface over TCP sockets, driven by epoll.
//
// The fallback for peers without RDMA, and the transport the runtime's tests
// run on first. One I/O thread per TcpTransport runs epoll over all its
// connections and listeners; observer callbacks run on that thread. Frames are
// the wire format's (transport/wire_format.h), written with sendmsg straight
// from the caller's buffers.
//
//   TcpTransport t(TransportOptions{}, TcpOptions{});
//   auto listener = t.Listen(*ParseAddress("tcp://127.0.0.1:0"), on_accept);
//
// A connection is the server's once it says so: it sends kHello first, and
// Connect returns only after reading it (transport/wire_format.h). That
// kHello says kHelloTcpAlone unless the listener shares its port with RDMA
// (Listener::SharePortWithRdma); a listener that comes to share it sends
// the connections it took a second kHello without the bit.
//
// A frame whose header does not parse closes that connection (the stream has
// lost its framing); every other connection is untouched. A payload larger
// than max_message_size is read and thrown away, then reported to the observer
// as RESOURCE_EXHAUSTED, so the connection stays usable; so is one that
// would take the payloads the transport holds past TcpOptions::
// max_receive_bytes (receive_budget.h).
//
// A transport made where the process is out of descriptors or threads has
// no I/O thread, and answers every Connect and Listen with what it lacked.
#ifndef RDMARPC_TRANSPORT_TCP_TCP_TRANSPORT_H_
#define RDMARPC_TRANSPORT_TCP_TCP_TRANSPORT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport/tcp/tcp_options.h"
#include "transport/transport.h"

namespace rdmarpc::transport {

class ReceiveBudget;
class TcpConnection;
class TcpListener;

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(TransportOptions options, TcpOptions tcp = {});
  ~TcpTransport() override;

  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Address& addr,
                                                      ConnectionObserver* observer,
                                                      absl::Time deadline) override;
  // Given up, a connect ends within 10 ms, wherever it waits: for the SYN's
  // answer, or for the server's kHello.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectUnless(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) override;
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Address& addr,
                                                   AcceptCallback on_accept) override;
  void Shutdown() override;

  // Not OK when the transport has no I/O thread (a descriptor or the thread
  // could not be had): what every Connect and Listen answers, and what
  // MakeTransport answers instead of making it.
  const absl::Status& unusable() const { return unusable_; }
  // Payload bytes received and held now, across the connections: what
  // TcpOptions::max_receive_bytes bounds.
  size_t received_bytes_held() const;
  // Bytes queued for peers, across the connections, beyond what their
  // sockets took: what TcpOptions::max_queued_send_bytes_total bounds.
  size_t queued_send_bytes() const { return queued_send_bytes_.load(std::memory_order_relaxed); }

 private:
  friend class TcpConnection;
  friend class TcpListener;

  // What epoll reports to, by pointer in epoll_event.data.
  struct IoHandler {
    virtual ~IoHandler() = default;
    virtual void OnEvents(uint32_t events) = 0;
  };

  // A listener out of descriptors, no longer watched until `resume`.
  struct PausedAccept {
    IoHandler* listener;
    int fd;
    absl::Time resume;
  };

  // Connect, or ConnectUnless with its `give_up` (never, when null).
  absl::StatusOr<std::shared_ptr<Connection>> ConnectWith(const Address& addr,
                                                          ConnectionObserver* observer,
                                                          absl::Time deadline,
                                                          const std::atomic<bool>* give_up);
  void Loop();
  // epoll_wait's timeout: until the first paused listener or the peer
  // watch is due, else none.
  int EpollTimeoutMs() const;  // I/O thread
  // Every connection's TcpConnection::WatchPeer, once a PeerWatch::Period.
  void WatchPeersIfDue();                          // I/O thread
  void PauseAccepts(IoHandler* listener, int fd);  // I/O thread
  void ResumeAccepts();                            // I/O thread: those due
  // A listener on the one address `at`, for Listen's name `asked`.
  absl::StatusOr<std::unique_ptr<Listener>> ListenSocket(const SocketAddress& at,
                                                         const Address& asked,
                                                         AcceptCallback on_accept);
  // Runs fn on the I/O thread and waits for it (runs inline on that thread).
  void RunInLoopAndWait(std::function<void()> fn);
  void Adopt(std::shared_ptr<TcpConnection> conn);  // I/O thread
  void Forget(int fd);                              // I/O thread

  const TransportOptions options_;
  const TcpOptions tcp_;
  // TcpOptions::max_receive_bytes over every connection (and the memory
  // quota, where options_ has one); Drop()ped by the destructor, and freed
  // once the last payload it counts is released.
  ReceiveBudget* const receive_budget_;
  // Bytes queued on all connections (TcpOptions::max_queued_send_bytes_total),
  // as each last counted them (TcpConnection::CountQueuedLocked).
  std::atomic<size_t> queued_send_bytes_{0};
  absl::Status unusable_;  // OK when it has its I/O thread
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  // Readable once Shutdown has begun: ends the Connects waiting for a handshake.
  int stop_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> loop_thread_id_{};
  std::atomic<bool> stopped_{false};
  std::mutex tasks_mu_;
  std::vector<std::function<void()>> tasks_;                          // guarded by tasks_mu_
  bool loop_ended_ = false;                                           // guarded by tasks_mu_
  bool loop_exit_ = false;                                            // I/O thread
  std::unordered_map<int, std::shared_ptr<TcpConnection>> conns_;     // I/O thread
  std::unordered_map<int, TcpListener*> listeners_;                   // I/O thread
  std::atomic<uint64_t> next_listener_id_{0};
  std::vector<std::shared_ptr<TcpConnection>> graveyard_;            // I/O thread
  std::vector<IoHandler*> retired_;  // I/O thread: listeners gone during this batch
  std::vector<PausedAccept> paused_accepts_;  // I/O thread
  absl::Time next_watch_ = absl::InfinitePast();  // I/O thread
};

// Whether the rdmarpc server at `addr` says that nothing but TCP takes
// connections on its port (kHelloTcpAlone, transport/wire_format.h):
// connects, reads its kHello and closes, by `deadline`, or sooner once
// `stop_fd` (an eventfd) is readable or `*give_up` (unless null) is true
// (CANCELLED). False where the kHello does not say so: a server beside an
// RDMA listener, or one older than the bit. What an auto:// client asks
// while RDMA keeps it waiting.
absl::StatusOr<bool> TcpListensAlone(const Address& addr, int stop_fd,
                                     const std::atomic<bool>* give_up, absl::Time deadline);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_TCP_TCP_TRANSPORT_H_
