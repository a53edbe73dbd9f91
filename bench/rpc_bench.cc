// RPC benchmark: small-call round trip and large-request bandwidth, server
// and client in one process over rdma:// (run it with bench/run_bench.sh,
// which measures perftest in the same VM boot and prints the ratios).
//
// Output lines (machine-readable):
//   transport_rtt_p50_us <value>   (raw frames, no runtime: the transport's share)
//   rpc_small_rtt_p50_us <value>   (the caller reuses its response message,
//     as protobuf advises for hot loops: what the runtime and transport cost)
//   rpc_small_fresh_response_rtt_p50_us <value>   (a new response message per
//     call: adds the allocation of its string field, the caller's own cost)
//   transport_pull_1mib_mib_per_s <value>   (1 MiB READs, no runtime)
//   rpc_pull_1mib_mib_per_s <value>   (1 MiB in a protobuf bytes field)
//   rpc_pull_attachment_1mib_mib_per_s <value>   (1 MiB as an attachment,
//     rpc/attachment.h: no protobuf copies; like the transport figure and
//     ib_read_bw, the client does not fill the bytes it sends)
//   {transport,rpc,rpc_attachment}_pull_{softirq,user_sys}_ms_per_mib <value>
//     (machine-wide CPU time per MiB pulled: the kernel's Soft-RoCE work, and
//     everyone's own)
//   {transport,rpc,rpc_attachment}_pull_minor_faults_per_mib <value>   (this
//     process's)
// With --interleaved_blocks N, also (bench/run_bench.sh runs it on its own,
// with the pollers in the adaptive mode; see InterleavedSmallCalls):
//   interleaved_bare_verbs_rtt_p50_us <value>   (a bare verbs ping-pong,
//     transport/rdma/bench/bare_pingpong.h, what ib_send_lat measures)
//   interleaved_rpc_small_rtt_p50_us <value>   (small calls, as rpc_small)
//   interleaved_rpc_small_over_bare_verbs <value>   (the median over the
//     block pairs of the call's block median over the ping-pong's)
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/notification.h"
#include "base/stage_trace.h"
#include "base/steady_clock.h"
#include "bench/bench.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/address.h"
#include "transport/rdma/bench/bare_pingpong.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/rdma_transport.h"

ABSL_FLAG(std::string, address, "", "server address; default rdma://$RDMARPC_TEST_ADDR:0");
ABSL_FLAG(int, pings, 5000, "small calls (0: skip the latency figures)");
ABSL_FLAG(std::string, responses, "both",
          "small calls' response messages: reuse (one for all calls), fresh (one per call) "
          "or both (a run of each)");
ABSL_FLAG(int, pulls, 100, "1 MiB requests (0: skip the bandwidth figure)");
ABSL_FLAG(int, in_flight, 8, "1 MiB requests in flight at once");
ABSL_FLAG(bool, rpc, true, "false: only the transport figures (no server, no protobuf)");
ABSL_FLAG(int, interleaved_blocks, 0,
          "blocks of small calls and of a bare verbs ping-pong, taking turns (0: none); needs "
          "pollers that sleep when idle, not RDMARPC_RDMA_POLL=busy");
ABSL_FLAG(int, medium_calls, 0,
          "calls carrying --medium_bytes each way, --medium_in_flight at a time (0: none)");
ABSL_FLAG(int, medium_bytes, 2048, "request and response data of a medium call");
ABSL_FLAG(int, medium_in_flight, 16, "medium calls in flight at once");
ABSL_FLAG(int, callback_threads, 2,
          "the channel's callback threads (0: callbacks inline where their calls end)");
ABSL_FLAG(int, workers, -1,
          "server worker threads (0: handlers inline on the I/O thread; -1: one per core)");

namespace {

class BenchImpl : public rdmarpc::bench::Bench::Service {
 public:
  rdmarpc::Status Ping(rdmarpc::ServerContext*, const rdmarpc::bench::Blob* req,
                       rdmarpc::bench::Blob* resp) override {
    resp->set_data(req->data());
    return rdmarpc::Status();
  }
  rdmarpc::Status Pull(rdmarpc::ServerContext* ctx, const rdmarpc::bench::Blob* req,
                       rdmarpc::bench::Ack* resp) override {
    resp->set_bytes(req->data().size() + ctx->request_attachment().size());
    return rdmarpc::Status();
  }
};

// Machine-wide CPU time by kind, from /proc/stat. Around a pull it tells the
// kernel's Soft-RoCE work (softirq: copies and checksums of every packet)
// from the process's own; run_bench.sh takes the same figure for perftest.
// The process's minor page faults tell whether a payload's memory is reused
// already mapped or faulted in again for each call.
struct CpuSeconds {
  double softirq = 0;
  double user_and_system = 0;
  long minor_faults = 0;
};

CpuSeconds ReadCpuSeconds() {
  CpuSeconds t;
  FILE* f = fopen("/proc/stat", "r");
  if (f == nullptr) return t;
  unsigned long long user, nice, system, idle, iowait, irq, softirq;
  if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &system, &idle, &iowait,
             &irq, &softirq) == 7) {
    const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
    t.softirq = softirq / hz;
    t.user_and_system = (user + nice + system) / hz;
  }
  fclose(f);
  rusage usage;
  if (getrusage(RUSAGE_SELF, &usage) == 0) t.minor_faults = usage.ru_minflt;
  return t;
}

void PrintCpuPerMiB(const char* figure, const CpuSeconds& before, double mib) {
  const CpuSeconds after = ReadCpuSeconds();
  printf("%s_softirq_ms_per_mib %.2f\n", figure, (after.softirq - before.softirq) * 1e3 / mib);
  printf("%s_user_sys_ms_per_mib %.2f\n", figure,
         (after.user_and_system - before.user_and_system) * 1e3 / mib);
  printf("%s_minor_faults_per_mib %.1f\n", figure,
         static_cast<double>(after.minor_faults - before.minor_faults) / mib);
}

// The transport-only figures: the same exchanges without protobuf and the
// runtime, so what those add is the difference to the RPC figures.
//
// Server side: answers each request with its own payload (echo) or with an
// empty frame carrying the payload's fetch status.
class Responder : public rdmarpc::transport::ConnectionObserver {
 public:
  explicit Responder(bool echo) : echo_(echo) {}
  void OnMessage(rdmarpc::transport::Connection& conn,
                 rdmarpc::transport::InboundMessage&& msg) override {
    if (msg.header.kind != rdmarpc::transport::MessageKind::kRequest) return;
    rdmarpc::transport::OutboundMessage r;
    r.header.kind = rdmarpc::transport::MessageKind::kResponse;
    r.header.call_id = msg.header.call_id;
    r.header.status = static_cast<uint16_t>(msg.payload_status.code());
    if (echo_) r.payload = std::move(msg.payload);
    conn.Send(std::move(r)).IgnoreError();
  }
  void OnClosed(rdmarpc::transport::Connection&, const absl::Status&) override {}

 private:
  const bool echo_;
};

// Client side: hands each response's call id and status on.
class ResponseSink : public rdmarpc::transport::ConnectionObserver {
 public:
  explicit ResponseSink(std::function<void(uint64_t call_id, uint16_t status)> on_response)
      : on_response_(std::move(on_response)) {}
  void OnMessage(rdmarpc::transport::Connection&,
                 rdmarpc::transport::InboundMessage&& msg) override {
    if (msg.header.kind == rdmarpc::transport::MessageKind::kResponse) {
      on_response_(msg.header.call_id, msg.header.status);
    }
  }
  void OnClosed(rdmarpc::transport::Connection&, const absl::Status&) override {}

 private:
  std::function<void(uint64_t, uint16_t)> on_response_;
};

// A server and a client RDMA transport on `address`, one connection between
// them. The observers must outlive the pair.
struct TransportPair {
  std::unique_ptr<rdmarpc::transport::rdma::RdmaTransport> server, client;
  std::unique_ptr<rdmarpc::transport::Listener> listener;
  std::shared_ptr<rdmarpc::transport::Connection> conn;

  bool Start(const std::string& address, Responder* responder, ResponseSink* sink) {
    using namespace rdmarpc::transport;
    TransportOptions so;
    so.listening = true;
    server = std::make_unique<rdma::RdmaTransport>(so, rdma::RdmaOptionsFromEnv(), true);
    auto l = server->Listen(*ParseAddress(address),
                            [responder](std::shared_ptr<Connection>) { return responder; });
    if (!l.ok()) return false;
    listener = std::move(*l);
    client = std::make_unique<rdma::RdmaTransport>(TransportOptions{}, rdma::RdmaOptionsFromEnv(),
                                                   false);
    auto c = client->Connect(listener->address(), sink, rdmarpc::SteadyNow() + absl::Seconds(10));
    if (!c.ok()) return false;
    conn = *c;
    return true;
  }
  ~TransportPair() {
    if (conn) conn->Close();
  }
};

rdmarpc::transport::OutboundMessage Request(uint64_t call_id, rdmarpc::transport::Buffer payload) {
  rdmarpc::transport::OutboundMessage m;
  m.header.kind = rdmarpc::transport::MessageKind::kRequest;
  m.header.call_id = call_id;
  m.payload = std::move(payload);
  return m;
}

// Frame ping-pong, one at a time; the caller drives its own completions.
double TransportRttP50(const std::string& address, int n) {
  Responder responder(/*echo=*/true);
  std::atomic<uint64_t> got{0};
  ResponseSink sink([&](uint64_t id, uint16_t) { got.store(id, std::memory_order_release); });
  TransportPair pair;  // last: its transports stop before what they call goes
  if (!pair.Start(address, &responder, &sink)) return -1;
  std::vector<double> us;
  for (int i = 1; i <= n + 100; ++i) {
    if (i == 101) RDMARPC_STAGE_RECORD(true);
    const absl::Time t0 = rdmarpc::SteadyNow();
    RDMARPC_STAGE(kRoundTripBegin);
    // Registered memory from the connection, as the runtime uses: a heap
    // buffer would add an allocation per frame that perftest does not make.
    auto payload = pair.conn->AllocatePayload(64);
    if (!payload.ok() || !pair.conn->Send(Request(i, std::move(*payload))).ok()) return -1;
    const auto arrived = [&] {
      return got.load(std::memory_order_acquire) == static_cast<uint64_t>(i);
    };
    if (!pair.conn->Drive(arrived)) {
      while (!arrived()) std::this_thread::yield();
    }
    RDMARPC_STAGE(kRoundTripEnd);
    if (i > 100) us.push_back(absl::ToDoubleMicroseconds(rdmarpc::SteadyNow() - t0));
  }
  RDMARPC_STAGE_DUMP("transport");
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// 1 MiB pulls, in_flight at a time: the client advertises a registered block
// it does not fill, the server READs it and answers with an empty frame.
double TransportPullMiBps(const std::string& address, int pulls, int in_flight) {
  Responder responder(/*echo=*/false);
  std::atomic<int> started{0}, done{0}, failed{0};
  std::shared_ptr<rdmarpc::transport::Connection> conn;
  std::function<void()> issue = [&] {
    const int n = started.fetch_add(1);
    if (n >= pulls) return;
    auto payload = conn->AllocatePayload(1 << 20);
    if (!payload.ok()) return;
    conn->Send(Request(static_cast<uint64_t>(n) + 1, std::move(*payload))).IgnoreError();
  };
  absl::Notification all_done;
  ResponseSink sink([&](uint64_t, uint16_t status) {
    if (status != 0) failed.fetch_add(1);
    if (done.fetch_add(1) + 1 == pulls) all_done.Notify();
    issue();
  });
  TransportPair pair;  // last: its transports stop before what they call goes
  if (!pair.Start(address, &responder, &sink)) return -1;
  conn = pair.conn;
  const CpuSeconds cpu = ReadCpuSeconds();
  const absl::Time start = rdmarpc::SteadyNow();
  for (int i = 0; i < in_flight; ++i) issue();
  // Waits without waking up: a waiter polling every few hundred microseconds
  // costs the emulated machine CPU time that the kernel's READ work needs.
  all_done.WaitForNotificationWithTimeout(absl::Seconds(120));
  const double secs = absl::ToDoubleSeconds(rdmarpc::SteadyNow() - start);
  PrintCpuPerMiB("transport_pull", cpu, pulls);
  if (done.load() < pulls || failed.load() > 0) return -1;
  return pulls / secs;
}

// What one run of asynchronous calls shares with its callbacks. Each pending
// call holds it: the last callback is still on its way out (calling
// IssueNext, which finds nothing left to start) after all_done has let
// RunAsyncCalls return, so nothing a callback touches may live on that
// function's stack.
struct AsyncRun {
  // Starts one call; it calls `done` once, with whether the call did what it should.
  using Start = std::function<void(std::function<void(bool ok)> done)>;
  AsyncRun(int calls, Start start) : calls(calls), start(std::move(start)) {}
  const int calls;
  const Start start;
  std::atomic<int> started{0}, done{0}, failed{0};
  absl::Notification all_done;
};

void IssueNext(const std::shared_ptr<AsyncRun>& run) {
  if (run->started.fetch_add(1) >= run->calls) return;
  run->start([run](bool ok) {
    if (!ok) run->failed.fetch_add(1);
    if (run->done.fetch_add(1) + 1 == run->calls) run->all_done.Notify();
    IssueNext(run);
  });
}

// `calls` calls, in_flight at a time, each completion starting the next.
// Returns the seconds they took, or -1 when one failed. What `start` names
// must outlive the last callback: every call has started (its request
// serialized and sent) before it can complete, so only starting may use it.
double RunAsyncCalls(int calls, int in_flight, AsyncRun::Start start) {
  auto run = std::make_shared<AsyncRun>(calls, std::move(start));
  const absl::Time t0 = rdmarpc::SteadyNow();
  for (int i = 0; i < in_flight; ++i) IssueNext(run);
  run->all_done.WaitForNotification();
  const double secs = absl::ToDoubleSeconds(rdmarpc::SteadyNow() - t0);
  return run->failed.load() > 0 ? -1 : secs;
}

// 1 MiB requests to Pull, in_flight at a time: `request`, plus what `attach`
// sets on each call's context (the 1 MiB is in one or the other). Returns
// MiB/s, or -1 when a call failed or the server saw other than 1 MiB.
double RpcPullMiBps(rdmarpc::bench::Bench::Stub& stub, const char* figure, int pulls, int in_flight,
                    const std::function<void(rdmarpc::ClientContext*)>& attach,
                    const rdmarpc::bench::Blob& request) {
  std::atomic<bool> told{false};
  const CpuSeconds cpu = ReadCpuSeconds();
  const double secs = RunAsyncCalls(pulls, in_flight, [&](std::function<void(bool)> done) {
    struct Slot {
      rdmarpc::ClientContext ctx;
      rdmarpc::bench::Ack ack;
    };
    auto slot = std::make_shared<Slot>();
    attach(&slot->ctx);
    stub.AsyncPull(&slot->ctx, request, &slot->ack, [&told, figure, slot, done](rdmarpc::Status s) {
      const bool ok = s.ok() && slot->ack.bytes() == (1 << 20);
      if (!ok && !told.exchange(true)) {
        fprintf(stderr, "%s: %s, server saw %llu bytes\n", figure, s.ToString().c_str(),
                static_cast<unsigned long long>(slot->ack.bytes()));
      }
      done(ok);
    });
  });
  PrintCpuPerMiB(figure, cpu, pulls);
  return secs < 0 ? -1 : pulls / secs;
}

// Calls to Ping whose request and echoed response carry `bytes` of data
// each, in_flight at a time: too large to go inline, small enough to travel
// by SEND from a send slot. Returns calls per second, or -1 when a call
// failed or its echo came back with other than `bytes`.
double MediumCallsPerSecond(rdmarpc::bench::Bench::Stub& stub, int calls, int in_flight,
                            int bytes) {
  rdmarpc::bench::Blob request;
  request.set_data(std::string(bytes, 'm'));
  std::atomic<bool> told{false};
  const double secs = RunAsyncCalls(calls, in_flight, [&](std::function<void(bool)> done) {
    struct Slot {
      rdmarpc::ClientContext ctx;
      rdmarpc::bench::Blob echo;
    };
    auto slot = std::make_shared<Slot>();
    stub.AsyncPing(&slot->ctx, request, &slot->echo, [&told, bytes, slot, done](rdmarpc::Status s) {
      const bool ok = s.ok() && slot->echo.data().size() == static_cast<size_t>(bytes);
      if (!ok && !told.exchange(true)) {
        fprintf(stderr, "rpc_medium: %s, echo of %zu bytes\n", s.ToString().c_str(),
                slot->echo.data().size());
      }
      done(ok);
    });
  });
  return secs < 0 ? -1 : calls / secs;
}

// Blocking small calls, one at a time; appends each round trip's time in us
// to `rtt` when given. False, with the reason on stderr, if a call fails.
bool TimeSmallCalls(rdmarpc::bench::Bench::Stub& stub, int calls, bool fresh_response,
                    const char* figure, std::vector<double>* rtt) {
  rdmarpc::bench::Blob small;
  small.set_data(std::string(64, 's'));
  rdmarpc::bench::Blob reused;
  for (int i = 0; i < calls; ++i) {
    rdmarpc::ClientContext ctx;
    rdmarpc::bench::Blob fresh;
    rdmarpc::bench::Blob* out = fresh_response ? &fresh : &reused;
    const absl::Time t0 = rdmarpc::SteadyNow();
    RDMARPC_STAGE(kRoundTripBegin);
    const rdmarpc::Status s = stub.Ping(&ctx, small, out);
    RDMARPC_STAGE(kRoundTripEnd);
    const double us = absl::ToDoubleMicroseconds(rdmarpc::SteadyNow() - t0);
    if (!s.ok() || out->data() != small.data()) {
      fprintf(stderr, "%s: %s\n", figure, s.ok() ? "the echo differs" : s.ToString().c_str());
      return false;
    }
    if (rtt != nullptr) rtt->push_back(us);
  }
  return true;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? -1 : v[v.size() / 2];
}

// Blocking small calls, one at a time, after 100 for warm-up; prints the
// round trip's p50 and p99 as `figure`_rtt_{p50,p99}_us. With a fresh
// response message per call, parsing the response allocates its string (the
// object and its bytes) and the message's end frees them: ~500 instructions
// of the caller's own that a reused message keeps out of the loop.
bool SmallCalls(rdmarpc::bench::Bench::Stub& stub, int pings, bool fresh_response,
                const char* figure) {
  if (!TimeSmallCalls(stub, 100, fresh_response, figure, nullptr)) return false;
  std::vector<double> rtt;
  rtt.reserve(pings);
  RDMARPC_STAGE_RECORD(true);
  if (!TimeSmallCalls(stub, pings, fresh_response, figure, &rtt)) return false;
  RDMARPC_STAGE_DUMP(figure);
  std::sort(rtt.begin(), rtt.end());
  printf("%s_rtt_p50_us %.2f\n", figure, rtt[rtt.size() / 2]);
  printf("%s_rtt_p99_us %.2f\n", figure, rtt[rtt.size() * 99 / 100]);
  return true;
}

// Small calls against a bare verbs ping-pong of the same bytes, in blocks
// that take turns, so that each pair of blocks shares the machine's spell
// (bare_pingpong.h says why that matters under the emulator). The ping-pong's
// server thread sleeps between its blocks; rdmarpc's pollers must too, which
// the adaptive mode does once they have been idle for spin_us, so the first
// round trips of each block (those wake-ups, and the other side's spinning
// before it sleeps) are not counted.
bool InterleavedSmallCalls(rdmarpc::bench::Bench::Stub& stub, const std::string& ip, int blocks) {
  constexpr int kSettle = 50;     // round trips per block not counted
  constexpr int kMeasured = 250;  // round trips per block counted
  constexpr int kFrame = 130;     // what one small call puts on the wire (run_bench.sh)
  using rdmarpc::transport::rdma::BarePingPong;
  auto pp = BarePingPong::Start(ip, kFrame, {BarePingPong::Shape{}});
  if (!pp.ok()) {
    fprintf(stderr, "interleaved: %s\n", pp.status().ToString().c_str());
    return false;
  }
  std::vector<double> bare_all, call_all, ratios;
  for (int b = 0; b <= blocks; ++b) {  // block pair 0 warms up
    std::vector<double> bare, call;
    absl::Status s = (*pp)->RunBlock(0, kSettle, nullptr, nullptr);
    if (s.ok()) s = (*pp)->RunBlock(0, kMeasured, nullptr, &bare);
    if (!s.ok()) {
      fprintf(stderr, "interleaved: %s\n", s.ToString().c_str());
      return false;
    }
    if (!TimeSmallCalls(stub, kSettle, false, "interleaved", nullptr) ||
        !TimeSmallCalls(stub, kMeasured, false, "interleaved", &call)) {
      return false;
    }
    if (b == 0) continue;
    ratios.push_back(Median(call) / Median(bare));
    bare_all.insert(bare_all.end(), bare.begin(), bare.end());
    call_all.insert(call_all.end(), call.begin(), call.end());
  }
  printf("interleaved_bare_verbs_rtt_p50_us %.2f\n", Median(bare_all));
  printf("interleaved_rpc_small_rtt_p50_us %.2f\n", Median(call_all));
  printf("interleaved_rpc_small_over_bare_verbs %.3f\n", Median(ratios));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) {
    const char* ip = getenv("RDMARPC_TEST_ADDR");
    if (!ip) {
      fprintf(stderr, "set --address or RDMARPC_TEST_ADDR (bench/run_bench.sh does)\n");
      return 2;
    }
    address = std::string("rdma://") + ip + ":0";
  }
  const int interleaved_blocks = absl::GetFlag(FLAGS_interleaved_blocks);
  std::string interleaved_ip;
  if (interleaved_blocks > 0) {
    const char* poll = getenv("RDMARPC_RDMA_POLL");
    auto parsed = rdmarpc::transport::ParseAddress(address);
    if (poll != nullptr && std::string(poll) == "busy") {
      // rdmarpc's busy pollers never sleep: with the ping-pong's threads
      // they would be more spinners than the VM has CPUs.
      fprintf(stderr,
              "--interleaved_blocks needs pollers that sleep when idle: unset "
              "RDMARPC_RDMA_POLL=busy\n");
      return 2;
    }
    if (!parsed.ok() || parsed->scheme != "rdma" || !absl::GetFlag(FLAGS_rpc)) {
      fprintf(stderr, "--interleaved_blocks needs calls (--rpc) to an rdma:// address\n");
      return 2;
    }
    interleaved_ip = parsed->host;
  }
  const int pings = absl::GetFlag(FLAGS_pings);
  if (pings > 0) printf("transport_rtt_p50_us %.2f\n", TransportRttP50(address, pings));
  const int pulls = absl::GetFlag(FLAGS_pulls);
  if (pulls > 0 && !absl::GetFlag(FLAGS_rpc)) {
    printf("transport_pull_1mib_mib_per_s %.2f\n",
           TransportPullMiBps(address, pulls, absl::GetFlag(FLAGS_in_flight)));
  }
  if (!absl::GetFlag(FLAGS_rpc)) return 0;
  BenchImpl service;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort(address)
                    .RegisterService(&service)
                    .SetWorkerThreads(absl::GetFlag(FLAGS_workers))
                    .BuildAndStart();
  if (!server.ok()) {
    fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  rdmarpc::ChannelOptions channel_options;
  channel_options.callback_threads = absl::GetFlag(FLAGS_callback_threads);
  auto channel = rdmarpc::Channel::Create((*server)->addresses()[0], channel_options);
  if (!channel.ok()) {
    fprintf(stderr, "%s\n", channel.status().ToString().c_str());
    return 1;
  }
  auto stub = rdmarpc::bench::Bench::NewStub(*channel);

  const std::string responses = absl::GetFlag(FLAGS_responses);
  if (responses != "reuse" && responses != "fresh" && responses != "both") {
    fprintf(stderr, "--responses: reuse, fresh or both, not '%s'\n", responses.c_str());
    return 2;
  }
  if (pings > 0 && responses != "fresh") {
    if (!SmallCalls(*stub, pings, /*fresh_response=*/false, "rpc_small")) return 1;
  }
  if (pings > 0 && responses != "reuse") {
    if (!SmallCalls(*stub, pings, /*fresh_response=*/true, "rpc_small_fresh_response")) return 1;
  }
  if (interleaved_blocks > 0 && !InterleavedSmallCalls(*stub, interleaved_ip, interleaved_blocks)) {
    return 1;
  }

  const int medium_calls = absl::GetFlag(FLAGS_medium_calls);
  if (medium_calls > 0) {
    const int bytes = absl::GetFlag(FLAGS_medium_bytes);
    const double rate =
        MediumCallsPerSecond(*stub, medium_calls, absl::GetFlag(FLAGS_medium_in_flight), bytes);
    printf("rpc_medium_%db_calls_per_s %.0f\n", bytes, rate);
    if (rate < 0) return 1;
  }

  if (pulls > 0) {
    printf("transport_pull_1mib_mib_per_s %.2f\n",
           TransportPullMiBps(address, pulls, absl::GetFlag(FLAGS_in_flight)));
  }
  int failed = 0;
  if (pulls > 0) {
    const int in_flight = absl::GetFlag(FLAGS_in_flight);
    rdmarpc::bench::Blob big;
    big.set_data(std::string(1 << 20, 'b'));
    const double bytes_field = RpcPullMiBps(
        *stub, "rpc_pull", pulls, in_flight, [](rdmarpc::ClientContext*) {}, big);
    printf("rpc_pull_1mib_mib_per_s %.2f\n", bytes_field);
    rdmarpc::Channel& ch = **channel;
    const double attached = RpcPullMiBps(
        *stub, "rpc_attachment_pull", pulls, in_flight,
        [&ch](rdmarpc::ClientContext* ctx) {
          auto att = ch.AllocateAttachment(1 << 20);
          if (att.ok()) ctx->set_request_attachment(std::move(*att));
        },
        rdmarpc::bench::Blob());
    printf("rpc_pull_attachment_1mib_mib_per_s %.2f\n", attached);
    failed = (bytes_field < 0) + (attached < 0);
  }
  printf("rpc_failed %d\n", failed);
  printf("counters %s\n", rdmarpc::transport::rdma::Counters().ToString().c_str());
  (*server)->Shutdown(absl::Seconds(1));
  return failed == 0 ? 0 : 1;
}
