// The RDMA device removed under a running server and its clients (`rdma
// link delete`, as a driver reset or a hot-unplug does): an auto:// channel
// goes on over TCP, to the same port of the auto:// server; an rdma://
// channel's calls end UNAVAILABLE at once, saying the device is gone; the
// server says its RDMA listener is gone and goes on taking TCP clients; an
// auto:// channel and an auto:// server made meanwhile go over TCP.
// Nothing waits for a timeout. Once a device serves the server's address
// again, the server listens there by itself, the rdma:// channel connects
// again, the server made meanwhile listens over RDMA too, and every
// auto:// channel moves to RDMA; and since every
// transport has let go of the removed device, the removal then completes
// while the process runs.
// Its own binary: it takes the VM's device away.
#include <glob.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/echo_service.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

using transport::rdma::Counters;

// Large enough to go by RDMA READ, so that the counters say which way it went.
const std::string kLarge(100 << 10, 'd');

// The verbs devices the process can open (what ibv_get_device_list lists):
// none once a removal has begun, though the device itself stays until every
// process lets go of it.
size_t VerbsDevices() {
  glob_t g{};
  const size_t n =
      glob("/sys/class/infiniband_verbs/uverbs*", 0, nullptr, &g) == 0 ? g.gl_pathc : 0;
  globfree(&g);
  return n;
}

TEST(DeviceRemoved, AutoGoesOnOverTcpAndRdmaEndsSayingWhy) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  TestServer server(absl::StrCat("auto://", ip, ":0"));
  ASSERT_TRUE(server.server);
  const std::string port = server.address.substr(server.address.rfind(':') + 1);
  ChannelOptions moves_back_soon;
  moves_back_soon.transport.tcp_fallback_upgrade = absl::Milliseconds(100);
  auto automatic = Channel::Create(server.address, moves_back_soon);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  auto rdma = Channel::Create(absl::StrCat("rdma://", ip, ":", port));
  ASSERT_TRUE(rdma.ok()) << rdma.status();
  const uint64_t reads_before = Counters().reads;
  ASSERT_TRUE(EchoOn(**automatic, kLarge).ok());
  ASSERT_TRUE(EchoOn(**rdma, kLarge).ok());
  ASSERT_GE(Counters().reads, reads_before + 2)
      << "the calls before the removal did not go by RDMA";
  ASSERT_GT(VerbsDevices(), 0u);

  ::testing::internal::CaptureStderr();
  // In the background: it returns only once every process has closed the
  // device, this one included.
  const std::string deleted =
      absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/rxe0_deleted");
  ASSERT_EQ(
      system(absl::StrCat("(rdma link delete rxe0 > /dev/null 2>&1; echo $? > ", deleted, ") &")
                 .c_str()),
      0);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (VerbsDevices() > 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(VerbsDevices(), 0u) << "the device was not removed";
  const absl::Time removed = absl::Now();

  // The first call may still have raced the connection's end (and the
  // server may have begun to READ its request); after it, each goes over
  // TCP.
  uint64_t reads_after = 0;
  int failed = 0;
  for (int i = 0; i < 5; ++i) {
    const Status s = EchoOn(**automatic, kLarge);
    if (i == 0) reads_after = Counters().reads;
    if (s.ok()) continue;
    ++failed;
    EXPECT_EQ(i, 0) << "a call after the first failed: " << s;
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  }
  EXPECT_EQ(Counters().reads, reads_after)
      << "auto:// calls after the first went by READ on a removed device";
  printf(
      "auto://: the first 5 calls after the removal: %d failed, the rest went over TCP, "
      "in %s\n",
      failed, absl::FormatDuration(absl::Now() - removed).c_str());

  for (int i = 0; i < 2; ++i) {
    const absl::Time start = absl::Now();
    const Status s = EchoOn(**rdma, "small");
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "RDMA_CM_EVENT_DEVICE_REMOVAL") ||
                absl::StrContains(s.message(), "RDMA_CM_EVENT_ADDR_ERROR: No such device"))
        << s;
    EXPECT_LT(took, absl::Seconds(3)) << s;
    printf("rdma:// call %d after the removal ended after %s: %s\n", i,
           absl::FormatDuration(took).c_str(), s.ToString().c_str());
  }

  auto tcp = Channel::Create(absl::StrCat("tcp://", ip, ":", port));
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  const Status over_tcp = EchoOn(**tcp, kLarge);
  EXPECT_TRUE(over_tcp.ok()) << over_tcp;
  // An auto:// channel made now finds no usable device: it goes over TCP
  // from its first call, and turns to RDMA once a device comes (below).
  auto late = Channel::Create(server.address, moves_back_soon);
  ASSERT_TRUE(late.ok()) << late.status();
  const uint64_t reads_late = Counters().reads;
  const Status late_call = EchoOn(**late, kLarge);
  EXPECT_TRUE(late_call.ok()) << late_call;
  EXPECT_EQ(Counters().reads, reads_late) << "a call with no device went by READ";
  // So does a server made now: it listens over TCP alone (its kHello says
  // so, and its clients stay on TCP) until a device comes (below).
  TestServer late_server(absl::StrCat("auto://", ip, ":0"));
  ASSERT_TRUE(late_server.server);
  EXPECT_EQ(late_server.address.rfind("auto://", 0), 0u) << late_server.address;
  const std::string late_port = late_server.address.substr(late_server.address.rfind(':') + 1);
  auto to_late_server = Channel::Create(late_server.address, moves_back_soon);
  ASSERT_TRUE(to_late_server.ok()) << to_late_server.status();
  const Status late_server_call = EchoOn(**to_late_server, kLarge);
  EXPECT_TRUE(late_server_call.ok()) << late_server_call;
  EXPECT_EQ(Counters().reads, reads_late) << "a call with no device went by READ";

  const std::string log = ::testing::internal::GetCapturedStderr();
  // At once: a line written between two captures goes uncaptured, and the
  // server may let go of rxe0 (and say so) late, under TSan as late as now.
  ::testing::internal::CaptureStderr();
  EXPECT_TRUE(absl::StrContains(log,
                                "cannot be reached over RDMA (RDMA_CM_EVENT_ADDR_ERROR: No "
                                "such device); auto:// connects over TCP"))
      << log;
  const std::string auto_channel = absl::StrCat("rdmarpc[channel auto://", ip, ":", port, "]: ");
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat(auto_channel, "no usable RDMA device (")) &&
              absl::StrContains(log, "auto:// falls back to TCP"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("RDMA device rxe0 was removed under the "
                                                  "listener on rdma://",
                                                  ip, ":", port,
                                                  ": it takes no RDMA connections until a "
                                                  "device serves that address again")))
      << log;
  printf("%s", log.c_str());

  // A device comes back at the server's address: a new Soft-RoCE device,
  // on another interface that takes the address over. (rxe0 itself cannot
  // come back on sr0 before its removal completes, and librdmacm closes a
  // removed device's context, which the removal waits for, only once an id
  // binds to a device it has not seen.) The server listens on it without a
  // restart, and the rdma:// channel, the same one, connects there again.
  ASSERT_EQ(system(absl::StrCat("old=$(ip -o -4 addr show to ", ip,
                                " | awk '{print $2}') && ip link add sr1 type dummy && "
                                "ip link set sr1 mtu 9000 up && ip addr del ",
                                ip, "/24 dev $old && ip addr add ", ip,
                                "/24 dev sr1 && rdma link add rxe1 type rxe netdev sr1")
                       .c_str()),
            0);
  const absl::Time added = absl::Now();
  ClientContext ctx;
  ctx.set_wait_for_ready(true);
  ctx.set_timeout(absl::Seconds(30));
  EchoRequest req;
  req.set_data(kLarge);
  EchoResponse resp;
  const uint64_t reads_back = Counters().reads;
  const Status again = (*rdma)->Call(kEcho, &ctx, req, &resp);
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_TRUE(resp.data() == kLarge) << "a response of " << resp.data().size() << " bytes";
  EXPECT_GE(Counters().reads, reads_back + 1) << "the call did not go by READ";
  printf("rdma:// channel: a call after the new device was added succeeded in %s\n",
         absl::FormatDuration(absl::Now() - added).c_str());
  auto fresh = Channel::Create(absl::StrCat("rdma://", ip, ":", port));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(EchoOn(**fresh, kLarge).ok());
  // The auto:// channel, over TCP since the removal, moves back to RDMA by
  // itself: its tries, 100 ms apart at first, twice as far apart after each
  // failure, reach 1.2 s apart at most.
  const absl::Time until_moved = absl::Now() + absl::Seconds(15);
  while ((*automatic)->stats().upgrades == 0 && absl::Now() < until_moved) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*automatic)->stats().upgrades, 1u) << "the auto:// channel stayed on TCP";
  printf("auto:// channel: back on RDMA %s after the new device was added\n",
         absl::FormatDuration(absl::Now() - added).c_str());
  while ((*late)->stats().upgrades == 0 && absl::Now() < until_moved) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*late)->stats().upgrades, 1u)
      << "the auto:// channel made without a device stayed on TCP";
  printf("auto:// channel made without a device: on RDMA %s after the new device was added\n",
         absl::FormatDuration(absl::Now() - added).c_str());
  // The server made without a device looks for one every second, listens
  // over RDMA on its port too, and tells its TCP clients.
  while ((*to_late_server)->stats().upgrades == 0 && absl::Now() < until_moved) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*to_late_server)->stats().upgrades, 1u)
      << "the channel to the server made without a device stayed on TCP";
  printf(
      "server made without a device: its auto:// client on RDMA %s after the new device was "
      "added\n",
      absl::FormatDuration(absl::Now() - added).c_str());
  auto rdma_to_late_server = Channel::Create(absl::StrCat("rdma://", ip, ":", late_port));
  ASSERT_TRUE(rdma_to_late_server.ok()) << rdma_to_late_server.status();
  for (Channel* channel :
       {automatic->get(), late->get(), to_late_server->get(), rdma_to_late_server->get()}) {
    const uint64_t reads_moved = Counters().reads;
    EXPECT_TRUE(EchoOn(*channel, kLarge).ok());
    EXPECT_GE(Counters().reads, reads_moved + 1) << "the call did not go by READ";
  }

  const std::string back = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(
      absl::StrContains(back, absl::StrCat("RDMA device rxe1 serves the listener on "
                                           "rdma://",
                                           ip, ":", port, " again: it takes RDMA connections")))
      << back;
  EXPECT_TRUE(absl::StrContains(
      back, absl::StrCat(auto_channel, "an RDMA device is usable now (rxe1 port 1 active")))
      << back;
  EXPECT_TRUE(
      absl::StrContains(back, "rdmarpc[server]: an RDMA device is usable now (rxe1 port 1 active"))
      << back;
  EXPECT_TRUE(absl::StrContains(back, absl::StrCat("rdmarpc[server]: auto://", ip, ":", late_port,
                                                   " listens over RDMA too now")))
      << back;
  EXPECT_TRUE(absl::StrContains(
      back, absl::StrCat("rdmarpc[channel auto://", ip, ":", port, "]: rdma://", ip, ":", port,
                         " reaches the server again: new calls go there, and the connection "
                         "tcp://",
                         ip, ":", port, " closes now")))
      << back;
  // Every transport that had used the removed device let go of it, so the
  // removal completes now that librdmacm has seen a new device.
  const absl::Time until_deleted = absl::Now() + absl::Seconds(20);
  while (access(deleted.c_str(), F_OK) != 0 && absl::Now() < until_deleted) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(access(deleted.c_str(), F_OK), 0)
      << "`rdma link delete rxe0` still waits: this process holds the device";
  printf("the removal of rxe0 completed %s after the new device was added\n",
         absl::FormatDuration(absl::Now() - added).c_str());
  for (const std::string& who :
       {std::string("server"), absl::StrCat("channel rdma://", ip, ":", port),
        absl::StrCat("channel auto://", ip, ":", port)}) {
    EXPECT_TRUE(absl::StrContains(
        log + back, absl::StrCat("rdmarpc[", who, "]: RDMA device rxe0 was removed: let go of it")))
        << who << ": " << log << back;
  }
  printf("%s", back.c_str());
}

}  // namespace
}  // namespace rdmarpc::testing
