#include "base/new_thread.h"

#include <errno.h>
#include <pthread.h>

#include <atomic>
#include <future>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/threads_of_process.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(NewThread, RunsTheBodyOnAThreadOfItsOwnThatHasItsName) {
  std::atomic<bool> ran{false};
  std::thread::id on;
  char name[16] = {};
  auto t = NewThread("test-body-15chr", "the test's body", [&] {
    on = std::this_thread::get_id();
    pthread_getname_np(pthread_self(), name, sizeof(name));
    ran = true;
  });
  ASSERT_TRUE(t.ok()) << t.status();
  t->join();
  EXPECT_TRUE(ran);
  EXPECT_NE(on, std::this_thread::get_id());
  EXPECT_STREQ(name, "test-body-15chr");
}

// Listed by name, as tests find the library's threads.
TEST(NewThread, ItsThreadIsListedByItsName) {
  std::promise<void> listed;
  auto t = NewThread("test-listed", "a thread to list", [&] { listed.get_future().wait(); });
  ASSERT_TRUE(t.ok()) << t.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (ThreadsNamed("test-listed") == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ThreadsNamed("test-listed"), 1);
  listed.set_value();
  t->join();
  EXPECT_EQ(ThreadsNamed("test-listed"), 0);
}

// What a process at its limit is told (the limits themselves are tested
// where one can be set: tests/thread_limit_test.cc, in the VM).
TEST(NewThread, NoThreadSaysForWhatAndHowManyThreadsRun) {
  const absl::Status s = NoThread("the poller of rxe0", EAGAIN);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  // 1, or 2 under TSan, which runs a thread of its own
  const size_t threads = ThreadIdsOfThisProcess().size();
  EXPECT_EQ(message.rfind(absl::StrCat("no thread for the poller of rxe0: Resource temporarily "
                                       "unavailable. This process runs ",
                                       threads, threads == 1 ? " thread;" : " threads;"),
                          0),
            0u)
      << message;
  EXPECT_NE(message.find("Raise the limit it reached, or run fewer threads in it."),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace rdmarpc
