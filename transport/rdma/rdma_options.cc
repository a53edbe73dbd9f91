#include "transport/rdma/rdma_options.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace rdmarpc::transport::rdma {
namespace {

template <typename T>
void FromEnv(const char* name, T* out) {
  if (const char* v = std::getenv(name); v && *v) *out = static_cast<T>(std::strtoull(v, nullptr, 10));
}

}  // namespace

RdmaOptions RdmaOptionsFromEnv() {
  RdmaOptions o;
  if (const char* mode = std::getenv("RDMARPC_RDMA_POLL")) {
    if (strcmp(mode, "busy") == 0) o.poll_mode = PollMode::kBusy;
    if (strcmp(mode, "event") == 0) o.poll_mode = PollMode::kEvent;
  }
  if (const char* dev = std::getenv("RDMARPC_RDMA_DEVICE")) o.device = dev;
  FromEnv("RDMARPC_RDMA_PORT", &o.device_port);
  if (const char* v = std::getenv("RDMARPC_RDMA_GID_INDEX"); v && *v) o.gid_index = std::atoi(v);
  FromEnv("RDMARPC_RDMA_SPIN_US", &o.spin_us);
  FromEnv("RDMARPC_RDMA_SLOT_SIZE", &o.slot_size);
  FromEnv("RDMARPC_RDMA_CREDITS", &o.credits);
  FromEnv("RDMARPC_RDMA_READ_THRESHOLD", &o.read_threshold);
  FromEnv("RDMARPC_RDMA_RELEASE_TIMEOUT_MS", &o.release_timeout_ms);
  FromEnv("RDMARPC_RDMA_PEER_TIMEOUT_MS", &o.peer_timeout_ms);
  FromEnv("RDMARPC_RDMA_KEEPALIVE_MS", &o.keepalive_ms);
  return o;
}

int AckTimeoutExponent(uint32_t peer_timeout_ms) {
  if (peer_timeout_ms == 0) return -1;
  const double per_try_us = peer_timeout_ms * 1000.0 / (kTransportRetries + 1);
  int e = 1;  // 0 would mean no timeout at all
  while (e < 31 && 4.096 * std::ldexp(1.0, e + 1) <= per_try_us) ++e;
  return e;
}

}  // namespace rdmarpc::transport::rdma
