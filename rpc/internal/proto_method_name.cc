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

absl::string_view ServiceOfMethod(absl::string_view full_name) {
  const size_t end = full_name.rfind('/');
  if (full_name.empty() || full_name[0] != '/' || end == absl::string_view::npos || end < 2) {
    return absl::string_view();
  }
  return full_name.substr(1, end - 1);
}

}  // namespace rdmarpc::internal
