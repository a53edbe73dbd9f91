// RunUserCode: runs code of the program's (a handler, an interceptor, an
// OnCancel callback, a client's callback) where an exception out of it would
// otherwise end the process: on a worker, a callback thread, the I/O thread
// or the timer thread. The exception is logged on stderr and goes no
// further; the caller decides what the call gets (UnaryHandler's `done`
// answers it UNKNOWN, a refusing interceptor refuses it, a callback's call
// has ended already).
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

#include "absl/base/config.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::internal {

// Runs `code`, part of a call of `method`; `who` names it in the log line
// ("the handler", "an interceptor's OnRequest"). False when it threw.
// `method` is anything absl::string_view is made from (a std::string, a
// C string), and made into one only on a throw: a client's callback passes
// a C string per call, whose length is not worth taking for nothing.
template <typename Name, typename Code>
bool RunUserCode(const char* who, const Name& method, Code&& code) {
#ifdef ABSL_HAVE_EXCEPTIONS
  try {
    code();
    return true;
  } catch (const std::exception& e) {
    const absl::string_view name(method);
    fprintf(stderr, "rdmarpc: %s threw (call %.*s): %s\n", who, static_cast<int>(name.size()),
            name.data(), e.what());
  } catch (...) {
    const absl::string_view name(method);
    fprintf(stderr, "rdmarpc: %s threw (call %.*s): something not a std::exception\n", who,
            static_cast<int>(name.size()), name.data());
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
