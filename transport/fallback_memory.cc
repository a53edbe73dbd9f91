#include "transport/fallback_memory.h"

namespace rdmarpc::transport {

bool FallbackMemory::FellBackWithin(const std::string& target, absl::Duration window,
                                    absl::Time now) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = fell_back_at_.find(target);
  return it != fell_back_at_.end() && now - it->second < window;
}

void FallbackMemory::Remember(const std::string& target, absl::Time now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fell_back_at_.size() >= kMaxTargets && fell_back_at_.count(target) == 0) {
    fell_back_at_.clear();
  }
  fell_back_at_[target] = now;
}

void FallbackMemory::Forget(const std::string& target) {
  std::lock_guard<std::mutex> lock(mu_);
  fell_back_at_.erase(target);
}

bool FallbackMemory::FirstMention(const std::string& target) {
  std::lock_guard<std::mutex> lock(mu_);
  if (mentioned_.size() >= kMaxTargets && mentioned_.count(target) == 0) mentioned_.clear();
  return mentioned_.insert(target).second;
}

FallbackMemory& FallbackMemory::Process() {
  static FallbackMemory* const memory = new FallbackMemory;
  return *memory;
}

}  // namespace rdmarpc::transport
