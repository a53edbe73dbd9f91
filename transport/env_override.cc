#include "transport/env_override.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"

namespace rdmarpc::transport {
namespace {

template <typename T>
bool Read(const char* name, T* out) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  T parsed;  // SimpleAtoi leaves its output unspecified on failure
  if (!absl::SimpleAtoi(v, &parsed)) {
    fprintf(stderr, "rdmarpc: ignoring %s=\"%s\": not a whole number in range; using %s\n", name,
            v, std::to_string(*out).c_str());
    return false;
  }
  *out = parsed;
  return true;
}

}  // namespace

bool OverrideFromEnv(const char* name, int32_t* out) { return Read(name, out); }
bool OverrideFromEnv(const char* name, uint32_t* out) { return Read(name, out); }
bool OverrideFromEnv(const char* name, uint64_t* out) { return Read(name, out); }

}  // namespace rdmarpc::transport
