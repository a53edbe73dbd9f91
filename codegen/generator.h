// RdmarpcGenerator: the protoc plugin's code generator (protoc-gen-rdmarpc).
//
// For every `foo.proto` with services it writes `foo.rdmarpc.pb.h/.cc` next to
// protobuf's `foo.pb.h/.cc`. For a service `pkg.Echo` they hold the class
// `pkg::Echo` with
//   - Echo::Methods   the method table: one rdmarpc::MethodInfo per rpc
//                     ("/pkg.Echo/Say", MethodId of it; see rpc/method_id.h);
//   - Echo::Stub      the client, over an rdmarpc::ChannelInterface (a Channel
//                     or a BalancedChannel, rpc/channel_interface.h): per rpc
//                     a blocking `Say(ctx, req, &resp)`,
//                     a callback form `AsyncSay(ctx, req, &resp, done)` and a
//                     future form `SayFuture(ctx, req)`;
//   - Echo::Service   the server base class: per rpc an overridable
//                     `Status Say(ctx, req, resp)` (answers UNIMPLEMENTED unless
//                     overridden) and `void SayAsync(ctx, req, resp, done)`
//                     (calls Say unless overridden); it hands
//                     Service::SetProtoFiles the file and its imports as
//                     serialized FileDescriptorProtos, which the .rdmarpc.pb.cc
//                     holds, for the reflection service (rpc/reflection.h).
//
// Naming: a name that is a C++ keyword gets a trailing '_' (as protobuf does
// for fields); a generated member name that would collide with another in the
// same class (rpc `Foo` and `AsyncFoo`, an rpc called `Stub`, a service
// called `NewStub`, or one named as a message of its package) gets
// trailing '_'s until it is unique, blocking names first, so the common case
// keeps the plain names. The generated header lists each rpc's names.
//
// Refused, with an error naming the file, service and method: streaming rpcs;
// two rpcs of one file whose method ids collide.
//
// This file knows protobuf's descriptors and rpc/'s public API, nothing of
// any transport.
#ifndef RDMARPC_CODEGEN_GENERATOR_H_
#define RDMARPC_CODEGEN_GENERATOR_H_

#include <string>

#include "google/protobuf/compiler/code_generator.h"

namespace rdmarpc::codegen {

class RdmarpcGenerator : public google::protobuf::compiler::CodeGenerator {
 public:
  bool Generate(const google::protobuf::FileDescriptor* file, const std::string& parameter,
                google::protobuf::compiler::GeneratorContext* context,
                std::string* error) const override;
  uint64_t GetSupportedFeatures() const override { return FEATURE_PROTO3_OPTIONAL; }
};

}  // namespace rdmarpc::codegen

#endif  // RDMARPC_CODEGEN_GENERATOR_H_
