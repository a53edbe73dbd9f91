// FallbackMemory: the auto:// targets that RDMA could not reach and TCP
// could, lately, for the whole process. A host without RDMA never answers
// rdma_cm, so an auto:// connect to it waits half its timeout before it
// tries TCP (auto_transport.h); with this memory only the first connection
// in a while pays that, and the next ones (a channel reconnecting after a
// restart, a channel per request) go straight to TCP.
//
//   FallbackMemory& memory = FallbackMemory::Process();
//   if (memory.FellBackWithin(target, absl::Seconds(60), SteadyNow())) { ... TCP first ... }
//   memory.Remember(target, SteadyNow());  // after a fallback to TCP that worked
//
// What not to rely on: it forgets at will (all of it beyond kMaxTargets
// targets); forgetting costs one slow connect, never a wrong one. A
// target is the address as written (auto://host:port), so two names of one
// host are two targets. Times are SteadyNow()'s.
#ifndef RDMARPC_TRANSPORT_FALLBACK_MEMORY_H_
#define RDMARPC_TRANSPORT_FALLBACK_MEMORY_H_

#include <cstddef>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "absl/time/time.h"

namespace rdmarpc::transport {

class FallbackMemory {
 public:
  // Beyond this many targets the memory starts again, empty: a process
  // that talks to more hosts without RDMA than this pays the slow connect
  // again, and its memory stays bounded.
  static constexpr size_t kMaxTargets = 4096;

  // Whether a fallback to `target` worked less than `window` before `now`.
  bool FellBackWithin(const std::string& target, absl::Duration window, absl::Time now) const;
  // A fallback to `target` worked at `now`. An entry is not renewed by
  // connections that used it: once its window has passed, the next
  // connection tries RDMA first again, so a peer that gains RDMA is used.
  void Remember(const std::string& target, absl::Time now);
  // TCP failed where it had worked: the next connection tries RDMA first.
  void Forget(const std::string& target);
  // True the first time for `target`, so that the fallback's log line is
  // printed once per target per process.
  bool FirstMention(const std::string& target);

  static FallbackMemory& Process();

 private:
  mutable std::mutex mu_;
  std::map<std::string, absl::Time> fell_back_at_;  // guarded by mu_
  std::set<std::string> mentioned_;                 // guarded by mu_
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_FALLBACK_MEMORY_H_
