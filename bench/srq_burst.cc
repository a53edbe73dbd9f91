// srq_burst: what an empty shared receive queue costs a burst of small
// frames. `--connections` connections each send `--frames` small requests at
// once to one server, which echoes each; a round ends when every response is
// in. The server shares its SRQ's slots among its connections (512 slots
// and windows of at most 32 by default; rdma_connection.h, "Flow control"),
// so a burst waits in the clients' backlogs for credit; only past as many
// connections as the slots hold frames (372 at the defaults; fewer with a
// small --receive_slots) can it find the SRQ empty before the server's
// poller has refilled it: then the sender's device is told to wait (RNR
// NAK) for the receiver's RNR timer, and retries.
//
//   bazel build -c opt //bench:srq_burst && tools/vm/run.sh bazel-bin/bench/srq_burst
//
// Two setups take turns, round by round, in one process: RdmaOptions'
// default rnr_wait_us, and the longest wait IBA's table has (491.52 ms),
// the nearest an option comes to the 655 ms that rdma_cm would leave
// (RdmaOptions::rnr_wait_us). Each setup has its own server, and a client
// transport per connection, all with that wait; --receive_slots sizes the
// server's SRQ.
// Output lines (machine-readable):
//   srq_burst_frames <connections x frames>
//   srq_burst_{default,long}_wait_round_p50_ms <value>
//   srq_burst_{default,long}_wait_round_max_ms <value>
//   srq_burst_{default,long}_wait_rnr_naks_per_round <value>   (device count)
//   srq_burst_long_over_default_p50 <value>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/steady_clock.h"
#include "transport/address.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/rdma_transport.h"

ABSL_FLAG(std::string, address, "", "the RDMA interface's address; default $RDMARPC_TEST_ADDR");
ABSL_FLAG(int, connections, 32, "connections that send at once");
ABSL_FLAG(int, frames, 32, "requests each connection sends at once (at most its credits)");
ABSL_FLAG(int, rounds, 5, "rounds per setup");
ABSL_FLAG(int, bytes, 64, "payload bytes of a request and of its response");
ABSL_FLAG(int, receive_slots,
          static_cast<int>(rdmarpc::transport::rdma::RdmaOptions().server_receive_slots),
          "the server's SRQ slots (RdmaOptions::server_receive_slots)");

namespace {

using rdmarpc::transport::Address;
using rdmarpc::transport::Connection;
using rdmarpc::transport::ConnectionObserver;
using rdmarpc::transport::InboundMessage;
using rdmarpc::transport::Listener;
using rdmarpc::transport::MessageKind;
using rdmarpc::transport::OutboundMessage;
using rdmarpc::transport::TransportOptions;
using rdmarpc::transport::rdma::RdmaOptions;
using rdmarpc::transport::rdma::RdmaTransport;

class Echo : public ConnectionObserver {
 public:
  void OnMessage(Connection& conn, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kRequest) return;
    OutboundMessage r;
    r.header.kind = MessageKind::kResponse;
    r.header.call_id = msg.header.call_id;
    if (auto b = conn.AllocatePayload(msg.payload.size()); b.ok()) {
      if (!msg.payload.empty()) memcpy(b->data(), msg.payload.data(), msg.payload.size());
      r.payload = std::move(*b);
    }
    conn.Send(std::move(r)).IgnoreError();
  }
  void OnClosed(Connection&, const absl::Status&) override {}
};

// Counts responses, and every connection's end, for the round in progress.
class Responses : public ConnectionObserver {
 public:
  void OnMessage(Connection&, InboundMessage&& msg) override {
    if (msg.header.kind != MessageKind::kResponse) return;
    std::lock_guard<std::mutex> lock(mu_);
    ++arrived_;
    cv_.notify_all();
  }
  void OnClosed(Connection&, const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = why.ok() ? absl::UnavailableError("closed") : why;
    cv_.notify_all();
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    arrived_ = 0;
  }
  // OK once `n` responses are in; the reason a connection ended, or
  // DEADLINE_EXCEEDED.
  absl::Status Wait(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(120),
                      [&] { return arrived_ >= n || !closed_.ok(); })) {
      return absl::DeadlineExceededError(absl::StrCat(arrived_, " of ", n, " responses in 120 s"));
    }
    return closed_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  absl::Status closed_;
};

struct Setup {
  const char* name;
  uint32_t rnr_wait_us;
  Echo echo;
  Responses responses;
  std::unique_ptr<RdmaTransport> server;
  std::unique_ptr<Listener> listener;
  // One client transport per connection, as separate client processes
  // would have, so that only the server's SRQ is shared.
  std::vector<std::unique_ptr<RdmaTransport>> clients;
  std::vector<std::shared_ptr<Connection>> conns;
  std::vector<double> round_ms;
  std::vector<int64_t> naks;
};

absl::Status Start(Setup& s, const std::string& ip, int connections) {
  RdmaOptions o;
  o.rnr_wait_us = s.rnr_wait_us;
  o.server_receive_slots = static_cast<size_t>(absl::GetFlag(FLAGS_receive_slots));
  TransportOptions so;
  so.name = absl::StrCat("burst-server-", s.name);
  so.listening = true;
  s.server = std::make_unique<RdmaTransport>(so, o, /*server=*/true);
  auto address = rdmarpc::transport::ParseAddress("rdma://" + ip + ":0");
  if (!address.ok()) return address.status();
  auto l = s.server->Listen(*address, [&s](std::shared_ptr<Connection>) { return &s.echo; });
  if (!l.ok()) return l.status();
  s.listener = std::move(*l);
  for (int i = 0; i < connections; ++i) {
    TransportOptions co;
    co.name = absl::StrCat("burst-client-", s.name, "-", i);
    s.clients.push_back(std::make_unique<RdmaTransport>(co, o, /*server=*/false));
    auto c = s.clients.back()->Connect(s.listener->address(), &s.responses,
                                       rdmarpc::SteadyNow() + absl::Seconds(30));
    if (!c.ok()) return c.status();
    s.conns.push_back(*c);
  }
  return absl::OkStatus();
}

absl::Status Round(Setup& s, int frames, size_t bytes, uint64_t* next_id) {
  s.responses.Reset();
  const int64_t naks_before = rdmarpc::transport::rdma::ReadDeviceRnrNaks().received;
  const absl::Time start = rdmarpc::SteadyNow();
  for (int f = 0; f < frames; ++f) {
    for (auto& c : s.conns) {
      auto payload = c->AllocatePayload(bytes);
      if (!payload.ok()) return payload.status();
      memset(payload->data(), 0x5a, bytes);
      OutboundMessage m;
      m.header.kind = MessageKind::kRequest;
      m.header.call_id = (*next_id)++;
      m.payload = std::move(*payload);
      if (absl::Status st = c->Send(std::move(m)); !st.ok()) return st;
    }
  }
  if (absl::Status st = s.responses.Wait(frames * static_cast<int>(s.conns.size())); !st.ok()) {
    return st;
  }
  s.round_ms.push_back(absl::ToDoubleMilliseconds(rdmarpc::SteadyNow() - start));
  const int64_t naks_after = rdmarpc::transport::rdma::ReadDeviceRnrNaks().received;
  if (naks_before >= 0 && naks_after >= 0) s.naks.push_back(naks_after - naks_before);
  return absl::OkStatus();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string ip = absl::GetFlag(FLAGS_address);
  if (ip.empty() && getenv("RDMARPC_TEST_ADDR") != nullptr) ip = getenv("RDMARPC_TEST_ADDR");
  if (ip.empty()) {
    fprintf(stderr, "srq_burst: set --address or RDMARPC_TEST_ADDR (tools/vm/run.sh does)\n");
    return 2;
  }
  const int connections = absl::GetFlag(FLAGS_connections);
  const int frames = absl::GetFlag(FLAGS_frames);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bytes));
  const int slots = absl::GetFlag(FLAGS_receive_slots);
  if (connections < 1 || frames < 1 || rounds < 1 || slots < 2 ||
      frames > static_cast<int>(std::min<size_t>(RdmaOptions().credits, slots / 2))) {
    fprintf(stderr,
            "srq_burst: --connections, --frames and --rounds from 1, --receive_slots from 2; "
            "--frames at most the credits a connection gets, %u or half the slots\n",
            RdmaOptions().credits);
    return 2;
  }
  Setup setups[2];
  setups[0].name = "default";
  setups[0].rnr_wait_us = RdmaOptions().rnr_wait_us;
  setups[1].name = "long";
  setups[1].rnr_wait_us = rdmarpc::transport::rdma::kLongestRnrWaitUs;
  for (Setup& s : setups) {
    if (absl::Status st = Start(s, ip, connections); !st.ok()) {
      fprintf(stderr, "srq_burst: %s setup: %s\n", s.name, st.ToString().c_str());
      return 1;
    }
  }
  printf(
      "srq_burst_frames %d (%d connections x %d, into %d receive slots; rnr_wait_us %u "
      "and %u)\n",
      connections * frames, connections, frames, slots, setups[0].rnr_wait_us,
      setups[1].rnr_wait_us);
  uint64_t next_id = 1;
  for (int r = 0; r < rounds; ++r) {
    for (Setup& s : setups) {
      if (absl::Status st = Round(s, frames, bytes, &next_id); !st.ok()) {
        fprintf(stderr, "srq_burst: %s setup, round %d: %s\n", s.name, r, st.ToString().c_str());
        return 1;
      }
      fprintf(stderr, "srq_burst: round %d/%d, %s wait: %.1f ms\n", r + 1, rounds, s.name,
              s.round_ms.back());
    }
  }
  for (Setup& s : setups) {
    printf("srq_burst_%s_wait_round_p50_ms %.1f\n", s.name, Median(s.round_ms));
    printf("srq_burst_%s_wait_round_max_ms %.1f\n", s.name,
           *std::max_element(s.round_ms.begin(), s.round_ms.end()));
    if (s.naks.empty()) {
      printf("srq_burst_%s_wait_rnr_naks_per_round none (the device does not count them)\n",
             s.name);
    } else {
      int64_t total = 0;
      for (int64_t n : s.naks) total += n;
      printf("srq_burst_%s_wait_rnr_naks_per_round %.1f\n", s.name,
             static_cast<double>(total) / s.naks.size());
    }
  }
  printf("srq_burst_long_over_default_p50 %.2f\n",
         Median(setups[1].round_ms) / Median(setups[0].round_ms));
  for (Setup& s : setups) {
    for (auto& c : s.conns) c->Close();
    for (auto& client : s.clients) client->Shutdown();
    s.server->Shutdown();
  }
  return 0;
}
