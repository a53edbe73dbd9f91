#include "transport/rdma/counters.h"

#include <dirent.h>

#include <cstdio>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

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

using Shards = base::ShardedCounts<RdmaCounters>;
// Each field under its own name.
#define RDMARPC_COUNTER(f) \
  { #f, &RdmaCounters::f }
constexpr Shards::NamedField kFields[] = {
    RDMARPC_COUNTER(sends),
    RDMARPC_COUNTER(sends_inline),
    RDMARPC_COUNTER(sends_in_place),
    RDMARPC_COUNTER(send_payload_copies),
    RDMARPC_COUNTER(reads),
    RDMARPC_COUNTER(bytes_read),
    RDMARPC_COUNTER(payloads_advertised),
    RDMARPC_COUNTER(advertised_payload_copies),
    RDMARPC_COUNTER(releases_expired),
    RDMARPC_COUNTER(late_reads_skipped),
    RDMARPC_COUNTER(srq_slots_posted),
    RDMARPC_COUNTER(srq_slots_consumed),
    RDMARPC_COUNTER(srq_short),
    RDMARPC_COUNTER(rnr_retry_exhausted),
    RDMARPC_COUNTER(credit_stalls),
    RDMARPC_COUNTER(credit_messages),
    RDMARPC_COUNTER(backlog_refusals),
    RDMARPC_COUNTER(credit_shrinks),
    RDMARPC_COUNTER(credit_shrinks_overdue),
    RDMARPC_COUNTER(frames_without_credit),
    RDMARPC_COUNTER(unwarranted_control_frames),
    RDMARPC_COUNTER(keepalives),
    RDMARPC_COUNTER(keepalives_behind_reads),
    RDMARPC_COUNTER(connections_opened),
    RDMARPC_COUNTER(connections_closed),
    RDMARPC_COUNTER(accepts_unfinished),
    RDMARPC_COUNTER(registered_bytes),
    RDMARPC_COUNTER(poller_sleeps),
    RDMARPC_COUNTER(caller_completions),
    RDMARPC_COUNTER(device_events),
};
#undef RDMARPC_COUNTER
static_assert(Shards::ListsEveryFieldOnce(kFields),
              "kFields must list every field of RdmaCounters once");

}  // namespace

RdmaCounters Counters() { return Shards::Sum(kFields); }

std::vector<std::pair<std::string, uint64_t>> RdmaCounters::Named() const {
  return Shards::Named(*this, kFields);
}

std::vector<std::string> DevicesInUse() {
  std::lock_guard<std::mutex> lock(DevicesMu());
  return std::vector<std::string>(Devices().begin(), Devices().end());
}

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
      "sends=", sends, " (inline ", sends_inline, ", in place ", sends_in_place,
      ", payload copied ", send_payload_copies, ") reads=", reads, " bytes_read=", bytes_read,
      " advertised=", payloads_advertised, " (copied ", advertised_payload_copies, ")",
      " releases_expired=", releases_expired, " late_reads_skipped=", late_reads_skipped,
      " srq_posted=", srq_slots_posted, " srq_consumed=", srq_slots_consumed,
      " srq_short=", srq_short, " device_rnr_naks_received=", Show(naks.received),
      " device_rnr_naks_sent=", Show(naks.sent), " rnr_retry_exhausted=", rnr_retry_exhausted,
      " credit_stalls=", credit_stalls, " credit_msgs=", credit_messages,
      " backlog_refusals=", backlog_refusals, " credit_shrinks=", credit_shrinks, " (overdue ",
      credit_shrinks_overdue, ")", " frames_without_credit=", frames_without_credit,
      " unwarranted_control_frames=", unwarranted_control_frames, " keepalives=", keepalives,
      " (behind reads ", keepalives_behind_reads, ")", " conns_opened=", connections_opened,
      " conns_closed=", connections_closed, " (unfinished accepts ", accepts_unfinished, ")",
      " registered_bytes=", registered_bytes, " poller_sleeps=", poller_sleeps,
      " caller_completions=", caller_completions, " device_events=", device_events);
}

}  // namespace rdmarpc::transport::rdma
