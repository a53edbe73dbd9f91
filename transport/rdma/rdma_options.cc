#include "transport/rdma/rdma_options.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "transport/env_override.h"

namespace rdmarpc::transport::rdma {

size_t InitialCqEntries(const RdmaOptions& options, bool listening) {
  if (options.cq_entries != 0) return options.cq_entries;
  if (listening) return kListeningCqEntries;
  return options.client_receive_slots + 2 * SendQueueDepth(options, options.max_reads_in_flight);
}

RdmaOptions RdmaOptionsFromEnv(RdmaOptions o) {
  if (const char* mode = std::getenv("RDMARPC_RDMA_POLL"); mode && *mode) {
    if (strcmp(mode, "adaptive") == 0) {
      o.poll_mode = PollMode::kAdaptive;
    } else if (strcmp(mode, "busy") == 0) {
      o.poll_mode = PollMode::kBusy;
    } else if (strcmp(mode, "event") == 0) {
      o.poll_mode = PollMode::kEvent;
    } else {
      fprintf(stderr,
              "rdmarpc: ignoring RDMARPC_RDMA_POLL=\"%s\": not adaptive, busy or event\n",
              mode);
    }
  }
  if (const char* dev = std::getenv("RDMARPC_RDMA_DEVICE")) o.device = dev;
  OverrideFromEnv("RDMARPC_RDMA_PORT", &o.device_port);
  OverrideFromEnv("RDMARPC_RDMA_GID_INDEX", &o.gid_index);
  OverrideFromEnv("RDMARPC_RDMA_TOS", &o.type_of_service);
  OverrideFromEnv("RDMARPC_RDMA_SPIN_US", &o.spin_us);
  OverrideFromEnv("RDMARPC_RDMA_SLOT_SIZE", &o.slot_size);
  OverrideFromEnv("RDMARPC_RDMA_CREDITS", &o.credits);
  OverrideFromEnv("RDMARPC_RDMA_MAX_BACKLOG_BYTES", &o.max_backlog_bytes);
  OverrideFromEnv("RDMARPC_RDMA_MAX_BACKLOG_BYTES_TOTAL", &o.max_backlog_bytes_total);
  OverrideFromEnv("RDMARPC_RDMA_READ_THRESHOLD", &o.read_threshold);
  OverrideFromEnv("RDMARPC_RDMA_RELEASE_TIMEOUT_MS", &o.release_timeout_ms);
  OverrideFromEnv("RDMARPC_RDMA_PEER_TIMEOUT_MS", &o.peer_timeout_ms);
  OverrideFromEnv("RDMARPC_RDMA_RNR_WAIT_US", &o.rnr_wait_us);
  OverrideFromEnv("RDMARPC_RDMA_KEEPALIVE_MS", &o.keepalive_ms);
  OverrideFromEnv("RDMARPC_RDMA_ACCEPT_TIMEOUT_MS", &o.accept_timeout_ms);
  if (uint32_t strict = 0; OverrideFromEnv("RDMARPC_RDMA_STRICT_CREDITS", &strict)) {
    o.strict_credits = strict != 0;
  }
  if (uint32_t trace = 0; OverrideFromEnv("RDMARPC_RDMA_TRACE", &trace)) o.trace = trace != 0;
  return o;
}

void TraceLine(const std::string& name, const std::string& what) {
  fprintf(stderr, "rdmarpc[%s] trace: %s\n", name.c_str(), what.c_str());
}

absl::Status CheckRdmaOptions(const RdmaOptions& o, bool listening) {
  const auto bad = [](const char* option, const char* env, auto value, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("RdmaOptions::", option, env, " is ", value,
                                                   ": ", why));
  };
  if (o.slot_size < kMinSlotSize || o.slot_size > std::numeric_limits<uint32_t>::max()) {
    return bad("slot_size", " (RDMARPC_RDMA_SLOT_SIZE)", o.slot_size,
               absl::StrCat("a slot holds the ", kHeaderSize,
                            "-byte header and metadata, so it must be from ", kMinSlotSize,
                            " to 4 GiB - 1 bytes (default 8192)"));
  }
  if (o.server_receive_slots == 0) {
    return bad("server_receive_slots", "", 0, "nothing could ever be received");
  }
  if (o.client_receive_slots == 0) {
    return bad("client_receive_slots", "", 0, "nothing could ever be received");
  }
  // Receive slots are numbered by 32 bits, and each has a 4-byte link in the
  // endpoint's free stack, allocated up front.
  constexpr size_t kMaxSlots = std::numeric_limits<uint32_t>::max();
  const size_t most = std::max(o.server_receive_slots, o.client_receive_slots);
  if (o.max_held_slots >= kMaxSlots - most) {
    return bad("max_held_slots", "", o.max_held_slots,
               absl::StrCat("with ", most, " receive slots posted that exceeds the ", kMaxSlots,
                            " slots an endpoint can number (default 4096)"));
  }
  if (o.send_slots == 0) {
    return bad("send_slots", "", 0, "a message too large to go inline could never be sent");
  }
  if (o.credits == 0) {
    return bad("credits", " (RDMARPC_RDMA_CREDITS)", 0, "a peer could never send anything");
  }
  if (o.max_completion_queues == 0 || o.max_completion_queues > kMaxCompletionQueues) {
    return bad("max_completion_queues", "", o.max_completion_queues,
               absl::StrCat("it must be from 1 to ", kMaxCompletionQueues, " (default 8)"));
  }
  // A CQ holds room for the receives the SRQ keeps posted and, per
  // connection, its whole send queue (endpoint.h); with one READ in flight
  // the queue is shortest.
  const size_t receives = listening ? o.server_receive_slots : o.client_receive_slots;
  const size_t least = receives + SendQueueDepth(o, 1);
  if (o.max_cq_entries != 0 && o.max_cq_entries < least) {
    return bad(
        "max_cq_entries", "", o.max_cq_entries,
        absl::StrCat("a completion queue must hold the ", receives, " receives kept posted (",
                     listening ? "server" : "client", "_receive_slots) and a connection's ",
                     least - receives, " send queue entries or more: at least ", least,
                     ", or 0 for the device's max_cqe"));
  }
  if (o.gid_index < -1) {
    return bad("gid_index", " (RDMARPC_RDMA_GID_INDEX)", o.gid_index,
               "a GID table index is from 0, and -1 lets rdma_cm choose");
  }
  if (o.type_of_service < -1 || o.type_of_service > 255) {
    return bad("type_of_service", " (RDMARPC_RDMA_TOS)", o.type_of_service,
               "it is one byte, 0 to 255 (DSCP << 2 | ECN on RoCE v2), or -1 for rdma_cm's "
               "default");
  }
  if (o.rnr_wait_us == 0 || o.rnr_wait_us > kLongestRnrWaitUs) {
    return bad(
        "rnr_wait_us", " (RDMARPC_RDMA_RNR_WAIT_US)", o.rnr_wait_us,
        absl::StrCat("the RNR NAK timer runs from 1 to ", kLongestRnrWaitUs, " us (default 640)"));
  }
  if (o.connect_timeout_ms == 0 ||
      o.connect_timeout_ms > static_cast<uint32_t>(std::numeric_limits<int>::max())) {
    return bad("connect_timeout_ms", "", o.connect_timeout_ms,
               "rdma_cm resolves addresses and routes within 1 to 2147483647 ms (default 10000)");
  }
  return absl::OkStatus();
}

namespace {

// IBA's RNR NAK timer table (volume 1, table 45): code i waits
// kRnrWaits[i] us; code 0 is 655.36 ms, out of order, and never chosen.
constexpr uint32_t kRnrWaits[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                    160,    240,   320,   480,    640,    960,    1280,   1920,
                                    2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                    40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};
static_assert(kRnrWaits[31] == kLongestRnrWaitUs);

}  // namespace

uint8_t RnrTimerCode(uint32_t wait_us) {
  uint8_t code = 1;
  while (code < 31 && kRnrWaits[code] < wait_us) ++code;
  return code;
}

uint32_t RnrTimerMicros(uint8_t code) { return kRnrWaits[code & 31]; }

int AckTimeoutExponent(uint32_t peer_timeout_ms) {
  if (peer_timeout_ms == 0) return -1;
  const double per_try_us = peer_timeout_ms * 1000.0 / (kTransportRetries + 1);
  int e = 1;  // 0 would mean no timeout at all
  while (e < 31 && 4.096 * std::ldexp(1.0, e + 1) <= per_try_us) ++e;
  return e;
}

}  // namespace rdmarpc::transport::rdma
