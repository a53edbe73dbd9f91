// ThreadSanitizer suppressions compiled into the test binaries.
//
// abseil comes from Debian as shared libraries built without TSan. A Status
// with a message shares a heap "rep" between copies, counted with atomics
// inside libabsl_status.so, which TSan cannot see: when the last copy goes on
// another thread, the free looks like a race with every earlier read. Only
// that free is suppressed; races in our code are still reported.
extern "C" const char* __tsan_default_suppressions() {
  return "race:absl::*Status::Unref\n";
}
