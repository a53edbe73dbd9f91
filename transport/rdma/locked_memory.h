// LockedMemory: what the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`)
// leaves for registrations. Every ibv_reg_mr pins its pages, and a process
// without CAP_IPC_LOCK may pin no more than the limit in all: Debian gives
// users (and systemd services) 8 MiB, less than a server's receive slots
// and a few large calls' buffers need. Root, and any process with
// CAP_IPC_LOCK, is not limited.
//
//   if (std::optional<size_t> limit = LockedMemoryLimit()) {
//     ... at most *limit bytes may be registered, PinnedBytes() of it now
//   }
//
// What not to rely on: the pinned figure is the whole process's (other
// libraries register too) and changes as they do; it is for messages.
#ifndef RDMARPC_TRANSPORT_RDMA_LOCKED_MEMORY_H_
#define RDMARPC_TRANSPORT_RDMA_LOCKED_MEMORY_H_

#include <cstddef>
#include <optional>
#include <string>

namespace rdmarpc::transport::rdma {

// The soft RLIMIT_MEMLOCK in bytes, or nothing when registrations are not
// limited by it (unlimited, or the process has CAP_IPC_LOCK).
std::optional<size_t> LockedMemoryLimit();

// The memory the process has pinned now (VmPin in /proc/self/status, which
// counts registrations); 0 when the kernel does not say.
size_t PinnedBytes();

// For a registration that failed with ENOMEM: what limited it and how to
// raise it, e.g. "the locked-memory limit is 8 MiB, 7.5 MiB of it pinned
// now: raise `ulimit -l` (...)"; or, not limited, that the machine is short
// of memory it can pin.
std::string LockedMemoryAdvice();

// Once per process, for the first endpoint: when registrations are limited,
// a line that says by how much and what that means for large calls; else
// empty.
std::string LockedMemoryNotice();

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_LOCKED_MEMORY_H_
