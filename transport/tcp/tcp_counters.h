// Counters of the TCP transport, process-wide, readable from code, as the
// RDMA transport's are (transport/rdma/counters.h):
//
//   const rdmarpc::transport::tcp::TcpCounters c = rdmarpc::transport::tcp::Counters();
//   printf("%s\n", c.ToString().c_str());
//   uint64_t refused = c.receive_refusals;
//
// They show what a channel that fell back to TCP (auto://) carried, whether
// frames wait behind full sockets (frames_queued) and how many frames one
// sendmsg(2) takes (frames_sent / sendmsg_calls), and they count what the
// transport's bounds refused and the connections it ended, which otherwise
// only the calls concerned hear of.
//
// Sharded per thread (base/sharded_counts.h), so counting costs a few plain
// instructions and shares no cache line; Counters() is a snapshot that adds
// the shards up (a lock and every shard: not a fast path).
#ifndef RDMARPC_TRANSPORT_TCP_TCP_COUNTERS_H_
#define RDMARPC_TRANSPORT_TCP_TCP_COUNTERS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/sharded_counts.h"

namespace rdmarpc::transport::tcp {

// Every field is a uint64_t that tcp_counters.cc lists (and checks it lists
// all), so that shards add up field by field.
struct TcpCounters {
  // Frames written whole to a socket, and the bytes written (headers,
  // metadata and payloads).
  uint64_t frames_sent = 0;
  uint64_t bytes_sent = 0;
  // sendmsg(2) calls that wrote something: a queue of frames goes out in
  // one, and a large frame may take several.
  uint64_t sendmsg_calls = 0;
  // Frames that did not go out whole in the Send that took them: behind a
  // socket buffer the peer had not drained, or behind frames already queued.
  uint64_t frames_queued = 0;
  // Frames refused RESOURCE_EXHAUSTED by TcpOptions::max_queued_send_bytes
  // or max_queued_send_bytes_total: peers that do not read.
  uint64_t send_refusals = 0;
  // Frames read whole (each kHello included), and every byte read.
  uint64_t frames_received = 0;
  uint64_t bytes_received = 0;
  // Payloads read and thrown away, their calls ended RESOURCE_EXHAUSTED:
  // past TcpOptions::max_receive_bytes (part way through, too), past
  // max_message_size, or with no memory to take them.
  uint64_t receive_refusals = 0;
  // Connections ended for a frame that broke the wire format.
  uint64_t malformed_frames = 0;
  // Connections ended because the peer stopped acknowledging: by PeerWatch
  // (TcpOptions::peer_timeout_ms) or by the kernel's own timeout.
  uint64_t peer_timeouts = 0;
  // Connections taken into the transport (dialed, or accepted and adopted by
  // the runtime), and connections ended. Both count once per connection.
  uint64_t connections_opened = 0;
  uint64_t connections_closed = 0;
  // Accepted connections the runtime refused (its server was shutting
  // down), closed unopened.
  uint64_t accepts_refused = 0;
  // Times a listener out of file descriptors or kernel memory stopped
  // accepting for a while.
  uint64_t accept_pauses = 0;

  using Field = uint64_t TcpCounters::*;

  std::string ToString() const;
  // Every counter under its field's name ("frames_sent", ...), in
  // declaration order: for exporting (rpc/stats.h), where ToString is for
  // people.
  std::vector<std::pair<std::string, uint64_t>> Named() const;
  // What was counted from the snapshot `earlier` to this one (all of these
  // counters only grow), e.g. Counters().Since(before).frames_sent.
  TcpCounters Since(const TcpCounters& earlier) const;
};

// The sum over all threads' shards, now.
TcpCounters Counters();

// Adds n to one counter in the calling thread's shard, e.g.
// Count(&TcpCounters::frames_sent).
inline void Count(TcpCounters::Field field, uint64_t n = 1) {
  base::ShardedCounts<TcpCounters>::Add(field, n);
}

}  // namespace rdmarpc::transport::tcp

#endif  // RDMARPC_TRANSPORT_TCP_TCP_COUNTERS_H_
