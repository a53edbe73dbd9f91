#include "transport/rdma/locked_memory.h"

#include <linux/capability.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace rdmarpc::transport::rdma {
namespace {

// A "Key:  value" line of /proc/self/status, its value; empty if absent.
std::string StatusField(absl::string_view key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, key) && absl::ConsumePrefix(&rest, ":")) {
      return std::string(absl::StripAsciiWhitespace(rest));
    }
  }
  return "";
}

bool HasIpcLock() {
  uint64_t effective = 0;
  return absl::SimpleHexAtoi(StatusField("CapEff"), &effective) &&
         (effective >> CAP_IPC_LOCK & 1) != 0;
}

std::string Mebibytes(size_t bytes) {
  if (bytes % (1 << 20) == 0) return absl::StrCat(bytes >> 20, " MiB");
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

std::optional<size_t> LockedMemoryLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY)
    return std::nullopt;
  if (HasIpcLock()) return std::nullopt;
  return static_cast<size_t>(limit.rlim_cur);
}

size_t PinnedBytes() {
  // "VmPin:       128 kB"
  const std::string value = StatusField("VmPin");
  size_t kib = 0;
  if (!absl::SimpleAtoi(absl::StripSuffix(value, " kB"), &kib)) return 0;
  return kib << 10;
}

std::string LockedMemoryAdvice() {
  const std::optional<size_t> limit = LockedMemoryLimit();
  if (!limit) {
    return "registrations are not limited by `ulimit -l` here: the machine is short of "
           "memory it can pin";
  }
  return absl::StrCat("the locked-memory limit is ", Mebibytes(*limit), ", ",
                      Mebibytes(PinnedBytes()),
                      " of it pinned now: raise `ulimit -l` (memlock in "
                      "/etc/security/limits.conf; LimitMEMLOCK= for a systemd service), or grant "
                      "CAP_IPC_LOCK");
}

std::string LockedMemoryNotice() {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return "";
  const std::optional<size_t> limit = LockedMemoryLimit();
  if (!limit) return "";
  return absl::StrCat(
      "registered memory is limited to ", Mebibytes(*limit), " by `ulimit -l` (no CAP_IPC_LOCK), ",
      Mebibytes(PinnedBytes()),
      " of it pinned now. A payload sent by READ needs a registered buffer of up to 1.25 times "
      "its size at each end, and a call whose buffers do not fit fails RESOURCE_EXHAUSTED: raise "
      "memlock in /etc/security/limits.conf (LimitMEMLOCK= for a systemd service)");
}

}  // namespace rdmarpc::transport::rdma
