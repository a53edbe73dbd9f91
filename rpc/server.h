// Server and ServerBuilder: host services on one or more addresses.
//
//   EchoServiceImpl service;                       // derives from generated code
//   int port = 0;
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("tcp://0.0.0.0:0", &port)
//                     .RegisterService(&service)
//                     .SetWorkerThreads(4)
//                     .BuildAndStart();
//   if (!server.ok()) { ... (*server) ... }
//   (*server)->Wait();   // until Shutdown() from another thread
//
// Thread model: each transport has its own I/O thread(s), which parse frames
// and hand each request to the worker pool (SetWorkerThreads; default: the
// number of cores). Handlers run on workers; an asynchronous handler may
// finish from any thread. SetWorkerThreads(0) runs handlers inline on the I/O
// thread instead: the lowest latency (no thread hop), for handlers that never
// block, since a blocked handler stalls every connection of that transport,
// and over TCP Shutdown too, which closes its listener on that thread before
// it sends a GOAWAY. A request whose deadline passed while it waited in the
// queue is answered DEADLINE_EXCEEDED without running its handler.
//
// Shutdown(grace): stops accepting connections, tells each client to send
// no new call on its connection (a GOAWAY: its channel connects anew, to a
// successor or failing) and serves the calls the client sent before it
// learned that: those that arrive before the client's acknowledgment. It
// answers requests that come after it with UNAVAILABLE. It waits up to
// `grace` for in-flight calls to finish; then marks the rest cancelled
// (ServerContext::IsCancelled) and answers them CANCELLED; then closes every
// connection and joins the workers. Handlers must return once cancelled: a
// handler that never returns blocks Shutdown.
//
// EnableHealthService() hosts the standard health service (rpc/health.h):
// Server::health() sets what it answers, and Shutdown starts by marking
// everything NOT_SERVING. EnableStatsService() hosts the stats service
// (rpc/stats.h): the process's transport counters and this server's calls.
// EnableReflectionService() hosts the reflection service (rpc/reflection.h):
// the services hosted and their .proto descriptions.
//
// SetMaxConcurrentCalls(n) sheds load: with n calls in flight (queued for
// a worker, running, or finishing asynchronously), the next is answered
// RESOURCE_EXHAUSTED at once, its handler not run, so that a client may try
// another server or later instead of queueing behind an overloaded one.
// Health checks, stats and reflection neither count nor are refused: a busy
// server still answers them.
// SetMaxConcurrentCallsPerConnection(n) does the same per connection, so
// that one client flooding the server is refused before it takes every
// slot of the global limit from the others.
//
// Bad input never takes the server down: an unparsable frame closes only that
// connection; an unknown method gets UNIMPLEMENTED, a request that does not
// parse INVALID_ARGUMENT, an oversize one RESOURCE_EXHAUSTED. An answer the
// transport cannot take (response metadata larger than an RDMA receive
// slot, a client that stopped reading or returning credits) is replaced by
// the error, or an error by itself without its metadata; a call that cannot
// be answered even so (the client is that far behind) closes its
// connection, so that the client's calls end UNAVAILABLE instead of waiting.
#ifndef RDMARPC_RPC_SERVER_H_
#define RDMARPC_RPC_SERVER_H_

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/health.h"
#include "rpc/interceptor.h"
#include "rpc/internal/thread_pool.h"
#include "rpc/internal/timer_queue.h"
#include "rpc/reflection.h"
#include "rpc/service.h"
#include "rpc/stats.h"
#include "rpc/status.h"
#include "transport/factory.h"
#include "transport/memory_quota.h"
#include "transport/transport.h"

namespace rdmarpc {

class ServerCallImpl;

class Server : private transport::ConnectionObserver {
 public:
  ~Server() override;

  void Shutdown(absl::Duration grace = absl::Seconds(5));
  // Blocks until Shutdown() has finished.
  void Wait();

  // Bound addresses, in the order added (ports resolved).
  const std::vector<std::string>& addresses() const { return addresses_; }

  // Requests received per method ("/pkg.Service/Method" -> count), including
  // those answered with an error.
  std::map<std::string, uint64_t> MethodCallCounts() const;

  // The calls in flight that SetMaxConcurrentCalls counts (all but health
  // checks), and the requests it refused.
  struct Stats {
    uint64_t calls_in_flight = 0;
    uint64_t refused_over_limit = 0;             // SetMaxConcurrentCalls
    uint64_t refused_over_connection_limit = 0;  // SetMaxConcurrentCallsPerConnection
  };
  Stats stats() const;

  // The health service, when the builder enabled it; null otherwise.
  HealthService* health() const { return health_.get(); }

  // The memory quota its transports share with others
  // (TransportTunables::memory_quota); null when it has none.
  const std::shared_ptr<transport::MemoryQuota>& memory_quota() const { return memory_quota_; }

 private:
  friend class ServerBuilder;
  friend class ServerCallImpl;
  using CallKey = std::pair<transport::Connection*, uint64_t>;

  Server(int workers, size_t max_message_size, size_t max_calls, size_t max_calls_per_conn);
  void OnMessage(transport::Connection& conn, transport::InboundMessage&& msg) override;
  // Refuses an over-limit request, or one after the client acknowledged a
  // GOAWAY, before its payload is READ.
  absl::Status AdmitRemotePayload(transport::Connection& conn,
                                  const transport::Header& header) override;
  void OnClosed(transport::Connection& conn, const absl::Status& why) override;
  void HandleRequest(transport::Connection& conn, transport::InboundMessage&& msg);
  // Inline handlers (SetWorkerThreads(0)): runs the call on this I/O thread
  // and tracks it only if its handler returns before finishing it.
  // `admitted_by_header`: see ConnEntry::reading.
  void RunInline(transport::Connection& conn, std::shared_ptr<ServerCallImpl> call,
                 bool admitted_by_header);
  // The client acknowledged the GOAWAY of Shutdown on `conn`.
  void OnGoAwayAck(transport::Connection& conn);
  struct ConnEntry;
  // Whether a request on `entry` that arrives now is refused as the server
  // shuts down. Needs mu_.
  bool RefusedByShutdownLocked(const ConnEntry& entry, bool admitted_by_header) const;
  // Drops `call_id` from `conn`'s ConnEntry::reading.
  void ForgetReading(transport::Connection& conn, uint64_t call_id);
  void DropReusedCallId(transport::Connection& conn, uint64_t call_id);
  struct MethodEntry;
  // The refusal of a request for `method` (counted) when `in_flight` calls
  // in all and `on_conn` on its connection are in flight (the limits of
  // SetMaxConcurrentCalls and SetMaxConcurrentCallsPerConnection), or OK.
  Status Admit(const MethodEntry& method, size_t in_flight, size_t on_conn);
  // The calls on `conn` that count against max_calls_per_conn_, read
  // without mu_ when none is in flight anywhere.
  size_t LimitedCallsOn(transport::Connection& conn);
  // Sends the response: the error's text when `status` is not OK, else
  // `attachment` then `message` (ByteSizeLong() gave `message_size`), if any.
  // When the transport cannot take that payload, the client gets its error.
  void Reply(transport::Connection& conn, uint64_t call_id, const Status& status,
             const Metadata& md = {}, const google::protobuf::MessageLite* message = nullptr,
             Attachment attachment = Attachment(), size_t message_size = 0);
  // Reply's path for an error (its text, metadata and status payloads) or an
  // answer with no message; out of line, as it is off the path of most calls.
  void SendWithoutMessage(transport::Connection& conn, uint64_t call_id, const Status& status,
                          transport::OutboundMessage&& out);
  void CallFinished(const CallKey& key);

  const size_t max_message_size_;
  const size_t max_calls_;           // 0: no limit
  const size_t max_calls_per_conn_;  // 0: no limit
  const bool inline_handlers_;
  std::vector<std::shared_ptr<ServerInterceptor>> interceptors_;  // set before the server starts
  std::shared_ptr<transport::MemoryQuota> memory_quota_;          // set before the server starts
  // Before methods_, which point into them.
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<StatsService> stats_;
  std::unique_ptr<ReflectionService> reflection_;
  struct MethodEntry {
    const Service::Method* method;
    std::unique_ptr<std::atomic<uint64_t>> calls;
    bool limited;  // by max_calls_: all but the health, stats and reflection services'
  };
  std::unordered_map<uint32_t, MethodEntry> methods_;
  std::map<std::string, std::unique_ptr<transport::Transport>> transports_;  // by scheme
  std::vector<std::unique_ptr<transport::Listener>> listeners_;
  std::vector<std::string> addresses_;
  // Made by BuildAndStart before any listener, so that no call finds them
  // missing.
  std::unique_ptr<internal::ThreadPool> workers_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> shutting_down_{false};  // written under mu_; read without it by RunInline
  // Shutdown is past waiting for the clients' acknowledgments and the calls:
  // every request is refused. Guarded by mu_.
  bool closing_ = false;
  bool shut_down_ = false;      // guarded by mu_
  struct ConnEntry {
    std::shared_ptr<transport::Connection> conn;
    size_t limited_in_flight = 0;  // its calls of limited_in_flight_
    // After Shutdown's GOAWAY: the client has sent the acknowledgment, after
    // which it sends no new call on this connection.
    bool go_away_acked = false;
    // A call came on it that took the lock (with worker threads, every call;
    // inline, those during Shutdown or gone asynchronous): the peer is a
    // client of ours, which acknowledges the GOAWAY (kGoAwayAckWait).
    bool sent_calls = false;
    // Requests admitted by their header (AdmitRemotePayload) whose payload
    // is being READ. Their delivery may come after a kGoAway that followed
    // them, so they were admitted in the order the client sent them and are
    // served even after the acknowledgment.
    absl::flat_hash_set<uint64_t> reading;
  };
  absl::flat_hash_map<transport::Connection*, ConnEntry> conns_;                 // mu_
  absl::flat_hash_map<CallKey, std::shared_ptr<ServerCallImpl>> inflight_;       // mu_
  std::atomic<size_t> tracked_{0};  // inflight_.size(), written under mu_
  // Those of inflight_ that count against max_calls_, written under mu_.
  std::atomic<size_t> limited_in_flight_{0};
  std::atomic<uint64_t> refused_over_limit_{0};
  std::atomic<uint64_t> refused_over_connection_limit_{0};
  // The timer thread that cancels calls at their deadlines for
  // ServerContext::OnCancel. Made by BuildAndStart with the workers; last, so
  // that it is destroyed (its thread joined) while what its callbacks reach
  // still exists.
  std::unique_ptr<internal::TimerQueue> timers_;
};

class ServerBuilder {
 public:
  // "tcp://host:port", "rdma://host:port" or "auto://host:port"; port 0 picks
  // a free port, written to *selected_port by BuildAndStart. A host name
  // means each of its addresses, on that one port.
  ServerBuilder& AddListeningPort(std::string address, int* selected_port = nullptr);
  // The service must outlive the server.
  ServerBuilder& RegisterService(Service* service);
  // 0: run handlers inline on the I/O thread (see the thread model above).
  ServerBuilder& SetWorkerThreads(int n);
  ServerBuilder& SetMaxMessageSize(size_t bytes);
  // At most n calls in flight, beyond which requests are refused
  // RESOURCE_EXHAUSTED (see above); 0, the default, sets no limit. With
  // SetWorkerThreads(0) a handler running inline holds the I/O thread
  // anyway: the calls counted are those that return before finishing.
  ServerBuilder& SetMaxConcurrentCalls(int n);
  // At most n calls in flight on any one connection, counted and refused as
  // above; 0, the default, sets no limit.
  ServerBuilder& SetMaxConcurrentCallsPerConnection(int n);
  // The tunables of the transports the server listens with
  // (transport/factory.h), e.g. rdma.poll_mode, rdma.server_receive_slots,
  // tcp.peer_timeout_ms. RDMARPC_* environment variables override them.
  ServerBuilder& SetTransportTunables(transport::TransportTunables tunables);
  // Hosts the standard health service (rpc/health.h) beside the registered
  // ones, with "" and each of them SERVING.
  ServerBuilder& EnableHealthService();
  // Hosts the stats service (rpc/stats.h) beside the registered ones.
  ServerBuilder& EnableStatsService();
  // Hosts the reflection service (rpc/reflection.h) beside the registered
  // ones, describing them, the other built-in ones and itself.
  ServerBuilder& EnableReflectionService();
  // Runs `interceptor` around every call (rpc/interceptor.h), after those
  // added before it as calls come in and before them as they are answered.
  ServerBuilder& AddInterceptor(std::shared_ptr<ServerInterceptor> interceptor);
  // Fails (naming the cause) on an unusable address, a method registered
  // twice, two methods whose ids collide, or a process that may start no
  // more threads (RESOURCE_EXHAUSTED, naming its limit).
  StatusOr<std::unique_ptr<Server>> BuildAndStart();

 private:
  std::vector<std::pair<std::string, int*>> ports_;
  std::vector<Service*> services_;
  int workers_ = -1;  // the number of cores
  size_t max_message_size_ = 64u << 20;
  int max_calls_ = 0;
  int max_calls_per_conn_ = 0;
  transport::TransportTunables tunables_;
  bool health_ = false;
  bool stats_ = false;
  bool reflection_ = false;
  std::vector<std::shared_ptr<ServerInterceptor>> interceptors_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_SERVER_H_
