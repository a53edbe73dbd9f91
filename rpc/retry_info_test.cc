#include "rpc/retry_info.h"

#include <string>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(RetryInfo, TheDelayRoundTripsOnAFailedStatus) {
  for (const absl::Duration delay :
       {absl::ZeroDuration(), absl::Milliseconds(200), absl::Seconds(1) + absl::Nanoseconds(1),
        absl::Hours(30), kDoNotRetry, absl::Milliseconds(-1500)}) {
    SCOPED_TRACE(absl::FormatDuration(delay));
    Status s(StatusCode::kUnavailable, "busy");
    SetRetryDelay(&s, delay);
    EXPECT_EQ(RetryDelay(s), delay);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_EQ(s.message(), "busy");
  }
  Status replaced(StatusCode::kUnavailable, "busy");
  SetRetryDelay(&replaced, absl::Seconds(1));
  SetRetryDelay(&replaced, absl::Seconds(2));
  EXPECT_EQ(RetryDelay(replaced), absl::Seconds(2));
  Status forever(StatusCode::kUnavailable, "busy");
  SetRetryDelay(&forever, absl::InfiniteDuration());
  EXPECT_EQ(RetryDelay(forever), kDoNotRetry);
}

// The bytes are google.rpc.RetryInfo's: field 1, a google.protobuf.Duration
// of 2 s and 5 ns (seconds = field 1, nanos = field 2).
TEST(RetryInfo, ItIsGoogleRpcRetryInfoUnderItsTypeUrl) {
  Status s(StatusCode::kResourceExhausted, "quota");
  SetRetryDelay(&s, absl::Seconds(2) + absl::Nanoseconds(5));
  const auto payload = s.GetPayload("type.googleapis.com/google.rpc.RetryInfo");
  ASSERT_TRUE(payload.has_value());
  EXPECT_EQ(std::string(*payload), std::string("\x0a\x04\x08\x02\x10\x05", 6));
}

TEST(RetryInfo, NoneOnAnOkStatusAndNoneFromBytesThatDoNotParse) {
  Status ok;
  SetRetryDelay(&ok, absl::Seconds(1));
  EXPECT_FALSE(RetryDelay(ok).has_value());
  EXPECT_FALSE(RetryDelay(Status(StatusCode::kUnavailable, "no payload")).has_value());
  Status garbage(StatusCode::kUnavailable, "busy");
  garbage.SetPayload(kRetryInfoTypeUrl, absl::Cord("\xff\xff\xff"));
  EXPECT_FALSE(RetryDelay(garbage).has_value());
  Status empty(StatusCode::kUnavailable, "busy");
  empty.SetPayload(kRetryInfoTypeUrl, absl::Cord(""));
  EXPECT_FALSE(RetryDelay(empty).has_value()) << "a RetryInfo without its delay";
}

}  // namespace
}  // namespace rdmarpc
