// Counters of the RDMA transport, process-wide, readable from code:
//
//   const auto& c = rdmarpc::transport::rdma::Counters();
//   printf("%s\n", c.ToString().c_str());
//   uint64_t reads = c.reads.load();
//
// They prove where bytes went: small messages as SENDs into the SRQ
// (srq_slots_consumed), large ones as READs (reads, bytes_read).
#ifndef RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
#define RDMARPC_TRANSPORT_RDMA_COUNTERS_H_

#include <atomic>
#include <cstdint>
#include <string>

namespace rdmarpc::transport::rdma {

struct RdmaCounters {
  std::atomic<uint64_t> sends{0};              // SENDs posted
  std::atomic<uint64_t> sends_inline{0};       //   of which inline
  std::atomic<uint64_t> reads{0};              // RDMA READ work requests posted
  std::atomic<uint64_t> bytes_read{0};         // bytes fetched by READ
  std::atomic<uint64_t> payloads_advertised{0};
  std::atomic<uint64_t> srq_slots_posted{0};
  std::atomic<uint64_t> srq_slots_consumed{0};
  std::atomic<uint64_t> srq_short{0};          // times the SRQ could not be refilled
  std::atomic<uint64_t> rnr_events{0};         // RNR retry exhausted (safety net failed)
  std::atomic<uint64_t> credit_stalls{0};      // sends queued for lack of credit or slot
  std::atomic<uint64_t> credit_messages{0};    // credit-only frames sent
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

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_COUNTERS_H_
