#include "transport/listen_on_each.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include <cstdio>
#include <memory>
#include <utility>

#include "absl/strings/cord.h"
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

// What one pass over a name's addresses bound, and why the others were not.
struct BindPass {
  std::vector<std::unique_ptr<Listener>> bound;
  FailedAttempts left_out;
  // An address after the first found the port that the first picked taken.
  bool picked_port_taken = false;
};

BindPass BindEach(const std::vector<SocketAddress>& addresses, ListenOne listen_one) {
  BindPass pass;
  for (SocketAddress a : addresses) {
    const bool asks_picked = !pass.bound.empty();
    if (asks_picked) a = WithPort(a.storage, pass.bound.front()->address().port);
    absl::StatusOr<std::unique_ptr<Listener>> one = listen_one(a);
    if (one.ok()) {
      pass.bound.push_back(std::move(*one));
      continue;
    }
    if (asks_picked && PortTaken(one.status())) pass.picked_port_taken = true;
    pass.left_out.Add(
        addresses.size() > 1 ? SockaddrString(reinterpret_cast<const sockaddr*>(&a.storage)) : "",
        one.status());
  }
  return pass;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Listener>> ListenOnEachAddress(
    const std::vector<SocketAddress>& addresses, const std::string& log_name,
    ListenOne listen_one) {
  const bool picks_port = addresses.size() > 1 && PortOf(addresses.front().storage) == 0;
  auto pass = std::make_unique<BindPass>(BindEach(addresses, listen_one));
  for (int tries = 1; picks_port && pass->picked_port_taken && tries < kFreshPortTries; ++tries) {
    // The pass before still holds the port it picked while this one binds,
    // so the port picked now is another.
    pass = std::make_unique<BindPass>(BindEach(addresses, listen_one));
  }
  if (pass->bound.empty()) return pass->left_out.Error();
  if (!pass->left_out.empty()) {
    fprintf(stderr, "rdmarpc[%s]: listening on %s, but not at %s\n", log_name.c_str(),
            pass->bound.front()->address().ToString().c_str(), pass->left_out.Message().c_str());
  }
  if (pass->bound.size() == 1) return std::move(pass->bound.front());
  return std::unique_ptr<Listener>(std::make_unique<ListenerGroup>(std::move(pass->bound)));
}

absl::Status BindError(int err) {
  absl::Status error = absl::UnavailableError(strerror(err));
  if (err == EADDRINUSE) {
    error.SetPayload(kPortTaken, absl::Cord());
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

bool PortTaken(const absl::Status& error) { return error.GetPayload(kPortTaken).has_value(); }

}  // namespace rdmarpc::transport
