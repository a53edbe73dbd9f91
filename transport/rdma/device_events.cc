#include "transport/rdma/device_events.h"

#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/new_thread.h"
#include "base/steady_clock.h"
#include "transport/attempt_errors.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/endpoint.h"
#include "transport/rdma/fault_injection.h"

namespace rdmarpc::transport::rdma {
namespace {

// How long after a port came back its going down is still worth naming in
// a connection's error: a connection that fails then most likely failed
// because of it.
constexpr absl::Duration kPortHistory = absl::Minutes(1);

struct PortHistory {
  absl::Time down_at = absl::InfinitePast();
  absl::Time up_at = absl::InfinitePast();
};

struct Device {
  std::string name;
  std::vector<Endpoint*> endpoints;
  std::map<uint8_t, PortHistory> ports;
};

// The reader runs only while some endpoint is watched, and polls only the
// contexts of watched endpoints: librdmacm closes its contexts when the
// process exits, and a removed device's once no one holds it (DeviceHold),
// and a reader left polling one then would touch freed memory.
struct State {
  std::mutex lifecycle_mu;  // held by Watch and Unwatch, across starting or joining the reader
  std::thread reader;       // lifecycle_mu
  std::mutex mu;
  std::map<ibv_context*, Device> devices;  // mu; a context while it has endpoints
  size_t watched = 0;                      // mu; endpoints in all devices
  bool stop = false;                       // mu
  // The reader's wake-up, made when it starts and closed when it stops for
  // good: a reader that could not be woken could not be stopped, and Unwatch
  // would wait for it for ever. lifecycle_mu; the reader only reads it.
  int wake_fd = -1;
};

// Never destroyed, so never destroyed under a thread that still uses it.
State& S() {
  static State* s = new State;
  return *s;
}

void Wake(State& s) {
  const uint64_t one = 1;
  (void)!write(s.wake_fd, &one, sizeof one);
}

// Undoes Watch's taking of `ep`, for which no reader could be started.
// Holds lifecycle_mu.
void Forget(State& s, Endpoint* ep) {
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.devices.find(ep->verbs());
  auto& eps = it->second.endpoints;
  eps.erase(std::remove(eps.begin(), eps.end(), ep), eps.end());
  if (eps.empty()) s.devices.erase(it);
  if (--s.watched > 0) return;
  close(s.wake_fd);
  s.wake_fd = -1;
}

void ReadEvents() {
  State& s = S();
  std::vector<pollfd> fds;
  std::vector<ibv_context*> contexts;
  for (;;) {
    fds.assign(1, pollfd{s.wake_fd, POLLIN, 0});
    contexts.clear();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.stop) return;
      for (const auto& [verbs, device] : s.devices) {
        fds.push_back(pollfd{verbs->async_fd, POLLIN, 0});
        contexts.push_back(verbs);
      }
    }
    if (poll(fds.data(), fds.size(), -1) < 0) continue;
    if (fds[0].revents & POLLIN) {
      uint64_t n;
      (void)!read(s.wake_fd, &n, sizeof n);
    }
    for (size_t i = 0; i < contexts.size(); ++i) {
      if (!(fds[i + 1].revents & POLLIN)) continue;
      ibv_async_event event;
      while (ibv_get_async_event(contexts[i], &event) == 0) {
        DeviceEvents::Handle(contexts[i], event);
        ibv_ack_async_event(&event);
      }
    }
  }
}

const char* EventName(ibv_event_type type) {
  switch (type) {
    case IBV_EVENT_CQ_ERR:
      return "IBV_EVENT_CQ_ERR";
    case IBV_EVENT_QP_FATAL:
      return "IBV_EVENT_QP_FATAL";
    case IBV_EVENT_QP_REQ_ERR:
      return "IBV_EVENT_QP_REQ_ERR";
    case IBV_EVENT_QP_ACCESS_ERR:
      return "IBV_EVENT_QP_ACCESS_ERR";
    case IBV_EVENT_PATH_MIG_ERR:
      return "IBV_EVENT_PATH_MIG_ERR";
    case IBV_EVENT_DEVICE_FATAL:
      return "IBV_EVENT_DEVICE_FATAL";
    case IBV_EVENT_PORT_ACTIVE:
      return "IBV_EVENT_PORT_ACTIVE";
    case IBV_EVENT_PORT_ERR:
      return "IBV_EVENT_PORT_ERR";
    case IBV_EVENT_LID_CHANGE:
      return "IBV_EVENT_LID_CHANGE";
    case IBV_EVENT_PKEY_CHANGE:
      return "IBV_EVENT_PKEY_CHANGE";
    case IBV_EVENT_SM_CHANGE:
      return "IBV_EVENT_SM_CHANGE";
    case IBV_EVENT_SRQ_ERR:
      return "IBV_EVENT_SRQ_ERR";
    case IBV_EVENT_CLIENT_REREGISTER:
      return "IBV_EVENT_CLIENT_REREGISTER";
    case IBV_EVENT_GID_CHANGE:
      return "IBV_EVENT_GID_CHANGE";
    default:
      return "an event";
  }
}

// What a queue-pair error means, for the text of the connection it ends.
const char* QueuePairCause(ibv_event_type type) {
  switch (type) {
    case IBV_EVENT_QP_FATAL:
      return "the device failed this queue pair (a catastrophic error in it)";
    case IBV_EVENT_QP_REQ_ERR:
      return "the peer sent a request this side could not take (a bad opcode or sequence: a bug "
             "or a version mismatch at the peer)";
    case IBV_EVENT_QP_ACCESS_ERR:
      return "the peer READ or wrote memory this side never advertised or had revoked, or used a "
             "bad rkey";
    default:
      return "path migration failed";
  }
}

const char* PortState(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_DOWN:
      return "down";
    case IBV_PORT_INIT:
      return "initializing";
    case IBV_PORT_ARMED:
      return "armed, not yet active";
    default:
      return ibv_port_state_str(state);
  }
}

// What to look at when a port of `device` is down.
std::string CheckLink(const std::string& device) {
  return absl::StrCat("check its link (`ibv_devinfo -d ", device,
                      "`, and `ip link` or the cable of its network device)");
}

}  // namespace

absl::Status DeviceEvents::Watch(Endpoint* ep) {
  State& s = S();
  std::lock_guard<std::mutex> lifecycle(s.lifecycle_mu);
  if (s.wake_fd < 0) {
    s.wake_fd = NewWakeFd(FaultInjection::WakeFdOf::kDeviceEvents);
    if (s.wake_fd < 0) {
      const int err = errno;
      return WithFileLimitAdvice(
          absl::UnavailableError(absl::StrCat("eventfd for the reader of ", ep->device_name(),
                                              "'s events: ", strerror(err))),
          err);
    }
  }
  ibv_context* verbs = ep->verbs();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto [it, added] = s.devices.try_emplace(verbs);
    if (added) {
      // Non-blocking, so that the reader drains every event of a wake-up and
      // then polls again.
      fcntl(verbs->async_fd, F_SETFL, fcntl(verbs->async_fd, F_GETFL) | O_NONBLOCK);
      it->second.name = ep->device_name();
    }
    it->second.endpoints.push_back(ep);
    ++s.watched;
  }
  if (s.reader.joinable()) {
    Wake(s);  // to poll a new context too
    return absl::OkStatus();
  }
  auto reader = NewThread("rdma-dev-events", "the reader of RDMA device events", ReadEvents);
  if (!reader.ok()) {
    Forget(s, ep);
    return reader.status();
  }
  s.reader = *std::move(reader);
  return absl::OkStatus();
}

void DeviceEvents::Unwatch(Endpoint* ep) {
  State& s = S();
  std::lock_guard<std::mutex> lifecycle(s.lifecycle_mu);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.devices.find(ep->verbs());
    if (it == s.devices.end()) return;
    auto& eps = it->second.endpoints;
    auto gone = std::remove(eps.begin(), eps.end(), ep);
    if (gone == eps.end()) return;
    eps.erase(gone, eps.end());
    --s.watched;
    if (!eps.empty()) return;
    // The context may be closed once this returns, and the reader may be
    // reading it right now: it stops before the context is forgotten (were
    // it forgotten first, an event the reader was handling would bring it
    // back), and starts again for the others.
    s.stop = true;
  }
  Wake(s);
  s.reader.join();
  std::lock_guard<std::mutex> lock(s.mu);
  s.devices.erase(ep->verbs());
  s.stop = false;
  if (s.watched > 0) {
    auto reader = NewThread("rdma-dev-events", "the reader of RDMA device events", ReadEvents);
    if (reader.ok()) {
      s.reader = *std::move(reader);
    } else {
      // The next endpoint made (Watch) tries again.
      fprintf(stderr,
              "rdmarpc: %s; the events of the devices still in use are not read until a new "
              "RDMA endpoint is made\n",
              std::string(reader.status().message()).c_str());
    }
  } else {
    close(s.wake_fd);
    s.wake_fd = -1;
  }
}

std::string DeviceEvents::PortNote(ibv_context* verbs, uint8_t port) {
  ibv_port_attr attr{};
  const bool known = ibv_query_port(verbs, port, &attr) == 0;
  const std::string name = ibv_get_device_name(verbs->device);
  PortHistory history;
  {
    State& s = S();
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.devices.find(verbs);
    if (it != s.devices.end()) {
      auto p = it->second.ports.find(port);
      if (p != it->second.ports.end()) history = p->second;
    }
  }
  const absl::Time now = SteadyNow();
  auto ago = [&](absl::Time t) {
    return absl::FormatDuration(absl::Trunc(now - t, absl::Milliseconds(1)));
  };
  const std::string check = absl::StrCat(": ", CheckLink(name));
  if (known && attr.state != IBV_PORT_ACTIVE) {
    return absl::StrCat("; ", name, " port ", port, " is ", PortState(attr.state),
                        history.down_at > history.up_at
                            ? absl::StrCat(", down since ", ago(history.down_at), " ago")
                            : "",
                        check);
  }
  if (history.down_at != absl::InfinitePast() && now - history.down_at < kPortHistory) {
    return absl::StrCat("; ", name, " port ", port, " went down ", ago(history.down_at),
                        " ago and is active again", check);
  }
  return "";
}

void DeviceEvents::Handle(ibv_context* verbs, const ibv_async_event& event) {
  State& s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  Device& device = s.devices[verbs];
  if (device.name.empty()) device.name = ibv_get_device_name(verbs->device);
  const ibv_event_type type = event.event_type;
  const char* name = EventName(type);
  switch (type) {
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_GID_CHANGE:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER: {
      const uint8_t port = static_cast<uint8_t>(event.element.port_num);
      std::string what;
      if (type == IBV_EVENT_PORT_ERR) {
        device.ports[port].down_at = SteadyNow();
        what = absl::StrCat(
            " is down: calls over it fail, and new connections cannot be made until it is back; ",
            CheckLink(device.name));
      } else if (type == IBV_EVENT_PORT_ACTIVE) {
        device.ports[port].up_at = SteadyNow();
        what = " is active";
      } else if (type == IBV_EVENT_GID_CHANGE) {
        what =
            ": its GID table changed (an address of its network device came or went); "
            "connections keep the GID they were made with";
      } else {
        what = ": its subnet settings changed";
      }
      fprintf(stderr, "rdmarpc: %s port %u%s (%s)\n", device.name.c_str(), port, what.c_str(),
              name);
      break;
    }
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_PATH_MIG_ERR: {
      const ibv_qp* qp = event.element.qp;
      for (Endpoint* ep : device.endpoints) {
        if (ep->pd() != qp->pd) continue;
        ep->FailQueuePair(
            qp->qp_num, absl::StrCat(device.name, " reported ", name, ": ", QueuePairCause(type)));
      }
      break;
    }
    case IBV_EVENT_CQ_ERR:
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_DEVICE_FATAL: {
      const absl::Status why = absl::UnavailableError(absl::StrCat(
          device.name, " reported ", name,
          type == IBV_EVENT_CQ_ERR
              ? ": a completion queue that connections of this transport share failed "
                "(overrun or a device error), so they all end"
          : type == IBV_EVENT_SRQ_ERR
              ? ": the shared receive queue that all connections of this transport share "
                "failed, so they all end"
              : ": the device failed; every connection on it ends (the driver must be reloaded "
                "or the device reset)",
          "; make a new transport to connect again"));
      fprintf(stderr, "rdmarpc: %s\n", std::string(why.message()).c_str());
      for (Endpoint* ep : device.endpoints) {
        if (type == IBV_EVENT_DEVICE_FATAL ||
            (type == IBV_EVENT_CQ_ERR && ep->HasCq(event.element.cq)) ||
            (type == IBV_EVENT_SRQ_ERR && ep->srq() == event.element.srq)) {
          ep->FailAll(why);
        }
      }
      break;
    }
    default:
      return;  // benign: COMM_EST, LAST_WQE_REACHED, SQ_DRAINED, SRQ_LIMIT_REACHED, ...
  }
  Count(&RdmaCounters::device_events);
}

}  // namespace rdmarpc::transport::rdma
