#include "base/new_thread.h"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rdmarpc {
namespace {

std::optional<std::string> ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<long long> ReadNumber(const std::string& path) {
  const std::optional<std::string> line = ReadLine(path);
  long long n = 0;
  if (!line || !absl::SimpleAtoi(*line, &n)) return std::nullopt;
  return n;
}

std::optional<long long> ThreadsOfThisProcess() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    absl::string_view rest = line;
    long long n = 0;
    if (absl::ConsumePrefix(&rest, "Threads:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &n)) {
      return n;
    }
  }
  return std::nullopt;
}

// The pids controller's directory of this process's cgroup: cgroup v2's
// unified tree, or v1's pids hierarchy.
std::optional<std::pair<std::string, std::string>> PidsCgroup() {
  std::ifstream in("/proc/self/cgroup");
  std::optional<std::pair<std::string, std::string>> found;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[1] == "pids") return std::make_pair("/sys/fs/cgroup/pids", f[2]);
    if (f[0] == "0" && f[1].empty()) found = std::make_pair("/sys/fs/cgroup", f[2]);
  }
  return found;
}

// The cgroup, from this process's up, whose pids.max is nearest to being
// reached, as "its cgroup /t allows 37 tasks (pids.max), and has 37".
std::string CgroupLimit() {
  const auto cgroup = PidsCgroup();
  if (!cgroup) return "";
  const auto& [root, own] = *cgroup;
  std::string best;
  long long best_room = 0;
  for (std::string path = own;;) {
    const std::string dir = root + (path == "/" ? "" : path);
    const std::optional<long long> max = ReadNumber(dir + "/pids.max");  // "max": none
    const std::optional<long long> current = ReadNumber(dir + "/pids.current");
    if (max) {
      const long long room = current ? *max - *current : *max;
      if (best.empty() || room < best_room) {
        best_room = room;
        best = absl::StrCat(path == own ? "its cgroup " : "its cgroup's ancestor ", path,
                            " allows ", *max, " tasks in all (", dir, "/pids.max",
                            current ? absl::StrCat(", now at ", *current) : "", ")");
      }
    }
    if (path == "/" || path.empty()) break;
    const size_t slash = path.rfind('/');
    path = slash == 0 ? "/" : path.substr(0, slash);
  }
  return best;
}

}  // namespace

std::string ThreadLimitAdvice() {
  std::vector<std::string> limits;
  if (std::string cgroup = CgroupLimit(); !cgroup.empty()) {
    limits.push_back(absl::StrCat(cgroup, ", a container's pids limit"));
  }
  rlimit nproc{};
  if (geteuid() != 0 && getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY) {
    limits.push_back(absl::StrCat("`ulimit -u` allows its user ", nproc.rlim_cur,
                                  " processes and threads in all"));
  }
  if (const std::optional<long long> max = ReadNumber("/proc/sys/kernel/threads-max")) {
    limits.push_back(
        absl::StrCat("the kernel allows ", *max, " threads in all (kernel.threads-max)"));
  }
  const std::optional<long long> threads = ThreadsOfThisProcess();
  if (limits.empty() && !threads) return "";
  std::string out =
      threads ? absl::StrCat("This process runs ", *threads, *threads == 1 ? " thread" : " threads")
              : std::string("This process may run no more threads");
  if (!limits.empty()) absl::StrAppend(&out, "; ", absl::StrJoin(limits, "; "));
  absl::StrAppend(&out, ". Raise the limit it reached, or run fewer threads in it.");
  return out;
}

void NameThisThread(ThreadName name) { pthread_setname_np(pthread_self(), name.c_str()); }

absl::Status NoThread(absl::string_view what, int err) {
  std::string message = absl::StrCat("no thread for ", what, ": ", strerror(err));
  if (const std::string advice = ThreadLimitAdvice(); !advice.empty()) {
    absl::StrAppend(&message, ". ", advice);
  }
  return absl::ResourceExhaustedError(message);
}

}  // namespace rdmarpc
