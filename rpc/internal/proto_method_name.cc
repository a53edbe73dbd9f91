#include "rpc/internal/proto_method_name.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace rdmarpc::internal {

std::string ProtoMethodName(const google::protobuf::FileDescriptor& file, absl::string_view service,
                            absl::string_view method) {
  const google::protobuf::ServiceDescriptor* s = file.FindServiceByName(std::string(service));
  const google::protobuf::MethodDescriptor* m =
      s == nullptr ? nullptr : s->FindMethodByName(std::string(method));
  if (m == nullptr) {
    fprintf(stderr, "rdmarpc: %s declares no method %s.%s\n", file.name().c_str(),
            std::string(service).c_str(), std::string(method).c_str());
    abort();
  }
  return absl::StrCat("/", s->full_name(), "/", m->name());
}

}  // namespace rdmarpc::internal
