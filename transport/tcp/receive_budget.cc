#include "transport/tcp/receive_budget.h"

#include <cstdio>
#include <cstdlib>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport {

ReceiveBudget* ReceiveBudget::New(size_t bound, std::shared_ptr<MemoryQuota> quota) {
  return new ReceiveBudget(bound, std::move(quota));
}

void ReceiveBudget::Drop() { Release(kOwner); }

void ReceiveBudget::Release(uint64_t bytes) {
  if (quota_ && bytes != kOwner) quota_->Release(bytes);
  if (value_.fetch_sub(bytes, std::memory_order_acq_rel) == bytes) delete this;
}

std::optional<ReceiveBudget::Incoming> ReceiveBudget::Allocate(size_t size) {
  std::unique_ptr<char[]> data(new (std::nothrow) char[size]);
  if (data == nullptr) return std::nullopt;
  return Incoming(this, std::move(data), size);
}

absl::Status ReceiveBudget::Exceeded(size_t bytes, absl::string_view from) const {
  if (quota_ && FitsOwnBound(bytes) && !quota_->Fits(bytes)) {
    return quota_->Exceeded(bytes, absl::StrCat("a message from ", from, " (it was skipped)"));
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("a message of ", bytes, " bytes from ", from, " does not fit under ",
                   "TcpOptions::max_receive_bytes, ", bound_,
                   " bytes of received messages held at once (", held(),
                   " held now, until their calls are done with them); it was skipped. Raise the "
                   "bound, or send fewer large messages at once"));
}

ReceiveBudget::Incoming::Incoming(Incoming&& other) noexcept
    : budget_(other.budget_),
      data_(std::move(other.data_)),
      size_(std::exchange(other.size_, 0)),
      counted_(std::exchange(other.counted_, 0)) {}

ReceiveBudget::Incoming& ReceiveBudget::Incoming::operator=(Incoming&& other) noexcept {
  if (this != &other) {
    GiveBack();
    budget_ = other.budget_;
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    counted_ = std::exchange(other.counted_, 0);
  }
  return *this;
}

void ReceiveBudget::Incoming::GiveBack() {
  data_.reset();
  if (counted_ > 0) budget_->Release(std::exchange(counted_, 0));
}

bool ReceiveBudget::Incoming::Count(size_t bytes) {
  std::atomic<uint64_t>& value = budget_->value_;
  uint64_t now = value.load(std::memory_order_relaxed);
  do {
    if (now < kOwner) {
      fprintf(stderr, "rdmarpc: a TCP payload counted after its transport let go\n");
      abort();
    }
    if (bytes > budget_->bound_ || now - kOwner > budget_->bound_ - bytes) return false;
  } while (!value.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  if (budget_->quota_ && !budget_->quota_->Reserve(bytes)) {
    value.fetch_sub(bytes, std::memory_order_relaxed);
    return false;
  }
  counted_ += bytes;
  return true;
}

Buffer ReceiveBudget::Incoming::Take() && {
  if (counted_ != size_) {
    fprintf(stderr, "rdmarpc: a TCP payload taken with %zu of its %zu bytes counted\n", counted_,
            size_);
    abort();
  }
  ReceiveBudget* budget = budget_;
  const size_t size = std::exchange(size_, 0);
  counted_ = 0;
  return Buffer(data_.release(), size, [budget, size](char* data, size_t) {
    delete[] data;
    budget->Release(size);
  });
}

}  // namespace rdmarpc::transport
