// What a small blocking call costs in heap allocations over RDMA, counted by
// replacing operator new for this test binary. With messages that hold no
// strings (so protobuf allocates nothing), what remains is the runtime's and
// the transport's own share, which must not grow unnoticed: on the server,
// the call object and the handler's request/response pair. Everything else
// on the path (payload buffers, pending-call table, completion state, receive
// slot buffers, server context, call table) is allocation-free, but for the
// send queue's bookkeeping, a deque that takes a new block every 64 SENDs.
// The handler's own allocations are the service's business: the echo handler
// here makes none for a request without data.
#include <atomic>
#include <cstdlib>
#include <new>

#include "tests/echo_service.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace {
std::atomic<uint64_t> g_news{0};
}  // namespace

void* operator new(size_t size) {
  g_news.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size) { return operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace rdmarpc::testing {
namespace {

constexpr double kAllowedPerCall = 2 + 0.1;

double AllocationsPerCall(int workers) {
  const std::string ip = rdma::testing::RequireRdmaTestAddress();
  TestServer ts("rdma://" + ip + ":0", 64u << 20, workers);
  auto ch = Channel::Create(ts.address);
  EXPECT_TRUE(ts.server && ch.ok());
  if (!ts.server || !ch.ok()) return 1e9;
  EchoRequest req;
  EchoResponse resp;
  const auto call = [&](int64_t tag) {
    ClientContext ctx;
    req.set_tag(tag);
    Status s = (*ch)->Call(kEcho, &ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.tag(), tag);
  };
  // Connects, fills the receive rings, and lets every table reach its size.
  for (int i = 1; i <= 300; ++i) call(i);
  const int calls = 1000;
  const uint64_t before = g_news.load();
  for (int i = 1; i <= calls; ++i) call(1000 + i);
  return static_cast<double>(g_news.load() - before) / calls;
}

TEST(RdmaFastPath, SmallCallAllocationsWithInlineHandlers) {
  const double per_call = AllocationsPerCall(0);
  printf("heap allocations per small call (inline handlers): %.2f\n", per_call);
  EXPECT_LE(per_call, kAllowedPerCall);
}

TEST(RdmaFastPath, SmallCallAllocationsWithWorkerThreads) {
  // The worker queue, too, grows in blocks.
  const double per_call = AllocationsPerCall(2);
  printf("heap allocations per small call (2 workers): %.2f\n", per_call);
  EXPECT_LE(per_call, kAllowedPerCall + 0.1);
}

}  // namespace
}  // namespace rdmarpc::testing
