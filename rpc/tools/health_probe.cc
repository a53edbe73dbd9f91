// rdmarpc_health_probe: asks a server's health service (rpc/health.h)
// whether it, or one of its services, is serving. For orchestrators'
// liveness and readiness checks, load balancers' scripts and people.
//
//   rdmarpc_health_probe --address rdma://10.0.0.7:7471
//   rdmarpc_health_probe --address tcp://db1:7471 --service demo.Greeter --timeout_ms 500
//
// Exit status: 0 SERVING; 1 the server answered, not SERVING; 2 no answer
// (the status says why: unreachable, timed out, a service the server does
// not know, a server without the health service); 3 bad arguments.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "proto/health.rdmarpc.pb.h"
#include "rpc/tools/call_once.h"
#include "rpc/tools/server_flags.h"

ABSL_FLAG(std::string, service, "",
          "a service's full name (e.g. demo.Greeter); empty asks about the whole server");

namespace {

using rdmarpc::health::v1::HealthCheckRequest;
using rdmarpc::health::v1::HealthCheckResponse;

int Probe(const std::string& address, const std::string& service, int timeout_ms) {
  const std::string what = service.empty() ? address : address + " service \"" + service + "\"";
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const int rc = rdmarpc::tools::CallOnce(
      "rdmarpc_health_probe", address, what, timeout_ms, "health", "EnableHealthService",
      [&](std::shared_ptr<rdmarpc::Channel> channel, rdmarpc::ClientContext* ctx) {
        return rdmarpc::health::v1::Health::NewStub(channel)->Check(ctx, request, &response);
      });
  if (rc != 0) return rc;
  printf("%s: %s\n", what.c_str(),
         HealthCheckResponse::ServingStatus_Name(response.status()).c_str());
  return response.status() == HealthCheckResponse::SERVING ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = rdmarpc::tools::ParseServerFlags(
      argc, argv,
      "rdmarpc_health_probe --address rdma://host:port [--service NAME] [--timeout_ms N > 0]");
  if (!flags) return rdmarpc::tools::kBadArguments;
  return Probe(flags->address, absl::GetFlag(FLAGS_service), flags->timeout_ms);
}
