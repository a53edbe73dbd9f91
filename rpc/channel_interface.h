// ChannelInterface: what a generated stub calls through, so that one stub
// type serves a Channel (one server, rpc/channel.h) and a BalancedChannel
// (calls spread over several servers of one service,
// rpc/balanced_channel.h).
//
//   std::shared_ptr<rdmarpc::ChannelInterface> channel = *rdmarpc::Channel::Create(address);
//   demo::Echo::Stub stub(channel);   // or a BalancedChannel
//
// Applications call through stubs, or through Channel and BalancedChannel
// directly; implementing the interface outside the library is not a use
// it is meant for, and methods may be added to it.
#ifndef RDMARPC_RPC_CHANNEL_INTERFACE_H_
#define RDMARPC_RPC_CHANNEL_INTERFACE_H_

#include <cstddef>
#include <cstdint>

#include "absl/functional/any_invocable.h"
#include "google/protobuf/message_lite.h"
#include "rpc/attachment.h"
#include "rpc/client_context.h"
#include "rpc/status.h"

namespace rdmarpc {

// What a stub passes per method; generated code has one per rpc (constexpr).
// The name must outlive every call made with it: calls keep the pointer.
struct MethodInfo {
  const char* full_name;  // "/package.Service/Method"
  uint32_t id;            // MethodId(full_name)
};

using CallCallback = absl::AnyInvocable<void(Status) &&>;

class ChannelInterface {
 public:
  virtual ~ChannelInterface() = default;

  // Blocking unary call.
  virtual Status Call(const MethodInfo& method, ClientContext* ctx,
                      const google::protobuf::MessageLite& request,
                      google::protobuf::MessageLite* response) = 0;

  // Asynchronous unary call: `done` runs exactly once. The request is
  // serialized before this returns; `ctx` and `response` must stay alive
  // until `done` runs.
  virtual void CallAsync(const MethodInfo& method, ClientContext* ctx,
                         const google::protobuf::MessageLite& request,
                         google::protobuf::MessageLite* response, CallCallback done) = 0;

  // Memory for a request attachment (rpc/attachment.h) with room after it
  // for a request message of up to `message_room` bytes.
  virtual StatusOr<Attachment> AllocateAttachment(
      size_t size, size_t message_room = kDefaultAttachmentMessageRoom) = 0;
};

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_CHANNEL_INTERFACE_H_
