#include "transport/memory_quota.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport {

namespace {

std::atomic<MemoryQuota::Reclaimer> reclaimer{nullptr};

}  // namespace

void MemoryQuota::SetReclaimer(Reclaimer r) { reclaimer.store(r, std::memory_order_release); }

std::shared_ptr<MemoryQuota> MemoryQuota::Create(std::string name, size_t bound) {
  return std::shared_ptr<MemoryQuota>(new MemoryQuota(std::move(name), bound));
}

MemoryQuota::~MemoryQuota() {
  if (const size_t left = used(); left != 0) {
    fprintf(stderr, "rdmarpc: memory quota \"%s\" destroyed with %zu bytes still reserved\n",
            name_.c_str(), left);
    abort();
  }
}

bool MemoryQuota::TryReserve(size_t bytes) {
  size_t now = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > bound_ || now > bound_ - bytes) return false;
  } while (!used_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return true;
}

bool MemoryQuota::Reserve(size_t bytes) {
  if (TryReserve(bytes)) return true;
  return MakeRoom(bytes) && TryReserve(bytes);
}

bool MemoryQuota::MakeRoom(size_t bytes) {
  if (Fits(bytes)) return true;
  if (bytes > bound_) return false;
  if (const Reclaimer r = reclaimer.load(std::memory_order_acquire)) r(Shortfall(bytes), this);
  return Fits(bytes);
}

void MemoryQuota::Release(size_t bytes) {
  const size_t before = used_.fetch_sub(bytes, std::memory_order_relaxed);
  if (before < bytes) {
    fprintf(stderr, "rdmarpc: memory quota \"%s\": %zu bytes released, %zu were reserved\n",
            name_.c_str(), bytes, before);
    abort();
  }
}

size_t MemoryQuota::Shortfall(size_t bytes) const {
  const size_t held = used();
  return held + bytes > bound_ ? held + bytes - bound_ : 0;
}

absl::Status MemoryQuota::Exceeded(size_t bytes, absl::string_view what) const {
  return absl::ResourceExhaustedError(
      absl::StrCat(bytes, " bytes for ", what, " do not fit under the memory quota \"", name_,
                   "\" (TransportTunables::memory_quota), ", bound_,
                   " bytes of payload memory for every transport that shares it (", used(),
                   " held now); raise its bound, or hold fewer large messages at once"));
}

}  // namespace rdmarpc::transport
