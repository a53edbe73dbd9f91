// The flags that every rdmarpc command-line tool takes, defined once:
// --address (the server) and --timeout_ms (how long the tool waits for each
// answer, connecting included).
//
//   int main(int argc, char** argv) {
//     const auto flags = rdmarpc::tools::ParseServerFlags(
//         argc, argv, "rdmarpc_stats --address rdma://host:port [--timeout_ms N > 0]");
//     if (!flags) return rdmarpc::tools::kBadArguments;
//     return Ask(flags->address, flags->timeout_ms);
//   }
#ifndef RDMARPC_RPC_TOOLS_SERVER_FLAGS_H_
#define RDMARPC_RPC_TOOLS_SERVER_FLAGS_H_

#include <optional>
#include <string>

namespace rdmarpc::tools {

struct ServerFlags {
  std::string address;
  int timeout_ms;
};

// Parses the command line (the tool's own flags too). nullopt, after
// printing "usage: <usage>" on stderr, when --address is missing or
// --timeout_ms is not positive.
std::optional<ServerFlags> ParseServerFlags(int argc, char** argv, const std::string& usage);

}  // namespace rdmarpc::tools

#endif  // RDMARPC_RPC_TOOLS_SERVER_FLAGS_H_
