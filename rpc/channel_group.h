// ChannelGroup: channels to many servers that share one transport, one
// timer thread and one set of callback threads.
//
//   rdmarpc::ChannelOptions options;          // for every channel of the group
//   auto group = rdmarpc::ChannelGroup::Create(options);
//   if (!group.ok()) ...;
//   std::vector<demo::Echo::Stub> stubs;
//   for (const std::string& server : servers) {   // "rdma://10.0.0.7:7471", ...
//     auto channel = (*group)->NewChannel(server);
//     if (!channel.ok()) ...;
//     stubs.emplace_back(*channel);
//   }
//
// Why: a channel made alone (Channel::Create) has everything of its own:
// over RDMA a Shared Receive Queue with its registered receive slots, a
// completion queue, a poller thread and an rdma_cm thread, then a timer
// thread and its callback threads. Right for one server; for a client of a
// hundred servers it is a hundred SRQs and five hundred threads. The
// channels of a group share one transport per kind (auto:// addresses share
// rdma://'s where a device is usable, and have their own without one,
// which turns to RDMA once one is; over RDMA one SRQ, CQ and poller per
// device, as a server's connections share its own),
// so receive memory and threads stay flat as servers are added.
//
// Per channel still: its connection (made on the first call, made again
// after it is lost), its pending calls and their ids. Destroying a channel
// closes its connection and ends its pending calls UNAVAILABLE; the others
// go on. Channels keep what they share alive: the group may go first.
//
// What not to rely on:
// - The shared SRQ's receive slots (RdmaOptions::client_receive_slots) serve
//   every channel's responses, so they bound the group's calls in flight
//   over RDMA (51 of the default 64 with one channel, 46 with two, 42
//   from three on): calls beyond wait to be sent until responses
//   come back, so that no response ever meets an empty SRQ. Calls parked
//   on one server (long polls) hold that room for the others too. A group
//   of many busy channels raises it (ChannelOptions::transport.rdma) to
//   its calls in flight; the first call held back says so on stderr.
//   With RdmaOptions::strict_credits, a channel whose connection finds no
//   slots left to grant fails its calls UNAVAILABLE, saying so (the default
//   64 hold two channels' windows).
// - A blocking call that drives its connection (run-to-completion) picks up
//   other channels' completions as well, and with callback_threads = 0 runs
//   their callbacks; the transport's I/O thread runs them too.
// - A channel destroyed inside an inline callback (callback_threads = 0) is
//   destroyed on a thread of its own, shortly after: that callback may be
//   running on the I/O thread that the destructor waits for. Likewise a
//   channel destroyed on one of the group's callback threads does not wait
//   for its callbacks queued behind that one.
#ifndef RDMARPC_RPC_CHANNEL_GROUP_H_
#define RDMARPC_RPC_CHANNEL_GROUP_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "rpc/channel.h"
#include "rpc/status.h"

namespace rdmarpc {

class ChannelGroup {
 public:
  // INVALID_ARGUMENT for options no channel could use (negative
  // callback_threads). The group's threads start here (RESOURCE_EXHAUSTED
  // where the process may start no more); transports are made on the first
  // channel of each kind.
  static StatusOr<std::shared_ptr<ChannelGroup>> Create(ChannelOptions options = {});

  // A channel to `address` ("rdma://host:port", "tcp://...", "auto://...")
  // with the group's options. INVALID_ARGUMENT for an address that does not
  // parse; the errors of ResolveScheme and MakeTransport for the first
  // channel of a kind.
  StatusOr<std::shared_ptr<Channel>> NewChannel(const std::string& address);

  const ChannelOptions& options() const { return options_; }

 private:
  ChannelGroup(ChannelOptions options, std::shared_ptr<internal::ThreadPool> callbacks,
               std::shared_ptr<internal::TimerQueue> timers);

  const ChannelOptions options_;
  const std::shared_ptr<internal::ThreadPool> callbacks_;  // null: callbacks run inline
  const std::shared_ptr<internal::TimerQueue> timers_;
  std::mutex mu_;
  // auto:// resolves once, to the kind rdma:// makes where a device is
  // usable, and shares that transport; else to a kind of its own, TCP until
  // a device is usable (ResolveScheme).
  std::map<std::string, std::string> kinds_;                                 // scheme's kind; mu_
  std::map<std::string, std::shared_ptr<transport::Transport>> transports_;  // by kind; mu_
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_CHANNEL_GROUP_H_
