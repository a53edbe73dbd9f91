// rdmarpc_stats: asks a server's stats service (rpc/stats.h) what its
// process counted and prints it, a line each, "section name value", sorted
// within each section, so that scripts can grep it and people can diff two
// runs:
//
//   rdmarpc_stats --address rdma://10.0.0.7:7471
//   rdma sends 40210
//   rdma srq_slots_consumed 40188
//   ...
//   tcp frames_received 0
//   ...
//   device rnr_naks_received 0
//   device rnr_naks_sent n/a
//   rdma_device rxe0
//   method_calls /demo.Greeter/Hello 20104
//   server calls_in_flight 0
//   server refused_over_limit 0
//   server refused_over_connection_limit 0
//   memory_quota name frontend
//   memory_quota bound 2147483648
//   memory_quota used 14680064
//
// The memory_quota lines come only from a server given one
// (TransportTunables::memory_quota).
//
// Exit status: 0 answered; 2 no answer (the status says why: unreachable,
// timed out, a server without the stats service); 3 bad arguments.
#include <cstdio>
#include <map>
#include <string>

#include "proto/stats.rdmarpc.pb.h"
#include "rpc/tools/call_once.h"
#include "rpc/tools/server_flags.h"

namespace {

using rdmarpc::stats::v1::StatsRequest;
using rdmarpc::stats::v1::StatsResponse;

template <typename Map>
void PrintSorted(const char* section, const Map& values) {
  for (const auto& [name, value] : std::map<std::string, uint64_t>(values.begin(), values.end())) {
    printf("%s %s %llu\n", section, name.c_str(), static_cast<unsigned long long>(value));
  }
}

void PrintNaks(const char* name, int64_t value) {
  if (value < 0) {
    printf("device %s n/a\n", name);
  } else {
    printf("device %s %lld\n", name, static_cast<long long>(value));
  }
}

int Ask(const std::string& address, int timeout_ms) {
  StatsResponse r;
  const int rc = rdmarpc::tools::CallOnce(
      "rdmarpc_stats", address, address, timeout_ms, "stats", "EnableStatsService",
      [&](std::shared_ptr<rdmarpc::Channel> channel, rdmarpc::ClientContext* ctx) {
        return rdmarpc::stats::v1::Stats::NewStub(channel)->Get(ctx, StatsRequest(), &r);
      });
  if (rc != 0) return rc;
  PrintSorted("rdma", r.rdma());
  PrintSorted("tcp", r.tcp());
  PrintNaks("rnr_naks_received", r.device_rnr_naks_received());
  PrintNaks("rnr_naks_sent", r.device_rnr_naks_sent());
  for (const std::string& device : r.rdma_devices()) printf("rdma_device %s\n", device.c_str());
  PrintSorted("method_calls", r.method_calls());
  printf("server calls_in_flight %llu\n", static_cast<unsigned long long>(r.calls_in_flight()));
  printf("server refused_over_limit %llu\n",
         static_cast<unsigned long long>(r.refused_over_limit()));
  printf("server refused_over_connection_limit %llu\n",
         static_cast<unsigned long long>(r.refused_over_connection_limit()));
  if (!r.memory_quota().empty() || r.memory_quota_bound() != 0) {
    printf("memory_quota name %s\n", r.memory_quota().c_str());
    printf("memory_quota bound %llu\n", static_cast<unsigned long long>(r.memory_quota_bound()));
    printf("memory_quota used %llu\n", static_cast<unsigned long long>(r.memory_quota_used()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = rdmarpc::tools::ParseServerFlags(
      argc, argv, "rdmarpc_stats --address rdma://host:port [--timeout_ms N > 0]");
  if (!flags) return rdmarpc::tools::kBadArguments;
  return Ask(flags->address, flags->timeout_ms);
}
