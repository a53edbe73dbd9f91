// Tells ThreadSanitizer about the synchronization a SEND provides.
//
// Why this exists: TSan sees memory accesses and synchronization only in
// instrumented code, and a SEND crosses the device (the kernel, for
// Soft-RoCE; the NIC's DMA on hardware) where TSan sees nothing. Without the
// edge below, "write, then send; the peer receives, then reads" is a race to
// TSan when both ends live in one process (tests, a client and server side by
// side), although the verbs specification orders it: everything a thread did
// before posting a SEND happens before the peer's RECV completion for it is
// polled. SentOn(qp) before the post and ReceivedOn(wc) when the RECV
// completion is polled say so (the test
// RdmaTransport.WhatASenderWroteIsVisibleToItsReceiver fails under TSan
// without them: three races reported).
//
// Only that edge is modelled. A work request's own completion, on the side
// that posted it, is ordered by the connection's lock already (both the post
// and the completion take it), and the memory a peer READs is reused only
// after a SEND (a release or a response) says so.
//
// Keys are the receiving QP's number folded into a fixed table, so two QPs
// may share a key: that adds edges (TSan may miss a race between their
// users), it never reports a false one. Without TSan every function here is
// empty and costs nothing on the fast path.
#ifndef RDMARPC_TRANSPORT_RDMA_SANITIZER_SYNC_H_
#define RDMARPC_TRANSPORT_RDMA_SANITIZER_SYNC_H_

#include <infiniband/verbs.h>

#include <cstdint>

#include "base/sanitizers.h"

#ifdef RDMARPC_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace rdmarpc::transport::rdma::sanitizer_sync {

#ifdef RDMARPC_TSAN
namespace internal {
constexpr uint32_t kKeys = 1024;
inline char keys[kKeys];
inline void* KeyOf(uint32_t receiving_qp_num) { return &keys[receiving_qp_num % kKeys]; }
}  // namespace internal

// Before posting SENDs on `qp`. The peer's QP number is asked of the device:
// a system call per post, in TSan builds only. A QP is connected (and so
// knows its peer) before anything is posted on it.
inline void SentOn(ibv_qp* qp) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(qp, &attr, IBV_QP_DEST_QPN, &init) == 0) {
    __tsan_release(internal::KeyOf(attr.dest_qp_num));
  }
}
// A RECV completion, polled.
inline void ReceivedOn(const ibv_wc& wc) { __tsan_acquire(internal::KeyOf(wc.qp_num)); }
#else
inline void SentOn(ibv_qp*) {}
inline void ReceivedOn(const ibv_wc&) {}
#endif

}  // namespace rdmarpc::transport::rdma::sanitizer_sync

#endif  // RDMARPC_TRANSPORT_RDMA_SANITIZER_SYNC_H_
