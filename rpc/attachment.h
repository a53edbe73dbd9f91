// Attachment: raw bytes that travel beside a call's message, untouched by
// protobuf.
//
// Why: protobuf copies a bytes field on both ends (serializing it into the
// frame, parsing it out), and for megabytes those copies cost a good part of
// the transfer. An attachment skips both: the sender fills it in place and
// the receiver reads it where the transport put it. Over RDMA that is the
// registered block the peer READs from and the block its READ filled.
//
//   // Client: fill memory the transport sends as it is.
//   auto att = channel->AllocateAttachment(n);
//   if (!att.ok()) return att.status();
//   ReadChunkInto(att->data(), att->size());
//   ctx.set_request_attachment(std::move(*att));
//   Status s = stub.Store(&ctx, req, &resp);
//   absl::string_view reply = ctx.response_attachment().view();
//
//   // Server: read it in place, answer with one.
//   Status Store(ServerContext* ctx, const Req* req, Resp* resp) {
//     absl::string_view bytes = ctx->request_attachment();  // until the handler is done
//     auto out = ctx->AllocateResponseAttachment(m);
//     ...fill out->data()...
//     ctx->set_response_attachment(std::move(*out));
//   }
//
// Attachment::CopyOf(bytes) works anywhere and costs a copy, and a second one
// into the frame when the call is sent.
//
// On the wire an attachment is the first attachment_len bytes of the frame's
// payload, and the serialized message follows (transport/wire_format.h). So
// AllocateAttachment leaves room for the message after the attachment. If the
// message does not fit there, or the channel has reconnected since the memory
// was allocated, the call still works but copies the attachment once.
//
// What not to rely on:
// - Memory from AllocateAttachment belongs to the transport and counts
//   against its bounds (RdmaOptions::max_registered_bytes) until the
//   Attachment is destroyed or sent. Sending takes it: the context no longer
//   holds it, and a pointer kept from data() must not be written through
//   afterwards (the peer may be READing those bytes; the transport reuses
//   the memory only once it can no longer, transport/rdma/rdma_connection.h).
// - Over RDMA, size plus room is taken from a registered block up to a
//   quarter larger. The room is cut to what max_message_size leaves after
//   the attachment (the channel's, or the server's for a response), since
//   both travel in one frame.
// - A received attachment (ClientContext::response_attachment) holds the
//   transport's block until the context is destroyed, and over TCP counts
//   against TcpOptions::max_receive_bytes until then.
#ifndef RDMARPC_RPC_ATTACHMENT_H_
#define RDMARPC_RPC_ATTACHMENT_H_

#include <cstddef>
#include <utility>

#include "absl/strings/string_view.h"
#include "transport/buffer.h"

namespace rdmarpc {

// Room AllocateAttachment leaves for the message when not told otherwise:
// enough for a message of ids, offsets and short names.
inline constexpr size_t kDefaultAttachmentMessageRoom = 1024;

class Attachment {
 public:
  Attachment() = default;
  static Attachment CopyOf(absl::string_view bytes) {
    return Attachment(transport::Buffer::CopyOf(bytes.data(), bytes.size()), bytes.size());
  }

  // For the runtime: the first `size` bytes of `memory` are the attachment;
  // the rest is room for the message. A `size` beyond memory.size() is cut
  // to it.
  Attachment(transport::Buffer memory, size_t size) : memory_(std::move(memory)), size_(size) {
    if (size_ > memory_.size()) size_ = memory_.size();
  }

  Attachment(Attachment&& other) noexcept
      : memory_(std::move(other.memory_)), size_(std::exchange(other.size_, 0)) {}
  Attachment& operator=(Attachment&& other) noexcept {
    if (this != &other) {
      memory_ = std::move(other.memory_);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }

  char* data() const { return memory_.data(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  absl::string_view view() const { return absl::string_view(memory_.data(), size_); }

  // For the runtime: bytes after the attachment free for the message, and
  // the whole memory, attachment first.
  size_t room() const { return memory_.size() - size_; }
  transport::Buffer TakeMemory() && {
    size_ = 0;
    return std::move(memory_);
  }

 private:
  transport::Buffer memory_;
  size_t size_ = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_ATTACHMENT_H_
