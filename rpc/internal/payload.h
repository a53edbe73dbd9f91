// The payload of a request or an OK response: the attachment first, then the
// serialized message (transport/wire_format.h). Shared by Channel and Server.
#ifndef RDMARPC_RPC_INTERNAL_PAYLOAD_H_
#define RDMARPC_RPC_INTERNAL_PAYLOAD_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "google/protobuf/message_lite.h"
#include "rpc/attachment.h"
#include "transport/transport.h"

namespace rdmarpc::internal {

// Serializes `message` (whose ByteSizeLong() returned `message_size`) after
// `attachment`: into the attachment's own memory when it has room for the
// message, so that neither is copied; otherwise into memory from `conn`, with
// one copy of the attachment.
absl::StatusOr<transport::Buffer> BuildPayload(transport::Connection& conn, Attachment attachment,
                                               const google::protobuf::MessageLite& message,
                                               size_t message_size);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_PAYLOAD_H_
