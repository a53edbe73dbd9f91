#include "base/signal_storm.h"

#include <unistd.h>

#include <cerrno>
#include <future>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

// The storm is only worth running code under if it interrupts a blocking
// system call in another thread: a read from a pipe nobody writes to ends
// with EINTR instead of waiting.
TEST(SignalStorm, InterruptsABlockingCallInAnotherThread) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  std::promise<int> started;
  auto reader = std::async(std::launch::async, [&] {
    started.set_value(0);
    char c;
    const ssize_t n = read(fds[0], &c, 1);
    return n < 0 ? errno : 0;
  });
  started.get_future().wait();
  SignalStorm storm(absl::Milliseconds(1));
  ASSERT_EQ(reader.wait_for(std::chrono::seconds(10)), std::future_status::ready)
      << "no signal interrupted the read";
  EXPECT_EQ(reader.get(), EINTR);
  // Read once the sender has stopped: the reader can wake and return before
  // the sender counts the tgkill that woke it.
  storm.Stop();
  EXPECT_GE(storm.threads_signalled(), 2u);  // the reader and this thread at least
  close(fds[0]);
  close(fds[1]);
}

// The handler counts what it ran, and a storm that ended leaves nothing
// pending to end the process under the old (default) disposition.
TEST(SignalStorm, CountsDeliveriesAndEndsCleanly) {
  uint64_t delivered = 0;
  {
    SignalStorm storm(absl::Microseconds(200));
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (storm.delivered() < 100 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    delivered = storm.delivered();
  }
  EXPECT_GE(delivered, 100u);
  absl::SleepFor(absl::Milliseconds(20));  // a leftover signal would end the test here
  struct sigaction now {};
  sigaction(SIGUSR1, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL) << "the storm did not put the old handler back";
}

}  // namespace
}  // namespace rdmarpc
