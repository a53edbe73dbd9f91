// RunUserCode: runs code of the program's (a handler, an interceptor, an
// OnCancel callback) where an exception out of it would otherwise end the
// process: on a worker, the I/O thread or the timer thread. The exception is
// logged on stderr and goes no further; the caller decides what the call
// gets (UnaryHandler's `done` answers it UNKNOWN, a refusing interceptor
// refuses it).
//
//   if (!internal::RunUserCode("an interceptor's OnRequest", method, [&] {
//         admitted = interceptor->OnRequest(ctx);
//       })) {
//     admitted = Status(StatusCode::kUnknown, ...);
//   }
//
// Built without exceptions (-fno-exceptions), it just runs the code.
#ifndef RDMARPC_RPC_INTERNAL_USER_CODE_H_
#define RDMARPC_RPC_INTERNAL_USER_CODE_H_

#include <cstdio>
#include <exception>
#include <string>

#include "absl/base/config.h"

namespace rdmarpc::internal {

// Runs `code`, part of serving a call of `method`; `who` names it in the
// log line ("the handler", "an interceptor's OnRequest"). False when it
// threw.
template <typename Code>
bool RunUserCode(const char* who, const std::string& method, Code&& code) {
#ifdef ABSL_HAVE_EXCEPTIONS
  try {
    code();
    return true;
  } catch (const std::exception& e) {
    fprintf(stderr, "rdmarpc: %s threw serving %s: %s\n", who, method.c_str(), e.what());
  } catch (...) {
    fprintf(stderr, "rdmarpc: %s threw serving %s: something not a std::exception\n", who,
            method.c_str());
  }
  return false;
#else
  (void)who;
  (void)method;
  code();
  return true;
#endif
}

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_USER_CODE_H_
