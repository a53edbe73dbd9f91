#include "transport/rdma/rdma_options.h"

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
  return o;
}

}  // namespace rdmarpc::transport::rdma
