#include "transport/rdma/bench/bare_pingpong.h"

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/stage_trace.h"

namespace rdmarpc::transport::rdma {
namespace {

constexpr int kReceives = 16;

double NowUs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

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
  std::string where;  // for errors: the address and the device

  absl::Status Fail(const char* what) const {
    return absl::UnavailableError(absl::StrCat(what, " failed on ", where, ": ", strerror(errno),
                                               ". Is an RDMA device active on that address "
                                               "(`rdma link`, `ibv_devinfo`)?"));
  }

  absl::Status Setup(rdma_cm_id* cm_id, int message_size, const BarePingPong::Shape& shape,
                     const std::string& address) {
    id = cm_id;
    size = message_size;
    signal_every = shape.signal_every;
    where = absl::StrCat(address, " (", ibv_get_device_name(id->verbs->device), ")");
    if (!(pd = ibv_alloc_pd(id->verbs))) return Fail("ibv_alloc_pd");
    if (shape.comp_channel && !(channel = ibv_create_comp_channel(id->verbs))) {
      return Fail("ibv_create_comp_channel");
    }
    const int cq_entries = shape.cq_entries > 0 ? shape.cq_entries : kReceives + shape.sq_depth;
    if (!(cq = ibv_create_cq(id->verbs, cq_entries, nullptr, channel, 0))) {
      return Fail("ibv_create_cq");
    }
    if (shape.srq) {
      ibv_srq_init_attr sa{};
      sa.attr.max_wr = kReceives;
      sa.attr.max_sge = 1;
      if (!(srq = ibv_create_srq(pd, &sa))) return Fail("ibv_create_srq");
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
    if (rdma_create_qp(id, pd, &a) != 0) return Fail("rdma_create_qp");
    buf.assign(static_cast<size_t>(kReceives + 1) * size, 'p');
    if (!(mr = ibv_reg_mr(pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE))) {
      return Fail("ibv_reg_mr");
    }
    for (int i = 0; i < kReceives; ++i) {
      if (absl::Status s = PostReceive(i); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  absl::Status PostReceive(int slot) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf.data() + size_t(slot) * size),
                static_cast<uint32_t>(size), mr->lkey};
    ibv_recv_wr wr{};
    wr.wr_id = static_cast<uint64_t>(slot);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    const int rc = srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(id->qp, &wr, &bad);
    if (rc != 0) {
      errno = rc;
      return Fail("ibv_post_recv");
    }
    return absl::OkStatus();
  }

  absl::Status Send() {
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
    const int rc = ibv_post_send(id->qp, &wr, &bad);
    RDMARPC_STAGE(kPostEnd);
    if (rc != 0) {
      errno = rc;
      return Fail("ibv_post_send");
    }
    return absl::OkStatus();
  }

  // Polls once; true in *received when a message arrived (a ping-pong has at
  // most one in flight per queue pair). Send completions are only counted off.
  absl::Status Poll(bool* received) {
    ibv_wc wc[16];
    RDMARPC_STAGE(kPoll);
    const int n = ibv_poll_cq(cq, 16, wc);
    if (n < 0) return Fail("ibv_poll_cq");
    *received = false;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        return absl::UnavailableError(
            absl::StrCat("a completion failed on ", where, ": ", ibv_wc_status_str(wc[i].status)));
      }
      if (wc[i].opcode == IBV_WC_RECV) {
        RDMARPC_STAGE(kRecvPolled);
        if (absl::Status s = PostReceive(static_cast<int>(wc[i].wr_id)); !s.ok()) return s;
        *received = true;
      }
    }
    return absl::OkStatus();
  }

  void Teardown() {
    if (id == nullptr) return;
    if (id->qp) rdma_destroy_qp(id);
    if (mr) ibv_dereg_mr(mr);
    if (srq) ibv_destroy_srq(srq);
    if (cq) ibv_destroy_cq(cq);
    if (channel) ibv_destroy_comp_channel(channel);
    if (pd) ibv_dealloc_pd(pd);
    rdma_destroy_id(id);
    id = nullptr;
  }
};

absl::Status Expect(rdma_event_channel* ch, rdma_cm_event_type type, const std::string& address,
                    rdma_cm_event** out = nullptr) {
  rdma_cm_event* ev = nullptr;
  if (rdma_get_cm_event(ch, &ev) != 0) {
    return absl::UnavailableError(
        absl::StrCat("rdma_get_cm_event on ", address, ": ", strerror(errno)));
  }
  if (ev->event != type) {
    absl::Status s = absl::UnavailableError(absl::StrCat(
        "expected ", rdma_event_str(type), ", got ", rdma_event_str(ev->event), " (status ",
        ev->status, ") on ", address, ". Is an RDMA device active on that address (`rdma link`)?"));
    rdma_ack_cm_event(ev);
    return s;
  }
  if (out != nullptr) {
    *out = ev;
  } else {
    rdma_ack_cm_event(ev);
  }
  return absl::OkStatus();
}

}  // namespace

struct BarePingPong::Impl {
  std::string address;
  rdma_event_channel* server_ch = nullptr;
  rdma_event_channel* client_ch = nullptr;
  rdma_cm_id* listener = nullptr;
  std::vector<Side> servers;
  std::vector<Side> clients;
  std::thread server_thread;

  // The block the server thread is to serve; -1 connection: stop.
  std::mutex mu;
  std::condition_variable cv;
  bool block_ready = false;
  int block_connection = 0;
  int block_round_trips = 0;
  absl::Status server_status;  // under mu: why the server thread stopped early
  std::atomic<bool> server_failed{false};
  // Set by Stop: a block the client left unfinished (its post or poll
  // failed) would otherwise keep the server spinning for ever.
  std::atomic<bool> stopping{false};
  size_t established = 0;  // connections fully set up, each to be disconnected

  void Serve() {
    for (;;) {
      int c;
      int n;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return block_ready; });
        block_ready = false;
        c = block_connection;
        n = block_round_trips;
      }
      if (c < 0) return;
      Side& side = servers[static_cast<size_t>(c)];
      for (int i = 0; i < n && !stopping.load(std::memory_order_relaxed);) {
        bool received = false;
        absl::Status s = side.Poll(&received);
        if (s.ok() && received) {
          s = side.Send();
          ++i;
        }
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          server_status = s;
          server_failed.store(true);
          return;
        }
      }
    }
  }

  void Stop() {
    if (server_thread.joinable()) {
      stopping.store(true);
      {
        std::lock_guard<std::mutex> lock(mu);
        block_ready = true;
        block_connection = -1;
      }
      cv.notify_one();
      server_thread.join();
    }
    for (Side& c : clients) {
      if (c.id) rdma_disconnect(c.id);
    }
    // Each disconnect is seen by the server side; its ids are destroyed
    // after, so that no event is left for an id already gone.
    for (size_t i = 0; i < established; ++i) {
      if (!Expect(server_ch, RDMA_CM_EVENT_DISCONNECTED, address).ok()) break;
    }
    for (Side& s : servers) s.Teardown();
    for (Side& c : clients) c.Teardown();
    if (listener) rdma_destroy_id(listener);
    if (client_ch) rdma_destroy_event_channel(client_ch);
    if (server_ch) rdma_destroy_event_channel(server_ch);
  }
};

BarePingPong::BarePingPong(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BarePingPong::~BarePingPong() { impl_->Stop(); }

absl::StatusOr<std::unique_ptr<BarePingPong>> BarePingPong::Start(
    const std::string& ipv4_address, int message_size, const std::vector<Shape>& shapes) {
  for (const Shape& s : shapes) {
    if (s.sq_depth < 1 || s.signal_every < 1 || s.signal_every > s.sq_depth) {
      // Unsignaled SENDs hold their send queue entries until a signaled one
      // completes, so more of them than the queue holds could never post.
      return absl::InvalidArgumentError(absl::StrCat("signal_every ", s.signal_every,
                                                     " must be from 1 to sq_depth ", s.sq_depth));
    }
  }
  if (shapes.empty() || message_size < 1) {
    return absl::InvalidArgumentError("a ping-pong needs a shape and a message of 1 byte or more");
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, ipv4_address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("an IPv4 address is needed, not '", ipv4_address, "'"));
  }
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  // From here on, m.Stop() (through the destructor) frees what was made.
  std::unique_ptr<BarePingPong> pp(new BarePingPong(std::move(impl)));
  m.address = ipv4_address;
  const auto fail = [&](const char* what) {
    return absl::UnavailableError(absl::StrCat(what, " failed for ", ipv4_address, ": ",
                                               strerror(errno),
                                               ". Is an RDMA device active on that address "
                                               "(`rdma link`, `ibv_devinfo`)?"));
  };
  if (!(m.server_ch = rdma_create_event_channel()) ||
      !(m.client_ch = rdma_create_event_channel())) {
    return fail("rdma_create_event_channel");
  }
  if (rdma_create_id(m.server_ch, &m.listener, nullptr, RDMA_PS_TCP) != 0) {
    return fail("rdma_create_id");
  }
  if (rdma_bind_addr(m.listener, reinterpret_cast<sockaddr*>(&addr)) != 0) {
    return fail("rdma_bind_addr");
  }
  if (rdma_listen(m.listener, static_cast<int>(shapes.size())) != 0) return fail("rdma_listen");
  addr.sin_port = rdma_get_src_port(m.listener);

  m.servers.resize(shapes.size());
  m.clients.resize(shapes.size());
  for (size_t c = 0; c < shapes.size(); ++c) {
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(m.client_ch, &id, nullptr, RDMA_PS_TCP) != 0) return fail("rdma_create_id");
    m.clients[c].id = id;
    if (rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&addr), 2000) != 0) {
      return fail("rdma_resolve_addr");
    }
    if (absl::Status s = Expect(m.client_ch, RDMA_CM_EVENT_ADDR_RESOLVED, ipv4_address); !s.ok()) {
      return s;
    }
    if (rdma_resolve_route(id, 2000) != 0) return fail("rdma_resolve_route");
    if (absl::Status s = Expect(m.client_ch, RDMA_CM_EVENT_ROUTE_RESOLVED, ipv4_address); !s.ok()) {
      return s;
    }
    if (absl::Status s = m.clients[c].Setup(id, message_size, shapes[c], ipv4_address); !s.ok()) {
      return s;
    }
    // Retried as rping's and rdmarpc's queue pairs are: with rdma_cm's
    // default of none, one ACK late past its timeout (a slow spell of the
    // emulator, under TSan) ended the ping-pong, "transport retry counter
    // exceeded". 6, not 7: Soft-RoCE takes 7 as "for ever" (rdma_options.h).
    rdma_conn_param param{};
    param.retry_count = 6;
    param.rnr_retry_count = 7;
    if (rdma_connect(id, &param) != 0) return fail("rdma_connect");
    // The request reaches the listener; accepted on this thread, then the
    // client's side completes.
    rdma_cm_event* ev = nullptr;
    if (absl::Status s = Expect(m.server_ch, RDMA_CM_EVENT_CONNECT_REQUEST, ipv4_address, &ev);
        !s.ok()) {
      return s;
    }
    rdma_cm_id* server_id = ev->id;
    rdma_ack_cm_event(ev);
    m.servers[c].id = server_id;
    if (absl::Status s = m.servers[c].Setup(server_id, message_size, shapes[c], ipv4_address);
        !s.ok()) {
      return s;
    }
    if (rdma_accept(server_id, &param) != 0) return fail("rdma_accept");
    if (absl::Status s = Expect(m.client_ch, RDMA_CM_EVENT_ESTABLISHED, ipv4_address); !s.ok()) {
      return s;
    }
    if (absl::Status s = Expect(m.server_ch, RDMA_CM_EVENT_ESTABLISHED, ipv4_address); !s.ok()) {
      return s;
    }
    ++m.established;
  }
  m.server_thread = std::thread([&m] { m.Serve(); });
  return pp;
}

absl::Status BarePingPong::RunBlock(int connection, int round_trips,
                                    const std::function<void(int)>& between,
                                    std::vector<double>* rtt_us) {
  Impl& m = *impl_;
  if (connection < 0 || static_cast<size_t>(connection) >= m.clients.size()) {
    return absl::InvalidArgumentError(absl::StrCat("no connection ", connection));
  }
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (!m.server_status.ok()) return m.server_status;
    m.block_ready = true;
    m.block_connection = connection;
    m.block_round_trips = round_trips;
  }
  m.cv.notify_one();
  Side& side = m.clients[static_cast<size_t>(connection)];
  for (int i = 0; i < round_trips; ++i) {
    if (between) between(i);
    const double t0 = NowUs();
    RDMARPC_STAGE(kRoundTripBegin);
    if (absl::Status s = side.Send(); !s.ok()) return s;
    for (bool received = false; !received;) {
      if (absl::Status s = side.Poll(&received); !s.ok()) return s;
      // A server that failed answers no more.
      if (!received && m.server_failed.load(std::memory_order_relaxed)) {
        std::lock_guard<std::mutex> lock(m.mu);
        return m.server_status;
      }
    }
    RDMARPC_STAGE(kRoundTripEnd);
    if (rtt_us != nullptr) rtt_us->push_back(NowUs() - t0);
  }
  return absl::OkStatus();
}

}  // namespace rdmarpc::transport::rdma
