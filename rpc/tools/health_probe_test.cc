// rdmarpc_health_probe against servers in this process (over tcp://: the
// probe is a client like any other, and the health service's own tests run
// over every transport in tests/rpc_suite.cc): its exit status and what it
// prints for a serving server, a service marked not serving, a name the
// server does not know, a server without the health service, an address
// nobody listens on, and bad arguments.
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/server.h"

namespace rdmarpc {
namespace {

std::string probe_path;  // argv[1]

struct Outcome {
  int exit_status = -1;
  std::string output;  // stdout and stderr
};

Outcome RunProbe(const std::string& args) {
  Outcome o;
  FILE* p = popen((probe_path + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return o;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) o.output.append(buf, n);
  const int w = pclose(p);
  o.exit_status = WIFEXITED(w) ? WEXITSTATUS(w) : -1;
  return o;
}

std::unique_ptr<Server> StartServer(Service* service, bool health) {
  ServerBuilder b;
  b.AddListeningPort("tcp://127.0.0.1:0").RegisterService(service);
  if (health) b.EnableHealthService();
  auto built = b.BuildAndStart();
  EXPECT_TRUE(built.ok()) << built.status();
  return built.ok() ? std::move(*built) : nullptr;
}

TEST(HealthProbe, ExitStatusSaysServingNotServingOrWhyNoAnswer) {
  examples::Echo::Service echo;
  std::unique_ptr<Server> server = StartServer(&echo, true);
  ASSERT_NE(server, nullptr);
  const std::string address = server->addresses()[0];

  Outcome o = RunProbe("--address " + address);
  EXPECT_EQ(o.exit_status, 0) << o.output;
  EXPECT_EQ(o.output, address + ": SERVING\n");

  server->health()->SetServingStatus("rdmarpc.examples.Echo", false);
  o = RunProbe("--address " + address + " --service rdmarpc.examples.Echo");
  EXPECT_EQ(o.exit_status, 1) << o.output;
  EXPECT_EQ(o.output, address + " service \"rdmarpc.examples.Echo\": NOT_SERVING\n");

  o = RunProbe("--address " + address + " --service no.Such");
  EXPECT_EQ(o.exit_status, 2) << o.output;
  EXPECT_NE(o.output.find("NOT_FOUND: health: no service \"no.Such\""), std::string::npos)
      << o.output;

  std::unique_ptr<Server> plain = StartServer(&echo, false);
  ASSERT_NE(plain, nullptr);
  o = RunProbe("--address " + plain->addresses()[0]);
  EXPECT_EQ(o.exit_status, 2) << o.output;
  EXPECT_NE(o.output.find("UNIMPLEMENTED"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("ServerBuilder::EnableHealthService()"), std::string::npos) << o.output;

  server->Shutdown();
  server.reset();  // nothing listens on `address` any more
  o = RunProbe("--address " + address + " --timeout_ms 3000");
  EXPECT_EQ(o.exit_status, 2) << o.output;
  EXPECT_NE(o.output.find("UNAVAILABLE"), std::string::npos) << o.output;

  o = RunProbe("--service x");
  EXPECT_EQ(o.exit_status, 3) << o.output;
  EXPECT_NE(o.output.find("usage:"), std::string::npos) << o.output;
  o = RunProbe("--address nonsense");
  EXPECT_EQ(o.exit_status, 3) << o.output;
}

}  // namespace
}  // namespace rdmarpc

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc != 2) {
    fprintf(stderr, "usage: %s PATH_OF_rdmarpc_health_probe\n", argv[0]);
    return 2;
  }
  rdmarpc::probe_path = argv[1];
  return RUN_ALL_TESTS();
}
