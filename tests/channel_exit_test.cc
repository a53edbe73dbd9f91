// A process that exits right after dropping a channel in its own inline
// callback: the channel is destroyed on a thread of its own
// (rpc/internal/own_thread.h), and the exit waits for that destruction, so
// the calls it ends still get their callbacks, and nothing is cut short
// while static objects are torn down.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "rpc/channel.h"
#include "tests/echo_service.h"

namespace rdmarpc::testing {
namespace {

// A port that takes connections (the kernel's backlog) and never answers.
std::string Silent() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return "";
  }
  return "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

// Drops the channel in a call's inline callback (its deadline, on the
// channel's timer thread) while another call is pending, then exits at
// once. Ending the pending call, the destructor runs its callback, which
// takes 300 ms to say so.
void DropTheChannelInACallbackAndExit() {
  const std::string address = Silent();
  if (address.empty()) {
    fprintf(stderr, "no listening socket\n");
    exit(2);
  }
  ChannelOptions options;
  options.callback_threads = 0;
  auto created = Channel::Create(address, options);
  if (!created.ok()) exit(3);
  std::shared_ptr<Channel> last = std::move(*created);
  ClientContext pending_ctx;
  EchoRequest request;
  EchoResponse pending_response, response;
  last->CallAsync(kEcho, &pending_ctx, request, &pending_response, [](Status s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    fprintf(stderr, "the pending call ended: %s\n", s.ToString().c_str());
  });
  std::promise<void> dropped;
  ClientContext ctx;
  ctx.set_timeout(absl::Milliseconds(200));
  last->CallAsync(kEcho, &ctx, request, &response, [&](Status) {
    last.reset();
    dropped.set_value();
  });
  dropped.get_future().wait();
  exit(0);
}

TEST(ChannelAtExit, ADestructionUnderWayEndsBeforeTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(DropTheChannelInACallbackAndExit(), ::testing::ExitedWithCode(0),
              "the pending call ended: UNAVAILABLE");
}

}  // namespace
}  // namespace rdmarpc::testing
