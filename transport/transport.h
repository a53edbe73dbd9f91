// The transport interface: what the RPC runtime (rpc/) needs from a network.
//
// A Transport makes Connections, by connecting or by accepting. A Connection
// carries frames (transport/wire_format.h) both ways and reports what arrives
// to its ConnectionObserver. Implementations: transport/tcp/ (epoll) and
// transport/rdma/ (rdma_cm, SEND into an SRQ, READ for large payloads).
//
//   std::unique_ptr<Transport> t = MakeTransport("tcp", options);
//   auto conn = t->Connect(addr, &observer, SteadyNow() + absl::Seconds(5));
//   OutboundMessage m;
//   m.header.kind = MessageKind::kRequest;
//   m.payload = (*conn)->AllocatePayload(n);   // fill in place: no copy later
//   (*conn)->Send(std::move(m));
//   // Or let the transport say where: a small payload goes into the frame.
//   (*conn)->SendWith(std::move(m2), n, [&](char* out) { Serialize(out); });
//
// Threading: each Transport runs its own I/O thread(s); observer callbacks run
// there, one at a time per connection, and must not block. Send() and Close()
// are safe from any thread. Shutdown() closes every connection (each gets
// OnClosed), ends the Connects in progress (UNAVAILABLE) and joins the
// transport's threads: after it returns, no callback runs, so observers may
// be destroyed, and a Connect fails FAILED_PRECONDITION.
//
// Large payloads: a transport may carry a payload out of band (RDMA advertises
// it and the receiver READs it). The runtime sees the same InboundMessage
// either way; the transport keeps an advertised buffer alive until the peer is
// done with it. MessageKind::kCredit and kRelease never reach the runtime.
#ifndef RDMARPC_TRANSPORT_TRANSPORT_H_
#define RDMARPC_TRANSPORT_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "transport/address.h"
#include "transport/buffer.h"
#include "transport/memory_quota.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport {

struct OutboundMessage {
  // kind, status, call_id, method_id and timeout_us are the caller's; the
  // transport fills in lengths, flags, credits and the remote descriptor.
  Header header;
  std::string metadata;  // EncodeMetadata() output
  Buffer payload;
};

struct InboundMessage {
  Header header;
  std::string metadata;
  Buffer payload;
  // Not OK when the payload could not be delivered although the header is
  // sound: RESOURCE_EXHAUSTED (larger than max_message_size, or than the
  // process had memory for; the bytes were skipped, not stored), UNAVAILABLE
  // (the READ failed), DEADLINE_EXCEEDED (expired before it was fetched), or
  // what the observer's AdmitRemotePayload refused it with. The runtime
  // answers that call with it.
  absl::Status payload_status;
  // True when the payload is on loan from the transport's receive resources
  // (an RDMA receive slot, which the SRQ gets back only when the Buffer is
  // released): whoever keeps bytes past handling the message copies them.
  // Otherwise the payload is memory of its own (heap, or the registered
  // block a READ filled) and may be kept.
  bool payload_on_loan = false;
};

class Connection;

class ConnectionObserver {
 public:
  virtual ~ConnectionObserver() = default;
  // `msg` is the observer's to move from (by reference, not by value: a
  // move of the whole message per frame is measurable on the fast path);
  // the transport destroys whatever is left of it after the call returns.
  virtual void OnMessage(Connection& conn, InboundMessage&& msg) = 0;
  // Asked, on the thread that delivers messages, before a payload that the
  // peer advertised is fetched (RDMA READ). A status that is not OK skips
  // the READ: the message comes to OnMessage with it as payload_status and
  // no payload. A server refuses a request by its header alone this way,
  // without spending the READ (rpc/server.h: its call limits).
  // Transports that receive payloads inline (TCP) do not ask.
  virtual absl::Status AdmitRemotePayload(Connection& conn, const Header& header) {
    (void)conn;
    (void)header;
    return absl::OkStatus();
  }
  // Exactly once per connection, after the last OnMessage.
  virtual void OnClosed(Connection& conn, const absl::Status& why) = 0;
  // Over TCP, on a client's connection: the server, which said as it took
  // the connection that TCP alone listened on its port, listens over RDMA
  // there too now (it gained a device; Listener::SharePortWithRdma), so
  // ServerTcpAlone() turned false and Transport::MayGoFaster may be true.
  virtual void OnMayGoFaster(Connection& conn) { (void)conn; }
};

// The payload (absl::Status::SetPayload) of a Send error that refused the
// frame before any of it was queued, as its connection was closing or
// closed: the peer never sees it, so it may be sent again elsewhere without
// running twice. A frame that a failed post or write lost after queueing
// carries none (its peer may have seen part of the batch).
inline constexpr absl::string_view kNeverSent = "type.rdmarpc.dev/transport.NeverSent";

// UNAVAILABLE with `message` and kNeverSent.
inline absl::Status RefusedUnsent(absl::string_view message) {
  absl::Status s = absl::UnavailableError(message);
  s.SetPayload(kNeverSent, absl::Cord());
  return s;
}
inline bool NeverSent(const absl::Status& s) { return s.GetPayload(kNeverSent).has_value(); }

// RESOURCE_EXHAUSTED for `bytes` that the process could not allocate for
// `what` ("a message from tcp://10.0.0.7:7000"). Peers choose how large their
// messages are, up to max_message_size, so running out ends that message's
// call, never the process.
inline absl::Status OutOfMemory(size_t bytes, absl::string_view what) {
  return absl::ResourceExhaustedError(
      absl::StrCat("out of memory for ", bytes, " bytes of ", what,
                   " (the process's address-space limit, `ulimit -v`, or its host's memory "
                   "is used up)"));
}

// The bytes of errors (responses with a status other than OK) that one
// connection may hold beyond the bounds on what waits to be sent to slow
// peers (TcpOptions::max_queued_send_bytes and max_queued_send_bytes_total,
// RdmaOptions::max_backlog_bytes and max_backlog_bytes_total), so that a
// call whose answer such a bound refused still ends with its error at a
// peer that catches up. A server whose error does not fit even there
// closes the connection (rpc/server.h), whose calls then end UNAVAILABLE:
// the peer is that far behind.
inline constexpr size_t kQueuedErrorHeadroom = size_t{1} << 20;

// A frame that such a bound never refuses: a header alone that is neither a
// request nor a response (a cancel, a GOAWAY or its acknowledgment, a
// kHello, a credit). Refusing it would lose what it says, and it stands for
// a call in flight or a one-time event, so the queue stays bounded.
inline bool IsControlFrame(const Header& h) {
  return h.kind != MessageKind::kRequest && h.kind != MessageKind::kResponse &&
         h.metadata_len == 0 && h.payload_len == 0;
}
// A frame that has kQueuedErrorHeadroom beyond such a bound: an error, which
// answers a call whose answer the bound may have refused.
inline bool IsErrorResponse(const Header& h) {
  return h.kind == MessageKind::kResponse && h.status != 0;
}

class Connection {
 public:
  virtual ~Connection() = default;
  // Queues one frame, moving from `msg` what it keeps (taken by reference:
  // a move of the whole message per frame is measurable on the fast path).
  // UNAVAILABLE once the connection is closing or closed, with kNeverSent;
  // RESOURCE_EXHAUSTED when the transport's bounded memory is used up.
  virtual absl::Status Send(OutboundMessage&& msg) = 0;
  // Send with a payload of `payload_size` bytes that `write` puts in place
  // (exactly that many; `msg.payload` must be empty). RDMA writes a small
  // frame's payload straight into its SEND, with no payload buffer to take,
  // lend and give back; otherwise, and by default, it is written into
  // AllocatePayload's memory and sent as Send sends it. `write` may run
  // under the connection's lock: it must not call into the transport.
  virtual absl::Status SendWith(OutboundMessage&& msg, size_t payload_size,
                                absl::FunctionRef<void(char*)> write) {
    if (payload_size > 0) {
      absl::StatusOr<Buffer> memory = AllocatePayload(payload_size);
      if (!memory.ok()) return memory.status();
      write(memory->data());
      msg.payload = std::move(*memory);
    }
    return Send(std::move(msg));
  }
  // Memory that Send can carry without copying (registered memory on RDMA).
  virtual absl::StatusOr<Buffer> AllocatePayload(size_t size) = 0;
  // Starts closing; OnClosed follows on the I/O thread. Idempotent.
  virtual void Close() = 0;
  // Whether the peer needs nothing more of this side for what was sent: every
  // frame has reached the peer (over TCP, its bytes acknowledged by the
  // peer's kernel; over RDMA, its SEND completed), and no payload the peer
  // pulls (RDMA READ) is still unreleased. Closing before that loses what is
  // left. Meant to be polled: a call may start what makes the answer come
  // true (RDMA: a signaled work request behind unsignaled SENDs). A closed
  // connection has nothing more to deliver.
  virtual bool Delivered() = 0;
  // "tcp://1.2.3.4:5678" or similar, for errors and logs.
  virtual const std::string& peer() const = 0;
  // Over TCP: the server said, as it took the connection, that nothing but
  // TCP takes connections on its port (wire_format.h's kHelloTcpAlone), so
  // an auto:// client has no RDMA to move to (Transport::MayGoFaster),
  // until the server says otherwise (ConnectionObserver::OnMayGoFaster).
  // False over RDMA.
  virtual bool ServerTcpAlone() const { return false; }
  // Run-to-completion: a thread about to block until done() lends itself to
  // the transport, which does this connection's I/O on it (observer callbacks
  // included) until done() is true — so the result needs no hand-off from
  // the I/O thread. Returns true when done() became true; false when the
  // transport does not drive now (not supported, poll mode, another caller
  // drives, idle too long, shutting down) and the caller should wait as
  // usual.
  virtual bool Drive(absl::FunctionRef<bool()> done) {
    (void)done;
    return false;
  }
};

class Listener {
 public:
  virtual ~Listener() = default;  // stops accepting
  // The bound address (port filled in when 0 was asked for).
  virtual const Address& address() const = 0;
  // Over TCP: an RDMA listener takes connections on this port too now (an
  // auto:// server's), so the kHello of the connections it takes from now
  // on lacks kHelloTcpAlone, and those it took already get a kHello that
  // lacks it. Other listeners ignore it.
  virtual void SharePortWithRdma() {}
};

// What every transport is given by its owner. Each kind has tunables of its
// own (transport/tcp/tcp_options.h, transport/rdma/rdma_options.h), which
// MakeTransport takes together (TransportTunables, transport/factory.h).
struct TransportOptions {
  // Largest payload a receiver accepts; larger ones are skipped and reported
  // as RESOURCE_EXHAUSTED in InboundMessage::payload_status.
  size_t max_message_size = 64u << 20;
  // Log prefix naming the owner, e.g. "server" or "channel tcp://h:1".
  std::string name = "rdmarpc";
  // A server's transport: sizes receive resources for many peers.
  bool listening = false;
  // Shared with other transports (memory_quota.h); null: none. MakeTransport
  // sets it from TransportTunables::memory_quota where that is set.
  std::shared_ptr<MemoryQuota> memory_quota;
};

// The payload (absl::Status::SetPayload) of a Connect error that says the
// peer cannot be reached by this kind of transport at all: no route of its
// kind leads there, or nothing of its kind listens there. A peer that
// answered and refused, or a deadline that passed, carries none. Another
// kind of transport may still reach the peer (auto://, auto_transport.h).
inline constexpr absl::string_view kNotReachableThisWay =
    "type.rdmarpc.dev/transport.NotReachableThisWay";

// How often a connect waiting on the network looks at the flags that end
// it early (ConnectUnless's `give_up`, a race lost to another of a name's
// addresses): a given-up connect ends within this, per transport it goes
// through. A wake-up every 10 ms while a connect waits, off any fast path.
inline constexpr absl::Duration kGiveUpCheck = absl::Milliseconds(10);

// Returns the observer for a new connection (never null), or null to refuse it.
using AcceptCallback = std::function<ConnectionObserver*(std::shared_ptr<Connection>)>;

class Transport {
 public:
  virtual ~Transport() = default;
  // `deadline` is on SteadyNow()'s clock (base/steady_clock.h), as every time
  // inside the library is.
  virtual absl::StatusOr<std::shared_ptr<Connection>> Connect(const Address& addr,
                                                              ConnectionObserver* observer,
                                                              absl::Time deadline) = 0;
  // Connect that another thread can end early: once `give_up` is true it
  // ends as at its deadline, within kGiveUpCheck (CANCELLED). A
  // transport whose connects end quickly anyway need not look at it.
  virtual absl::StatusOr<std::shared_ptr<Connection>> ConnectUnless(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) {
    (void)give_up;
    return Connect(addr, observer, deadline);
  }
  virtual absl::StatusOr<std::unique_ptr<Listener>> Listen(const Address& addr,
                                                           AcceptCallback on_accept) = 0;
  virtual void Shutdown() = 0;

  // For an address whose way the transport picks (auto://): whether `conn`,
  // which Connect(addr) made, went the slower way (TCP) to a server that
  // the faster way (RDMA) may reach later. Its owner may then try
  // ConnectFaster now and then, and move its new calls to what that makes.
  virtual bool MayGoFaster(const Address& addr, const Connection& conn) const {
    (void)addr;
    (void)conn;
    return false;
  }
  // Connects to `addr` the faster way alone, ending early (CANCELLED) once
  // `give_up` is true, as ConnectUnless does.
  virtual absl::StatusOr<std::shared_ptr<Connection>> ConnectFaster(
      const Address& addr, ConnectionObserver* observer, absl::Time deadline,
      const std::atomic<bool>& give_up) {
    (void)observer;
    (void)deadline;
    (void)give_up;
    return absl::UnimplementedError(
        absl::StrCat(addr.ToString(), ": this transport has no faster way to it"));
  }
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_TRANSPORT_H_
