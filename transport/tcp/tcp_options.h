// TcpOptions: every tunable of the TCP transport, in one place.
//
// Set from code (TcpTransport's constructor, or the runtime's
// ChannelOptions::transport.tcp and ServerBuilder::SetTransportTunables) and,
// for experiments, overridden from the environment (TcpOptionsFromEnv, which
// MakeTransport applies to every TCP transport it makes).
//
//   TcpOptions tcp;
//   tcp.peer_timeout_ms = 10000;   // a slow link: wait longer for ACKs
//   TcpTransport t(TransportOptions{}, tcp);
#ifndef RDMARPC_TRANSPORT_TCP_TCP_OPTIONS_H_
#define RDMARPC_TRANSPORT_TCP_TCP_OPTIONS_H_

#include <cstddef>
#include <cstdint>

namespace rdmarpc::transport {

struct TcpOptions {
  // Dead peers (RDMA has its own, RdmaOptions::keepalive_ms and
  // peer_timeout_ms, same defaults). A peer whose machine or link dies sends
  // no FIN or RST, and the kernel's defaults notice only after hours. So a
  // connection idle for keepalive_ms sends keepalive probes (SO_KEEPALIVE,
  // TCP_KEEPIDLE; whole seconds, 1 to 32767, longer is cut to that), and
  // one whose data or probes stay unacknowledged for peer_timeout_ms ends
  // UNAVAILABLE, with every call on it (PeerWatch, peer_watch.h; window
  // probes get 2 s at least). A peer that only stops reading answers the
  // probes of its closed window and is waited for. 0: the kernel's (no
  // keepalive; ~15 minutes of retransmissions).
  uint32_t keepalive_ms = 1000;
  uint32_t peer_timeout_ms = 2000;
  // Bytes one connection may hold queued for a peer that does not read
  // (beyond what its socket buffer took): the memory a stalled peer can pin.
  // A Send that would queue more fails RESOURCE_EXHAUSTED naming the bound;
  // a frame sent when nothing is queued is always taken, and so is a
  // control frame (a cancel, a GOAWAY, a kHello: a header each); errors
  // have kQueuedErrorHeadroom beyond it (transport/transport.h).
  size_t max_queued_send_bytes = 256u << 20;
  // The same over all of a transport's connections: the memory that many
  // peers which stop reading can pin together. A Send past it, on a
  // connection that has something queued already, fails RESOURCE_EXHAUSTED
  // naming it, with the same exceptions.
  size_t max_queued_send_bytes_total = size_t{1} << 30;
  // Payload bytes one transport may hold received, across its connections:
  // counted as they arrive and until the runtime, or whoever kept the
  // payload, releases it (receive_budget.h). A frame that would pass it is
  // read and thrown away, and its call ends RESOURCE_EXHAUSTED naming the
  // bound; the connection goes on. TCP's counterpart of
  // RdmaOptions::max_registered_bytes, with the same default; a bound below
  // max_message_size refuses the messages between. One bound for several
  // transports together: TransportTunables::memory_quota.
  size_t max_receive_bytes = size_t{1} << 30;
};

// `options` with what the environment sets: RDMARPC_TCP_KEEPALIVE_MS,
// RDMARPC_TCP_PEER_TIMEOUT_MS (milliseconds, 0: the kernel's),
// RDMARPC_TCP_MAX_QUEUED_SEND_BYTES, RDMARPC_TCP_MAX_QUEUED_SEND_BYTES_TOTAL
// and RDMARPC_TCP_MAX_RECEIVE_BYTES. A value that is not a whole number in
// range is reported on stderr and leaves the option as it was.
TcpOptions TcpOptionsFromEnv(TcpOptions options);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_TCP_TCP_OPTIONS_H_
