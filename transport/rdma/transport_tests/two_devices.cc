// A host with two RDMA devices, as a server with two NICs has: a server
// listening on the unspecified address takes connections over each, every
// one on an endpoint (protection domain, completion queues, SRQ) of the
// device it came in on; calls go over both at once, small ones by SEND and
// large ones by READ; and a device removed under them, while calls run on
// both, ends the connections on it alone, while those on the other go on
// without a failed call, the listener keeps taking connections there, and a
// device added later serves the removed one's address again without a
// restart.
// Its own binary: it adds devices to the VM's boot and removes one.
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/transport_tests/fixture.h"

namespace rdmarpc::transport::rdma::transport_test {
namespace {

// The second device's address, a subnet apart from the VM's own
// (tools/vm/run.sh: 10.77.0.0/24 on sr0).
constexpr char kSecondIp[] = "10.78.0.1";

// Large enough to go by RDMA READ; the small one goes inline in a SEND.
constexpr size_t kLarge = 1 << 20;
constexpr size_t kSmall = 100;

// A new interface `interface` holding kSecondIp (taken off `from`, unless
// empty), and Soft-RoCE device `device` on it, which carries kSecondIp's GID
// once this returns; "" with the test failed, else `device`.
std::string AddDevice(const std::string& device, const std::string& interface,
                      const std::string& from = "") {
  const std::string ip = kSecondIp;
  const int rc = system(
      absl::StrCat(from.empty() ? "" : absl::StrCat("ip addr del ", ip, "/24 dev ", from, " && "),
                   "ip link add ", interface, " type dummy && ip link set ", interface,
                   " mtu 9000 up && ip addr add ", ip, "/24 dev ", interface, " && rdma link add ",
                   device, " type rxe netdev ", interface)
          .c_str());
  EXPECT_EQ(rc, 0) << "adding " << device << " on " << interface;
  if (rc != 0) return "";
  const absl::Time until = absl::Now() + absl::Seconds(20);
  for (;;) {
    const GidPlace place = FindGidOf(ip);
    if (place.device == device) return device;
    if (absl::Now() >= until) {
      ADD_FAILURE() << device << " carries no RoCE v2 GID of " << ip << " after 20 s";
      return "";
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string DeviceOf(Connection& c) {
  return static_cast<RdmaConnection&>(c).endpoint()->device_name();
}

struct Client {
  Waiter* waiter = nullptr;
  std::shared_ptr<Connection> conn;
};

// fx's client connected to the server's port at `ip`; reached at `ip`, over
// `device`.
Client ConnectAt(Fixture& fx, const std::string& ip, const std::string& device) {
  Client c;
  c.waiter = &fx.NewWaiter();
  const Address to = *ParseAddress(absl::StrCat("rdma://", ip, ":", fx.addr.port));
  auto conn = fx.client->Connect(to, c.waiter, SteadyNow() + absl::Seconds(30));
  EXPECT_TRUE(conn.ok()) << to.ToString() << ": " << conn.status();
  if (!conn.ok()) return c;
  c.conn = std::move(*conn);
  EXPECT_EQ(PeerHost(*c.conn), ip);
  EXPECT_EQ(DeviceOf(*c.conn), device) << to.ToString();
  return c;
}

// `calls` calls on c, small and large in turns, each answered whole;
// call ids from `first`.
void CallsComeBackWhole(Client& c, uint64_t first, int calls) {
  for (int i = 0; i < calls; ++i) {
    const uint64_t id = first + i;
    const size_t size = i % 2 == 0 ? kSmall : kLarge;
    auto r = Call(*c.conn, *c.waiter, id, Filled(*c.conn, size, id));
    ASSERT_TRUE(r.ok()) << "call " << id << " of " << size << " bytes: " << r.status();
    ASSERT_TRUE(Matches(r->payload, size, id)) << "call " << id;
  }
}

// The server's ends of its connections, by the device each is on.
std::multiset<std::string> ServerDevices(Fixture& fx) {
  std::multiset<std::string> devices;
  for (const auto& conn : fx.Accepted()) devices.insert(DeviceOf(*conn));
  return devices;
}

TEST(RdmaTwoDevices, TheServerTakesEachOnItsOwnEndpointAndLosesOnlyTheRemovedOnes) {
  Fixture fx;
  fx.listen_host = "0.0.0.0";
  ASSERT_TRUE(fx.Start());
  const std::string first_device = FindGidOf(fx.ip).device;
  ASSERT_FALSE(first_device.empty()) << "no device carries " << fx.ip;
  // Added while the server listens: a listener on the unspecified address
  // covers devices that come later.
  const std::string second_device = AddDevice("rxe1", "sr1");
  ASSERT_FALSE(second_device.empty());

  Client first = ConnectAt(fx, fx.ip, first_device);
  Client second = ConnectAt(fx, kSecondIp, second_device);
  ASSERT_TRUE(first.conn && second.conn);
  const uint64_t reads_before = Counters().reads;
  {
    // Both at once: each endpoint has its own poller.
    std::thread other([&] { CallsComeBackWhole(second, 1, 20); });
    CallsComeBackWhole(first, 1, 20);
    other.join();
  }
  // 10 large requests and 10 large responses on each connection.
  EXPECT_GE(Counters().reads, reads_before + 40) << "the large calls did not go by READ";

  // One endpoint per device on each side: its own SRQ, and its own slots.
  auto* first_ep = static_cast<RdmaConnection&>(*first.conn).endpoint();
  auto* second_ep = static_cast<RdmaConnection&>(*second.conn).endpoint();
  EXPECT_NE(first_ep, second_ep);
  EXPECT_NE(first_ep->srq(), second_ep->srq());
  std::vector<std::shared_ptr<Connection>> accepted = fx.Accepted();
  ASSERT_EQ(accepted.size(), 2u);
  EXPECT_EQ(ServerDevices(fx), (std::multiset<std::string>{first_device, second_device}));
  auto* server_a = static_cast<RdmaConnection&>(*accepted[0]).endpoint();
  auto* server_b = static_cast<RdmaConnection&>(*accepted[1]).endpoint();
  EXPECT_NE(server_a, server_b);
  EXPECT_NE(server_a->srq(), server_b->srq());
  EXPECT_GT(server_a->receive_bytes(), 0u);
  EXPECT_EQ(server_a->receive_bytes(), server_b->receive_bytes());
  accepted.clear();

  // The second device goes, as in a driver reset or a hot-unplug, while
  // calls run on both connections. In the background: `rdma link delete`
  // returns only once every process has let go of the device, this one
  // included.
  std::atomic<bool> removal_seen{false};
  int calls_beside_removal = 0;  // read once on_first has ended
  int calls_after_removal = 0;
  std::vector<absl::Status> first_failures;
  std::thread on_first([&] {
    // On past the removal, while the transports let go of the device.
    for (uint64_t id = 1000; calls_after_removal < 20; ++id) {
      if (removal_seen.load()) ++calls_after_removal;
      const size_t size = id % 2 == 0 ? kSmall : kLarge;
      auto r = Call(*first.conn, *first.waiter, id, Filled(*first.conn, size, id));
      if (!r.ok()) {
        first_failures.push_back(r.status());
      } else if (!Matches(r->payload, size, id)) {
        first_failures.push_back(
            absl::DataLossError(absl::StrCat("call ", id, " came back wrong")));
      }
      ++calls_beside_removal;
    }
  });
  absl::Status second_failed;
  std::thread on_second([&] {
    for (uint64_t id = 1000; second_failed.ok(); ++id) {
      const size_t size = id % 2 == 0 ? kSmall : kLarge;
      auto r = Call(*second.conn, *second.waiter, id, Filled(*second.conn, size, id));
      if (!r.ok()) second_failed = r.status();
    }
  });
  const std::string deleted =
      absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/rxe1_deleted");
  ASSERT_EQ(system(absl::StrCat("(rdma link delete ", second_device,
                                " > /dev/null 2>&1; echo $? > ", deleted, ") &")
                       .c_str()),
            0);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!second.waiter->FinishedClosing() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const bool second_ended = second.waiter->FinishedClosing();
  // A call over the removed device ends, failed, once its connection has.
  on_second.join();
  removal_seen.store(true);
  on_first.join();
  ASSERT_TRUE(second_ended) << "the connection over the removed device did not end";
  EXPECT_EQ(second_failed.code(), absl::StatusCode::kUnavailable) << second_failed;
  for (const absl::Status& s : first_failures) ADD_FAILURE() << "over the other device: " << s;
  EXPECT_GT(calls_beside_removal, 0);
  printf("over the other device: %d calls from before to after the removal, %zu failed\n",
         calls_beside_removal, first_failures.size());
  EXPECT_EQ(second.waiter->closed_status.code(), absl::StatusCode::kUnavailable)
      << second.waiter->closed_status;
  EXPECT_TRUE(absl::StrContains(second.waiter->closed_status.message(), kSecondIp))
      << second.waiter->closed_status;
  printf("over the removed device: %s\n", second.waiter->closed_status.ToString().c_str());
  // As the runtime does with a connection that ended: a connection object
  // holds its endpoint, and so the device.
  second.conn.reset();

  // The other device's connection and the server's listener go on.
  EXPECT_FALSE(first.waiter->closed.load()) << first.waiter->closed_status;
  CallsComeBackWhole(first, 100, 6);
  Client again = ConnectAt(fx, fx.ip, first_device);
  ASSERT_TRUE(again.conn);
  CallsComeBackWhole(again, 1, 4);
  while (ServerDevices(fx).count(second_device) > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ServerDevices(fx), (std::multiset<std::string>{first_device, first_device}));

  // A device added on another interface that takes the removed one's
  // address over (Soft-RoCE keeps sr1 until the removal completes) serves
  // that address again, and the listener takes connections over it. The new
  // device's arrival has librdmacm close the removed device's context, so
  // the removal completes while this process runs: both transports have let
  // go of it.
  const std::string third_device = AddDevice("rxe2", "sr2", "sr1");
  ASSERT_FALSE(third_device.empty());
  Client back = ConnectAt(fx, kSecondIp, third_device);
  ASSERT_TRUE(back.conn);
  CallsComeBackWhole(back, 1, 4);
  CallsComeBackWhole(first, 200, 4);
  const absl::Time removal_until = absl::Now() + absl::Seconds(20);
  std::string removal;
  while (absl::Now() < removal_until) {
    std::ifstream in(deleted);
    if (std::getline(in, removal)) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(removal, "0") << "`rdma link delete " << second_device
                          << "` did not complete while the process ran";
}

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
