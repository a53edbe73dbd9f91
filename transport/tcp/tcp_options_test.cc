// TcpOptionsFromEnv: the environment overrides TCP's keepalive options, only
// where set, and a value that is not a number changes nothing.
#include <cstdlib>

#include "gtest/gtest.h"
#include "transport/tcp/tcp_options.h"

namespace rdmarpc::transport {
namespace {

TcpOptions Base() {
  TcpOptions o;
  o.keepalive_ms = 1000;
  o.peer_timeout_ms = 2000;
  return o;
}

TEST(TcpOptionsFromEnv, OverridesOnlyWhatIsSet) {
  unsetenv("RDMARPC_TCP_KEEPALIVE_MS");
  unsetenv("RDMARPC_TCP_PEER_TIMEOUT_MS");
  TcpOptions o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.keepalive_ms, 1000u);
  EXPECT_EQ(o.peer_timeout_ms, 2000u);

  setenv("RDMARPC_TCP_PEER_TIMEOUT_MS", "30000", 1);
  o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.keepalive_ms, 1000u);
  EXPECT_EQ(o.peer_timeout_ms, 30000u);

  setenv("RDMARPC_TCP_KEEPALIVE_MS", "0", 1);  // 0: the kernel's keepalive
  o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.keepalive_ms, 0u);
  EXPECT_EQ(o.peer_timeout_ms, 30000u);
  unsetenv("RDMARPC_TCP_KEEPALIVE_MS");
  unsetenv("RDMARPC_TCP_PEER_TIMEOUT_MS");

  EXPECT_EQ(o.max_queued_send_bytes, size_t{256} << 20);
  setenv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES", "8388608", 1);
  o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.max_queued_send_bytes, size_t{8} << 20);
  EXPECT_EQ(o.keepalive_ms, 1000u);
  unsetenv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES");

  EXPECT_EQ(o.max_queued_send_bytes_total, size_t{1} << 30);
  setenv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES_TOTAL", "33554432", 1);
  o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.max_queued_send_bytes_total, size_t{32} << 20);
  EXPECT_EQ(o.max_queued_send_bytes, size_t{256} << 20);
  unsetenv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES_TOTAL");

  EXPECT_EQ(o.max_receive_bytes, size_t{1} << 30);
  setenv("RDMARPC_TCP_MAX_RECEIVE_BYTES", "16777216", 1);
  o = TcpOptionsFromEnv(Base());
  EXPECT_EQ(o.max_receive_bytes, size_t{16} << 20);
  EXPECT_EQ(o.max_queued_send_bytes, size_t{256} << 20);
  unsetenv("RDMARPC_TCP_MAX_RECEIVE_BYTES");
}

// strtoull would read "2s" as 2 and "soon" as 0, which would silently turn
// the dead-peer timeout off; a malformed value keeps the option instead.
TEST(TcpOptionsFromEnv, MalformedValuesChangeNothing) {
  for (const char* bad : {"soon", "2s", "-1", "99999999999"}) {
    setenv("RDMARPC_TCP_PEER_TIMEOUT_MS", bad, 1);
    EXPECT_EQ(TcpOptionsFromEnv(Base()).peer_timeout_ms, 2000u) << bad;
  }
  unsetenv("RDMARPC_TCP_PEER_TIMEOUT_MS");
}

}  // namespace
}  // namespace rdmarpc::transport
