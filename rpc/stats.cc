#include "rpc/stats.h"

#include "rpc/internal/proto_method_name.h"
#include "rpc/server.h"
#include "transport/rdma/counters.h"
#include "transport/tcp/tcp_counters.h"

namespace rdmarpc {

using stats::v1::StatsRequest;
using stats::v1::StatsResponse;

StatsService::StatsService(const Server* server) : server_(server) {
  auto get = [this](ServerContext*, const StatsRequest*, StatsResponse* resp, DoneCallback done) {
    *resp = Snapshot();
    std::move(done)(Status());
  };
  AddMethod(internal::ProtoMethodName(*StatsRequest::descriptor()->file(), "Stats", "Get"),
            UnaryHandler<StatsRequest, StatsResponse>(get));
}

StatsResponse StatsService::Snapshot() const {
  StatsResponse resp;
  for (const auto& [name, value] : transport::rdma::Counters().Named()) {
    (*resp.mutable_rdma())[name] = value;
  }
  for (const auto& [name, value] : transport::tcp::Counters().Named()) {
    (*resp.mutable_tcp())[name] = value;
  }
  const transport::rdma::DeviceRnrNaks naks = transport::rdma::ReadDeviceRnrNaks();
  resp.set_device_rnr_naks_received(naks.received);
  resp.set_device_rnr_naks_sent(naks.sent);
  for (const std::string& device : transport::rdma::DevicesInUse()) resp.add_rdma_devices(device);
  for (const auto& [method, calls] : server_->MethodCallCounts()) {
    (*resp.mutable_method_calls())[method] = calls;
  }
  const Server::Stats calls = server_->stats();
  resp.set_calls_in_flight(calls.calls_in_flight);
  resp.set_refused_over_limit(calls.refused_over_limit);
  resp.set_refused_over_connection_limit(calls.refused_over_connection_limit);
  if (const auto& quota = server_->memory_quota()) {
    resp.set_memory_quota(quota->name());
    resp.set_memory_quota_bound(quota->bound());
    resp.set_memory_quota_used(quota->used());
  }
  return resp;
}

}  // namespace rdmarpc
