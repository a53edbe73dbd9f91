// pingpong_probe: the smallest rdma_cm SEND/RECV ping-pong there is, run
// three ways: bare (what ib_send_lat measures), with a fixed piece of
// ordinary user code (containers, formatting, sorting) between round trips,
// and with a spin on the clock for as long as that code takes. It tells what
// the machine charges for running any code between posts from what rdmarpc
// itself costs.
//
//   bazel-bin/transport/rdma/pingpong_probe --address 10.77.0.1
//
// Under QEMU TCG (the Soft-RoCE VM) the round trip after the user code,
// timed without the code, is slower than the bare one and slower than after
// the spin, by far more in the machine's slow spells: what costs is not the
// time away from the posts but the code run in it. The kernel's Soft-RoCE
// send path, which runs inside ibv_post_send, is slower after user code has
// displaced it from the emulator's translation caches. Any RPC layer runs
// such code between posts, so its round trip cannot get near 2 x
// ib_send_lat there; on hardware the step is an ordinary cache miss. bench/run_bench.sh prints
// these figures next to perftest's.
//
// The ping-pong is bench/bare_pingpong.h's. The flags --srq, --signal_every,
// --cq_entries, --sq_depth and --comp_channel set its queue pairs up as
// rdmarpc does, one difference at a time; --compare times them against the
// bare shape in alternating blocks of the same process.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/stage_trace.h"
#include "transport/rdma/bench/bare_pingpong.h"

ABSL_FLAG(std::string, address, "", "IPv4 address of the RDMA device's interface");
ABSL_FLAG(int, iterations, 4000, "round trips per variant");
ABSL_FLAG(int, size, 130, "bytes per message (rdmarpc's small-call frame is 130)");
// The ways rdmarpc's queue pairs differ from this bare one, each on its own,
// to tell which of them (if any) makes a delivery slower.
ABSL_FLAG(bool, srq, false, "receive from a shared receive queue, as rdmarpc does");
ABSL_FLAG(int, signal_every, 1, "signal one SEND in this many, as rdmarpc's selective signaling");
ABSL_FLAG(int, cq_entries, 0, "completion queue entries (0: just enough; an rdmarpc server asks 16384)");
ABSL_FLAG(int, sq_depth, 16, "send queue depth (rdmarpc: send_slots + max_qp_rd_atom + 16)");
ABSL_FLAG(bool, comp_channel, false, "attach a completion channel to the CQ (never armed)");
ABSL_FLAG(bool, compare, false,
          "also connect a queue pair set up the default way and take turns with it, so that "
          "the flags above are measured against it in the same process");

namespace {

using rdmarpc::transport::rdma::BarePingPong;

constexpr int kBlock = 250;  // the variants take turns in blocks of this many

// What the client does between round trips: nothing (ib_send_lat's loop),
// ordinary user code, or a spin on the clock for as long as that code takes
// (the same time away from the posts, with next to no code). The last kind,
// with --compare only, is nothing on the default-shape queue pair.
enum class Between { kNothing, kUserCode, kSpin, kNothingDefaultShape };
constexpr int kMaxVariants = 4;
static_assert(static_cast<int>(Between::kNothingDefaultShape) + 1 == kMaxVariants,
              "one block kind per variant");

double NowUs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Ordinary code of the kind an RPC runtime runs between posts; noinline so
// the compiler cannot fold it into the loop.
__attribute__((noinline)) size_t UserWork(int k) {
  std::map<int, std::string> m;
  for (int i = 0; i < 8; ++i) m[i * k] = std::to_string(i * 12345 + k);
  std::ostringstream os;
  os << k << ' ' << 3.25 * k;
  char text[96];
  snprintf(text, sizeof text, "%s %.3f %s", os.str().c_str(), k * 0.5, m.begin()->second.c_str());
  std::vector<int> v(32);
  for (int i = 0; i < 32; ++i) v[i] = (i * 7919 + k) % 101;
  std::sort(v.begin(), v.end());
  return m.size() + strlen(text) + v[3];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string address = absl::GetFlag(FLAGS_address);
  const int iterations = std::max(kBlock, absl::GetFlag(FLAGS_iterations)) / kBlock * kBlock;
  // Connection 0 is set up by the flags; with --compare, connection 1 the
  // default way.
  BarePingPong::Shape shaped;
  shaped.srq = absl::GetFlag(FLAGS_srq);
  shaped.signal_every = absl::GetFlag(FLAGS_signal_every);
  shaped.cq_entries = absl::GetFlag(FLAGS_cq_entries);
  shaped.sq_depth = absl::GetFlag(FLAGS_sq_depth);
  shaped.comp_channel = absl::GetFlag(FLAGS_comp_channel);
  const bool compare = absl::GetFlag(FLAGS_compare);
  std::vector<BarePingPong::Shape> shapes = {shaped};
  if (compare) shapes.push_back(BarePingPong::Shape{});
  auto pp = BarePingPong::Start(address, absl::GetFlag(FLAGS_size), shapes);
  if (!pp.ok()) {
    fprintf(stderr, "pingpong_probe: %s\n", pp.status().ToString().c_str());
    return 2;
  }
  const int variants = compare ? kMaxVariants : kMaxVariants - 1;

  // The user code's own time first, so that the spin can last as long.
  std::vector<double> work_alone;
  volatile size_t sink = 0;
  for (int i = 0; i < iterations; ++i) {
    const double t0 = NowUs();
    sink = UserWork(i);
    work_alone.push_back(NowUs() - t0);
  }
  const double work_us = Median(work_alone);
  const std::function<void(int)> between_kinds[kMaxVariants] = {
      nullptr,
      [&sink](int i) { sink = UserWork(i); },
      [work_us](int) {
        for (const double until = NowUs() + work_us; NowUs() < until;) {
        }
      },
      nullptr,
  };
  // Block 0 warms up; then the variants take turns, a block each.
  std::vector<double> rtts[kMaxVariants];
  const int blocks = 1 + variants * iterations / kBlock;
  for (int block = 0; block < blocks; ++block) {
    const int kind = block % variants;
    const bool measured = block > 0;
    RDMARPC_STAGE_RECORD(measured && kind == static_cast<int>(Between::kNothing));
    const int connection = kind == static_cast<int>(Between::kNothingDefaultShape) ? 1 : 0;
    const absl::Status s =
        (*pp)->RunBlock(connection, kBlock, between_kinds[kind], measured ? &rtts[kind] : nullptr);
    if (!s.ok()) {
      fprintf(stderr, "pingpong_probe: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  (void)sink;
  RDMARPC_STAGE_DUMP("probe_bare");
  pp->reset();

  printf("probe_bare_rtt_p50_us %.2f\n", Median(rtts[static_cast<int>(Between::kNothing)]));
  printf("probe_user_code_us %.2f\n", work_us);
  printf("probe_rtt_after_user_code_p50_us %.2f\n",
         Median(rtts[static_cast<int>(Between::kUserCode)]));
  printf("probe_rtt_after_spin_p50_us %.2f\n", Median(rtts[static_cast<int>(Between::kSpin)]));
  if (compare) {
    printf("probe_default_shape_bare_rtt_p50_us %.2f\n",
           Median(rtts[static_cast<int>(Between::kNothingDefaultShape)]));
  }
  return 0;
}
