// RdmaOptions: every tunable of the RDMA transport, in one place.
//
// Defaults suit a small VM and a real NIC alike. Each can be set from code
// (RdmaTransport's constructor, or the runtime's ChannelOptions::transport.rdma
// and ServerBuilder::SetTransportTunables) and, for experiments, overridden
// from the environment (RdmaOptionsFromEnv):
//
//   rdmarpc::ChannelOptions opts;
//   opts.transport.rdma.poll_mode = PollMode::kBusy;   // a core for latency
//   auto channel = rdmarpc::Channel::Create("rdma://10.0.0.1:7471", opts);
//
// Sizing rule of thumb: receive memory of an endpoint is
//   (receive slots posted + slots held by the runtime) x slot_size,
// independent of how many connections share the SRQ. A payload that does not
// fit in a slot next to the header and metadata goes by RDMA READ.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_OPTIONS_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_OPTIONS_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "transport/wire_format.h"

namespace rdmarpc::transport::rdma {

enum class PollMode {
  kAdaptive,  // spin on the CQ for spin_us after activity, then sleep on events
  kBusy,      // always spin: lowest latency, one core per transport; under
              // Soft-RoCE also the fastest READs (the kernel's packet work
              // keeps to the other cores, bench/RESULTS.md)
  kEvent,     // always sleep on the completion channel: no spinning at all
};

struct RdmaOptions {
  // Bytes of one receive (and send) slot: header + metadata + inline payload.
  size_t slot_size = 8192;
  // Receive slots kept posted on the SRQ of a listening transport and of a
  // connecting one. A client endpoint needs far fewer: its slots bound its
  // requests in flight over all its connections (Endpoint::
  // TakeResponseRoom), so a busy ChannelGroup may want more.
  size_t server_receive_slots = 512;
  size_t client_receive_slots = 64;
  // Receive slots that may be out of the SRQ at once (held by the runtime
  // until it is done with a message); beyond it the SRQ runs short. Costs 4
  // bytes per slot up front (the free list), the slots' memory only when used.
  size_t max_held_slots = 4096;
  // Frames a peer may send us on one connection before we return credit.
  // A listening transport shares its SRQ's slots among its connections
  // (ShareReceiveBudget): each gets at most this, and less when there are
  // many; when joining connections overdraw the slots, those whose peers
  // hold the most past their windows, idle or not, are asked for credits
  // back (kShrink), and the windows grow again as connections leave.
  uint32_t credits = 32;
  // A listening transport's peer that has not answered such a request this
  // long after it was sent (its process stopped, its I/O thread stuck)
  // stops holding the other connections back: what it holds past its
  // window no longer counts against the slots, so their windows are topped
  // up again, at the risk that a burst from it when it wakes finds the SRQ
  // empty and waits on RNR retry. Counted in credit_shrinks_overdue, and
  // said on stderr once per connection. 0: wait for the answer for ever.
  uint32_t shrink_answer_timeout_ms = 200;
  // Whether a connection is refused rather than its window shrunk. Off (the
  // default), a listening transport grants every connection its share of
  // the slots, at least one frame: past as many connections as the slots
  // hold frames, a burst from all of them at once meets an empty SRQ and
  // waits on RNR retry, and the transport says so once on stderr. (A
  // connecting transport bounds its requests by its slots instead,
  // Endpoint::TakeResponseRoom.) On, a connection is granted only what the
  // slots not yet spoken for still hold (StrictCreditWindow), so no SEND
  // finds the SRQ empty while the runtime gives its slots back; one that
  // would get none is refused, naming the slots and what holds them: a
  // server rejects the connect request, a client's Connect fails
  // RESOURCE_EXHAUSTED. What is granted is never taken back, so idle
  // connections keep their share; it comes back when they close.
  // RDMARPC_RDMA_STRICT_CREDITS=1.
  bool strict_credits = false;
  // Most send slots one connection holds, for SENDs too large to go inline:
  // slot-sized blocks taken from the transport's shared stock as the frames
  // in flight need them, and given back (but one) as their SENDs complete;
  // that one goes back too when the connection is silent for keepalive_ms
  // (with keepalive_ms = 0 it stays until the connection closes).
  uint32_t send_slots = 64;
  // Bytes of frames (header, metadata and a payload that is not advertised)
  // one connection may hold waiting for the peer's credits or send-queue
  // room: the memory a peer that sends requests and returns no credits can
  // pin. A Send that would hold more fails RESOURCE_EXHAUSTED naming the
  // bound; a frame sent when none waits is always taken, and so is a
  // control frame (a header each); errors have kQueuedErrorHeadroom beyond
  // it (transport/transport.h). RDMARPC_RDMA_MAX_BACKLOG_BYTES.
  size_t max_backlog_bytes = 256u << 20;
  // The same over all the connections on one device (per device, as
  // max_registered_bytes): the memory that many peers which return no
  // credits can pin together, however many they are. Past it, a frame on a
  // connection whose backlog is not empty fails RESOURCE_EXHAUSTED naming
  // it, with the same exceptions. RDMARPC_RDMA_MAX_BACKLOG_BYTES_TOTAL.
  size_t max_backlog_bytes_total = size_t{1} << 30;
  // Request a completion for every n-th unsignaled SEND.
  uint32_t signal_every = 16;
  // RDMA READs one connection keeps outstanding (each at most the port's
  // max_msg_sz), further bounded by what the device and the peer allow
  // (max_qp_init_rd_atom here, max_qp_rd_atom there). More READs queue, in
  // arrival order.
  uint32_t max_reads_in_flight = 16;
  // Payloads above this many bytes go by READ; 0 derives it from slot_size.
  size_t read_threshold = 0;
  // Bound on the registered pool of large payload buffers (RESOURCE_EXHAUSTED
  // naming it when reached), per device: a transport whose connections use
  // two devices has a pool on each. Slot-sized memory has bounds of its own:
  // receive slots target + max_held_slots, small payload blocks and send
  // slots Endpoint::kMaxSmallBlocks and kMaxSendBlocks. One bound for
  // several transports together: TransportTunables::memory_quota.
  size_t max_registered_bytes = size_t{1} << 30;
  // Entries of a completion queue of the transport (shared by the SRQ's
  // receives and the send queues of the connections on it) to begin with,
  // and their bound (0: the device's max_cqe; else at least the role's
  // receive slots and one connection's send queue). Each connection holds room
  // for its whole send queue (SendQueueDepth); a CQ grows as they need, a
  // connection that no CQ can grow to fit gets a new CQ, up to
  // max_completion_queues, and past those it is refused (endpoint.h,
  // "Completion-queue capacity"). cq_entries 0 sizes it by role
  // (InitialCqEntries): a listening transport, which expects many peers,
  // begins at kListeningCqEntries; a connecting one at room for its receives
  // and two connections. The kernel keeps the entries: devices round the
  // size up to a power of two, and Soft-RoCE takes 128 bytes an entry, so
  // 16384 asked is 4 MiB (32 KiB per 256).
  size_t cq_entries = 0;
  size_t max_cq_entries = 0;
  // Completion queues one device's endpoint may open, from 1 to
  // kMaxCompletionQueues. A further one is opened only when the others are
  // at max_cq_entries, or cannot grow (a device without ibv_resize_cq, such
  // as siw: then each new one is twice the last): on Soft-RoCE (max_cqe 32767) one holds ~335
  // connections with the default send queue; on a NIC with millions of
  // entries one is all there is. The poller polls each in turn.
  uint32_t max_completion_queues = 8;
  // How long a response payload stays exposed to the client's READ (from the
  // moment its SEND is queued) when the client sends no release: then the
  // memory window is revoked and the block reused, and a READ after that
  // fails and ends that client's connection; without memory windows the
  // connection is closed instead. 0: until release or disconnect, so a client
  // that never releases holds our registered memory. Sent to the client in
  // the handshake, which then does not start a READ after half of it.
  // Likewise, with memory windows, a request's payload is revoked this long
  // after the request's deadline if no answer came (the server starts no
  // READ past the deadline).
  uint32_t release_timeout_ms = 30000;
  // Expose advertised payloads through type-2 memory windows (bound to one
  // QP, exactly the payload's bytes, revocable) when the device has them.
  // false registers each block for REMOTE_READ instead, as on a device
  // without windows: the whole block, until deregistered, with no way to
  // revoke it but closing the connection. For comparison and tests.
  bool memory_windows = true;
  PollMode poll_mode = PollMode::kAdaptive;
  // Adaptive mode: how long to keep spinning after the last completion. One
  // completion-channel wake-up costs ~140 us on Soft-RoCE, a polled round
  // trip ~27 us: spinning a little longer than a round trip wins.
  uint32_t spin_us = 300;
  // Which device, port and GID connections use (device_selection.h): by
  // default what rdma_cm picks for the address. `device` alone insists on a
  // device (e.g. "mlx5_0", "rxe0"), `device_port` (from 1) on a port, and
  // `gid_index` (with device) names the GID table entry to use.
  std::string device;
  uint32_t device_port = 0;
  int gid_index = -1;
  // The type of service of the connections this transport makes, 0 to 255:
  // on RoCE v2 the IP header's byte (DSCP << 2 | ECN), so 104 puts them in
  // DSCP 26, where many lossless (PFC) fabrics carry RDMA; on InfiniBand the
  // traffic class, which the subnet manager maps to a service level. -1
  // leaves rdma_cm's default (the port's default_roce_tos in configfs, 0
  // unless an administrator set it). A server's connections take the class
  // of their client's connect request, as rdma_cm builds an accepted
  // connection's path from it, so it is the clients that choose.
  int type_of_service = -1;
  // Longest rdma_cm may take to resolve a peer's address, and then its
  // route (rdma_resolve_addr, rdma_resolve_route), each; the connect's own
  // deadline (ChannelOptions::connect_timeout) bounds them as well. From 1
  // to 2147483647 (rdma_cm takes an int).
  uint32_t connect_timeout_ms = 10000;
  // Dead peers. A peer whose machine, device or link dies sends no
  // disconnect: only an operation of ours that its device never acknowledges
  // reveals it. peer_timeout_ms bounds how long our device waits for an
  // acknowledgement before the connection fails UNAVAILABLE (it sets the
  // QP's ACK timeout, tried kTransportRetries + 1 times; the device rounds
  // it down to a power of two, and a real NIC may impose a minimum). 0 keeps
  // rdma_cm's own, ~17 s on RoCE.
  uint32_t peer_timeout_ms = 2000;
  // How long a peer whose SEND finds our SRQ empty waits before it sends
  // again: the RNR NAK timer our queue pairs advertise (IBA min_rnr_timer,
  // rounded up to its table, 10 us to 491.52 ms). Credits make this rare;
  // it is the safety net's delay, so a few SRQ refills long is right.
  // rdma_cm sets code 0, which means 655 ms: one empty SRQ would stall
  // each sender caught by it that long. Soft-RoCE waits at least one kernel
  // tick (4 ms at HZ=250) whatever it is told.
  uint32_t rnr_wait_us = 640;
  // A connection that has heard nothing from its peer for this long sends
  // it a keepalive: a zero-byte RDMA WRITE, which the peer's device
  // acknowledges without its software, spending none of its receive slots,
  // credits or READ resources. So a vanished peer ends its connection, and
  // every call waiting on it, within about keepalive_ms + peer_timeout_ms
  // even when nothing else is being sent. It cannot tell a live but stuck
  // peer process (its device still answers): deadlines are for that. A READ
  // with no completion for this long gets one behind it as well (see
  // "Stalled READs" in rdma_connection.h). 0: no keepalive.
  uint32_t keepalive_ms = 1000;
  // A connection a listener accepted that its client has not completed
  // (rdma_cm's RTU, which makes it ESTABLISHED) within this long gets a
  // keepalive. A client whose QP runs acknowledges it (only its RTU was
  // lost) and keeps its connection; one that stopped or vanished between
  // its connect request and our answer does not, and its connection ends
  // about peer_timeout_ms later (twice that where Soft-RoCE retries for
  // ever, as with any keepalive), with one line on stderr and
  // accepts_unfinished in the counters. Without it the connection would
  // hold its queue pair and credits for minutes: the client's kernel
  // answers our REP with an MRA worth 68 s, and rdma_cm resends the REP up
  // to 15 times. Normally an RTU takes milliseconds. 0: leave it to rdma_cm.
  uint32_t accept_timeout_ms = 10000;
  // One line on stderr per step of each connection's life: the address and
  // route resolved (device, port, GID, MTU), the QP and the terms both sides
  // agreed (credits, slot sizes, READs in flight, release timeout, retry
  // policy), rdma_cm's events, the teardown and whether the QP drained. For
  // "it connects, then fails" reports; nothing is traced per message, so it
  // costs the fast path nothing. RDMARPC_RDMA_TRACE=1.
  bool trace = false;
};

// One line of RdmaOptions::trace, "rdmarpc[<name>] trace: <what>", on
// stderr; `name` is the transport's (TransportOptions::name). Callers check
// the option first, so that nothing is built when it is off.
void TraceLine(const std::string& name, const std::string& what);

// Transport retries of an RC queue pair (IBA "retry count"). Not 7: the
// specification allows 7 retries, but Soft-RoCE (Linux 6.1) treats 7 as
// "retry for ever", so a vanished peer would never be noticed there.
inline constexpr int kTransportRetries = 6;

// The slowest rate at which a READ is still taken to be progressing. A READ
// the device has neither completed nor failed within twice its retry time
// (peer_timeout_ms) plus its bytes at this rate ends its connection
// UNAVAILABLE: a backstop for a device that loses a READ without a word,
// since a dead peer already fails it within the retry time. Far below any
// device's rate (Soft-RoCE in a TCG VM READs 60-110 MiB/s), so that a slow
// READ is not cut short.
inline constexpr uint64_t kSlowestReadBytesPerSecond = uint64_t{4} << 20;

// How often a listener whose RDMA device was removed tries to listen on its
// address and port again, so that it takes RDMA connections once a device
// serves that address (a driver reset done, a new device in the old one's
// place). A try that finds no device costs one rdma_bind_addr.
inline constexpr std::chrono::milliseconds kRelistenInterval{1000};

// How often a transport looks for a removed device under its endpoints
// (DeviceHold::Removed, one stat() each), to let go of those that no
// connection uses any more, so that the removal can complete.
inline constexpr std::chrono::milliseconds kRemovedDeviceCheck{1000};

// Where a listening transport's completion queue begins (cq_entries 0).
inline constexpr size_t kListeningCqEntries = 16384;

// The most completion queues an endpoint may open (max_completion_queues):
// their handles sit in a fixed array that the poller reads without a lock.
inline constexpr uint32_t kMaxCompletionQueues = 64;

// Send-queue entries of one connection taking `reads` READs in flight,
// before the device's max_qp_wr caps them: one per send slot and per READ,
// and 16 more.
inline uint32_t SendQueueDepth(const RdmaOptions& options, uint32_t reads) {
  return options.send_slots + reads + 16;
}

// Completion-queue entries a transport begins with: cq_entries, or by role
// when it is 0 (see there). A connecting transport gets room for two
// connections because a lost one's room comes back only once the CQ has
// been found empty, which may be after its channel has connected again.
size_t InitialCqEntries(const RdmaOptions& options, bool listening);

// The SRQ is refilled once this many of its slots have been consumed (or
// fewer, for an SRQ of under 8x this many), in one chain of receive WRs: one
// post per batch instead of one per message. The slots it lacks meanwhile
// are within the safety margin that credits keep (at most half the slots per
// connection).
inline constexpr size_t kSrqRefillBatch = 16;

// Strict credits (RdmaOptions::strict_credits). A peer returns credit in a
// kCredit frame, which costs none, once half the window it granted us (at
// least two frames, or all we hold) is owed, and we send at most that
// window before we read its credit: so at most two of its kCredit frames
// wait in our SRQ at once. Each connection holds this many slots besides
// its window all the same: a peer built before that rule returned a
// window of 3 one frame at a time, three kCredit frames.
inline constexpr size_t kCreditFramesPerWindow = 3;
// The window a new connection gets when the SRQ keeps `target` slots
// posted, up to `unposted` of them may be consumed and not yet posted again
// while their credit is already back with the peer (Endpoint's refill lag),
// and the connections already there hold `committed` (their windows plus
// kCreditFramesPerWindow each): at most `wanted`, 0 when not even one frame
// fits.
inline uint32_t StrictCreditWindow(uint32_t wanted, size_t target, size_t unposted,
                                   size_t committed) {
  const size_t usable = target > unposted ? target - unposted : 0;
  const size_t spoken_for = committed + kCreditFramesPerWindow;
  if (usable <= spoken_for) return 0;
  return static_cast<uint32_t>(std::min<size_t>(wanted, usable - spoken_for));
}

// Shared windows (a listening transport without strict_credits). Besides
// its kCredit frames, a peer sends one free frame at a time: the answer to
// our kShrink. A connecting transport counts a GOAWAY and our kShrink from
// its peer besides the kCredit frames.
inline constexpr size_t kControlFramesPerConnection = kCreditFramesPerWindow + 2;
// What `connections` may have in flight into an SRQ that keeps `target`
// slots posted, `unposted` of which may be consumed and not yet posted
// again: the rest, less kControlFramesPerConnection per connection for
// control frames, but at most a quarter (many connections seldom send them
// all at once, and hundreds of connections must still have room for
// calls); at least one. Each connection's window is then `budget` /
// `connections`, at least one frame and at most `wanted`.
struct ReceiveShare {
  size_t budget = 1;
  uint32_t window = 1;
};
inline ReceiveShare ShareReceiveBudget(uint32_t wanted, size_t target, size_t unposted,
                                       size_t connections) {
  const size_t usable = target > unposted ? target - unposted : 0;
  const size_t n = std::max<size_t>(1, connections);
  const size_t reserved = std::min(kControlFramesPerConnection * n, usable / 4);
  ReceiveShare share;
  share.budget = std::max<size_t>(1, usable - reserved);
  share.window =
      static_cast<uint32_t>(std::clamp<size_t>(share.budget / n, 1, std::max(1u, wanted)));
  return share;
}

// The smallest slot: the header and a little metadata. A peer that offers
// less is refused at connection time.
inline constexpr size_t kMinSlotSize = kHeaderSize + 64;

// OK, or INVALID_ARGUMENT naming the first option (and its environment
// variable) that cannot work: a slot below kMinSlotSize or beyond what the
// handshake can carry, no receive or send slots, no credits, no completion
// queue or more than kMaxCompletionQueues, a GID index below -1, a type of
// service outside -1 to 255, an RNR wait outside the table's 1 to
// kLongestRnrWaitUs, a max_cq_entries too small for the role's receive
// slots and one connection (`listening`: a server's). Listen and Connect
// check this first, device or not.
absl::Status CheckRdmaOptions(const RdmaOptions& options, bool listening);

// The QP ACK timeout exponent (4.096 us x 2^e per try) that keeps
// kTransportRetries + 1 tries within peer_timeout_ms; -1 when it is 0.
int AckTimeoutExponent(uint32_t peer_timeout_ms);

// The longest RNR NAK timer the IBA table has (code 31).
inline constexpr uint32_t kLongestRnrWaitUs = 491520;

// The IBA min_rnr_timer code (1 to 31) of the shortest wait of at least
// `wait_us` (1 to kLongestRnrWaitUs), and how long a code waits, in us.
uint8_t RnrTimerCode(uint32_t wait_us);
uint32_t RnrTimerMicros(uint8_t code);

// `options` with what the environment sets: RDMARPC_RDMA_POLL
// (adaptive|busy|event), RDMARPC_RDMA_SPIN_US, RDMARPC_RDMA_DEVICE,
// RDMARPC_RDMA_PORT, RDMARPC_RDMA_GID_INDEX, RDMARPC_RDMA_TOS,
// RDMARPC_RDMA_SLOT_SIZE,
// RDMARPC_RDMA_CREDITS, RDMARPC_RDMA_MAX_BACKLOG_BYTES, RDMARPC_RDMA_READ_THRESHOLD,
// RDMARPC_RDMA_RELEASE_TIMEOUT_MS, RDMARPC_RDMA_PEER_TIMEOUT_MS,
// RDMARPC_RDMA_RNR_WAIT_US, RDMARPC_RDMA_KEEPALIVE_MS,
// RDMARPC_RDMA_STRICT_CREDITS, RDMARPC_RDMA_TRACE.
// A value that does not parse is reported on stderr and leaves the option
// as it was. MakeTransport applies this to every RDMA transport it makes,
// over the options from code.
RdmaOptions RdmaOptionsFromEnv(RdmaOptions options = {});

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_OPTIONS_H_
