// TryEachAddress: a connect to a name with several addresses, as RFC 8305
// ("Happy Eyeballs") makes it.
//
// Why: a name may resolve to an address that swallows its packets (an IPv6
// route that is there but broken, one host of several down). Tried one after
// another, such an address would hold the connect for its timeout, or its
// share of it, before the next is asked. Here the first address is tried
// alone; the next one starts beside it as soon as every attempt started so
// far has failed, or once the last one has run kNextAddressAfter without an
// answer; the first to connect wins and the others are ended. So a dead
// address costs a connect 250 ms, and one that refuses at once costs nothing.
//
//   auto conn = TryEachAddress<Conn>(
//       addresses, deadline, /*name_each=*/true,
//       [&](const SocketAddress& a, const std::atomic<bool>& lost) {
//         return ConnectOne(a, deadline, lost);  // ends early once `lost`
//       },
//       [](Conn&& extra) { Close(extra); },  // a second connection that was made
//       [](const absl::Status& s) { return absl::IsCancelled(s); });  // shutting down
//
// The addresses are asked in getaddrinfo's order, but with the two families
// taking turns (RFC 8305 section 4): a family that is broken costs one
// delay, not one per address of it.
//
// What not to rely on: attempts run on threads of their own when there is
// more than one address (the attempt must be safe to run beside itself);
// and two attempts that connect within the same moment both make a
// connection, of which the later is handed to `discard`, so a server may
// see a connection come and go at once.
#ifndef RDMARPC_TRANSPORT_ADDRESS_RACE_H_
#define RDMARPC_TRANSPORT_ADDRESS_RACE_H_

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "transport/address.h"
#include "transport/attempt_errors.h"

namespace rdmarpc::transport {

// How long an attempt on one address runs alone before the next address is
// asked beside it: RFC 8305's recommended Connection Attempt Delay, which
// gRPC's clients use too. Long enough that on a healthy network the first
// address has answered by then, so a connect makes one connection.
inline constexpr absl::Duration kNextAddressAfter = absl::Milliseconds(250);

// `addresses` in their order, but with the families taking turns, the first
// address's first: [v6a, v6b, v6c, v4a] becomes [v6a, v4a, v6b, v6c].
inline std::vector<SocketAddress> InterleaveFamilies(const std::vector<SocketAddress>& addresses) {
  std::vector<SocketAddress> first;
  std::vector<SocketAddress> other;
  for (const SocketAddress& a : addresses) {
    (a.storage.ss_family == addresses.front().storage.ss_family ? first : other).push_back(a);
  }
  std::vector<SocketAddress> turns;
  for (size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
    if (i < first.size()) turns.push_back(first[i]);
    if (i < other.size()) turns.push_back(other[i]);
  }
  return turns;
}

// Runs `attempt(address, lost)` on each address as above (in the order
// InterleaveFamilies gives) until one succeeds, one fails for good
// (`gives_up(status)`: the transport shuts down), or every one started has
// failed and no other may start (`deadline` passed, none left). Each
// attempt must end by `deadline` itself, and soon after `lost` turns true
// (another won or the connect gave up); what it makes then goes to
// `discard`. The error has the code of the last attempt it names, each
// attempt's message in the order they were asked, after its address when
// `name_each` (for messages that do not name it), as FailedAttempts joins
// them: each distinct advice once, at the end, and the payloads that every
// attempt's error had. Attempts the race itself ended are left out of it:
// after one failed for good, its error is what the others would say.
template <typename T, typename Attempt, typename Discard, typename GivesUp>
absl::StatusOr<T> TryEachAddress(const std::vector<SocketAddress>& resolved, absl::Time deadline,
                                 bool name_each, Attempt attempt, Discard discard,
                                 GivesUp gives_up) {
  const std::vector<SocketAddress> addresses = InterleaveFamilies(resolved);
  struct Race {
    std::mutex mu;
    std::condition_variable ended_one;
    // By address, once ended, unless the race had ended it (another won, or
    // one gave up): its error says nothing of its address. Guarded by mu.
    std::vector<std::optional<absl::Status>> failed;
    std::optional<T> won;   // guarded by mu
    size_t ended = 0;       // guarded by mu
    bool given_up = false;  // guarded by mu
    std::atomic<bool> lost{false};
  } race;
  race.failed.resize(addresses.size());
  const auto run = [&](size_t i) {
    absl::StatusOr<T> result = attempt(addresses[i], race.lost);
    std::optional<T> extra;
    {
      std::lock_guard<std::mutex> lock(race.mu);
      ++race.ended;
      if (!result.ok()) {
        if (!race.lost.load()) race.failed[i] = result.status();
        race.given_up = race.given_up || gives_up(result.status());
      } else if (race.won.has_value()) {
        extra = std::move(*result);
      } else {
        race.won = std::move(*result);
      }
      if (race.won.has_value() || race.given_up) race.lost.store(true);
    }
    race.ended_one.notify_all();
    if (extra.has_value()) discard(std::move(*extra));
  };

  size_t started = 0;
  if (addresses.size() == 1) {
    run(started++);
  } else {
    std::vector<std::thread> running;
    std::unique_lock<std::mutex> lock(race.mu);
    absl::Time next_at = absl::InfinitePast();
    while (!race.won.has_value() && !race.given_up) {
      // The first is asked even past the deadline, so that the error says
      // what an attempt made of it (timed out) rather than nothing.
      const bool more = started < addresses.size() && (started == 0 || SteadyNow() < deadline);
      if (!more && race.ended == started) break;
      if (more && (race.ended == started || SteadyNow() >= next_at)) {
        lock.unlock();
        const size_t i = started++;
        try {
          running.emplace_back(run, i);
        } catch (const std::system_error&) {
          run(i);  // no thread to be had: this one alone, on this thread
        }
        lock.lock();
        next_at = SteadyNow() + kNextAddressAfter;
        continue;
      }
      const size_t ended = race.ended;
      WaitUntil(race.ended_one, lock, more ? std::min(next_at, deadline) : absl::InfiniteFuture(),
                [&] { return race.ended != ended; });
    }
    race.lost.store(true);
    lock.unlock();
    for (std::thread& t : running) t.join();
  }
  if (race.won.has_value()) return std::move(*race.won);
  FailedAttempts failed;
  for (size_t i = 0; i < started; ++i) {
    if (!race.failed[i].has_value()) continue;
    failed.Add(name_each && addresses.size() > 1
                   ? SockaddrString(reinterpret_cast<const sockaddr*>(&addresses[i].storage))
                   : "",
               *race.failed[i]);
  }
  return failed.Error();
}

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_ADDRESS_RACE_H_
