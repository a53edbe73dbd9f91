#include "transport/listen_on_each.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include <map>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "transport/attempt_errors.h"

namespace rdmarpc::transport {
namespace {

SocketAddress Ipv4(const char* ip, uint16_t port) {
  SocketAddress a{};
  auto* in = reinterpret_cast<sockaddr_in*>(&a.storage);
  in->sin_family = AF_INET;
  in->sin_port = htons(port);
  inet_pton(AF_INET, ip, &in->sin_addr);
  a.len = sizeof(sockaddr_in);
  return a;
}

uint16_t PortOf(const SocketAddress& a) {
  return ntohs(reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_port);
}

// Stands for one bound socket: records what it was asked for and when it
// is stopped.
class FakeListener : public Listener {
 public:
  FakeListener(Address address, int* alive) : address_(std::move(address)), alive_(alive) {
    ++*alive_;
  }
  ~FakeListener() override { --*alive_; }
  const Address& address() const override { return address_; }

 private:
  const Address address_;
  int* const alive_;
};

// Binds what it is asked for, picking first_pick, first_pick + 1, ... for
// port 0, and refuses the addresses in `refuse` (with `refuse_with`) and the
// ports in `taken` on their address (with EADDRINUSE).
struct FakeTransport {
  Address asked{"tcp", "name", 0};
  uint16_t first_pick = 4242;
  int picks = 0;
  std::vector<std::string> refuse;
  int refuse_with = EADDRINUSE;
  std::map<std::string, std::set<uint16_t>> taken;
  std::vector<SocketAddress> tried;
  std::vector<int> alive_at_try;  // listeners alive when each bind was tried
  int alive = 0;

  absl::StatusOr<std::unique_ptr<Listener>> ListenOne(const SocketAddress& a) {
    tried.push_back(a);
    alive_at_try.push_back(alive);
    const std::string host = SockaddrHost(reinterpret_cast<const sockaddr*>(&a.storage));
    for (const std::string& r : refuse) {
      if (r == host) return BindError(refuse_with);
    }
    if (taken[host].count(PortOf(a)) != 0) return BindError(EADDRINUSE);
    Address bound = asked;
    bound.port = PortOf(a) == 0 ? first_pick + picks++ : PortOf(a);
    return std::unique_ptr<Listener>(std::make_unique<FakeListener>(bound, &alive));
  }
  absl::StatusOr<std::unique_ptr<Listener>> Listen(const std::vector<SocketAddress>& all) {
    return ListenOnEachAddress(all, "test",
                               [this](const SocketAddress& a) { return ListenOne(a); });
  }
};

TEST(ListenOnEachAddress, PortZeroIsPickedByTheFirstAndAskedOfTheRest) {
  FakeTransport t;
  auto listener = t.Listen({Ipv4("10.0.0.1", 0), Ipv4("10.0.0.2", 0), Ipv4("10.0.0.3", 0)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_EQ(t.tried.size(), 3u);
  EXPECT_EQ(PortOf(t.tried[0]), 0);
  EXPECT_EQ(PortOf(t.tried[1]), t.first_pick);
  EXPECT_EQ(PortOf(t.tried[2]), t.first_pick);
  EXPECT_EQ((*listener)->address().port, t.first_pick);
  EXPECT_EQ(t.alive, 3);
  listener->reset();
  EXPECT_EQ(t.alive, 0) << "the group stops every listener it holds";
}

TEST(ListenOnEachAddress, AnAddressThatFailsIsLeftOut) {
  FakeTransport t;
  t.refuse = {"10.0.0.1"};
  auto listener = t.Listen({Ipv4("10.0.0.1", 0), Ipv4("10.0.0.2", 0)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(PortOf(t.tried[1]), 0) << "no port was picked yet";
  EXPECT_EQ((*listener)->address().port, t.first_pick);
  EXPECT_EQ(t.alive, 1);
}

// The port that [::1] picked was a client's on 127.0.0.1 (seen in CI):
// both are bound again on a port picked afresh, while the first pick is
// still held, so the kernel cannot hand the same one back.
TEST(ListenOnEachAddress, APickedPortTakenOnALaterAddressIsPickedAgain) {
  FakeTransport t;
  t.taken["10.0.0.2"] = {t.first_pick};
  auto listener = t.Listen({Ipv4("10.0.0.1", 0), Ipv4("10.0.0.2", 0)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  ASSERT_EQ(t.tried.size(), 4u);
  EXPECT_EQ(PortOf(t.tried[1]), t.first_pick);
  EXPECT_EQ(PortOf(t.tried[2]), 0) << "picked afresh";
  EXPECT_EQ(t.alive_at_try[2], 1) << "the first pick still held";
  EXPECT_EQ(PortOf(t.tried[3]), t.first_pick + 1);
  EXPECT_EQ((*listener)->address().port, t.first_pick + 1);
  EXPECT_EQ(t.alive, 2) << "both addresses, and the first pick let go";
}

// Past kFreshPortTries picks the address is left out as any other would be.
TEST(ListenOnEachAddress, AnAddressWithEveryPickTakenIsLeftOutAfterTheTries) {
  FakeTransport t;
  for (int i = 0; i <= kFreshPortTries; ++i) t.taken["10.0.0.2"].insert(t.first_pick + i);
  auto listener = t.Listen({Ipv4("10.0.0.1", 0), Ipv4("10.0.0.2", 0)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(t.tried.size(), 2u * kFreshPortTries);
  EXPECT_EQ((*listener)->address().port, t.first_pick + kFreshPortTries - 1);
  EXPECT_EQ(t.alive, 1);
}

// A port asked for is the only one that will do, and an address that fails
// otherwise than by its port fails on any port: neither is tried again.
TEST(ListenOnEachAddress, OnlyAPickedPortTakenIsPickedAgain) {
  FakeTransport asked;
  asked.taken["10.0.0.2"] = {7};
  auto listener = asked.Listen({Ipv4("10.0.0.1", 7), Ipv4("10.0.0.2", 7)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(asked.tried.size(), 2u);
  EXPECT_EQ(asked.alive, 1);

  FakeTransport elsewhere;
  elsewhere.refuse = {"10.0.0.2"};
  elsewhere.refuse_with = EADDRNOTAVAIL;
  listener = elsewhere.Listen({Ipv4("10.0.0.1", 0), Ipv4("10.0.0.2", 0)});
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(elsewhere.tried.size(), 2u);
  EXPECT_EQ(elsewhere.alive, 1);
}

// Each address, then once what to do: the same advice after each would
// repeat ~100 characters.
TEST(ListenOnEachAddress, NoAddressBoundNamesEachThenSaysWhatToDoOnce) {
  FakeTransport t;
  t.refuse = {"10.0.0.1", "10.0.0.2"};
  auto listener = t.Listen({Ipv4("10.0.0.1", 7), Ipv4("10.0.0.2", 7)});
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(listener.status().message(),
            absl::StrCat("10.0.0.1:7: Address already in use; 10.0.0.2:7: Address already in use. ",
                         std::string(BindError(EADDRINUSE).GetPayload(kWhatToDo).value())));
}

TEST(ListenOnEachAddress, OneAddressKeepsItsMessageBare) {
  FakeTransport t;
  t.refuse = {"10.0.0.1"};
  auto listener = t.Listen({Ipv4("10.0.0.1", 7)});
  ASSERT_FALSE(listener.ok());
  EXPECT_EQ(listener.status().message(), BindError(EADDRINUSE).message());
}

// A port taken or privileged, and an address not this host's, say what to
// do; any other failure is the system's words alone (over RDMA the devices
// follow, rdma_transport.cc).
TEST(BindError, SaysWhatToDoAboutThePortAndTheAddress) {
  const absl::Status taken = BindError(EADDRINUSE);
  EXPECT_TRUE(absl::IsUnavailable(taken)) << taken;
  EXPECT_TRUE(absl::StartsWith(taken.message(), "Address already in use. Another server")) << taken;
  EXPECT_TRUE(absl::EndsWith(taken.message(), "(port 0 picks a free one).")) << taken;
  EXPECT_TRUE(taken.GetPayload(kWhatToDo).has_value()) << "said once for many addresses";
  const absl::Status privileged = BindError(EACCES);
  EXPECT_TRUE(absl::StrContains(privileged.message(), "CAP_NET_BIND_SERVICE")) << privileged;
  const absl::Status elsewhere = BindError(EADDRNOTAVAIL);
  EXPECT_TRUE(absl::IsUnavailable(elsewhere)) << elsewhere;
  EXPECT_TRUE(absl::StartsWith(elsewhere.message(),
                               "Cannot assign requested address. No interface of this host"))
      << elsewhere;
  EXPECT_TRUE(absl::StrContains(elsewhere.message(), "`ip -br addr`")) << elsewhere;
  EXPECT_TRUE(elsewhere.GetPayload(kWhatToDo).has_value()) << "said once for many addresses";
  EXPECT_EQ(BindError(EIO).message(), strerror(EIO));
  EXPECT_TRUE(PortTaken(taken));
  EXPECT_FALSE(PortTaken(privileged));
  EXPECT_FALSE(PortTaken(elsewhere));
}

}  // namespace
}  // namespace rdmarpc::transport
