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
// displaced it from the emulator's translation caches. Any RPC layer runs such code between posts,
// so its round trip cannot get near 2 x ib_send_lat there; on hardware the
// step is an ordinary cache miss. bench/run_bench.sh prints these figures
// next to perftest's.
//
// Client and server are two threads of this process, each with its own
// queue pair, completion queue and receive buffers; every SEND is inline and
// signaled, and a receive is re-posted as soon as it completes. The flags
// --srq, --signal_every, --cq_entries, --sq_depth and --comp_channel set up
// the queue pairs as rdmarpc does, one difference at a time.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "base/stage_trace.h"

ABSL_FLAG(std::string, address, "", "IPv4 address of the RDMA device's interface");
ABSL_FLAG(int, iterations, 4000, "round trips per variant");
ABSL_FLAG(int, size, 130, "bytes per message (rdmarpc's small-call frame is 130)");
// The ways rdmarpc's queue pairs differ from this bare one, each on its own,
// to tell which of them (if any) makes a delivery slower.
ABSL_FLAG(bool, srq, false, "receive from a shared receive queue, as rdmarpc does");
ABSL_FLAG(int, signal_every, 1, "signal one SEND in this many, as rdmarpc's selective signaling");
ABSL_FLAG(int, cq_entries, 0, "completion queue entries (0: just enough; rdmarpc asks 16384)");
ABSL_FLAG(int, sq_depth, 16, "send queue depth (rdmarpc: send_slots + max_qp_rd_atom + 16)");
ABSL_FLAG(bool, comp_channel, false, "attach a completion channel to the CQ (never armed)");
ABSL_FLAG(bool, compare, false,
          "also connect a queue pair set up the default way and take turns with it, so that "
          "the flags above are measured against it in the same process");

namespace {

constexpr int kReceives = 16;
constexpr int kBlock = 250;  // the variants take turns in blocks of this many

// What the client does between round trips: nothing (ib_send_lat's loop),
// ordinary user code, or a spin on the clock for as long as that code takes
// (the same time away from the posts, with next to no code). The last kind,
// with --compare only, is nothing on the default-shape queue pair.
enum class Between { kNothing, kUserCode, kSpin, kNothingDefaultShape };
constexpr int kMaxVariants = 4;
static_assert(static_cast<int>(Between::kNothingDefaultShape) + 1 == kMaxVariants,
              "one block kind per variant");

std::string g_address;

[[noreturn]] void Die(const char* what) {
  fprintf(stderr, "pingpong_probe: %s failed for %s: %s. Is an RDMA device active on that "
          "address (`rdma link`, `ibv_devinfo`)?\n", what, g_address.c_str(), strerror(errno));
  exit(1);
}

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

// How a queue pair is set up: the default is the bare one ib_send_lat uses.
struct Shape {
  bool srq = false;
  int signal_every = 1;
  int cq_entries = 0;
  int sq_depth = 16;
  bool comp_channel = false;

  static Shape FromFlags() {
    Shape s;
    s.srq = absl::GetFlag(FLAGS_srq);
    s.signal_every = std::max(1, absl::GetFlag(FLAGS_signal_every));
    s.cq_entries = absl::GetFlag(FLAGS_cq_entries);
    s.sq_depth = std::max(1, absl::GetFlag(FLAGS_sq_depth));
    s.comp_channel = absl::GetFlag(FLAGS_comp_channel);
    if (s.signal_every > s.sq_depth) {
      // Unsignaled SENDs hold their send queue entries until a signaled one
      // completes, so more of them than the queue holds could never post.
      fprintf(stderr, "pingpong_probe: --signal_every %d exceeds --sq_depth %d\n",
              s.signal_every, s.sq_depth);
      exit(2);
    }
    return s;
  }
};

// One side of a connection: its queue pair and what the queue pair needs.
struct Side {
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  ibv_mr* mr = nullptr;
  std::vector<char> buf;  // kReceives receive slots, then the send buffer
  int size = 0;
  int signal_every = 1;
  int unsignaled = 0;

  void Setup(rdma_cm_id* cm_id, int message_size, const Shape& shape) {
    id = cm_id;
    size = message_size;
    signal_every = shape.signal_every;
    if (!(pd = ibv_alloc_pd(id->verbs))) Die("ibv_alloc_pd");
    if (shape.comp_channel && !(channel = ibv_create_comp_channel(id->verbs))) {
      Die("ibv_create_comp_channel");
    }
    const int cq_entries = shape.cq_entries > 0 ? shape.cq_entries : kReceives + shape.sq_depth;
    if (!(cq = ibv_create_cq(id->verbs, cq_entries, nullptr, channel, 0))) {
      Die("ibv_create_cq");
    }
    if (shape.srq) {
      ibv_srq_init_attr sa{};
      sa.attr.max_wr = kReceives;
      sa.attr.max_sge = 1;
      if (!(srq = ibv_create_srq(pd, &sa))) Die("ibv_create_srq");
    }
    ibv_qp_init_attr a{};
    a.send_cq = cq;
    a.recv_cq = cq;
    a.srq = srq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = static_cast<uint32_t>(shape.sq_depth);
    a.cap.max_recv_wr = srq ? 0 : kReceives;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = static_cast<uint32_t>(size);
    if (rdma_create_qp(id, pd, &a) != 0) Die("rdma_create_qp");
    buf.assign(static_cast<size_t>(kReceives + 1) * size, 'p');
    if (!(mr = ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE))) Die("ibv_reg_mr");
    for (int i = 0; i < kReceives; ++i) PostReceive(i);
  }

  void PostReceive(int slot) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf.data() + size_t(slot) * size),
                static_cast<uint32_t>(size), mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = static_cast<uint64_t>(slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (srq ? ibv_post_srq_recv(srq, &wr, &bad) != 0 : ibv_post_recv(id->qp, &wr, &bad) != 0) {
      Die("ibv_post_recv");
    }
  }

  void Send() {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf.data() + size_t(kReceives) * size),
                static_cast<uint32_t>(size), mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = kReceives;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    const bool signaled = ++unsignaled >= signal_every;
    if (signaled) unsignaled = 0;
    wr.send_flags = IBV_SEND_INLINE | (signaled ? IBV_SEND_SIGNALED : 0);
    ibv_send_wr* bad = nullptr;
    RDMARPC_STAGE(kPostBegin);
    if (ibv_post_send(id->qp, &wr, &bad) != 0) Die("ibv_post_send");
    RDMARPC_STAGE(kPostEnd);
  }

  void Teardown() {
    rdma_destroy_qp(id);
    ibv_dereg_mr(mr);
    if (srq) ibv_destroy_srq(srq);
    ibv_destroy_cq(cq);
    if (channel) ibv_destroy_comp_channel(channel);
    ibv_dealloc_pd(pd);
    rdma_destroy_id(id);
  }

  // Polls once; true when a message arrived (a ping-pong has at most one in
  // flight per queue pair). Send completions are only counted off.
  bool Poll() {
    ibv_wc wc[16];
    RDMARPC_STAGE(kPoll);
    const int n = ibv_poll_cq(cq, 16, wc);
    if (n < 0) Die("ibv_poll_cq");
    bool received = false;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        fprintf(stderr, "pingpong_probe: completion failed on %s: %s\n", g_address.c_str(),
                ibv_wc_status_str(wc[i].status));
        exit(1);
      }
      if (wc[i].opcode == IBV_WC_RECV) {
        RDMARPC_STAGE(kRecvPolled);
        PostReceive(static_cast<int>(wc[i].wr_id));
        received = true;
      }
    }
    return received;
  }

  void Receive() {
    while (!Poll()) {
    }
  }
};

rdma_cm_event* Expect(rdma_event_channel* ch, rdma_cm_event_type type) {
  rdma_cm_event* ev = nullptr;
  if (rdma_get_cm_event(ch, &ev) != 0) Die("rdma_get_cm_event");
  if (ev->event != type) {
    fprintf(stderr, "pingpong_probe: expected %s, got %s (status %d) on %s\n",
            rdma_event_str(type), rdma_event_str(ev->event), ev->status, g_address.c_str());
    exit(1);
  }
  return ev;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  g_address = absl::GetFlag(FLAGS_address);
  const int iterations = std::max(kBlock, absl::GetFlag(FLAGS_iterations)) / kBlock * kBlock;
  const int size = absl::GetFlag(FLAGS_size);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, g_address.c_str(), &addr.sin_addr) != 1) {
    fprintf(stderr, "pingpong_probe: --address must be an IPv4 address, got '%s'\n",
            g_address.c_str());
    return 2;
  }

  // Connection 0 is set up by the flags; with --compare, connection 1 the
  // default way.
  const int connections = absl::GetFlag(FLAGS_compare) ? 2 : 1;
  const Shape shapes[2] = {Shape::FromFlags(), Shape{}};

  rdma_event_channel* server_ch = rdma_create_event_channel();
  rdma_event_channel* client_ch = rdma_create_event_channel();
  if (!server_ch || !client_ch) Die("rdma_create_event_channel");
  rdma_cm_id* listener = nullptr;
  if (rdma_create_id(server_ch, &listener, nullptr, RDMA_PS_TCP) != 0) Die("rdma_create_id");
  if (rdma_bind_addr(listener, reinterpret_cast<sockaddr*>(&addr)) != 0) Die("rdma_bind_addr");
  if (rdma_listen(listener, 1) != 0) Die("rdma_listen");
  addr.sin_port = rdma_get_src_port(listener);

  const int variants = connections == 2 ? kMaxVariants : kMaxVariants - 1;
  const int total = variants * iterations + kBlock;  // a block of warm-up, then the variants
  std::thread server([&] {
    std::vector<Side> sides(static_cast<size_t>(connections));
    for (int c = 0; c < connections; ++c) {
      rdma_cm_event* ev = Expect(server_ch, RDMA_CM_EVENT_CONNECT_REQUEST);
      rdma_cm_id* id = ev->id;
      rdma_ack_cm_event(ev);
      sides[c].Setup(id, size, shapes[c]);
      rdma_conn_param param{};
      if (rdma_accept(id, &param) != 0) Die("rdma_accept");
      rdma_ack_cm_event(Expect(server_ch, RDMA_CM_EVENT_ESTABLISHED));
    }
    for (int i = 0; i < total;) {
      for (Side& side : sides) {
        if (side.Poll()) {
          side.Send();
          ++i;
        }
      }
    }
    for (int c = 0; c < connections; ++c) {
      rdma_ack_cm_event(Expect(server_ch, RDMA_CM_EVENT_DISCONNECTED));
    }
    for (Side& side : sides) side.Teardown();
  });

  std::vector<Side> sides(static_cast<size_t>(connections));
  for (int c = 0; c < connections; ++c) {
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(client_ch, &id, nullptr, RDMA_PS_TCP) != 0) Die("rdma_create_id");
    if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&addr), 2000) != 0) {
      Die("rdma_resolve_addr");
    }
    rdma_ack_cm_event(Expect(client_ch, RDMA_CM_EVENT_ADDR_RESOLVED));
    if (rdma_resolve_route(id, 2000) != 0) Die("rdma_resolve_route");
    rdma_ack_cm_event(Expect(client_ch, RDMA_CM_EVENT_ROUTE_RESOLVED));
    sides[c].Setup(id, size, shapes[c]);
    rdma_conn_param param{};
    if (rdma_connect(id, &param) != 0) Die("rdma_connect");
    rdma_ack_cm_event(Expect(client_ch, RDMA_CM_EVENT_ESTABLISHED));
  }

  // The user code's own time first, so that the spin can last as long.
  std::vector<double> work_alone;
  volatile size_t sink = 0;
  for (int i = 0; i < iterations; ++i) {
    const double t0 = NowUs();
    sink = UserWork(i);
    work_alone.push_back(NowUs() - t0);
  }
  const double work_us = Median(work_alone);
  // Block 0 warms up; then the variants take turns, a block each.
  std::vector<double> rtts[kMaxVariants];
  for (int block = 0; block * kBlock < total; ++block) {
    const auto between = static_cast<Between>(block % variants);
    Side& side = sides[between == Between::kNothingDefaultShape ? 1 : 0];
    for (int i = 0; i < kBlock; ++i) {
      if (between == Between::kUserCode) sink = UserWork(i);
      if (between == Between::kSpin) {
        for (const double until = NowUs() + work_us; NowUs() < until;) {
        }
      }
      RDMARPC_STAGE_RECORD(block > 0 && between == Between::kNothing);
      const double t0 = NowUs();
      RDMARPC_STAGE(kRoundTripBegin);
      side.Send();
      side.Receive();
      RDMARPC_STAGE(kRoundTripEnd);
      if (block > 0) rtts[static_cast<int>(between)].push_back(NowUs() - t0);
    }
  }
  (void)sink;
  RDMARPC_STAGE_DUMP("probe_bare");
  for (Side& side : sides) rdma_disconnect(side.id);
  server.join();
  for (Side& side : sides) side.Teardown();
  rdma_destroy_id(listener);
  rdma_destroy_event_channel(client_ch);
  rdma_destroy_event_channel(server_ch);

  printf("probe_bare_rtt_p50_us %.2f\n", Median(rtts[static_cast<int>(Between::kNothing)]));
  printf("probe_user_code_us %.2f\n", work_us);
  printf("probe_rtt_after_user_code_p50_us %.2f\n",
         Median(rtts[static_cast<int>(Between::kUserCode)]));
  printf("probe_rtt_after_spin_p50_us %.2f\n", Median(rtts[static_cast<int>(Between::kSpin)]));
  if (connections == 2) {
    printf("probe_default_shape_bare_rtt_p50_us %.2f\n",
           Median(rtts[static_cast<int>(Between::kNothingDefaultShape)]));
  }
  return 0;
}
