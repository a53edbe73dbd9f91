// rdmarpc_health_probe against servers in this process, over tcp:// on the
// host (//rpc:health_probe_test) and over rdma:// in the Soft-RoCE VM
// (//rpc:health_probe_rdma_test): its exit status and what it prints for a
// serving server, a service marked not serving, a name the server does not
// know, a server without the health service, an address nobody listens on,
// and bad arguments.
//
//   health_probe_test PATH_OF_rdmarpc_health_probe tcp|rdma
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/server.h"

namespace rdmarpc {
namespace {

std::string probe_path;  // argv[1]
std::string listen_at;   // from argv[2]: where the test servers listen

struct Outcome {
  int exit_status = -1;
  std::string out;
  std::string err;
};

std::string ReadAll(FILE* f) {
  std::string all;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) all.append(buf, n);
  return all;
}

Outcome RunProbe(const std::string& args) {
  Outcome o;
  const std::string err_path = ::testing::TempDir() + "/probe_stderr";
  FILE* p = popen((probe_path + " " + args + " 2>" + err_path).c_str(), "r");
  if (p == nullptr) return o;
  o.out = ReadAll(p);
  const int w = pclose(p);
  o.exit_status = WIFEXITED(w) ? WEXITSTATUS(w) : -1;
  if (FILE* e = fopen(err_path.c_str(), "r")) {
    o.err = ReadAll(e);
    fclose(e);
  }
  return o;
}

std::unique_ptr<Server> StartServer(Service* service, bool health) {
  ServerBuilder b;
  b.AddListeningPort(listen_at).RegisterService(service);
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
  EXPECT_EQ(o.exit_status, 0) << o.out << o.err;
  EXPECT_EQ(o.out, address + ": SERVING\n") << o.err;
  if (listen_at.rfind("rdma://", 0) == 0) {
    // The probe's transport names the device it took, as every RDMA client's does.
    EXPECT_NE(o.err.find("]: RDMA device "), std::string::npos) << o.err;
  }

  server->health()->SetServingStatus("rdmarpc.examples.Echo", false);
  o = RunProbe("--address " + address + " --service rdmarpc.examples.Echo");
  EXPECT_EQ(o.exit_status, 1) << o.out << o.err;
  EXPECT_EQ(o.out, address + " service \"rdmarpc.examples.Echo\": NOT_SERVING\n") << o.err;

  o = RunProbe("--address " + address + " --service no.Such");
  EXPECT_EQ(o.exit_status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("NOT_FOUND: health: no service \"no.Such\""), std::string::npos) << o.err;

  std::unique_ptr<Server> plain = StartServer(&echo, false);
  ASSERT_NE(plain, nullptr);
  o = RunProbe("--address " + plain->addresses()[0]);
  EXPECT_EQ(o.exit_status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("UNIMPLEMENTED"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("ServerBuilder::EnableHealthService()"), std::string::npos) << o.err;

  server->Shutdown();
  server.reset();  // nothing listens on `address` any more
  o = RunProbe("--address " + address + " --timeout_ms 3000");
  EXPECT_EQ(o.exit_status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("UNAVAILABLE"), std::string::npos) << o.err;

  o = RunProbe("--service x");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("usage:"), std::string::npos) << o.err;
  o = RunProbe("--address nonsense");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
}

}  // namespace
}  // namespace rdmarpc

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string scheme = argc == 3 ? argv[2] : "";
  if (scheme != "tcp" && scheme != "rdma") {
    fprintf(stderr, "usage: %s PATH_OF_rdmarpc_health_probe tcp|rdma\n", argv[0]);
    return 2;
  }
  rdmarpc::probe_path = argv[1];
  if (scheme == "tcp") {
    rdmarpc::listen_at = "tcp://127.0.0.1:0";
  } else {
    // Set by tools/vm/run.sh, which `make test` runs the rdma tests under.
    const char* ip = getenv("RDMARPC_TEST_ADDR");
    if (ip == nullptr || *ip == '\0') {
      fprintf(stderr, "FAIL: no RDMA address (RDMARPC_TEST_ADDR): run it with make test\n");
      return 1;
    }
    rdmarpc::listen_at = std::string("rdma://") + ip + ":0";
  }
  return RUN_ALL_TESTS();
}
