// MakeTransport: the transport for an address scheme ("tcp", "rdma", "auto"),
// tuned by TransportTunables.
//
//   TransportTunables tunables;
//   tunables.rdma.poll_mode = rdma::PollMode::kBusy;
//   tunables.tcp_fallback = false;   // auto:// without RDMA is an error
//   auto t = MakeTransport("auto", TransportOptions{}, tunables);
//
// "auto" picks RDMA when a usable RDMA device exists and TCP otherwise, with
// one log line saying which and why, unless tcp_fallback is off; TCP then
// turns to RDMA once a device is usable, a client's and a server's
// (auto_transport.h). With RDMA
// it still reaches peers without it: an auto:// server listens on TCP too,
// at the same port, and an auto:// client connects over TCP where RDMA
// cannot reach the peer (auto_transport.h), unless tcp_fallback is off.
//
// The environment overrides the tunables (for experiments on a built
// program): RdmaOptionsFromEnv and TcpOptionsFromEnv list the variables,
// and RDMARPC_NO_TCP_FALLBACK=1 turns tcp_fallback off.
#ifndef RDMARPC_TRANSPORT_FACTORY_H_
#define RDMARPC_TRANSPORT_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/rdma/rdma_options.h"
#include "transport/tcp/tcp_options.h"
#include "transport/transport.h"

namespace rdmarpc::transport {

// Every kind's tunables together, so that a channel or a server sets them
// without knowing which kind its address will pick (auto://). Only those of
// the kind made are used.
struct TransportTunables {
  TcpOptions tcp;
  rdma::RdmaOptions rdma;
  // auto:// with no usable RDMA device: fall back to TCP (one log line).
  // false makes that an error naming the devices found, and keeps auto://
  // with a device to RDMA alone (no TCP listener, no TCP connection to a
  // peer RDMA cannot reach).
  bool tcp_fallback = true;
  // An auto:// target that RDMA could not reach and TCP could: for this
  // long after, new connections to it go over TCP straight away, in this
  // whole process, rather than wait for RDMA again (half the connect
  // timeout from a host without RDMA). Then RDMA is tried first again, so
  // that a peer that gains RDMA is used. Zero: RDMA first every time.
  absl::Duration tcp_fallback_memory = absl::Seconds(60);
  // A channel whose auto:// connection went over TCP to a server that
  // listens over RDMA too tries RDMA again this long after it connected
  // (where the server comes to listen over RDMA later, between half and
  // all of this after it says so), then twice as long after each failed
  // try, up to 12 times this. Once
  // RDMA connects, new calls go there, and the TCP connection closes as its
  // last call ends (rpc/channel.h). Zero: never; the TCP connection is kept
  // while it lasts.
  absl::Duration tcp_fallback_upgrade = absl::Seconds(10);
  // One bound on payload memory shared by every transport given the same
  // quota (transport/memory_quota.h): a server's and its process's
  // channels', say. Null: each transport has only its own bounds.
  std::shared_ptr<MemoryQuota> memory_quota;
};

// The transport for `scheme`, its tunables overridden by the environment.
// INVALID_ARGUMENT, naming the option, when the RDMA options of an rdma://
// (or auto:// resolved to RDMA) transport cannot work (CheckRdmaOptions);
// RESOURCE_EXHAUSTED when the transport's thread cannot be started, and
// UNAVAILABLE when the descriptors it needs cannot be had (EMFILE).
absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(
    const std::string& scheme, const TransportOptions& options,
    const TransportTunables& tunables = TransportTunables());

// What "auto" resolves to where no RDMA device is usable: TCP until a
// device is usable, then RDMA first for a client, and RDMA beside TCP for a
// server (auto_transport.h).
inline constexpr char kTcpUntilRdma[] = "tcp-until-rdma";

// The kind of transport MakeTransport(scheme) makes on this machine: "tcp",
// "rdma" or kTcpUntilRdma, each of which resolves to itself. For "auto"
// that is "rdma" where a device is usable, else kTcpUntilRdma with the log
// line (naming `who`), or UNAVAILABLE naming the devices found when the
// fallback is off. Transports of one kind serve each other's addresses, so
// a ChannelGroup keys its transports by this.
absl::StatusOr<std::string> ResolveScheme(const std::string& scheme, const std::string& who,
                                          const TransportTunables& tunables = TransportTunables());

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_FACTORY_H_
