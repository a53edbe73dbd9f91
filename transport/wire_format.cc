#include "transport/wire_format.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace rdmarpc::transport {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian and encoded with memcpy");

template <typename T>
void Put(char* out, size_t off, T v) {
  memcpy(out + off, &v, sizeof v);
}
template <typename T>
T Get(const char* in, size_t off) {
  T v;
  memcpy(&v, in + off, sizeof v);
  return v;
}

bool ValidKeyChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
}

}  // namespace

void EncodeHeader(const Header& h, char* out) {
  Put<uint16_t>(out, 0, kWireMagic);
  Put<uint8_t>(out, 2, kWireVersion);
  Put<uint8_t>(out, 3, static_cast<uint8_t>(h.kind));
  Put<uint16_t>(out, 4, h.flags);
  Put<uint16_t>(out, 6, h.status);
  Put<uint64_t>(out, 8, h.call_id);
  Put<uint32_t>(out, 16, h.method_id);
  Put<uint32_t>(out, 20, h.metadata_len);
  Put<uint32_t>(out, 24, h.payload_len);
  Put<uint32_t>(out, 28, h.credits);
  Put<uint64_t>(out, 32, h.timeout_us);
  Put<uint64_t>(out, 40, h.remote.addr);
  Put<uint32_t>(out, 48, h.remote.rkey);
  Put<uint32_t>(out, 52, h.attachment_len);
  Put<uint64_t>(out, 56, h.remote.token);
}

absl::Status DecodeHeader(const char* in, size_t len, Header* out) {
  if (len < kHeaderSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncated header: ", len, " of ", kHeaderSize, " bytes"));
  }
  if (Get<uint16_t>(in, 0) != kWireMagic) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad magic 0x", absl::Hex(Get<uint16_t>(in, 0)), " (not an rdmarpc peer?)"));
  }
  if (Get<uint8_t>(in, 2) != kWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported wire version ",
                                                   Get<uint8_t>(in, 2), ", expected ",
                                                   kWireVersion));
  }
  Header& h = *out;
  const uint8_t kind = Get<uint8_t>(in, 3);
  if (kind < static_cast<uint8_t>(MessageKind::kRequest) ||
      kind > static_cast<uint8_t>(MessageKind::kHello)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown message kind ", kind));
  }
  h.kind = static_cast<MessageKind>(kind);
  h.flags = Get<uint16_t>(in, 4);
  if (h.flags & ~kKnownFlags) {
    return absl::InvalidArgumentError(absl::StrCat("unknown flags 0x", absl::Hex(h.flags)));
  }
  h.status = Get<uint16_t>(in, 6);
  h.call_id = Get<uint64_t>(in, 8);
  h.method_id = Get<uint32_t>(in, 16);
  h.metadata_len = Get<uint32_t>(in, 20);
  if (h.metadata_len > kMaxMetadataBytes) {
    return absl::InvalidArgumentError(absl::StrCat("metadata_len ", h.metadata_len,
                                                   " exceeds the limit of ", kMaxMetadataBytes));
  }
  h.payload_len = Get<uint32_t>(in, 24);
  if (h.payload_len > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("payload_len ", h.payload_len,
                                                   " exceeds the limit of ", kMaxPayloadBytes));
  }
  h.credits = Get<uint32_t>(in, 28);
  h.timeout_us = Get<uint64_t>(in, 32);
  h.remote.addr = Get<uint64_t>(in, 40);
  h.remote.rkey = Get<uint32_t>(in, 48);
  h.attachment_len = Get<uint32_t>(in, 52);
  if (h.attachment_len > h.payload_len) {
    return absl::InvalidArgumentError(absl::StrCat("attachment_len ", h.attachment_len,
                                                   " exceeds payload_len ", h.payload_len));
  }
  h.remote.token = Get<uint64_t>(in, 56);
  if (!h.remote_payload() && (h.remote.addr || h.remote.rkey)) {
    return absl::InvalidArgumentError("remote descriptor set without kFlagRemotePayload");
  }
  if (h.remote_payload() && h.payload_len == 0) {
    return absl::InvalidArgumentError("it advertises a payload of 0 bytes");
  }
  return absl::OkStatus();
}

absl::Status ValidateMetadata(const Metadata& md) {
  size_t total = 0;
  for (const auto& [key, value] : md) {
    if (key.empty() || key.size() > kMaxMetadataKey) {
      return absl::InvalidArgumentError(absl::StrCat("metadata key '", key, "' must be 1..",
                                                     kMaxMetadataKey, " bytes"));
    }
    for (char c : key) {
      if (!ValidKeyChar(c)) {
        return absl::InvalidArgumentError(
            absl::StrCat("metadata key '", key, "' may hold only [a-z0-9-_.]"));
      }
    }
    if (absl::StartsWith(key, kReservedKeyPrefix)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metadata key '", key, "' is reserved: keys from '", kReservedKeyPrefix,
          "' on are the runtime's own (status payloads go as absl::Status::SetPayload)"));
    }
    total += 6 + key.size() + value.size();
  }
  if (total > kMaxMetadataBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("metadata of ", total,
                                                     " bytes exceeds the limit of ",
                                                     kMaxMetadataBytes));
  }
  return absl::OkStatus();
}

namespace {

void AppendEntryLengths(size_t key_len, size_t value_len, std::string* out) {
  char lens[6];
  Put<uint16_t>(lens, 0, static_cast<uint16_t>(key_len));
  Put<uint32_t>(lens, 2, static_cast<uint32_t>(value_len));
  out->append(lens, sizeof lens);
}

}  // namespace

std::string EncodeMetadata(const Metadata& md) {
  std::string out;
  for (const auto& [key, value] : md) {
    AppendEntryLengths(key.size(), value.size(), &out);
    out.append(key);
    out.append(value);
  }
  return out;
}

std::string EncodeStatusPayloads(const absl::Status& status) {
  std::string out;
  status.ForEachPayload([&out](absl::string_view type_url, const absl::Cord& payload) {
    // A type URL too long for its u16 length could not be told apart from
    // the payload; no real one comes near.
    if (type_url.size() > UINT16_MAX) return;
    AppendEntryLengths(kStatusPayloadKey.size(), 2 + type_url.size() + payload.size(), &out);
    out.append(kStatusPayloadKey.data(), kStatusPayloadKey.size());
    char len[2];
    Put<uint16_t>(len, 0, static_cast<uint16_t>(type_url.size()));
    out.append(len, sizeof len);
    out.append(type_url.data(), type_url.size());
    for (absl::string_view chunk : payload.Chunks()) out.append(chunk.data(), chunk.size());
  });
  return out;
}

absl::Status TakeStatusPayloads(Metadata* md, absl::Status* status) {
  std::vector<std::pair<absl::string_view, absl::string_view>> payloads;
  for (const auto& [key, value] : *md) {
    if (key != kStatusPayloadKey) continue;
    const uint16_t url_len = value.size() < 2 ? 0 : Get<uint16_t>(value.data(), 0);
    if (value.size() < 2 || value.size() - 2 < url_len) {
      return absl::InvalidArgumentError(absl::StrCat("a status payload entry of ", value.size(),
                                                     " bytes ends before its type URL does"));
    }
    payloads.emplace_back(absl::string_view(value).substr(2, url_len),
                          absl::string_view(value).substr(2 + url_len));
  }
  if (!status->ok()) {
    for (const auto& [type_url, payload] : payloads) {
      status->SetPayload(type_url, absl::Cord(payload));
    }
  }
  md->erase(std::remove_if(md->begin(), md->end(),
                           [](const auto& entry) {
                             return absl::StartsWith(entry.first, kReservedKeyPrefix);
                           }),
            md->end());
  return absl::OkStatus();
}

absl::StatusOr<Metadata> DecodeMetadata(absl::string_view bytes) {
  Metadata md;
  size_t off = 0;
  while (off < bytes.size()) {
    if (bytes.size() - off < 6) return absl::InvalidArgumentError("truncated metadata entry");
    const uint16_t klen = Get<uint16_t>(bytes.data(), off);
    const uint32_t vlen = Get<uint32_t>(bytes.data(), off + 2);
    off += 6;
    if (klen == 0 || klen > kMaxMetadataKey || bytes.size() - off < klen ||
        bytes.size() - off - klen < vlen) {
      return absl::InvalidArgumentError("metadata entry length out of bounds");
    }
    std::string key(bytes.substr(off, klen));
    for (char c : key) {
      if (!ValidKeyChar(c)) return absl::InvalidArgumentError("bad metadata key character");
    }
    md.emplace_back(std::move(key), std::string(bytes.substr(off + klen, vlen)));
    off += klen + vlen;
  }
  return md;
}

}  // namespace rdmarpc::transport
