// Verbs smoke test, written against rdma-core alone (no rdmarpc code): proves
// that the machine or VM it runs on can do everything the RDMA transport
// relies on. rdma_cm listen / resolve / connect / accept; a server QP attached
// to an SRQ with pre-posted receive buffers; a client SEND into it carrying the
// (addr, rkey, length) of a registered buffer; the server RDMA READs it; both
// sides check bytes; orderly disconnect and teardown.
//
// The negative cases advertise a wrong rkey or a length past the end of the
// registered buffer and require the READ to fail with a remote access error:
// the NIC, not our code, must be what enforces the boundary.
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "transport/rdma/testing/rdma_test_env.h"

namespace {

constexpr int kSrqSlots = 16;
constexpr size_t kSlotSize = 4096;
constexpr size_t kPayloadSize = 256 * 1024;  // several MTUs, one READ
constexpr int kTimeoutMs = 20000;

// The small message the client SENDs: the advertisement plus a greeting.
struct Advert {
  uint64_t addr;
  uint32_t rkey;
  uint32_t length;
  char greeting[32];
};

enum class Fault { kNone, kBadRkey, kLengthPastEnd };

uint8_t PatternByte(size_t i) { return static_cast<uint8_t>((i * 131 + 7) & 0xff); }

#define CHECK_OK(expr)                                                       \
  do {                                                                       \
    if ((expr) != 0) {                                                       \
      ADD_FAILURE() << #expr << " failed: " << strerror(errno);              \
      return false;                                                          \
    }                                                                        \
  } while (0)
#define CHECK_PTR(expr)                                                      \
  do {                                                                       \
    if ((expr) == nullptr) {                                                 \
      ADD_FAILURE() << #expr << " returned null: " << strerror(errno);       \
      return false;                                                          \
    }                                                                        \
  } while (0)

bool WaitEvent(rdma_event_channel* ch, rdma_cm_event_type want, rdma_cm_id** id_out) {
  rdma_cm_event* ev = nullptr;
  CHECK_OK(rdma_get_cm_event(ch, &ev));
  const rdma_cm_event_type got = ev->event;
  const int status = ev->status;
  if (id_out) *id_out = ev->id;
  rdma_ack_cm_event(ev);
  if (got != want) {
    ADD_FAILURE() << "expected " << rdma_event_str(want) << ", got " << rdma_event_str(got)
                  << " (status " << status << ")";
    return false;
  }
  return true;
}

bool PollOne(ibv_cq* cq, ibv_wc* wc) {
  for (long spins = 0;; ++spins) {
    const int n = ibv_poll_cq(cq, 1, wc);
    if (n < 0) {
      ADD_FAILURE() << "ibv_poll_cq failed";
      return false;
    }
    if (n == 1) return true;
    if (spins > 2000000000L) {
      ADD_FAILURE() << "no completion";
      return false;
    }
    // Soft-RoCE does its work in kernel threads: leave them the CPU.
    if ((spins & 0xff) == 0) std::this_thread::yield();
  }
}

std::string GidString(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN];
  inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
  return buf;
}

// The GID index rdma_cm chose for this id: the port's table entry that equals
// the route's source GID.
int FindGidIndex(rdma_cm_id* id, ibv_gid* gid_out) {
  ibv_port_attr port;
  if (ibv_query_port(id->verbs, id->port_num, &port) != 0) return -1;
  for (int i = 0; i < port.gid_tbl_len; ++i) {
    ibv_gid gid;
    if (ibv_query_gid(id->verbs, id->port_num, i, &gid) != 0) continue;
    if (memcmp(&gid, &id->route.addr.addr.ibaddr.sgid, sizeof gid) == 0) {
      *gid_out = gid;
      return i;
    }
  }
  return -1;
}

// Client side: connect, advertise the payload, wait for the server's verdict.
struct Client {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* id = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  std::vector<uint8_t> payload = std::vector<uint8_t>(kPayloadSize);
  Advert send_msg{};
  uint32_t verdict = 0;
  std::string completion_error;
  ibv_mr* payload_mr = nullptr;
  ibv_mr* send_mr = nullptr;
  ibv_mr* recv_mr = nullptr;

  bool Run(const std::string& server_ip, uint16_t port, Fault fault) {
    for (size_t i = 0; i < payload.size(); ++i) payload[i] = PatternByte(i);
    CHECK_PTR(ch = rdma_create_event_channel());
    CHECK_OK(rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP));
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(port);
    inet_pton(AF_INET, server_ip.c_str(), &dst.sin_addr);
    CHECK_OK(rdma_resolve_addr(id, nullptr, reinterpret_cast<sockaddr*>(&dst), kTimeoutMs));
    if (!WaitEvent(ch, RDMA_CM_EVENT_ADDR_RESOLVED, nullptr)) return false;
    CHECK_OK(rdma_resolve_route(id, kTimeoutMs));
    if (!WaitEvent(ch, RDMA_CM_EVENT_ROUTE_RESOLVED, nullptr)) return false;

    CHECK_PTR(pd = ibv_alloc_pd(id->verbs));
    CHECK_PTR(cq = ibv_create_cq(id->verbs, 8, nullptr, nullptr, 0));
    ibv_qp_init_attr qpa{};
    qpa.send_cq = cq;
    qpa.recv_cq = cq;
    qpa.qp_type = IBV_QPT_RC;
    qpa.cap.max_send_wr = 4;
    qpa.cap.max_recv_wr = 4;
    qpa.cap.max_send_sge = 1;
    qpa.cap.max_recv_sge = 1;
    CHECK_OK(rdma_create_qp(id, pd, &qpa));

    // Only the payload is remotely readable, and only its own bytes.
    CHECK_PTR(payload_mr = ibv_reg_mr(pd, payload.data(), payload.size(), IBV_ACCESS_REMOTE_READ));
    CHECK_PTR(send_mr = ibv_reg_mr(pd, &send_msg, sizeof send_msg, 0));
    CHECK_PTR(recv_mr = ibv_reg_mr(pd, &verdict, sizeof verdict, IBV_ACCESS_LOCAL_WRITE));

    ibv_sge rsge{reinterpret_cast<uintptr_t>(&verdict), sizeof verdict, recv_mr->lkey};
    ibv_recv_wr rwr{};
    rwr.sg_list = &rsge;
    rwr.num_sge = 1;
    ibv_recv_wr* bad_r = nullptr;
    CHECK_OK(ibv_post_recv(id->qp, &rwr, &bad_r));

    rdma_conn_param cp{};
    cp.responder_resources = 1;
    cp.initiator_depth = 1;
    cp.retry_count = 7;
    cp.rnr_retry_count = 7;
    CHECK_OK(rdma_connect(id, &cp));
    if (!WaitEvent(ch, RDMA_CM_EVENT_ESTABLISHED, nullptr)) return false;

    send_msg.addr = reinterpret_cast<uintptr_t>(payload.data());
    send_msg.rkey = payload_mr->rkey;
    send_msg.length = static_cast<uint32_t>(payload.size());
    if (fault == Fault::kBadRkey) send_msg.rkey ^= 0x5a5a00;
    if (fault == Fault::kLengthPastEnd) send_msg.length += 4096;
    snprintf(send_msg.greeting, sizeof send_msg.greeting, "hello over SRQ");

    ibv_sge ssge{reinterpret_cast<uintptr_t>(&send_msg), sizeof send_msg, send_mr->lkey};
    ibv_send_wr swr{};
    swr.sg_list = &ssge;
    swr.num_sge = 1;
    swr.opcode = IBV_WR_SEND;
    swr.send_flags = IBV_SEND_SIGNALED;
    ibv_send_wr* bad_s = nullptr;
    CHECK_OK(ibv_post_send(id->qp, &swr, &bad_s));

    // Two completions: our SEND, then the server's verdict.
    for (int got = 0; got < 2; ++got) {
      ibv_wc wc{};
      if (!PollOne(cq, &wc)) return false;
      if (wc.status != IBV_WC_SUCCESS) {
        // Expected in the fault cases; the test body judges it.
        completion_error = ibv_wc_status_str(wc.status);
        return false;
      }
    }
    return true;
  }

  void Teardown() {
    if (id && id->qp) {
      rdma_disconnect(id);
      WaitEvent(ch, RDMA_CM_EVENT_DISCONNECTED, nullptr);
      rdma_destroy_qp(id);
    }
    for (ibv_mr* mr : {payload_mr, send_mr, recv_mr})
      if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (id) rdma_destroy_id(id);
    if (ch) rdma_destroy_event_channel(ch);
  }
};

// Server side: listen, accept onto an SRQ-attached QP, READ what is advertised.
struct Server {
  rdma_event_channel* ch = nullptr;
  rdma_cm_id* listen_id = nullptr;
  rdma_cm_id* conn = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_srq* srq = nullptr;
  std::vector<uint8_t> slots = std::vector<uint8_t>(kSrqSlots * kSlotSize);
  std::vector<uint8_t> sink = std::vector<uint8_t>(kPayloadSize + 8192);
  uint32_t verdict = 0;
  ibv_mr* slots_mr = nullptr;
  ibv_mr* sink_mr = nullptr;
  ibv_mr* verdict_mr = nullptr;
  uint16_t port = 0;
  ibv_wc_status read_status = IBV_WC_SUCCESS;

  bool Listen(const std::string& ip) {
    CHECK_PTR(ch = rdma_create_event_channel());
    CHECK_OK(rdma_create_id(ch, &listen_id, nullptr, RDMA_PS_TCP));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
    CHECK_OK(rdma_bind_addr(listen_id, reinterpret_cast<sockaddr*>(&a)));
    CHECK_OK(rdma_listen(listen_id, 4));
    port = ntohs(rdma_get_src_port(listen_id));
    return true;
  }

  bool AcceptAndRead(Fault fault) {
    if (!WaitEvent(ch, RDMA_CM_EVENT_CONNECT_REQUEST, &conn)) return false;
    CHECK_PTR(pd = ibv_alloc_pd(conn->verbs));
    CHECK_PTR(cq = ibv_create_cq(conn->verbs, 2 * kSrqSlots, nullptr, nullptr, 0));
    ibv_srq_init_attr sa{};
    sa.attr.max_wr = kSrqSlots;
    sa.attr.max_sge = 1;
    CHECK_PTR(srq = ibv_create_srq(pd, &sa));
    CHECK_PTR(slots_mr = ibv_reg_mr(pd, slots.data(), slots.size(), IBV_ACCESS_LOCAL_WRITE));
    CHECK_PTR(sink_mr = ibv_reg_mr(pd, sink.data(), sink.size(), IBV_ACCESS_LOCAL_WRITE));
    CHECK_PTR(verdict_mr = ibv_reg_mr(pd, &verdict, sizeof verdict, 0));
    for (int i = 0; i < kSrqSlots; ++i) {
      ibv_sge sge{reinterpret_cast<uintptr_t>(slots.data() + i * kSlotSize), kSlotSize,
                  slots_mr->lkey};
      ibv_recv_wr wr{};
      wr.wr_id = i;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      ibv_recv_wr* bad = nullptr;
      CHECK_OK(ibv_post_srq_recv(srq, &wr, &bad));
    }
    ibv_qp_init_attr qpa{};
    qpa.send_cq = cq;
    qpa.recv_cq = cq;
    qpa.srq = srq;
    qpa.qp_type = IBV_QPT_RC;
    qpa.cap.max_send_wr = 4;
    qpa.cap.max_send_sge = 1;
    CHECK_OK(rdma_create_qp(conn, pd, &qpa));
    rdma_conn_param cp{};
    cp.responder_resources = 1;
    cp.initiator_depth = 1;
    cp.rnr_retry_count = 7;
    CHECK_OK(rdma_accept(conn, &cp));
    if (!WaitEvent(ch, RDMA_CM_EVENT_ESTABLISHED, nullptr)) return false;

    ibv_gid gid{};
    const int gid_index = FindGidIndex(conn, &gid);
    ibv_port_attr pattr{};
    ibv_query_port(conn->verbs, conn->port_num, &pattr);
    printf("smoke: device %s port %d gid_index %d gid %s active_mtu %d\n",
           ibv_get_device_name(conn->verbs->device), conn->port_num, gid_index,
           GidString(gid).c_str(), 128 << pattr.active_mtu);
    EXPECT_GE(gid_index, 0) << "route source GID not in the port's GID table";

    ibv_wc wc{};
    if (!PollOne(cq, &wc)) return false;
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    EXPECT_EQ(wc.opcode, IBV_WC_RECV);
    EXPECT_EQ(wc.qp_num, conn->qp->qp_num);
    EXPECT_EQ(wc.byte_len, sizeof(Advert));
    Advert adv;
    memcpy(&adv, slots.data() + wc.wr_id * kSlotSize, sizeof adv);
    EXPECT_STREQ(adv.greeting, "hello over SRQ");
    if (adv.length > sink.size()) {
      ADD_FAILURE() << "advertised length " << adv.length << " exceeds sink";
      return false;
    }

    ibv_sge rsge{reinterpret_cast<uintptr_t>(sink.data()), adv.length, sink_mr->lkey};
    ibv_send_wr rd{};
    rd.opcode = IBV_WR_RDMA_READ;
    rd.sg_list = &rsge;
    rd.num_sge = 1;
    rd.send_flags = IBV_SEND_SIGNALED;
    rd.wr.rdma.remote_addr = adv.addr;
    rd.wr.rdma.rkey = adv.rkey;
    ibv_send_wr* bad = nullptr;
    CHECK_OK(ibv_post_send(conn->qp, &rd, &bad));
    if (!PollOne(cq, &wc)) return false;
    read_status = wc.status;
    printf("smoke: RDMA READ of %u bytes: %s\n", adv.length, ibv_wc_status_str(wc.status));
    if (fault != Fault::kNone) return true;  // the QP is now in error: no verdict

    EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
    size_t mismatches = 0;
    for (size_t i = 0; i < kPayloadSize; ++i) mismatches += sink[i] != PatternByte(i);
    EXPECT_EQ(mismatches, 0u) << "READ brought wrong bytes";
    verdict = mismatches == 0 ? 0x600dda7a : 0xbad;

    ibv_sge vsge{reinterpret_cast<uintptr_t>(&verdict), sizeof verdict, verdict_mr->lkey};
    ibv_send_wr vs{};
    vs.opcode = IBV_WR_SEND;
    vs.sg_list = &vsge;
    vs.num_sge = 1;
    vs.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    CHECK_OK(ibv_post_send(conn->qp, &vs, &bad));
    if (!PollOne(cq, &wc)) return false;
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
    return true;
  }

  void Teardown() {
    if (conn && conn->qp) {
      // Answering the peer's DREQ at once; without it the peer waits for the
      // CM's DREP timeout (about 100 s on rxe).
      WaitEvent(ch, RDMA_CM_EVENT_DISCONNECTED, nullptr);
      rdma_disconnect(conn);
      rdma_destroy_qp(conn);
    }
    if (srq) ibv_destroy_srq(srq);
    for (ibv_mr* mr : {slots_mr, sink_mr, verdict_mr})
      if (mr) ibv_dereg_mr(mr);
    if (cq) ibv_destroy_cq(cq);
    if (pd) ibv_dealloc_pd(pd);
    if (conn) rdma_destroy_id(conn);
    if (listen_id) rdma_destroy_id(listen_id);
    if (ch) rdma_destroy_event_channel(ch);
  }
};

class VerbsSmokeTest : public ::testing::TestWithParam<Fault> {};

TEST_P(VerbsSmokeTest, SendIntoSrqThenReadAdvertisedBuffer) {
  const std::string ip = rdmarpc::rdma::testing::RequireRdmaTestAddress();
  ASSERT_FALSE(ip.empty());
  const Fault fault = GetParam();

  Server server;
  ASSERT_TRUE(server.Listen(ip));
  Client client;
  bool client_ok = false;
  std::thread client_thread([&] {
    client_ok = client.Run(ip, server.port, fault);
    client.Teardown();
  });
  const bool server_ok = server.AcceptAndRead(fault);
  // After a failed READ the server's QP is in error and no verdict comes: the
  // server hangs up first, which ends the client's wait.
  if (fault != Fault::kNone && server.conn) rdma_disconnect(server.conn);
  server.Teardown();
  client_thread.join();

  ASSERT_TRUE(server_ok);
  if (fault == Fault::kNone) {
    EXPECT_TRUE(client_ok) << client.completion_error;
    EXPECT_EQ(server.read_status, IBV_WC_SUCCESS);
    EXPECT_EQ(client.verdict, 0x600dda7au) << "server did not confirm the bytes";
  } else {
    EXPECT_EQ(server.read_status, IBV_WC_REM_ACCESS_ERR)
        << "a READ outside the advertised registration must be refused by the NIC, got "
        << ibv_wc_status_str(server.read_status);
    EXPECT_FALSE(client_ok) << "client must not see a verdict after a failed READ";
  }
}

INSTANTIATE_TEST_SUITE_P(Faults, VerbsSmokeTest,
                         ::testing::Values(Fault::kNone, Fault::kBadRkey, Fault::kLengthPastEnd),
                         [](const ::testing::TestParamInfo<Fault>& info) {
                           switch (info.param) {
                             case Fault::kNone: return "Honest";
                             case Fault::kBadRkey: return "BadRkey";
                             case Fault::kLengthPastEnd: return "LengthPastEnd";
                           }
                           return "Unknown";
                         });

}  // namespace
