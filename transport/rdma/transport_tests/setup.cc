// What a connection is set up with: the named device, port and GID (IPv4
// and IPv6), the terms both sides agree on (READs in flight, RNR wait,
// type of service), the trace of each step, a clear error when what is
// named does not fit, and where a connect to the unspecified address goes.
#include <arpa/inet.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/signal_storm.h"
#include "gtest/gtest.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/testing/rdma_test_env.h"
#include "transport/rdma/transport_tests/fixture.h"

namespace rdmarpc::transport::rdma::transport_test {
namespace {

// fx's client connects to `to`, reaches the server at `host`, and a call
// there comes back whole.
void ExpectReachedAt(Fixture& fx, const Address& to, const std::string& host) {
  Waiter& waiter = fx.NewWaiter();
  auto conn = fx.client->Connect(to, &waiter, SteadyNow() + absl::Seconds(30));
  ASSERT_TRUE(conn.ok()) << to.ToString() << ": " << conn.status();
  EXPECT_EQ(PeerHost(**conn), host) << to.ToString();
  auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 100, 1));
  (*conn)->Close();
}

// The first RoCE v2 GID of place's port whose address is of `family`, or -1.
int FindGidOfFamily(const GidPlace& place, int family) {
  int found = -1;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int d = 0; d < n && found < 0; ++d) {
    if (place.device != ibv_get_device_name(list[d])) continue;
    ibv_context* ctx = ibv_open_device(list[d]);
    if (!ctx) continue;
    ibv_port_attr pa{};
    for (int g = 0; ibv_query_port(ctx, place.port, &pa) == 0 && g < pa.gid_tbl_len; ++g) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(ctx, place.port, g, &e, 0) != 0) continue;
      const bool v4 = IN6_IS_ADDR_V4MAPPED(reinterpret_cast<const in6_addr*>(e.gid.raw));
      if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && v4 == (family == AF_INET)) {
        found = g;
        break;
      }
    }
    ibv_close_device(ctx);
  }
  if (list) ibv_free_device_list(list);
  return found;
}

// Named explicitly, device, port and GID index are what both sides use; a
// server given a wildcard listens on that GID's address.
TEST(RdmaTransport, NamedDevicePortAndGidAreUsed) {
  const GidPlace place = FindGidOf(::rdmarpc::rdma::testing::RequireRdmaTestAddress());
  ASSERT_GE(place.index, 0) << "no RoCE v2 GID carries the test address. " << DescribeDevices();
  RdmaOptions named;
  named.device = place.device;
  named.device_port = place.port;
  named.gid_index = place.index;
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  fx.listen_host = "0.0.0.0";
  ASSERT_TRUE(fx.Start(named, named));
  EXPECT_EQ(fx.addr.host, fx.ip) << "a wildcard listens on the named GID's address";
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, 100, 1));
  rdma_cm_id* id = std::static_pointer_cast<RdmaConnection>(*conn)->id();
  EXPECT_EQ(ibv_get_device_name(id->verbs->device), place.device);
  EXPECT_EQ(id->port_num, place.port);
  EXPECT_EQ(ChosenGidIndex(id), place.index);
  (*conn)->Close();
  // Dialled as the unspecified address, it is the named GID's address that
  // is reached.
  ExpectReachedAt(fx, *ParseAddress(absl::StrCat("rdma://0.0.0.0:", fx.addr.port)), fx.ip);
}

// As a destination the unspecified address means this host, as over TCP,
// but rdma_cm alone takes it to a loopback path that Soft-RoCE (and any
// device that does not loop back) lacks. So a connect to a server on
// 0.0.0.0 or [::], dialled as the address the server gives, goes to this
// host's RoCE addresses: the IPv4 ones for 0.0.0.0, the IPv6 ones first for
// [::].
class UnspecifiedAddress : public ::testing::Test {
 protected:
  void SetUp() override {
    ip_ = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
    ip6_ = ::rdmarpc::rdma::testing::RequireRdmaTestAddress6();
    ASSERT_FALSE(ip_.empty());
    ASSERT_FALSE(ip6_.empty());
  }
  std::string ip_;
  std::string ip6_;
};

TEST_F(UnspecifiedAddress, IsThisHost) {
  for (const auto& [listen_on, reached] :
       {std::pair<std::string, std::string>{"0.0.0.0", ip_}, {"[::]", ip6_}}) {
    SCOPED_TRACE(listen_on);
    Fixture fx;
    fx.listen_host = listen_on;
    ASSERT_TRUE(fx.Start());
    ASSERT_TRUE(absl::StartsWith(fx.addr.ToString(), absl::StrCat("rdma://", listen_on, ":")))
        << fx.addr.ToString();
    ExpectReachedAt(fx, fx.addr, reached);
  }
}

// Where the unspecified address leads: each of this host's RoCE addresses
// of the family once, the test address among them, link-local ones last.
TEST_F(UnspecifiedAddress, LeadsToEachOfThisHostsRoceAddressesOnceLinkLocalLast) {
  for (const auto& [family, test_address] :
       {std::pair<int, std::string>{AF_INET, ip_}, {AF_INET6, ip6_}}) {
    std::vector<std::string> hosts;
    bool link_local_seen = false;
    for (const SocketAddress& a : ThisHostRdmaAddresses(family, 7)) {
      const auto* sa = reinterpret_cast<const sockaddr*>(&a.storage);
      EXPECT_EQ(sa->sa_family, family);
      hosts.push_back(SockaddrHost(sa));
      EXPECT_TRUE(absl::EndsWith(SockaddrString(sa), ":7")) << SockaddrString(sa);
      const bool link_local = absl::StartsWith(hosts.back(), "fe80:");
      EXPECT_FALSE(link_local_seen && !link_local) << hosts.back() << " after a link-local one";
      link_local_seen |= link_local;
    }
    EXPECT_EQ(std::count(hosts.begin(), hosts.end(), test_address), 1)
        << absl::StrJoin(hosts, ", ") << "; " << DescribeDevices();
    EXPECT_EQ(std::set<std::string>(hosts.begin(), hosts.end()).size(), hosts.size())
        << absl::StrJoin(hosts, ", ");
  }
}

// An IPv6 address is served and reached over the RoCE v2 GID that carries
// it, not over the port's IPv4-mapped or link-local GID, and frames and READ
// pulls both work across it.
TEST(RdmaTransport, Ipv6AddressIsReachedOverItsOwnGid) {
  const std::string ip6 = ::rdmarpc::rdma::testing::RequireRdmaTestAddress6();
  ASSERT_FALSE(ip6.empty());
  const GidPlace place = FindGidOf(ip6);
  ASSERT_GE(place.index, 0) << "no RoCE v2 GID carries " << ip6 << ". " << DescribeDevices();
  Fixture fx;
  fx.listen_host = absl::StrCat("[", ip6, "]");
  Waiter& waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  EXPECT_EQ(fx.addr.host, ip6);
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  const size_t large = RdmaOptions().slot_size * 4;
  const uint64_t reads_before = Counters().reads;
  auto small = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_TRUE(Matches(small->payload, 100, 1));
  EXPECT_EQ(Counters().reads, reads_before) << "a small frame went by READ";
  auto pulled = Call(**conn, waiter, 2, Filled(**conn, large, 2));
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(Matches(pulled->payload, large, 2));
  EXPECT_GE(Counters().reads - reads_before, 2u) << "request and response each pulled by READ";
  std::shared_ptr<Connection> server_conn = fx.LastAccepted();
  ASSERT_NE(server_conn, nullptr);
  for (Connection* c : {conn->get(), server_conn.get()}) {
    const GidPlace p = OnPoller<GidPlace>(*c, GidPlace{}, [](rdma_cm_id* id) {
      return GidPlace{ibv_get_device_name(id->verbs->device), id->port_num, ChosenGidIndex(id)};
    });
    EXPECT_EQ(p.device, place.device);
    EXPECT_EQ(p.port, place.port);
    EXPECT_EQ(p.index, place.index) << "not the GID of " << ip6;
  }
  (*conn)->Close();
}

// READ limits are set as rdma_accept(3) reads a connect request: a side
// keeps at most as many READs in flight as the other side's QP serves, and
// the server sets aside responder resources for as many READs as the client
// will have in flight, not for as many as the client's device could serve.
TEST(RdmaTransport, ReadsInFlightAreNegotiatedBothWays) {
  RdmaOptions client_options;
  client_options.max_reads_in_flight = 4;
  Fixture fx;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_options));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  struct Limits {
    int initiator = -1;  // max_rd_atomic: READs this QP has in flight
    int responder = -1;  // max_dest_rd_atomic: the peer's READs it serves
  };
  const auto limits = [](Connection& c) {
    return OnPoller<Limits>(c, Limits{}, [](rdma_cm_id* id) {
      Limits l;
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      if (ibv_query_qp(id->qp, &attr, IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC, &init) ==
          0) {
        l.initiator = attr.max_rd_atomic;
        l.responder = attr.max_dest_rd_atomic;
      }
      return l;
    });
  };
  const Limits client = limits(*ends.client);
  const Limits server = limits(*ends.server);
  EXPECT_EQ(client.initiator, 4) << "the client's own max_reads_in_flight";
  EXPECT_EQ(server.responder, 4) << "the server serves more READs than the client takes";
  EXPECT_LE(server.initiator, client.responder)
      << "the server has more READs in flight than the client's QP serves";
  EXPECT_EQ(server.initiator, std::min<int>(RdmaOptions().max_reads_in_flight, client.responder))
      << "the server took the client's own READ limit for its own";
  ends.client->Close();
}

// A SEND that finds the SRQ empty is retried after the receiver's RNR NAK
// timer, which rdma_cm leaves at code 0: 655 ms. Each side sets its own
// from rnr_wait_us, rounded up to IBA's table (120 us for 100 asked).
TEST(RdmaTransport, EachSideAdvertisesItsOwnRnrWait) {
  RdmaOptions server_options;
  server_options.rnr_wait_us = 100;
  Fixture fx;
  ASSERT_TRUE(fx.Start(server_options, RdmaOptions()));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  const auto rnr_timer = [](Connection& c) {
    return OnPoller<int>(c, -1, [](rdma_cm_id* id) {
      ibv_qp_attr attr{};
      ibv_qp_init_attr init{};
      return ibv_query_qp(id->qp, &attr, IBV_QP_MIN_RNR_TIMER, &init) == 0 ? int{attr.min_rnr_timer}
                                                                           : -1;
    });
  };
  EXPECT_EQ(rnr_timer(*ends.server), 7) << "120 us, the shortest wait of at least 100";
  EXPECT_EQ(rnr_timer(*ends.client), RnrTimerCode(RdmaOptions().rnr_wait_us))
      << "the default, 640 us";
  ends.client->Close();
}

// A client's type_of_service goes into its QP's path and, through the
// connect request, into the server's: a lossless RoCE class (here DSCP 26)
// holds both ways. Without it both keep rdma_cm's default, the same on
// each side. The one log line says the class.
TEST(RdmaTransport, TheClientsTypeOfServiceHoldsBothWays) {
  RdmaOptions client_options;
  client_options.type_of_service = 26 << 2;
  Fixture fx;
  ASSERT_TRUE(fx.Start(RdmaOptions(), client_options));
  const BothEnds ends = ConnectAndCall(fx);
  ASSERT_NE(ends.server, nullptr);
  const auto traffic_class = [](const std::shared_ptr<Connection>& c) {
    return OnPoller<int>(*c, -1, TrafficClass);
  };
  EXPECT_EQ(traffic_class(ends.client), 104);
  EXPECT_EQ(traffic_class(ends.server), 104) << "the server's QP does not answer in its class";
  const std::string described = OnPoller<std::string>(*ends.client, "gone", DescribeChoice);
  EXPECT_TRUE(absl::StrContains(described, "type_of_service 104")) << described;
  ends.client->Close();

  Fixture plain;
  ASSERT_TRUE(plain.Start());
  const BothEnds defaults = ConnectAndCall(plain);
  ASSERT_NE(defaults.server, nullptr);
  EXPECT_GE(traffic_class(defaults.client), 0);
  EXPECT_EQ(traffic_class(defaults.client), traffic_class(defaults.server));
  defaults.client->Close();
}

// The lines RdmaOptions::trace wrote for `who` ("test-client"), in order.
std::vector<std::string> TraceLines(const std::string& captured, const std::string& who) {
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(captured, '\n')) {
    if (absl::StartsWith(line, absl::StrCat("rdmarpc[", who, "] trace: "))) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

// Each of `expected` is in a line of `lines`, in this order.
void ExpectInOrder(const std::vector<std::string>& lines,
                   const std::vector<std::string>& expected) {
  size_t at = 0;
  for (const std::string& e : expected) {
    while (at < lines.size() && lines[at].find(e) == std::string::npos) ++at;
    EXPECT_LT(at, lines.size()) << "no line with \"" << e << "\" where expected; traced:\n"
                                << absl::StrJoin(lines, "\n");
  }
}

// With RdmaOptions::trace, each side says every step of a connection's life
// with what it chose and agreed: the device, port and GID, the QP, the
// credits each side grants the other, rdma_cm's events, the teardown, and
// that the QP drained before it was freed. Without it, nothing is traced.
TEST(RdmaTransport, TraceFollowsEachConnectionFromResolveToFree) {
  for (const bool trace : {false, true}) {
    SCOPED_TRACE(trace ? "traced" : "not traced");
    RdmaOptions server_options;
    server_options.credits = 24;
    server_options.trace = trace;
    RdmaOptions client_options;
    client_options.credits = 16;
    client_options.trace = trace;
    std::string choice;
    ::testing::internal::CaptureStderr();
    {
      Fixture fx;
      Waiter& waiter = fx.NewWaiter();
      if (!fx.Start(server_options, client_options)) {
        ::testing::internal::GetCapturedStderr();
        FAIL() << "could not start";
      }
      auto conn = fx.Connect(&waiter);
      ASSERT_TRUE(conn.ok()) << conn.status();
      choice = DescribeChoice(std::static_pointer_cast<RdmaConnection>(*conn)->id());
      auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
      EXPECT_TRUE(r.ok()) << r.status();
      const uint64_t closed_before = Counters().connections_closed;
      (*conn)->Close();
      // Both ends, the server's on the client's disconnect, not at shutdown.
      const absl::Time until = absl::Now() + absl::Seconds(30);
      while (Counters().connections_closed < closed_before + 2 && absl::Now() < until) {
        absl::SleepFor(absl::Milliseconds(5));
      }
      EXPECT_GE(Counters().connections_closed, closed_before + 2) << "a side never closed";
    }  // the transports shut down: every connection is freed
    const std::string captured = ::testing::internal::GetCapturedStderr();
    const std::vector<std::string> client = TraceLines(captured, "test-client");
    const std::vector<std::string> server = TraceLines(captured, "test-server");
    if (!trace) {
      EXPECT_TRUE(client.empty() && server.empty()) << captured;
      continue;
    }
    ExpectInOrder(client,
                  {"resolving the address; rdma_cm picks the device", "RDMA_CM_EVENT_ADDR_RESOLVED",
                   "RDMA_CM_EVENT_ROUTE_RESOLVED", absl::StrCat(choice, "; QP "),
                   "we grant 16 credits", "established: QP", "credits: we grant 16, the peer 24",
                   "ACK timeout", "tearing down QP", "drained after"});
    ExpectInOrder(server, {"listening on rdma://", "connection request from rdma://",
                           "it grants 16 credits", "accepted on device",
                           "credits: we grant 24, the peer 16", "RDMA_CM_EVENT_ESTABLISHED",
                           "RDMA_CM_EVENT_DISCONNECTED", "tearing down QP", "drained after"});
  }
}

// ResolveRoute (what `rdmarpc_devices --to` prints) waits for rdma_cm's
// answers in a blocking read, which a signal without SA_RESTART interrupts:
// the route is still found, as in a program that takes signals.
TEST(RdmaTransport, RouteIsResolvedUnderSignals) {
  const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(7471);
  ASSERT_EQ(inet_pton(AF_INET, ip.c_str(), &to.sin_addr), 1) << ip;
  SignalStorm storm(absl::Microseconds(200));
  // At least 50 resolutions, and on until 50 signals have landed somewhere,
  // so that a fast resolver cannot finish between two rounds of the storm.
  const absl::Time until = SteadyNow() + absl::Seconds(20);
  for (int i = 0; i < 50 || (storm.delivered() < 50 && SteadyNow() < until); ++i) {
    auto route = ResolveRoute(reinterpret_cast<const sockaddr*>(&to), RdmaOptions());
    ASSERT_TRUE(route.ok()) << "resolution " << i << ": " << route.status();
  }
  storm.Stop();
  EXPECT_GE(storm.delivered(), 50u);
}

// Names that name nothing fail before any connection is tried, saying what
// exists; a device that rdma_cm does not route to fails naming both.
TEST(RdmaTransport, NamedDeviceOrGidThatDoesNotFitIsAClearError) {
  const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  const GidPlace place = FindGidOf(ip);
  ASSERT_GE(place.index, 0) << DescribeDevices();
  Fixture fx;
  Waiter& waiter = fx.NewWaiter();
  ASSERT_TRUE(fx.Start());
  const auto connect_with = [&](RdmaOptions o, std::optional<Address> to = std::nullopt) {
    TransportOptions co;
    co.name = "named-client";
    Waiter w;
    RdmaTransport client(co, o, false);
    return client.Connect(to.value_or(fx.addr), &w, SteadyNow() + absl::Seconds(30)).status();
  };
  const auto expect_error = [](const absl::Status& s, absl::StatusCode code,
                               const std::vector<std::string>& mentions) {
    EXPECT_EQ(s.code(), code) << s;
    for (const std::string& m : mentions) {
      EXPECT_NE(s.message().find(m), absl::string_view::npos) << "'" << m << "' missing: " << s;
    }
  };
  RdmaOptions o;
  o.device = place.device;
  o.device_port = place.port;
  o.gid_index = 1000000;
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument,
               {"gid_index 1000000", "no such GID", "Devices: " + place.device});
  o.device_port = 99;
  o.gid_index = place.index;
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument, {"no port 99", "Devices:"});
  o.device = "nosuch9";
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument,
               {"nosuch9", "Devices: " + place.device});
  o.device = "";
  expect_error(connect_with(o), absl::StatusCode::kInvalidArgument, {"set device"});
  // A GID of the other address family (Soft-RoCE's GID 0 is the port's IPv6
  // link-local address) cannot reach the server's IPv4 address.
  const int v6 = FindGidOfFamily(place, AF_INET6);
  if (place.device.rfind("rxe", 0) == 0) {
    ASSERT_GE(v6, 0) << "Soft-RoCE keeps the port's IPv6 link-local GID at index 0";
  }
  if (v6 >= 0) {
    RdmaOptions ipv6;
    ipv6.device = place.device;
    ipv6.device_port = place.port;
    ipv6.gid_index = v6;
    expect_error(connect_with(ipv6), absl::StatusCode::kInvalidArgument,
                 {absl::StrCat("gid_index ", v6), "is IPv6 and cannot reach an IPv4 address"});
  }
  // Nor a loopback address: rdma_cm would look for it on the GID's
  // interface, and the connect would wait out its deadline (30 s here,
  // DEADLINE_EXCEEDED). It fails at once, saying so, also beside
  // "localhost"'s IPv6 address.
  RdmaOptions named_gid;
  named_gid.device = place.device;
  named_gid.device_port = place.port;
  named_gid.gid_index = place.index;
  for (const char* loopback : {"127.0.0.1", "localhost"}) {
    expect_error(connect_with(named_gid,
                              *ParseAddress(absl::StrCat("rdma://", loopback, ":", fx.addr.port))),
                 absl::StatusCode::kInvalidArgument,
                 {absl::StrCat("gid_index ", place.index), "cannot reach a loopback address",
                  absl::StrCat("Reach this host at ", ip)});
  }
  // A device alone is a check on what rdma_cm picks for the address.
  RdmaOptions other_device;
  other_device.device = "nosuch9";
  expect_error(connect_with(other_device), absl::StatusCode::kUnavailable,
               {"rdma_cm chose device " + place.device, "asks for nosuch9"});
  // A server named a GID cannot listen on another address.
  TransportOptions so;
  so.listening = true;
  RdmaTransport server(so, named_gid, true);
  auto l = server.Listen(*ParseAddress("rdma://127.0.0.1:0"),
                         [](std::shared_ptr<Connection>) { return nullptr; });
  ASSERT_FALSE(l.ok());
  expect_error(l.status(), absl::StatusCode::kInvalidArgument, {"whose address is " + ip});
  // The server that was there is untouched.
  auto conn = fx.Connect(&waiter);
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(Call(**conn, waiter, 1, Filled(**conn, 100, 1)).ok());
  (*conn)->Close();
}

// A listener on a loopback address starts, but says once that RDMA clients
// on other hosts (and any on Soft-RoCE) cannot reach it; one on the
// device's address says nothing of the kind.
TEST(RdmaTransport, AListenerOnALoopbackAddressSaysWhoCanReachIt) {
  const std::string ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  TransportOptions so;
  so.name = "loop-server";
  so.listening = true;
  RdmaTransport server(so, RdmaOptions(), true);
  const auto listen_on = [&](const std::string& address, std::string* said) {
    ::testing::internal::CaptureStderr();
    auto l =
        server.Listen(*ParseAddress(address), [](std::shared_ptr<Connection>) { return nullptr; });
    *said = ::testing::internal::GetCapturedStderr();
    return l;
  };
  for (const char* loopback : {"rdma://127.0.0.1:0", "rdma://[::1]:0"}) {
    std::string said;
    auto l = listen_on(loopback, &said);
    ASSERT_TRUE(l.ok()) << loopback << ": " << l.status();
    const std::string at = absl::StrCat(absl::StrContains(loopback, "[") ? "[::1]:" : "127.0.0.1:",
                                        (*l)->address().port);
    EXPECT_TRUE(absl::StrContains(
        said, absl::StrCat("rdmarpc[loop-server]: listening over RDMA on ", at,
                           ", a loopback address: only clients on this host reach it")))
        << said;
    EXPECT_TRUE(absl::StrContains(said, "listen on the address of an interface with an RDMA port"))
        << said;
  }
  std::string said;
  auto l = listen_on(absl::StrCat("rdma://", ip, ":0"), &said);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_FALSE(absl::StrContains(said, "loopback")) << said;
}

}  // namespace
}  // namespace rdmarpc::transport::rdma::transport_test
