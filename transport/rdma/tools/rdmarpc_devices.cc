// rdmarpc_devices: the RDMA devices this machine has, and which device, port
// and GID a connection to an address would use, found the way rdmarpc finds
// them. The first questions of any RDMA problem, answered before a call is
// made; it also prints the perftest commands that check the same path
// without rdmarpc.
//
//   bazel run //transport/rdma:rdmarpc_devices                       # devices
//   bazel run //transport/rdma:rdmarpc_devices -- --to rdma://10.0.0.2:7471
//
// Honours the transport's RDMARPC_RDMA_DEVICE, _PORT and _GID_INDEX: a named
// device or GID is checked as a connection checks it. A host name gets a
// line per address, as a connection tries each. Exit status 0 when a device
// has an active port and the route to (an address of) --to resolves, 1
// otherwise.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "transport/address.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/rdma_options.h"

ABSL_FLAG(std::string, to, "",
          "an address a client would call (rdma://host:port or auto://host:port): show the "
          "device, port and GID a connection there would use");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace rdma = rdmarpc::transport::rdma;
  printf("RDMA devices:\n");
  for (absl::string_view device : absl::StrSplit(rdma::DescribeDevices(), "; ")) {
    printf("  %s\n", std::string(device).c_str());
  }
  if (!rdma::RdmaUsable()) {
    printf("no device has an active port. Try: `rdma link` and `ibv_devinfo` for devices and "
           "ports; on a machine without an RDMA NIC, Soft-RoCE (`rdma link add rxe0 type rxe "
           "netdev <if>`); or tcp:// addresses.\n");
    return 1;
  }
  const std::string to = absl::GetFlag(FLAGS_to);
  if (to.empty()) return 0;
  auto address = rdmarpc::transport::ParseAddress(to);
  if (!address.ok()) {
    fprintf(stderr, "--to: %s\n", std::string(address.status().message()).c_str());
    return 1;
  }
  auto addresses = rdmarpc::transport::ResolveAddresses(*address);
  if (!addresses.ok()) {
    fprintf(stderr, "--to: %s\n", std::string(addresses.status().message()).c_str());
    return 1;
  }
  // A connection asks the name's addresses from the first, the families
  // taking turns, and takes the first that connects
  // (transport/address_race.h): each gets its line, and the first route
  // found its perftest command. The unspecified address is this host's
  // RoCE addresses, as for a connect.
  const rdma::RdmaOptions options = rdma::RdmaOptionsFromEnv();
  const bool unspecified = std::any_of(
      addresses->begin(), addresses->end(), [](const rdmarpc::transport::SocketAddress& a) {
        return rdmarpc::transport::IsUnspecified(reinterpret_cast<const sockaddr*>(&a.storage));
      });
  if (auto named = rdma::NamedGidAddress(options, 0); named.ok()) {
    *addresses = rdma::ThisHostForUnspecified(*addresses, *named, address->port);
  }
  std::optional<rdma::Route> first;
  std::string first_host;
  for (const rdmarpc::transport::SocketAddress& a : *addresses) {
    const auto* sa = reinterpret_cast<const struct sockaddr*>(&a.storage);
    const std::string via =
        addresses->size() > 1 || unspecified
            ? absl::StrCat(" (address ", rdmarpc::transport::SockaddrString(sa), ")")
            : std::string();
    auto route = rdma::ResolveRoute(sa, options);
    const std::string what = route.ok() ? route->text : std::string(route.status().message());
    printf("route to %s%s: %s\n", to.c_str(), via.c_str(), what.c_str());
    if (!route.ok() || first) continue;
    first = *route;
    first_host =
        addresses->size() > 1 || unspecified ? rdmarpc::transport::SockaddrHost(sa) : address->host;
  }
  if (!first) return 1;
  printf(
      "the same path without rdmarpc (perftest, through rdma_cm as here): `ib_read_bw -R` on "
      "%s, then `ib_read_bw -R -d %s -i %d %s` here; without -R name the GID: -x %d\n",
      first_host.c_str(), first->device.c_str(), first->port, first_host.c_str(), first->gid_index);
  return 0;
}
