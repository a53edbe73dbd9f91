// RDMA in a process whose registrations the locked-memory limit bounds
// (RLIMIT_MEMLOCK, `ulimit -l`), as a user's program or a systemd service
// is (Debian gives them 8 MiB): the first endpoint says what the limit is,
// a call whose buffers do not fit fails alone and names the limit, and idle
// payload buffers, of any transport of the process, make way for a size that
// needs new ones.
//
// Runs in the Soft-RoCE VM under tests/without_capability.sh ipc_lock, which drops the
// CAP_IPC_LOCK that root would have; the test sets the limit itself. Server
// and client share this process, and so the limit.
#include "transport/rdma/locked_memory.h"

#include <sys/resource.h>

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace rdmarpc::testing {
namespace {

constexpr size_t kMiB = 1 << 20;

void LimitLockedMemory(size_t bytes) {
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &limit), 0);
  limit.rlim_cur = bytes;
  if (limit.rlim_max != RLIM_INFINITY && limit.rlim_max < bytes) limit.rlim_max = bytes;
  ASSERT_EQ(setrlimit(RLIMIT_MEMLOCK, &limit), 0) << strerror(errno);
  const std::optional<size_t> seen = transport::rdma::LockedMemoryLimit();
  ASSERT_TRUE(seen.has_value()) << "not limited: run under tests/without_capability.sh ipc_lock";
  ASSERT_EQ(*seen, bytes);
}

// Fewer receive slots than the defaults, so that what is left of the limit
// goes to payload buffers.
transport::TransportTunables FewSlots() {
  transport::TransportTunables t;
  t.rdma.server_receive_slots = 64;
  t.rdma.client_receive_slots = 64;
  return t;
}

// A request of `size` bytes whose response is one byte: payload buffers for
// the request only, one at each end.
Status Send(Channel& ch, size_t size) {
  ClientContext ctx;
  ctx.set_timeout(absl::Seconds(30));
  EchoRequest req;
  req.set_data(std::string(size, 'm'));
  req.set_response_size(1);
  EchoResponse resp;
  return ch.Call(kEcho, &ctx, req, &resp);
}

struct Peers {
  TestServer server;
  std::shared_ptr<Channel> channel;

  explicit Peers(const std::string& ip) : server("rdma://" + ip + ":0", 64u << 20, 4, FewSlots()) {
    if (!server.server) return;
    ChannelOptions options;
    options.transport = FewSlots();
    auto ch = Channel::Create(server.address, std::move(options));
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (ch.ok()) channel = std::move(*ch);
  }
};

// Runs first: the line comes once per process, with the first endpoint.
TEST(LockedMemory, ACallTooBigForTheLimitFailsAloneAndNamesIt) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  LimitLockedMemory(64 * kMiB);
  ::testing::internal::CaptureStderr();
  Peers peers(ip);
  const Status first = peers.channel ? Send(*peers.channel, 10) : Status();
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(peers.channel);
  ASSERT_TRUE(first.ok()) << first;
  EXPECT_NE(log.find("registered memory is limited to 64 MiB by `ulimit -l` (no CAP_IPC_LOCK)"),
            std::string::npos)
      << log;

  // 60 MiB travel in a 64 MiB buffer: the whole limit, and some is pinned.
  const Status big = Send(*peers.channel, 60 * kMiB);
  EXPECT_EQ(big.code(), StatusCode::kResourceExhausted) << big;
  EXPECT_NE(big.message().find("the locked-memory limit is 64 MiB"), std::string::npos) << big;
  EXPECT_NE(big.message().find("raise `ulimit -l`"), std::string::npos) << big;

  for (size_t size : {size_t{10}, kMiB}) {
    const Status s = Send(*peers.channel, size);
    EXPECT_TRUE(s.ok()) << size << " bytes after the refusal: " << s;
  }
}

// After 3 MiB requests (a 3.5 MiB buffer idle at each end), 6 MiB ones need
// 7 MiB buffers, which fit only once idle ones are given back.
TEST(LockedMemory, IdleBuffersMakeWayForANewSize) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  LimitLockedMemory(64 * kMiB);
  Peers peers(ip);
  ASSERT_TRUE(peers.channel);
  ASSERT_TRUE(Send(*peers.channel, 10).ok());
  const size_t base = transport::rdma::PinnedBytes();
  ASSERT_GT(base, 0u) << "VmPin does not count registrations here";
  // Without eviction the 6 MiB request needs base + 21 MiB (two 3.5 MiB
  // buffers idle, two 7 MiB ones in use), with it base + 14 or 17.5.
  LimitLockedMemory(base + 19 * kMiB);
  const Status three = Send(*peers.channel, 3 * kMiB);
  ASSERT_TRUE(three.ok()) << three;
  const Status six = Send(*peers.channel, 6 * kMiB);
  EXPECT_TRUE(six.ok()) << six;
}

// The limit counts every registration of the process, so idle buffers of
// one transport make way for another's: after 3 MiB requests from one
// channel to one server (a 3.5 MiB buffer idle in each of their pools), 6 MiB
// ones from a second channel to a second server need 7 MiB buffers in two
// other pools, and the second server's fits only once the first pair's idle
// ones are given back; then the first pair's fit again once the second's
// are.
TEST(LockedMemory, IdleBuffersOfOneTransportMakeWayForAnothers) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  LimitLockedMemory(64 * kMiB);
  Peers first(ip);
  Peers second(ip);
  ASSERT_TRUE(first.channel && second.channel);
  ASSERT_TRUE(Send(*first.channel, 10).ok());
  ASSERT_TRUE(Send(*second.channel, 10).ok());
  const size_t base = transport::rdma::PinnedBytes();
  // Without giving back across pools the 6 MiB request needs base + 21 MiB
  // (two 3.5 MiB buffers idle, two 7 MiB ones in use), with it base + 14.
  LimitLockedMemory(base + 17 * kMiB);
  const Status three = Send(*first.channel, 3 * kMiB);
  ASSERT_TRUE(three.ok()) << three;
  const Status six = Send(*second.channel, 6 * kMiB);
  EXPECT_TRUE(six.ok()) << six;
  const Status again = Send(*first.channel, 3 * kMiB);
  EXPECT_TRUE(again.ok()) << again;
}

}  // namespace
}  // namespace rdmarpc::testing
