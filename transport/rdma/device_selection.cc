#include "transport/rdma/device_selection.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>

#include <algorithm>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::rdma {
namespace {

const char* GidTypeName(uint32_t type) {
  switch (type) {
    case IBV_GID_TYPE_IB:
      return "IB";
    case IBV_GID_TYPE_ROCE_V1:
      return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2:
      return "RoCE v2";
    default:
      return "unknown type";
  }
}

bool IsIpv4Mapped(const ibv_gid& gid) {
  static constexpr uint8_t kPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(gid.raw, kPrefix, sizeof kPrefix) == 0;
}

struct DeviceListDeleter {
  void operator()(ibv_device** list) const { ibv_free_device_list(list); }
};
struct ContextCloser {
  void operator()(ibv_context* ctx) const { ibv_close_device(ctx); }
};
using OpenDevice = std::unique_ptr<ibv_context, ContextCloser>;

// Opens each device in turn and calls visit(name, context, attributes), with
// a null context for a device that does not open, until visit returns false.
// Returns how many devices there are, or -errno when there is no list.
template <typename Visit>
int ForEachDevice(Visit visit) {
  int n = 0;
  errno = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&n));
  if (list == nullptr) return errno ? -errno : 0;
  for (int i = 0; i < n; ++i) {
    OpenDevice ctx(ibv_open_device(list.get()[i]));
    ibv_device_attr attr{};
    if (ctx) ibv_query_device(ctx.get(), &attr);
    if (!visit(ibv_get_device_name(list.get()[i]), ctx.get(), attr)) break;
  }
  return n;
}

OpenDevice OpenByName(const std::string& name) {
  int n = 0;
  std::unique_ptr<ibv_device*, DeviceListDeleter> list(ibv_get_device_list(&n));
  for (int i = 0; list && i < n; ++i) {
    if (name == ibv_get_device_name(list.get()[i])) return OpenDevice(ibv_open_device(list.get()[i]));
  }
  return nullptr;
}

// The IP address a RoCE GID holds, with `port`.
sockaddr_storage GidAddress(const ibv_gid_entry& e, uint16_t port) {
  sockaddr_storage ss{};
  if (IsIpv4Mapped(e.gid)) {
    auto* in = reinterpret_cast<sockaddr_in*>(&ss);
    in->sin_family = AF_INET;
    in->sin_port = htons(port);
    memcpy(&in->sin_addr, e.gid.raw + 12, 4);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&ss);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(port);
    memcpy(&in6->sin6_addr, e.gid.raw, 16);
    if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) in6->sin6_scope_id = e.ndev_ifindex;
  }
  return ss;
}

// What the user named, for messages.
std::string Named(const RdmaOptions& o) {
  return absl::StrCat("device ", o.device, " port ", std::max<uint32_t>(o.device_port, 1),
                      " gid_index ", o.gid_index);
}

}  // namespace

std::string GidToString(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN];
  inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
  return buf;
}

std::string DescribeDevices() {
  std::string out;
  const int n = ForEachDevice([&](const char* name, ibv_context* ctx, const ibv_device_attr& attr) {
    absl::StrAppend(&out, out.empty() ? "" : "; ", name);
    for (int p = 1; ctx && p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) != 0) continue;
      absl::StrAppend(&out, " port ", p, " ", ibv_port_state_str(pa.state), " mtu ",
                      128 << pa.active_mtu);
      for (int g = 0; g < std::min(pa.gid_tbl_len, 8); ++g) {
        ibv_gid_entry e{};
        if (ibv_query_gid_ex(ctx, p, g, &e, 0) == 0) {
          absl::StrAppend(&out, " gid[", g, "]=", GidToString(e.gid), " ",
                          GidTypeName(e.gid_type));
        }
      }
    }
    return true;
  });
  if (n <= 0) {
    return absl::StrCat("no RDMA devices (ibv_get_device_list: ", n < 0 ? strerror(-n) : "empty",
                        ")");
  }
  return out;
}

bool RdmaUsable() {
  bool usable = false;
  ForEachDevice([&](const char*, ibv_context* ctx, const ibv_device_attr& attr) {
    for (int p = 1; ctx && p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) usable = true;
    }
    return !usable;
  });
  return usable;
}

absl::StatusOr<std::optional<sockaddr_storage>> NamedGidAddress(const RdmaOptions& o,
                                                                uint16_t port) {
  if (o.gid_index < 0) return std::nullopt;
  if (o.device.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RdmaOptions::gid_index (RDMARPC_RDMA_GID_INDEX) ", o.gid_index,
        " names an entry of one device's port: set device (RDMARPC_RDMA_DEVICE) too. Devices: ",
        DescribeDevices()));
  }
  const uint32_t device_port = std::max<uint32_t>(o.device_port, 1);
  OpenDevice ctx = OpenByName(o.device);
  if (!ctx) {
    return absl::InvalidArgumentError(absl::StrCat("no RDMA device ", o.device,
                                                   " can be opened. Devices: ", DescribeDevices()));
  }
  ibv_port_attr pa{};
  if (ibv_query_port(ctx.get(), static_cast<uint8_t>(device_port), &pa) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(o.device, " has no port ", device_port,
                                                   ". Devices: ", DescribeDevices()));
  }
  ibv_gid_entry e{};
  if (o.gid_index >= pa.gid_tbl_len ||
      ibv_query_gid_ex(ctx.get(), device_port, static_cast<uint32_t>(o.gid_index), &e, 0) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        Named(o), ": no such GID (the table has ", pa.gid_tbl_len,
        " entries; empty ones are unused). Devices: ", DescribeDevices(),
        ". Try `ibv_devinfo -v` or `rdma link` for the GIDs in use."));
  }
  if (pa.link_layer != IBV_LINK_LAYER_ETHERNET) return std::nullopt;
  return GidAddress(e, port);
}

namespace {

// The IP addresses of this host's active RoCE ports, of both families, with
// `port`: as ThisHostRdmaAddresses gives them, before it picks a family.
std::vector<SocketAddress> RoceAddresses(uint16_t port) {
  std::vector<sockaddr_storage> found;
  std::vector<sockaddr_storage> link_local;
  ForEachDevice([&](const char*, ibv_context* ctx, const ibv_device_attr& attr) {
    for (int p = 1; ctx && p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) != 0 || pa.state != IBV_PORT_ACTIVE ||
          pa.link_layer != IBV_LINK_LAYER_ETHERNET) {
        continue;
      }
      for (int g = 0; g < pa.gid_tbl_len; ++g) {
        // Each address is in the table once per RoCE version; an empty
        // entry does not query.
        ibv_gid_entry e{};
        if (ibv_query_gid_ex(ctx, p, g, &e, 0) != 0) continue;
        const sockaddr_storage ss = GidAddress(e, port);
        std::vector<sockaddr_storage>& into =
            IsLinkLocal(reinterpret_cast<const sockaddr*>(&ss)) ? link_local : found;
        const bool seen = std::any_of(into.begin(), into.end(), [&](const sockaddr_storage& b) {
          return memcmp(&b, &ss, sizeof ss) == 0;
        });
        if (!seen) into.push_back(ss);
      }
    }
    return true;
  });
  std::vector<SocketAddress> addresses;
  for (const auto* each : {&found, &link_local}) {
    for (const sockaddr_storage& ss : *each) addresses.push_back(WithPort(ss, port));
  }
  return addresses;
}

// Those of `all` of `family`, in their order, appended to `out`.
void AppendOfFamily(const std::vector<SocketAddress>& all, int family,
                    std::vector<SocketAddress>* out) {
  std::copy_if(all.begin(), all.end(), std::back_inserter(*out),
               [&](const SocketAddress& a) { return a.storage.ss_family == family; });
}

}  // namespace

std::vector<SocketAddress> ThisHostRdmaAddresses(int family, uint16_t port) {
  std::vector<SocketAddress> of_family;
  AppendOfFamily(RoceAddresses(port), family, &of_family);
  return of_family;
}

std::vector<SocketAddress> ThisHostForUnspecified(const std::vector<SocketAddress>& addresses,
                                                  const std::optional<sockaddr_storage>& named,
                                                  uint16_t port) {
  std::vector<SocketAddress> out;
  for (const SocketAddress& a : addresses) {
    const int family = a.storage.ss_family;
    if (!IsUnspecified(reinterpret_cast<const sockaddr*>(&a.storage))) {
      out.push_back(a);
      continue;
    }
    std::vector<SocketAddress> here;
    if (named.has_value()) {
      if (named->ss_family == family || family == AF_INET6) here.push_back(WithPort(*named, port));
    } else {
      const std::vector<SocketAddress> all = RoceAddresses(port);
      AppendOfFamily(all, family, &here);
      if (family == AF_INET6) AppendOfFamily(all, AF_INET, &here);
    }
    if (here.empty()) here.push_back(a);
    out.insert(out.end(), here.begin(), here.end());
  }
  return out;
}

namespace {

// The global route of id's QP, once it has one: only from RTR on, since
// before rdma_connect a QP's vector is unset (rxe then reports a global one
// with index 0).
std::optional<ibv_global_route> ConnectedRoute(rdma_cm_id* id) {
  if (id->qp == nullptr) return std::nullopt;
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(id->qp, &attr, IBV_QP_AV | IBV_QP_STATE, &init) == 0 &&
      attr.qp_state != IBV_QPS_RESET && attr.qp_state != IBV_QPS_INIT && attr.ah_attr.is_global) {
    return attr.ah_attr.grh;
  }
  return std::nullopt;
}

}  // namespace

int TrafficClass(rdma_cm_id* id) {
  const std::optional<ibv_global_route> grh = ConnectedRoute(id);
  return grh ? grh->traffic_class : -1;
}

int ChosenGidIndex(rdma_cm_id* id) {
  // The QP's address vector holds the index rdma_cm used: a table search by
  // value could find a RoCE v1 entry that has the same GID as the v2 one.
  if (const std::optional<ibv_global_route> grh = ConnectedRoute(id)) return grh->sgid_index;
  // Before a connection, only the route's GID value is known. Where a RoCE
  // v1 and a v2 entry share it, rdma_cm takes the port's default RoCE mode,
  // v2 unless changed in configfs (see CheckGidIndex).
  ibv_port_attr pa{};
  if (ibv_query_port(id->verbs, id->port_num, &pa) != 0) return -1;
  int first = -1;
  for (int i = 0; i < pa.gid_tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(id->verbs, id->port_num, i, &e, 0) != 0 ||
        memcmp(&e.gid, &id->route.addr.addr.ibaddr.sgid, sizeof e.gid) != 0) {
      continue;
    }
    if (e.gid_type == IBV_GID_TYPE_ROCE_V2) return i;
    if (first < 0) first = i;
  }
  return first;
}

std::string DescribeLocalEnd(rdma_cm_id* id) {
  const int index = ChosenGidIndex(id);
  std::string gid = GidToString(id->route.addr.addr.ibaddr.sgid);
  ibv_gid_entry e{};
  if (index >= 0 && ibv_query_gid_ex(id->verbs, id->port_num, index, &e, 0) == 0) {
    gid = absl::StrCat(GidToString(e.gid), ", ", GidTypeName(e.gid_type));
  }
  return absl::StrCat("device ", ibv_get_device_name(id->verbs->device), " port ", id->port_num,
                      " gid_index ", index, " (", gid, ")");
}

std::string DescribeChoice(rdma_cm_id* id) {
  ibv_port_attr pa{};
  ibv_query_port(id->verbs, id->port_num, &pa);
  const int traffic_class = TrafficClass(id);
  return absl::StrCat(DescribeLocalEnd(id), " active_mtu ", 128 << pa.active_mtu,
                      traffic_class > 0 ? absl::StrCat(" type_of_service ", traffic_class) : "");
}

absl::StatusOr<Route> ResolveRoute(const sockaddr* to, const RdmaOptions& o) {
  const std::string target = SockaddrString(to);
  auto src = NamedGidAddress(o, 0);
  if (!src.ok()) return src.status();
  struct Cm {
    rdma_event_channel* channel = rdma_create_event_channel();
    rdma_cm_id* id = nullptr;
    ~Cm() {
      if (id != nullptr) rdma_destroy_id(id);
      if (channel != nullptr) rdma_destroy_event_channel(channel);
    }
  } cm;
  const auto fail = [&](const std::string& what) {
    const int err = errno;  // before DescribeDevices() may change it
    return absl::UnavailableError(
        absl::StrCat(what, " for ", target, ": ", strerror(err), ". Devices: ", DescribeDevices()));
  };
  if (cm.channel == nullptr) return fail("rdma_create_event_channel");
  if (rdma_create_id(cm.channel, &cm.id, nullptr, RDMA_PS_TCP) != 0) return fail("rdma_create_id");
  // Each step ends in an event, success or not, within its timeout.
  const auto step = [&](int rc, const char* what, rdma_cm_event_type want) -> absl::Status {
    if (rc != 0) {
      const int err = errno;
      return absl::UnavailableError(
          absl::StrCat(what, " for ", target, ": ", strerror(err),
                       ": no RDMA device reaches it (no interface with one routes there). "
                       "Devices: ",
                       DescribeDevices()));
    }
    rdma_cm_event* ev = nullptr;
    // A blocking read, which a signal without SA_RESTART interrupts.
    int got_event;
    while ((got_event = rdma_get_cm_event(cm.channel, &ev)) != 0 && errno == EINTR) {
    }
    if (got_event != 0) return fail("rdma_get_cm_event");
    const rdma_cm_event_type got = ev->event;
    const int status = ev->status;
    rdma_ack_cm_event(ev);
    if (got == want) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        what, " for ", target, ": ", rdma_event_str(got), " (status ", status,
        "): no RDMA device reaches it. Devices: ", DescribeDevices()));
  };
  constexpr int kTimeoutMs = 2000;
  sockaddr* from = src->has_value() ? reinterpret_cast<sockaddr*>(&**src) : nullptr;
  if (absl::Status s = step(rdma_resolve_addr(cm.id, from, const_cast<sockaddr*>(to), kTimeoutMs),
                            "rdma_resolve_addr", RDMA_CM_EVENT_ADDR_RESOLVED);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = step(rdma_resolve_route(cm.id, kTimeoutMs), "rdma_resolve_route",
                            RDMA_CM_EVENT_ROUTE_RESOLVED);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckDeviceAndPort(cm.id, o); !s.ok()) return s;
  if (absl::Status s = CheckGidIndex(cm.id, o); !s.ok()) return s;
  Route route;
  route.device = ibv_get_device_name(cm.id->verbs->device);
  route.port = cm.id->port_num;
  route.gid_index = ChosenGidIndex(cm.id);
  route.text =
      absl::StrCat(DescribeChoice(cm.id), " from ", SockaddrString(rdma_get_local_addr(cm.id)));
  return route;
}

absl::Status CheckDeviceAndPort(rdma_cm_id* id, const RdmaOptions& o) {
  const std::string local = SockaddrString(rdma_get_local_addr(id));
  if (id->verbs == nullptr) {
    return absl::UnavailableError(absl::StrCat("rdma_cm found no RDMA device for ", local));
  }
  const std::string device = ibv_get_device_name(id->verbs->device);
  if (!o.device.empty() && o.device != device) {
    return absl::UnavailableError(absl::StrCat(
        "rdma_cm chose device ", device, " for ", local,
        " but RdmaOptions::device (RDMARPC_RDMA_DEVICE) asks for ", o.device,
        ". Use an address on ", o.device, "'s interface."));
  }
  if (o.device_port != 0 && o.device_port != id->port_num) {
    return absl::UnavailableError(absl::StrCat(
        "rdma_cm chose ", device, " port ", id->port_num, " for ", local,
        " but RdmaOptions::device_port (RDMARPC_RDMA_PORT) asks for port ", o.device_port,
        ". Use an address on that port's interface."));
  }
  return absl::OkStatus();
}

absl::Status CheckGidIndex(rdma_cm_id* id, const RdmaOptions& o) {
  if (o.gid_index < 0 || ChosenGidIndex(id) == o.gid_index) return absl::OkStatus();
  const std::string device = ibv_get_device_name(id->verbs->device);
  return absl::UnavailableError(absl::StrCat(
      "rdma_cm chose ", DescribeChoice(id), " for ", SockaddrString(rdma_get_local_addr(id)),
      " but RdmaOptions asks for ", Named(o),
      ". Where two entries carry the same address (RoCE v1 and v2), rdma_cm takes the port's "
      "default RoCE mode: /sys/kernel/config/rdma_cm/", device, "/ports/", id->port_num,
      "/default_roce_mode."));
}

}  // namespace rdmarpc::transport::rdma
