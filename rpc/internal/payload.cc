#include "rpc/internal/payload.h"

#include <cstdint>
#include <cstring>
#include <utility>

namespace rdmarpc::internal {

absl::StatusOr<transport::Buffer> BuildPayload(transport::Connection& conn, Attachment attachment,
                                               const google::protobuf::MessageLite& message,
                                               size_t message_size) {
  const size_t att = attachment.size();
  transport::Buffer payload;
  if (att > 0 && attachment.room() >= message_size) {
    payload = std::move(attachment).TakeMemory();
    payload.Truncate(att + message_size);
  } else {
    auto memory = conn.AllocatePayload(att + message_size);
    if (!memory.ok()) return memory.status();
    payload = std::move(*memory);
    if (att > 0) memcpy(payload.data(), attachment.data(), att);
  }
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(payload.data() + att));
  return payload;
}

absl::Status SendWithMessage(transport::Connection& conn, transport::OutboundMessage&& msg,
                             Attachment attachment,
                             const google::protobuf::MessageLite& message, size_t message_size) {
  if (attachment.empty()) {
    msg.header.attachment_len = 0;
    return conn.SendWith(std::move(msg), message_size, [&message](char* out) {
      message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out));
    });
  }
  msg.header.attachment_len = static_cast<uint32_t>(attachment.size());
  auto payload = BuildPayload(conn, std::move(attachment), message, message_size);
  if (!payload.ok()) return payload.status();
  msg.payload = std::move(*payload);
  return conn.Send(std::move(msg));
}

}  // namespace rdmarpc::internal
