// CallOnce: what the command-line tools (rdmarpc_health_probe, rdmarpc_stats,
// rdmarpc_call) share: one call to a server's built-in service, its failures
// reported on stderr and mapped to the tools' exit statuses.
//
//   HealthCheckResponse response;
//   const int rc = rdmarpc::tools::CallOnce(
//       "rdmarpc_health_probe", address, address, timeout_ms, "health", "EnableHealthService",
//       [&](std::shared_ptr<rdmarpc::Channel> channel, rdmarpc::ClientContext* ctx) {
//         return rdmarpc::health::v1::Health::NewStub(channel)->Check(ctx, request, &response);
//       });
//   if (rc != 0) return rc;   // kNoAnswer or kBadArguments, said why on stderr
#ifndef RDMARPC_RPC_TOOLS_CALL_ONCE_H_
#define RDMARPC_RPC_TOOLS_CALL_ONCE_H_

#include <cstdio>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "rpc/channel.h"

namespace rdmarpc::tools {

// The tools' exit statuses besides 0 (answered) and their own (the health
// probe's 1: answered, not serving).
inline constexpr int kNoAnswer = 2;
inline constexpr int kBadArguments = 3;

// Calls `call(channel, &ctx)` once, on a channel to `address` and with
// `timeout_ms` for all of it, connecting included. 0 when it succeeded.
// Otherwise prints "<tool>: <what>: <status>", and for a server without the
// service (UNIMPLEMENTED) that it has no <service> service and needs
// ServerBuilder::<enable>(), and returns kBadArguments for an address that
// does not parse, kNoAnswer for the rest.
template <typename Call>
int CallOnce(const char* tool, const std::string& address, const std::string& what, int timeout_ms,
             const char* service, const char* enable, Call call) {
  auto channel = Channel::Create(address);
  if (!channel.ok()) {
    fprintf(stderr, "%s: %s: %s\n", tool, address.c_str(), channel.status().ToString().c_str());
    return channel.status().code() == StatusCode::kInvalidArgument ? kBadArguments : kNoAnswer;
  }
  ClientContext ctx;
  ctx.set_timeout(absl::Milliseconds(timeout_ms));
  const Status s = call(*channel, &ctx);
  if (s.ok()) return 0;
  fprintf(stderr, "%s: %s: %s\n", tool, what.c_str(), s.ToString().c_str());
  if (s.code() == StatusCode::kUnimplemented) {
    fprintf(stderr, "%s: the server has no %s service; it needs ServerBuilder::%s()\n", tool,
            service, enable);
  }
  return kNoAnswer;
}

}  // namespace rdmarpc::tools

#endif  // RDMARPC_RPC_TOOLS_CALL_ONCE_H_
