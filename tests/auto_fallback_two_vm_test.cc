// auto:// from a machine with RDMA to one without: two Soft-RoCE VMs
// (tools/vm/run.sh --vms 2), the server's with its RDMA device deleted
// before anything uses it. The server's auto:// falls back to TCP; the
// client's auto:// gets no answer over RDMA (the server's host drops
// RoCE packets) and connects over TCP within its connect timeout
// (transport/auto_transport.h); a second channel to it goes over TCP
// straight away (transport/fallback_memory.h), and one that does not
// remember, as soon as the server's kHello says TCP alone listens there.
// Its own binary: `rdma link delete` waits for every process that opened
// the device, so no earlier test may run in this one.
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

constexpr int kPort = 7475;
constexpr int kCalls = 4;

TEST(TwoVms, AnAutoClientReachesAHostWithoutRdmaOverTcp) {
  const std::string role = rdma::testing::Role();
  if (role == "server") {
    ASSERT_EQ(system("rdma link delete rxe0"), 0) << "could not delete the server VM's device";
    TestServer server(absl::StrCat("auto://0.0.0.0:", kPort));
    ASSERT_TRUE(server.server);
    EXPECT_EQ(server.address.rfind("auto://", 0), 0u) << server.address;
    const absl::Time until = absl::Now() + absl::Seconds(240);
    while (server.service.started.load() < kCalls && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    absl::SleepFor(absl::Seconds(2));  // the last response on its way
    EXPECT_EQ(server.service.started.load(), kCalls);
    return;
  }
  ASSERT_EQ(role, "client") << "run under tools/vm/run.sh --vms 2 (make test does)";
  const std::string target = absl::StrCat("auto://", rdma::testing::PeerAddress(), ":", kPort);
  auto ch = Channel::Create(target);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ::testing::internal::CaptureStderr();
  // The server VM may still be booting: calls until one is answered.
  Status first;
  const absl::Time until = absl::Now() + absl::Seconds(120);
  do {
    EchoRequest req;
    req.set_data("hello");
    EchoResponse resp;
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(20));
    first = (*ch)->Call(kEcho, &ctx, req, &resp);
    if (!first.ok()) absl::SleepFor(absl::Milliseconds(500));
  } while (!first.ok() && absl::Now() < until);
  EchoRequest large;
  large.set_data(std::string(3 << 20, 'w'));
  EchoResponse resp;
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(60));
  const Status second = (*ch)->Call(kEcho, &ctx, large, &resp);
  ASSERT_TRUE(first.ok()) << "the server never answered: " << first;
  EXPECT_TRUE(second.ok()) << second;
  EXPECT_EQ(resp.data(), large.data());

  // A new channel does not wait for RDMA again: without the memory its
  // connect would spend half its timeout (5 s here) on RDMA first.
  ChannelOptions options;
  options.connect_timeout = absl::Seconds(10);
  const absl::Time start = absl::Now();
  auto again = Channel::Create(target, options);
  ASSERT_TRUE(again.ok()) << again.status();
  EchoRequest req;
  req.set_data("again");
  EchoResponse again_resp;
  ClientContext again_ctx;
  again_ctx.set_timeout(absl::Seconds(20));
  const Status third = (*again)->Call(kEcho, &again_ctx, req, &again_resp);
  const absl::Duration took = absl::Now() - start;
  const std::string log = ::testing::internal::GetCapturedStderr();
  printf("%s", log.c_str());
  printf("a second channel connected and called in %s\n", absl::FormatDuration(took).c_str());
  EXPECT_TRUE(third.ok()) << third;
  EXPECT_LT(took, absl::Milliseconds(2500));
  EXPECT_TRUE(absl::StrContains(log, "cannot be reached over RDMA (")) << log;
  EXPECT_TRUE(absl::StrContains(log, "auto:// connects over TCP")) << log;
  EXPECT_EQ(log.find("auto:// connects over TCP"), log.rfind("auto:// connects over TCP"))
      << "logged more than once for one target: " << log;

  // Nor does a channel that does not remember: the server's kHello says
  // that TCP alone listens there, which ends the wait for RDMA (else half
  // the timeout, 5 s here).
  options.transport.tcp_fallback_memory = absl::ZeroDuration();
  const absl::Time fresh_start = absl::Now();
  auto fresh = Channel::Create(target, options);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EchoResponse fresh_resp;
  ClientContext fresh_ctx;
  fresh_ctx.set_timeout(absl::Seconds(20));
  const Status fourth = (*fresh)->Call(kEcho, &fresh_ctx, req, &fresh_resp);
  const absl::Duration fresh_took = absl::Now() - fresh_start;
  printf("a channel without the memory connected and called in %s\n",
         absl::FormatDuration(fresh_took).c_str());
  EXPECT_TRUE(fourth.ok()) << fourth;
  EXPECT_LT(fresh_took, absl::Milliseconds(2500));
}

}  // namespace
}  // namespace rdmarpc::testing
