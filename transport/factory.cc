#include "transport/factory.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::transport {

absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const std::string& scheme,
                                                         const TransportOptions& options) {
  auto rdma = [&] {
    return std::unique_ptr<Transport>(new rdma::RdmaTransport(
        options, rdma::RdmaOptionsFromEnv(), options.listening));
  };
  if (scheme == "tcp") {
    return std::unique_ptr<Transport>(new TcpTransport(TcpOptionsFromEnv(options)));
  }
  if (scheme == "rdma") return rdma();
  if (scheme == "auto") {
    if (rdma::RdmaUsable()) return rdma();
    const char* no_fallback = std::getenv("RDMARPC_NO_TCP_FALLBACK");
    const std::string devices = rdma::DescribeDevices();
    if (no_fallback && strcmp(no_fallback, "1") == 0) {
      return absl::UnavailableError(absl::StrCat(
          "auto:// found no usable RDMA device (", devices,
          ") and RDMARPC_NO_TCP_FALLBACK=1 forbids falling back to TCP"));
    }
    fprintf(stderr, "rdmarpc[%s]: no usable RDMA device (%s); auto:// falls back to TCP\n",
            options.name.c_str(), devices.c_str());
    return std::unique_ptr<Transport>(new TcpTransport(TcpOptionsFromEnv(options)));
  }
  return absl::InvalidArgumentError(absl::StrCat("no transport for scheme '", scheme, "'"));
}

}  // namespace rdmarpc::transport
