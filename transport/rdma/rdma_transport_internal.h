// What rdma_transport.cc and rdma_transport_events.cc share: a connect
// under way, a listener, and the hints that errors end with. Not for use
// outside RdmaTransport.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_INTERNAL_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_INTERNAL_H_

#include <rdma/rdma_cma.h>
#include <string.h>
#include <sys/socket.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "transport/attempt_errors.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/rdma_transport.h"

namespace rdmarpc::transport::rdma {
namespace internal {

// Said with a failure to reach a loopback address (or the unspecified one,
// which means this host as a destination): rdma_cm binds such a connection
// to a device, but Soft-RoCE (and devices without loopback) finds no route
// for it.
inline constexpr char kLoopbackHint[] =
    " (a loopback or unspecified address: this device has no RDMA path over it; use the "
    "address of an interface with an RDMA port, or tcp://, or auto://, which falls back to TCP "
    "there)";

// Whether a connect or a listen failed: what to try differs.
enum class Doing { kConnect, kListen };

// Advice (WithWhatToDo) for a failure a device may explain: the devices
// there are (DescribeDevices), then what to try.
inline std::string DevicesAndTry(Doing doing) {
  return absl::StrCat(
      "Devices: ", DescribeDevices(),
      ". Try: `rdma link` and `ibv_devinfo` to see devices and ports; make sure the address "
      "belongs to an interface with an active RDMA port (Soft-RoCE: `rdma link add rxe0 type rxe "
      "netdev <if>`); ",
      doing == Doing::kConnect ? "that the server listens there; " : "",
      "or use tcp:// (or auto://).");
}

// The payload of an error that a device may explain, made on rdma_cm's
// thread, which listing the devices (opening each) would hold up for every
// connection. EndWithDevices, on the caller's thread, takes it off and adds
// DevicesAndTry as advice, which a name's attempts then say once
// (FailedAttempts). A failure that is no device's doing (a port in use)
// carries none.
inline constexpr absl::string_view kEndWithDevices = "type.rdmarpc.dev/rdma.EndWithDevices";

template <typename T>
absl::StatusOr<T> EndWithDevices(absl::StatusOr<T> result, Doing doing) {
  if (result.ok() || !result.status().GetPayload(kEndWithDevices)) return result;
  absl::Status why = result.status();
  why.ErasePayload(kEndWithDevices);
  return WithWhatToDo(std::move(why), DevicesAndTry(doing));
}

}  // namespace internal

struct RdmaTransport::Attempt {
  rdma_cm_id* id = nullptr;
  std::string target;
  bool loopback = false;  // the target is 127.0.0.0/8, ::1, 0.0.0.0 or ::
  ConnectionObserver* observer = nullptr;
  std::shared_ptr<RdmaConnection> conn;
  std::promise<absl::Status> done;
  bool finished = false;

  void Finish(absl::Status s) {
    if (finished) return;
    finished = true;
    done.set_value(std::move(s));
  }
};

// A listener on one address. Bound to a specific address, its rdma_cm id is
// bound to the device that serves it; when that device is removed the id is
// useless (rdma_cm delivers nothing more to it), so it is destroyed and the
// listener tries every kRelistenInterval to listen on the same address and
// port again (RelistenDue), on whatever device serves the address by then.
// A wildcard listener needs none of this: rdma_cm itself listens on devices
// that come after it.
class RdmaTransport::RdmaListener : public Listener {
 public:
  RdmaListener(RdmaTransport* t, rdma_cm_id* id, Address bound, AcceptCallback cb)
      : transport_(t),
        id_(id),
        bound_(std::move(bound)),
        bound_at_(CopySockaddr(rdma_get_local_addr(id))),
        on_accept_(std::move(cb)) {}
  ~RdmaListener() override {
    transport_->RunOnCmAndWait([this] {
      transport_->orphaned_listeners_.erase(this);
      if (id_ == nullptr) return;
      transport_->cm_targets_.erase(id_);
      rdma_destroy_id(id_);
    });
  }
  const Address& address() const override { return bound_; }
  AcceptCallback& on_accept() { return on_accept_; }

  // CM thread: the listener's id, null while its device is gone.
  void set_id(rdma_cm_id* id) { id_ = id; }
  // The address and port it listens on, to listen there again.
  const sockaddr_storage& bound_at() const { return bound_at_; }
  // CM thread: when RelistenDue tries next.
  std::chrono::steady_clock::time_point relisten_at;

 private:
  static sockaddr_storage CopySockaddr(const sockaddr* sa) {
    sockaddr_storage copy{};
    memcpy(&copy, sa, sa->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
    return copy;
  }

  RdmaTransport* const transport_;
  rdma_cm_id* id_;
  const Address bound_;
  const sockaddr_storage bound_at_;
  AcceptCallback on_accept_;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_TRANSPORT_INTERNAL_H_
