// ProcessCpuTime: the CPU time the whole process has used, for tests that
// check a wait sleeps rather than spins. That bounds CPU, not speed: a
// sleeping wait uses next to none, a spinning one a core.
//
//   const absl::Duration before = ProcessCpuTime();
//   ... 500 ms of waiting that should sleep ...
//   EXPECT_LT(ProcessCpuTime() - before, absl::Milliseconds(250));
#ifndef RDMARPC_BASE_CPU_TIME_H_
#define RDMARPC_BASE_CPU_TIME_H_

#include <time.h>

#include "absl/time/time.h"

namespace rdmarpc {

inline absl::Duration ProcessCpuTime() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return absl::DurationFromTimespec(t);
}

}  // namespace rdmarpc

#endif  // RDMARPC_BASE_CPU_TIME_H_
