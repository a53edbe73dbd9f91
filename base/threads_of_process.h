// ThreadsOfThisProcess: the threads this process runs now, with the names
// NewThread gave them (base/new_thread.h), read from /proc/self/task. For
// tests that check a component started, ended or left no thread behind:
//
//   const size_t before = ThreadIdsOfThisProcess().size();
//   ... make and drop a channel ...
//   EXPECT_EQ(ThreadIdsOfThisProcess().size(), before);
//   EXPECT_EQ(ThreadsNamed("rpc-connector"), 0);
//
// What not to rely on: it is a snapshot; a thread that ends on its own (a
// connector once nothing waits) may be listed a moment after its work is
// done, so tests poll it with a deadline.
#ifndef RDMARPC_BASE_THREADS_OF_PROCESS_H_
#define RDMARPC_BASE_THREADS_OF_PROCESS_H_

#include <dirent.h>
#include <sys/types.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace rdmarpc {

// The ids of the threads, without reading their names: cheaper, for tests
// that list them often.
inline std::vector<pid_t> ThreadIdsOfThisProcess() {
  std::vector<pid_t> tids;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return tids;
  while (const dirent* e = readdir(d)) {
    const pid_t tid = static_cast<pid_t>(atoi(e->d_name));
    if (tid > 0) tids.push_back(tid);
  }
  closedir(d);
  return tids;
}

struct ThreadOfProcess {
  pid_t tid;
  std::string name;  // "" where it ended as it was listed
};

inline std::vector<ThreadOfProcess> ThreadsOfThisProcess() {
  std::vector<ThreadOfProcess> threads;
  for (const pid_t tid : ThreadIdsOfThisProcess()) {
    std::ifstream comm(absl::StrCat("/proc/self/task/", tid, "/comm"));
    std::string name;
    std::getline(comm, name);
    threads.push_back({tid, std::move(name)});
  }
  return threads;
}

inline int ThreadsNamed(absl::string_view name) {
  int n = 0;
  for (const ThreadOfProcess& t : ThreadsOfThisProcess()) n += t.name == name;
  return n;
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_THREADS_OF_PROCESS_H_
