// BarePingPong: the smallest rdma_cm SEND/RECV ping-pong there is (what
// ib_send_lat measures), client and server as two threads of this process,
// for benchmarks that time something against bare verbs in the same process
// and, block by block, in the same spell of the machine.
//
//   auto pp = BarePingPong::Start("10.77.0.1", /*message_size=*/130, {{}});
//   std::vector<double> rtt_us;
//   absl::Status s = (*pp)->RunBlock(0, 250, nullptr, &rtt_us);
//
// Why blocks: under QEMU TCG the machine's speed moves between discrete
// levels (the same ping-pong's round trip at 22, 28, 36 or 42 us) for
// tenths of a second at a time, so figures taken seconds apart, even in one
// process, compare spells rather than code. Timed in alternating blocks of
// a few milliseconds, each pair of blocks shares its spell.
//
// The server thread spins on its queue pairs only while a block runs, and
// waits on a condition variable between blocks, so that whatever runs in
// between (rdmarpc's own threads) has the CPUs the machine has. The first
// round trips of a block include the server's wake-up; the caller drops them.
//
// Each connection is set up by its Shape: the default is the bare queue pair
// ib_send_lat uses; the fields set it up as rdmarpc does, one at a time.
// Every SEND is inline; a receive is re-posted as soon as it completes.
// Not for production traffic: it exists to measure.
#ifndef RDMARPC_TRANSPORT_RDMA_BENCH_BARE_PINGPONG_H_
#define RDMARPC_TRANSPORT_RDMA_BENCH_BARE_PINGPONG_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc::transport::rdma {

class BarePingPong {
 public:
  struct Shape {
    bool srq = false;           // receive from a shared receive queue, as rdmarpc does
    int signal_every = 1;       // signal one SEND in this many (at most sq_depth)
    int cq_entries = 0;         // 0: just enough; an rdmarpc server asks 16384
    int sq_depth = 16;          // rdmarpc: send_slots + max_qp_rd_atom + 16
    bool comp_channel = false;  // a completion channel on the CQ, never armed
  };

  // Connects one queue pair per shape to itself through `ipv4_address` (the
  // RDMA device's interface). Errors name the step, the address and what to
  // check.
  static absl::StatusOr<std::unique_ptr<BarePingPong>> Start(const std::string& ipv4_address,
                                                             int message_size,
                                                             const std::vector<Shape>& shapes);
  ~BarePingPong();  // disconnects and frees everything

  // `round_trips` round trips on connection `connection`; before each,
  // `between(i)` if given (not timed). Appends each round trip's time in us
  // to `rtt_us`. A failed post or completion is returned, and the ping-pong
  // cannot be used after it.
  absl::Status RunBlock(int connection, int round_trips, const std::function<void(int)>& between,
                        std::vector<double>* rtt_us);

  BarePingPong(const BarePingPong&) = delete;
  BarePingPong& operator=(const BarePingPong&) = delete;

 private:
  struct Impl;
  explicit BarePingPong(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_BENCH_BARE_PINGPONG_H_
