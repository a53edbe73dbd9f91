// DeviceEvents: reads the devices' asynchronous events (ibv_get_async_event)
// for every Endpoint of the process and acts on them, so that a port that
// goes down, or a queue pair, completion queue or device the hardware has
// failed, is named in a log line and in the status of the calls it ends,
// instead of showing up only as flushed completions or a lost connection.
//
//   absl::Status s = DeviceEvents::Watch(endpoint);  // when it is made;
//                                                     // refuse it if not ok
//   ...
//   std::string note = DeviceEvents::PortNote(verbs, port);  // for an error text
//   ...
//   DeviceEvents::Unwatch(endpoint);   // before its CQ and SRQ are destroyed
//
// The reader is woken (to poll a new device, or to stop) through an eventfd
// made when it starts. When the process is out of descriptors and none can
// be made, Watch fails and the endpoint is refused, rather than watched by a
// reader that nothing could wake to stop; so does a process that may start
// no more threads, when the reader is not running.
//
// Why process-wide: librdmacm opens each device once per process, so every
// transport's endpoints on one device share its ibv_context and its one
// queue of events; whoever reads an event must hand it to the endpoint it is
// about. One thread reads them all, while any endpoint is watched; it sleeps
// in poll() between events.
//
// What each event does:
//   PORT_ERR, PORT_ACTIVE, GID/LID/PKEY/SM changes: one log line naming the
//     device and port. A port's state also goes into the texts of the
//     connections that fail over it (PortNote).
//   QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, PATH_MIG_ERR: the connection of that
//     queue pair ends UNAVAILABLE, naming the event and its likely cause.
//   CQ_ERR, SRQ_ERR, DEVICE_FATAL: every connection of the endpoint (of every
//     endpoint on the device, for DEVICE_FATAL) ends, and the endpoint
//     refuses new ones; a new transport is needed.
//   Others (COMM_EST, LAST_WQE_REACHED, SQ_DRAINED, ...): dropped.
//
// What not to rely on: an event races the completions of the same failure,
// and a connection ends with whichever reaches it first. An application
// that reads the same device's events itself competes with this thread for
// them. Each event is acknowledged as soon as it is handed over, never
// later: ibv_destroy_qp, _cq and _srq wait for the acks of their events.
#ifndef RDMARPC_TRANSPORT_RDMA_DEVICE_EVENTS_H_
#define RDMARPC_TRANSPORT_RDMA_DEVICE_EVENTS_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace rdmarpc::transport::rdma {

class Endpoint;

class DeviceEvents {
 public:
  // Events about `ep`'s resources reach it from now on; an error (a process
  // out of file descriptors) when they cannot. Any thread.
  static absl::Status Watch(Endpoint* ep);
  // None reaches `ep` once this returns. After the last endpoint on its
  // device, the reader no longer touches the device's context, which may
  // then be closed, and forgets its ports' history; after the last endpoint
  // of all, the reader has stopped. Any thread but the reader's; a no-op for
  // an endpoint not watched.
  static void Unwatch(Endpoint* ep);
  // How port `port` of `verbs` is, for the text of a connection that failed
  // over it: empty while it is active, else what went wrong and since when.
  static std::string PortNote(ibv_context* verbs, uint8_t port);
  // What the reader does with an event it got from `verbs`. Tests call it to
  // play events a device would report.
  static void Handle(ibv_context* verbs, const ibv_async_event& event);
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_DEVICE_EVENTS_H_
