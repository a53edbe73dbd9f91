// Address: where a channel connects or a server listens, e.g.
//   "tcp://127.0.0.1:5000", "rdma://10.0.0.1:7471", "auto://host:port"
//   "tcp://[::1]:5000"  (IPv6 in brackets), "tcp://host:0" (any free port)
// "auto" means RDMA when a usable device exists, else TCP (one log line).
#ifndef RDMARPC_TRANSPORT_ADDRESS_H_
#define RDMARPC_TRANSPORT_ADDRESS_H_

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace rdmarpc::transport {

struct Address {
  std::string scheme;  // "tcp", "rdma" or "auto"
  std::string host;    // without brackets
  uint16_t port = 0;

  std::string ToString() const;
};

absl::StatusOr<Address> ParseAddress(absl::string_view text);

// "127.0.0.1:5000", "[::1]:5000": a socket address for error texts.
std::string SockaddrString(const sockaddr* sa);
// "127.0.0.1", "::1": its IP address alone.
std::string SockaddrHost(const sockaddr* sa);

// One result of a name's resolution: what connect(2) and bind(2) take.
struct SocketAddress {
  sockaddr_storage storage;
  socklen_t len;
};

// 0.0.0.0 or [::]: a wildcard to listen on; as a destination, this host.
bool IsUnspecified(const sockaddr* sa);

// An IPv6 link-local address (fe80::/10): an address only on its interface.
bool IsLinkLocal(const sockaddr* sa);

// `ss`, an IPv4 or IPv6 address, with `port` for its port.
SocketAddress WithPort(const sockaddr_storage& ss, uint16_t port);
// The port of `ss`, an IPv4 or IPv6 address.
uint16_t PortOf(const sockaddr_storage& ss);

// Every socket address of host:port, in getaddrinfo's order of preference
// (on a stock Debian "localhost" is [::1] first, then 127.0.0.1), each once.
// A connect tries each (transport/address_race.h), so a server that listens
// on one family only is still found by name. UNAVAILABLE naming the address,
// and what to try, if it does not resolve; never an empty list. An IPv6
// link-local address without its interface ([fe80::1] for [fe80::1%eth0]),
// which no socket takes, is left out: INVALID_ARGUMENT, saying so, when it
// is all there is.
absl::StatusOr<std::vector<SocketAddress>> ResolveAddresses(const Address& addr);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ADDRESS_H_
