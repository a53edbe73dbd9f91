// OverrideFromEnv: reads one numeric option from the environment, strictly.
//
//   uint32_t timeout_ms = 2000;
//   OverrideFromEnv("RDMARPC_TCP_PEER_TIMEOUT_MS", &timeout_ms);
//
// Unset or empty leaves the option alone. A value that is not a whole number
// in the option's range ("2s", "soon", "-1" for an unsigned option, one too
// large) is reported on stderr, naming the variable and the value kept, and
// changes nothing. Why not strtoull/atoi: they read "soon" as 0, and 0 often
// means "off" (no dead-peer timeout, no keepalive), so a typo would silently
// disable a safety feature.
#ifndef RDMARPC_TRANSPORT_ENV_OVERRIDE_H_
#define RDMARPC_TRANSPORT_ENV_OVERRIDE_H_

#include <cstdint>

namespace rdmarpc::transport {

// Returns true when the variable was set to a valid value and *out now holds
// it; false when it was unset, empty or malformed (*out unchanged).
bool OverrideFromEnv(const char* name, int32_t* out);
bool OverrideFromEnv(const char* name, uint32_t* out);
bool OverrideFromEnv(const char* name, uint64_t* out);  // size_t on LP64 Linux

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ENV_OVERRIDE_H_
