// ParseAddress: the addresses users write, and a clear error naming what is
// wrong with each one that is not an address. TryEachAddress: how a connect
// asks a name's addresses.
#include "transport/address.h"

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>

#include <atomic>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "transport/address_race.h"

namespace rdmarpc::transport {
namespace {

TEST(ParseAddress, TakesEachSchemeIpv4Ipv6AndNames) {
  struct Case {
    const char* text;
    const char* scheme;
    const char* host;
    uint16_t port;
  } cases[] = {
      {"tcp://127.0.0.1:5000", "tcp", "127.0.0.1", 5000},
      {"rdma://10.0.0.1:7471", "rdma", "10.0.0.1", 7471},
      {"auto://server.example:65535", "auto", "server.example", 65535},
      {"tcp://[::1]:0", "tcp", "::1", 0},
      {"rdma://[fe80::1%sr0]:18515", "rdma", "fe80::1%sr0", 18515},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    auto a = ParseAddress(c.text);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->scheme, c.scheme);
    EXPECT_EQ(a->host, c.host);
    EXPECT_EQ(a->port, c.port);
    EXPECT_EQ(a->ToString(), c.text) << "does not print as it was written";
  }
}

TEST(ParseAddress, RefusesWhatIsNotAnAddressSayingWhy) {
  struct Case {
    const char* text;
    const char* why;
  } cases[] = {
      {"127.0.0.1:5000", "no scheme"},
      {"udp://127.0.0.1:5000", "unknown scheme"},
      {"tcp://[::1:5000", "unterminated [ipv6]:port"},
      {"tcp://[::1]5000", "unterminated [ipv6]:port"},
      {"tcp://[::1]", "unterminated [ipv6]:port"},
      {"tcp://127.0.0.1", "no port"},
      {"tcp://:5000", "no host"},
      {"tcp://127.0.0.1:http", "bad port"},
      {"tcp://127.0.0.1:65536", "bad port"},
      {"tcp://127.0.0.1:", "bad port"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    auto a = ParseAddress(c.text);
    ASSERT_FALSE(a.ok()) << "parsed as " << a->ToString();
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(a.status().message(),
              std::string("bad address '") + c.text + "': " + c.why +
                  " (expected tcp://host:port, rdma://host:port or auto://host:port)");
  }
}

TEST(ResolveAddresses, GivesTheSocketAddressOfNumericHosts) {
  auto v4 = ResolveAddresses(*ParseAddress("tcp://127.0.0.1:5000"));
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_EQ(v4->front().storage.ss_family, AF_INET);
  EXPECT_EQ(v4->front().len, sizeof(sockaddr_in));
  const auto* in = reinterpret_cast<const sockaddr_in*>(&v4->front().storage);
  EXPECT_EQ(ntohs(in->sin_port), 5000);
  EXPECT_EQ(ntohl(in->sin_addr.s_addr), INADDR_LOOPBACK);
  auto v6 = ResolveAddresses(*ParseAddress("tcp://[::1]:7"));
  ASSERT_TRUE(v6.ok()) << v6.status();
  ASSERT_EQ(v6->front().storage.ss_family, AF_INET6);
  EXPECT_EQ(ntohs(reinterpret_cast<const sockaddr_in6*>(&v6->front().storage)->sin6_port), 7);
}

// As a destination the unspecified address is this host (rdma_cm's connect
// replaces it by this host's RoCE addresses), the loopback one is not.
TEST(IsUnspecified, IsTrueForTheWildcardsOfBothFamiliesAlone) {
  for (const auto& [text, unspecified] : {std::pair<const char*, bool>{"tcp://0.0.0.0:1", true},
                                          {"tcp://[::]:1", true},
                                          {"tcp://127.0.0.1:1", false},
                                          {"tcp://[::1]:1", false},
                                          {"tcp://[::ffff:0.0.0.0]:1", false}}) {
    auto a = ResolveAddresses(*ParseAddress(text));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(IsUnspecified(reinterpret_cast<const sockaddr*>(&a->front().storage)), unspecified)
        << text;
  }
}

TEST(WithPort, SetsThePortAndTheLengthOfEitherFamily) {
  for (const char* text : {"tcp://10.1.2.3:1", "tcp://[fd00::7]:1"}) {
    auto a = ResolveAddresses(*ParseAddress(text));
    ASSERT_TRUE(a.ok()) << a.status();
    const SocketAddress with = WithPort(a->front().storage, 7471);
    EXPECT_EQ(with.len, a->front().len) << text;
    const std::string host = SockaddrHost(reinterpret_cast<const sockaddr*>(&a->front().storage));
    EXPECT_EQ(SockaddrString(reinterpret_cast<const sockaddr*>(&with.storage)),
              absl::StrContains(host, ":") ? absl::StrCat("[", host, "]:7471")
                                           : absl::StrCat(host, ":7471"));
  }
}

// A link-local address is one only on its interface, which the address
// must name: without it, INVALID_ARGUMENT saying how to name it (with the
// interface's name where it is one of this host's), not the bare EINVAL
// that bind(2) or connect(2) would give. With it, the address has the
// interface's scope.
TEST(ResolveAddresses, ALinkLocalAddressNeedsItsInterface) {
  auto bare = ResolveAddresses(*ParseAddress("rdma://[fe80::1]:7471"));
  ASSERT_FALSE(bare.ok());
  EXPECT_EQ(bare.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bare.status().message(),
                                "rdma://[fe80::1]:7471: fe80::1 is a link-local address"))
      << bare.status();
  EXPECT_TRUE(absl::StrContains(bare.status().message(),
                                "Name the interface, as in rdma://[fe80::1%eth0]:7471"))
      << bare.status();
  auto scoped = ResolveAddresses(*ParseAddress("tcp://[fe80::1%lo]:7471"));
  ASSERT_TRUE(scoped.ok()) << scoped.status();
  ASSERT_EQ(scoped->size(), 1u);
  EXPECT_EQ(reinterpret_cast<const sockaddr_in6*>(&scoped->front().storage)->sin6_scope_id,
            if_nametoindex("lo"));
}

// Addresses 10.0.0.1:5, 10.0.0.2:5, ...
std::vector<SocketAddress> Addresses(int n) {
  std::vector<SocketAddress> addresses(n);
  for (int i = 0; i < n; ++i) {
    auto* in = reinterpret_cast<sockaddr_in*>(&addresses[i].storage);
    in->sin_family = AF_INET;
    in->sin_port = htons(5);
    inet_pton(AF_INET, absl::StrCat("10.0.0.", i + 1).c_str(), &in->sin_addr);
    addresses[i].len = sizeof(sockaddr_in);
  }
  return addresses;
}

int Index(const SocketAddress& a) {
  return (ntohl(reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr.s_addr) & 0xff) - 1;
}

// Until `done` is true, or a minute has passed (false): the attempts below
// wait for each other, and a race that never ran them side by side would
// otherwise wait for ever.
bool SpinUntil(const std::atomic<bool>& done) {
  const absl::Time give_up = SteadyNow() + absl::Minutes(1);
  while (!done.load()) {
    if (SteadyNow() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

const auto kNoDiscard = [](int) { ADD_FAILURE() << "nothing was made twice"; };
const auto kNeverGivesUp = [](const absl::Status&) { return false; };

// IPv6 addresses [fd00::N]:5.
SocketAddress V6(int n) {
  SocketAddress a{};
  auto* in6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  in6->sin6_family = AF_INET6;
  in6->sin6_port = htons(5);
  inet_pton(AF_INET6, absl::StrCat("fd00::", n).c_str(), &in6->sin6_addr);
  a.len = sizeof(sockaddr_in6);
  return a;
}

std::vector<std::string> Hosts(const std::vector<SocketAddress>& addresses) {
  std::vector<std::string> hosts;
  for (const SocketAddress& a : addresses) {
    hosts.push_back(SockaddrHost(reinterpret_cast<const sockaddr*>(&a.storage)));
  }
  return hosts;
}

// The families take turns, the first address's first, each family's
// addresses in their own order.
TEST(InterleaveFamilies, TakesTurnsFirstFamilyFirst) {
  const std::vector<SocketAddress> v4 = Addresses(2);
  EXPECT_EQ(Hosts(InterleaveFamilies({V6(1), V6(2), V6(3), v4[0]})),
            (std::vector<std::string>{"fd00::1", "10.0.0.1", "fd00::2", "fd00::3"}));
  EXPECT_EQ(Hosts(InterleaveFamilies({v4[0], v4[1], V6(1), V6(2)})),
            (std::vector<std::string>{"10.0.0.1", "fd00::1", "10.0.0.2", "fd00::2"}));
  EXPECT_EQ(Hosts(InterleaveFamilies({V6(1), V6(2)})),
            (std::vector<std::string>{"fd00::1", "fd00::2"}));
}

// The error of a name whose every address failed says what each did, after
// the address and in the addresses' order (not in the order they failed),
// then once what to do about it (FailedAttempts), with the code of the last
// address's attempt.
TEST(TryEachAddress, NamesEachAttemptInOrderThenSaysWhatToDoOnce) {
  std::atomic<bool> second_failed{false};
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(2), absl::InfiniteFuture(), /*name_each=*/true,
      [&](const SocketAddress& a, const std::atomic<bool>&) -> absl::StatusOr<int> {
        // The first fails only once the second has, which starts beside it.
        if (Index(a) == 0 && !SpinUntil(second_failed)) return absl::InternalError("alone");
        absl::Status why =
            WithWhatToDo(absl::Status(Index(a) == 0 ? absl::StatusCode::kUnavailable
                                                    : absl::StatusCode::kDeadlineExceeded,
                                      "refused"),
                         "Start the server.");
        if (Index(a) == 1) second_failed = true;
        return why;
      },
      kNoDiscard, kNeverGivesUp);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.status().message(), "10.0.0.1:5: refused; 10.0.0.2:5: refused. Start the server.");
}

// An address that never answers holds up neither the next one, which is
// asked beside it kNextAddressAfter in, nor the result: it is told it lost
// and ends.
TEST(TryEachAddress, AnAddressThatNeverAnswersDoesNotHoldUpTheNext) {
  std::atomic<bool> first_ended{false};
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(3), absl::InfiniteFuture(), /*name_each=*/true,
      [&](const SocketAddress& a, const std::atomic<bool>& lost) -> absl::StatusOr<int> {
        if (Index(a) == 0) {
          const bool told = SpinUntil(lost);
          first_ended = true;
          return absl::CancelledError(told ? "lost" : "never told it lost");
        }
        EXPECT_EQ(Index(a), 1) << "the third was asked though the second connected";
        EXPECT_FALSE(first_ended) << "the second was asked only once the first had ended";
        return Index(a);
      },
      kNoDiscard, kNeverGivesUp);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 1);
  EXPECT_TRUE(first_ended) << "returned while an attempt still ran";
}

// A failure starts the next address at once, without waiting out its delay:
// each attempt here fails only once the one after it has started.
TEST(TryEachAddress, AFailureAsksTheNextAddressAtOnce) {
  std::atomic<int> started{0};
  const absl::Time begun = SteadyNow();
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(4), absl::InfiniteFuture(), /*name_each=*/false,
      [&](const SocketAddress& a, const std::atomic<bool>&) -> absl::StatusOr<int> {
        ++started;
        if (Index(a) == 3) return 3;
        return absl::UnavailableError("refused");
      },
      kNoDiscard, kNeverGivesUp);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 3);
  EXPECT_EQ(started, 4);
  // Three failures in a row, each followed at once by the next attempt: in
  // turn with the delay between them this took three delays.
  EXPECT_LT(SteadyNow() - begun, 3 * kNextAddressAfter);
}

// A connect whose deadline has passed asks the first address, which says
// so, and no other: the error is that attempt's, not an empty one.
TEST(TryEachAddress, PastItsDeadlineTheFirstAddressAloneIsAsked) {
  std::atomic<int> started{0};
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(2), SteadyNow() - absl::Seconds(1), /*name_each=*/true,
      [&](const SocketAddress&, const std::atomic<bool>&) -> absl::StatusOr<int> {
        ++started;
        return absl::DeadlineExceededError("timed out");
      },
      kNoDiscard, kNeverGivesUp);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded) << s.status();
  EXPECT_EQ(s.status().message(), "10.0.0.1:5: timed out");
  EXPECT_EQ(started, 1);
}

// Two attempts that connect within the same moment: the first to report
// wins, the other's connection goes to `discard`.
TEST(TryEachAddress, ASecondConnectionMadeIsDiscarded) {
  std::atomic<bool> second_started{false};
  std::vector<int> discarded;
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(2), absl::InfiniteFuture(), /*name_each=*/true,
      [&](const SocketAddress& a, const std::atomic<bool>& lost) -> absl::StatusOr<int> {
        if (Index(a) == 1) {
          second_started = true;
          if (!SpinUntil(lost)) return absl::InternalError("never told it lost");
          return 1;  // connected all the same
        }
        if (!SpinUntil(second_started)) return absl::InternalError("alone");
        return 0;
      },
      [&](int extra) { discarded.push_back(extra); }, kNeverGivesUp);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*s, 0);
  EXPECT_EQ(discarded, std::vector<int>{1});
}

// An attempt that fails for good (the transport shuts down) ends the others
// and asks no more addresses; the error is its own, as the others ended
// only because it did.
TEST(TryEachAddress, AFailureForGoodEndsTheRest) {
  std::atomic<int> started{0};
  const absl::StatusOr<int> s = TryEachAddress<int>(
      Addresses(3), absl::InfiniteFuture(), /*name_each=*/false,
      [&](const SocketAddress& a, const std::atomic<bool>& lost) -> absl::StatusOr<int> {
        ++started;
        if (Index(a) == 0) {
          return SpinUntil(lost) ? absl::CancelledError("lost")
                                 : absl::InternalError("never told it lost");
        }
        return absl::CancelledError("transport shutting down");
      },
      kNoDiscard, [](const absl::Status& why) { return absl::IsCancelled(why); });
  EXPECT_EQ(s.status().code(), absl::StatusCode::kCancelled) << s.status();
  EXPECT_EQ(s.status().message(), "transport shutting down");
  EXPECT_EQ(started, 2);
}

}  // namespace
}  // namespace rdmarpc::transport
