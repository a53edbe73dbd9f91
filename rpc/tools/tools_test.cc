// The command-line tools against servers in this process, over tcp:// on the
// host (//rpc:tools_test) and over rdma:// in the Soft-RoCE VM
// (//rpc:tools_rdma_test).
// rdmarpc_health_probe: its exit status and what it prints for a serving
// server, a service marked not serving, a name the server does not know, a
// server without the health service, an address nobody listens on, and bad
// arguments.
// rdmarpc_stats: the counters it prints against the process's own, the
// server's calls per method, the memory quota of a server given one, a
// server without the stats service, and bad arguments.
// rdmarpc_call: the methods it lists, calls made from text and their
// answers, metadata both ways, a call that fails (and its error details), a
// method the server does not have, a request that does not parse, a server
// without the reflection service, and bad arguments.
//
//   tools_test PATH_OF_rdmarpc_health_probe PATH_OF_rdmarpc_stats PATH_OF_rdmarpc_call tcp|rdma
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/echo.rdmarpc.pb.h"
#include "rpc/channel.h"
#include "rpc/retry_info.h"
#include "rpc/server.h"
#include "transport/factory.h"
#include "transport/memory_quota.h"
#include "transport/rdma/counters.h"
#include "transport/tcp/tcp_counters.h"

namespace rdmarpc {
namespace {

std::string probe_path;  // argv[1]
std::string stats_path;  // argv[2]
std::string call_path;   // argv[3]
std::string listen_at;   // from argv[4]: where the test servers listen

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

// Runs the tool at `path` with `args`.
Outcome RunTool(const std::string& path, const std::string& args) {
  Outcome o;
  const std::string err_path = ::testing::TempDir() + "/tool_stderr";
  FILE* p = popen((path + " " + args + " 2>" + err_path).c_str(), "r");
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

Outcome RunProbe(const std::string& args) { return RunTool(probe_path, args); }

std::unique_ptr<Server> StartServer(Service* service, bool health, bool stats = false,
                                    std::shared_ptr<transport::MemoryQuota> quota = nullptr) {
  ServerBuilder b;
  b.AddListeningPort(listen_at).RegisterService(service);
  transport::TransportTunables tunables;
  tunables.memory_quota = std::move(quota);
  b.SetTransportTunables(tunables);
  if (health) b.EnableHealthService();
  if (stats) b.EnableStatsService();
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

// "section name" -> value, from rdmarpc_stats's lines.
std::map<std::string, std::string> StatsLines(const std::string& out) {
  std::map<std::string, std::string> lines;
  for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    const size_t last = line.rfind(' ');
    if (last == absl::string_view::npos) continue;
    lines[std::string(line.substr(0, last))] = std::string(line.substr(last + 1));
  }
  return lines;
}

// Every counter of `named`, as rdmarpc_stats printed it in `section`, lies
// between its values before and after the tool ran; a gauge, which may move
// either way meanwhile (registered_bytes), is only looked for.
void ExpectPrintedWithin(const std::map<std::string, std::string>& printed, const char* section,
                         const std::vector<std::pair<std::string, uint64_t>>& before,
                         const std::vector<std::pair<std::string, uint64_t>>& after) {
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    const std::string key = std::string(section) + " " + before[i].first;
    auto it = printed.find(key);
    ASSERT_NE(it, printed.end()) << "no line for " << key;
    uint64_t value = 0;
    ASSERT_TRUE(absl::SimpleAtoi(it->second, &value)) << key << " " << it->second;
    if (before[i].first == "registered_bytes") continue;
    EXPECT_GE(value, before[i].second) << key;
    EXPECT_LE(value, after[i].second) << key;
  }
}

TEST(Stats, PrintsTheProcessCountersAndTheServersCallsPerMethod) {
  examples::Echo::Service echo;  // answers UNIMPLEMENTED, and counts the calls
  std::unique_ptr<Server> server = StartServer(&echo, false, /*stats=*/true);
  ASSERT_NE(server, nullptr);
  const std::string address = server->addresses()[0];
  auto channel = Channel::Create(address);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto stub = examples::Echo::NewStub(*channel);
  constexpr int kCalls = 5;
  for (int i = 0; i < kCalls; ++i) {
    ClientContext ctx;
    examples::EchoRequest req;
    examples::EchoResponse resp;
    EXPECT_EQ(stub->Say(&ctx, req, &resp).code(), StatusCode::kUnimplemented);
  }

  const auto rdma_before = transport::rdma::Counters();
  const auto tcp_before = transport::tcp::Counters();
  Outcome o = RunTool(stats_path, "--address " + address);
  const auto rdma_after = transport::rdma::Counters();
  const auto tcp_after = transport::tcp::Counters();
  ASSERT_EQ(o.exit_status, 0) << o.out << o.err;
  const std::map<std::string, std::string> printed = StatsLines(o.out);
  ExpectPrintedWithin(printed, "rdma", rdma_before.Named(), rdma_after.Named());
  ExpectPrintedWithin(printed, "tcp", tcp_before.Named(), tcp_after.Named());
  EXPECT_EQ(printed.count("method_calls /rdmarpc.examples.Echo/Say"), 1u) << o.out;
  EXPECT_EQ(printed.at("method_calls /rdmarpc.examples.Echo/Say"), std::to_string(kCalls));
  EXPECT_EQ(printed.count("method_calls /rdmarpc.stats.v1.Stats/Get"), 1u) << o.out;
  EXPECT_EQ(printed.count("server calls_in_flight"), 1u) << o.out;
  EXPECT_EQ(printed.count("server refused_over_limit"), 1u) << o.out;
  EXPECT_EQ(printed.count("device rnr_naks_received"), 1u) << o.out;
  EXPECT_EQ(printed.count("memory_quota name"), 0u) << "a server without a quota: " << o.out;
  if (listen_at.rfind("rdma://", 0) == 0) {
    // The calls went by SEND into the SRQ, and the device is named.
    EXPECT_GE(rdma_before.sends, 2u * kCalls);
    EXPECT_GE(rdma_before.srq_slots_consumed, 2u * kCalls);
    EXPECT_NE(o.out.find("\nrdma_device "), std::string::npos) << o.out;
  } else {
    EXPECT_GE(tcp_before.frames_received, 2u * kCalls);
  }

  // A server given a memory quota says how much of it is reserved: over
  // RDMA the block its 1 MiB request was READ into stays, idle.
  auto quota = transport::MemoryQuota::Create("tools", 64u << 20);
  std::unique_ptr<Server> bounded = StartServer(&echo, false, /*stats=*/true, quota);
  ASSERT_NE(bounded, nullptr);
  {
    auto to_bounded = Channel::Create(bounded->addresses()[0]);
    ASSERT_TRUE(to_bounded.ok()) << to_bounded.status();
    ClientContext ctx;
    examples::EchoRequest req;
    req.set_payload(std::string(1 << 20, 'q'));
    examples::EchoResponse resp;
    EXPECT_EQ(examples::Echo::NewStub(*to_bounded)->Say(&ctx, req, &resp).code(),
              StatusCode::kUnimplemented);
  }
  o = RunTool(stats_path, "--address " + bounded->addresses()[0]);
  ASSERT_EQ(o.exit_status, 0) << o.out << o.err;
  const std::map<std::string, std::string> with_quota = StatsLines(o.out);
  EXPECT_EQ(with_quota.count("memory_quota name"), 1u) << o.out;
  EXPECT_EQ(with_quota.at("memory_quota name"), "tools");
  EXPECT_EQ(with_quota.at("memory_quota bound"), std::to_string(64u << 20));
  EXPECT_EQ(with_quota.at("memory_quota used"), std::to_string(quota->used()));
  if (listen_at.rfind("rdma://", 0) == 0) {
    EXPECT_GT(quota->used(), 1u << 20);
  }
  bounded.reset();
  EXPECT_EQ(quota->used(), 0u) << "the server's transport left memory reserved";

  std::unique_ptr<Server> plain = StartServer(&echo, false);
  ASSERT_NE(plain, nullptr);
  o = RunTool(stats_path, "--address " + plain->addresses()[0]);
  EXPECT_EQ(o.exit_status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("ServerBuilder::EnableStatsService()"), std::string::npos) << o.err;
  o = RunTool(stats_path, "");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("usage:"), std::string::npos) << o.err;
}

// Echoes the payload and the metadata, and numbers the calls; fails with
// error details when asked to.
class NumberingEcho : public examples::Echo::Service {
 public:
  Status Say(ServerContext* ctx, const examples::EchoRequest* req,
             examples::EchoResponse* resp) override {
    for (const auto& [key, value] : ctx->client_metadata()) {
      ctx->AddResponseMetadata("echo-" + key, value);
    }
    if (req->payload() == "fail") {
      Status busy(StatusCode::kUnavailable, "busy");
      busy.SetPayload("example.com/Detail", absl::Cord("try the other region"));
      examples::EchoResponse elsewhere;
      elsewhere.set_payload("elsewhere");
      elsewhere.set_server_calls(7);
      busy.SetPayload("type.googleapis.com/rdmarpc.examples.EchoResponse",
                      absl::Cord(elsewhere.SerializeAsString()));
      busy.SetPayload("type.googleapis.com/rdmarpc.examples.EchoRequest",
                      absl::Cord("\xff\xff\xff"));
      SetRetryDelay(&busy, absl::Milliseconds(200));
      return busy;
    }
    if (req->payload() == "refuse") {
      Status full(StatusCode::kResourceExhausted, "full");
      SetRetryDelay(&full, kDoNotRetry);
      return full;
    }
    resp->set_payload(req->payload());
    resp->set_server_calls(++calls_);
    return Status();
  }

 private:
  std::atomic<uint64_t> calls_{0};
};

// A service no .proto declares.
class HandWritten : public Service {
 public:
  HandWritten() {
    AddMethod("/rdmarpc.testing.HandWritten/Do",
              UnaryHandler<examples::EchoRequest, examples::EchoResponse>(
                  [](ServerContext*, const examples::EchoRequest*, examples::EchoResponse*,
                     DoneCallback done) { std::move(done)(Status()); }));
  }
};

TEST(Call, ListsTheServersMethodsAndCallsThemFromText) {
  NumberingEcho echo;
  HandWritten hand_written;
  auto built = ServerBuilder()
                   .AddListeningPort(listen_at)
                   .RegisterService(&echo)
                   .RegisterService(&hand_written)
                   .EnableHealthService()
                   .EnableReflectionService()
                   .BuildAndStart();
  ASSERT_TRUE(built.ok()) << built.status();
  std::unique_ptr<Server> server = std::move(*built);
  const std::string address = server->addresses()[0];
  const std::string at = "--address " + address + " ";

  Outcome o = RunTool(call_path, at);
  EXPECT_EQ(o.exit_status, 0) << o.out << o.err;
  EXPECT_EQ(o.out,
            "rdmarpc.examples.Echo\n"
            "  rpc Say(rdmarpc.examples.EchoRequest) returns (rdmarpc.examples.EchoResponse)\n"
            "rdmarpc.health.v1.Health\n"
            "  rpc Check(rdmarpc.health.v1.HealthCheckRequest) returns "
            "(rdmarpc.health.v1.HealthCheckResponse)\n"
            "rdmarpc.reflection.v1.Reflection\n"
            "  rpc Describe(rdmarpc.reflection.v1.DescribeRequest) returns "
            "(rdmarpc.reflection.v1.DescribeResponse)\n"
            "rdmarpc.testing.HandWritten (undescribed: the server's binary has no .proto "
            "description of it)\n")
      << o.err;

  o = RunTool(call_path,
              at + "--method /rdmarpc.examples.Echo/Say --request 'payload: \"hi there\"'");
  EXPECT_EQ(o.exit_status, 0) << o.out << o.err;
  EXPECT_EQ(o.out, "payload: \"hi there\"\nserver_calls: 1\n") << o.err;
  // The other spellings of a method; an empty request is all defaults.
  o = RunTool(call_path, at + "--method rdmarpc.examples.Echo.Say");
  EXPECT_EQ(o.exit_status, 0) << o.out << o.err;
  EXPECT_EQ(o.out, "server_calls: 2\n") << o.err;
  o = RunTool(call_path, at + "--method rdmarpc.examples.Echo/Say --request 'payload: \"x\"' "
                              "--metadata request-id=42,tenant=a=b");
  EXPECT_EQ(o.out, "payload: \"x\"\nserver_calls: 3\n") << o.err;
  EXPECT_NE(o.err.find("rdmarpc_call: server metadata: echo-request-id: 42\n"), std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("rdmarpc_call: server metadata: echo-tenant: a=b\n"), std::string::npos)
      << o.err;
  EXPECT_EQ(server->MethodCallCounts().at("/rdmarpc.examples.Echo/Say"), 3u);

  // A built-in service, and a call that ends with an error: exit 1.
  o = RunTool(call_path, at + "--method /rdmarpc.health.v1.Health/Check --request 'service: \"\"'");
  EXPECT_EQ(o.exit_status, 0) << o.out << o.err;
  EXPECT_EQ(o.out, "status: SERVING\n") << o.err;
  o = RunTool(call_path,
              at + "--method /rdmarpc.health.v1.Health/Check --request 'service: \"no.Such\"'");
  EXPECT_EQ(o.exit_status, 1) << o.out << o.err;
  EXPECT_NE(o.err.find("/rdmarpc.health.v1.Health/Check: NOT_FOUND"), std::string::npos) << o.err;

  o = RunTool(call_path, at + "--method /rdmarpc.examples.Echo/Shout");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("describes no method /rdmarpc.examples.Echo/Shout"), std::string::npos)
      << o.err;
  o = RunTool(call_path, at + "--method /rdmarpc.examples.Echo/Say --request 'volume: 11'");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("--request is not a rdmarpc.examples.EchoRequest in text format: 1:"),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("volume"), std::string::npos) << o.err;
  o = RunTool(call_path, at + "--method /rdmarpc.examples.Echo/Say --metadata tenant");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("--metadata tenant is not key=value"), std::string::npos) << o.err;
  o = RunTool(call_path, at + "--method /rdmarpc.examples.Echo/Say --metadata Bad=1");
  EXPECT_EQ(o.exit_status, 1) << o.out << o.err;
  EXPECT_NE(o.err.find("INVALID_ARGUMENT"), std::string::npos) << o.err;
  EXPECT_EQ(server->MethodCallCounts().at("/rdmarpc.examples.Echo/Say"), 3u)
      << "a refused request was sent";

  // An error's details (status payloads) are printed with it.
  o = RunTool(call_path, at + "--method /rdmarpc.examples.Echo/Say --request 'payload: \"fail\"'");
  EXPECT_EQ(o.exit_status, 1) << o.out << o.err;
  // In no set order: Status::ForEachPayload, which sends them, visits them
  // in an order absl leaves unspecified, and which varies between runs.
  EXPECT_NE(o.err.find("rdmarpc_call: /rdmarpc.examples.Echo/Say: UNAVAILABLE: busy ["),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find(" [example.com/Detail='try the other region']"), std::string::npos) << o.err;
  // Then those it can read, a line each: a type the server describes, in
  // text format, and the retry pushback.
  EXPECT_NE(o.err.find("\nrdmarpc_call: detail rdmarpc.examples.EchoResponse: payload: "
                       "\"elsewhere\" server_calls: 7\n"),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("\nrdmarpc_call: detail rdmarpc.examples.EchoRequest: 3 bytes that do "
                       "not parse as it\n"),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("\nrdmarpc_call: detail google.rpc.RetryInfo: retry after 200ms\n"),
            std::string::npos)
      << o.err;
  EXPECT_EQ(o.err.find("detail Detail"), std::string::npos) << "an unknown type decoded: " << o.err;
  // A negative delay: the server says not to send the call again.
  o = RunTool(call_path,
              at + "--method /rdmarpc.examples.Echo/Say --request 'payload: \"refuse\"'");
  EXPECT_EQ(o.exit_status, 1) << o.out << o.err;
  EXPECT_NE(o.err.find("rdmarpc_call: /rdmarpc.examples.Echo/Say: RESOURCE_EXHAUSTED: full ["),
            std::string::npos)
      << o.err;
  EXPECT_NE(o.err.find("\nrdmarpc_call: detail google.rpc.RetryInfo: do not retry\n"),
            std::string::npos)
      << o.err;

  std::unique_ptr<Server> plain = StartServer(&echo, false);
  ASSERT_NE(plain, nullptr);
  o = RunTool(call_path, "--address " + plain->addresses()[0]);
  EXPECT_EQ(o.exit_status, 2) << o.out << o.err;
  EXPECT_NE(o.err.find("ServerBuilder::EnableReflectionService()"), std::string::npos) << o.err;
  o = RunTool(call_path, "--method /rdmarpc.examples.Echo/Say");
  EXPECT_EQ(o.exit_status, 3) << o.out << o.err;
  EXPECT_NE(o.err.find("usage:"), std::string::npos) << o.err;
}

}  // namespace
}  // namespace rdmarpc

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const std::string scheme = argc == 5 ? argv[4] : "";
  if (scheme != "tcp" && scheme != "rdma") {
    fprintf(stderr,
            "usage: %s PATH_OF_rdmarpc_health_probe PATH_OF_rdmarpc_stats PATH_OF_rdmarpc_call "
            "tcp|rdma\n",
            argv[0]);
    return 2;
  }
  rdmarpc::probe_path = argv[1];
  rdmarpc::stats_path = argv[2];
  rdmarpc::call_path = argv[3];
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
