// The name a generated stub calls a method by, "/package.Service/Method":
// looked up in the descriptor of the .proto file that declares it, for the
// services the runtime writes by hand (health.cc, stats.cc, reflection.cc),
// so that their names cannot drift from their .proto files; and taken apart.
#ifndef RDMARPC_RPC_INTERNAL_PROTO_METHOD_NAME_H_
#define RDMARPC_RPC_INTERNAL_PROTO_METHOD_NAME_H_

#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"

namespace rdmarpc::internal {

// Precondition: `file` declares `service` with `method`; aborts naming them
// otherwise (a mistake in the runtime, found by any test that builds it).
std::string ProtoMethodName(const google::protobuf::FileDescriptor& file, absl::string_view service,
                            absl::string_view method);

// "package.Service" of "/package.Service/Method"; empty for a name not of
// that form.
absl::string_view ServiceOfMethod(absl::string_view full_name);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RPC_INTERNAL_PROTO_METHOD_NAME_H_
