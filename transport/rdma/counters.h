// Counters of the RDMA transport, process-wide, readable from code:
//
//   const auto& c = rdmarpc::transport::rdma::Counters();
//   printf("%s\n", c.ToString().c_str());
//   uint64_t reads = c.reads.load();
//
// They prove where bytes went: small messages as SENDs into the SRQ
// (srq_slots_consumed), large ones as READs (reads, bytes_read). RNR events
// are counted by the device, not by us (a retried SEND completes like any
// other): ReadDeviceRnrNaks.
#ifndef RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
#define RDMARPC_TRANSPORT_RDMA_COUNTERS_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace rdmarpc::transport::rdma {

struct RdmaCounters {
  std::atomic<uint64_t> sends{0};              // SENDs posted
  std::atomic<uint64_t> sends_inline{0};       //   of which inline
  // SENDs whose payload was copied into the frame rather than sent from where
  // it was serialized: payloads not from AllocatePayload (error texts), or
  // past the bound of registered small blocks (Endpoint::SmallBuffer).
  std::atomic<uint64_t> send_payload_copies{0};
  std::atomic<uint64_t> reads{0};              // RDMA READ work requests posted
  std::atomic<uint64_t> bytes_read{0};         // bytes fetched by READ
  std::atomic<uint64_t> payloads_advertised{0};
  //   of which first copied into registered memory (not from AllocatePayload)
  std::atomic<uint64_t> advertised_payload_copies{0};
  // Advertised payloads revoked by release_timeout_ms and back in the pool:
  // responses the client did not release in time, requests left unanswered
  // that long past their deadline (without windows: the connection closed).
  std::atomic<uint64_t> releases_expired{0};
  // Response payloads a client did not READ because it got to them too late
  // in the server's release timeout; their calls end DEADLINE_EXCEEDED.
  std::atomic<uint64_t> late_reads_skipped{0};
  std::atomic<uint64_t> srq_slots_posted{0};
  std::atomic<uint64_t> srq_slots_consumed{0};
  std::atomic<uint64_t> srq_short{0};          // times the SRQ could not be refilled
  std::atomic<uint64_t> rnr_retry_exhausted{0};  // RNR retries ran out (the safety net failed)
  std::atomic<uint64_t> credit_stalls{0};      // sends queued for lack of credit or slot
  std::atomic<uint64_t> credit_messages{0};    // credit-only frames sent
  // Zero-byte WRITEs sent to peers silent for RdmaOptions::keepalive_ms.
  std::atomic<uint64_t> keepalives{0};
  std::atomic<uint64_t> connections_opened{0};
  std::atomic<uint64_t> connections_closed{0};
  std::atomic<uint64_t> registered_bytes{0};   // currently registered
  std::atomic<uint64_t> poller_sleeps{0};      // adaptive/event poller went to sleep
  // Completions picked up by a blocked caller's own thread (run-to-completion,
  // Endpoint::Drive) instead of the poller thread.
  std::atomic<uint64_t> caller_completions{0};

  std::string ToString() const;
};

const RdmaCounters& Counters();
RdmaCounters& MutableCounters();

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

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
