// HealthService: the standard health service (proto/health.proto), which a
// Server hosts when its builder asks for it. Load balancers, orchestrators'
// probes and clients ask it whether the server, or one of its services, is
// serving.
//
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("rdma://0.0.0.0:7471")
//                     .RegisterService(&greeter)
//                     .EnableHealthService()
//                     .BuildAndStart();
//   rdmarpc::HealthService* health = (*server)->health();
//   health->SetServingStatus("demo.Greeter", false);  // e.g. its database is down
//   ...
//   health->Shutdown();   // to drain: probes see NOT_SERVING while calls still work
//   absl::SleepFor(absl::Seconds(5));                 // a probe period or two
//   (*server)->Shutdown();
//
// Asking, from code (the stub in proto/health.rdmarpc.pb.h):
//
//   auto stub = rdmarpc::health::v1::Health::NewStub(*channel);
//   rdmarpc::health::v1::HealthCheckRequest req;
//   req.set_service("demo.Greeter");                  // "" for the whole server
//   rdmarpc::health::v1::HealthCheckResponse resp;
//   rdmarpc::Status s = stub->Check(&ctx, req, &resp);  // resp.status(): SERVING, ...
//
// or from a shell: `rdmarpc_health_probe --address rdma://host:7471`
// (rpc/tools/health_probe.cc; exit 0 only when serving).
//
// What it answers, as gRPC's default health service does: "" (the server)
// and every registered service, by its full name ("demo.Greeter"), are
// SERVING from the start; a name it does not know is NOT_FOUND.
// SetServingStatus adds names. Server::Shutdown starts with Shutdown() and
// from then on answers every new call UNAVAILABLE, Check included: to let
// probes see NOT_SERVING while calls still work, call Shutdown() here first
// (above).
//
// What not to rely on: SERVING means the server answered Check and nobody
// said otherwise. It does not run the service's handlers; what they depend
// on is for the program to report through SetServingStatus.
#ifndef RDMARPC_RPC_HEALTH_H_
#define RDMARPC_RPC_HEALTH_H_

#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "proto/health.pb.h"
#include "rpc/service.h"

namespace rdmarpc {

class HealthService : public Service {
 public:
  using ServingStatus = health::v1::HealthCheckResponse::ServingStatus;

  // Knows "" (the server), SERVING.
  HealthService();

  // SERVING or NOT_SERVING from now on; adds `service` if it is new.
  // Ignored after Shutdown().
  void SetServingStatus(const std::string& service, bool serving);
  // The same for every name known, "" included.
  void SetServingStatus(bool serving);

  // Every name NOT_SERVING, for good: later SetServingStatus calls are
  // ignored, so that nothing reports SERVING while the server drains.
  void Shutdown();

  // What Check answers for `service`: its status, or NOT_FOUND.
  StatusOr<ServingStatus> Check(const std::string& service) const;

 private:
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, bool> serving_;  // name -> serving; mu_
  bool shut_down_ = false;                          // mu_
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_HEALTH_H_
