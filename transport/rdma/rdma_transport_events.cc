// RdmaTransport's rdma_cm events, on its CM thread: each connect's
// progress, a listener's connect requests, disconnects and device removals.
#include <errno.h>
#include <string.h>

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/steady_clock.h"
#include "transport/attempt_errors.h"
#include "transport/rdma/counters.h"
#include "transport/rdma/device_selection.h"
#include "transport/rdma/fault_injection.h"
#include "transport/rdma/rdma_transport.h"
#include "transport/rdma/rdma_transport_internal.h"

namespace rdmarpc::transport::rdma {
namespace {

// Said with EINVAL from rdma_create_qp or rdma_accept for a connect
// request: the kernel's CM no longer holds it as pending (so rdma_cm will
// not move a QP to INIT for it, nor send its reply), as it stops doing when
// the client cancels it.
const char* kClientGaveUpHint =
    " (most likely the client gave up on this connect before it was accepted: its deadline "
    "passed, it was given up or it shut down)";

std::string EncodeRefusal(const std::string& why) {
  std::string text = absl::StrCat(kRefusalPrefix, why);
  if (text.size() <= kMaxRefusalBytes) return text;
  const size_t room = kMaxRefusalBytes - strlen(kRefusalCut);
  size_t end = text.rfind(' ', room);
  if (end == std::string::npos || end < strlen(kRefusalPrefix)) end = room;
  text.resize(end);
  return text + kRefusalCut;
}

// Why the server refused, from a REJ's private data, or nullopt when the
// refusal is not an rdmarpc server's (or has no reason).
std::optional<std::string> DecodeRefusal(const void* data, size_t len) {
  absl::string_view text(static_cast<const char*>(data), data == nullptr ? 0 : len);
  text = text.substr(0, text.find('\0'));
  if (!absl::ConsumePrefix(&text, kRefusalPrefix) || text.empty()) return std::nullopt;
  if (absl::EndsWith(text, kRefusalCut)) {
    return absl::StrCat(text,
                        " (cut short to fit rdma_cm's reject: the server's log has all of it)");
  }
  return std::string(text);
}

}  // namespace

void RdmaTransport::HandleEvent(rdma_cm_event* ev) {
  // Everything that may touch ev->id happens before the ack: until then
  // rdma_destroy_id on that id (from a poller) waits.
  const rdma_cm_event_type type = ev->event;
  rdma_cm_id* id = ev->id;
  auto it = cm_targets_.find(type == RDMA_CM_EVENT_CONNECT_REQUEST ? ev->listen_id : id);
  if (it == cm_targets_.end()) {
    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) rdma_reject(id, nullptr, 0);
    rdma_ack_cm_event(ev);
    return;
  }
  CmTarget target = it->second;
  if (target.listener) {
    if (type == RDMA_CM_EVENT_CONNECT_REQUEST) OnConnectRequest(ev, target.listener);
    if (type == RDMA_CM_EVENT_DEVICE_REMOVAL) {
      // Nothing else would say why RDMA clients cannot connect meanwhile
      // (README, "A device removed").
      fprintf(stderr,
              "rdmarpc[%s]: RDMA device %s was removed under the listener on %s: it takes no "
              "RDMA connections until a device serves that address again (it tries every %lld "
              "ms)\n",
              options_.name.c_str(), id->verbs ? ibv_get_device_name(id->verbs->device) : "?",
              target.listener->address().ToString().c_str(),
              static_cast<long long>(kRelistenInterval.count()));
      cm_targets_.erase(it);
      retired_ids_.push_back(id);
      target.listener->set_id(nullptr);
      target.listener->relisten_at = std::chrono::steady_clock::now() + kRelistenInterval;
      orphaned_listeners_.insert(target.listener);
    }
    rdma_ack_cm_event(ev);
    return;
  }
  if (auto conn = target.conn.lock()) {
    if (rdma_.trace) {
      TraceLine(options_.name, absl::StrCat(conn->peer(), ": ", rdma_event_str(type),
                                            type == RDMA_CM_EVENT_ESTABLISHED
                                                ? absl::StrCat("; ", conn->DescribeRetryPolicy())
                                                : ""));
    }
    switch (type) {
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
      case RDMA_CM_EVENT_REJECTED:
      case RDMA_CM_EVENT_UNREACHABLE:
      case RDMA_CM_EVENT_CONNECT_ERROR:
        // On the poller, which alone destroys the QP: rdma_disconnect here
        // could race with that.
        conn->endpoint()->RunOnPoller([conn, type] {
          conn->OnPeerGone(absl::UnavailableError(
              absl::StrCat("connection to ", conn->peer(), " lost (", rdma_event_str(type), ")")));
        });
        break;
      case RDMA_CM_EVENT_ESTABLISHED:  // an accepted connection
        conn->MarkEstablished();
        conn->endpoint()->RunOnPoller([conn] { conn->endpoint()->OnEstablished(); });
        break;
      default:
        break;
    }
    rdma_ack_cm_event(ev);
    return;
  }
  if (!target.attempt) {
    rdma_ack_cm_event(ev);
    return;
  }
  Attempt* at = target.attempt.get();
  const int status = ev->status;
  const std::optional<std::string> refusal =
      type == RDMA_CM_EVENT_REJECTED
          ? DecodeRefusal(ev->param.conn.private_data, ev->param.conn.private_data_len)
          : std::nullopt;
  // `no_path`: a step that found no RDMA path there (a route that cannot
  // be resolved) failed, whatever the event.
  auto fail = [&](const std::string& what, bool no_path = false) {
    // No RDMA path there, or no RDMA listener: TCP may still reach the peer.
    // A refusal with our private data, or a peer that is not an rdmarpc
    // server, says the peer is there.
    const bool not_rdma_there = no_path || type == RDMA_CM_EVENT_ADDR_ERROR ||
                                type == RDMA_CM_EVENT_ROUTE_ERROR ||
                                type == RDMA_CM_EVENT_UNREACHABLE ||
                                (type == RDMA_CM_EVENT_REJECTED && !refusal.has_value());
    // A negative status is an errno (ENODEV: the device was removed); a
    // positive one, a REJ's reason.
    const std::string event = status < 0
                                  ? absl::StrCat(rdma_event_str(type), ": ", strerror(-status))
                                  : rdma_event_str(type);
    absl::Status why = absl::UnavailableError(
        absl::StrCat("rdma_cm could not connect to ", at->target, ": ", what,
                     not_rdma_there && at->loopback ? internal::kLoopbackHint : "", " (", event,
                     ", status ", status, ")"));
    // rdma_cm's own clock ran out (no ARP or neighbour answer, a connect
    // request never answered): what to check is what our deadline says,
    // which it races.
    if (status == -ETIMEDOUT) why = NothingAnswered(std::move(why));
    // An rdmarpc server that refused was reached, so the devices work: its
    // reason is what to act on.
    if (!refusal.has_value()) why.SetPayload(internal::kEndWithDevices, absl::Cord());
    if (not_rdma_there) why.SetPayload(kNotReachableThisWay, absl::Cord(no_path ? what : event));
    if (rdma_.trace)
      TraceLine(options_.name, absl::StrCat(at->target, ": connect failed: ", why.message()));
    AbandonAttempt(at);
    at->Finish(std::move(why));
  };
  if (rdma_.trace && type != RDMA_CM_EVENT_ESTABLISHED) {
    TraceLine(options_.name, absl::StrCat(at->target, ": ", rdma_event_str(type)));
  }
  switch (type) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
      if (rdma_resolve_route(id, static_cast<int>(rdma_.connect_timeout_ms)) != 0) {
        fail(absl::StrCat("rdma_resolve_route: ", strerror(errno)), /*no_path=*/true);
      }
      break;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
      auto ep = EndpointFor(id);
      if (!ep.ok()) {
        fail(std::string(ep.status().message()));
        break;
      }
      const ibv_device_attr& dev = (*ep)->device_attr();
      const uint32_t credits = LocalCredits(**ep);
      if (credits == 0) {
        AbandonAttempt(at);
        at->Finish(absl::ResourceExhaustedError(
            absl::StrCat("cannot connect to ", at->target, " on ", (*ep)->device_name(), ": ",
                         (*ep)->DescribeStrictRefusal(), " or close a connection")));
        break;
      }
      const uint32_t rd_atom = std::max(
          1, std::min<int>(static_cast<int>(rdma_.max_reads_in_flight), dev.max_qp_init_rd_atom));
      auto conn = std::make_shared<RdmaConnection>(*ep, id, at->target, next_serial_++, options_,
                                                   Handshake{}, credits, rd_atom);
      if (absl::Status s = conn->CreateQp(); !s.ok()) {
        // Never opened, so not torn down: the id stays the attempt's, and is
        // given up with it on this thread.
        conn->ReleaseId();
        fail(std::string(s.message()));
        break;
      }
      at->conn = conn;
      conn->set_observer(at->observer);
      Track(conn);
      (*ep)->RunOnPollerAndWait([&] { (*ep)->AddConnection(conn); });
      const Handshake hs = LocalHandshake(**ep, credits);
      rdma_conn_param param{};
      param.private_data = &hs;
      param.private_data_len = sizeof hs;
      param.responder_resources = static_cast<uint8_t>(std::min(255, dev.max_qp_rd_atom));
      param.initiator_depth = static_cast<uint8_t>(rd_atom);
      // The passive side's QP takes the same retry count from this request.
      param.retry_count = kTransportRetries;
      param.rnr_retry_count = 7;  // infinite: the safety net behind credits
      SetAckTimeout(id);
      if (rdma_.trace) {
        TraceLine(options_.name,
                  absl::StrCat(at->target, ": ", DescribeChoice(id), "; QP ", conn->qp_num(),
                               " created; connecting, we grant ", hs.credits, " credits and take ",
                               rd_atom, " READs in flight"));
      }
      if (rdma_connect(id, &param) != 0) fail(absl::StrCat("rdma_connect: ", strerror(errno)));
      break;
    }
    case RDMA_CM_EVENT_ESTABLISHED: {
      Handshake hs;
      const auto* pd = static_cast<const uint8_t*>(ev->param.conn.private_data);
      if (pd == nullptr || ev->param.conn.private_data_len < sizeof hs) {
        fail("the server sent no rdmarpc handshake (not an rdmarpc server?)");
        break;
      }
      memcpy(&hs, pd, sizeof hs);
      if (hs.magic != Handshake::kMagic) {
        fail("the server sent no rdmarpc handshake (not an rdmarpc server?)");
        break;
      }
      if (hs.version != Handshake::kVersion) {
        fail(absl::StrCat("the server speaks rdmarpc handshake version ", hs.version, ", we speak ",
                          Handshake::kVersion));
        break;
      }
      if (hs.max_credits < hs.credits) {
        fail(absl::StrCat("the server's handshake grants a window of ", hs.credits,
                          " past its largest, ", hs.max_credits));
        break;
      }
      if (absl::Status s = CheckGidIndex(id, rdma_); !s.ok()) {
        fail(std::string(s.message()));
        break;
      }
      auto conn = at->conn;
      SetRnrWait(id);
      conn->LearnRetryPolicy();
      conn->MarkEstablished();
      DescribeOnce(conn->endpoint(), id, *conn);
      conn->SetPeer(hs);
      if (rdma_.trace) {
        TraceLine(options_.name, absl::StrCat(at->target, ": established: ", conn->DescribeTerms(),
                                              "; ", conn->DescribeRetryPolicy()));
      }
      cm_targets_[id] = CmTarget{nullptr, nullptr, conn};
      at->Finish(absl::OkStatus());
      break;
    }
    case RDMA_CM_EVENT_REJECTED:
      if (refusal.has_value()) {
        fail(absl::StrCat("the server refused the connection: ", *refusal));
      } else {
        fail("rejected (no rdmarpc server listens there?)");
      }
      break;
    default:
      fail("connection setup failed");
      break;
  }
  rdma_ack_cm_event(ev);
}

void RdmaTransport::OnConnectRequest(rdma_cm_event* ev, RdmaListener* listener) {
  rdma_cm_id* child = ev->id;
  const std::string peer = PeerOf(child);
  auto reject = [&](const std::string& why) {
    fprintf(stderr, "rdmarpc[%s]: refusing connection from %s: %s\n", options_.name.c_str(),
            peer.c_str(), why.c_str());
    const std::string refusal = EncodeRefusal(why);
    rdma_reject(child, refusal.data(), static_cast<uint8_t>(refusal.size()));
  };
  auto refuse = [&](const std::string& why) {
    reject(why);
    retired_ids_.push_back(child);
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return refuse("shutting down");
  }
  Handshake hs;
  if (ev->param.conn.private_data == nullptr || ev->param.conn.private_data_len < sizeof hs) {
    return refuse("no rdmarpc handshake in the private data (not an rdmarpc client?)");
  }
  memcpy(&hs, ev->param.conn.private_data, sizeof hs);
  if (hs.magic != Handshake::kMagic) {
    return refuse("no rdmarpc handshake in the private data (not an rdmarpc client?)");
  }
  if (hs.version != Handshake::kVersion) {
    return refuse(absl::StrCat("it speaks rdmarpc handshake version ", hs.version, ", we speak ",
                               Handshake::kVersion));
  }
  if (hs.max_credits < hs.credits) {
    return refuse(absl::StrCat("its handshake grants a window of ", hs.credits,
                               " past its largest, ", hs.max_credits));
  }
  if (rdma_.trace) {
    TraceLine(options_.name,
              absl::StrCat("connection request from ", peer, ": it grants ", hs.credits,
                           " credits, has slots of ", hs.slot_size, " bytes, takes ",
                           static_cast<int>(ev->param.conn.responder_resources),
                           " READs in flight and serves ",
                           static_cast<int>(ev->param.conn.initiator_depth), " of ours"));
  }
  if (hs.slot_size < kMinSlotSize) return refuse("peer's slot size is too small");
  auto ep = EndpointFor(child);
  if (!ep.ok()) return refuse(std::string(ep.status().message()));
  const ibv_device_attr& dev = (*ep)->device_attr();
  // A connect request's READ limits are from our side (rdma_accept(3)):
  // initiator_depth is how many of our READs the peer's device serves at
  // once, responder_resources how many of its own it will have in flight.
  const uint32_t rd_atom = std::max(
      1, std::min({static_cast<int>(rdma_.max_reads_in_flight),
                   static_cast<int>(ev->param.conn.initiator_depth), dev.max_qp_init_rd_atom}));
  const uint32_t credits = LocalCredits(**ep);
  if (credits == 0) return refuse((*ep)->DescribeStrictRefusal());
  auto conn = std::make_shared<RdmaConnection>(*ep, child, peer, next_serial_++, options_, hs,
                                               credits, rd_atom);
  if (absl::Status s = conn->CreateQp(); !s.ok()) {
    conn->ReleaseId();  // the id goes after the ack instead
    return refuse(absl::StrCat(s.message(), absl::IsInvalidArgument(s) ? kClientGaveUpHint : ""));
  }
  if (rdma_.accept_timeout_ms != 0) {
    conn->set_establish_by(SteadyNow() + absl::Milliseconds(rdma_.accept_timeout_ms));
  }
  ConnectionObserver* observer = listener->on_accept()(conn);
  if (observer == nullptr) {
    conn->ReleaseId();
    return refuse("its accept callback refused it (a server shutting down?)");
  }
  conn->set_observer(observer);
  (*ep)->RunOnPollerAndWait([&] { (*ep)->AddConnection(conn); });
  Track(conn);
  cm_targets_[child] = CmTarget{nullptr, nullptr, conn};
  const Handshake ours = LocalHandshake(**ep, credits);
  rdma_conn_param param{};
  param.private_data = &ours;
  param.private_data_len = sizeof ours;
  param.responder_resources =
      static_cast<uint8_t>(std::min<int>(ev->param.conn.responder_resources, dev.max_qp_rd_atom));
  param.initiator_depth = static_cast<uint8_t>(rd_atom);
  param.rnr_retry_count = 7;
  SetAckTimeout(child);
  const bool accept_fails = FaultInjection::TakeFailedAccept();
  if (accept_fails || rdma_accept(child, &param) != 0) {
    // The client hears it now, not at its connect timeout; the id goes with
    // the connection.
    const int err = accept_fails ? ENOMEM : errno;
    const std::string why =
        absl::StrCat("rdma_accept: ", strerror(err), err == EINVAL ? kClientGaveUpHint : "");
    reject(why);
    (*ep)->RunOnPoller([conn, why] { conn->Teardown(absl::UnavailableError(why)); });
    return;
  }
  if (absl::Status s = CheckGidIndex(child, rdma_); !s.ok()) {
    fprintf(stderr, "rdmarpc[%s]: closing connection from %s: %s\n", options_.name.c_str(),
            peer.c_str(), std::string(s.message()).c_str());
    (*ep)->RunOnPoller([conn, s] { conn->Teardown(s); });
    return;
  }
  SetRnrWait(child);
  conn->LearnRetryPolicy();
  DescribeOnce(*ep, child, *conn);
  if (rdma_.trace) {
    TraceLine(options_.name, absl::StrCat(peer, ": accepted on ", DescribeChoice(child), "; ",
                                          conn->DescribeTerms()));
  }
}

}  // namespace rdmarpc::transport::rdma
