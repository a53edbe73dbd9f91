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
//   absl::StatusOr<std::thread> t = NewThread("the poller of rxe0", [this] { PollLoop(); });
//   if (!t.ok()) return t.status();
//   // RESOURCE_EXHAUSTED: "no thread for the poller of rxe0: Resource
//   // temporarily unavailable. This process runs 37 threads, and its cgroup
//   // /t allows 37 tasks (pids.max) ...: raise ..."
//   poller_ = *std::move(t);
//
// What not to rely on: the limits named are those that could be read (a
// cgroup's pids.max where its file is visible), not every one the kernel
// applies.
#ifndef RDMARPC_BASE_NEW_THREAD_H_
#define RDMARPC_BASE_NEW_THREAD_H_

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

// Starts `body` on a new thread, or says why it could not (NoThread).
template <typename F>
absl::StatusOr<std::thread> NewThread(absl::string_view what, F&& body) {
  try {
    return std::thread(std::forward<F>(body));
  } catch (const std::system_error& e) {
    return NoThread(what, e.code().value());
  }
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_NEW_THREAD_H_
