#include "rpc/internal/payload.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "rpc/internal/send_faults.h"

namespace rdmarpc::internal {
namespace {

auto SerializeTo(const google::protobuf::MessageLite& message) {
  return [&message](char* out) {
    message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out));
  };
}

// A request refused by SendFaults; out of line, as the fast path never
// comes here.
ABSL_ATTRIBUTE_NOINLINE absl::Status RefusedForTest(transport::Connection& conn) {
  if (SendFaults::BeforeRefusal()) SendFaults::BeforeRefusal()(conn);
  return transport::RefusedUnsent(
      absl::StrCat("connection to ", conn.peer(), " is closed (SendFaults, a test's)"));
}

// BuildPayload for `message_size` bytes that `write(out)` puts at `out`.
template <typename Write>
absl::StatusOr<transport::Buffer> BuildPayloadWith(transport::Connection& conn,
                                                   Attachment attachment, size_t message_size,
                                                   const Write& write) {
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
  write(payload.data() + att);
  return payload;
}

// SendWithMessage for `message_size` bytes that `write(out)` puts at `out`.
template <typename Write>
absl::Status SendPayload(transport::Connection& conn, transport::OutboundMessage&& msg,
                         Attachment attachment, size_t message_size, const Write& write) {
  if (msg.header.kind == transport::MessageKind::kRequest && SendFaults::TakeRefusedRequest()) {
    return RefusedForTest(conn);
  }
  if (attachment.empty()) {
    msg.header.attachment_len = 0;
    return conn.SendWith(std::move(msg), message_size, write);
  }
  msg.header.attachment_len = static_cast<uint32_t>(attachment.size());
  auto payload = BuildPayloadWith(conn, std::move(attachment), message_size, write);
  if (!payload.ok()) return payload.status();
  msg.payload = std::move(*payload);
  return conn.Send(std::move(msg));
}

}  // namespace

bool SerializeForLater(const google::protobuf::MessageLite& message, size_t size,
                       std::string* out) {
#ifdef ABSL_HAVE_EXCEPTIONS
  try {
    out->resize(size);
  } catch (const std::bad_alloc&) {
    return false;
  }
#else
  out->resize(size);
#endif
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out->data()));
  return true;
}

absl::StatusOr<size_t> AttachmentMemorySize(size_t size, size_t message_room,
                                            size_t max_message_size) {
  if (size > max_message_size) {
    return absl::ResourceExhaustedError(
        absl::StrCat("attachment of ", size, " bytes exceeds max_message_size ", max_message_size));
  }
  return size + std::min(message_room, max_message_size - size);
}

absl::StatusOr<transport::Buffer> BuildPayload(transport::Connection& conn, Attachment attachment,
                                               const google::protobuf::MessageLite& message,
                                               size_t message_size) {
  return BuildPayloadWith(conn, std::move(attachment), message_size, SerializeTo(message));
}

absl::Status SendWithMessage(transport::Connection& conn, transport::OutboundMessage&& msg,
                             Attachment attachment, const google::protobuf::MessageLite& message,
                             size_t message_size) {
  return SendPayload(conn, std::move(msg), std::move(attachment), message_size,
                     SerializeTo(message));
}

absl::Status SendWithSerialized(transport::Connection& conn, transport::OutboundMessage&& msg,
                                Attachment attachment, absl::string_view message) {
  return SendPayload(conn, std::move(msg), std::move(attachment), message.size(),
                     [message](char* out) { memcpy(out, message.data(), message.size()); });
}

}  // namespace rdmarpc::internal
