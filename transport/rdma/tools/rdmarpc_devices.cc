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
// device or GID is checked as a connection checks it. Exit status 0 when a
// device has an active port and the route asked for resolves, 1 otherwise.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
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
  auto sockaddr = rdmarpc::transport::ResolveAddress(*address);
  if (!sockaddr.ok()) {
    fprintf(stderr, "--to: %s\n", std::string(sockaddr.status().message()).c_str());
    return 1;
  }
  const rdma::RdmaOptions options = rdma::RdmaOptionsFromEnv();
  auto route = rdma::ResolveRoute(reinterpret_cast<const struct sockaddr*>(&*sockaddr), options);
  if (!route.ok()) {
    printf("route to %s: %s\n", to.c_str(), std::string(route.status().message()).c_str());
    return 1;
  }
  printf("route to %s: %s\n", to.c_str(), route->text.c_str());
  printf("the same path without rdmarpc (perftest, through rdma_cm as here): `ib_read_bw -R` on "
         "%s, then `ib_read_bw -R -d %s -i %d %s` here; without -R name the GID: -x %d\n",
         address->host.c_str(), route->device.c_str(), route->port, address->host.c_str(),
         route->gid_index);
  return 0;
}
