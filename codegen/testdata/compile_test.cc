// Generated code for tricky protos compiles warning-free (this file and the
// generated .cc files build with -Werror) and has the promised shape.
#include <type_traits>

#include "codegen/testdata/empty.rdmarpc.pb.h"
#include "codegen/testdata/imports.rdmarpc.pb.h"
#include "codegen/testdata/lite.rdmarpc.pb.h"
#include "codegen/testdata/long_names.rdmarpc.pb.h"
#include "codegen/testdata/multi_service.rdmarpc.pb.h"
#include "codegen/testdata/names.rdmarpc.pb.h"
#include "codegen/testdata/nested_package.rdmarpc.pb.h"
#include "codegen/testdata/no_package.rdmarpc.pb.h"
#include "gtest/gtest.h"
#include "rpc/method_id.h"

namespace {

namespace names = ::rdmarpc::codegen_test::names;
namespace nested = ::rdmarpc::codegen_test::deeply::nested;

TEST(Generated, MethodTableHoldsFullNamesAndIds) {
  EXPECT_STREQ(nested::Nester::Methods::kDown.full_name,
               "/rdmarpc.codegen_test.deeply.nested.Nester/Down");
  EXPECT_EQ(nested::Nester::Methods::kDown.id,
            rdmarpc::MethodId("/rdmarpc.codegen_test.deeply.nested.Nester/Down"));
  EXPECT_STREQ(Pinger::Methods::kPing.full_name, "/Pinger/Ping");
  EXPECT_STREQ(Pinger::kServiceName, "Pinger");
}

TEST(Generated, EachServiceRegistersEachMethod) {
  rdmarpc::codegen_test::multi::First::Service first;
  rdmarpc::codegen_test::multi::Second::Service second;
  rdmarpc::codegen_test::multi::Third::Service third;
  EXPECT_EQ(first.methods().size(), 2u);
  EXPECT_EQ(second.methods().size(), 1u);
  EXPECT_EQ(third.methods().size(), 0u);
  EXPECT_EQ(first.methods()[1].full_name, "/rdmarpc.codegen_test.multi.First/Tell");
}

TEST(Generated, CollidingAndKeywordNamesAreRenamedPredictably) {
  // Service Stub: outer class Stub_, rpc "Stub" becomes Stub_ in class Stub.
  using StubStub = names::Stub_::Stub;
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&StubStub::Stub_)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&StubStub::Service)>));
  // rpc Foo keeps Foo/AsyncFoo/FooAsync; AsyncFoo, FooAsync and FooFuture get '_'s.
  using SvcStub = names::Service_::Stub;
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&SvcStub::Foo)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&SvcStub::AsyncFoo)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&SvcStub::AsyncFoo_)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&SvcStub::FooFuture_)>));
  // Keywords and macros get one '_'.
  using KwStub = names::class_::Stub;
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&KwStub::delete_)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&KwStub::errno_)>));
  EXPECT_TRUE((std::is_member_function_pointer_v<decltype(&KwStub::channel__)>));
  // Same C++ name as the message Foo.Bar.
  EXPECT_STREQ(names::Foo_Bar_::kServiceName, "rdmarpc.codegen_test.names.Foo_Bar");
  // Same names as the outer class's members NewStub and kServiceName.
  EXPECT_STREQ(names::NewStub_::kServiceName, "rdmarpc.codegen_test.names.NewStub");
  EXPECT_STREQ(names::kServiceName_::kServiceName, "rdmarpc.codegen_test.names.kServiceName");
  // The enum struct_ has the name the service struct would get.
  EXPECT_STREQ(names::struct__::kServiceName, "rdmarpc.codegen_test.names.struct");
  EXPECT_EQ(names::struct_::STRUCT_UNSPECIFIED, 0);
  names::class_::Service kw;
  EXPECT_EQ(kw.methods().size(), 11u);
}

// A service overriding one method; the rest answer UNIMPLEMENTED.
class ImporterImpl : public rdmarpc::codegen_test::imports::Importer::Service {
 public:
  rdmarpc::Status Now(rdmarpc::ServerContext*, const google::protobuf::Empty*,
                      google::protobuf::Timestamp* now) override {
    now->set_seconds(42);
    return rdmarpc::Status();
  }
};

TEST(Generated, DefaultHandlersAnswerUnimplemented) {
  ImporterImpl impl;
  google::protobuf::StringValue req;
  nested::Outer::Inner resp;
  const rdmarpc::Status s = impl.Wrap(nullptr, &req, &resp);
  EXPECT_EQ(s.code(), rdmarpc::StatusCode::kUnimplemented);
  EXPECT_NE(s.message().find("/rdmarpc.codegen_test.imports.Importer/Wrap"), std::string::npos);
  google::protobuf::Empty empty;
  google::protobuf::Timestamp ts;
  rdmarpc::Status got;
  impl.NowAsync(nullptr, &empty, &ts, [&](rdmarpc::Status st) { got = st; });
  EXPECT_TRUE(got.ok());
  EXPECT_EQ(ts.seconds(), 42);
}

TEST(Generated, LiteAndEmptyAndLongNamesHaveStubs) {
  EXPECT_TRUE((std::is_class_v<rdmarpc::codegen_test::lite::Lite::Stub>));
  EXPECT_TRUE((std::is_class_v<rdmarpc::codegen_test::empty::Void::Stub>));
  rdmarpc::codegen_test::a_rather_long_package_name::that_keeps_going::and_going::
      SVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceNameVeryLongServiceName::Service
          svc;
  EXPECT_EQ(svc.methods().size(), 1u);
}

}  // namespace
