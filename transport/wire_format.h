// The rdmarpc wire format: every message on every transport is one frame.
//
//   frame = header (64 bytes) | metadata (metadata_len bytes) | payload
//
// The payload (payload_len bytes) is the call's attachment (the first
// attachment_len bytes: raw bytes that protobuf never sees, rpc/attachment.h)
// followed by the serialized message. It follows inline unless the header's
// kFlagRemotePayload is set; then the frame ends after the metadata and the
// header's `remote` descriptor tells where the receiver READs the payload from
// (RDMA only; see transport/rdma/). All integers are little-endian.
//
// Header layout (offsets in bytes):
//   0  u16 magic        0x5052 ("RP")
//   2  u8  version      kWireVersion; a frame of another version is rejected
//   3  u8  kind         MessageKind
//   4  u16 flags        kFlag* bits; unknown bits are rejected
//   6  u16 status       absl::StatusCode of a response (0 otherwise); any value
//                       decodes, and the runtime reads a code it does not know
//                       as UNKNOWN: one odd answer ends its call, not the link
//   8  u64 call_id      chosen by the client, unique per connection while pending;
//                       on a kShrink, the count of credits; on a kHello, the
//                       kHello* bits (a receiver ignores those it does not know)
//  16  u32 method_id    MethodId("/pkg.Service/Method") (rpc/method_id.h)
//  20  u32 metadata_len encoded Metadata, at most kMaxMetadataBytes
//  24  u32 payload_len  attachment + serialized message (or error text), at
//                       most kMaxPayloadBytes
//  28  u32 credits      receive slots the sender has freed (RDMA flow control)
//  32  u64 timeout_us   time left to the call's deadline when sent; 0 = none;
//                       2^63 and up read as 2^63 - 1 (Header::timeout)
//  40  u64 remote.addr  } where the payload can be READ, valid with
//  48  u32 remote.rkey  } kFlagRemotePayload; length is payload_len (> 0)
//  52  u32 attachment_len  the payload's first bytes that are the attachment,
//                       at most payload_len; 0 = none (always on a kResponse
//                       with a non-OK status, and on every other kind)
//  56  u64 remote.token identifies the advertised buffer in a kRelease
//
// The deadline travels as time left rather than as a wall-clock time, so that
// the peers' clocks need not agree; a server drops a request whose time is up
// before it spends a READ on it.
//
// Metadata: a sequence of entries, each
//   u16 key_len | u32 value_len | key bytes | value bytes
// Keys are 1..kMaxMetadataKey bytes of [a-z0-9-_.]; values are any bytes.
//
// A response with a non-OK status carries the error message as its payload,
// and the status's payloads (absl::Status::SetPayload: rich error details, as
// gRPC's google.rpc.Status details) as metadata entries, one per payload:
//   key "rdmarpc-status-payload", value u16 type_url_len | type_url | bytes
// Keys from "rdmarpc-" on are the runtime's own: ValidateMetadata refuses
// them in what an application sends, and a client takes every one out of
// the response metadata it hands on (those it does not know, a newer
// server's, it drops). A client older than them hands them on as they are.
//
// Limits: kMaxMetadataBytes and kMaxPayloadBytes bound what any receiver will
// accept at all (a header claiming more is malformed); a runtime may set a
// lower per-message limit, which yields RESOURCE_EXHAUSTED for that call only.
#ifndef RDMARPC_TRANSPORT_WIRE_FORMAT_H_
#define RDMARPC_TRANSPORT_WIRE_FORMAT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rdmarpc::transport {

inline constexpr uint16_t kWireMagic = 0x5052;
inline constexpr uint8_t kWireVersion = 2;  // 2: TCP connections open with kHello
inline constexpr size_t kHeaderSize = 64;
inline constexpr uint32_t kMaxMetadataBytes = 64 * 1024;
inline constexpr uint32_t kMaxPayloadBytes = 1u << 30;  // 1 GiB
inline constexpr size_t kMaxMetadataKey = 256;

enum class MessageKind : uint8_t {
  kRequest = 1,   // client -> server: a call
  kResponse = 2,  // server -> client: the call's result
  kCancel = 3,    // client -> server: stop working on call_id
  kCredit = 4,    // either way: only returns credits (no call), at least one;
                  // the credits a side holds never exceed the largest window
                  // the other side's handshake says it grants
  kRelease = 5,   // client -> server: done READing the advertised response
  kGoAway = 6,    // server -> client: shutting down, send no new call on this
                  // connection (those in flight still end on it); then
                  // client -> server, the acknowledgment: no request follows
                  // this one, so the server serves those before it
  kShrink = 7,    // RDMA only, costs no credit. From the receiver of a
                  // connection's frames: take `call_id` credits back off the
                  // window granted (its shared receive queue is being shared
                  // among more connections), at least one, and not before
                  // the answer to the last such ask came; the other side
                  // takes them off its credits, going into debt for any
                  // already spent, and answers with a kShrink of the same
                  // count, behind every frame it sent on those credits
  kHello = 8,     // TCP only, server -> client, empty: the first frame on
                  // every connection, sent once the server has taken it.
                  // The kernel completes a TCP connect before the server
                  // sees it; a connection that the server then refuses, or
                  // that the listener's close resets, never gets a kHello,
                  // so the client knows no call it could send there was
                  // seen. Its connect waits for the kHello (rdma_cm's
                  // accept does the same for RDMA)
};

// kHello bits (in its call_id). Zero, as older servers send, says nothing.
// Nothing but TCP takes connections on this port (a tcp:// server, or an
// auto:// one on a host without RDMA): an auto:// client need not wait for
// an RDMA answer that will not come (transport/auto_transport.h).
inline constexpr uint64_t kHelloTcpAlone = 1;

inline constexpr uint16_t kFlagRemotePayload = 1 << 0;
inline constexpr uint16_t kKnownFlags = kFlagRemotePayload;

struct RemoteDescriptor {
  uint64_t addr = 0;
  uint32_t rkey = 0;
  uint64_t token = 0;
};

struct Header {
  MessageKind kind = MessageKind::kRequest;
  uint16_t flags = 0;
  uint16_t status = 0;
  uint64_t call_id = 0;
  uint32_t method_id = 0;
  uint32_t metadata_len = 0;
  uint32_t payload_len = 0;
  uint32_t attachment_len = 0;
  uint32_t credits = 0;
  uint64_t timeout_us = 0;
  RemoteDescriptor remote;

  bool remote_payload() const { return flags & kFlagRemotePayload; }
  // timeout_us as a duration. From 2^63 up (our clients never send that:
  // absl saturates there) it reads as the longest absl::Microseconds holds,
  // not as the negative time a plain conversion would make of it.
  absl::Duration timeout() const {
    return absl::Microseconds(static_cast<int64_t>(std::min<uint64_t>(timeout_us, INT64_MAX)));
  }
};

// Writes exactly kHeaderSize bytes.
void EncodeHeader(const Header& h, char* out);

// Parses and validates a header into `*h`; the error says which field is
// wrong (then `*h` holds part of the frame's fields: do not use it). The
// receive path decodes straight into the message it delivers.
absl::Status DecodeHeader(const char* in, size_t len, Header* h);
// The same, returning the header.
inline absl::StatusOr<Header> DecodeHeader(const char* in, size_t len) {
  Header h;
  absl::Status s = DecodeHeader(in, len, &h);
  if (!s.ok()) return s;
  return h;
}

using Metadata = std::vector<std::pair<std::string, std::string>>;

inline constexpr absl::string_view kReservedKeyPrefix = "rdmarpc-";
inline constexpr absl::string_view kStatusPayloadKey = "rdmarpc-status-payload";

// Validates keys and sizes of an application's metadata; the error names the
// offending key (a reserved one included).
absl::Status ValidateMetadata(const Metadata& md);
std::string EncodeMetadata(const Metadata& md);
absl::StatusOr<Metadata> DecodeMetadata(absl::string_view bytes);

// The encoded metadata entries that carry `status`'s payloads (none for a
// status without any), to append to a response's encoded metadata.
std::string EncodeStatusPayloads(const absl::Status& status);
// Takes every reserved entry out of `md`, putting the status payloads on
// `*status` unless it is OK. INVALID_ARGUMENT, saying what is wrong, for a
// payload entry that does not parse; `*md` and `*status` are then as they
// were.
absl::Status TakeStatusPayloads(Metadata* md, absl::Status* status);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_WIRE_FORMAT_H_
