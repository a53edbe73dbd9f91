// A user's program, built in a workspace of its own against @rdmarpc: a
// Greeter server and a client in one process. Exits 0 when the answer came
// back right.
//
//   greeter [address]   (default tcp://127.0.0.1:0; rdma://... over RDMA)
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "greeter.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"

namespace {

class GreeterImpl : public greeter::Greeter::Service {
 public:
  rdmarpc::Status Hello(rdmarpc::ServerContext*, const greeter::HelloRequest* req,
                        greeter::HelloReply* reply) override {
    reply->set_text("hello, " + req->name());
    return rdmarpc::Status();
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::string address = argc > 1 ? argv[1] : "tcp://127.0.0.1:0";
  GreeterImpl service;
  auto server =
      rdmarpc::ServerBuilder().AddListeningPort(address).RegisterService(&service).BuildAndStart();
  if (!server.ok()) {
    fprintf(stderr, "greeter: cannot serve on %s: %s\n", address.c_str(),
            server.status().ToString().c_str());
    return 1;
  }
  auto channel = rdmarpc::Channel::Create((*server)->addresses()[0]);
  if (!channel.ok()) {
    fprintf(stderr, "greeter: %s\n", channel.status().ToString().c_str());
    return 1;
  }
  auto stub = greeter::Greeter::NewStub(*channel);
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(absl::Seconds(10));
  greeter::HelloRequest req;
  req.set_name("consumer");
  greeter::HelloReply reply;
  const rdmarpc::Status s = stub->Hello(&ctx, req, &reply);
  if (!s.ok() || reply.text() != "hello, consumer") {
    fprintf(stderr, "greeter: call to %s: %s, reply \"%s\"\n", (*server)->addresses()[0].c_str(),
            s.ToString().c_str(), reply.text().c_str());
    return 1;
  }
  printf("greeter: %s answered \"%s\"\n", (*server)->addresses()[0].c_str(), reply.text().c_str());
  return 0;
}
