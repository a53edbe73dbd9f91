// auto:// picks RDMA where a usable device exists and falls back to TCP
// otherwise; TransportTunables::tcp_fallback = false (or
// RDMARPC_NO_TCP_FALLBACK=1) turns the fallback into an error.
#include <cstdlib>

#include "gtest/gtest.h"
#include "rpc/channel_group.h"
#include "tests/echo_service.h"
#include "transport/factory.h"
#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::testing {
namespace {

TEST(AutoTransport, FallsBackToTcpOnlyWithoutRdma) {
  unsetenv("RDMARPC_NO_TCP_FALLBACK");
  if (transport::rdma::RdmaUsable()) {
    // With a device, auto:// listens over RDMA and TCP on one port, and
    // says auto:// (transport/auto_transport.h).
    EchoService service;
    auto server = ServerBuilder()
                      .AddListeningPort("auto://127.0.0.1:0")
                      .RegisterService(&service)
                      .BuildAndStart();
    if (server.ok()) {
      EXPECT_EQ((*server)->addresses()[0].rfind("auto://", 0), 0u);
    }
    return;
  }
  // Without one it listens over TCP alone until a device is usable, and
  // says auto:// too: what reaches it then and after.
  TestServer ts("auto://127.0.0.1:0");
  ASSERT_TRUE(ts.server);
  ASSERT_EQ(ts.address.rfind("auto://", 0), 0u) << ts.address;
  const std::string host_port = ts.address.substr(7);
  auto ch = Channel::Create(ts.address);
  ASSERT_TRUE(ch.ok()) << ch.status();
  ClientContext ctx;
  EchoRequest req;
  req.set_data("over the fallback");
  EchoResponse resp;
  Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.data(), "over the fallback");

  // A group's auto:// channels share a transport of their own kind, TCP
  // until a device is usable, beside tcp://'s.
  auto kind = transport::ResolveScheme("auto", "test");
  ASSERT_TRUE(kind.ok()) << kind.status();
  EXPECT_EQ(*kind, transport::kTcpUntilRdma);
  EXPECT_EQ(*transport::ResolveScheme(*kind, "test"), *kind);
  auto group = ChannelGroup::Create();
  ASSERT_TRUE(group.ok()) << group.status();
  for (const char* scheme : {"auto://", "tcp://", "auto://"}) {
    auto grouped = (*group)->NewChannel(scheme + host_port);
    ASSERT_TRUE(grouped.ok()) << grouped.status();
    EXPECT_TRUE(EchoOn(**grouped, "grouped").ok()) << scheme;
  }
}

TEST(AutoTransport, FallbackCanBeForbidden) {
  setenv("RDMARPC_NO_TCP_FALLBACK", "1", 1);
  auto ch = Channel::Create("auto://127.0.0.1:1");
  unsetenv("RDMARPC_NO_TCP_FALLBACK");
  if (transport::rdma::RdmaUsable()) {
    EXPECT_TRUE(ch.ok()) << ch.status();
  } else {
    ASSERT_FALSE(ch.ok());
    EXPECT_EQ(ch.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(ch.status().message().find("RDMARPC_NO_TCP_FALLBACK"), absl::string_view::npos)
        << ch.status();
  }
}

TEST(AutoTransport, FallbackCanBeForbiddenInCode) {
  unsetenv("RDMARPC_NO_TCP_FALLBACK");
  transport::TransportTunables no_fallback;
  no_fallback.tcp_fallback = false;
  ChannelOptions options;
  options.transport = no_fallback;
  auto ch = Channel::Create("auto://127.0.0.1:1", options);
  EchoService service;
  auto server = ServerBuilder()
                    .AddListeningPort("auto://127.0.0.1:0")
                    .RegisterService(&service)
                    .SetTransportTunables(no_fallback)
                    .BuildAndStart();
  if (transport::rdma::RdmaUsable()) {
    EXPECT_TRUE(ch.ok()) << ch.status();
    return;
  }
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ch.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(ch.status().message().find("tcp_fallback = false"), absl::string_view::npos)
      << ch.status();
  ASSERT_FALSE(server.ok()) << (*server)->addresses()[0];
  EXPECT_EQ(server.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(server.status().message().find("tcp_fallback = false"), absl::string_view::npos)
      << server.status();
}

}  // namespace
}  // namespace rdmarpc::testing
