#include "transport/attempt_errors.h"

#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

constexpr char kPortAdvice[] = "Another server has this port there: take another.";

absl::Status PortTaken() {
  return WithWhatToDo(absl::UnavailableError("Address already in use"), kPortAdvice);
}

TEST(WithWhatToDo, EndsTheMessageWithTheAdviceAndKeepsIt) {
  const absl::Status s = PortTaken();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), absl::StrCat("Address already in use. ", kPortAdvice));
  EXPECT_EQ(s.GetPayload(kWhatToDo), absl::Cord(kPortAdvice));

  const absl::Status sentence = WithWhatToDo(absl::UnavailableError("It failed."), "Try again.");
  EXPECT_EQ(sentence.message(), "It failed. Try again.");

  const absl::Status more = WithWhatToDo(PortTaken(), "Or wait.");
  EXPECT_EQ(more.message(), absl::StrCat("Address already in use. ", kPortAdvice, " Or wait."));
  EXPECT_EQ(more.GetPayload(kWhatToDo), absl::Cord(absl::StrCat(kPortAdvice, "\nOr wait.")));

  EXPECT_TRUE(WithWhatToDo(absl::OkStatus(), "Nothing to do.").ok());
  EXPECT_FALSE(WithWhatToDo(absl::UnavailableError("x"), "").GetPayload(kWhatToDo));
}

// Two addresses whose port is taken: the advice once, after both.
TEST(FailedAttempts, SaysEachDistinctAdviceOnceAfterAll) {
  FailedAttempts failed;
  EXPECT_TRUE(failed.empty());
  failed.Add("[::1]:5", PortTaken());
  failed.Add("127.0.0.1:5", PortTaken());
  failed.Add("", WithWhatToDo(absl::PermissionDeniedError("Permission denied"), "Be root."));
  EXPECT_FALSE(failed.empty());
  const std::string said =
      "[::1]:5: Address already in use; 127.0.0.1:5: Address already in use; Permission denied";
  const std::string advice = absl::StrCat(kPortAdvice, " Be root.");
  EXPECT_EQ(failed.Message(), absl::StrCat(said, ". ", advice));
  const absl::Status error = failed.Error();
  EXPECT_EQ(error.code(), absl::StatusCode::kPermissionDenied) << "the last attempt's";
  EXPECT_EQ(error.message(), failed.Message());
  EXPECT_EQ(error.GetPayload(kWhatToDo), absl::Cord(absl::StrCat(kPortAdvice, "\nBe root.")));

  // Joined again (a name's attempts inside another's): still once.
  FailedAttempts outer;
  outer.Add("first", error);
  outer.Add("second", PortTaken());
  EXPECT_EQ(outer.Message(),
            absl::StrCat("first: ", said, "; second: Address already in use. ", advice));
}

// Two ways that failed differently (auto://'s RDMA, then TCP): advice that
// one alone has stays with it, and what both have is said once at the end.
TEST(FailedAttempts, WithItsAttemptKeepsAdviceOnlyOneHadInPlace) {
  const auto failed_on = [](std::initializer_list<absl::string_view> advice) {
    absl::Status s = absl::UnavailableError("timed out");
    for (absl::string_view piece : advice) s = WithWhatToDo(std::move(s), piece);
    return s;
  };
  FailedAttempts shared(FailedAttempts::Unshared::kWithItsAttempt);
  shared.Add("over RDMA", failed_on({"Check the host.", "Devices: rxe0."}));
  shared.Add("then over TCP", failed_on({"Check the host."}));
  EXPECT_EQ(shared.Message(),
            "over RDMA: timed out. Devices: rxe0.; then over TCP: timed out. Check the host.");
  EXPECT_EQ(shared.Error().GetPayload(kWhatToDo), absl::Cord("Check the host."));

  FailedAttempts apart(FailedAttempts::Unshared::kWithItsAttempt);
  apart.Add("over RDMA", failed_on({"Devices: rxe0."}));
  apart.Add("then over TCP", failed_on({"Start the server."}));
  apart.Add("", absl::UnavailableError("no advice"));
  EXPECT_EQ(apart.Message(),
            "over RDMA: timed out. Devices: rxe0.; then over TCP: timed out. Start the server.; "
            "no advice");
  EXPECT_FALSE(apart.Error().GetPayload(kWhatToDo).has_value());
}

TEST(FailedAttempts, LeavesInPlaceAdviceTheMessageDoesNotEndWith) {
  absl::Status rewritten(absl::StatusCode::kUnavailable,
                         absl::StrCat("wrapped: (", PortTaken().message(), ")"));
  rewritten.SetPayload(kWhatToDo, absl::Cord(kPortAdvice));
  FailedAttempts failed;
  failed.Add("", rewritten);
  EXPECT_EQ(failed.Message(), rewritten.message());
  EXPECT_FALSE(failed.Error().GetPayload(kWhatToDo));
}

// What every attempt's error had describes the name (auto:// falls back on
// one); what only some had does not.
TEST(FailedAttempts, KeepsThePayloadsEveryAttemptHad) {
  const auto run = [](bool second_has_it) {
    FailedAttempts failed;
    for (int n = 0; n < 2; ++n) {
      absl::Status s = absl::UnavailableError(absl::StrCat("attempt ", n));
      if (n == 0 || second_has_it) s.SetPayload("kind", absl::Cord("x"));
      s.SetPayload(absl::StrCat("only ", n), absl::Cord("y"));
      failed.Add("", s);
    }
    return failed.Error();
  };
  const absl::Status both = run(true);
  EXPECT_EQ(both.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(both.message(), "attempt 0; attempt 1");
  EXPECT_EQ(both.GetPayload("kind"), absl::Cord("x"));
  EXPECT_FALSE(both.GetPayload("only 0").has_value());
  EXPECT_FALSE(both.GetPayload("only 1").has_value());
  EXPECT_FALSE(both.GetPayload(kWhatToDo).has_value());
  EXPECT_FALSE(run(false).GetPayload("kind").has_value());
}

}  // namespace
}  // namespace rdmarpc::transport
