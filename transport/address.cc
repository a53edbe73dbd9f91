#include "transport/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <string.h>

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "transport/attempt_errors.h"

namespace rdmarpc::transport {

std::string Address::ToString() const {
  const bool v6 = host.find(':') != std::string::npos;
  return absl::StrCat(scheme, "://", v6 ? "[" : "", host, v6 ? "]" : "", ":", port);
}

absl::StatusOr<Address> ParseAddress(absl::string_view text) {
  const auto fail = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad address '", text, "': ", why, " (expected tcp://host:port, rdma://host:port or "
        "auto://host:port)"));
  };
  Address a;
  const size_t sep = text.find("://");
  if (sep == absl::string_view::npos) return fail("no scheme");
  a.scheme = std::string(text.substr(0, sep));
  if (a.scheme != "tcp" && a.scheme != "rdma" && a.scheme != "auto") return fail("unknown scheme");
  absl::string_view rest = text.substr(sep + 3);
  absl::string_view port;
  if (!rest.empty() && rest[0] == '[') {
    const size_t close = rest.find(']');
    if (close == absl::string_view::npos || close + 1 >= rest.size() || rest[close + 1] != ':')
      return fail("unterminated [ipv6]:port");
    a.host = std::string(rest.substr(1, close - 1));
    port = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == absl::string_view::npos) return fail("no port");
    a.host = std::string(rest.substr(0, colon));
    port = rest.substr(colon + 1);
  }
  uint32_t p = 0;
  if (a.host.empty()) return fail("no host");
  if (!absl::SimpleAtoi(port, &p) || p > 65535) return fail("bad port");
  a.port = static_cast<uint16_t>(p);
  return a;
}

namespace {

// The interface of this host that has the IPv6 address `host`, if one has.
std::optional<std::string> InterfaceWithAddress(const std::string& host) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return std::nullopt;
  std::optional<std::string> name;
  for (const ifaddrs* i = all; i != nullptr && !name; i = i->ifa_next) {
    if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET6 &&
        SockaddrHost(i->ifa_addr) == host) {
      name = i->ifa_name;
    }
  }
  freeifaddrs(all);
  return name;
}

}  // namespace

absl::StatusOr<std::vector<SocketAddress>> ResolveAddresses(const Address& addr) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(addr.port);
  const int rc = getaddrinfo(addr.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return WithWhatToDo(
        absl::UnavailableError(
            absl::StrCat("cannot resolve ", addr.ToString(), ": ", gai_strerror(rc))),
        absl::StrCat("Check the name: `getent ahosts ", addr.host,
                     "` shows what it resolves to on this host; or use an IP address."));
  }
  std::vector<SocketAddress> out;
  std::string unscoped;  // a link-local address left out, for the error
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    if (ai->ai_addrlen > sizeof(sockaddr_storage)) continue;
    SocketAddress a{};
    memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.len = ai->ai_addrlen;
    // An IPv6 link-local address is one only on its interface: without it
    // (a scope), bind(2) and connect(2) refuse it with a bare EINVAL.
    const auto* sa = reinterpret_cast<const sockaddr*>(&a.storage);
    if (IsLinkLocal(sa) && reinterpret_cast<const sockaddr_in6*>(sa)->sin6_scope_id == 0) {
      unscoped = SockaddrHost(sa);
      continue;
    }
    // A name listed twice in /etc/hosts comes back twice.
    const bool seen = std::any_of(out.begin(), out.end(), [&](const SocketAddress& b) {
      return b.len == a.len && memcmp(&b.storage, &a.storage, a.len) == 0;
    });
    if (!seen) out.push_back(a);
  }
  freeaddrinfo(res);
  if (out.empty() && !unscoped.empty()) {
    Address scoped = addr;
    scoped.host = absl::StrCat(unscoped, "%", InterfaceWithAddress(unscoped).value_or("eth0"));
    return WithWhatToDo(absl::InvalidArgumentError(absl::StrCat(
                            addr.ToString(), ": ", unscoped,
                            " is a link-local address, which is an address only on its interface")),
                        absl::StrCat("Name the interface, as in ", scoped.ToString(),
                                     " (`ip -6 addr show scope link` lists each interface's)."));
  }
  if (out.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", addr.ToString(), ": no address of a stream socket"));
  }
  return out;
}

std::string SockaddrHost(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, host, sizeof host);
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, host, sizeof host);
  }
  return host;
}

std::string SockaddrString(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return absl::StrCat(SockaddrHost(sa), ":",
                        ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port));
  }
  return absl::StrCat("[", SockaddrHost(sa),
                      "]:", ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port));
}

bool IsUnspecified(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(sa)->sin_addr.s_addr == htonl(INADDR_ANY);
  }
  return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

bool IsLinkLocal(const sockaddr* sa) {
  return sa->sa_family == AF_INET6 &&
         IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
}

SocketAddress WithPort(const sockaddr_storage& ss, uint16_t port) {
  SocketAddress a{};
  a.storage = ss;
  if (ss.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port = htons(port);
    a.len = sizeof(sockaddr_in);
  } else {
    reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port = htons(port);
    a.len = sizeof(sockaddr_in6);
  }
  return a;
}

uint16_t PortOf(const sockaddr_storage& ss) {
  return ntohs(ss.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in*>(&ss)->sin_port
                                       : reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
}

}  // namespace rdmarpc::transport
