#include "transport/factory.h"

#include "absl/strings/str_cat.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::transport {

absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const std::string& scheme,
                                                         const TransportOptions& options) {
  if (scheme == "tcp") return std::unique_ptr<Transport>(new TcpTransport(options));
  return absl::InvalidArgumentError(absl::StrCat("no transport for scheme '", scheme, "'"));
}

}  // namespace rdmarpc::transport
