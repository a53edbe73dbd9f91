// RunOnOwnThread: work that cannot run where it is started, on a thread of its
// own that the process joins when it exits.
//
//   internal::RunOnOwnThread([c] { delete c; });
//
// A channel dropped in its own inline callback is the case: its destructor
// waits for the very thread that callback runs on. A detached thread would
// do, but a process that exits meanwhile (its main returning right after the
// callback) would cut the destructor short while static objects are torn
// down. These threads are joined instead, by a static object that is
// constructed at the first call, so it is destroyed before the statics in
// use by then.
//
// What not to rely on: work still running at exit delays the exit until it
// ends; work started after that join has begun is detached. Work that finds
// no thread (the process at its limit, base/new_thread.h) is said on
// stderr and runs with the next work that gets one, or at exit.
#ifndef RDMARPC_RPC_INTERNAL_OWN_THREAD_H_
#define RDMARPC_RPC_INTERNAL_OWN_THREAD_H_

#include "absl/functional/any_invocable.h"

namespace rdmarpc::internal {

void RunOnOwnThread(absl::AnyInvocable<void() &&> work);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_OWN_THREAD_H_
