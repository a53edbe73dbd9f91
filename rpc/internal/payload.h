// The payload of a request or an OK response: the attachment first, then the
// serialized message (transport/wire_format.h). Shared by Channel and Server.
#ifndef RDMARPC_RPC_INTERNAL_PAYLOAD_H_
#define RDMARPC_RPC_INTERNAL_PAYLOAD_H_

#include <cstddef>
#include <new>
#include <string>

#include "absl/base/config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "rpc/attachment.h"
#include "transport/transport.h"

namespace rdmarpc::internal {

// How parsing a payload's message went.
enum class Parsed { kOk, kMalformed, kOutOfMemory };

// Parses `bytes` into `message`. kOutOfMemory when the process had no memory
// for what they hold (a message's strings take as much as its bytes do): the
// peer chose the size, so that ends the call RESOURCE_EXHAUSTED
// (transport::OutOfMemory), as when the transport had no memory for the
// bytes themselves, and not the process. What was parsed stays in `message`.
inline Parsed ParseMessage(google::protobuf::MessageLite& message, absl::string_view bytes) {
  const auto parse = [&] {
    return message.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))
               ? Parsed::kOk
               : Parsed::kMalformed;
  };
#ifdef ABSL_HAVE_EXCEPTIONS
  try {
    return parse();
  } catch (const std::bad_alloc&) {
    return Parsed::kOutOfMemory;
  }
#else
  return parse();
#endif
}

// `message` (whose ByteSizeLong() returned `size`) serialized into `out`,
// for a call that keeps its request to send later: one that waits for a
// connection, or may be retried. False when the process has no memory for
// the copy; the caller ends the call with transport::OutOfMemory, as when
// the transport has none for a payload, instead of throwing out of Call with
// the call half made.
bool SerializeForLater(const google::protobuf::MessageLite& message, size_t size, std::string* out);

// Serializes `message` (whose ByteSizeLong() returned `message_size`) after
// `attachment`: into the attachment's own memory when it has room for the
// message, so that neither is copied; otherwise into memory from `conn`, with
// one copy of the attachment.
absl::StatusOr<transport::Buffer> BuildPayload(transport::Connection& conn, Attachment attachment,
                                               const google::protobuf::MessageLite& message,
                                               size_t message_size);

// The memory to ask the transport for to hold an attachment of `size` bytes
// with room after it for a message of up to `message_room` bytes.
// Attachment and message travel in one frame of at most `max_message_size`
// bytes, so the room is cut to what that leaves: the sum can neither wrap
// nor ask for more than a frame holds. RESOURCE_EXHAUSTED, naming
// `max_message_size`, for an attachment larger than a frame.
absl::StatusOr<size_t> AttachmentMemorySize(size_t size, size_t message_room,
                                            size_t max_message_size);

// Sends `msg` with that payload and its header's attachment_len set. With no
// attachment the message is serialized by Connection::SendWith, straight into
// the frame where the transport can (a small RDMA SEND); with one, the
// payload is built by BuildPayload and sent by Send.
absl::Status SendWithMessage(transport::Connection& conn, transport::OutboundMessage&& msg,
                             Attachment attachment,
                             const google::protobuf::MessageLite& message, size_t message_size);

// The same for a message serialized earlier (a call that waited for a
// connection keeps its request as bytes).
absl::Status SendWithSerialized(transport::Connection& conn, transport::OutboundMessage&& msg,
                                Attachment attachment, absl::string_view message);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_PAYLOAD_H_
