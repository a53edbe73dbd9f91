// Which RDMA device, port and GID a transport's connections use.
//
// By default rdma_cm decides from the address in use: it resolves the route
// to the peer (or binds the listening address) and takes the device and port
// behind that interface and, on RoCE, the GID that carries the interface's IP
// address in the port's default RoCE mode (v2 where the kernel has it; the
// mode is /sys/kernel/config/rdma_cm/<device>/ports/<port>/default_roce_mode).
//
// RdmaOptions can name the choice instead:
//   - `device` alone insists on a device: a connection that rdma_cm puts on
//     another one fails, naming both;
//   - `device`, `port` and `gid_index` name one GID table entry. rdma_cm takes
//     no GID index, so on RoCE the entry's IP address is what we hand it: the
//     source address of outgoing connections, and the address a server
//     listening on a wildcard binds (a server given another address is an
//     error, as is a client's connect to a loopback address or one of the
//     other family, which the GID's interface cannot reach). Every
//     connection is then checked to have landed on that device, port and
//     GID index. On InfiniBand a GID is not an IP address: rdma_cm follows
//     the IPoIB address as usual and the check still applies.
//
// Errors name what was asked, what rdma_cm chose and what to try; those about
// names that name nothing list the devices that exist with their GIDs
// (DescribeDevices), as the transport's connect errors do.
#ifndef RDMARPC_TRANSPORT_RDMA_DEVICE_SELECTION_H_
#define RDMARPC_TRANSPORT_RDMA_DEVICE_SELECTION_H_

#include <rdma/rdma_cma.h>
#include <sys/socket.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/address.h"
#include "transport/rdma/rdma_options.h"

namespace rdmarpc::transport::rdma {

// A line per device with its ports, states and GIDs, or why there is none;
// for error messages and tools (rdmarpc_devices).
std::string DescribeDevices();
// True when at least one device has an active port.
bool RdmaUsable();

std::string GidToString(const ibv_gid& gid);

// The IP address of the GID that `options` names (device, port, gid_index),
// with `port` as its port number; nullopt when no GID is named or the port is
// InfiniBand. INVALID_ARGUMENT when the names are incomplete or name nothing
// (no such device, port or GID entry; an entry that is not an IP address).
absl::StatusOr<std::optional<sockaddr_storage>> NamedGidAddress(const RdmaOptions& options,
                                                                uint16_t port);

// As a destination the unspecified address (0.0.0.0, [::]) means this host,
// as over TCP, but rdma_cm takes it to a loopback path, which Soft-RoCE
// (and any device that does not loop back) lacks. So a connect there goes
// to this host's RoCE addresses instead, which a server on a wildcard
// listens on.
//
// The IP addresses of this host's active RoCE ports (their GIDs'), of
// `family`, with `port`: devices and ports in their order, each address
// once, link-local IPv6 ones last (scoped to the GID's interface). None for
// InfiniBand ports, whose GIDs are not IP addresses.
std::vector<SocketAddress> ThisHostRdmaAddresses(int family, uint16_t port);

// A connect's resolved `addresses` (of port `port`) with each unspecified
// one replaced by the address of the GID `named` (NamedGidAddress) or, when
// none is named, by ThisHostRdmaAddresses (for [::] the IPv4 ones after the
// IPv6 ones: a server on [::] takes both). Left as it is where there is
// none, for the connect to fail saying why.
std::vector<SocketAddress> ThisHostForUnspecified(const std::vector<SocketAddress>& addresses,
                                                  const std::optional<sockaddr_storage>& named,
                                                  uint16_t port);

// The index in id's port GID table of the GID rdma_cm chose for id, or -1.
int ChosenGidIndex(rdma_cm_id* id);

// The traffic class (on RoCE v2 the IP type of service) of id's connected
// QP, or -1 before it is connected.
int TrafficClass(rdma_cm_id* id);

// "device rxe0 port 1 gid_index 1 (::ffff:10.0.0.1, RoCE v2)": where id's
// end of a connection is, for error texts (-1 and the route's GID when the
// table no longer has it).
std::string DescribeLocalEnd(rdma_cm_id* id);

// DescribeLocalEnd and " active_mtu 4096", and " type_of_service 104" once
// connected with one.
std::string DescribeChoice(rdma_cm_id* id);

// What a connection to `to` would use, found as one finds it: rdma_cm
// resolves the address and the route (from the GID `options` names, if any),
// then the choice is checked against `options` like a connection's.
// UNAVAILABLE says which step failed and lists the devices there are. For
// tools (rdmarpc_devices).
struct Route {
  std::string device;
  int port = 0;
  int gid_index = -1;
  std::string text;  // DescribeChoice's line and the local address
};
absl::StatusOr<Route> ResolveRoute(const sockaddr* to, const RdmaOptions& options);

// OK when the device and port rdma_cm chose for id are the ones `options`
// names (if any); otherwise UNAVAILABLE naming both and what to try. Valid
// once id has a device: after route resolution, or on a connect request.
absl::Status CheckDeviceAndPort(rdma_cm_id* id, const RdmaOptions& options);

// The same for the GID index. Valid once id's QP has its address vector:
// after rdma_accept, or when a connection is established.
absl::Status CheckGidIndex(rdma_cm_id* id, const RdmaOptions& options);

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_DEVICE_SELECTION_H_
