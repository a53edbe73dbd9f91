// One error out of several attempts, with what to do said once.
//
// A connect (or listen) on a name tries each of its addresses, and when all
// fail its error says what became of each. An attempt's error that knows
// what the user can do about it (take another port, look at the devices)
// ends its message with that advice and keeps it as the payload kWhatToDo
// too (WithWhatToDo). FailedAttempts joins the attempts' errors and says
// each distinct advice once, after all of them: said after every address, a
// name's two addresses would repeat ~100-450 characters.
//
//   FailedAttempts failed;
//   failed.Add("[::1]:5", WithWhatToDo(absl::UnavailableError("Address already in use"),
//                                      "Another server has this port there: ..."));
//   failed.Add("127.0.0.1:5", <the same for 127.0.0.1>);
//   failed.Error();  // "[::1]:5: Address already in use; 127.0.0.1:5: Address
//                    //  already in use. Another server has this port there: ..."
//
// Attempts that fail in different ways (auto://'s RDMA, then TCP) keep the
// advice that only one of them has with that one (Unshared::kWithItsAttempt),
// and what all say (a host that answered neither way) goes once at the end.
//
// What not to rely on: advice that code rewriting a message did not keep at
// its end stays where it is, said with that attempt, and is not moved.
#ifndef RDMARPC_TRANSPORT_ATTEMPT_ERRORS_H_
#define RDMARPC_TRANSPORT_ATTEMPT_ERRORS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::transport {

// The payload that holds the advice an error's message ends with: what to do
// about it, one piece per line, said in the message one after another.
inline constexpr absl::string_view kWhatToDo = "type.rdmarpc.dev/transport.WhatToDo";

// `error` with `advice` (whole sentences, ending with a period; no line
// break) after its message, as a new sentence, and in kWhatToDo after any
// it had. An OK `error` or empty `advice` comes back as it was.
absl::Status WithWhatToDo(absl::Status error, absl::string_view advice);

// `error` with code `code` and its message after `context` and ": ", its
// payloads kept: the advice among them, for a join to say once.
absl::Status Prefixed(absl::StatusCode code, absl::string_view context, const absl::Status& error);

// A connect attempt that `timed_out` with nothing answering it, with what to
// check: the same whichever transport's attempt it was.
absl::Status NothingAnswered(absl::Status timed_out);

// This process's limit on open files and how to raise it, for what failed
// with EMFILE: "this process may open 1024 files: raise `ulimit -n`".
std::string FileLimitAdvice();
// `error` with that advice when `err` is EMFILE; else as it was.
absl::Status WithFileLimitAdvice(absl::Status error, int err);

class FailedAttempts {
 public:
  // Where advice goes that not every attempt's error has: with the rest at
  // the end, or after its own attempt.
  enum class Unshared { kAtTheEnd, kWithItsAttempt };

  explicit FailedAttempts(Unshared unshared = Unshared::kAtTheEnd) : unshared_(unshared) {}

  // Adds what became of one attempt, a failed one: `error`'s message, after
  // `where` and ": " unless `where` is empty, without its advice, which is
  // kept to be said once.
  void Add(absl::string_view where, const absl::Status& error);

  bool empty() const { return attempts_.empty(); }

  // Each attempt's message, "; " between, then each distinct advice once
  // (with kWithItsAttempt, each attempt's message ends with the advice that
  // not every attempt has, and only the rest comes at the end).
  std::string Message() const;

  // Message() with the last attempt's code, kWhatToDo for the advice, and
  // the other payloads that every attempt's error had (a kind of failure
  // they share: auto:// falls back on one, auto_transport.h). UNKNOWN when
  // nothing was added.
  absl::Status Error() const;

 private:
  struct Attempt {
    std::string said;                 // "where: message", without its advice
    std::vector<std::string> advice;  // what was taken off its message
  };

  const Unshared unshared_;
  std::vector<Attempt> attempts_;
  absl::StatusCode last_code_ = absl::StatusCode::kUnknown;
  std::map<std::string, absl::Cord> shared_;  // payloads of every error so far
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ATTEMPT_ERRORS_H_
