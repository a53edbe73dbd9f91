// BuildPayload: the attachment stays where the caller wrote it when its
// memory has room for the message; otherwise both go into new memory from
// the connection, attachment first. SendWithMessage: what it sends is that
// layout, with the header's attachment_len, by either path.
#include "rpc/internal/payload.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "tests/proto/test_service.pb.h"

namespace rdmarpc::internal {
namespace {

class CountingConnection : public transport::Connection {
 public:
  absl::Status Send(transport::OutboundMessage&& msg) override {
    sent = std::move(msg);
    return absl::OkStatus();
  }
  absl::StatusOr<transport::Buffer> AllocatePayload(size_t size) override {
    ++allocations;
    if (fail) return absl::ResourceExhaustedError("bound reached");
    return transport::Buffer::Allocate(size);
  }
  void Close() override {}
  bool Delivered() override { return true; }
  const std::string& peer() const override { return peer_; }

  int allocations = 0;
  bool fail = false;
  transport::OutboundMessage sent;

 private:
  const std::string peer_ = "test";
};

test::EchoRequest Message() {
  test::EchoRequest m;
  m.set_data("the message");
  m.set_tag(7);
  return m;
}

void ExpectLayout(const transport::Buffer& payload, absl::string_view attachment,
                  const test::EchoRequest& message) {
  ASSERT_EQ(payload.size(), attachment.size() + message.ByteSizeLong());
  EXPECT_EQ(absl::string_view(payload.data(), attachment.size()), attachment);
  test::EchoRequest back;
  ASSERT_TRUE(back.ParseFromArray(payload.data() + attachment.size(),
                                  static_cast<int>(payload.size() - attachment.size())));
  EXPECT_EQ(back.data(), message.data());
  EXPECT_EQ(back.tag(), message.tag());
}

TEST(AttachmentMemorySize, TheRoomIsCutToWhatAFrameLeaves) {
  EXPECT_EQ(*AttachmentMemorySize(100, 1024, 1 << 20), 1124u);
  EXPECT_EQ(*AttachmentMemorySize(100, 1024, 1000), 1000u);
  EXPECT_EQ(*AttachmentMemorySize(1000, 1024, 1000), 1000u);
  // A room near SIZE_MAX would wrap the sum to fewer bytes than the
  // attachment itself.
  EXPECT_EQ(*AttachmentMemorySize(100, SIZE_MAX, 1 << 20), size_t{1} << 20);
  EXPECT_EQ(*AttachmentMemorySize(SIZE_MAX, SIZE_MAX, SIZE_MAX), SIZE_MAX);
}

TEST(AttachmentMemorySize, AnAttachmentLargerThanAFrameIsRefused) {
  auto refused = AttachmentMemorySize(1001, 0, 1000);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(), "attachment of 1001 bytes exceeds max_message_size 1000");
}

TEST(BuildPayload, WritesTheMessageAfterTheAttachmentInPlace) {
  CountingConnection conn;
  const test::EchoRequest message = Message();
  const size_t size = message.ByteSizeLong();
  Attachment att(transport::Buffer::Allocate(100 + size), 100);
  memset(att.data(), 'a', 100);
  const char* where = att.data();
  auto payload = BuildPayload(conn, std::move(att), message, size);
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_EQ(payload->data(), where) << "the attachment was moved";
  EXPECT_EQ(conn.allocations, 0);
  ExpectLayout(*payload, std::string(100, 'a'), message);
}

TEST(BuildPayload, CopiesTheAttachmentWhenTheMessageDoesNotFit) {
  CountingConnection conn;
  const test::EchoRequest message = Message();
  const size_t size = message.ByteSizeLong();
  Attachment att(transport::Buffer::Allocate(100 + size - 1), 100);
  memset(att.data(), 'b', 100);
  const char* where = att.data();
  auto payload = BuildPayload(conn, std::move(att), message, size);
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_NE(payload->data(), where);
  EXPECT_EQ(conn.allocations, 1);
  ExpectLayout(*payload, std::string(100, 'b'), message);
}

TEST(BuildPayload, NoAttachmentIsJustTheMessage) {
  CountingConnection conn;
  const test::EchoRequest message = Message();
  auto payload = BuildPayload(conn, Attachment(), message, message.ByteSizeLong());
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_EQ(conn.allocations, 1);
  ExpectLayout(*payload, "", message);
}

TEST(BuildPayload, AllocationFailureIsReturned) {
  CountingConnection conn;
  conn.fail = true;
  const test::EchoRequest message = Message();
  auto payload = BuildPayload(conn, Attachment::CopyOf("no room"), message,
                              message.ByteSizeLong());
  EXPECT_EQ(payload.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(SendWithMessage, WithoutAnAttachmentTheMessageIsThePayload) {
  CountingConnection conn;
  const test::EchoRequest message = Message();
  transport::OutboundMessage msg;
  msg.header.call_id = 42;
  msg.header.attachment_len = 99;  // stale: SendWithMessage sets it
  ASSERT_TRUE(SendWithMessage(conn, std::move(msg), Attachment(), message,
                              message.ByteSizeLong())
                  .ok());
  EXPECT_EQ(conn.sent.header.call_id, 42u);
  EXPECT_EQ(conn.sent.header.attachment_len, 0u);
  ExpectLayout(conn.sent.payload, "", message);
}

TEST(SendWithMessage, WithAnAttachmentItComesFirst) {
  CountingConnection conn;
  const test::EchoRequest message = Message();
  ASSERT_TRUE(SendWithMessage(conn, transport::OutboundMessage(), Attachment::CopyOf("att"),
                              message, message.ByteSizeLong())
                  .ok());
  EXPECT_EQ(conn.sent.header.attachment_len, 3u);
  ExpectLayout(conn.sent.payload, "att", message);
}

TEST(SendWithMessage, AllocationFailureIsReturnedAndNothingSent) {
  CountingConnection conn;
  conn.fail = true;
  const test::EchoRequest message = Message();
  transport::OutboundMessage msg;
  msg.header.call_id = 5;
  EXPECT_EQ(SendWithMessage(conn, std::move(msg), Attachment(), message, message.ByteSizeLong())
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(conn.sent.header.call_id, 0u);
}

}  // namespace
}  // namespace rdmarpc::internal
