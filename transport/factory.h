// MakeTransport: the transport for an address scheme ("tcp", "rdma", "auto").
//
// "auto" picks RDMA when a usable RDMA device exists and TCP otherwise, with
// one log line saying which and why; RDMARPC_NO_TCP_FALLBACK=1 turns the
// fallback into an error.
#ifndef RDMARPC_TRANSPORT_FACTORY_H_
#define RDMARPC_TRANSPORT_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace rdmarpc::transport {

absl::StatusOr<std::unique_ptr<Transport>> MakeTransport(const std::string& scheme,
                                                         const TransportOptions& options);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_FACTORY_H_
