// StatsService: the stats service (proto/stats.proto), which a Server hosts
// when its builder asks for it. It answers what the process has counted
// (the transports' counters, the RDMA devices in use) and what this server
// has (its calls per method, in flight and refused), so that an operator or
// a bug report can tell how calls went (by SEND into the SRQ, by READ, over
// TCP) and what was refused, from outside the process.
//
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("rdma://0.0.0.0:7471")
//                     .RegisterService(&greeter)
//                     .EnableStatsService()
//                     .BuildAndStart();
//
// Asking, from code (the stub in proto/stats.rdmarpc.pb.h):
//
//   auto stub = rdmarpc::stats::v1::Stats::NewStub(*channel);
//   rdmarpc::stats::v1::StatsResponse resp;
//   rdmarpc::Status s = stub->Get(&ctx, rdmarpc::stats::v1::StatsRequest(), &resp);
//   uint64_t reads = resp.rdma().at("reads");
//
// or from a shell: `rdmarpc_stats --address rdma://host:7471`
// (rpc/tools/stats.cc).
//
// What not to rely on: the transport counters are the process's, not the
// server's (a process that also makes calls counts them in the same ones),
// and a snapshot: counts made on other threads while it is taken may be in
// it or not. Counter names are the fields' of RdmaCounters and TcpCounters,
// which may gain fields. Anyone who can call the server can read them:
// enable it where that is acceptable.
#ifndef RDMARPC_RPC_STATS_H_
#define RDMARPC_RPC_STATS_H_

#include "proto/stats.pb.h"
#include "rpc/service.h"

namespace rdmarpc {

class Server;

class StatsService : public Service {
 public:
  // Answers for `server`, which must outlive it (the server owns it).
  explicit StatsService(const Server* server);

  // What Get answers now.
  stats::v1::StatsResponse Snapshot() const;

 private:
  const Server* const server_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_STATS_H_
