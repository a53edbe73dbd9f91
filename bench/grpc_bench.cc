// gRPC beside rdmarpc: the same service (bench.proto's Ping and Pull), served
// and called in one process by gRPC (HTTP/2 over TCP), by rdmarpc over tcp://
// and by rdmarpc over rdma://, all to the same address. The three take turns
// in blocks, round after round, so that each round's figures share the
// emulated machine's spell of speed (transport/rdma/bench/bare_pingpong.h
// says why that matters); a ratio is the median over the rounds of the
// round's ratio. bench/run_bench.sh runs it in the Soft-RoCE VM.
//
// What is measured, the same way for all three: blocking calls, one at a
// time, from one thread; a small call sends 64 bytes each way (Ping), a pull
// sends 1 MiB in a bytes field and gets a small answer (Pull). Then the same
// calls with --in_flight of them at once (that many client threads on the
// one channel, each making blocking calls): calls per second and MiB/s, what
// a server gets from a busy client rather than one call's latency. Then as
// many at once from one thread through each system's asynchronous API
// (gRPC's callback API, rdmarpc's Async methods), each call that ends
// starting the next: the way to keep many calls in flight. gRPC's
// synchronous server runs as it comes, which runs a handler on the thread
// that polled its request; rdmarpc's runs handlers on its I/O thread
// (--workers 0) to match. rdmarpc's pollers run in their default adaptive
// mode: busy ones would keep a CPU from gRPC's threads in its turns.
//
// Output lines (machine-readable), for each SYSTEM of grpc, rdmarpc_tcp and
// rdmarpc_rdma:
//   SYSTEM_small_rtt_p50_us <value>   (over every measured call)
//   SYSTEM_pull_1mib_mib_per_s <value>   (median over the rounds)
//   SYSTEM_small_in_flight_calls_per_s <value>   (median over the rounds)
//   SYSTEM_pull_in_flight_mib_per_s <value>   (median over the rounds)
//   SYSTEM_small_async_calls_per_s <value>   (median over the rounds)
//   SYSTEM_pull_async_mib_per_s <value>   (median over the rounds)
// and for each rdmarpc SYSTEM:
//   SYSTEM_small_rtt_over_grpc <ratio>   (below 1: faster than gRPC)
//   SYSTEM_pull_over_grpc <ratio>   (above 1: faster than gRPC)
//   SYSTEM_small_in_flight_over_grpc <ratio>   (above 1: faster than gRPC)
//   SYSTEM_pull_in_flight_over_grpc <ratio>   (above 1: faster than gRPC)
//   SYSTEM_small_async_over_grpc <ratio>   (above 1: faster than gRPC)
//   SYSTEM_pull_async_over_grpc <ratio>   (above 1: faster than gRPC)
// (the in-flight and async lines only with --in_flight above 1, which
// `in_flight N` names)
// then grpc_bench_failed <0 or 1> and the RDMA transport's counters.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/steady_clock.h"
#include "bench/bench.rdmarpc.pb.h"
#include "bench/grpc_bench.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/rdma/counters.h"

ABSL_FLAG(std::string, ip, "", "the address all three use; default $RDMARPC_TEST_ADDR");
ABSL_FLAG(int, rounds, 10, "rounds of blocks, one block of each system per round");
ABSL_FLAG(int, calls, 250, "small calls measured per block (after 50 not counted)");
ABSL_FLAG(int, pulls, 20, "1 MiB requests measured per block (after 2 not counted); 0: none");
ABSL_FLAG(int, in_flight, 8,
          "calls in flight at once: that many client threads making blocking calls, then that "
          "many asynchronous calls from one thread; --calls small calls and --pulls pulls a "
          "block, over them all; 0 or 1: neither");
ABSL_FLAG(std::string, systems, "grpc,tcp,rdma",
          "which of grpc, tcp (rdmarpc's tcp://) and rdma (rdmarpc's rdma://) run, in this "
          "order in each round; the ratios need grpc first");
ABSL_FLAG(int, workers, 0,
          "rdmarpc's server worker threads (ServerBuilder::SetWorkerThreads): 0 runs handlers "
          "on the I/O thread, as gRPC's synchronous server runs them on the thread that polled "
          "the request; -1: one per core");

namespace {

using rdmarpc::bench::Ack;
using rdmarpc::bench::Blob;

constexpr int kSettleCalls = 50;
constexpr int kSettlePulls = 2;
constexpr size_t kSmallBytes = 64;
constexpr size_t kPullBytes = 1 << 20;

class GrpcService final : public rdmarpc::bench_grpc::Bench::Service {
  grpc::Status Ping(grpc::ServerContext*, const Blob* req, Blob* resp) override {
    resp->set_data(req->data());
    return grpc::Status::OK;
  }
  grpc::Status Pull(grpc::ServerContext*, const Blob* req, Ack* resp) override {
    resp->set_bytes(req->data().size());
    return grpc::Status::OK;
  }
};

class RdmarpcService final : public rdmarpc::bench::Bench::Service {
  rdmarpc::Status Ping(rdmarpc::ServerContext*, const Blob* req, Blob* resp) override {
    resp->set_data(req->data());
    return rdmarpc::Status();
  }
  rdmarpc::Status Pull(rdmarpc::ServerContext*, const Blob* req, Ack* resp) override {
    resp->set_bytes(req->data().size());
    return rdmarpc::Status();
  }
};

// What an asynchronous call is given to run when it ends: its error, empty
// when it succeeded as it should.
using Ended = std::function<void(std::string error)>;

// One system's server and client. `ping` and `pull` make one blocking call
// and return its error, empty when it succeeded as it should (CheckEcho,
// CheckPull); `ping_async` and `pull_async` start one and return, `ended`
// running when it ends (`req` must outlive that).
struct System {
  std::string name;
  std::function<std::string(const Blob& req, Blob* resp)> ping;
  std::function<std::string(const Blob& req, Ack* resp)> pull;
  std::function<void(const Blob& req, Ended ended)> ping_async;
  std::function<void(const Blob& req, Ended ended)> pull_async;
  std::function<void()> stop;
  std::vector<double> rtt_us;        // every measured small call
  std::vector<double> block_rtt_us;  // the median of each round's block
  std::vector<double> pull_mib_per_s;
  std::vector<double> small_in_flight_per_s;  // calls per second, a figure per round
  std::vector<double> pull_in_flight_mib_per_s;
  std::vector<double> small_async_per_s;
  std::vector<double> pull_async_mib_per_s;
};

// A small call's request: kSmallBytes of data.
Blob SmallRequest() {
  Blob req;
  req.set_data(std::string(kSmallBytes, 's'));
  return req;
}

// An asynchronous call's state, kept by its callback: both APIs need the
// context and the response until then.
template <typename Context, typename Response>
struct AsyncCall {
  Context ctx;
  Response resp;
};

// The check both APIs' calls end with: the echo came back, or the server
// saw every byte.
std::string CheckEcho(const Blob& req, const Blob& resp) {
  return resp.data() == req.data() ? "" : "the echo differs";
}
std::string CheckPull(const Blob& req, const Ack& ack) {
  return ack.bytes() == req.data().size() ? "" : "the server saw other bytes";
}

// gRPC on `ip`, on a port it picks.
std::unique_ptr<System> StartGrpc(const std::string& ip, std::string* error) {
  auto service = std::make_shared<GrpcService>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(ip + ":0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service.get());
  std::shared_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    *error = absl::StrCat("gRPC could not listen on ", ip);
    return nullptr;
  }
  std::shared_ptr<rdmarpc::bench_grpc::Bench::Stub> stub = rdmarpc::bench_grpc::Bench::NewStub(
      grpc::CreateChannel(absl::StrCat(ip, ":", port), grpc::InsecureChannelCredentials()));
  auto system = std::make_unique<System>();
  system->name = "grpc";
  system->ping = [stub](const Blob& req, Blob* resp) {
    grpc::ClientContext ctx;
    const grpc::Status s = stub->Ping(&ctx, req, resp);
    return s.ok() ? CheckEcho(req, *resp) : s.error_message();
  };
  system->pull = [stub](const Blob& req, Ack* resp) {
    grpc::ClientContext ctx;
    const grpc::Status s = stub->Pull(&ctx, req, resp);
    return s.ok() ? CheckPull(req, *resp) : s.error_message();
  };
  system->ping_async = [stub](const Blob& req, Ended ended) {
    auto call = std::make_shared<AsyncCall<grpc::ClientContext, Blob>>();
    stub->async()->Ping(&call->ctx, &req, &call->resp,
                        [call, &req, ended = std::move(ended)](grpc::Status s) {
                          ended(s.ok() ? CheckEcho(req, call->resp) : s.error_message());
                        });
  };
  system->pull_async = [stub](const Blob& req, Ended ended) {
    auto call = std::make_shared<AsyncCall<grpc::ClientContext, Ack>>();
    stub->async()->Pull(&call->ctx, &req, &call->resp,
                        [call, &req, ended = std::move(ended)](grpc::Status s) {
                          ended(s.ok() ? CheckPull(req, call->resp) : s.error_message());
                        });
  };
  system->stop = [server, service] { server->Shutdown(); };
  return system;
}

// rdmarpc on `scheme`://`ip`, on a port it picks.
std::unique_ptr<System> StartRdmarpc(const std::string& scheme, const std::string& ip,
                                     std::string* error) {
  auto service = std::make_shared<RdmarpcService>();
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort(absl::StrCat(scheme, "://", ip, ":0"))
                    .RegisterService(service.get())
                    .SetWorkerThreads(absl::GetFlag(FLAGS_workers))
                    .BuildAndStart();
  if (!server.ok()) {
    *error = server.status().ToString();
    return nullptr;
  }
  std::shared_ptr<rdmarpc::Server> shared_server = std::move(*server);
  auto channel = rdmarpc::Channel::Create(shared_server->addresses()[0]);
  if (!channel.ok()) {
    *error = channel.status().ToString();
    return nullptr;
  }
  std::shared_ptr<rdmarpc::bench::Bench::Stub> stub = rdmarpc::bench::Bench::NewStub(*channel);
  auto system = std::make_unique<System>();
  system->name = "rdmarpc_" + scheme;
  system->ping = [stub](const Blob& req, Blob* resp) {
    rdmarpc::ClientContext ctx;
    const rdmarpc::Status s = stub->Ping(&ctx, req, resp);
    return s.ok() ? CheckEcho(req, *resp) : s.ToString();
  };
  system->pull = [stub](const Blob& req, Ack* resp) {
    rdmarpc::ClientContext ctx;
    const rdmarpc::Status s = stub->Pull(&ctx, req, resp);
    return s.ok() ? CheckPull(req, *resp) : s.ToString();
  };
  system->ping_async = [stub](const Blob& req, Ended ended) {
    auto call = std::make_shared<AsyncCall<rdmarpc::ClientContext, Blob>>();
    stub->AsyncPing(&call->ctx, req, &call->resp,
                    [call, &req, ended = std::move(ended)](rdmarpc::Status s) {
                      ended(s.ok() ? CheckEcho(req, call->resp) : s.ToString());
                    });
  };
  system->pull_async = [stub](const Blob& req, Ended ended) {
    auto call = std::make_shared<AsyncCall<rdmarpc::ClientContext, Ack>>();
    stub->AsyncPull(&call->ctx, req, &call->resp,
                    [call, &req, ended = std::move(ended)](rdmarpc::Status s) {
                      ended(s.ok() ? CheckPull(req, call->resp) : s.ToString());
                    });
  };
  system->stop = [shared_server, service] { shared_server->Shutdown(absl::Seconds(1)); };
  return system;
}

double Median(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// `n` small calls; appends each one's round trip when `rtt_us` is given.
// Empty, or what went wrong.
std::string SmallCalls(System& system, int n, std::vector<double>* rtt_us) {
  const Blob req = SmallRequest();
  Blob resp;
  for (int i = 0; i < n; ++i) {
    const absl::Time t0 = rdmarpc::SteadyNow();
    const std::string error = system.ping(req, &resp);
    const double us = absl::ToDoubleMicroseconds(rdmarpc::SteadyNow() - t0);
    if (!error.empty()) return absl::StrCat(system.name, " small call: ", error);
    if (rtt_us != nullptr) rtt_us->push_back(us);
  }
  return "";
}

// `n` pulls of 1 MiB; their rate in MiB/s when `mib_per_s` is given.
std::string Pulls(System& system, const Blob& big, int n, double* mib_per_s) {
  Ack ack;
  const absl::Time t0 = rdmarpc::SteadyNow();
  for (int i = 0; i < n; ++i) {
    const std::string error = system.pull(big, &ack);
    if (!error.empty()) return absl::StrCat(system.name, " pull: ", error);
  }
  if (mib_per_s != nullptr) {
    *mib_per_s = n * (big.data().size() / double{1 << 20}) /
                 absl::ToDoubleSeconds(rdmarpc::SteadyNow() - t0);
  }
  return "";
}

// `n` calls over `threads` client threads at once, `call` being one of
// them (its error, empty when it succeeded); their rate per second when
// `per_s` is given. The threads start together and the clock stops when the
// last ends, so a thread that ends early lowers the rate: the figure is what
// the system served, not the best thread's.
std::string InFlight(int threads, int n, const std::function<std::string()>& call, double* per_s) {
  const int each = std::max(1, n / threads);
  std::vector<std::string> errors(threads);
  std::vector<std::thread> clients;
  const absl::Time t0 = rdmarpc::SteadyNow();
  for (int t = 0; t < threads; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; i < each && errors[t].empty(); ++i) errors[t] = call();
    });
  }
  for (std::thread& client : clients) client.join();
  for (const std::string& error : errors) {
    if (!error.empty()) return error;
  }
  if (per_s != nullptr) *per_s = each * threads / absl::ToDoubleSeconds(rdmarpc::SteadyNow() - t0);
  return "";
}

// The system's small calls and pulls, `threads` at a time: one block of
// each, after a block not counted.
std::string InFlightBlock(System& system, const Blob& big, int threads, bool measured) {
  const Blob req = SmallRequest();  // read by every thread, built once
  const auto small = [&system, &req] {
    Blob resp;
    const std::string error = system.ping(req, &resp);
    return error.empty() ? error : absl::StrCat(system.name, " small call in flight: ", error);
  };
  const auto pull = [&system, &big] {
    Ack ack;
    const std::string error = system.pull(big, &ack);
    return error.empty() ? error : absl::StrCat(system.name, " pull in flight: ", error);
  };
  double calls_per_s = 0;
  std::string error = InFlight(threads, kSettleCalls, small, nullptr);
  if (error.empty()) error = InFlight(threads, absl::GetFlag(FLAGS_calls), small, &calls_per_s);
  if (!error.empty()) return error;
  if (measured) system.small_in_flight_per_s.push_back(calls_per_s);
  const int pulls = absl::GetFlag(FLAGS_pulls);
  if (pulls == 0) return "";
  double pulls_per_s = 0;
  error = InFlight(threads, threads, pull, nullptr);
  if (error.empty()) error = InFlight(threads, pulls, pull, &pulls_per_s);
  if (!error.empty()) return error;
  if (measured) {
    system.pull_in_flight_mib_per_s.push_back(pulls_per_s * big.data().size() / double{1 << 20});
  }
  return "";
}

// `n` asynchronous calls, `window` of them in flight at once from this
// thread, `start` starting one; each call that ends starts the next. Their
// rate per second when `per_s` is given. Empty, or the first error.
std::string AsyncWindow(int window, int n, const std::function<void(const Blob&, Ended)>& start,
                        const Blob& req, double* per_s) {
  std::mutex mu;
  std::condition_variable all_ended;
  int started = 0;
  int ended_calls = 0;
  std::string first_error;
  const Ended on_end = [&](std::string error) {
    bool more;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!error.empty() && first_error.empty()) first_error = std::move(error);
      more = started < n && first_error.empty();
      if (more) ++started;
      if (++ended_calls == started) all_ended.notify_one();
    }
    if (more) start(req, on_end);
  };
  const absl::Time t0 = rdmarpc::SteadyNow();
  {
    std::lock_guard<std::mutex> lock(mu);
    started = std::min(window, n);
  }
  for (int i = 0; i < std::min(window, n); ++i) start(req, on_end);
  std::unique_lock<std::mutex> lock(mu);
  all_ended.wait(lock, [&] { return ended_calls == started; });
  if (!first_error.empty()) return first_error;
  if (per_s != nullptr) *per_s = n / absl::ToDoubleSeconds(rdmarpc::SteadyNow() - t0);
  return "";
}

// The system's small calls and pulls through its asynchronous API, `window`
// in flight at once: one block of each, after a block not counted.
std::string AsyncBlock(System& system, const Blob& big, int window, bool measured) {
  const Blob small = SmallRequest();
  double calls_per_s = 0;
  std::string error = AsyncWindow(window, kSettleCalls, system.ping_async, small, nullptr);
  if (error.empty()) {
    error = AsyncWindow(window, absl::GetFlag(FLAGS_calls), system.ping_async, small, &calls_per_s);
  }
  if (!error.empty()) return absl::StrCat(system.name, " asynchronous small call: ", error);
  if (measured) system.small_async_per_s.push_back(calls_per_s);
  const int pulls = absl::GetFlag(FLAGS_pulls);
  if (pulls == 0) return "";
  double pulls_per_s = 0;
  error = AsyncWindow(window, window, system.pull_async, big, nullptr);
  if (error.empty()) error = AsyncWindow(window, pulls, system.pull_async, big, &pulls_per_s);
  if (!error.empty()) return absl::StrCat(system.name, " asynchronous pull: ", error);
  if (measured) {
    system.pull_async_mib_per_s.push_back(pulls_per_s * big.data().size() / double{1 << 20});
  }
  return "";
}

// One round: a block of each system in turn. Round 0 warms up.
std::string Round(std::vector<std::unique_ptr<System>>& systems, const Blob& big, bool measured) {
  const int calls = absl::GetFlag(FLAGS_calls);
  const int pulls = absl::GetFlag(FLAGS_pulls);
  const int in_flight = absl::GetFlag(FLAGS_in_flight);
  for (auto& system : systems) {
    std::vector<double> block;
    std::string error = SmallCalls(*system, kSettleCalls, nullptr);
    if (error.empty()) error = SmallCalls(*system, calls, measured ? &block : nullptr);
    if (error.empty() && pulls > 0) {
      double rate = 0;
      error = Pulls(*system, big, kSettlePulls, nullptr);
      if (error.empty()) error = Pulls(*system, big, pulls, &rate);
      if (measured) system->pull_mib_per_s.push_back(rate);
    }
    if (error.empty() && in_flight > 1) error = InFlightBlock(*system, big, in_flight, measured);
    if (error.empty() && in_flight > 1) error = AsyncBlock(*system, big, in_flight, measured);
    if (!error.empty()) return error;
    if (!measured) continue;
    system->block_rtt_us.push_back(Median(block));
    system->rtt_us.insert(system->rtt_us.end(), block.begin(), block.end());
  }
  return "";
}

// The median over the rounds of a's figure over b's.
double MedianRatio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) ratios.push_back(a[i] / b[i]);
  return Median(ratios);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::string ip = absl::GetFlag(FLAGS_ip);
  if (ip.empty() && getenv("RDMARPC_TEST_ADDR") != nullptr) ip = getenv("RDMARPC_TEST_ADDR");
  if (ip.empty()) {
    fprintf(stderr, "set --ip or RDMARPC_TEST_ADDR (bench/run_bench.sh does)\n");
    return 2;
  }
  std::vector<std::unique_ptr<System>> systems;
  std::string error;
  const std::vector<std::string> names = absl::StrSplit(absl::GetFlag(FLAGS_systems), ',');
  for (const std::string& scheme : names) {
    if (scheme != "grpc" && scheme != "tcp" && scheme != "rdma") {
      fprintf(stderr, "--systems: grpc, tcp or rdma, not '%s'\n", scheme.c_str());
      return 2;
    }
    auto system = scheme == "grpc" ? StartGrpc(ip, &error) : StartRdmarpc(scheme, ip, &error);
    if (!system) {
      fprintf(stderr, "%s\n", error.c_str());
      return 1;
    }
    systems.push_back(std::move(system));
  }
  Blob big;
  big.set_data(std::string(kPullBytes, 'b'));
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int in_flight = absl::GetFlag(FLAGS_in_flight);
  if (in_flight > 1) printf("in_flight %d\n", in_flight);
  for (int round = 0; round <= rounds && error.empty(); ++round) {
    error = Round(systems, big, round > 0);
    if (round > 0) fprintf(stderr, "round %d of %d done\n", round, rounds);
  }
  if (!error.empty()) fprintf(stderr, "%s\n", error.c_str());
  for (const auto& system : systems) {
    printf("%s_small_rtt_p50_us %.2f\n", system->name.c_str(), Median(system->rtt_us));
    if (absl::GetFlag(FLAGS_pulls) > 0) {
      printf("%s_pull_1mib_mib_per_s %.1f\n", system->name.c_str(), Median(system->pull_mib_per_s));
    }
    if (in_flight > 1) {
      printf("%s_small_in_flight_calls_per_s %.0f\n", system->name.c_str(),
             Median(system->small_in_flight_per_s));
      printf("%s_small_async_calls_per_s %.0f\n", system->name.c_str(),
             Median(system->small_async_per_s));
      if (absl::GetFlag(FLAGS_pulls) > 0) {
        printf("%s_pull_in_flight_mib_per_s %.1f\n", system->name.c_str(),
               Median(system->pull_in_flight_mib_per_s));
        printf("%s_pull_async_mib_per_s %.1f\n", system->name.c_str(),
               Median(system->pull_async_mib_per_s));
      }
    }
  }
  const System& grpc_system = *systems[0];
  for (size_t i = 1; i < systems.size() && grpc_system.name == "grpc"; ++i) {
    const System& system = *systems[i];
    printf("%s_small_rtt_over_grpc %.3f\n", system.name.c_str(),
           MedianRatio(system.block_rtt_us, grpc_system.block_rtt_us));
    if (absl::GetFlag(FLAGS_pulls) > 0) {
      printf("%s_pull_over_grpc %.3f\n", system.name.c_str(),
             MedianRatio(system.pull_mib_per_s, grpc_system.pull_mib_per_s));
    }
    if (in_flight > 1) {
      printf("%s_small_in_flight_over_grpc %.3f\n", system.name.c_str(),
             MedianRatio(system.small_in_flight_per_s, grpc_system.small_in_flight_per_s));
      printf("%s_small_async_over_grpc %.3f\n", system.name.c_str(),
             MedianRatio(system.small_async_per_s, grpc_system.small_async_per_s));
      if (absl::GetFlag(FLAGS_pulls) > 0) {
        printf("%s_pull_in_flight_over_grpc %.3f\n", system.name.c_str(),
               MedianRatio(system.pull_in_flight_mib_per_s, grpc_system.pull_in_flight_mib_per_s));
        printf("%s_pull_async_over_grpc %.3f\n", system.name.c_str(),
               MedianRatio(system.pull_async_mib_per_s, grpc_system.pull_async_mib_per_s));
      }
    }
  }
  printf("grpc_bench_failed %d\n", error.empty() ? 0 : 1);
  printf("counters %s\n", rdmarpc::transport::rdma::Counters().ToString().c_str());
  for (auto& system : systems) system->stop();
  return error.empty() ? 0 : 1;
}
