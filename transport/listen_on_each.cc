#include "transport/listen_on_each.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

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

void SetPort(SocketAddress* a, uint16_t port) {
  if (a->storage.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&a->storage)->sin_port = htons(port);
  } else {
    reinterpret_cast<sockaddr_in6*>(&a->storage)->sin6_port = htons(port);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Listener>> ListenOnEachAddress(
    const std::vector<SocketAddress>& addresses, const std::string& log_name,
    ListenOne listen_one) {
  std::vector<std::unique_ptr<Listener>> bound;
  std::string left_out;
  absl::Status last;
  for (SocketAddress a : addresses) {
    if (!bound.empty()) SetPort(&a, bound.front()->address().port);
    absl::StatusOr<std::unique_ptr<Listener>> one = listen_one(a);
    if (one.ok()) {
      bound.push_back(std::move(*one));
      continue;
    }
    last = one.status();
    AppendAttempt(&left_out, a, addresses.size() > 1, last.message());
  }
  if (bound.empty()) return absl::Status(last.code(), left_out);
  if (!left_out.empty()) {
    fprintf(stderr, "rdmarpc[%s]: listening on %s, but not at %s\n", log_name.c_str(),
            bound.front()->address().ToString().c_str(), left_out.c_str());
  }
  if (bound.size() == 1) return std::move(bound.front());
  return std::unique_ptr<Listener>(std::make_unique<ListenerGroup>(std::move(bound)));
}

absl::Status BindError(int err) {
  const char* what_to_do = "";
  if (err == EADDRINUSE) {
    what_to_do =
        " (another server has this port there: stop it, or listen on another port; port "
        "0 picks a free one)";
  } else if (err == EACCES) {
    what_to_do = " (a port below 1024 needs root or CAP_NET_BIND_SERVICE: listen on a higher one)";
  }
  return absl::UnavailableError(absl::StrCat(strerror(err), what_to_do));
}

}  // namespace rdmarpc::transport
