// A hostile or broken rdmarpc peer for tests: one rdma_cm connection to (or
// from) an rdmarpc transport, driven by hand with raw verbs, so that a test
// can send what no rdmarpc client would (frames written byte by byte, bad
// advertisements, a foreign handshake) and stop where none would (before
// its RTU, or as if its machine died).
//
//   RawPeer peer;
//   ASSERT_EQ(peer.Connect(server_address), "");
//   ASSERT_TRUE(peer.Send(Frame(SmallRequest(1, 0))));
//   std::optional<Header> answer = peer.NextFrame(absl::Seconds(10));
//
// Every wait is bounded; nothing here is safe for more than one thread.
#ifndef RDMARPC_TRANSPORT_RDMA_TESTING_RAW_PEER_H_
#define RDMARPC_TRANSPORT_RDMA_TESTING_RAW_PEER_H_

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <sched.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "transport/address.h"
#include "transport/rdma/rdma_connection.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport::rdma::testing {

inline constexpr uint32_t kRawSlot = 4096;  // what the raw peer receives at most
inline constexpr int kRawRecvs = 16;
inline constexpr uint32_t kRawReadMax = 64 * 1024;  // what the raw peer READs at most

// One rdma_cm connection to (or from) an rdmarpc peer, driven by hand.
class RawPeer {
 public:
  // Sent in rdma_connect / rdma_accept instead of a valid rdmarpc handshake.
  std::optional<std::string> private_data;
  // The text of the last REJ's private data (Connect's "rejected"), up to
  // its first zero byte.
  std::string rejection;
  // The window the rdmarpc side granted in its handshake: the frames on
  // credit this peer may send before it has any credit back. 0 before
  // Connect or Accept has succeeded.
  uint32_t granted_window = 0;
  // The credits the rdmarpc side has returned so far, in the frames this
  // peer has taken off its CQ (Send, NextFrame, AwaitCredits).
  uint64_t credits_received = 0;

  ~RawPeer() {
    if (id_ != nullptr && id_->qp != nullptr) rdma_destroy_qp(id_);
    if (lose_rtu && qp_ != nullptr) ibv_destroy_qp(qp_);
    if (send_mr_) ibv_dereg_mr(send_mr_);
    if (recv_mr_) ibv_dereg_mr(recv_mr_);
    if (read_mr_) ibv_dereg_mr(read_mr_);
    if (exposed_mr_) ibv_dereg_mr(exposed_mr_);
    if (cq_) ibv_destroy_cq(cq_);
    if (pd_) ibv_dealloc_pd(pd_);
    if (id_) rdma_destroy_id(id_);
    if (listen_id_) rdma_destroy_id(listen_id_);
    if (channel_) rdma_destroy_event_channel(channel_);
  }

  // Connect returns once its request is out, and reads no CM event after:
  // as a client process that stops there, it never sends the RTU.
  bool stall_before_rtu = false;
  // Connect readies its QP on the server's REP, as rdma_cm would, and then
  // sends no RTU: as if the RTU were lost on the way.
  bool lose_rtu = false;

  // What this peer's handshake grants: a window, and the largest one it
  // may grow to (the rdmarpc side holds no more credits than that).
  uint32_t our_window = kRawRecvs;
  uint32_t our_largest_window = kRawRecvs;

  // Posts no receive until PostReceives: the credits the handshake grants
  // are not backed, and the server's SENDs meet RNR NAKs until then.
  bool withhold_receives = false;

  // Connects with a valid rdmarpc handshake, asking for `retry_count`
  // transport retries; "" or what failed.
  std::string Connect(const Address& server, uint8_t retry_count = 7) {
    if (!(channel_ = rdma_create_event_channel())) return "rdma_create_event_channel";
    if (rdma_create_id(channel_, &id_, nullptr, RDMA_PS_TCP) != 0) return "rdma_create_id";
    sockaddr_in dst{};
    dst.sin_family = AF_INET;
    dst.sin_port = htons(server.port);
    if (inet_pton(AF_INET, server.host.c_str(), &dst.sin_addr) != 1) return "address";
    if (rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&dst), 2000) != 0 ||
        !Await(RDMA_CM_EVENT_ADDR_RESOLVED)) {
      return "resolve address";
    }
    if (rdma_resolve_route(id_, 2000) != 0 || !Await(RDMA_CM_EVENT_ROUTE_RESOLVED)) {
      return "resolve route";
    }
    if (std::string error = CreateQp(); !error.empty()) return error;
    rdma_conn_param param = ConnParam();
    param.retry_count = retry_count;
    if (lose_rtu) param.qp_num = qp_->qp_num;
    if (rdma_connect(id_, &param) != 0) return "connect";
    if (stall_before_rtu) return "";
    if (lose_rtu) {
      // rdma_cm leaves a QP it did not make to us: it reports the REP and
      // waits for rdma_establish, the RTU, which never comes.
      if (!Await(RDMA_CM_EVENT_CONNECT_RESPONSE)) return "no connect response";
      // INIT again first, as librdmacm does: only now does rdma_cm know the
      // access the connection grants (the server's keepalive WRITEs).
      return MoveQp(IBV_QPS_INIT) && MoveQp(IBV_QPS_RTR) && MoveQp(IBV_QPS_RTS) ? ""
                                                                                : "ready the QP";
    }
    switch (NextEvent()) {
      case RDMA_CM_EVENT_ESTABLISHED:
        return "";
      case RDMA_CM_EVENT_REJECTED:
        return "rejected";
      default:
        return "connect";
    }
  }

  // As a server: listens on `ip` and returns the address to connect to.
  std::optional<Address> Listen(const std::string& ip) {
    if (!(channel_ = rdma_create_event_channel())) return std::nullopt;
    if (rdma_create_id(channel_, &listen_id_, nullptr, RDMA_PS_TCP) != 0) return std::nullopt;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    if (inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) != 1 ||
        rdma_bind_addr(listen_id_, reinterpret_cast<sockaddr*>(&addr)) != 0 ||
        rdma_listen(listen_id_, 4) != 0) {
      return std::nullopt;
    }
    return ParseAddress(absl::StrCat("rdma://", ip, ":", ntohs(rdma_get_src_port(listen_id_))))
        .value();
  }

  // Accepts one connection with a valid rdmarpc handshake; "" or what failed.
  std::string Accept() {
    if (!Await(RDMA_CM_EVENT_CONNECT_REQUEST, absl::Seconds(10), &id_)) return "no connection";
    if (std::string error = CreateQp(); !error.empty()) return error;
    rdma_conn_param param = ConnParam();
    if (rdma_accept(id_, &param) != 0 || !Await(RDMA_CM_EVENT_ESTABLISHED)) return "accept";
    return "";
  }

  // Posts the receives that withhold_receives kept back.
  void PostReceives() {
    for (int i = 0; i < kRawRecvs; ++i) PostRecv(i);
  }

  // As if this machine died: the QP stops answering, and no disconnect is
  // sent (the rdma_cm id lives on until the peer is destroyed).
  bool Vanish() {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(qp_, &attr, IBV_QP_STATE) == 0;
  }

  // One SEND of exactly `frame`; true once the device has sent it.
  bool Send(const std::string& frame) {
    if (frame.size() > sizeof send_buf_) return false;
    memcpy(send_buf_, frame.data(), frame.size());
    ibv_sge sge{reinterpret_cast<uintptr_t>(send_buf_), static_cast<uint32_t>(frame.size()),
                send_mr_->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = kSendId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (ibv_post_send(qp_, &wr, &bad) != 0) return false;
    return Completion(kSendId) == IBV_WC_SUCCESS;
  }

  // One RDMA READ of `length` bytes at what `remote` advertises, into
  // `*out`; the completion's status (IBV_WC_GENERAL_ERR: none came).
  ibv_wc_status Read(const RemoteDescriptor& remote, uint32_t length, std::string* out) {
    if (length > read_buf_.size()) return IBV_WC_LOC_LEN_ERR;
    ibv_sge sge{reinterpret_cast<uintptr_t>(read_buf_.data()), length, read_mr_->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = kReadId;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = remote.addr;
    wr.wr.rdma.rkey = remote.rkey;
    if (ibv_post_send(qp_, &wr, &bad) != 0) return IBV_WC_GENERAL_ERR;
    const ibv_wc_status status = Completion(kReadId);
    if (status == IBV_WC_SUCCESS) out->assign(read_buf_.data(), length);
    return status;
  }

  // `size` bytes that the server may READ; nullopt when they cannot be
  // registered.
  std::optional<RemoteDescriptor> Expose(uint32_t size) {
    exposed_.assign(size, 'x');
    exposed_mr_ = ibv_reg_mr(pd_, exposed_.data(), size, IBV_ACCESS_REMOTE_READ);
    if (exposed_mr_ == nullptr) return std::nullopt;
    return RemoteDescriptor{reinterpret_cast<uintptr_t>(exposed_.data()), exposed_mr_->rkey, 1};
  }

  // The next response or request the server sends (credit frames are
  // skipped), or nullopt after `timeout`.
  std::optional<Header> NextFrame(absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    do {
      TakeReceive();
    } while (frames_.empty() && absl::Now() < until);
    if (frames_.empty()) return std::nullopt;
    Header h = frames_.front();
    frames_.erase(frames_.begin());
    return h;
  }

  // Whether credits_received reaches `total` within `timeout`; frames that
  // come meanwhile are kept for NextFrame.
  bool AwaitCredits(uint64_t total, absl::Duration timeout) {
    const absl::Time until = absl::Now() + timeout;
    while (credits_received < total && absl::Now() < until) TakeReceive();
    return credits_received >= total;
  }

  // True when the server ends the connection within `timeout`. It says so
  // by a DREQ (DISCONNECTED here) once its CM has seen our RTU. Our first
  // frame can outrun the RTU, and a server that fails the connection before
  // its CM saw it can send no DREQ (the kernel skips it outside ESTABLISHED):
  // destroying its id then sends a REJ, which rdma_cm reports on our
  // established id as REJECTED.
  bool Disconnected(absl::Duration timeout) {
    return Await(RDMA_CM_EVENT_DISCONNECTED, timeout, nullptr, RDMA_CM_EVENT_REJECTED);
  }
  // A stall_before_rtu peer goes on: the event its connect ends with
  // (ESTABLISHED once its RTU is out), RDMA_CM_EVENT_TIMEWAIT_EXIT when
  // none comes in 10 s.
  rdma_cm_event_type GoOn() { return NextEvent(); }
  // The CM events that came while this peer waited for others, for a failed
  // test to show.
  const std::string& OtherEvents() const { return other_events_; }

 private:
  static constexpr uint64_t kSendId = ~uint64_t{0};
  static constexpr uint64_t kReadId = kSendId - 1;

  // The status of work request `id`'s completion; frames that arrive
  // meanwhile are kept.
  ibv_wc_status Completion(uint64_t id) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (absl::Now() < until) {
      ibv_wc wc{};
      if (ibv_poll_cq(cq_, 1, &wc) <= 0) {
        sched_yield();  // the server shares this machine's CPUs
        continue;
      }
      if (wc.wr_id == id) return wc.status;
      if (wc.wr_id < kRawRecvs) OnRecv(wc);
    }
    return IBV_WC_GENERAL_ERR;
  }

  std::string CreateQp() {
    pd_ = ibv_alloc_pd(id_->verbs);
    cq_ = ibv_create_cq(id_->verbs, 64, nullptr, nullptr, 0);
    send_mr_ = ibv_reg_mr(pd_, send_buf_, sizeof send_buf_, IBV_ACCESS_LOCAL_WRITE);
    recv_mr_ = ibv_reg_mr(pd_, recv_buf_.data(), recv_buf_.size(), IBV_ACCESS_LOCAL_WRITE);
    read_mr_ = ibv_reg_mr(pd_, read_buf_.data(), read_buf_.size(), IBV_ACCESS_LOCAL_WRITE);
    if (!pd_ || !cq_ || !send_mr_ || !recv_mr_ || !read_mr_) return "verbs resources";
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq_;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = 8;
    qa.cap.max_recv_wr = kRawRecvs;
    qa.cap.max_send_sge = qa.cap.max_recv_sge = 1;
    if (lose_rtu) {
      qp_ = ibv_create_qp(pd_, &qa);
      if (qp_ == nullptr || !MoveQp(IBV_QPS_INIT)) return "ibv_create_qp";
    } else {
      if (rdma_create_qp(id_, pd_, &qa) != 0) return "rdma_create_qp";
      qp_ = id_->qp;
    }
    if (!withhold_receives) PostReceives();
    return "";
  }

  // Moves a QP this peer made itself (lose_rtu) to `state`, with the
  // attributes rdma_cm has for it.
  bool MoveQp(ibv_qp_state state) {
    ibv_qp_attr attr{};
    int mask = 0;
    attr.qp_state = state;
    return rdma_init_qp_attr(id_, &attr, &mask) == 0 && ibv_modify_qp(qp_, &attr, mask) == 0;
  }

  // One READ each way at a time, with a valid rdmarpc handshake or, when
  // set, private_data instead.
  rdma_conn_param ConnParam() {
    handshake_.credits = our_window;
    handshake_.max_credits = our_largest_window;
    handshake_.slot_size = kRawSlot;
    rdma_conn_param param{};
    if (private_data.has_value()) {
      param.private_data = private_data->empty() ? nullptr : private_data->data();
      param.private_data_len = static_cast<uint8_t>(private_data->size());
    } else {
      param.private_data = &handshake_;
      param.private_data_len = sizeof handshake_;
    }
    param.responder_resources = param.initiator_depth = 1;
    param.rnr_retry_count = 7;
    return param;
  }

  void PostRecv(int i) {
    ibv_sge sge{reinterpret_cast<uintptr_t>(&recv_buf_[i * kRawSlot]), kRawSlot, recv_mr_->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = static_cast<uint64_t>(i);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_post_recv(qp_, &wr, &bad);
  }

  // One completion off the CQ, handled if it is a receive; a yield when
  // there is none (the rdmarpc side shares this machine's CPUs).
  void TakeReceive() {
    ibv_wc wc{};
    if (ibv_poll_cq(cq_, 1, &wc) > 0) {
      if (wc.wr_id < kRawRecvs) OnRecv(wc);
    } else {
      sched_yield();
    }
  }

  void OnRecv(const ibv_wc& wc) {
    if (wc.status != IBV_WC_SUCCESS) return;  // flushed at teardown
    auto h = DecodeHeader(&recv_buf_[wc.wr_id * kRawSlot], wc.byte_len);
    if (h.ok()) credits_received += h->credits;
    if (h.ok() && h->kind != MessageKind::kCredit) frames_.push_back(*h);
    PostRecv(static_cast<int>(wc.wr_id));
  }

  // granted_window, from the rdmarpc side's handshake.
  void NoteGrant(const rdma_conn_param& conn) {
    if (conn.private_data == nullptr || conn.private_data_len < sizeof(Handshake)) return;
    Handshake granted;
    memcpy(&granted, conn.private_data, sizeof granted);
    granted_window = granted.credits;
  }

  // The type of the next rdma_cm event, or RDMA_CM_EVENT_TIMEWAIT_EXIT
  // (which no connect waits for) when none comes in 10 s.
  rdma_cm_event_type NextEvent() {
    pollfd p{channel_->fd, POLLIN, 0};
    rdma_cm_event* ev = nullptr;
    if (poll(&p, 1, 10000) <= 0 || rdma_get_cm_event(channel_, &ev) != 0) {
      return RDMA_CM_EVENT_TIMEWAIT_EXIT;
    }
    const rdma_cm_event_type type = ev->event;
    if (type == RDMA_CM_EVENT_ESTABLISHED) NoteGrant(ev->param.conn);
    if (type == RDMA_CM_EVENT_REJECTED && ev->param.conn.private_data != nullptr) {
      const char* text = static_cast<const char*>(ev->param.conn.private_data);
      rejection.assign(text, strnlen(text, ev->param.conn.private_data_len));
    }
    rdma_ack_cm_event(ev);
    return type;
  }

  // Waits for an event of type `want` (or `also`, where given); true when one
  // comes within `timeout`, and `id`, if given, gets its rdma_cm id. Other
  // events are acknowledged and noted in other_events_.
  bool Await(rdma_cm_event_type want, absl::Duration timeout = absl::Seconds(10),
             rdma_cm_id** id = nullptr, std::optional<rdma_cm_event_type> also = std::nullopt) {
    pollfd p{channel_->fd, POLLIN, 0};
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      if (poll(&p, 1, 100) <= 0) continue;
      rdma_cm_event* ev = nullptr;
      if (rdma_get_cm_event(channel_, &ev) != 0) return false;
      const rdma_cm_event_type type = ev->event;
      const bool wanted = type == want || (also && type == *also);
      if (wanted && id != nullptr) *id = ev->id;
      if (wanted && type == RDMA_CM_EVENT_CONNECT_REQUEST) NoteGrant(ev->param.conn);
      if (!wanted) {
        absl::StrAppend(&other_events_, other_events_.empty() ? "" : ", ", rdma_event_str(type),
                        " (status ", ev->status, ")");
      }
      rdma_ack_cm_event(ev);
      if (wanted) return true;
    }
    return false;
  }

  rdma_event_channel* channel_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  rdma_cm_id* listen_id_ = nullptr;
  ibv_qp* qp_ = nullptr;  // id_->qp, or one made without rdma_cm (lose_rtu)
  Handshake handshake_;   // what rdma_connect / rdma_accept send
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* send_mr_ = nullptr;
  ibv_mr* recv_mr_ = nullptr;
  ibv_mr* read_mr_ = nullptr;
  ibv_mr* exposed_mr_ = nullptr;
  char send_buf_[kRawSlot];
  std::vector<char> recv_buf_ = std::vector<char>(kRawRecvs * kRawSlot);
  std::vector<char> read_buf_ = std::vector<char>(kRawReadMax);
  std::vector<char> exposed_;
  std::vector<Header> frames_;
  std::string other_events_;
};

inline std::string Frame(const Header& h, std::string body = {}) {
  std::string out(kHeaderSize, '\0');
  EncodeHeader(h, out.data());
  return out + body;
}

// A kCredit frame that returns `credits` (0: a malformed one).
inline std::string CreditFrame(uint32_t credits) {
  Header h;
  h.kind = MessageKind::kCredit;
  h.credits = credits;
  return Frame(h);
}

inline Header SmallRequest(uint64_t call_id, uint32_t payload_len) {
  Header h;
  h.kind = MessageKind::kRequest;
  h.call_id = call_id;
  h.payload_len = payload_len;
  return h;
}

}  // namespace rdmarpc::transport::rdma::testing

#endif  // RDMARPC_TRANSPORT_RDMA_TESTING_RAW_PEER_H_
