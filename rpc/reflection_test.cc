// ReflectionService's answer: which services are described and which are
// not, and files that build into a DescriptorPool in the order given, each
// once, imports (nested packages, protobuf's well-known types) included.
#include "rpc/reflection.h"

#include <set>
#include <string>
#include <vector>

#include "codegen/testdata/imports.rdmarpc.pb.h"
#include "codegen/testdata/lite.rdmarpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"

namespace rdmarpc {
namespace {

// A service no .proto declares.
class HandWritten : public Service {
 public:
  HandWritten() {
    AddMethod("/rdmarpc.testing.HandWritten/Do", [](ServerCall* call) {
      call->Finish(Status(StatusCode::kUnimplemented, "not called here"), nullptr);
    });
  }
};

TEST(Reflection, DescribesEveryServiceItCanWithItsImportsInBuildOrder) {
  codegen_test::imports::Importer::Service importer;
  codegen_test::lite::Lite::Service lite;
  HandWritten hand_written;
  const ReflectionService reflection({&importer, &lite, &hand_written});
  const reflection::v1::DescribeResponse& d = reflection.description();

  // Generated services carry their files, lite ones too, and imports.proto
  // (which declares no message, so that its .pb.cc is not even linked in
  // here) is described all the same; the hand-written one has no file.
  EXPECT_EQ(std::vector<std::string>(d.services().begin(), d.services().end()),
            (std::vector<std::string>{"rdmarpc.codegen_test.imports.Importer",
                                      "rdmarpc.codegen_test.lite.Lite",
                                      "rdmarpc.reflection.v1.Reflection"}));
  EXPECT_EQ(
      std::vector<std::string>(d.undescribed_services().begin(), d.undescribed_services().end()),
      std::vector<std::string>{"rdmarpc.testing.HandWritten"});

  google::protobuf::DescriptorPool pool;  // empty: only what the answer brings
  std::set<std::string> names;
  for (const std::string& bytes : d.files()) {
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(bytes));
    EXPECT_TRUE(names.insert(file.name()).second) << file.name() << " sent twice";
    ASSERT_NE(pool.BuildFile(file), nullptr) << file.name() << " came before an import of it";
  }
  EXPECT_EQ(names, (std::set<std::string>{
                       "codegen/testdata/imports.proto", "codegen/testdata/nested_package.proto",
                       "google/protobuf/empty.proto", "google/protobuf/timestamp.proto",
                       "google/protobuf/wrappers.proto", "codegen/testdata/lite.proto",
                       "proto/reflection.proto"}));
  const google::protobuf::MethodDescriptor* wrap =
      pool.FindMethodByName("rdmarpc.codegen_test.imports.Importer.Wrap");
  ASSERT_NE(wrap, nullptr);
  EXPECT_EQ(wrap->input_type()->full_name(), "google.protobuf.StringValue");
  EXPECT_EQ(wrap->output_type()->full_name(), "rdmarpc.codegen_test.deeply.nested.Outer.Inner");
}

}  // namespace
}  // namespace rdmarpc
