#include "transport/rdma/counters.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc::transport::rdma {

RdmaCounters& MutableCounters() {
  static RdmaCounters* counters = new RdmaCounters;
  return *counters;
}

const RdmaCounters& Counters() { return MutableCounters(); }

std::string RdmaCounters::ToString() const {
  return absl::StrCat(
      "sends=", sends.load(), " (inline ", sends_inline.load(), ") reads=", reads.load(),
      " bytes_read=", bytes_read.load(), " advertised=", payloads_advertised.load(),
      " srq_posted=", srq_slots_posted.load(), " srq_consumed=", srq_slots_consumed.load(),
      " srq_short=", srq_short.load(), " rnr=", rnr_events.load(),
      " credit_stalls=", credit_stalls.load(), " credit_msgs=", credit_messages.load(),
      " conns_opened=", connections_opened.load(), " conns_closed=", connections_closed.load(),
      " registered_bytes=", registered_bytes.load(), " poller_sleeps=", poller_sleeps.load(),
      " caller_completions=", caller_completions.load());
}

}  // namespace rdmarpc::transport::rdma
