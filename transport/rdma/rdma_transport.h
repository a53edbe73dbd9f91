// RdmaTransport: the transport interface over RDMA verbs.
//
//   RdmaTransport t(TransportOptions{}, RdmaOptionsFromEnv(), /*server=*/true);
//   auto listener = t.Listen(*ParseAddress("rdma://10.0.0.1:7471"), on_accept);
//
// Connections are RC queue pairs set up by librdmacm (rdma_cm): the device,
// port and GID follow from the address (rdma_cm resolves the route; on RoCE it
// picks the v2 GID of the interface's IP), or RdmaOptions names them
// (device_selection.h). The first connection on a device logs one line naming
// device, port, GID index and type, and active MTU. Frames travel as described in
// rdma_connection.h; all connections of the transport on one device share one
// SRQ, one CQ and one poller thread (endpoint.h).
//
// Threads: one rdma_cm event thread per transport, one poller per device.
// Observer callbacks run on the poller.
//
// A Connect that ends at its deadline, or given up (ConnectUnless), at any
// step returns at once and frees its queue pair and rdma_cm id within
// milliseconds; destroying the id cancels a connect request that is out,
// and a peer that had answered it is sent a reject.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_H_

#include <rdma/rdma_cma.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport/rdma/device_selection.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/transport.h"

namespace rdmarpc::transport::rdma {

class RdmaTransport : public Transport {
 public:
  RdmaTransport(TransportOptions options, RdmaOptions rdma, bool server);
  ~RdmaTransport() override;

  absl::StatusOr<std::shared_ptr<Connection>> Connect(const Address& addr,
                                                      ConnectionObserver* observer,
                                                      absl::Time deadline) override;
  absl::StatusOr<std::shared_ptr<Connection>> ConnectUnless(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) override;
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const Address& addr,
                                                   AcceptCallback on_accept) override;
  void Shutdown() override;

  // Not OK when the transport has no rdma_cm thread for want of what a
  // process runs out of and gets back (a thread, or a descriptor: EMFILE):
  // every Connect and Listen would fail so, and MakeTransport answers with
  // it instead of making a transport that never works.
  absl::Status Unusable() const;

  // Receive memory registered by this transport (all devices): stays flat as
  // connections come and go.
  size_t receive_bytes() const;
  // Its completion queues (all devices): how many, their entries, and the
  // room reserved on them for receives and connections' send queues.
  Endpoint::CompletionQueueUse completion_queue_use() const;

 private:
  class RdmaListener;
  struct Attempt;
  // What an rdma_cm_id stands for; exactly one member is set.
  struct CmTarget {
    std::shared_ptr<Attempt> attempt;   // a Connect() in progress
    RdmaListener* listener;             // a listening id
    std::weak_ptr<RdmaConnection> conn;  // an established connection
  };

  void CmLoop();
  // Tasks for the CM thread, which owns cm_targets_ and the rdma_cm ids. Once
  // it has exited (Shutdown), a task runs on the thread that gives it, one
  // at a time (RunAfterCm): a task queued then would never run.
  void RunOnCm(std::function<void()> task);
  void RunOnCmAndWait(std::function<void()> task);
  // Queues `task` (moving it) unless the CM thread has exited.
  bool QueueOnCm(std::function<void()>& task);
  void RunAfterCm(const std::function<void()>& task);
  // Handles and acks one event.
  void HandleEvent(rdma_cm_event* ev);
  // Tries to listen again where listeners whose device was removed listened,
  // those whose time has come; how many ms until the next try is due (at
  // most 1000). CM thread.
  int RelistenDue();
  // Stops and drops the endpoints whose device is being removed and that
  // no connection uses any more, once per kRemovedDeviceCheck: their
  // resources, and with them librdmacm's reference on the device, go once
  // the runtime has released what it holds of them. CM thread.
  void LetGoOfRemovedDevices();
  // A new id bound to `at` (its port set where it was 0) and listening. CM
  // thread.
  absl::StatusOr<rdma_cm_id*> BindAndListen(sockaddr_storage* at);
  // Destroys the ids given up while handling events or running tasks; CM
  // thread, with no event unacked (rdma_destroy_id waits for its acks).
  void DestroyRetiredIds();
  void OnConnectRequest(rdma_cm_event* ev, RdmaListener* listener);
  // One address of Connect's: `src` is the named GID's address, if any.
  // Ends early (CANCELLED) once `give_up` (the caller's) or `lost` (another
  // address won, address_race.h) is true.
  absl::StatusOr<std::shared_ptr<RdmaConnection>> ConnectTo(
      sockaddr_storage dst, std::optional<sockaddr_storage> src, ConnectionObserver* observer,
      absl::Time deadline, const std::atomic<bool>& give_up, const std::atomic<bool>& lost);
  // A listener on the one address `at`, for Listen's name `asked`.
  absl::StatusOr<std::unique_ptr<Listener>> ListenAt(const SocketAddress& at, const Address& asked,
                                                     AcceptCallback on_accept);
  void AbandonAttempt(Attempt* at);
  absl::StatusOr<Endpoint*> EndpointFor(rdma_cm_id* id);
  // Logs the device, port and GID of the endpoint's first connection, and
  // how soon a peer that stops answering is noticed.
  void DescribeOnce(const Endpoint* ep, rdma_cm_id* id, RdmaConnection& conn);
  // Asks for the QP ACK timeout that RdmaOptions::peer_timeout_ms implies,
  // before the QP is connected.
  void SetAckTimeout(rdma_cm_id* id);
  // Sets RdmaOptions::rnr_wait_us as the RNR NAK timer of the connected QP.
  void SetRnrWait(rdma_cm_id* id);
  void Track(const std::shared_ptr<RdmaConnection>& conn);
  std::string PeerOf(rdma_cm_id* id) const;
  // The window a new connection on `ep` gets: RdmaOptions::credits, at most
  // half the receive slots, and with strict_credits at most what the slots
  // not spoken for hold (0: none; the connection is refused).
  uint32_t LocalCredits(const Endpoint& ep) const;
  Handshake LocalHandshake(const Endpoint& ep, uint32_t credits) const;

  const TransportOptions options_;
  const RdmaOptions rdma_;
  const bool server_;
  rdma_event_channel* channel_ = nullptr;
  // What failed, with its errno, when the transport has no channel; or
  // no_cm_thread_, when it could have none for want of a thread.
  std::pair<const char*, int> channel_failure_{"", 0};
  absl::Status no_cm_thread_;
  int wake_fd_ = -1;
  std::thread cm_thread_;
  // The CM thread's id while it runs; none once it has exited, when a new
  // thread may be given the same id.
  std::atomic<std::thread::id> cm_thread_id_{};
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> next_serial_{1};

  std::mutex tasks_mu_;
  std::vector<std::function<void()>> tasks_;              // tasks_mu_
  bool cm_exited_ = false;                                // tasks_mu_; no task is taken any more
  std::mutex late_tasks_mu_;                              // RunAfterCm
  std::unordered_map<rdma_cm_id*, CmTarget> cm_targets_;  // CM thread
  std::vector<rdma_cm_id*> retired_ids_;                  // CM thread
  bool cm_events_stopped_ = false;                        // CM thread; set by Shutdown
  std::set<RdmaListener*> orphaned_listeners_;            // CM thread; their device is gone
  std::chrono::steady_clock::time_point next_device_check_;  // CM thread
  std::set<const Endpoint*> described_;                    // CM thread
  bool ack_timeout_warned_ = false;                        // CM thread
  bool rnr_wait_warned_ = false;                           // CM thread

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool shut_down_ = false;                                                  // mu_
  std::map<ibv_context*, std::shared_ptr<Endpoint>> endpoints_;             // mu_
  std::unordered_map<RdmaConnection*, std::shared_ptr<RdmaConnection>> conns_;  // mu_
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_H_
