// Fault injection for the RDMA transport's tests, off unless a test arms it.
//
// Production code only reads these counters (one relaxed atomic load on the
// large-payload path); tests arm them to make a peer misbehave on purpose.
#ifndef RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_
#define RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_

#include <atomic>

namespace rdmarpc::transport::rdma {

struct FaultInjection {
  // The next N payload advertisements carry a wrong rkey.
  static std::atomic<int>& CorruptRkeys() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeCorruptRkey() { return Take(CorruptRkeys()); }

  // The next N payload fetches READ the previous advertisement on their
  // connection instead, as a peer replaying an old (addr, rkey) would.
  static std::atomic<int>& StaleReads() {
    static std::atomic<int> n{0};
    return n;
  }
  static bool TakeStaleRead() { return Take(StaleReads()); }

 private:
  static bool Take(std::atomic<int>& n) {
    int v = n.load(std::memory_order_relaxed);
    while (v > 0 && !n.compare_exchange_weak(v, v - 1)) {
    }
    return v > 0;
  }
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_FAULT_INJECTION_H_
