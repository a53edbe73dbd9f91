// DeviceHold: keeps librdmacm from closing a device's ibv_context while
// resources made on it (protection domain, CQs, SRQ, registrations) live.
//
//   auto hold = DeviceHold::Take(id->verbs);  // before the first resource
//   if (!hold.ok()) return hold.status();
//   ...                                        // ibv_alloc_pd(id->verbs), ...
//   if (hold->Removed()) ...                   // let go of the device
//   hold.reset();                              // after the last is destroyed
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
// still works. Released, a removed device's context is not closed at once
// either: librdmacm (rdma-core 44) closes it only when it next reads the
// device list, which it does when an id binds to a device it has not seen.
// Taking a hold makes librdmacm open every device's context, not only this
// one's, and keep them open, as it does for devices its ids use: two file
// descriptors and the driver's per-context memory per device.
#ifndef RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_
#define RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_

#include <infiniband/verbs.h>
#include <sys/types.h>

#include <memory>
#include <string>

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

  // Whether the device is being removed: its uverbs node, there when the
  // hold was taken, has left sysfs (the kernel takes it away as a removal
  // begins, before it waits for the processes that hold the device), or
  // another device's has taken its name (a device added since reuses the
  // free number). False where sysfs did not show the node to begin with. A
  // stat(), for a check now and then, not per call.
  bool Removed() const;

 private:
  DeviceHold(ibv_context** list, std::string uverbs_path, ino_t uverbs_ino)
      : list_(list), uverbs_path_(std::move(uverbs_path)), uverbs_ino_(uverbs_ino) {}
  // What rdma_free_devices is handed: this device, then a null.
  ibv_context** const list_;
  // Empty when sysfs did not show it. Each sysfs node has an inode number
  // of its own, so a new device's node under the same name has another.
  const std::string uverbs_path_;
  const ino_t uverbs_ino_;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_DEVICE_HOLD_H_
