// The main job (`make demo`): an Echo server and a client in one process,
// talking over rdma:// (or the address given), with small calls going by SEND
// into the server's SRQ and large ones by RDMA READ, as a protobuf bytes field
// and as an attachment (rpc/attachment.h, which protobuf never copies).
// Asks the server's health service first, as a load balancer would (rpc/health.h).
// Prints the device used (the transport's log line), latencies and the
// transport counters. The RDMA poll mode is set in code on both ends
// (ChannelOptions::transport, ServerBuilder::SetTransportTunables).
//
//   echo_demo --address=rdma://10.77.0.1:0 --small_calls=2000 --large_calls=20 --poll=busy
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "proto/echo.rdmarpc.pb.h"
#include "proto/health.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/rdma/counters.h"
#include "transport/tcp/tcp_counters.h"

ABSL_FLAG(std::string, address, "", "where the server listens, e.g. rdma://10.0.0.1:0");
ABSL_FLAG(int, small_calls, 2000, "calls with a 64-byte payload (0: none)");
ABSL_FLAG(int, large_calls, 20, "calls with a 1 MiB payload (0: none)");
ABSL_FLAG(int, attachment_calls, 20, "calls with a 1 MiB attachment each way (0: none)");
ABSL_FLAG(int, workers, 0, "server worker threads; 0 runs the (non-blocking) handler inline");
ABSL_FLAG(std::string, poll, "adaptive",
          "RDMA completion polling: adaptive (spin a while, then sleep), busy (spin: the lowest "
          "latency, a core per transport) or event (never spin)");

namespace {

using rdmarpc::transport::rdma::PollMode;

std::optional<PollMode> ParsePollMode(const std::string& name) {
  if (name == "adaptive") return PollMode::kAdaptive;
  if (name == "busy") return PollMode::kBusy;
  if (name == "event") return PollMode::kEvent;
  return std::nullopt;
}

class EchoImpl : public rdmarpc::examples::Echo::Service {
 public:
  rdmarpc::Status Say(rdmarpc::ServerContext* ctx, const rdmarpc::examples::EchoRequest* req,
                      rdmarpc::examples::EchoResponse* resp) override {
    resp->set_payload(req->payload());
    const absl::string_view in = ctx->request_attachment();
    if (!in.empty()) {
      auto out = ctx->AllocateResponseAttachment(in.size());
      if (!out.ok()) return out.status();
      memcpy(out->data(), in.data(), in.size());
      ctx->set_response_attachment(std::move(*out));
    }
    resp->set_server_calls(++calls_);
    return rdmarpc::Status();
  }

 private:
  std::atomic<uint64_t> calls_{0};
};

// Intervals are timed on the steady clock: the wall clock (absl::Now()) may
// step in the middle of a run (NTP, a resumed VM) and skew a latency.
double MicrosecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

std::string Percentiles(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[static_cast<size_t>(q * (us.size() - 1))]; };
  return absl::StrFormat("p50 %.1f us, p99 %.1f us, max %.1f us", at(0.5), at(0.99), us.back());
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) {
    const char* ip = getenv("RDMARPC_TEST_ADDR");
    address = ip ? absl::StrCat("rdma://", ip, ":0") : "auto://127.0.0.1:0";
  }
  const std::optional<PollMode> poll = ParsePollMode(absl::GetFlag(FLAGS_poll));
  if (!poll) {
    fprintf(stderr, "--poll=%s: not adaptive, busy or event\n", absl::GetFlag(FLAGS_poll).c_str());
    return 2;
  }
  for (const auto& [name, calls] :
       {std::pair<const char*, int>{"small_calls", absl::GetFlag(FLAGS_small_calls)},
        {"large_calls", absl::GetFlag(FLAGS_large_calls)},
        {"attachment_calls", absl::GetFlag(FLAGS_attachment_calls)}}) {
    if (calls < 0) {
      fprintf(stderr, "--%s=%d: a count of calls, 0 for none\n", name, calls);
      return 2;
    }
  }
  rdmarpc::transport::TransportTunables tunables;  // for both ends
  tunables.rdma.poll_mode = *poll;
  EchoImpl service;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort(address)
                    .RegisterService(&service)
                    .SetWorkerThreads(absl::GetFlag(FLAGS_workers))
                    .SetTransportTunables(tunables)
                    .EnableHealthService()
                    .BuildAndStart();
  if (!server.ok()) {
    fprintf(stderr, "server: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  const std::string target = (*server)->addresses()[0];
  printf("server listening on %s (RDMA poll mode %s, unless RDMARPC_RDMA_POLL says otherwise)\n",
         target.c_str(), absl::GetFlag(FLAGS_poll).c_str());
  rdmarpc::ChannelOptions channel_options;
  channel_options.transport = tunables;
  auto channel = rdmarpc::Channel::Create(target, channel_options);
  if (!channel.ok()) {
    fprintf(stderr, "channel: %s\n", std::string(channel.status().message()).c_str());
    return 1;
  }
  {
    // Connecting ahead of the first call keeps it out of the latencies.
    const auto start = std::chrono::steady_clock::now();
    if (!(*channel)->WaitForConnected(absl::Now() + absl::Seconds(30))) {
      fprintf(stderr, "channel: not connected to %s after 30 s (%s): %s\n", target.c_str(),
              rdmarpc::ChannelStateName((*channel)->GetState(false)),
              (*channel)->stats().last_connect_error.ToString().c_str());
      return 1;
    }
    printf("channel connected to %s in %.1f ms (connect attempts: %llu)\n", target.c_str(),
           MicrosecondsSince(start) / 1000,
           static_cast<unsigned long long>((*channel)->stats().connect_attempts));
  }
  auto stub = rdmarpc::examples::Echo::NewStub(*channel);
  {
    // What a load balancer asks first (rpc/health.h).
    auto health = rdmarpc::health::v1::Health::NewStub(*channel);
    rdmarpc::ClientContext ctx;
    ctx.set_timeout(absl::Seconds(30));
    rdmarpc::health::v1::HealthCheckRequest req;
    req.set_service("rdmarpc.examples.Echo");
    rdmarpc::health::v1::HealthCheckResponse resp;
    const rdmarpc::Status s = health->Check(&ctx, req, &resp);
    if (!s.ok()) {
      fprintf(stderr, "health check: %s\n", s.ToString().c_str());
      return 1;
    }
    printf("health of %s at %s: %s\n", req.service().c_str(), target.c_str(),
           rdmarpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()).c_str());
  }

  auto run = [&](int calls, size_t size, bool attach, const char* label) -> bool {
    if (calls == 0) {
      printf("%-6s no calls\n", label);
      return true;
    }
    rdmarpc::examples::EchoRequest req;
    if (!attach) req.set_payload(std::string(size, 'x'));
    std::vector<double> us;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) {
      rdmarpc::ClientContext ctx;
      ctx.set_timeout(absl::Seconds(30));
      rdmarpc::examples::EchoResponse resp;
      const auto t0 = std::chrono::steady_clock::now();
      if (attach) {
        auto att = (*channel)->AllocateAttachment(size);
        if (!att.ok()) {
          fprintf(stderr, "%s call %d: %s\n", label, i, att.status().ToString().c_str());
          return false;
        }
        memset(att->data(), 'a', size);
        ctx.set_request_attachment(std::move(*att));
      }
      rdmarpc::Status s = stub->Say(&ctx, req, &resp);
      us.push_back(MicrosecondsSince(t0));
      const size_t got = attach ? ctx.response_attachment().size() : resp.payload().size();
      if (!s.ok() || got != size) {
        fprintf(stderr, "%s call %d failed: %s\n", label, i, s.ToString().c_str());
        return false;
      }
    }
    const double secs = MicrosecondsSince(start) / 1e6;
    printf("%-6s %5d calls of %8zu bytes: %s; %.1f MiB/s each way\n", label, calls, size,
           Percentiles(us).c_str(), calls * size / secs / (1 << 20));
    return true;
  };
  const bool ok = run(absl::GetFlag(FLAGS_small_calls), 64, false, "small") &&
                  run(absl::GetFlag(FLAGS_large_calls), 1 << 20, false, "large") &&
                  run(absl::GetFlag(FLAGS_attachment_calls), 1 << 20, true, "attach");
  printf("rdma counters: %s\n", rdmarpc::transport::rdma::Counters().ToString().c_str());
  // Over tcp://, or auto:// without a device.
  const rdmarpc::transport::tcp::TcpCounters tcp = rdmarpc::transport::tcp::Counters();
  if (tcp.connections_opened > 0) printf("tcp counters: %s\n", tcp.ToString().c_str());
  for (const auto& [method, calls] : (*server)->MethodCallCounts()) {
    printf("server calls: %s %llu\n", method.c_str(), static_cast<unsigned long long>(calls));
  }
  (*server)->Shutdown(absl::Seconds(1));
  return ok ? 0 : 1;
}
