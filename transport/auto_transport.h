// AutoTransport: the transport MakeTransport makes for auto://, unless the
// TCP fallback is off. RDMA first for auto:// addresses, and TCP where RDMA
// cannot reach the peer, so that auto:// works when either side lacks RDMA:
// a server on a machine without a device listens on TCP alone, and clients
// without one connect over TCP. rdma:// addresses pass through to RDMA
// untouched.
//
// One made where no RDMA device was usable starts without RDMA, and makes
// its RDMA transport once a device is usable. A client's auto://
// connections go over TCP straight away until then; the first connection
// or ConnectFaster that finds a device makes it (so a channel over TCP
// moves to RDMA once a device comes, as below). A server's auto://
// listener takes TCP alone until then (its kHello says so), looks for a
// device every second, and then listens over RDMA on its port too and
// tells its TCP clients, whose auto:// channels move to RDMA.
//
//   auto t = MakeTransport("auto", options, tunables);  // one of these where RDMA is usable
//   (*t)->Listen(*ParseAddress("auto://0.0.0.0:7471"), on_accept);  // RDMA and TCP, one port
//   (*t)->Connect(*ParseAddress("auto://10.0.0.2:7471"), observer, deadline);
//
// Connect: over RDMA, within half the time left; where that fails because
//   no RDMA path or listener is there (transport.h's kNotReachableThisWay:
//   rdma_cm's ADDR_ERROR, ROUTE_ERROR, UNREACHABLE, or a REJECTED that no
//   rdmarpc server sent) or no answer came in that half (a host without
//   RDMA drops its packets), over TCP to the same host and port, within
//   what is left, with one log line per target. RDMA that has not answered
//   within 200 ms is asked about over TCP meanwhile: a server whose kHello
//   says that TCP alone listens on its port (wire_format.h's
//   kHelloTcpAlone) ends the wait for RDMA then. A server that refused is
//   no reason to try TCP. rdma:// and tcp:// addresses go their own way
//   only.
// Listen: RDMA, then TCP on the port RDMA took (rdma_cm's ports and the
//   kernel's TCP ports are apart on RoCE and InfiniBand); the listener
//   reports the auto:// address, which reaches it from any client (an
//   rdma:// address only from those with an RDMA path to it).
//
//   A connection that went over TCP to a server that listens over RDMA
//   too (its kHello lacks kHelloTcpAlone) MayGoFaster: its channel tries
//   ConnectFaster, RDMA alone, now and then while the TCP connection lasts
//   (TransportTunables::tcp_fallback_upgrade), and moves its new calls to
//   the RDMA connection that makes, which ends the target's memory below.
//
//   A target reached that way is remembered for the process
//   (fallback_memory.h) for `remember` (TransportTunables::
//   tcp_fallback_memory): connections to it in that time go over TCP
//   straight away, and try RDMA only if TCP fails there.
//
// What not to rely on: a fallback waits for RDMA's answer first, which
// comes at once for a missing route or listener, and from a host without
// RDMA after 200 ms and a TCP handshake, but only after half the connect
// timeout where its server does not say TCP alone listens there (a server
// older than the kHello bit, or one whose TCP port did not answer in
// time): once per target per `remember` (after it, RDMA is tried first
// again, so that a server that gains RDMA is used), and on every connection
// when `remember` is zero. The question costs the server a TCP connection
// that closes once it has its kHello.
#ifndef RDMARPC_TRANSPORT_AUTO_TRANSPORT_H_
#define RDMARPC_TRANSPORT_AUTO_TRANSPORT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/fallback_memory.h"
#include "transport/transport.h"

namespace rdmarpc::transport {

// Marks MakeRdma's error when a device is usable but the RDMA transport
// could not be made (no thread or file descriptor for it): auto:// says so
// once, goes on over TCP, and tries again at each need, saying nothing more
// until it is made or the device goes.
inline constexpr absl::string_view kRdmaNotMade = "type.rdmarpc.dev/transport.RdmaNotMade";

class AutoTransport : public Transport {
 public:
  // Makes an RDMA transport, or says why there is none yet (UNAVAILABLE
  // while no device is usable; an error marked kRdmaNotMade while one is
  // but the transport cannot be made).
  using MakeRdma = std::function<absl::StatusOr<std::unique_ptr<Transport>>()>;
  // Makes the TCP transport, or says why it cannot (no thread or descriptor
  // for its I/O).
  using MakeTcp = std::function<absl::StatusOr<std::unique_ptr<Transport>>()>;

  // `rdma` is the RDMA transport; null: `make_rdma` makes it when it is
  // first needed, and again at each need while it fails. `make_tcp` makes
  // the TCP transport when it is first needed, and again while it fails. `who` names the owner in
  // the log line. `memory` (FallbackMemory::Process() but in tests) must outlive this.
  AutoTransport(std::unique_ptr<Transport> rdma, MakeRdma make_rdma, MakeTcp make_tcp,
                std::string who, absl::Duration remember, FallbackMemory* memory);

  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Address& addr,
                                                      ConnectionObserver* observer,
                                                      absl::Time deadline) override;
  // Given up, a connect ends whichever way it is trying, and tries no other.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectUnless(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) override;
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Address& addr,
                                                   AcceptCallback on_accept) override;
  void Shutdown() override;
  bool MayGoFaster(const Address& addr, const Connection& conn) const override;
  absl::StatusOr<std::shared_ptr<Connection>> ConnectFaster(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) override;

 private:
  // The TCP transport, made now if need be; make_tcp_'s error while it
  // cannot be made.
  absl::StatusOr<Transport*> Tcp();
  // Connect, or ConnectUnless with its `give_up` (never, when null), as the
  // helpers below take it too.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectWith(const Address& addr,
                                                          ConnectionObserver* observer,
                                                          absl::Time deadline,
                                                          const std::atomic<bool>* give_up);
  // Connect (to `addr` as tcp://) and Listen over Tcp(), or its error.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectTcp(const Address& addr,
                                                         ConnectionObserver* observer,
                                                         absl::Time deadline,
                                                         const std::atomic<bool>* give_up);
  absl::StatusOr<std::unique_ptr<Listener>> ListenTcp(const Address& addr,
                                                      AcceptCallback on_accept);
  // The RDMA transport, made now if need be; make_rdma_'s error while it
  // cannot be made.
  absl::StatusOr<Transport*> Rdma();
  // RDMA first, within half the time left; then TCP where RDMA cannot
  // reach the peer. `target` is addr.ToString(), the memory's key.
  absl::StatusOr<std::shared_ptr<Connection>> ConnectRdmaFirst(Transport& rdma, const Address& addr,
                                                               const std::string& target,
                                                               ConnectionObserver* observer,
                                                               absl::Time deadline,
                                                               const std::atomic<bool>* give_up);

  const MakeRdma make_rdma_;
  const MakeTcp make_tcp_;
  const std::string who_;
  const absl::Duration remember_;
  FallbackMemory& memory_;
  std::mutex mu_;
  // Guarded by mu_; each is kept, once made, until this is destroyed.
  std::unique_ptr<Transport> rdma_;
  std::unique_ptr<Transport> tcp_;
  bool shut_down_ = false;  // guarded by mu_: nothing more is made
  bool told_not_made_ = false;  // guarded by mu_: kRdmaNotMade was said
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_AUTO_TRANSPORT_H_
