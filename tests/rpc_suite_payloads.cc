// Message sizes and attachments: the size limits and what a call carries
// beside its message, on both sides of the transports' thresholds (see
// rpc_suite.h).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "tests/proto/test_service.pb.h"
#include "tests/rpc_suite.h"
#include "tests/rpc_suite_util.h"
#include "transport/memory_quota.h"

namespace rdmarpc::testing {
namespace {

using test::EchoRequest;
using test::EchoResponse;

TEST_P(RpcSuite, OversizeMessagesAreResourceExhaustedNamingTheLimit) {
  TestServer ts(GetParam().listen_addr(), /*max_message=*/64 * 1024);
  ASSERT_TRUE(ts.server);
  ChannelOptions small;
  small.max_message_size = 32 * 1024;
  auto ch = MakeChannel(ts.address, small);
  EchoResponse resp;
  {  // Too big for the channel: refused before sending.
    ClientContext ctx;
    Status s = ch->Call(kEcho, &ctx, Req(std::string(40 * 1024, 'a')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("32768"), absl::string_view::npos) << s;
  }
  auto big = MakeChannel(ts.address);
  {  // Too big for the server: that call fails, the connection stays.
    ClientContext ctx;
    Status s = big->Call(kEcho, &ctx, Req(std::string(100 * 1024, 'b')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("65536"), absl::string_view::npos) << s;
  }
  {  // A response too big for the server to send.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_size(80 * 1024);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  }
  {  // A response too big for the channel to accept.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_size(40 * 1024);
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  }
  ClientContext ctx;
  EXPECT_TRUE(big->Call(kEcho, &ctx, Req("still fine"), &resp).ok());
}

// Attachments at sizes on both sides of the RDMA transport's SEND/READ
// threshold (the default slot of 8 KiB less header), both ways, next to a
// message that must arrive intact too.
TEST_P(RpcSuite, AttachmentsTravelBothWaysBesideTheMessage) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (size_t size : {size_t{1}, size_t{4000}, size_t{8127}, size_t{8128}, size_t{8129},
                      size_t{65536}, size_t{1} << 20, size_t{8} << 20}) {
    for (bool in_place : {true, false}) {
      SCOPED_TRACE(absl::StrCat(size, in_place ? " bytes, allocated" : " bytes, copied"));
      std::string bytes(size, '\0');
      FillAttachment(bytes.data(), size);
      ClientContext ctx;
      if (in_place) {
        auto att = ch->AllocateAttachment(size);
        ASSERT_TRUE(att.ok()) << att.status();
        ASSERT_EQ(att->size(), size);
        FillAttachment(att->data(), size);
        ctx.set_request_attachment(std::move(*att));
      } else {
        ctx.set_request_attachment(Attachment::CopyOf(bytes));
      }
      EchoRequest req = Req("the message " + std::to_string(size));
      req.set_tag(static_cast<int64_t>(size));
      EchoResponse resp;
      Status s = ch->Call(kEcho, &ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(resp.data(), req.data());
      EXPECT_EQ(resp.tag(), req.tag());
      EXPECT_EQ(resp.attachment_size(), static_cast<int64_t>(size));
      EXPECT_EQ(resp.attachment_checksum(), AttachmentChecksum(bytes));
      ASSERT_EQ(ctx.response_attachment().size(), size);
      EXPECT_TRUE(ctx.response_attachment().view() == bytes);
    }
  }
}

TEST_P(RpcSuite, ResponseAttachmentWrittenInPlaceAndMessagesBeyondTheRoom) {
  TestServer ts(GetParam().listen_addr());
  ASSERT_TRUE(ts.server);
  auto ch = MakeChannel(ts.address);
  for (size_t size : {size_t{100}, size_t{3} << 20}) {
    SCOPED_TRACE(size);
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(static_cast<int64_t>(size));
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.attachment_size(), 0) << "no request attachment was sent";
    std::string expected(size, '\0');
    FillAttachment(expected.data(), size);
    EXPECT_TRUE(ctx.response_attachment().view() == expected);
  }
  // A message larger than the room left after the attachment still goes,
  // with the attachment copied once.
  const std::string message(5000, 'm');
  for (size_t size : {size_t{10}, size_t{1} << 20}) {
    SCOPED_TRACE(size);
    auto att = ch->AllocateAttachment(size, /*message_room=*/0);
    ASSERT_TRUE(att.ok()) << att.status();
    FillAttachment(att->data(), size);
    const uint64_t checksum = AttachmentChecksum(att->view());
    ClientContext ctx;
    ctx.set_request_attachment(std::move(*att));
    EchoResponse resp;
    Status s = ch->Call(kEcho, &ctx, Req(message), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.data(), message);
    EXPECT_EQ(resp.attachment_size(), static_cast<int64_t>(size));
    EXPECT_EQ(resp.attachment_checksum(), checksum);
  }
}

TEST_P(RpcSuite, AttachmentsCountAgainstMaxMessageSize) {
  TestServer ts(GetParam().listen_addr(), /*max_message=*/64 * 1024);
  ASSERT_TRUE(ts.server);
  ChannelOptions small;
  small.max_message_size = 32 * 1024;
  auto ch = MakeChannel(ts.address, small);
  {
    auto att = ch->AllocateAttachment(40 * 1024);
    EXPECT_EQ(att.status().code(), StatusCode::kResourceExhausted) << att.status();
  }
  EchoResponse resp;
  {  // Attachment and message fit alone, not together.
    ClientContext ctx;
    ctx.set_request_attachment(Attachment::CopyOf(std::string(30 * 1024, 'a')));
    Status s = ch->Call(kEcho, &ctx, Req(std::string(3 * 1024, 'b')), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 30720 bytes"), absl::string_view::npos) << s;
  }
  auto big = MakeChannel(ts.address);
  {  // Too big for the server to accept: that call fails, no attachment back.
    ClientContext ctx;
    ctx.set_request_attachment(Attachment::CopyOf(std::string(100 * 1024, 'c')));
    Status s = big->Call(kEcho, &ctx, Req("x"), &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  {  // A response attachment too big for the server to send.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(80 * 1024);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 81920 bytes"), absl::string_view::npos) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  {  // One no memory could hold: refused by the bound, not tried (a failed
     // allocation there would end the server).
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(int64_t{1} << 62);
    Status s = big->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("attachment of 4611686018427387904 bytes exceeds "
                               "max_message_size 65536"),
              absl::string_view::npos)
        << s;
  }
  {  // The room asked for after an attachment is what a frame leaves: a
     // room near SIZE_MAX no longer wraps to a block shorter than the
     // attachment.
    auto att = ch->AllocateAttachment(100, SIZE_MAX);
    ASSERT_TRUE(att.ok()) << att.status();
    ASSERT_EQ(att->size(), 100u);
    FillAttachment(att->data(), 100);
    const uint64_t checksum = AttachmentChecksum(att->view());
    ClientContext ctx;
    ctx.set_request_attachment(std::move(*att));
    Status s = ch->Call(kEcho, &ctx, Req("after a room of SIZE_MAX"), &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.attachment_size(), 100);
    EXPECT_EQ(resp.attachment_checksum(), checksum);
  }
  {  // One too big for the channel to accept.
    ClientContext ctx;
    EchoRequest req;
    req.set_response_attachment_size(40 * 1024);
    Status s = ch->Call(kEcho, &ctx, req, &resp);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_TRUE(ctx.response_attachment().empty());
  }
  ClientContext ctx;
  ctx.set_request_attachment(Attachment::CopyOf("fits"));
  ASSERT_TRUE(big->Call(kEcho, &ctx, Req("still fine"), &resp).ok());
  EXPECT_EQ(ctx.response_attachment().view(), "fits");
}

// Two servers and two channels, every transport given one memory quota
// (transport/memory_quota.h): payload sizes that change on one pair are
// not refused for the other pair's idle memory, a message larger than the
// quota is refused naming it, and what one channel holds (a response
// attachment it keeps) refuses another's call until it is let go. Over TCP
// a payload counts once, where it is received; over RDMA twice, in the
// sender's registered buffer and in the receiver's, each up to a quarter
// larger than the payload (transport/rdma/size_classes.h). So the quota is
// 10 MiB over TCP and 20 MiB over RDMA: a 6 MiB attachment held and
// another in transit need 12 MiB over TCP and 21 over RDMA, past either
// quota, and one alone fits. Over RDMA, a TCP server in the process is
// given the quota too: the RDMA transports' idle buffers must make way for
// its messages.
TEST_P(RpcSuite, TransportsSharingAMemoryQuotaAreBoundTogether) {
  constexpr size_t kMiB = size_t{1} << 20;
  const bool over_tcp = absl::StartsWith(GetParam().name, "tcp");
  auto quota = transport::MemoryQuota::Create("suite", (over_tcp ? 10 : 20) * kMiB);
  {
    transport::TransportTunables tunables;
    tunables.memory_quota = quota;
    TestServer first_server(GetParam().listen_addr(), 64 * kMiB, 4, tunables);
    TestServer second_server(GetParam().listen_addr(), 64 * kMiB, 4, tunables);
    ASSERT_TRUE(first_server.server && second_server.server);
    ChannelOptions options;
    options.transport = tunables;
    auto first = MakeChannel(first_server.address, options);
    auto second = MakeChannel(second_server.address, options);
    const auto send = [](Channel& ch, size_t size) {
      ClientContext ctx;
      ctx.set_timeout(absl::Seconds(30));
      EchoRequest req = Req(std::string(size, 'q'));
      req.set_response_size(1);
      EchoResponse resp;
      return ch.Call(kEcho, &ctx, req, &resp);
    };
    // Over RDMA: 3 MiB leave two 3.5 MiB buffers idle, and 6 MiB need two
    // of 7 MiB, 21 MiB with the idle ones kept; then 3 MiB again need the
    // 3.5 MiB ones back beside those 7 MiB ones, idle now (21 MiB).
    for (auto [ch, size] : {std::pair{first.get(), 3 * kMiB}, std::pair{second.get(), 6 * kMiB},
                            std::pair{first.get(), 3 * kMiB}}) {
      const Status s = send(*ch, size);
      EXPECT_TRUE(s.ok()) << size << " bytes: " << s;
    }
    const Status too_big = send(*first, 24 * kMiB);
    EXPECT_EQ(too_big.code(), StatusCode::kResourceExhausted) << too_big;
    EXPECT_NE(too_big.message().find("memory quota \"suite\""), absl::string_view::npos) << too_big;
    const Status after = send(*first, kMiB);
    EXPECT_TRUE(after.ok()) << "after the refusal: " << after;

    const auto attachment_back = [](Channel& ch, ClientContext* ctx) {
      ctx->set_timeout(absl::Seconds(30));
      EchoRequest req = Req("attachment");
      req.set_response_attachment_size(static_cast<int64_t>(6 * kMiB));
      EchoResponse resp;
      return ch.Call(kEcho, ctx, req, &resp);
    };
    auto kept = std::make_unique<ClientContext>();
    const Status held = attachment_back(*first, kept.get());
    ASSERT_TRUE(held.ok()) << held;
    ASSERT_EQ(kept->response_attachment().size(), 6 * kMiB);
    {
      ClientContext ctx;
      const Status refused = attachment_back(*second, &ctx);
      EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
      EXPECT_NE(refused.message().find("memory quota \"suite\""), absl::string_view::npos)
          << refused;
    }
    kept.reset();
    {
      ClientContext ctx;
      const Status let_go = attachment_back(*second, &ctx);
      EXPECT_TRUE(let_go.ok()) << "once the first channel let go: " << let_go;
      EXPECT_EQ(ctx.response_attachment().size(), 6 * kMiB);
    }
    if (!over_tcp) {
      // A TCP server and channel in the same process share the quota too,
      // as an auto:// server's two listeners do: a 12 MiB message to it
      // fits only once the RDMA pairs' idle buffers are given back.
      ASSERT_GT(quota->used(), 8 * kMiB) << "the RDMA buffers are not idle and reserved";
      TestServer tcp_server("tcp://127.0.0.1:0", 64 * kMiB, 4, tunables);
      ASSERT_TRUE(tcp_server.server);
      auto over_tcp_too = MakeChannel(tcp_server.address, options);
      const Status s = send(*over_tcp_too, 12 * kMiB);
      EXPECT_TRUE(s.ok()) << "over TCP beside RDMA: " << s;
    }
  }
  EXPECT_EQ(quota->used(), 0u) << "payload memory outlived the servers and channels";
}

}  // namespace
}  // namespace rdmarpc::testing
