#include "rpc/tools/server_flags.h"

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

ABSL_FLAG(std::string, address, "",
          "the server: rdma://host:port, tcp://host:port or auto://host:port");
ABSL_FLAG(int, timeout_ms, 1000, "how long to wait for each answer, connecting included");

namespace rdmarpc::tools {

std::optional<ServerFlags> ParseServerFlags(int argc, char** argv, const std::string& usage) {
  absl::ParseCommandLine(argc, argv);
  ServerFlags flags{absl::GetFlag(FLAGS_address), absl::GetFlag(FLAGS_timeout_ms)};
  if (flags.address.empty() || flags.timeout_ms <= 0) {
    fprintf(stderr, "usage: %s\n", usage.c_str());
    return std::nullopt;
  }
  return flags;
}

}  // namespace rdmarpc::tools
