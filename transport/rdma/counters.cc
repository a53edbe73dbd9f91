#include "transport/rdma/counters.h"

#include <dirent.h>

#include <cstdio>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::rdma {
namespace {

std::mutex& DevicesMu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::set<std::string>& Devices() {  // guarded by DevicesMu()
  static auto* devices = new std::set<std::string>;
  return *devices;
}

// Adds the value of hw counter `name` on every port of `device` to `*sum`,
// which stays -1 when no port has it.
void AddPortCounter(const std::string& device, const char* name, int64_t* sum) {
  const std::string ports = "/sys/class/infiniband/" + device + "/ports";
  DIR* dir = opendir(ports.c_str());
  if (dir == nullptr) return;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const std::string path = absl::StrCat(ports, "/", e->d_name, "/hw_counters/", name);
    FILE* f = fopen(path.c_str(), "r");
    if (f == nullptr) continue;
    unsigned long long v = 0;
    if (fscanf(f, "%llu", &v) == 1) *sum = (*sum < 0 ? 0 : *sum) + static_cast<int64_t>(v);
    fclose(f);
  }
  closedir(dir);
}

std::string Show(int64_t v) { return v < 0 ? "n/a" : absl::StrCat(v); }

}  // namespace

RdmaCounters& MutableCounters() {
  static RdmaCounters* counters = new RdmaCounters;
  return *counters;
}

const RdmaCounters& Counters() { return MutableCounters(); }

void NoteDeviceInUse(const std::string& device) {
  std::lock_guard<std::mutex> lock(DevicesMu());
  Devices().insert(device);
}

DeviceRnrNaks ReadDeviceRnrNaks() {
  std::set<std::string> devices;
  {
    std::lock_guard<std::mutex> lock(DevicesMu());
    devices = Devices();
  }
  DeviceRnrNaks naks;
  for (const std::string& d : devices) {
    AddPortCounter(d, "rcvd_rnr_err", &naks.received);  // rxe
    AddPortCounter(d, "send_rnr_err", &naks.sent);      // rxe
    AddPortCounter(d, "out_of_buffer", &naks.sent);     // mlx5
  }
  return naks;
}

std::string RdmaCounters::ToString() const {
  const DeviceRnrNaks naks = ReadDeviceRnrNaks();
  return absl::StrCat(
      "sends=", sends.load(), " (inline ", sends_inline.load(),
      ", payload copied ", send_payload_copies.load(), ") reads=", reads.load(),
      " bytes_read=", bytes_read.load(), " advertised=", payloads_advertised.load(),
      " (copied ", advertised_payload_copies.load(), ")",
      " releases_expired=", releases_expired.load(), " late_reads_skipped=",
      late_reads_skipped.load(),
      " srq_posted=", srq_slots_posted.load(), " srq_consumed=", srq_slots_consumed.load(),
      " srq_short=", srq_short.load(), " device_rnr_naks_received=", Show(naks.received),
      " device_rnr_naks_sent=", Show(naks.sent),
      " rnr_retry_exhausted=", rnr_retry_exhausted.load(),
      " credit_stalls=", credit_stalls.load(), " credit_msgs=", credit_messages.load(),
      " keepalives=", keepalives.load(),
      " conns_opened=", connections_opened.load(), " conns_closed=", connections_closed.load(),
      " registered_bytes=", registered_bytes.load(), " poller_sleeps=", poller_sleeps.load(),
      " caller_completions=", caller_completions.load());
}

}  // namespace rdmarpc::transport::rdma
