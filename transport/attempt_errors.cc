#include "transport/attempt_errors.h"

#include <errno.h>
#include <sys/resource.h>

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rdmarpc::transport {
namespace {

// Between the pieces of advice in kWhatToDo, which a message separates by
// a space: a joiner says each piece once, however the errors nest.
constexpr char kBetweenPieces[] = "\n";

// What goes between a message and the advice after it: a message that ends
// a sentence already needs only the space.
absl::string_view SentenceBreak(absl::string_view message) {
  return absl::EndsWith(message, ".") ? " " : ". ";
}

}  // namespace

absl::Status WithWhatToDo(absl::Status error, absl::string_view advice) {
  if (error.ok() || advice.empty()) return error;
  absl::Status out(error.code(),
                   absl::StrCat(error.message(), SentenceBreak(error.message()), advice));
  error.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  const auto had = error.GetPayload(kWhatToDo);
  out.SetPayload(kWhatToDo,
                 had ? absl::Cord(absl::StrCat(std::string(*had), kBetweenPieces, advice))
                     : absl::Cord(advice));
  return out;
}

absl::Status Prefixed(absl::StatusCode code, absl::string_view context, const absl::Status& error) {
  absl::Status out(code, absl::StrCat(context, ": ", error.message()));
  error.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

absl::Status NothingAnswered(absl::Status timed_out) {
  return WithWhatToDo(std::move(timed_out),
                      "Nothing answered in time: check that the host is up and reachable from "
                      "here (no firewall in the way), and that its server runs and is not too "
                      "busy to take connections.");
}

std::string FileLimitAdvice() {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  return absl::StrCat("this process may open ", limit.rlim_cur, " files: raise `ulimit -n`");
}

absl::Status WithFileLimitAdvice(absl::Status error, int err) {
  if (err != EMFILE) return error;
  return WithWhatToDo(std::move(error), absl::StrCat("T", FileLimitAdvice().substr(1), "."));
}

void FailedAttempts::Add(absl::string_view where, const absl::Status& error) {
  Attempt& attempt = attempts_.emplace_back();
  absl::string_view message = error.message();
  if (const auto advice = error.GetPayload(kWhatToDo)) {
    std::vector<std::string> pieces = absl::StrSplit(std::string(*advice), kBetweenPieces);
    absl::string_view before = message;
    if (absl::ConsumeSuffix(&before, absl::StrJoin(pieces, " ")) &&
        (absl::ConsumeSuffix(&before, ". ") || absl::ConsumeSuffix(&before, " "))) {
      message = before;
      attempt.advice = std::move(pieces);
    }
  }
  attempt.said = absl::StrCat(where, where.empty() ? "" : ": ", message);
  last_code_ = error.code();
  if (attempts_.size() == 1) {
    error.ForEachPayload(
        [&](absl::string_view url, const absl::Cord& p) { shared_.emplace(url, p); });
    shared_.erase(std::string(kWhatToDo));
  } else {
    for (auto it = shared_.begin(); it != shared_.end();) {
      it = error.GetPayload(it->first) ? std::next(it) : shared_.erase(it);
    }
  }
}

std::string FailedAttempts::Message() const { return std::string(Error().message()); }

absl::Status FailedAttempts::Error() const {
  const auto has = [](const std::vector<std::string>& pieces, const std::string& piece) {
    return std::find(pieces.begin(), pieces.end(), piece) != pieces.end();
  };
  std::vector<std::string> at_end;  // distinct, in the order first said
  for (const Attempt& attempt : attempts_) {
    for (const std::string& piece : attempt.advice) {
      if (has(at_end, piece)) continue;
      if (unshared_ == Unshared::kWithItsAttempt &&
          !std::all_of(attempts_.begin(), attempts_.end(),
                       [&](const Attempt& other) { return has(other.advice, piece); })) {
        continue;
      }
      at_end.push_back(piece);
    }
  }
  std::string said;
  for (size_t i = 0; i < attempts_.size(); ++i) {
    std::string one = attempts_[i].said;
    for (const std::string& piece : attempts_[i].advice) {
      if (!has(at_end, piece)) absl::StrAppend(&one, SentenceBreak(one), piece);
    }
    absl::StrAppend(&said, i == 0 ? "" : "; ", one);
  }
  absl::Status error(last_code_, said);
  for (const auto& [url, payload] : shared_) error.SetPayload(url, payload);
  for (const std::string& piece : at_end) error = WithWhatToDo(std::move(error), piece);
  return error;
}

}  // namespace rdmarpc::transport
