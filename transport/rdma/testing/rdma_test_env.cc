#include "transport/rdma/testing/rdma_test_env.h"

#include <errno.h>
#include <infiniband/verbs.h>
#include <string.h>

#include <cstdlib>

#include "gtest/gtest.h"

namespace rdmarpc::rdma::testing {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

std::string RequireRdmaTestAddress() {
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  const int err = errno;
  if (list) ibv_free_device_list(list);
  if (n == 0) {
    ADD_FAILURE() << "no RDMA device (ibv_get_device_list: "
                  << (err ? strerror(err) : "empty list")
                  << "). This test needs real verbs: run `make test`, which runs "
                     "RDMA tests on this machine's device or in a Soft-RoCE VM "
                     "(tools/vm/run.sh).";
    return "";
  }
  std::string addr = Env("RDMARPC_TEST_ADDR");
  if (addr.empty()) {
    ADD_FAILURE() << n << " RDMA device(s) found but RDMARPC_TEST_ADDR is not set: "
                  << "set it to the IPv4 address of an interface with an active "
                     "RDMA port (see `rdma link`), or run under tools/vm/run.sh.";
  }
  return addr;
}

std::string RequireRdmaTestAddress6() {
  std::string addr = Env("RDMARPC_TEST_ADDR6");
  if (addr.empty()) {
    ADD_FAILURE() << "RDMARPC_TEST_ADDR6 is not set: set it to a global IPv6 address of the "
                     "interface with the active RDMA port (`ip -6 addr`; Soft-RoCE gives each "
                     "of them a RoCE v2 GID), or run under tools/vm/run.sh, whose VM has one.";
  }
  return addr;
}

std::string SilentTestNetworkHost() {
  const std::string ip = RequireRdmaTestAddress();
  const size_t dot = ip.rfind('.');
  if (dot == std::string::npos) return "";
  return ip.substr(0, dot + 1) + (ip.substr(dot + 1) == "254" ? "253" : "254");
}

std::string PeerAddress() { return Env("RDMARPC_PEER_ADDR"); }

std::string PeerAddress6() { return Env("RDMARPC_PEER_ADDR6"); }

std::string Role() { return Env("RDMARPC_VM_ROLE"); }

}  // namespace rdmarpc::rdma::testing
