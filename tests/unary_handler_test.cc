// UnaryHandler's pooled request/response pairs: a pair comes back with its
// response cleared and its request replaced by the new parse, keeps the
// capacity small calls gave it, and is not kept after a large call (so one
// huge request does not pin its memory in the pool). A handler that throws
// or drops `done` ends its call UNKNOWN, once; a second run of `done` does
// nothing.
#include <optional>
#include <stdexcept>
#include <string>

#include "gtest/gtest.h"
#include "rpc/service.h"
#include "tests/proto/test_service.pb.h"

namespace rdmarpc::testing {
namespace {

using test::EchoRequest;
using test::EchoResponse;

// The connection a FakeCall's context names; nothing is sent on it.
class NoConnection : public transport::Connection {
 public:
  absl::Status Send(transport::OutboundMessage&&) override {
    return absl::UnavailableError("no connection");
  }
  absl::StatusOr<transport::Buffer> AllocatePayload(size_t size) override {
    return transport::Buffer::Allocate(size);
  }
  void Close() override {}
  bool Delivered() override { return true; }
  const std::string& peer() const override { return peer_; }

 private:
  const std::string peer_ = "test";
};

// A served call without a transport: the serialized request in, the status
// and response out.
class FakeCall : public ServerCall {
 public:
  explicit FakeCall(const EchoRequest& req)
      : request_(req.SerializeAsString()),
        ctx_(method_, conn_, /*max_message_size=*/64u << 20, absl::InfiniteFuture(), Metadata(),
             absl::string_view()) {}
  ServerContext* context() override { return &ctx_; }
  absl::string_view request() const override { return request_; }
  void Finish(const Status& status, const google::protobuf::MessageLite* response) override {
    ++finishes_;
    status_ = status;
    if (response != nullptr) response_ = response->SerializeAsString();
  }

  int finishes_ = 0;
  Status status_{StatusCode::kUnknown, "not finished"};
  std::string response_;

 private:
  const std::string method_ = "/rdmarpc.test.Echo/Echo";
  NoConnection conn_;
  std::string request_;
  ServerContext ctx_;
};

struct Seen {
  size_t data_capacity = 0;
  std::string data;
  int64_t tag = 0;
  bool response_empty = false;
};

TEST(UnaryHandler, PooledMessagesComeBackClearedAndLargeOnesAreNotKept) {
  Seen seen;
  MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
      [&seen](ServerContext*, const EchoRequest* req, EchoResponse* resp, DoneCallback done) {
        seen = Seen{req->data().capacity(), req->data(), req->tag(),
                    resp->ByteSizeLong() == 0};
        resp->set_data(req->data());
        resp->set_tag(req->tag());
        std::move(done)(Status());
      });
  const auto serve = [&](size_t data_bytes, int64_t tag) {
    EchoRequest req;
    req.set_data(std::string(data_bytes, 'x'));
    req.set_tag(tag);
    FakeCall call(req);
    handler(&call);
    EXPECT_TRUE(call.status_.ok()) << call.status_;
    EchoResponse resp;
    EXPECT_TRUE(resp.ParseFromString(call.response_));
    EXPECT_EQ(resp.data().size(), data_bytes);
    EXPECT_EQ(resp.tag(), tag);
  };

  serve(4000, 1);
  // The pair used for 4000 bytes is reused: its string kept the capacity,
  // the response was cleared and the request holds only the new call's.
  serve(0, 2);
  EXPECT_GE(seen.data_capacity, 4000u);
  EXPECT_EQ(seen.data, "");
  EXPECT_EQ(seen.tag, 2);
  EXPECT_TRUE(seen.response_empty);

  // A request over the bound is served, but its pair is freed afterwards:
  // the next call does not find a string of that size in its request.
  serve(kMaxPooledMessageBytes + 1, 3);
  serve(0, 4);
  EXPECT_LT(seen.data_capacity, kMaxPooledMessageBytes);
  EXPECT_EQ(seen.tag, 4);
}

TEST(UnaryHandler, UnparsableRequestIsInvalidArgumentAndThePairIsReusable) {
  int handled = 0;
  MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
      [&handled](ServerContext*, const EchoRequest* req, EchoResponse* resp, DoneCallback done) {
        ++handled;
        EXPECT_EQ(req->tag(), 9);
        EXPECT_EQ(req->data(), "");
        resp->set_tag(req->tag());
        std::move(done)(Status());
      });
  // Field 1 (bytes) claiming 100 bytes where 2 follow.
  std::string bad("\x0a\x64xy", 4);
  class RawCall : public FakeCall {
   public:
    explicit RawCall(std::string raw) : FakeCall(EchoRequest()), raw_(std::move(raw)) {}
    absl::string_view request() const override { return raw_; }
    std::string raw_;
  };
  RawCall bad_call(bad);
  handler(&bad_call);
  EXPECT_EQ(bad_call.status_.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_call.status_.message().find("rdmarpc.test.EchoRequest"), std::string::npos)
      << bad_call.status_;
  EXPECT_EQ(handled, 0);

  EchoRequest good;
  good.set_tag(9);
  FakeCall good_call(good);
  handler(&good_call);
  EXPECT_TRUE(good_call.status_.ok()) << good_call.status_;
  EXPECT_EQ(handled, 1);
}

TEST(UnaryHandler, AHandlerThatThrowsEndsItsCallUnknownOnceAndTheThrowGoesNoFurther) {
  for (int what : {0, 1}) {
    SCOPED_TRACE(what == 0 ? "a std::exception" : "an int");
    MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
        [what](ServerContext*, const EchoRequest*, EchoResponse* resp, DoneCallback) {
          resp->set_data("half written");
          if (what == 0) throw std::out_of_range("no such key");
          throw 7;
        });
    FakeCall call{EchoRequest()};
    handler(&call);
    EXPECT_EQ(call.finishes_, 1);
    EXPECT_EQ(call.status_.code(), StatusCode::kUnknown) << call.status_;
    EXPECT_EQ(call.status_.message(), "/rdmarpc.test.Echo/Echo: the handler threw an exception");
    EXPECT_EQ(call.response_, "") << "what the handler wrote before it threw was sent";
  }
}

TEST(UnaryHandler, AHandlerThatDropsDoneEndsItsCallUnknownOnce) {
  MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
      [](ServerContext*, const EchoRequest*, EchoResponse*, DoneCallback done) {
        DoneCallback lost = std::move(done);
      });
  FakeCall call{EchoRequest()};
  handler(&call);
  EXPECT_EQ(call.finishes_, 1);
  EXPECT_EQ(call.status_.code(), StatusCode::kUnknown) << call.status_;
  EXPECT_EQ(call.status_.message(), "/rdmarpc.test.Echo/Echo: the handler did not call done");
}

TEST(UnaryHandler, ASecondRunOfDoneIsIgnored) {
  MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
      [](ServerContext*, const EchoRequest* req, EchoResponse* resp, DoneCallback done) {
        resp->set_tag(req->tag());
        std::move(done)(Status());
        std::move(done)(Status(StatusCode::kInternal, "again"));  // NOLINT: the bug under test
      });
  EchoRequest req;
  req.set_tag(3);
  FakeCall call(req);
  handler(&call);
  EXPECT_EQ(call.finishes_, 1);
  EXPECT_TRUE(call.status_.ok()) << call.status_;
}

// A handler that passed `done` on and then threw: whoever holds `done` still
// finishes the call, and only then.
TEST(UnaryHandler, ADonePassedOnBeforeAThrowFinishesTheCallWhenCalled) {
  std::optional<DoneCallback> kept;
  MethodHandler handler = UnaryHandler<EchoRequest, EchoResponse>(
      [&kept](ServerContext*, const EchoRequest* req, EchoResponse* resp, DoneCallback done) {
        resp->set_tag(req->tag());
        kept = std::move(done);
        throw std::runtime_error("after passing done on");
      });
  EchoRequest req;
  req.set_tag(5);
  FakeCall call(req);
  handler(&call);
  EXPECT_EQ(call.finishes_, 0);
  ASSERT_TRUE(kept.has_value());
  std::move (*kept)(Status());
  EXPECT_EQ(call.finishes_, 1);
  EXPECT_TRUE(call.status_.ok()) << call.status_;
  EchoResponse resp;
  ASSERT_TRUE(resp.ParseFromString(call.response_));
  EXPECT_EQ(resp.tag(), 5);
  kept.reset();
  EXPECT_EQ(call.finishes_, 1);
}

}  // namespace
}  // namespace rdmarpc::testing
