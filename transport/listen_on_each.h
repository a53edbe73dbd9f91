// A server's name means every address it resolves to, as in gRPC: on a
// stock Debian "localhost" is [::1] and 127.0.0.1, and a server on
// "tcp://localhost:P" is reached by a client that dials "tcp://127.0.0.1:P"
// as well as by one that dials the name. Each transport binds one address
// (`listen_one`); ListenOnEachAddress binds them all and hands back one
// Listener that stops them together.
//
//   auto addresses = ResolveAddresses(addr);
//   auto listener = ListenOnEachAddress(*addresses, "server",
//       [&](const SocketAddress& a) { return ListenSocket(a, addr, on_accept); });
//
// What not to rely on:
// - With port 0 the first address's bind picks the port and the others ask
//   for that one, so the server has one port to report. Another program's
//   socket can hold that port on another address (a client's ephemeral
//   port on 127.0.0.1, where [::1] had it free): then every address is
//   bound again on a port picked afresh, up to kFreshPortTries times, and
//   only after those is an address left out.
// - An address that cannot be bound (IPv6 turned off, its port taken, an
//   address of another machine) is left out with one log line on stderr.
//   Only when none can be is it an error, as in gRPC.
#ifndef RDMARPC_TRANSPORT_LISTEN_ON_EACH_H_
#define RDMARPC_TRANSPORT_LISTEN_ON_EACH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/address.h"
#include "transport/transport.h"

namespace rdmarpc::transport {

// How many ports a listen on port 0 picks before it leaves out an address
// that has each of them taken. A pick that collides is rare (the ephemeral
// range has ~28,000 ports), so 8 in a row are no chance: that address takes
// no port, and trying more would only delay the listen.
inline constexpr int kFreshPortTries = 8;

using ListenOne =
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<Listener>>(const SocketAddress&)>;

// A listener on each of `addresses` (never empty) that `listen_one` could
// bind, whose address() is the first's (the name asked for, with the port
// that was bound, as `listen_one` makes it). When none could be, each
// address's error (after the address, when there are several) as
// FailedAttempts joins them: the last one's code, each distinct advice once.
// `log_name` begins the line that names an address left out.
absl::StatusOr<std::unique_ptr<Listener>> ListenOnEachAddress(
    const std::vector<SocketAddress>& addresses, const std::string& log_name, ListenOne listen_one);

// What a listener's bind (or listen) that failed with `err` says:
// UNAVAILABLE with the system's words and, for the failures a user can
// mend (the port taken, or below 1024 without the privilege; an address
// that no interface of this host has), what to do (WithWhatToDo: said once
// for all the addresses that failed so). The port taken is marked with the
// payload kPortTaken, which PortTaken reads.
absl::Status BindError(int err);

inline constexpr absl::string_view kPortTaken = "type.rdmarpc.dev/transport.PortTaken";

// Whether `error` is a bind that found its port taken (BindError(EADDRINUSE)).
bool PortTaken(const absl::Status& error);

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_LISTEN_ON_EACH_H_
