// DeviceHold: keeps librdmacm from closing a device's ibv_context while
// resources made on it (protection domain, CQs, SRQ, registrations) live.
//
//   auto hold = DeviceHold::Take(id->verbs);  // before the first resource
//   if (!hold.ok()) return hold.status();
//   ...                                        // ibv_alloc_pd(id->verbs), ...
//   hold->reset();                             // after the last is destroyed
//
// Why: the ibv_context of an rdma_cm_id is librdmacm's. librdmacm counts the
// ids bound to a device as its references, and closes the context of a
// removed device once none is left, the next time it reads the device list
// (when a device it has not seen yet appears). An Endpoint's resources
// outlive the ids of its connections, so a device removed and another added
// would free the context under them. rdma_get_devices takes a reference on
// every device and rdma_free_devices gives back those of the contexts it is
// handed: the hold keeps its device's and gives the others back at once.
//
// What not to rely on: a hold keeps a removed device's context open, and so
// the device itself (Soft-RoCE's `rdma link delete` waits for every open
// context), until it is released; it says nothing about whether the device
// still works. Taking one makes librdmacm open every device's context, not
// only this one's, and keep them open, as it does for devices its ids use:
// two file descriptors and the driver's per-context memory per device.
#ifndef RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_
#define RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_

#include <infiniband/verbs.h>

#include <memory>

#include "absl/status/statusor.h"

namespace rdmarpc::transport::rdma {

class DeviceHold {
 public:
  // A reference on `verbs`, which must be a context librdmacm opened (an
  // rdma_cm_id's). UNAVAILABLE when librdmacm no longer lists it: the
  // device is being removed.
  static absl::StatusOr<std::unique_ptr<DeviceHold>> Take(ibv_context* verbs);
  ~DeviceHold();
  DeviceHold(const DeviceHold&) = delete;
  DeviceHold& operator=(const DeviceHold&) = delete;

 private:
  explicit DeviceHold(ibv_context** list) : list_(list) {}
  // What rdma_free_devices is handed: this device, then a null.
  ibv_context** const list_;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_
