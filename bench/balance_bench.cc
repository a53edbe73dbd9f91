// Balancing benchmark: what a BalancedChannel's policy does for a client
// whose replicas are uneven. --servers servers in this process, the first
// of them slow (each of its calls takes --slow_us more), and --threads
// client threads making small blocking calls through one BalancedChannel,
// first under round robin, then under least requests, on the same servers.
// Round robin is the peer: least requests is measured beside it and the
// ratios printed.
//
// Output lines (machine-readable), for each policy (round_robin,
// least_requests):
//   <policy>_calls_per_s <value>    (all threads together)
//   <policy>_mean_us, <policy>_p50_us, <policy>_p99_us <value>   (a call's
//     round trip)
//   <policy>_slow_server_share <value>   (the fraction of the calls that
//     the slow server answered)
//   <policy>_failed <value>         (calls that did not end OK)
// then least_requests_over_round_robin_{calls_per_s,mean,p50,p99} <value>.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "bench/bench.rdmarpc.pb.h"
#include "rpc/balanced_channel.h"
#include "rpc/server.h"

ABSL_FLAG(std::string, address, "",
          "where each server listens (port 0: one of its own); default "
          "rdma://$RDMARPC_TEST_ADDR:0 where that is set (the Soft-RoCE VM), else "
          "tcp://127.0.0.1:0");
ABSL_FLAG(int, servers, 3, "replicas, the first of them slow");
ABSL_FLAG(int, slow_us, 2000, "what each call to the slow server takes beyond the others'");
ABSL_FLAG(int, threads, 6, "client threads, each making blocking calls one after another");
ABSL_FLAG(int, calls, 2000, "calls per thread and policy");
ABSL_FLAG(int, workers, 8, "worker threads per server");

namespace {

class DelayedPing : public rdmarpc::bench::Bench::Service {
 public:
  explicit DelayedPing(absl::Duration delay) : delay_(delay) {}
  rdmarpc::Status Ping(rdmarpc::ServerContext*, const rdmarpc::bench::Blob* req,
                       rdmarpc::bench::Blob* resp) override {
    calls.fetch_add(1, std::memory_order_relaxed);
    if (delay_ > absl::ZeroDuration()) absl::SleepFor(delay_);
    resp->set_data(req->data());
    return rdmarpc::Status();
  }
  rdmarpc::Status Pull(rdmarpc::ServerContext*, const rdmarpc::bench::Blob*,
                       rdmarpc::bench::Ack*) override {
    return rdmarpc::Status(rdmarpc::StatusCode::kUnimplemented, "balance_bench pings only");
  }

  std::atomic<uint64_t> calls{0};

 private:
  const absl::Duration delay_;
};

struct Replica {
  std::unique_ptr<DelayedPing> service;
  std::unique_ptr<rdmarpc::Server> server;
};

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()))];
}

struct Figures {
  double calls_per_s = 0, mean_us = 0, p50_us = 0, p99_us = 0;
};

// One policy's run: prints its figures.
Figures Measure(const char* name, rdmarpc::BalancingPolicy policy,
                const std::vector<std::string>& addresses, std::vector<Replica>& replicas) {
  auto channel = rdmarpc::BalancedChannel::Create(addresses, rdmarpc::ChannelOptions(), policy);
  if (!channel.ok()) {
    fprintf(stderr, "balance_bench: %s\n", channel.status().ToString().c_str());
    exit(1);
  }
  for (const auto& backend : (*channel)->backends()) {
    if (!backend->WaitForConnected(absl::Now() + absl::Seconds(20))) {
      fprintf(stderr, "balance_bench: cannot connect to %s: %s\n", backend->target().c_str(),
              backend->stats().last_connect_error.ToString().c_str());
      exit(1);
    }
  }
  auto stub = rdmarpc::bench::Bench::NewStub(*channel);
  const uint64_t slow_before = replicas[0].service->calls.load();
  uint64_t all_before = 0;
  for (const Replica& r : replicas) all_before += r.service->calls.load();

  const int threads = absl::GetFlag(FLAGS_threads);
  const int calls = absl::GetFlag(FLAGS_calls);
  std::vector<std::vector<double>> us(threads);
  std::atomic<int> failed{0};
  const absl::Time start = rdmarpc::SteadyNow();
  std::vector<std::thread> clients;
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      rdmarpc::bench::Blob req, resp;
      req.set_data(std::string(64, 'p'));
      us[t].reserve(calls);
      for (int i = 0; i < calls; ++i) {
        rdmarpc::ClientContext ctx;
        ctx.set_timeout(absl::Seconds(20));
        const absl::Time t0 = rdmarpc::SteadyNow();
        const rdmarpc::Status s = stub->Ping(&ctx, req, &resp);
        us[t].push_back(absl::ToDoubleMicroseconds(rdmarpc::SteadyNow() - t0));
        if (!s.ok() && failed.fetch_add(1) == 0) {
          fprintf(stderr, "balance_bench: %s call failed: %s\n", name, s.ToString().c_str());
        }
      }
    });
  }
  for (auto& c : clients) c.join();
  const double secs = absl::ToDoubleSeconds(rdmarpc::SteadyNow() - start);

  std::vector<double> all;
  for (const auto& v : us) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  uint64_t all_after = 0;
  for (const Replica& r : replicas) all_after += r.service->calls.load();
  const double slow_share = static_cast<double>(replicas[0].service->calls.load() - slow_before) /
                            static_cast<double>(std::max<uint64_t>(1, all_after - all_before));

  Figures f;
  f.calls_per_s = all.size() / secs;
  for (double v : all) f.mean_us += v / all.size();
  f.p50_us = Percentile(all, 0.50);
  f.p99_us = Percentile(all, 0.99);
  printf("%s_calls_per_s %.0f\n", name, f.calls_per_s);
  printf("%s_mean_us %.1f\n", name, f.mean_us);
  printf("%s_p50_us %.1f\n", name, f.p50_us);
  printf("%s_p99_us %.1f\n", name, f.p99_us);
  printf("%s_slow_server_share %.3f\n", name, slow_share);
  printf("%s_failed %d\n", name, failed.load());
  fflush(stdout);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_servers);
  if (n < 2 || absl::GetFlag(FLAGS_threads) < 1 || absl::GetFlag(FLAGS_calls) < 1) {
    fprintf(stderr, "balance_bench: needs --servers >= 2, --threads >= 1 and --calls >= 1\n");
    return 2;
  }
  std::string listen = absl::GetFlag(FLAGS_address);
  if (listen.empty()) {
    const char* ip = getenv("RDMARPC_TEST_ADDR");
    listen = ip != nullptr ? absl::StrCat("rdma://", ip, ":0") : "tcp://127.0.0.1:0";
  }
  std::vector<Replica> replicas(n);
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    replicas[i].service = std::make_unique<DelayedPing>(
        i == 0 ? absl::Microseconds(absl::GetFlag(FLAGS_slow_us)) : absl::ZeroDuration());
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort(listen)
                      .RegisterService(replicas[i].service.get())
                      .SetWorkerThreads(absl::GetFlag(FLAGS_workers))
                      .BuildAndStart();
    if (!server.ok()) {
      fprintf(stderr, "balance_bench: server %d on %s: %s\n", i, listen.c_str(),
              server.status().ToString().c_str());
      return 1;
    }
    replicas[i].server = *std::move(server);
    addresses.push_back(replicas[i].server->addresses()[0]);
  }
  printf("servers %d (the first %d us slower), threads %d, calls %d per thread, on %s\n", n,
         absl::GetFlag(FLAGS_slow_us), absl::GetFlag(FLAGS_threads), absl::GetFlag(FLAGS_calls),
         listen.c_str());
  fflush(stdout);
  const Figures rr =
      Measure("round_robin", rdmarpc::BalancingPolicy::kRoundRobin, addresses, replicas);
  const Figures lr =
      Measure("least_requests", rdmarpc::BalancingPolicy::kLeastRequests, addresses, replicas);
  printf("least_requests_over_round_robin_calls_per_s %.2f\n", lr.calls_per_s / rr.calls_per_s);
  printf("least_requests_over_round_robin_mean %.2f\n", lr.mean_us / rr.mean_us);
  printf("least_requests_over_round_robin_p50 %.2f\n", lr.p50_us / rr.p50_us);
  printf("least_requests_over_round_robin_p99 %.2f\n", lr.p99_us / rr.p99_us);
  return 0;
}
