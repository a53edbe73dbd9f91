#include "transport/wire_format.h"

#include <cstring>
#include <random>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

Header Sample() {
  Header h;
  h.kind = MessageKind::kResponse;
  h.flags = kFlagRemotePayload;
  h.status = 5;
  h.call_id = 0x1122334455667788ull;
  h.method_id = 0xdeadbeef;
  h.metadata_len = 12;
  h.payload_len = 1 << 20;
  h.attachment_len = 4096;
  h.credits = 7;
  h.timeout_us = 1500000;
  h.remote = {0xabcdef0123ull, 0x4242, 99};
  return h;
}

TEST(WireFormat, HeaderRoundTrips) {
  char buf[kHeaderSize];
  EncodeHeader(Sample(), buf);
  auto h = DecodeHeader(buf, sizeof buf);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->kind, MessageKind::kResponse);
  EXPECT_EQ(h->call_id, 0x1122334455667788ull);
  EXPECT_EQ(h->method_id, 0xdeadbeefu);
  EXPECT_EQ(h->status, 5);
  EXPECT_EQ(h->payload_len, 1u << 20);
  EXPECT_EQ(h->attachment_len, 4096u);
  EXPECT_EQ(h->credits, 7u);
  EXPECT_EQ(h->timeout_us, 1500000u);
  EXPECT_TRUE(h->remote_payload());
  EXPECT_EQ(h->remote.addr, 0xabcdef0123ull);
  EXPECT_EQ(h->remote.rkey, 0x4242u);
  EXPECT_EQ(h->remote.token, 99u);
}

TEST(WireFormat, LayoutIsLittleEndianAtDocumentedOffsets) {
  char buf[kHeaderSize];
  EncodeHeader(Sample(), buf);
  EXPECT_EQ(static_cast<uint8_t>(buf[0]), 0x52);
  EXPECT_EQ(static_cast<uint8_t>(buf[1]), 0x50);
  EXPECT_EQ(buf[2], kWireVersion);
  EXPECT_EQ(buf[3], 2);
  EXPECT_EQ(static_cast<uint8_t>(buf[8]), 0x88);
  EXPECT_EQ(static_cast<uint8_t>(buf[16]), 0xef);
  EXPECT_EQ(static_cast<uint8_t>(buf[53]), 0x10);  // attachment_len 4096
}

TEST(WireFormat, RejectsMalformedHeaders) {
  char good[kHeaderSize];
  EncodeHeader(Sample(), good);
  struct Case {
    const char* what;
    size_t offset;
    uint8_t value;
    const char* error_contains;
  } cases[] = {
      {"magic", 0, 0x00, "bad magic"},
      {"version", 2, 9, "unsupported wire version"},
      {"kind", 3, 0, "unknown message kind"},
      {"kind high", 3, 200, "unknown message kind"},
      {"flags", 5, 0x80, "unknown flags"},
      {"metadata_len", 23, 0x7f, "metadata_len"},
      {"payload_len", 27, 0xff, "payload_len"},
      {"attachment_len", 55, 0x7f, "attachment_len"},
  };
  for (const Case& c : cases) {
    char bad[kHeaderSize];
    memcpy(bad, good, sizeof bad);
    bad[c.offset] = static_cast<char>(c.value);
    auto h = DecodeHeader(bad, sizeof bad);
    ASSERT_FALSE(h.ok()) << c.what;
    EXPECT_NE(h.status().message().find(c.error_contains), std::string::npos)
        << c.what << ": " << h.status();
  }
  EXPECT_FALSE(DecodeHeader(good, kHeaderSize - 1).ok());
}

TEST(WireFormat, StatusCodesBeyondAbslsDecodeIntact) {
  Header h = Sample();
  h.status = 999;
  char buf[kHeaderSize];
  EncodeHeader(h, buf);
  auto back = DecodeHeader(buf, sizeof buf);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->status, 999);
}

TEST(WireFormat, AttachmentMayFillThePayloadButNotExceedIt) {
  Header h = Sample();
  char buf[kHeaderSize];
  h.attachment_len = h.payload_len;
  EncodeHeader(h, buf);
  ASSERT_TRUE(DecodeHeader(buf, sizeof buf).ok());
  h.attachment_len = h.payload_len + 1;
  EncodeHeader(h, buf);
  auto back = DecodeHeader(buf, sizeof buf);
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("exceeds payload_len"), std::string::npos)
      << back.status();
}

TEST(WireFormat, TimeoutsPastWhatADurationHoldsReadAsTheLongestNotNegative) {
  Header h;
  h.timeout_us = 1500000;
  EXPECT_EQ(h.timeout(), absl::Milliseconds(1500));
  const absl::Duration longest = absl::Microseconds(INT64_MAX);
  for (const uint64_t far : {uint64_t{INT64_MAX}, uint64_t{1} << 63, ~uint64_t{0}}) {
    h.timeout_us = far;
    EXPECT_EQ(h.timeout(), longest) << far;
  }
}

TEST(WireFormat, RemoteDescriptorRequiresFlag) {
  Header h = Sample();
  h.flags = 0;
  char buf[kHeaderSize];
  EncodeHeader(h, buf);
  EXPECT_FALSE(DecodeHeader(buf, sizeof buf).ok());
}

TEST(WireFormat, MetadataRoundTripsAndRejectsGarbage) {
  Metadata md = {{"user-id", "42"}, {"trace.span", std::string("\0\x01\xff", 3)}};
  ASSERT_TRUE(ValidateMetadata(md).ok());
  const std::string bytes = EncodeMetadata(md);
  auto back = DecodeMetadata(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);
  EXPECT_FALSE(DecodeMetadata(bytes.substr(0, bytes.size() - 1)).ok());
  EXPECT_FALSE(DecodeMetadata(std::string("\x05\x00\xff\xff\xff\xff", 6)).ok());
  EXPECT_FALSE(ValidateMetadata({{"Upper", "x"}}).ok());
  EXPECT_FALSE(ValidateMetadata({{"", "x"}}).ok());
  EXPECT_EQ(ValidateMetadata({{"big", std::string(kMaxMetadataBytes, 'x')}}).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(WireFormat, StatusPayloadsTravelAsReservedMetadataEntries) {
  absl::Status status(absl::StatusCode::kAborted, "conflict");
  const std::string binary("\0\xff\x01", 3);
  status.SetPayload("type.googleapis.com/google.rpc.ErrorInfo", absl::Cord(binary));
  status.SetPayload("", absl::Cord("an empty type URL"));
  EXPECT_EQ(EncodeStatusPayloads(absl::OkStatus()), "");
  const std::string entries = EncodeStatusPayloads(status);
  auto md = DecodeMetadata(EncodeMetadata({{"user-id", "42"}}) + entries +
                           EncodeMetadata({{"rdmarpc-from-a-newer-peer", "x"}}));
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->size(), 4u);
  EXPECT_EQ((*md)[1].first, kStatusPayloadKey);

  absl::Status received(absl::StatusCode::kAborted, "conflict");
  ASSERT_TRUE(TakeStatusPayloads(&*md, &received).ok());
  EXPECT_EQ(*md, (Metadata{{"user-id", "42"}}));
  EXPECT_EQ(received, status);  // code, message and payloads

  // An OK status takes no payloads, but loses the entries all the same.
  auto ok_md = DecodeMetadata(entries);
  ASSERT_TRUE(ok_md.ok());
  absl::Status ok;
  ASSERT_TRUE(TakeStatusPayloads(&*ok_md, &ok).ok());
  EXPECT_TRUE(ok_md->empty());
  EXPECT_TRUE(ok.ok());

  // A type URL length past the entry's end, or no room for the length.
  for (const std::string& value : {std::string("\x05\x00"
                                               "abcd",
                                               6),
                                   std::string("\x01", 1), std::string()}) {
    Metadata bad = {{"user-id", "42"}, {std::string(kStatusPayloadKey), value}};
    const Metadata before = bad;
    absl::Status target(absl::StatusCode::kAborted, "conflict");
    const absl::Status taken = TakeStatusPayloads(&bad, &target);
    EXPECT_EQ(taken.code(), absl::StatusCode::kInvalidArgument) << taken;
    EXPECT_EQ(bad, before);
    EXPECT_EQ(target, absl::Status(absl::StatusCode::kAborted, "conflict"));
  }

  // What an application sends may not use the runtime's keys.
  const absl::Status reserved = ValidateMetadata({{"rdmarpc-status-payload", "forged"}});
  EXPECT_EQ(reserved.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(reserved.message().find("'rdmarpc-status-payload' is reserved"), std::string::npos);
  EXPECT_TRUE(ValidateMetadata({{"rdmarpc", "x"}, {"my-rdmarpc-key", "x"}}).ok());
}

// A receiver takes a frame's header and metadata from its peer's bytes, so
// decoding must accept exactly what an encoder writes: every mutation of a
// valid encoding (bytes replaced, bits flipped, cut short, grown) either
// fails with a message or decodes to fields that encode back to the same
// bytes. Run under the sanitizers in `make test`, it also checks that no
// input reads out of bounds.
TEST(WireFormat, MutatedFramesDecodeToWhatEncodesThemOrToAnError) {
  std::mt19937 rng(20261127);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto mutate = [&](std::string bytes) {
    for (size_t k = 1 + pick(3); k > 0; --k) {
      switch (pick(bytes.empty() ? 1 : 4)) {
        case 0:
          bytes.insert(pick(bytes.size() + 1), 1, static_cast<char>(pick(256)));
          break;
        case 1:
          bytes[pick(bytes.size())] = static_cast<char>(pick(256));
          break;
        case 2:
          bytes[pick(bytes.size())] ^= static_cast<char>(1 << pick(8));
          break;
        default:
          bytes.resize(pick(bytes.size()));
          break;
      }
    }
    return bytes;
  };

  Header local = Sample();
  local.flags = 0;
  local.remote = {};
  int accepted = 0, refused = 0;
  for (const Header& valid : {Sample(), local}) {
    std::string good(kHeaderSize, '\0');
    EncodeHeader(valid, good.data());
    for (int i = 0; i < 100000; ++i) {
      const std::string bytes = mutate(good);
      Header h;
      const absl::Status s = DecodeHeader(bytes.data(), bytes.size(), &h);
      if (!s.ok()) {
        ++refused;
        EXPECT_FALSE(s.message().empty());
        continue;
      }
      ++accepted;
      ASSERT_GE(bytes.size(), kHeaderSize);
      std::string again(kHeaderSize, '\0');
      EncodeHeader(h, again.data());
      ASSERT_EQ(again, bytes.substr(0, kHeaderSize)) << "mutation " << i;
    }
  }
  // Both outcomes must have been reached, or the mutations tested nothing.
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 1000);

  const std::string good =
      EncodeMetadata({{"user-id", "42"}, {"trace.span", std::string("\0\x01\xff", 3)}, {"k", ""}});
  accepted = refused = 0;
  for (int i = 0; i < 100000; ++i) {
    const std::string bytes = mutate(good);
    auto md = DecodeMetadata(bytes);
    if (!md.ok()) {
      ++refused;
      EXPECT_FALSE(md.status().message().empty());
      continue;
    }
    ++accepted;
    ASSERT_TRUE(ValidateMetadata(*md).ok()) << "mutation " << i << ": " << ValidateMetadata(*md);
    ASSERT_EQ(EncodeMetadata(*md), bytes) << "mutation " << i;
  }
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 1000);
}

}  // namespace
}  // namespace rdmarpc::transport
