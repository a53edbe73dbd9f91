#include "base/new_thread.h"

#include <dirent.h>
#include <errno.h>

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

TEST(NewThread, RunsTheBodyOnAThreadOfItsOwn) {
  std::atomic<bool> ran{false};
  std::thread::id on;
  auto t = NewThread("the test's body", [&] {
    on = std::this_thread::get_id();
    ran = true;
  });
  ASSERT_TRUE(t.ok()) << t.status();
  t->join();
  EXPECT_TRUE(ran);
  EXPECT_NE(on, std::this_thread::get_id());
}

// What a process at its limit is told (the limits themselves are tested
// where one can be set: tests/thread_limit_test.cc, in the VM).
TEST(NewThread, NoThreadSaysForWhatAndHowManyThreadsRun) {
  const absl::Status s = NoThread("the poller of rxe0", EAGAIN);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  int threads = 0;  // 1, or 2 under TSan, which runs a thread of its own
  if (DIR* d = opendir("/proc/self/task")) {
    while (const dirent* e = readdir(d)) threads += e->d_name[0] != '.';
    closedir(d);
  }
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
