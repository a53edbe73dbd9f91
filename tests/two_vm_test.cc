// Client and server on two machines (two Soft-RoCE VMs on a virtual wire, run
// by tools/vm/run.sh --vms 2): the same binary runs in both, with
// RDMARPC_VM_ROLE telling it which side it is.
#include <atomic>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc {
namespace {

constexpr int kPort = 7471;
constexpr int kSmallCalls = 200;
constexpr int kLargeCalls = 4;
constexpr size_t kLarge = 3 << 20;

class CountingEcho : public examples::Echo::Service {
 public:
  Status Say(ServerContext*, const examples::EchoRequest* req,
             examples::EchoResponse* resp) override {
    resp->set_payload(req->payload());
    resp->set_server_calls(++calls);
    return Status();
  }
  std::atomic<uint64_t> calls{0};
};

void RunServer(const std::string& ip) {
  CountingEcho service;
  auto server = ServerBuilder()
                    .AddListeningPort("rdma://" + ip + ":" + std::to_string(kPort))
                    .RegisterService(&service)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  const absl::Time until = absl::Now() + absl::Seconds(240);
  while (service.calls.load() < kSmallCalls + kLargeCalls && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Seconds(2));  // let the last responses (and READs) finish
  (*server)->Shutdown(absl::Seconds(5));
  EXPECT_EQ(service.calls.load(), static_cast<uint64_t>(kSmallCalls + kLargeCalls));
  printf("server counters: %s\n", transport::rdma::Counters().ToString().c_str());
}

void RunClient(const std::string& peer) {
  auto channel = Channel::Create("rdma://" + peer + ":" + std::to_string(kPort));
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = examples::Echo::NewStub(*channel);
  examples::EchoRequest req;
  examples::EchoResponse resp;
  // The server VM may still be booting: retry until it answers.
  Status s;
  const absl::Time until = absl::Now() + absl::Seconds(120);
  do {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(10));
    req.set_payload("hello");
    s = stub->Say(&ctx, req, &resp);
    if (!s.ok()) absl::SleepFor(absl::Milliseconds(500));
  } while (!s.ok() && absl::Now() < until);
  ASSERT_TRUE(s.ok()) << "server never answered: " << s;
  for (int i = 1; i < kSmallCalls; ++i) {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    req.set_payload("small-" + std::to_string(i));
    ASSERT_TRUE(stub->Say(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.payload(), req.payload());
  }
  for (int i = 0; i < kLargeCalls; ++i) {
    std::string big(kLarge, '\0');
    for (size_t k = 0; k < big.size(); ++k) big[k] = static_cast<char>((k * 7 + i) & 0xff);
    req.set_payload(big);
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(60));
    Status st = stub->Say(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(resp.payload(), big) << "large payload " << i << " came back different";
  }
  const auto& c = transport::rdma::Counters();
  printf("client counters: %s\n", c.ToString().c_str());
  EXPECT_GE(c.reads.load(), static_cast<uint64_t>(kLargeCalls)) << "large responses go by READ";
}

TEST(TwoVms, EchoAcrossTheWire) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  const std::string role = rdma::testing::Role();
  if (role == "server") {
    RunServer(ip);
  } else {
    ASSERT_EQ(role, "client") << "run under tools/vm/run.sh --vms 2 (make test does)";
    RunClient(rdma::testing::PeerAddress());
  }
}

}  // namespace
}  // namespace rdmarpc
