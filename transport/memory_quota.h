// MemoryQuota: one bound on the payload memory of several transports
// together, as gRPC's ResourceQuota is: for a process that hosts a server
// and channels (or several servers, or lone channels) and wants one number
// for all of them rather than one per transport.
//
//   auto quota = rdmarpc::transport::MemoryQuota::Create("frontend", size_t{2} << 30);
//   rdmarpc::ChannelOptions copts;
//   copts.transport.memory_quota = quota;
//   rdmarpc::transport::TransportTunables stunables;
//   stunables.memory_quota = quota;
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("rdma://0.0.0.0:7471")
//                     .SetTransportTunables(stunables)
//                     ...
//
// What it counts is what each kind's own bound counts, summed over the
// transports given the quota:
// - RDMA: registered payload blocks, READ into or advertised, in use or idle
//   (the pool that RdmaOptions::max_registered_bytes bounds per device).
// - TCP: received payloads, from their first byte until released (the budget
//   that TcpOptions::max_receive_bytes bounds per transport).
// Before anything is refused for the quota, idle RDMA blocks reserved on it
// are given back (Reserve, MakeRoom: the reclaimer the RDMA transport sets),
// whichever transport asks, so that only memory in use refuses: a TCP
// message to an auto:// server is not refused for the idle buffers of its
// RDMA listener.
// Each transport's own bound still applies. Not counted: receive and send
// slots and small payload blocks (bounded by counts of their own), and what
// waits to be sent (RdmaOptions::max_backlog_bytes, TcpOptions::
// max_queued_send_bytes). What is refused for the quota ends the one call it
// belongs to RESOURCE_EXHAUSTED, naming the quota.
//
// What not to rely on: reservations are first come, first served, with no
// fairness between transports. used() counts idle RDMA blocks: they stay
// reserved until a reservation on the quota needs their room, or their
// transport is destroyed.
#ifndef RDMARPC_TRANSPORT_MEMORY_QUOTA_H_
#define RDMARPC_TRANSPORT_MEMORY_QUOTA_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::transport {

class MemoryQuota {
 public:
  // A quota of `bound` bytes; `name` says which in errors.
  static std::shared_ptr<MemoryQuota> Create(std::string name, size_t bound);
  // Aborts when bytes are still reserved: whoever reserved them holds a
  // reference until it has released them.
  ~MemoryQuota();
  MemoryQuota(const MemoryQuota&) = delete;
  MemoryQuota& operator=(const MemoryQuota&) = delete;

  // Reserves `bytes`; false, reserving nothing, when that would pass the
  // bound.
  bool TryReserve(size_t bytes);
  // TryReserve, after the reclaimer gave back idle memory reserved on the
  // quota where there was no room.
  bool Reserve(size_t bytes);
  // Whether `bytes` more fit, after the reclaimer gave back idle memory
  // reserved on the quota where they did not; reserves nothing.
  bool MakeRoom(size_t bytes);
  // Gives back bytes reserved before; aborts on more than are reserved.
  void Release(size_t bytes);

  // Whether `bytes` more fit now.
  bool Fits(size_t bytes) const { return bytes <= bound_ && used() <= bound_ - bytes; }
  // Bytes that must be released before `bytes` more fit (0 when they do).
  size_t Shortfall(size_t bytes) const;
  size_t used() const { return used_.load(std::memory_order_relaxed); }
  size_t bound() const { return bound_; }
  const std::string& name() const { return name_; }

  // RESOURCE_EXHAUSTED for `bytes` that do not fit, needed for `what` ("a
  // message from tcp://..."): names the quota, its bound and what is held.
  absl::Status Exceeded(size_t bytes, absl::string_view what) const;

  // Gives back idle memory reserved on `quota`, at least `bytes` of it
  // where there is that much; returns the bytes given back. One per
  // process: the RDMA transport sets it when it makes a pool with a quota
  // (TCP holds no idle memory). Until then nothing is given back.
  using Reclaimer = size_t (*)(size_t bytes, const MemoryQuota* quota);
  static void SetReclaimer(Reclaimer reclaimer);

 private:
  MemoryQuota(std::string name, size_t bound) : name_(std::move(name)), bound_(bound) {}

  const std::string name_;
  const size_t bound_;
  std::atomic<size_t> used_{0};
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_MEMORY_QUOTA_H_
