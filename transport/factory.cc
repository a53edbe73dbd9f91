#include "transport/factory.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "transport/attempt_errors.h"
#include "transport/auto_transport.h"
#include "transport/rdma/rdma_options.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace rdmarpc::transport {
namespace {

bool EnvForbidsFallback() {
  const char* no_fallback = std::getenv("RDMARPC_NO_TCP_FALLBACK");
  return no_fallback != nullptr && strcmp(no_fallback, "1") == 0;
}

}  // namespace

absl::StatusOr<std::string> ResolveScheme(const std::string& scheme, const std::string& who,
                                          const TransportTunables& tunables) {
  if (scheme == "tcp" || scheme == "rdma" || scheme == kTcpUntilRdma) return scheme;
  if (scheme != "auto") {
    return absl::InvalidArgumentError(absl::StrCat("no transport for scheme '", scheme, "'"));
  }
  if (rdma::RdmaUsable()) return std::string("rdma");
  const bool env_forbids = EnvForbidsFallback();
  const std::string devices = rdma::DescribeDevices();
  if (env_forbids || !tunables.tcp_fallback) {
    return absl::UnavailableError(absl::StrCat(
        "auto:// found no usable RDMA device (", devices, ") and ",
        env_forbids ? "RDMARPC_NO_TCP_FALLBACK=1" : "TransportTunables::tcp_fallback = false",
        " forbids falling back to TCP"));
  }
  fprintf(stderr, "rdmarpc[%s]: no usable RDMA device (%s); auto:// falls back to TCP\n",
          who.c_str(), devices.c_str());
  return std::string(kTcpUntilRdma);
}

absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const std::string& scheme,
                                                         const TransportOptions& given,
                                                         const TransportTunables& tunables) {
  TransportOptions options = given;
  if (tunables.memory_quota) options.memory_quota = tunables.memory_quota;
  absl::StatusOr<std::string> kind = ResolveScheme(scheme, options.name, tunables);
  if (!kind.ok()) return kind.status();
  // A transport that could not start its thread (or, at the descriptor
  // limit, get what its thread waits on) is not made: it would fail every
  // connect and listen even once the process has threads and descriptors
  // again.
  if (*kind == "tcp") {
    auto tcp = std::make_unique<TcpTransport>(options, TcpOptionsFromEnv(tunables.tcp));
    if (!tcp->unusable().ok()) return tcp->unusable();
    return std::unique_ptr<Transport>(std::move(tcp));
  }
  rdma::RdmaOptions rdma = rdma::RdmaOptionsFromEnv(tunables.rdma);
  // Here rather than at the first connect, so that a channel or server
  // whose options cannot work is refused as it is made, not call by call.
  if (absl::Status s = rdma::CheckRdmaOptions(rdma, options.listening); !s.ok()) return s;
  std::unique_ptr<Transport> made;
  AutoTransport::MakeRdma make_rdma;
  if (*kind == "rdma") {
    auto rdma_made = std::make_unique<rdma::RdmaTransport>(options, rdma, options.listening);
    if (absl::Status s = rdma_made->Unusable(); !s.ok()) return s;
    made = std::move(rdma_made);
    // rdma:// too: an AutoTransport passes rdma:// addresses through
    // untouched, and a ChannelGroup shares this one transport between the
    // rdma:// and auto:// addresses it is given.
    if (!tunables.tcp_fallback || EnvForbidsFallback()) return made;
  } else {
    make_rdma = [options, rdma]() -> absl::StatusOr<std::unique_ptr<Transport>> {
      if (!rdma::RdmaUsable()) {
        return absl::UnavailableError(
            absl::StrCat("no usable RDMA device (", rdma::DescribeDevices(), ")"));
      }
      auto fresh = std::make_unique<rdma::RdmaTransport>(options, rdma, options.listening);
      if (absl::Status s = fresh->Unusable(); !s.ok()) {
        absl::Status not_made =
            Prefixed(s.code(),
                     absl::StrCat("an RDMA device is usable (", rdma::DescribeDevices(),
                                  "), but the RDMA transport cannot be made"),
                     s);
        not_made.SetPayload(kRdmaNotMade, absl::Cord());
        return not_made;
      }
      fprintf(stderr, "rdmarpc[%s]: an RDMA device is usable now (%s); %s\n", options.name.c_str(),
              rdma::DescribeDevices().c_str(),
              options.listening ? "auto:// listeners take RDMA connections too"
                                : "auto:// connections try RDMA first from now on");
      return fresh;
    };
  }
  TcpOptions tcp = TcpOptionsFromEnv(tunables.tcp);
  return std::unique_ptr<Transport>(new AutoTransport(
      std::move(made), std::move(make_rdma),
      [options, tcp]() -> absl::StatusOr<std::unique_ptr<Transport>> {
        auto fresh = std::make_unique<TcpTransport>(options, tcp);
        if (!fresh->unusable().ok()) return fresh->unusable();
        return fresh;
      },
      options.name, tunables.tcp_fallback_memory, &FallbackMemory::Process()));
}

}  // namespace rdmarpc::transport
