#include "rpc/retry_throttle.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace rdmarpc {

StatusOr<std::shared_ptr<RetryThrottle>> RetryThrottle::Create(int max_tokens, double token_ratio) {
  if (max_tokens <= 0 || max_tokens > 1000) {
    return Status(StatusCode::kInvalidArgument,
                  absl::StrCat("retry throttle max_tokens is ", max_tokens,
                               "; it must be above 0 and at most 1000"));
  }
  if (!(token_ratio >= 0.001 && token_ratio <= 1000)) {  // NaN fails both
    return Status(StatusCode::kInvalidArgument,
                  absl::StrCat("retry throttle token_ratio is ", token_ratio,
                               "; it must be at least 0.001 and at most 1000"));
  }
  const auto ratio_milli = static_cast<int64_t>(std::floor(token_ratio * 1000 + 1e-6));
  return std::shared_ptr<RetryThrottle>(new RetryThrottle(int64_t{max_tokens} * 1000, ratio_milli));
}

RetryThrottle::RetryThrottle(int64_t max_milli, int64_t ratio_milli)
    : max_milli_(max_milli), ratio_milli_(ratio_milli), milli_(max_milli) {}

bool RetryThrottle::RecordFailure() {
  int64_t now = milli_.load(std::memory_order_relaxed);
  int64_t next;
  do {
    next = std::max<int64_t>(now - 1000, 0);
  } while (!milli_.compare_exchange_weak(now, next, std::memory_order_relaxed));
  return next > max_milli_ / 2;
}

void RetryThrottle::RecordSuccess() {
  int64_t now = milli_.load(std::memory_order_relaxed);
  while (now < max_milli_ &&
         !milli_.compare_exchange_weak(now, std::min(now + ratio_milli_, max_milli_),
                                       std::memory_order_relaxed)) {
  }
}

double RetryThrottle::tokens() const { return milli_.load(std::memory_order_relaxed) / 1000.0; }

}  // namespace rdmarpc
