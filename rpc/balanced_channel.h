// BalancedChannel: calls spread over several servers of one service, in
// turn over those that are connected (gRPC's round_robin policy), or to the
// one with the fewest calls in flight (gRPC's least_request).
//
//   auto channel = rdmarpc::BalancedChannel::Create(
//       {"rdma://10.0.0.7:7471", "rdma://10.0.0.8:7471", "rdma://10.0.0.9:7471"});
//   if (!channel.ok()) ...;
//   demo::Echo::Stub stub(*channel);   // generated stubs take any ChannelInterface
//
// Why: replicas of a service share its load only if their clients spread
// their calls over them, and a Channel reaches one address. A
// BalancedChannel holds one Channel per address (its backends), made by one
// ChannelGroup (rpc/channel_group.h), so they share a transport per kind, a
// timer thread and the callback threads, and starts connecting all of them
// at once. Each call goes to a backend that is READY, as the
// BalancingPolicy picks it; one that is not is passed over, and asked to
// connect again (after its reconnect backoff), so a server that went away
// gets its share again once it is back. When none is READY, a call goes to
// the next backend that is connecting or idle and waits there for the
// connection, as on a Channel; when every backend's last attempt failed, to
// the next in turn, where it waits for that backend's next attempt. A call
// waiting so does not stay with its backend once another is READY, as gRPC
// picks a queued call again: when another backend connects, the calls
// waiting on those that are not READY go to it (or to another READY one,
// as the policy picks); when the attempt a call waits for fails, or its
// connection goes before it is sent, it goes to a READY backend if there is
// one (ChannelStats::waits_elsewhere counts the moves, on the backend
// left). Only with none READY does such a call end UNAVAILABLE (a
// wait-for-ready call waits on, and a call whose connection went before it
// was sent has its one transparent retry). GetState, WaitForStateChange and
// WaitForConnected show where the channel as a whole stands, and connect
// ahead of the first call, as a Channel's do.
//
// What not to rely on:
// - Round robin counts calls, not load: a slow server gets as many as a
//   fast one. Least requests counts the calls this client has in flight on
//   each backend (Channel::calls_in_flight), not the server's load from
//   other clients, and reads them as the call is given out: calls made at
//   once from several threads may see the same counts and bunch on one
//   backend.
// - A retry under a RetryPolicy goes to another backend that is READY when
//   there is one, picked as a call is (gRPC picks again for each attempt),
//   and to the same one when there is none (ChannelStats::
//   retries_elsewhere counts the moves, on the backend left).
// - A waiting call with an attachment stays with its backend, whose
//   transport's memory holds it. The others move when a backend connects
//   through its connector (for calls, GetState(true), WaitForConnected), not
//   when AllocateAttachment connects it: until its connector next runs,
//   calls may wait on another backend while it is READY.
// - A backend's state is read as the call is given out: a server that
//   shuts down at that moment may still get it, which the channel then
//   handles as any Channel does (the GOAWAY, a transparent retry).
// - AllocateAttachment takes memory from the backend the next call would
//   get, without taking its turn, so a thread's next call goes there too. A
//   call of another thread may change that first: the attachment then goes
//   to another backend, which sends it as it is where the two share a
//   transport and device (over RDMA, the device's registered memory) and
//   copies it once where they do not (rpc/attachment.h).
#ifndef RDMARPC_RPC_BALANCED_CHANNEL_H_
#define RDMARPC_RPC_BALANCED_CHANNEL_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "base/steady_clock.h"
#include "rpc/channel.h"
#include "rpc/channel_group.h"
#include "rpc/channel_interface.h"
#include "rpc/status.h"

namespace rdmarpc {

// Which READY backend a call goes to. Both pass over the backends that are
// not READY the same way (above).
enum class BalancingPolicy {
  // The next in turn; the turn moves past the backends passed over, so that
  // the others share evenly while one is down.
  kRoundRobin,
  // The one with the fewest calls in flight from this channel, the first
  // from the turn among equals, the turn moving past it: a slow server,
  // whose calls last, gets fewer new ones, and backends with equal counts
  // get their calls in turn. Scans every backend per call (a lock-free
  // read each), so it suits the tens of replicas of one service, not
  // thousands.
  kLeastRequests,
};

namespace internal {

// What a backend knows of its BalancedChannel, to give a retry to another
// backend (Channel::ResendElsewhere): nothing, once it is destroyed. Held by
// the backends too, which may outlive it (backends()).
struct BalancerLink {
  std::mutex mu;
  BalancedChannel* owner = nullptr;  // guarded by mu

  // A count of the backends' state changes, which the BalancedChannel's
  // waits (WaitForConnected) wait on: read before the states are, it says
  // whether one changed since. state_mu is a leaf, taken under a backend's
  // lock.
  void StateChanged() {
    {
      std::lock_guard<std::mutex> lock(state_mu);
      ++state_changes;
    }
    state_changed.notify_all();
  }
  uint64_t StateChanges() {
    std::lock_guard<std::mutex> lock(state_mu);
    return state_changes;
  }
  // Until a change after `seen` (true) or `deadline`, on SteadyNow()'s
  // clock (false).
  bool WaitForChangeAfter(uint64_t seen, absl::Time deadline) {
    std::unique_lock<std::mutex> lock(state_mu);
    return WaitUntil(state_changed, lock, deadline, [&] { return state_changes != seen; });
  }
  std::mutex state_mu;
  std::condition_variable state_changed;
  uint64_t state_changes = 0;  // guarded by state_mu
};

}  // namespace internal

class BalancedChannel final : public ChannelInterface {
 public:
  // A backend per address, made with `options` by a group of its own.
  // INVALID_ARGUMENT for no address, or an address that does not parse
  // (naming it); the errors of ChannelGroup::Create and NewChannel.
  static StatusOr<std::shared_ptr<BalancedChannel>> Create(
      const std::vector<std::string>& addresses, ChannelOptions options = {},
      BalancingPolicy policy = BalancingPolicy::kRoundRobin);
  // The same, the backends made by `group` (with its options), beside its
  // other channels.
  static StatusOr<std::shared_ptr<BalancedChannel>> Create(
      const std::shared_ptr<ChannelGroup>& group, const std::vector<std::string>& addresses,
      BalancingPolicy policy = BalancingPolicy::kRoundRobin);

  Status Call(const MethodInfo& method, ClientContext* ctx,
              const google::protobuf::MessageLite& request,
              google::protobuf::MessageLite* response) override;
  void CallAsync(const MethodInfo& method, ClientContext* ctx,
                 const google::protobuf::MessageLite& request,
                 google::protobuf::MessageLite* response, CallCallback done) override;
  StatusOr<Attachment> AllocateAttachment(
      size_t size, size_t message_room = kDefaultAttachmentMessageRoom) override;

  // Where the channel stands, its backends' states summed up as gRPC sums
  // up a channel's subchannels: READY when one backend is, else CONNECTING
  // when one is, else IDLE when one is, else TRANSIENT_FAILURE (every
  // backend's last attempt failed). With `try_to_connect`, each backend
  // that is not READY or CONNECTING starts an attempt, after its backoff
  // (Channel::GetState).
  ChannelState GetState(bool try_to_connect);
  // Waits until GetState(false) is no longer `last` (true) or `deadline`, a
  // wall-clock time as absl::Now() gives it, passes (false). It starts no
  // attempt.
  bool WaitForStateChange(ChannelState last, absl::Time deadline);
  // Connects every backend that is not connected, each through failed
  // attempts (after its backoff), until one is READY (true) or `deadline`
  // (wall-clock, as above) passes (false). From an inline callback of a
  // backend (callback_threads = 0) it waits for nothing: it asks for the
  // attempts and says whether one backend is READY.
  bool WaitForConnected(absl::Time deadline);

  // One Channel per address, in the order given: their states and stats().
  // Destroying the BalancedChannel destroys them, which ends their pending
  // calls UNAVAILABLE (Channel's destructor).
  const std::vector<std::shared_ptr<Channel>>& backends() const { return backends_; }
  BalancingPolicy policy() const { return policy_; }

  ~BalancedChannel() override;

 private:
  friend class Channel;

  BalancedChannel(std::vector<std::shared_ptr<Channel>> backends, BalancingPolicy policy);

  // The backend for the next call (see above); without `take_turn`, the
  // one the next call would get, the turn left to it.
  Channel& Pick(bool take_turn);
  // For a retry leaving `failed`: the backend a call would get, but only
  // one that is READY and not `failed`; null when there is none. Under
  // link_->mu.
  Channel* PickForRetry(const Channel& failed);
  // What both pick with: `instead_of`, when given, is passed over, and
  // then null is returned where no other backend is READY.
  Channel* PickFrom(bool take_turn, const Channel* instead_of);

  const std::vector<std::shared_ptr<Channel>> backends_;
  const BalancingPolicy policy_;
  // Where the next call's turn starts; moved on past the backend a call
  // went to, so that the others share evenly while one is down or busy.
  std::atomic<uint64_t> next_{0};
  const std::shared_ptr<internal::BalancerLink> link_ = std::make_shared<internal::BalancerLink>();
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_BALANCED_CHANNEL_H_
