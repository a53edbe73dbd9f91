// ReflectionService: the reflection service (proto/reflection.proto), which
// a Server hosts when its builder asks for it. It answers which services the
// server hosts and their .proto descriptions, so that a tool can list the
// methods and call any of them with a request written as text:
//
//   auto server = rdmarpc::ServerBuilder()
//                     .AddListeningPort("rdma://0.0.0.0:7471")
//                     .RegisterService(&greeter)
//                     .EnableReflectionService()
//                     .BuildAndStart();
//
//   $ rdmarpc_call --address rdma://host:7471
//   demo.Greeter
//     rpc Hello(demo.HelloRequest) returns (demo.HelloReply)
//   $ rdmarpc_call --address rdma://host:7471 --method /demo.Greeter/Hello
//         --request 'name: "world"'        (one command line)
//   text: "hello world"
//
// (rpc/tools/call.cc). The descriptions come from the services themselves:
// generated code carries its .proto files (Service::proto_files). A Service
// written by hand is looked up by name in protobuf's generated pool (the
// runtime's own are found there), and listed as undescribed where it is not.
//
// What not to rely on: it describes every message of those files, not only
// the ones the methods use, and anyone who can call the server can read
// them: enable it where that is acceptable, as for the stats service.
#ifndef RDMARPC_RPC_REFLECTION_H_
#define RDMARPC_RPC_REFLECTION_H_

#include <vector>

#include "proto/reflection.pb.h"
#include "rpc/service.h"

namespace rdmarpc {

class ReflectionService : public Service {
 public:
  // Describes `services` and itself; the answer is made here, once, as the
  // services a server hosts are fixed when it is built.
  explicit ReflectionService(const std::vector<const Service*>& services);

  const reflection::v1::DescribeResponse& description() const { return description_; }

 private:
  reflection::v1::DescribeResponse description_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_REFLECTION_H_
