#include "rpc/reflection.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "rpc/internal/proto_method_name.h"

namespace rdmarpc {

using reflection::v1::DescribeRequest;
using reflection::v1::DescribeResponse;

namespace {

// The files of the answer, each once, each after its imports.
class Files {
 public:
  explicit Files(DescribeResponse* description) : description_(description) {}

  // Appends `files`, already in that order, skipping those added before.
  void AddSerialized(const std::vector<absl::string_view>& files) {
    for (absl::string_view bytes : files) {
      google::protobuf::FileDescriptorProto proto;
      if (!proto.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) continue;
      if (added_.insert(proto.name()).second) description_->add_files(std::string(bytes));
    }
  }

  // Appends `file` after the files it imports.
  void AddWithImports(const google::protobuf::FileDescriptor* file) {
    if (added_.count(file->name()) != 0) return;
    for (int i = 0; i < file->dependency_count(); ++i) AddWithImports(file->dependency(i));
    added_.insert(file->name());
    google::protobuf::FileDescriptorProto proto;
    file->CopyTo(&proto);
    description_->add_files(proto.SerializeAsString());
  }

 private:
  DescribeResponse* const description_;
  std::set<std::string> added_;
};

}  // namespace

ReflectionService::ReflectionService(const std::vector<const Service*>& services) {
  const std::string describe =
      internal::ProtoMethodName(*DescribeRequest::descriptor()->file(), "Reflection", "Describe");
  // Each service's name, and the files it carries (generated code's); the
  // runtime's own services, and this one, carry none: they are found in
  // protobuf's generated pool, as their messages are linked in.
  std::map<std::string, const std::vector<absl::string_view>*> names;
  const std::vector<absl::string_view> none;
  names.emplace(std::string(internal::ServiceOfMethod(describe)), &none);
  for (const Service* service : services) {
    for (const Method& m : service->methods()) {
      const absl::string_view name = internal::ServiceOfMethod(m.full_name);
      if (!name.empty()) names.emplace(std::string(name), &service->proto_files());
    }
  }
  Files files(&description_);
  for (const auto& [name, carried] : names) {
    if (!carried->empty()) {
      description_.add_services(name);
      files.AddSerialized(*carried);
      continue;
    }
    const google::protobuf::ServiceDescriptor* d =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    if (d == nullptr) {
      description_.add_undescribed_services(name);
      continue;
    }
    description_.add_services(name);
    files.AddWithImports(d->file());
  }
  auto answer = [this](ServerContext*, const DescribeRequest*, DescribeResponse* resp,
                       DoneCallback done) {
    *resp = description_;
    std::move(done)(Status());
  };
  AddMethod(describe, UnaryHandler<DescribeRequest, DescribeResponse>(answer));
}

}  // namespace rdmarpc
