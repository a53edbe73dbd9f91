// Status: the result of every call, with gRPC's 17 codes.
//
// rdmarpc uses absl::Status and absl::StatusCode as they are (same numbering
// as gRPC), so code that already knows them needs nothing new:
//
//   rdmarpc::Status s = stub.Echo(&ctx, req, &resp);
//   if (s.code() == rdmarpc::StatusCode::kDeadlineExceeded) { ... }
//
// What the runtime itself returns, and when:
//   kDeadlineExceeded   the call's deadline passed before its response came
//                       (client side), or before the server started it
//   kCancelled          ClientContext::TryCancel(), or the server shut down
//                       with the call still running
//   kUnavailable        the server could not be reached, or the connection
//                       was lost with the call pending (a peer that breaks
//                       the framing is disconnected); the message names the
//                       peer (retrying is reasonable)
//   kUnimplemented      the server has no such service or method
//   kResourceExhausted  a message exceeds max_message_size (the limit is named
//                       in the message), a bounded pool is used up, or the
//                       process had no memory for a message ("out of memory
//                       for N bytes")
//   kInvalidArgument    the request could not be parsed as the method's type,
//                       or its metadata was malformed
//   kInternal           the response did not parse as the method's type, or
//                       its metadata was malformed (the message names the
//                       server)
//   kUnknown            the server answered with a code this client does not
//                       know (a newer or broken peer; the message has it)
// A handler's own status, code and message, reaches the client unchanged,
// and so do its payloads: rich error details, as gRPC's google.rpc.Status
// details carry them (a serialized message under its type URL):
//
//   // server, in a handler
//   Status s(StatusCode::kInvalidArgument, "bad page size");
//   s.SetPayload("type.googleapis.com/google.rpc.BadRequest",
//                absl::Cord(bad_request.SerializeAsString()));
//   return s;
//   // client
//   if (auto details = s.GetPayload("type.googleapis.com/google.rpc.BadRequest")) ...
//
// They travel as metadata entries with the response (transport/wire_format.h),
// so they share its bound: over RDMA the error's metadata and payloads go
// with the header in one receive slot (8 KiB by default), over TCP up to 64
// KiB. An error whose payloads and metadata do not fit goes without either,
// with its code and message. For when to retry, rpc/retry_info.h writes and
// reads a google.rpc.RetryInfo, which a RetryPolicy honours.
#ifndef RDMARPC_RPC_STATUS_H_
#define RDMARPC_RPC_STATUS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc {

using Status = absl::Status;
using StatusCode = absl::StatusCode;
template <typename T>
using StatusOr = absl::StatusOr<T>;

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_STATUS_H_
