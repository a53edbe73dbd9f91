// A process short of memory (an address-space limit, `ulimit -v`; a host
// with strict overcommit): a message it has no memory for ends that one call
// with RESOURCE_EXHAUSTED, the connection stays, and everyone else is served.
// The peer chooses how big a message is (up to max_message_size), so an
// allocation that fails here must not end the process.
#include <sys/resource.h>

#include <chrono>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "rpc/internal/send_faults.h"
#include "tests/echo_service.h"
#include "tests/raw_connection.h"
#include "transport/rdma/testing/rdma_test_env.h"
#include "transport/wire_format.h"

namespace rdmarpc::testing {
namespace {

using transport::Header;

constexpr size_t kMiB = size_t{1} << 20;

// The process's address space now, from /proc/self/status (VmSize).
size_t AddressSpaceBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  }
  ADD_FAILURE() << "no VmSize in /proc/self/status";
  return 0;
}

// While it lives, the process may map at most `room` bytes more than it has.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(size_t room) {
    EXPECT_EQ(getrlimit(RLIMIT_AS, &before_), 0);
    rlimit tight = before_;
    tight.rlim_cur = AddressSpaceBytes() + room;
    EXPECT_EQ(setrlimit(RLIMIT_AS, &tight), 0);
  }
  ~AddressSpaceLimit() { EXPECT_EQ(setrlimit(RLIMIT_AS, &before_), 0); }

 private:
  rlimit before_{};
};

// Sends a frame whose payload is `bytes` a MiB at a time: a copy of it all
// would need the memory that the test has taken away.
void SendFrameInChunks(RawConnection& peer, const Header& h, const std::string& bytes) {
  peer.SendFrame(h, "", "", /*claimed_payload_len=*/bytes.size());
  for (size_t sent = 0; sent < bytes.size(); sent += kMiB) peer.SendBytes(bytes.substr(sent, kMiB));
}

// Room for one copy of a kBig-byte message beyond what the process has, not
// for two. kBig is more than a glibc malloc arena's heap (64 MiB), so that
// its copies cannot land in arena space the process reserved before the
// limit: each one needs more address space.
constexpr size_t kRoom = 160 * kMiB;
constexpr size_t kBig = 96 * kMiB;
constexpr size_t kHuge = 256 * kMiB;  // more than kRoom
constexpr size_t kMaxMessage = 512 * kMiB;

// `scheme`://the test interface:0, for a server to listen on.
std::string Address(const std::string& scheme) {
  return scheme + "://" + rdma::testing::RequireRdmaTestAddress() + ":0";
}

// An echo server and a channel to it, both allowed messages of kMaxMessage.
class EchoServerAndChannel : public ::testing::Test {
 protected:
  void Start(const std::string& listen) {
    server_ = std::make_unique<TestServer>(listen, kMaxMessage);
    ASSERT_TRUE(server_->server);
    ChannelOptions options;
    options.max_message_size = kMaxMessage;
    auto ch = Channel::Create(server_->address, options);
    ASSERT_TRUE(ch.ok()) << ch.status();
    good_ = *ch;
    ASSERT_TRUE(EchoOn(*good_, "warm").ok());
  }
  // One Echo call of `request` on the channel, from memory made before any
  // limit.
  Status Call(const EchoRequest& request) {
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(60));
    EchoResponse response;
    return good_->Call(kEcho, &ctx, request, &response);
  }

  std::unique_ptr<TestServer> server_;
  std::shared_ptr<Channel> good_;
};

// A transport, and how its errors say which side ran out of memory.
struct TransportCase {
  std::string scheme;
  std::string sending;    // the sender's memory for the payload
  std::string receiving;  // the receiver's
};

void PrintTo(const TransportCase& c, std::ostream* os) { *os << c.scheme; }

// Over RDMA and TCP: what the runtime and either transport allocate.
class OutOfMemory : public EchoServerAndChannel,
                    public ::testing::WithParamInterface<TransportCase> {
 protected:
  void SetUp() override { Start(Address(GetParam().scheme)); }
  // The call ended RESOURCE_EXHAUSTED, saying that the memory `side` needed
  // was not there.
  static void ExpectOutOfMemory(const Status& s, const std::string& side) {
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("out of memory for"), std::string::npos) << s;
    EXPECT_NE(s.message().find(side), std::string::npos) << s;
  }
};

INSTANTIATE_TEST_SUITE_P(
    Transports, OutOfMemory,
    ::testing::Values(TransportCase{"rdma", "for the peer to READ", "to READ a payload into"},
                      TransportCase{"tcp", "bytes of a message to", "bytes of a message from"}),
    [](const auto& info) { return info.param.scheme; });

TEST_P(OutOfMemory, ARequestTheServerCannotHoldIsAnsweredResourceExhausted) {
  EchoRequest request;
  request.mutable_data()->assign(kBig, 'q');  // the client's copy fits, the server's does not
  {
    AddressSpaceLimit limit(kRoom);
    ExpectOutOfMemory(Call(request), GetParam().receiving);
  }
  EXPECT_TRUE(EchoOn(*good_, "the channel stays").ok());
}

TEST_P(OutOfMemory, AResponseTheServerHasNoMemoryToSendIsAnsweredResourceExhausted) {
  EchoRequest request;
  request.set_response_size(kBig);  // the handler's copy fits, the frame's does not
  {
    AddressSpaceLimit limit(kRoom);
    ExpectOutOfMemory(Call(request), GetParam().sending);
  }
  EXPECT_TRUE(EchoOn(*good_, "the channel stays").ok());
}

TEST_P(OutOfMemory, AClientWithNoMemoryForItsRequestEndsTheCallResourceExhausted) {
  EchoRequest request;
  request.mutable_data()->assign(kHuge, 'q');
  {
    AddressSpaceLimit limit(kRoom);
    ExpectOutOfMemory(Call(request), GetParam().sending);
  }
  EXPECT_TRUE(EchoOn(*good_, "the channel stays").ok());
}

// A call that keeps a copy of its request: one that may be retried, or that
// waits for its channel to connect.
TEST_P(OutOfMemory, ACallWithNoMemoryForTheCopyItKeepsEndsResourceExhausted) {
  ChannelOptions retrying;
  retrying.max_message_size = kMaxMessage;
  retrying.retry.max_attempts = 2;
  ChannelOptions plain;
  plain.max_message_size = kMaxMessage;
  for (const auto& [options, copy] : {std::pair{retrying, "kept for retries"},
                                      std::pair{plain, "kept until a connection is up"}}) {
    auto ch = Channel::Create(server_->address, options);  // connects on its first call
    ASSERT_TRUE(ch.ok()) << ch.status();
    EchoRequest request;
    request.mutable_data()->assign(kHuge, 'q');
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(60));
    EchoResponse response;
    {
      AddressSpaceLimit limit(kRoom);
      const Status s = (*ch)->Call(kEcho, &ctx, request, &response);
      EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("out of memory for " + std::to_string(request.ByteSizeLong()) +
                                 " bytes of the request's copy " + copy),
                std::string::npos)
          << s;
    }
    EXPECT_TRUE(EchoOn(**ch, "the channel works").ok()) << copy;
  }
}

// A call whose connection closed under its send (SendFaults opens that
// window on purpose, rpc_suite_connecting.cc) goes on the next connection
// from a copy of its request; with no memory for the copy it ends, and the
// channel connects again for the next call.
TEST_P(OutOfMemory, ACallRefusedUnsentWithNoMemoryToSendItAgainEndsResourceExhausted) {
  internal::SendFaults::Disarm disarm;
  EchoRequest request;
  request.mutable_data()->assign(kHuge, 'q');
  internal::SendFaults::RefuseRequests() = 1;
  {
    AddressSpaceLimit limit(kRoom);
    const Status s = Call(request);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("out of memory for " + std::to_string(request.ByteSizeLong()) +
                               " bytes of the request's copy kept to send it again"),
              std::string::npos)
        << s;
  }
  EXPECT_EQ(internal::SendFaults::RefuseRequests().load(), 0) << "nothing was refused";
  EXPECT_EQ(good_->stats().transparent_retries, 0u) << "it was sent again";
  const Status again = EchoOn(*good_, "the channel connects again");
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_EQ(good_->stats().connect_attempts, 2u) << "the refusing connection was used again";
}

// A response the client has no memory to READ into, from an RDMA server
// that has the memory to send it: it writes the response's attachment in
// place, into a registered block that its pool kept idle from a first such
// call (on another channel, so that this client's pool has no block to
// reuse). The client's call ends RESOURCE_EXHAUSTED, and the channel goes
// on. (Over TCP: ClientOutOfMemory below.)
class RdmaClientOutOfMemory : public EchoServerAndChannel {
 protected:
  void SetUp() override { Start(Address("rdma")); }
  // An Echo call on `channel` whose response carries a kBig-byte attachment.
  static Status CallForBigAttachment(Channel& channel) {
    EchoRequest request;
    request.set_response_attachment_size(kBig);
    ClientContext ctx;
    ctx.set_timeout(absl::Seconds(60));
    EchoResponse response;
    Status s = channel.Call(kEcho, &ctx, request, &response);
    if (s.ok() && ctx.response_attachment().size() != kBig) {
      return Status(
          StatusCode::kInternal,
          "an attachment of " + std::to_string(ctx.response_attachment().size()) + " bytes");
    }
    return s;
  }
};

TEST_F(RdmaClientOutOfMemory, AResponseItHasNoMemoryToReadEndsTheCallResourceExhausted) {
  ChannelOptions options;
  options.max_message_size = kMaxMessage;
  {
    auto warm = Channel::Create(server_->address, options);
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE(CallForBigAttachment(**warm).ok()) << "the server's pool keeps its block";
  }
  {
    // Less than the block the client's READ needs, more than anything else
    // a call takes.
    AddressSpaceLimit limit(kBig / 2);
    const Status s = CallForBigAttachment(*good_);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("out of memory for"), std::string::npos) << s;
    EXPECT_NE(s.message().find("to READ a payload into"), std::string::npos) << s;
    EXPECT_TRUE(EchoOn(*good_, "the channel stays").ok());
  }
  EXPECT_TRUE(CallForBigAttachment(*good_).ok()) << "with memory, the same call works";
}

// A TCP server and a raw client that sends it what the test says: the
// request's bytes are read and dropped, so the connection goes on.
class TcpServerOutOfMemory : public EchoServerAndChannel {
 protected:
  void SetUp() override {
    Start("tcp://127.0.0.1:0");  // where RawClient connects
    port_ = std::stoi(server_->address.substr(server_->address.rfind(':') + 1));
  }
  // The bad connection's next frame is the answer to `call_id`: an error
  // that says it had no memory for `bytes` bytes.
  static void ExpectOutOfMemoryAnswer(RawConnection& bad, uint64_t call_id, size_t bytes) {
    auto r = bad.ReadFrame();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->header.call_id, call_id);
    EXPECT_EQ(r->header.status, static_cast<uint16_t>(StatusCode::kResourceExhausted));
    EXPECT_NE(r->payload.find("out of memory for " + std::to_string(bytes) + " bytes"),
              std::string::npos)
        << r->payload;
  }
  // Once the limit is gone, the bad connection's next call is answered.
  static void ExpectConnectionStays(RawConnection& bad, uint64_t call_id) {
    bad.SendFrame(Request(call_id, kEcho.id), "", EchoBytes("the connection stays"));
    auto r = bad.ReadFrame();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->header.call_id, call_id);
    EXPECT_EQ(r->header.status, 0);
  }

  int port_ = 0;
};

TEST_F(TcpServerOutOfMemory, ARequestItCannotHoldIsSkippedAndAnsweredResourceExhausted) {
  RawClient bad(port_);
  const std::string filler(kHuge, 'q');
  {
    AddressSpaceLimit limit(kRoom);
    SendFrameInChunks(bad, Request(1, kEcho.id), filler);
    ExpectOutOfMemoryAnswer(bad, 1, kHuge);
    EXPECT_TRUE(EchoOn(*good_, "others are served").ok());
  }
  ExpectConnectionStays(bad, 2);
}

TEST_F(TcpServerOutOfMemory, ARequestItCannotParseIsAnsweredResourceExhausted) {
  RawClient bad(port_);
  const std::string request = EchoBytes(std::string(kBig, 'q'));
  {
    AddressSpaceLimit limit(kRoom);
    SendFrameInChunks(bad, Request(1, kEcho.id), request);
    ExpectOutOfMemoryAnswer(bad, 1, request.size());
    EXPECT_TRUE(EchoOn(*good_, "others are served").ok());
  }
  ExpectConnectionStays(bad, 2);
}

// A client's channel to a RawServer that answers its one call with what the
// test sends.
class ClientOutOfMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    ChannelOptions options;
    options.max_message_size = kMaxMessage;
    auto ch = Channel::Create(raw_.address(), options);
    ASSERT_TRUE(ch.ok()) << ch.status();
    channel_ = *ch;
  }
  // Starts a call on the channel (on a thread made before any limit) and
  // returns the request as the server read it.
  std::optional<RawConnection::Frame> StartCall() {
    call_ = std::async(std::launch::async, [this] { return EchoOn(*channel_, "x"); });
    if (peer_ == nullptr) peer_ = raw_.Accept();
    if (peer_ == nullptr) return std::nullopt;
    return peer_->ReadFrame();
  }
  // The call ended RESOURCE_EXHAUSTED, saying it had no memory for `bytes`.
  void ExpectOutOfMemory(size_t bytes) {
    ASSERT_EQ(call_.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    const Status s = call_.get();
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("out of memory for " + std::to_string(bytes) + " bytes"),
              std::string::npos)
        << s;
  }
  // Once the limit is gone, the channel's next call is answered on the
  // same connection.
  void ExpectConnectionStays() {
    auto req = StartCall();
    ASSERT_TRUE(req);
    peer_->SendFrame(Response(req->header.call_id), "", EchoResponseBytes("x"));
    ASSERT_EQ(call_.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    EXPECT_TRUE(call_.get().ok());
  }

  RawServer raw_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<RawConnection> peer_;
  std::future<Status> call_;
};

TEST_F(ClientOutOfMemory, AResponseItCannotHoldEndsTheCallResourceExhausted) {
  auto req = StartCall();
  ASSERT_TRUE(req);
  const std::string filler(kHuge, 'q');
  {
    AddressSpaceLimit limit(kRoom);
    SendFrameInChunks(*peer_, Response(req->header.call_id), filler);
    ExpectOutOfMemory(kHuge);
  }
  ExpectConnectionStays();
}

TEST_F(ClientOutOfMemory, AResponseItCannotParseEndsTheCallResourceExhausted) {
  auto req = StartCall();
  ASSERT_TRUE(req);
  const std::string response = EchoResponseBytes(std::string(kBig, 'q'));
  {
    AddressSpaceLimit limit(kRoom);
    SendFrameInChunks(*peer_, Response(req->header.call_id), response);
    ExpectOutOfMemory(response.size());
  }
  ExpectConnectionStays();
}

}  // namespace
}  // namespace rdmarpc::testing
