#include "transport/tcp/tcp_options.h"

#include "transport/env_override.h"

namespace rdmarpc::transport {

TcpOptions TcpOptionsFromEnv(TcpOptions options) {
  OverrideFromEnv("RDMARPC_TCP_KEEPALIVE_MS", &options.keepalive_ms);
  OverrideFromEnv("RDMARPC_TCP_PEER_TIMEOUT_MS", &options.peer_timeout_ms);
  OverrideFromEnv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES", &options.max_queued_send_bytes);
  OverrideFromEnv("RDMARPC_TCP_MAX_QUEUED_SEND_BYTES_TOTAL", &options.max_queued_send_bytes_total);
  OverrideFromEnv("RDMARPC_TCP_MAX_RECEIVE_BYTES", &options.max_receive_bytes);
  return options;
}

}  // namespace rdmarpc::transport
