// Endpoint: what one RdmaTransport shares across all its connections on one
// device: the protection domain, one completion queue, one Shared Receive
// Queue with its receive slots, the registered payload pool, and the poller
// thread that drives them.
//
// Why one SRQ: receive memory must not grow with the number of connections.
// The SRQ keeps `target` slots posted; a slot consumed by a SEND is handed to
// the runtime as the message's payload (no copy) and a spare slot is posted in
// its place at once. When the runtime releases the message, the slot becomes a
// spare again. Slots are fixed-size pieces of a few registered regions that
// grow (by 64 slots) up to target + max_held_slots.
//
// The poller thread is the one I/O thread of the endpoint: it polls the CQ,
// runs posted tasks, refills the SRQ, and calls connections (and through them
// the runtime's observers). Its sleep policy is RdmaOptions::poll_mode.
//
// Lifetime: buffers handed to the runtime (receive slots, payload blocks)
// hold a reference to their Endpoint, so its registered memory outlives every
// message the runtime still holds. Stop() ends the poller; the last reference
// frees the verbs resources.
//
// Work-request ids: RECV wr_id is the slot index; every other wr_id is
// (connection serial << 32 | per-connection index), looked up in a map, so a
// completion that arrives for a connection already gone is simply dropped.
#ifndef RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_
#define RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_

#include <infiniband/verbs.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/buffer.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/registered_pool.h"

namespace rdmarpc::transport::rdma {

class RdmaConnection;

class Endpoint : public std::enable_shared_from_this<Endpoint> {
 public:
  static absl::StatusOr<std::shared_ptr<Endpoint>> Create(ibv_context* verbs,
                                                          const RdmaOptions& options,
                                                          size_t receive_slots,
                                                          const std::string& owner);
  ~Endpoint();
  // Stops the poller thread (joins it); connections must be gone. Idempotent;
  // never from the poller thread itself.
  void Stop();

  ibv_context* verbs() const { return verbs_; }
  ibv_pd* pd() const { return pd_; }
  ibv_cq* cq() const { return cq_; }
  ibv_srq* srq() const { return srq_; }
  RegisteredPool& pool() { return *pool_; }
  const RdmaOptions& options() const { return options_; }
  const std::string& device_name() const { return device_name_; }
  const ibv_device_attr& device_attr() const { return device_attr_; }
  size_t slot_size() const { return options_.slot_size; }
  // Bytes registered for receive slots: flat in the number of connections.
  size_t receive_bytes() const;

  void RunOnPoller(std::function<void()> task);
  void RunOnPollerAndWait(std::function<void()> task);
  bool OnPollerThread() const { return std::this_thread::get_id() == poller_id_.load(); }

  // Poller thread only.
  void AddConnection(std::shared_ptr<RdmaConnection> conn);
  void RemoveConnection(RdmaConnection* conn);
  // A torn-down connection waiting for its queue pair to drain; the poller
  // retries it every loop until RdmaConnection::FinishTeardown says done.
  void AddDraining(RdmaConnection* conn) { draining_.push_back(conn); }
  void ReleaseSlot(uint32_t slot);

  // A receive slot's bytes as a Buffer: releasing it makes the slot a spare.
  Buffer SlotBuffer(uint32_t slot, size_t offset, size_t length);
  // `size` bytes of a pool block as a Buffer: releasing it returns the block.
  Buffer BlockBuffer(RegisteredPool::Block* block, size_t size);

 private:
  Endpoint(ibv_context* verbs, const RdmaOptions& options, size_t target, std::string owner);
  absl::Status Init();
  absl::Status GrowSlots();  // poller thread or Init
  void PollLoop();
  void HandleCompletion(const ibv_wc& wc);
  void RefillSrq();
  void Wake();

  ibv_context* const verbs_;
  const RdmaOptions options_;
  const size_t target_;  // slots kept posted
  const std::string owner_;
  std::string device_name_;
  ibv_device_attr device_attr_{};
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_srq* srq_ = nullptr;
  std::unique_ptr<RegisteredPool> pool_;
  int wake_fd_ = -1;

  // Receive slots.
  struct Region {
    char* base;
    ibv_mr* mr;
  };
  static constexpr uint32_t kSlotsPerRegion = 64;
  std::vector<Region> regions_;   // poller thread after Init
  std::atomic<uint32_t> slot_count_{0};
  size_t posted_ = 0;             // poller thread
  std::mutex spare_mu_;
  std::vector<uint32_t> spare_;   // guarded by spare_mu_
  std::atomic<bool> short_{false};

  std::thread poller_;
  std::atomic<std::thread::id> poller_id_{};
  std::atomic<bool> stop_{false};
  std::mutex tasks_mu_;
  std::vector<std::function<void()>> tasks_;  // guarded by tasks_mu_
  std::unordered_map<uint32_t, std::shared_ptr<RdmaConnection>> by_qp_;   // poller thread
  std::unordered_map<uint32_t, RdmaConnection*> by_serial_;               // poller thread
  std::vector<RdmaConnection*> draining_;                                 // poller thread
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_ENDPOINT_H_
