// Which sanitizer this translation unit is built with, as one macro each, for
// GCC (__SANITIZE_THREAD__) and Clang (__has_feature) alike:
//
//   #include "base/sanitizers.h"
//   #ifdef RDMARPC_TSAN
//   ... code or limits that only a TSan build needs ...
//   #endif
#ifndef RDMARPC_BASE_SANITIZERS_H_
#define RDMARPC_BASE_SANITIZERS_H_

#if defined(__SANITIZE_THREAD__)
#define RDMARPC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RDMARPC_TSAN 1
#endif
#endif

#endif  // RDMARPC_BASE_SANITIZERS_H_
