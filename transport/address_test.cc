// ParseAddress: the addresses users write, and a clear error naming what is
// wrong with each one that is not an address.
#include "transport/address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

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

TEST(AttemptDeadline, SharesWhatIsLeftAmongTheAddressesLeft) {
  const absl::Time before = SteadyNow();
  const absl::Time deadline = before + absl::Seconds(10);
  const absl::Time first_of_two = AttemptDeadline(deadline, 2);
  EXPECT_GE(first_of_two, before + absl::Seconds(5));
  EXPECT_LE(first_of_two, SteadyNow() + absl::Seconds(5));
  EXPECT_EQ(AttemptDeadline(deadline, 1), deadline);  // the last gets all that is left
  EXPECT_EQ(AttemptDeadline(absl::InfiniteFuture(), 3), absl::InfiniteFuture());
  const absl::Time passed = SteadyNow() - absl::Seconds(1);
  EXPECT_EQ(AttemptDeadline(passed, 2), passed);
}

// The error of a name whose every address failed says what each did, after
// the address, then once what to do about it (FailedAttempts), with the
// last attempt's code.
TEST(TryEachAddress, NamesEachAttemptThenSaysWhatToDoOnce) {
  std::vector<SocketAddress> two(2);
  for (SocketAddress& a : two) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a.storage);
    in->sin_family = AF_INET;
    in->sin_port = htons(5);
    inet_pton(AF_INET, &a == &two[0] ? "10.0.0.1" : "10.0.0.2", &in->sin_addr);
    a.len = sizeof(sockaddr_in);
  }
  int n = 0;
  const absl::StatusOr<int> s = TryEachAddress<int>(
      two, absl::InfiniteFuture(), /*name_each=*/true,
      [&](const SocketAddress&, absl::Time) -> absl::StatusOr<int> {
        return WithWhatToDo(absl::Status(n++ == 0 ? absl::StatusCode::kUnavailable
                                                  : absl::StatusCode::kDeadlineExceeded,
                                         "refused"),
                            "Start the server.");
      },
      [](const absl::Status&) { return false; });
  EXPECT_EQ(n, 2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.status().message(), "10.0.0.1:5: refused; 10.0.0.2:5: refused. Start the server.");
}

}  // namespace
}  // namespace rdmarpc::transport
