// Retry throttling: retries stop while most calls to a server fail, so that
// a server in trouble is not sent every call again on top of the new ones.
//
//   rdmarpc::ChannelOptions options;
//   options.retry.max_attempts = 3;
//   options.retry.throttle = *rdmarpc::RetryThrottle::Create(/*max_tokens=*/10,
//                                                            /*token_ratio=*/0.1);
//
// This is gRPC's retryThrottling, with its numbers: the throttle holds up to
// max_tokens tokens, full at first. Every attempt that ends with a code in the
// policy's retryable_codes takes one token (none below zero), every call that
// ends OK gives back token_ratio (none above max_tokens), and while the tokens
// are at or below max_tokens / 2 no call is sent again: each ends with its
// attempt's status. With a ratio of 0.1, retries go on while fewer than about
// one call in eleven fails.
//
// One throttle may serve several channels (each keeps a reference): give the
// channels to one server the same one, as gRPC does for a server's name, and
// their failures and successes count together. What not to rely on: the
// counts are taken as attempts end, in no order across threads, so with many
// calls failing at once a few more may be sent again than the numbers say;
// and a channel counts only while its RetryPolicy allows more than one
// attempt. First attempts are never held back.
#ifndef RDMARPC_RPC_RETRY_THROTTLE_H_
#define RDMARPC_RPC_RETRY_THROTTLE_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "rpc/status.h"

namespace rdmarpc {

class RetryThrottle {
 public:
  // INVALID_ARGUMENT, naming the figure, unless 0 < max_tokens <= 1000 and
  // 0.001 <= token_ratio <= 1000 (gRPC's bounds; the ratio counts in
  // thousandths, as gRPC's does).
  static StatusOr<std::shared_ptr<RetryThrottle>> Create(int max_tokens, double token_ratio);
  RetryThrottle(const RetryThrottle&) = delete;
  RetryThrottle& operator=(const RetryThrottle&) = delete;

  // An attempt failed retryably: takes a token, and says whether the call may
  // be sent again (the tokens left are above max_tokens / 2).
  bool RecordFailure();
  // A call ended OK: gives back token_ratio.
  void RecordSuccess();

  double tokens() const;
  int max_tokens() const { return static_cast<int>(max_milli_ / 1000); }
  double token_ratio() const { return ratio_milli_ / 1000.0; }

 private:
  RetryThrottle(int64_t max_milli, int64_t ratio_milli);

  const int64_t max_milli_;
  const int64_t ratio_milli_;
  std::atomic<int64_t> milli_;  // tokens, in thousandths
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_RETRY_THROTTLE_H_
