// Support for the RDMA transport's tests (//transport/rdma:rdma_transport_test,
// one binary whose files each cover one concern, and rdma_two_devices_test,
// which changes the VM's devices): a server and a client transport on the
// test address, observers that echo and that wait for responses, payloads
// whose bytes say whether they arrived whole, and where a GID or peer is.
//
//   Fixture fx;
//   Waiter& waiter = fx.NewWaiter();
//   std::shared_ptr<Connection> conn = fx.StartAndConnect(waiter);
//   auto r = Call(*conn, waiter, 1, Filled(*conn, 100000, 1));
//   EXPECT_TRUE(r.ok() && Matches(r->payload, 100000, 1));
//
// Everything here runs on real verbs: under tools/vm/run.sh, in the
// Soft-RoCE VM when the machine has no device.
#ifndef RDMARPC_TRANSPORT_RDMA_TRANSPORT_TESTS_FIXTURE_H_
#define RDMARPC_TRANSPORT_RDMA_TRANSPORT_TESTS_FIXTURE_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/address.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/transport.h"

namespace rdmarpc::transport::rdma::transport_test {

// A payload of `size` bytes from conn's registered memory, filled with a
// pattern (byte i is Pattern(i, seed)); Matches checks that b holds exactly
// that.
uint8_t Pattern(size_t i, uint64_t seed);
Buffer Filled(Connection& conn, size_t size, uint64_t seed);
bool Matches(const Buffer& b, size_t size, uint64_t seed);

// Server side: answers every request with its own payload, byte for byte.
class EchoObserver : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kRequest) return;
    OutboundMessage r;
    r.header.kind = MessageKind::kResponse;
    r.header.call_id = msg.header.call_id;
    if (!msg.payload_status.ok()) {
      r.header.status = static_cast<uint16_t>(msg.payload_status.code());
    } else if (auto b = conn.AllocatePayload(msg.payload.size()); !b.ok()) {
      // Answered, not dropped: the client's test then shows why.
      fprintf(stderr, "echo: %s\n", b.status().ToString().c_str());
      r.header.status = static_cast<uint16_t>(b.status().code());
    } else {
      // An empty Buffer's data() is null, which memcpy may not be given.
      if (!msg.payload.empty()) memcpy(b->data(), msg.payload.data(), msg.payload.size());
      r.payload = std::move(*b);
    }
    requests.fetch_add(1);
    conn.Send(std::move(r)).IgnoreError();
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu);
    closed.push_back(why);
  }
  std::atomic<int> requests{0};
  std::mutex mu;
  std::vector<absl::Status> closed;
};

// Client side: waits for responses by call id.
class Waiter : public ConnectionObserver {
 public:
  std::future<InboundMessage> Expect(uint64_t call_id) {
    std::lock_guard<std::mutex> lock(mu_);
    return waiting_[call_id].get_future();
  }
  void OnMessage(Connection&, InboundMessage&& msg) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = waiting_.find(msg.header.call_id);
    if (it == waiting_.end()) return;
    it->second.set_value(std::move(msg));
    waiting_.erase(it);
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_status = why;
    // Before the waiters wake: a test that saw its call fail may check it.
    closed = true;
    for (auto& [id, p] : waiting_) {
      InboundMessage m;
      m.header.call_id = id;
      m.payload_status = why;
      p.set_value(std::move(m));
    }
    waiting_.clear();
  }
  // True once OnClosed is done with this observer, which the test may then
  // destroy: `closed` turns true while OnClosed is still running.
  bool FinishedClosing() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed.load();
  }
  std::atomic<bool> closed{false};
  absl::Status closed_status;

 private:
  std::mutex mu_;
  std::map<uint64_t, std::promise<InboundMessage>> waiting_;
};

// A client observer: calls (ids below kFirst) as Waiter, and frames from
// kFirst on counted, the first of them holding the I/O thread until Open().
struct HeldReceiver : Waiter {
  static constexpr uint64_t kFirst = 100;
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.call_id < kFirst) return Waiter::OnMessage(conn, std::move(msg));
    std::unique_lock<std::mutex> lock(mu);
    ++received;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
  // Opens `held` when it goes: a failed assertion must not leave a client's
  // I/O thread held, or its transport's shutdown would wait for it. Declared
  // after the Fixture, so that it goes first.
  struct OpenAtExit {
    HeldReceiver& held;
    ~OpenAtExit() { held.Open(); }
  };
  std::mutex mu;
  std::condition_variable cv;
  int received = 0;   // guarded by mu
  bool open = false;  // guarded by mu
};

// Server and client transports on the test address. The observers they call
// until they shut down live here, declared before the transports so they are
// destroyed after them: a test's own Waiter declared after the Fixture would
// be gone while the client transport still calls it.
struct Fixture {
  std::string ip;
  EchoObserver echo;
  std::deque<Waiter> waiters;                   // a deque: NewWaiter never moves the others
  ConnectionObserver* server_observer = &echo;  // a test may put its own
  std::string listen_host;                      // default: the test address
  std::mutex accepted_mu;
  std::vector<std::weak_ptr<Connection>> accepted;  // in the order accepted; expired ones pruned
  std::unique_ptr<RdmaTransport> server;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<RdmaTransport> client;
  Address addr;

  bool Start(RdmaOptions server_opts = RdmaOptions(), RdmaOptions client_opts = RdmaOptions());
  Waiter& NewWaiter() { return waiters.emplace_back(); }
  // The server's side of the connection accepted last, while the server keeps it.
  std::shared_ptr<Connection> LastAccepted() {
    std::lock_guard<std::mutex> lock(accepted_mu);
    return accepted.empty() ? nullptr : accepted.back().lock();
  }
  // The server's sides of the connections it accepted and keeps.
  std::vector<std::shared_ptr<Connection>> Accepted() {
    std::lock_guard<std::mutex> lock(accepted_mu);
    std::vector<std::shared_ptr<Connection>> kept;
    for (const auto& a : accepted) {
      if (auto c = a.lock()) kept.push_back(std::move(c));
    }
    return kept;
  }
  absl::StatusOr<std::shared_ptr<Connection>> Connect(ConnectionObserver* observer) {
    return client->Connect(addr, observer, SteadyNow() + absl::Seconds(30));
  }
  // Start() and one connection for `waiter`; null, with the test failed and
  // the reason said, when either fails.
  std::shared_ptr<Connection> StartAndConnect(Waiter& waiter,
                                              RdmaOptions server_opts = RdmaOptions(),
                                              RdmaOptions client_opts = RdmaOptions());
};

OutboundMessage Request(uint64_t id, Buffer payload, std::string metadata = {});

// Sends request `id` and waits (up to 120 s) for its response; the
// connection's or the server's failure as a status.
absl::StatusOr<InboundMessage> Call(Connection& conn, Waiter& w, uint64_t id, Buffer payload);

// Both ends of one connection, after a call on it was answered (so the
// server has accepted it); the server's end is null if something failed.
struct BothEnds {
  std::shared_ptr<Connection> client, server;
};
BothEnds ConnectAndCall(Fixture& fx);

// What `read` returns for c's rdma_cm id, read on c's poller, the thread
// that tears c down and clears the id (so read in any other thread, it
// races with a teardown); `gone` once c is torn down.
template <typename T>
T OnPoller(Connection& c, T gone, std::function<T(rdma_cm_id*)> read) {
  auto& conn = static_cast<RdmaConnection&>(c);
  T value = gone;
  conn.endpoint()->RunOnPollerAndWait([&] {
    if (conn.id() != nullptr) value = read(conn.id());
  });
  return value;
}

// The device, port and GID table entry that carry `ip` (IPv4 or IPv6) on
// RoCE; an index of -1 when no device has it.
struct GidPlace {
  std::string device;
  uint32_t port = 0;
  int index = -1;
};
GidPlace FindGidOf(const std::string& ip);

// The address c's peer has, as rdma_cm saw it; "gone" once c is torn down.
std::string PeerHost(Connection& c);

// Waits (up to 20 s) until every connection opened since the counters read
// `opened` and `closed` has closed again, at both ends; false if one stays.
bool EveryConnectionClosedSince(uint64_t opened, uint64_t closed);

// The server still serves: a new connection's call of `size` bytes comes
// back whole.
void ExpectServesANewClient(Fixture& fx, size_t size = 100);

}  // namespace rdmarpc::transport::rdma::transport_test

#endif  // RDMARPC_TRANSPORT_RDMA_TRANSPORT_TESTS_FIXTURE_H_
