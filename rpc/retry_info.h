// Retry pushback: a server tells clients when a call that failed may be
// tried again, or that it may not, with the error itself.
//
//   // server, in a handler that is overloaded
//   rdmarpc::Status s(rdmarpc::StatusCode::kUnavailable, "overloaded");
//   rdmarpc::SetRetryDelay(&s, absl::Milliseconds(200));  // or kDoNotRetry
//   return s;
//
// A client whose channel has a RetryPolicy (rpc/channel.h) then sends such a
// call again after 200 ms rather than after its own backoff (the backoffs
// after it start over from initial_backoff), or, for a negative delay, not
// at all; the policy still decides whether the code is retryable, how many
// attempts a call gets and that none goes past its deadline. This is gRPC's
// retry pushback. Any client may read the delay with RetryDelay(status).
//
// It travels as a status payload (rpc/status.h): a google.rpc.RetryInfo
// under its type URL (proto/retry_info.proto has the same bytes), so a
// handler that already attaches googleapis' own RetryInfo is honoured too.
#ifndef RDMARPC_RPC_RETRY_INFO_H_
#define RDMARPC_RPC_RETRY_INFO_H_

#include <optional>

#include "absl/time/time.h"
#include "rpc/status.h"

namespace rdmarpc {

inline constexpr char kRetryInfoTypeUrl[] = "type.googleapis.com/google.rpc.RetryInfo";
// A delay that says: do not send this call again.
inline constexpr absl::Duration kDoNotRetry = absl::Seconds(-1);

// Puts the delay on `status`, replacing one there; nothing on an OK status,
// which carries no payloads. An infinite delay reads as kDoNotRetry.
void SetRetryDelay(Status* status, absl::Duration delay);
// The delay a RetryInfo on `status` gives (negative: do not retry); nullopt
// when there is none, or it does not parse.
std::optional<absl::Duration> RetryDelay(const Status& status);

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_RETRY_INFO_H_
