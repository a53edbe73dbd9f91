#include "transport/listen_on_each.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include <cstdio>
#include <utility>

#include "transport/attempt_errors.h"

namespace rdmarpc::transport {
namespace {

class ListenerGroup : public Listener {
 public:
  explicit ListenerGroup(std::vector<std::unique_ptr<Listener>> each) : each_(std::move(each)) {}
  const Address& address() const override { return each_.front()->address(); }
  void SharePortWithRdma() override {
    for (auto& one : each_) one->SharePortWithRdma();
  }

 private:
  std::vector<std::unique_ptr<Listener>> each_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Listener>> ListenOnEachAddress(
    const std::vector<SocketAddress>& addresses, const std::string& log_name,
    ListenOne listen_one) {
  std::vector<std::unique_ptr<Listener>> bound;
  FailedAttempts left_out;
  for (SocketAddress a : addresses) {
    if (!bound.empty()) a = WithPort(a.storage, bound.front()->address().port);
    absl::StatusOr<std::unique_ptr<Listener>> one = listen_one(a);
    if (one.ok()) {
      bound.push_back(std::move(*one));
      continue;
    }
    left_out.Add(
        addresses.size() > 1 ? SockaddrString(reinterpret_cast<const sockaddr*>(&a.storage)) : "",
        one.status());
  }
  if (bound.empty()) return left_out.Error();
  if (!left_out.empty()) {
    fprintf(stderr, "rdmarpc[%s]: listening on %s, but not at %s\n", log_name.c_str(),
            bound.front()->address().ToString().c_str(), left_out.Message().c_str());
  }
  if (bound.size() == 1) return std::move(bound.front());
  return std::unique_ptr<Listener>(std::make_unique<ListenerGroup>(std::move(bound)));
}

absl::Status BindError(int err) {
  absl::Status error = absl::UnavailableError(strerror(err));
  if (err == EADDRINUSE) {
    return WithWhatToDo(std::move(error),
                        "Another server has this port there: stop it, or listen on another port "
                        "(port 0 picks a free one).");
  }
  if (err == EACCES) {
    return WithWhatToDo(std::move(error),
                        "A port below 1024 needs root or CAP_NET_BIND_SERVICE: listen on a "
                        "higher one.");
  }
  if (err == EADDRNOTAVAIL) {
    return WithWhatToDo(std::move(error),
                        "No interface of this host has that address (`ip -br addr` lists those "
                        "it has): listen on one of them, or on 0.0.0.0 or [::] for all.");
  }
  return error;
}

}  // namespace rdmarpc::transport
