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
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "transport/attempt_errors.h"

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

// Every socket address of host:port, in getaddrinfo's order of preference
// (on a stock Debian "localhost" is [::1] first, then 127.0.0.1), each once.
// A connect tries them in turn: a server that listens on one family only
// is still found by name. UNAVAILABLE naming the address, and what to try,
// if it does not resolve; never an empty list.
absl::StatusOr<std::vector<SocketAddress>> ResolveAddresses(const Address& addr);

// When a connect's attempt on one of its addresses must give up, so that
// the `left` addresses still to try (this one included) share the time to
// `deadline`: one that swallows its packets, or whose server never answers,
// does not use up the time of those after it. Unbounded for an unbounded
// deadline.
absl::Time AttemptDeadline(absl::Time deadline, size_t left);

// Runs `attempt(address, its_deadline)` on each address in turn, each
// within its AttemptDeadline, until one succeeds, one fails for good
// (`gives_up(status)`: the transport shuts down) or `deadline` passes. The
// error has the last attempt's code, each attempt's message, after its
// address when `name_each` (for messages that do not name it), as
// FailedAttempts joins them: each distinct advice once, at the end, and the
// payloads that every attempt's error had.
template <typename T, typename Attempt, typename GivesUp>
absl::StatusOr<T> TryEachAddress(const std::vector<SocketAddress>& addresses, absl::Time deadline,
                                 bool name_each, Attempt attempt, GivesUp gives_up) {
  FailedAttempts failed;
  for (size_t i = 0; i < addresses.size(); ++i) {
    absl::StatusOr<T> result =
        attempt(addresses[i], AttemptDeadline(deadline, addresses.size() - i));
    if (result.ok()) return result;
    failed.Add(name_each && addresses.size() > 1
                   ? SockaddrString(reinterpret_cast<const sockaddr*>(&addresses[i].storage))
                   : "",
               result.status());
    if (gives_up(result.status()) || SteadyNow() >= deadline) break;
  }
  return failed.Error();
}

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ADDRESS_H_
