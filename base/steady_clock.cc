#include "base/steady_clock.h"

#include <chrono>

#include "absl/time/clock.h"

namespace rdmarpc {
namespace {

struct Anchor {
  absl::Time wall = absl::Now();
  std::chrono::steady_clock::time_point steady = std::chrono::steady_clock::now();
};

}  // namespace

absl::Time SteadyNow() {
  static const Anchor anchor;
  return anchor.wall + absl::FromChrono(std::chrono::steady_clock::now() - anchor.steady);
}

absl::Time FromWallClock(absl::Time wall) { return SteadyNow() + (wall - absl::Now()); }

absl::Time ToWallClock(absl::Time steady) { return absl::Now() + (steady - SteadyNow()); }

}  // namespace rdmarpc
