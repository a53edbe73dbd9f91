// The runtime suite over TCP on loopback, IPv4 and IPv6.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "tests/rpc_suite.h"

namespace rdmarpc::testing {
namespace {

// A listener with backlog 0 whose accept queue one connection fills: the
// kernel then drops every SYN to it, so a connect waits for a handshake
// that never comes.
StalledAddress StalledTcp(int family) {
  sockaddr_storage ss{};
  socklen_t len;
  if (family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    len = sizeof *in;
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_loopback;
    len = sizeof *in6;
  }
  const int listener = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int filler = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const auto close_both = [listener, filler](void*) {
    close(listener);
    close(filler);
  };
  std::shared_ptr<void> keep(nullptr, close_both);
  if (bind(listener, reinterpret_cast<sockaddr*>(&ss), len) != 0 || listen(listener, 0) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
      connect(filler, reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    ADD_FAILURE() << "cannot set up a stalled listener: " << strerror(errno);
    return {};
  }
  const int port = ntohs(family == AF_INET ? reinterpret_cast<sockaddr_in*>(&ss)->sin_port
                                           : reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return {absl::StrCat(family == AF_INET ? "tcp://127.0.0.1:" : "tcp://[::1]:", port), keep};
}

INSTANTIATE_TEST_SUITE_P(
    Tcp, RpcSuite,
    ::testing::Values(SuiteParam{"tcp", [] { return std::string("tcp://127.0.0.1:0"); },
                                 [] { return StalledTcp(AF_INET); }},
                      SuiteParam{"tcp6", [] { return std::string("tcp://[::1]:0"); },
                                 [] { return StalledTcp(AF_INET6); }}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace rdmarpc::testing
