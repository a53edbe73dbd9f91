// NewThread: a std::thread, or a status that says why none could be started.
//
// Why: std::thread's constructor throws std::system_error when the process
// may not have another thread (clone() fails with EAGAIN: a container's
// pids.max, `ulimit -u` for a user that is not root, the kernel's
// threads-max). The library answers with statuses, not exceptions, and much
// of it starts threads on threads of its own (a channel's connector, an
// endpoint's poller, made on the rdma_cm thread), where a throw ends the
// process. So every thread it starts comes from here, and a process at its
// limit gets an error that says which limit it is at and how to raise it:
//
//   absl::StatusOr<std::thread> t =
//       NewThread("rdma-poll", "the poller of rxe0", [this] { PollLoop(); });
//   if (!t.ok()) return t.status();
//   // RESOURCE_EXHAUSTED: "no thread for the poller of rxe0: Resource
//   // temporarily unavailable. This process runs 37 threads, and its cgroup
//   // /t allows 37 tasks (pids.max) ...: raise ..."
//   poller_ = *std::move(t);
//
// Each thread is named (`ps -L`, `top -H`, gdb and perf show it), so that
// one can tell the library's pollers, connectors and timers apart from each
// other and from the application's threads.
//
// What not to rely on: the limits named are those that could be read (a
// cgroup's pids.max where its file is visible), not every one the kernel
// applies.
#ifndef RDMARPC_BASE_NEW_THREAD_H_
#define RDMARPC_BASE_NEW_THREAD_H_

#include <cstddef>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmarpc {

// RESOURCE_EXHAUSTED: no thread for `what` (what it would have run, "the
// poller of rxe0"), with errno `err`, and the limits this process is at.
absl::Status NoThread(absl::string_view what, int err);

// The limits on this process's threads that are set, and how to raise them:
// "This process runs 37 threads, and its cgroup /t allows 37 tasks
// (pids.max) ...". Empty when none could be read.
std::string ThreadLimitAdvice();

// A thread's name: a string literal of at most 15 characters, the kernel's
// limit (TASK_COMM_LEN less the NUL), checked where it is written.
class ThreadName {
 public:
  template <size_t N>
  constexpr ThreadName(const char (&name)[N]) : name_(name) {  // NOLINT: implicit by design
    static_assert(N <= 16, "a thread's name has at most 15 characters");
  }
  const char* c_str() const { return name_; }

 private:
  const char* name_;
};

// Gives the calling thread `name`.
void NameThisThread(ThreadName name);

// Starts `body` on a new thread named `name`, or says why it could not
// (NoThread).
template <typename F>
absl::StatusOr<std::thread> NewThread(ThreadName name, absl::string_view what, F&& body) {
  try {
    return std::thread([name, body = std::forward<F>(body)]() mutable {
      NameThisThread(name);
      body();
    });
  } catch (const std::system_error& e) {
    return NoThread(what, e.code().value());
  }
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_NEW_THREAD_H_
