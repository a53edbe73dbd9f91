#include "rpc/retry_info.h"

#include <cstdint>
#include <string>

#include "absl/strings/cord.h"
#include "proto/retry_info.pb.h"

namespace rdmarpc {

void SetRetryDelay(Status* status, absl::Duration delay) {
  if (status->ok()) return;
  if (delay == absl::InfiniteDuration() || delay == -absl::InfiniteDuration()) delay = kDoNotRetry;
  // Duration's fields share its sign (google/protobuf/duration.proto).
  const int64_t seconds = absl::IDivDuration(delay, absl::Seconds(1), &delay);
  errors::RetryInfo info;
  info.mutable_retry_delay()->set_seconds(seconds);
  info.mutable_retry_delay()->set_nanos(static_cast<int32_t>(absl::ToInt64Nanoseconds(delay)));
  status->SetPayload(kRetryInfoTypeUrl, absl::Cord(info.SerializeAsString()));
}

std::optional<absl::Duration> RetryDelay(const Status& status) {
  const auto payload = status.GetPayload(kRetryInfoTypeUrl);
  if (!payload) return std::nullopt;
  errors::RetryInfo info;
  if (!info.ParseFromString(std::string(*payload)) || !info.has_retry_delay()) return std::nullopt;
  return absl::Seconds(info.retry_delay().seconds()) +
         absl::Nanoseconds(info.retry_delay().nanos());
}

}  // namespace rdmarpc
