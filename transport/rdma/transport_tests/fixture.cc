#include "transport/rdma/transport_tests/fixture.h"

#include <arpa/inet.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "transport/address.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::transport::rdma::transport_test {

uint8_t Pattern(size_t i, uint64_t seed) {
  return static_cast<uint8_t>((i * 131 + seed * 7) & 0xff);
}

Buffer Filled(Connection& conn, size_t size, uint64_t seed) {
  auto b = conn.AllocatePayload(size);
  EXPECT_TRUE(b.ok()) << b.status();
  for (size_t i = 0; i < size; ++i) b->data()[i] = static_cast<char>(Pattern(i, seed));
  return std::move(*b);
}

bool Matches(const Buffer& b, size_t size, uint64_t seed) {
  if (b.size() != size) return false;
  for (size_t i = 0; i < size; ++i)
    if (static_cast<uint8_t>(b.data()[i]) != Pattern(i, seed)) return false;
  return true;
}

bool Fixture::Start(RdmaOptions server_opts, RdmaOptions client_opts) {
  ip = ::rdmarpc::rdma::testing::RequireRdmaTestAddress();
  if (ip.empty()) return false;
  TransportOptions so;
  so.name = "test-server";
  so.listening = true;
  so.max_message_size = 128u << 20;
  server = std::make_unique<RdmaTransport>(so, server_opts, true);
  auto l =
      server->Listen(*ParseAddress("rdma://" + (listen_host.empty() ? ip : listen_host) + ":0"),
                     [this](std::shared_ptr<Connection> c) {
                       std::lock_guard<std::mutex> lock(accepted_mu);
                       // Only those the server keeps: a test may make 1000.
                       accepted.erase(std::remove_if(accepted.begin(), accepted.end(),
                                                     [](const std::weak_ptr<Connection>& a) {
                                                       return a.expired();
                                                     }),
                                      accepted.end());
                       accepted.push_back(c);
                       return server_observer;
                     });
  EXPECT_TRUE(l.ok()) << l.status();
  if (!l.ok()) return false;
  listener = std::move(*l);
  addr = listener->address();
  TransportOptions co;
  co.name = "test-client";
  co.max_message_size = 128u << 20;
  client = std::make_unique<RdmaTransport>(co, client_opts, false);
  return true;
}

std::shared_ptr<Connection> Fixture::StartAndConnect(Waiter& waiter, RdmaOptions server_opts,
                                                     RdmaOptions client_opts) {
  if (!Start(server_opts, client_opts)) {
    ADD_FAILURE() << "could not start the server and client transports";
    return nullptr;
  }
  auto conn = Connect(&waiter);
  if (!conn.ok()) {
    ADD_FAILURE() << "connect: " << conn.status();
    return nullptr;
  }
  return std::move(*conn);
}

OutboundMessage Request(uint64_t id, Buffer payload, std::string metadata) {
  OutboundMessage m;
  m.header.kind = MessageKind::kRequest;
  m.header.call_id = id;
  m.payload = std::move(payload);
  m.metadata = std::move(metadata);
  return m;
}

absl::StatusOr<InboundMessage> Call(Connection& conn, Waiter& w, uint64_t id, Buffer payload) {
  auto f = w.Expect(id);
  if (absl::Status s = conn.Send(Request(id, std::move(payload))); !s.ok()) return s;
  if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    return absl::DeadlineExceededError(
        absl::StrCat("no response in 120 s; counters: ", Counters().ToString()));
  }
  InboundMessage r = f.get();
  if (!r.payload_status.ok()) return r.payload_status;
  if (r.header.status != 0) {
    return absl::Status(static_cast<absl::StatusCode>(r.header.status),
                        "the server could not answer (see its log line)");
  }
  return r;
}

BothEnds ConnectAndCall(Fixture& fx) {
  BothEnds ends;
  Waiter& waiter = fx.NewWaiter();
  auto conn = fx.Connect(&waiter);
  EXPECT_TRUE(conn.ok()) << conn.status();
  if (!conn.ok()) return ends;
  ends.client = *conn;
  auto r = Call(**conn, waiter, 1, Filled(**conn, 100, 1));
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) ends.server = fx.LastAccepted();
  return ends;
}

GidPlace FindGidOf(const std::string& ip) {
  // An IPv4 address's GID is the address mapped into IPv6, ::ffff:a.b.c.d.
  in6_addr want{};
  if (in_addr v4{}; inet_pton(AF_INET, ip.c_str(), &v4) == 1) {
    want.s6_addr[10] = want.s6_addr[11] = 0xff;
    memcpy(want.s6_addr + 12, &v4, 4);
  } else if (inet_pton(AF_INET6, ip.c_str(), &want) != 1) {
    return {};
  }
  GidPlace place;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  for (int d = 0; d < n && place.index < 0; ++d) {
    ibv_context* ctx = ibv_open_device(list[d]);
    if (!ctx) continue;
    ibv_device_attr attr{};
    ibv_query_device(ctx, &attr);
    for (uint32_t p = 1; p <= attr.phys_port_cnt && place.index < 0; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) != 0) continue;
      for (int g = 0; g < pa.gid_tbl_len; ++g) {
        ibv_gid_entry e{};
        if (ibv_query_gid_ex(ctx, p, g, &e, 0) != 0) continue;
        if (e.gid_type == IBV_GID_TYPE_ROCE_V2 && memcmp(e.gid.raw, &want, 16) == 0) {
          place = GidPlace{ibv_get_device_name(list[d]), p, g};
          break;
        }
      }
    }
    ibv_close_device(ctx);
  }
  if (list) ibv_free_device_list(list);
  return place;
}

std::string PeerHost(Connection& c) {
  return OnPoller<std::string>(c, "gone",
                               [](rdma_cm_id* id) { return SockaddrHost(rdma_get_peer_addr(id)); });
}

bool EveryConnectionClosedSince(uint64_t opened, uint64_t closed) {
  // One snapshot a look: with two, a connection opened between them read
  // as none open.
  auto still_open = [&] {
    const RdmaCounters c = Counters();
    return c.connections_opened - opened - (c.connections_closed - closed);
  };
  const absl::Time until = absl::Now() + absl::Seconds(20);
  for (;;) {
    if (still_open() == 0) return true;
    if (absl::Now() >= until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

void ExpectServesANewClient(Fixture& fx, size_t size) {
  Waiter& after = fx.NewWaiter();
  auto conn = fx.Connect(&after);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = Call(**conn, after, 1, Filled(**conn, size, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Matches(r->payload, size, 1));
  (*conn)->Close();
}

}  // namespace rdmarpc::transport::rdma::transport_test
