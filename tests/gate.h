// Gate: a one-way door for tests that hold a thread at a chosen point (a
// handler, a callback) until the test lets it go. Open may be called any
// number of times, from any thread, so that every way out of a test can
// open it and a held thread never outlives the test waiting.
//
//   Gate gate;
//   ... on the held thread: gate.Wait();
//   ... in the test, and in a guard's destructor: gate.Open();
#ifndef RDMARPC_TESTS_GATE_H_
#define RDMARPC_TESTS_GATE_H_

#include <future>
#include <mutex>

namespace rdmarpc::testing {

class Gate {
 public:
  void Open() {
    std::call_once(once_, [this] { open_.set_value(); });
  }
  void Wait() const { opened_.wait(); }

 private:
  std::promise<void> open_;
  std::shared_future<void> opened_ = open_.get_future().share();
  std::once_flag once_;
};

}  // namespace rdmarpc::testing

#endif  // RDMARPC_TESTS_GATE_H_
