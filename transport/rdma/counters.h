// Counters of the RDMA transport, process-wide, readable from code:
//
//   const rdmarpc::transport::rdma::RdmaCounters c = rdmarpc::transport::rdma::Counters();
//   printf("%s\n", c.ToString().c_str());
//   uint64_t reads = c.reads;
//
// They prove where bytes went: small messages as SENDs into the SRQ
// (srq_slots_consumed), large ones as READs (reads, bytes_read). RNR events
// are counted by the device, not by us (a retried SEND completes like any
// other): ReadDeviceRnrNaks.
//
// Sharded per thread (base/sharded_counts.h), so counting costs a few plain
// instructions and shares no cache line; Counters() is a snapshot that adds
// the shards up (a lock and every shard: not a fast path).
#ifndef RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
#define RDMARPC_TRANSPORT_RDMA_COUNTERS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/sharded_counts.h"

namespace rdmarpc::transport::rdma {

// Every field is a uint64_t that counters.cc lists (and checks it lists all),
// so that shards add up field by field.
struct RdmaCounters {
  uint64_t sends = 0;         // SENDs posted
  uint64_t sends_inline = 0;  //   of which inline
  // SENDs whose payload was serialized straight into the frame (SendWith),
  // with no payload block.
  uint64_t sends_in_place = 0;
  // SENDs whose payload was copied into the frame rather than sent from where
  // it was serialized: payloads not from AllocatePayload (error texts), or
  // past the bound of registered small blocks (Endpoint::SmallBuffer).
  uint64_t send_payload_copies = 0;
  uint64_t reads = 0;       // RDMA READ work requests posted
  uint64_t bytes_read = 0;  // bytes fetched by READ
  uint64_t payloads_advertised = 0;
  //   of which first copied into registered memory (not from AllocatePayload)
  uint64_t advertised_payload_copies = 0;
  // Advertised payloads revoked by release_timeout_ms and back in the pool:
  // responses the client did not release in time, requests left unanswered
  // that long past their deadline (without windows: the connection closed).
  uint64_t releases_expired = 0;
  // Response payloads a client did not READ because it got to them too late
  // in the server's release timeout; their calls end DEADLINE_EXCEEDED.
  uint64_t late_reads_skipped = 0;
  uint64_t srq_slots_posted = 0;
  uint64_t srq_slots_consumed = 0;
  uint64_t srq_short = 0;            // times the SRQ could not be refilled
  uint64_t rnr_retry_exhausted = 0;  // RNR retries ran out (the safety net failed)
  // Sends queued for lack of credit, a send slot, (a client's requests)
  // response room or (a window to bind, on Soft-RoCE) a quiet send queue.
  uint64_t credit_stalls = 0;
  uint64_t credit_messages = 0;      // credit-only frames sent
  // Frames refused RESOURCE_EXHAUSTED because they would have passed
  // RdmaOptions::max_backlog_bytes or max_backlog_bytes_total: peers that
  // return no credits, or return them slower than calls come.
  uint64_t backlog_refusals = 0;
  // kShrink frames sent to take back credits past a peer's window, as a
  // listening transport's windows shrink with more connections.
  uint64_t credit_shrinks = 0;
  // Of which not answered within RdmaOptions::shrink_answer_timeout_ms.
  uint64_t credit_shrinks_overdue = 0;
  // Frames a peer sent with no credit of ours left: each ended its
  // connection (rdma_connection.h, "A peer that sends without credit").
  uint64_t frames_without_credit = 0;
  // kCredit and kShrink frames (free) that a peer had no cause to send:
  // credit past the largest window it granted, or a kShrink asking again
  // before our answer to its last one could reach it. Each ended its
  // connection (rdma_connection.h, "A peer that sends without credit").
  uint64_t unwarranted_control_frames = 0;
  // Zero-byte WRITEs sent to peers silent for RdmaOptions::keepalive_ms.
  uint64_t keepalives = 0;
  // Of which sent behind READs in flight, none of which had completed for
  // keepalive_ms: a peer gone mid-READ, or a READ the device left unsent
  // until its next work request (rdma_connection.h, "Stalled READs").
  uint64_t keepalives_behind_reads = 0;
  uint64_t connections_opened = 0;
  uint64_t connections_closed = 0;
  // Accepted connections whose client did not complete them within
  // RdmaOptions::accept_timeout_ms nor answer the probe sent then, ended
  // (of connections_closed).
  uint64_t accepts_unfinished = 0;
  // Currently registered. A gauge: added to on registration and taken from
  // on deregistration (Uncount), possibly on different threads; the shards
  // add up modulo 2^64, so the total is right although one shard may wrap.
  uint64_t registered_bytes = 0;
  uint64_t poller_sleeps = 0;  // adaptive/event poller went to sleep
  // Completions picked up by a blocked caller's own thread (run-to-completion,
  // Endpoint::Drive) instead of the poller thread.
  uint64_t caller_completions = 0;
  // Device events that were logged or ended connections: ports down or up,
  // GID changes, queue pairs, CQs, SRQs or devices failed (device_events.h).
  uint64_t device_events = 0;

  using Field = uint64_t RdmaCounters::*;

  std::string ToString() const;
  // Every counter under its field's name ("sends", ...), in declaration
  // order: for exporting (rpc/stats.h), where ToString is for people.
  std::vector<std::pair<std::string, uint64_t>> Named() const;
};

// The sum over all threads' shards, now.
RdmaCounters Counters();

// Adds n to one counter in the calling thread's shard, e.g.
// Count(&RdmaCounters::sends).
inline void Count(RdmaCounters::Field field, uint64_t n = 1) {
  base::ShardedCounts<RdmaCounters>::Add(field, n);
}
// Takes n from a gauge (registered_bytes).
inline void Uncount(RdmaCounters::Field field, uint64_t n) { Count(field, uint64_t{0} - n); }

// RNR NAKs as counted by the RDMA devices this process uses: device-wide
// (every process on the device counts) since the device came up. Received:
// SENDs of ours that found the peer's receive queue empty and were retried.
// Sent: peers' SENDs that found our SRQ empty. Credits keep both still in
// normal operation; but the SRQ is shared, so many connections bursting at
// once can empty it, and then the retry is the safety net. -1: the device
// exposes no such counter (rxe has both; mlx5 only `out_of_buffer`, which
// counts the sent side).
struct DeviceRnrNaks {
  int64_t received = -1;
  int64_t sent = -1;
};
DeviceRnrNaks ReadDeviceRnrNaks();
// Endpoints record their device so ReadDeviceRnrNaks knows where to look.
void NoteDeviceInUse(const std::string& device);
// The devices recorded so, by name, sorted.
std::vector<std::string> DevicesInUse();

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
