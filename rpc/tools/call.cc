// rdmarpc_call: lists the methods of a server, or calls one with a request
// written in protobuf's text format and prints the response the same way, as
// grpcurl does for gRPC. It learns the methods and messages from the server's
// reflection service (rpc/reflection.h), so it needs none of the server's
// code or .proto files:
//
//   rdmarpc_call --address rdma://10.0.0.7:7471
//   demo.Greeter
//     rpc Hello(demo.HelloRequest) returns (demo.HelloReply)
//   rdmarpc_call --address rdma://10.0.0.7:7471 --method /demo.Greeter/Hello
//       --request 'name: "world"'
//   text: "hello world"
//
// --method takes "/demo.Greeter/Hello", "demo.Greeter/Hello" or
// "demo.Greeter.Hello". --metadata request-id=42,tenant=a sends metadata
// with the call (values cannot hold commas here); the metadata the server
// answers with goes to stderr, "rdmarpc_call: server metadata: key: value".
// A failed call's status goes there too, with its details (status
// payloads) as bytes, and then a line for each one it can read: a message
// type the server describes, in text format, and a google.rpc.RetryInfo as
// its delay:
//
//   rdmarpc_call: /demo.Greeter/Hello: UNAVAILABLE: overloaded [...]
//   rdmarpc_call: detail google.rpc.RetryInfo: retry after 200ms
//
// Exit status: 0 answered (the call OK); 1 the call ended with an error (its
// status on stderr); 2 no answer from the reflection service (unreachable,
// timed out, a server without it); 3 bad arguments: an address that does not
// parse, a method the server does not describe, a request that does not
// parse as its message.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "proto/reflection.rdmarpc.pb.h"
#include "rpc/method_id.h"
#include "rpc/retry_info.h"
#include "rpc/tools/call_once.h"
#include "rpc/tools/server_flags.h"

ABSL_FLAG(std::string, method, "",
          "the method to call, /package.Service/Method; without it, lists the server's methods");
ABSL_FLAG(std::string, request, "", "the request, in protobuf's text format (empty: all defaults)");
ABSL_FLAG(std::vector<std::string>, metadata, {},
          "metadata for the call, key=value[,key=value...]; what the server sends back is printed "
          "on stderr");

namespace {

using google::protobuf::DescriptorPool;
using google::protobuf::MethodDescriptor;
using rdmarpc::reflection::v1::DescribeRequest;
using rdmarpc::reflection::v1::DescribeResponse;
using rdmarpc::tools::kBadArguments;
using rdmarpc::tools::kNoAnswer;

constexpr char kTool[] = "rdmarpc_call";

// The text parser's complaints, "line:column: what", for one line on stderr.
class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  // `line` is -1 for what concerns the whole message (required fields).
  void AddError(int line, int column, const std::string& message) override {
    absl::StrAppend(&errors_, errors_.empty() ? "" : "; ");
    if (line >= 0) absl::StrAppend(&errors_, line + 1, ":", column + 1, ": ");
    absl::StrAppend(&errors_, message);
  }
  const std::string& errors() const { return errors_; }

 private:
  std::string errors_;
};

void List(const DescriptorPool& pool, const DescribeResponse& description) {
  for (const std::string& name : description.services()) {
    printf("%s\n", name.c_str());
    const google::protobuf::ServiceDescriptor* service = pool.FindServiceByName(name);
    for (int i = 0; service != nullptr && i < service->method_count(); ++i) {
      const MethodDescriptor* m = service->method(i);
      printf("  rpc %s(%s) returns (%s)\n", m->name().c_str(), m->input_type()->full_name().c_str(),
             m->output_type()->full_name().c_str());
    }
  }
  for (const std::string& name : description.undescribed_services()) {
    printf("%s (undescribed: the server's binary has no .proto description of it)\n", name.c_str());
  }
}

// "/a.B/C", "a.B/C" or "a.B.C" in `pool`, or null.
const MethodDescriptor* FindMethod(const DescriptorPool& pool, std::string name) {
  if (!name.empty() && name[0] == '/') name.erase(0, 1);
  size_t split = name.rfind('/');
  if (split == std::string::npos) split = name.rfind('.');
  if (split == std::string::npos) return nullptr;
  const google::protobuf::ServiceDescriptor* service =
      pool.FindServiceByName(name.substr(0, split));
  return service == nullptr ? nullptr : service->FindMethodByName(name.substr(split + 1));
}

// One line on stderr for each of the error's details that can be read: a
// message type the server describes, in text format, and a RetryInfo (which
// servers send without describing it) as its delay. Status::ToString, printed
// before, has them all as bytes.
void PrintDetails(const rdmarpc::Status& status, const DescriptorPool& pool,
                  google::protobuf::DynamicMessageFactory& factory) {
  status.ForEachPayload([&](absl::string_view type_url, const absl::Cord& value) {
    const absl::string_view type = type_url.substr(type_url.rfind('/') + 1);
    const google::protobuf::Descriptor* descriptor = pool.FindMessageTypeByName(std::string(type));
    std::string text;
    if (descriptor != nullptr) {
      std::unique_ptr<google::protobuf::Message> detail(factory.GetPrototype(descriptor)->New());
      if (!detail->ParseFromString(std::string(value))) {
        text = absl::StrCat(value.size(), " bytes that do not parse as it");
      } else {
        google::protobuf::TextFormat::Printer printer;
        printer.SetSingleLineMode(true);
        printer.PrintToString(*detail, &text);
        if (!text.empty() && text.back() == ' ') text.pop_back();
      }
    } else if (type_url == rdmarpc::kRetryInfoTypeUrl) {
      const std::optional<absl::Duration> delay = rdmarpc::RetryDelay(status);
      if (!delay) return;
      text = *delay < absl::ZeroDuration()
                 ? "do not retry"
                 : absl::StrCat("retry after ", absl::FormatDuration(*delay));
    } else {
      return;
    }
    fprintf(stderr, "%s: detail %s: %s\n", kTool, std::string(type).c_str(), text.c_str());
  });
}

int Call(const std::string& address, const DescriptorPool& pool, const std::string& method_name,
         const std::string& request_text, const std::vector<std::string>& metadata,
         int timeout_ms) {
  const MethodDescriptor* method = FindMethod(pool, method_name);
  if (method == nullptr) {
    fprintf(stderr,
            "%s: the server at %s describes no method %s; `%s --address %s` lists those it "
            "describes\n",
            kTool, address.c_str(), method_name.c_str(), kTool, address.c_str());
    return kBadArguments;
  }
  google::protobuf::DynamicMessageFactory factory(&pool);
  std::unique_ptr<google::protobuf::Message> request(
      factory.GetPrototype(method->input_type())->New());
  std::unique_ptr<google::protobuf::Message> response(
      factory.GetPrototype(method->output_type())->New());
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(request_text, request.get())) {
    fprintf(stderr, "%s: --request is not a %s in text format: %s\n", kTool,
            method->input_type()->full_name().c_str(), errors.errors().c_str());
    return kBadArguments;
  }
  const std::string full_name =
      absl::StrCat("/", method->service()->full_name(), "/", method->name());
  auto channel = rdmarpc::Channel::Create(address);
  if (!channel.ok()) {
    fprintf(stderr, "%s: %s: %s\n", kTool, address.c_str(), channel.status().ToString().c_str());
    return kNoAnswer;
  }
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(absl::Milliseconds(timeout_ms));
  for (const std::string& pair : metadata) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos) {
      fprintf(stderr, "%s: --metadata %s is not key=value\n", kTool, pair.c_str());
      return kBadArguments;
    }
    ctx.AddMetadata(pair.substr(0, eq), pair.substr(eq + 1));
  }
  const rdmarpc::Status s =
      (*channel)->Call(rdmarpc::MethodInfo{full_name.c_str(), rdmarpc::MethodId(full_name)}, &ctx,
                       *request, response.get());
  for (const auto& [key, value] : ctx.server_metadata()) {
    fprintf(stderr, "%s: server metadata: %s: %s\n", kTool, key.c_str(), value.c_str());
  }
  if (!s.ok()) {
    fprintf(stderr, "%s: %s: %s\n", kTool, full_name.c_str(), s.ToString().c_str());
    PrintDetails(s, pool, factory);
    return 1;
  }
  std::string text;
  google::protobuf::TextFormat::PrintToString(*response, &text);
  fputs(text.c_str(), stdout);
  return 0;
}

int Run(const std::string& address, const std::string& method, const std::string& request,
        const std::vector<std::string>& metadata, int timeout_ms) {
  DescribeResponse description;
  const int rc = rdmarpc::tools::CallOnce(
      kTool, address, address, timeout_ms, "reflection", "EnableReflectionService",
      [&](std::shared_ptr<rdmarpc::Channel> channel, rdmarpc::ClientContext* ctx) {
        return rdmarpc::reflection::v1::Reflection::NewStub(channel)->Describe(
            ctx, DescribeRequest(), &description);
      });
  if (rc != 0) return rc;
  DescriptorPool pool;
  for (const std::string& bytes : description.files()) {
    google::protobuf::FileDescriptorProto file;
    if (!file.ParseFromString(bytes) || pool.BuildFile(file) == nullptr) {
      fprintf(stderr, "%s: the server at %s described %s in a way that does not build\n", kTool,
              address.c_str(), file.name().empty() ? "a file" : file.name().c_str());
      return kNoAnswer;
    }
  }
  if (method.empty()) {
    List(pool, description);
    return 0;
  }
  return Call(address, pool, method, request, metadata, timeout_ms);
}

}  // namespace

int main(int argc, char** argv) {
  const auto flags = rdmarpc::tools::ParseServerFlags(
      argc, argv,
      absl::StrCat(kTool,
                   " --address rdma://host:port [--method /package.Service/Method "
                   "[--request TEXT] [--metadata key=value,...]] [--timeout_ms N > 0]"));
  if (!flags) return kBadArguments;
  return Run(flags->address, absl::GetFlag(FLAGS_method), absl::GetFlag(FLAGS_request),
             absl::GetFlag(FLAGS_metadata), flags->timeout_ms);
}
