#include "codegen/generator.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/compiler/cpp/names.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/io/printer.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "rpc/method_id.h"

namespace rdmarpc::codegen {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::FileDescriptor;
using google::protobuf::MethodDescriptor;
using google::protobuf::ServiceDescriptor;
using google::protobuf::compiler::GeneratorContext;
using google::protobuf::io::Printer;

// C++ keywords, plus macros that the C and POSIX headers define as lower-case
// names and that would break a member of that name.
const std::set<std::string>& ReservedWords() {
  static const auto* words = new std::set<std::string>{
      "alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break",
      "case", "catch", "char", "char8_t", "char16_t", "char32_t", "class", "compl", "concept",
      "const", "consteval", "constexpr", "constinit", "const_cast", "continue", "co_await",
      "co_return", "co_yield", "decltype", "default", "delete", "do", "double", "dynamic_cast",
      "else", "enum", "explicit", "export", "extern", "false", "float", "for", "friend", "goto",
      "if", "inline", "int", "long", "mutable", "namespace", "new", "noexcept", "not", "not_eq",
      "nullptr", "operator", "or", "or_eq", "private", "protected", "public", "register",
      "reinterpret_cast", "requires", "return", "short", "signed", "sizeof", "static",
      "static_assert", "static_cast", "struct", "switch", "template", "this", "thread_local",
      "throw", "true", "try", "typedef", "typeid", "typename", "union", "unsigned", "using",
      "virtual", "void", "volatile", "wchar_t", "while", "xor", "xor_eq",
      // macros
      "assert", "errno", "major", "minor", "makedev", "offsetof", "setjmp", "stdin", "stdout",
      "stderr", "linux", "unix", "EOF", "NULL", "TRUE", "FALSE", "DEBUG", "NDEBUG",
  };
  return *words;
}

std::string Escape(const std::string& name) {
  return ReservedWords().count(name) ? name + "_" : name;
}

// Hands out names in one C++ class scope, never the same twice.
class Scope {
 public:
  explicit Scope(std::set<std::string> reserved) : taken_(std::move(reserved)) {}
  std::string Claim(const std::string& wanted) {
    std::string name = Escape(wanted);
    while (taken_.count(name)) name += "_";
    taken_.insert(name);
    return name;
  }

 private:
  std::set<std::string> taken_;
};

struct MethodNames {
  const MethodDescriptor* method;
  std::string full_name;  // "/pkg.Service/Method"
  uint32_t id;
  std::string constant;   // in Methods
  std::string stub_sync, stub_async, stub_future;
  std::string service_sync, service_async;
  std::string request, response;  // qualified C++ types
};

std::string Namespace(const FileDescriptor* file) {
  if (file->package().empty()) return "";
  return absl::StrCat("::", absl::StrReplaceAll(file->package(), {{".", "::"}}));
}

std::string HeaderGuard(const std::string& file_name) {
  std::string guard;
  for (char c : file_name) guard += std::isalnum(static_cast<unsigned char>(c)) ? std::toupper(c) : '_';
  return guard + "_RDMARPC_PB_H_";
}

// Class names that protobuf generates into the file's namespace, from this
// file and every file it depends on in the same package.
void CollectClassNames(const FileDescriptor* file, const std::string& package,
                       std::set<std::string>* names, std::set<const FileDescriptor*>* seen) {
  if (!seen->insert(file).second) return;
  for (int i = 0; i < file->dependency_count(); ++i)
    CollectClassNames(file->dependency(i), package, names, seen);
  if (file->package() != package) return;
  std::vector<const Descriptor*> stack;
  for (int i = 0; i < file->message_type_count(); ++i) stack.push_back(file->message_type(i));
  for (int i = 0; i < file->enum_type_count(); ++i)
    names->insert(google::protobuf::compiler::cpp::ClassName(file->enum_type(i)));
  while (!stack.empty()) {
    const Descriptor* d = stack.back();
    stack.pop_back();
    names->insert(google::protobuf::compiler::cpp::ClassName(d));
    for (int i = 0; i < d->nested_type_count(); ++i) stack.push_back(d->nested_type(i));
    for (int i = 0; i < d->enum_type_count(); ++i)
      names->insert(google::protobuf::compiler::cpp::ClassName(d->enum_type(i)));
  }
}

struct ServiceNames {
  const ServiceDescriptor* service;
  std::string cls;        // the outer class, unqualified
  std::string qualified;  // with namespace
  std::vector<MethodNames> methods;
};

void OpenNamespace(Printer& p, const FileDescriptor* file) {
  if (file->package().empty()) return;
  for (const auto& part : absl::StrSplit(file->package(), '.')) {
    p.Print("namespace $ns$ {\n", "ns", std::string(part));
  }
  p.Print("\n");
}

void CloseNamespace(Printer& p, const FileDescriptor* file) {
  if (file->package().empty()) return;
  std::vector<std::string> parts = absl::StrSplit(file->package(), '.');
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
    p.Print("}  // namespace $ns$\n", "ns", *it);
  }
}

void PrintHeader(Printer& p, const FileDescriptor* file, const std::vector<ServiceNames>& services) {
  const std::string base = google::protobuf::compiler::cpp::StripProto(file->name());
  p.Print(
      "// Generated by protoc-gen-rdmarpc from $file$. DO NOT EDIT.\n"
      "// Client stubs and server base classes; see codegen/generator.h.\n"
      "#ifndef $guard$\n#define $guard$\n\n"
      "#include <future>\n#include <memory>\n\n"
      "#include \"$base$.pb.h\"\n"
      "#include \"rpc/channel.h\"\n"
      "#include \"rpc/channel_interface.h\"\n"
      "#include \"rpc/method_id.h\"\n"
      "#include \"rpc/service.h\"\n\n",
      "file", file->name(), "guard", HeaderGuard(file->name()), "base", base);
  OpenNamespace(p, file);
  for (const ServiceNames& s : services) {
    std::map<std::string, std::string> v = {{"cls", s.cls},
                                            {"service", s.service->full_name()}};
    p.Print(v, "// Service $service$.\n");
    for (const MethodNames& m : s.methods) {
      p.Print(
          "//   rpc $rpc$: Stub::$ss$, Stub::$sa$, Stub::$sf$; Service::$vs$, Service::$va$\n",
          "rpc", m.method->name(), "ss", m.stub_sync, "sa", m.stub_async, "sf", m.stub_future,
          "vs", m.service_sync, "va", m.service_async);
    }
    p.Print(v,
            "class $cls$ final {\n"
            " public:\n"
            "  static constexpr char kServiceName[] = \"$service$\";\n\n"
            "  // The method table: full names and wire ids (rpc/method_id.h).\n"
            "  struct Methods {\n");
    for (const MethodNames& m : s.methods) {
      p.Print("    static constexpr ::rdmarpc::MethodInfo $c${\"$fn$\", $id$u};\n", "c", m.constant,
              "fn", m.full_name, "id", absl::StrCat(m.id));
    }
    p.Print("  };\n\n");
    p.Print(v,
            "  // Client side. Thread-safe; one Stub may serve any number of threads.\n"
            "  class Stub final {\n"
            "   public:\n"
            "    explicit Stub(std::shared_ptr<::rdmarpc::ChannelInterface> channel)\n"
            "        : channel_(std::move(channel)) {}\n\n");
    for (const MethodNames& m : s.methods) {
      std::map<std::string, std::string> mv = {
          {"req", m.request}, {"resp", m.response}, {"ss", m.stub_sync},
          {"sa", m.stub_async}, {"sf", m.stub_future}, {"fn", m.full_name}};
      p.Print(mv,
              "    // $fn$: blocks until the call ends.\n"
              "    ::rdmarpc::Status $ss$(::rdmarpc::ClientContext* context, const $req$& request,\n"
              "        $resp$* response);\n"
              "    // $fn$: `done` runs once, on a channel callback thread; `context` and\n"
              "    // `response` must outlive it.\n"
              "    void $sa$(::rdmarpc::ClientContext* context, const $req$& request,\n"
              "        $resp$* response, ::rdmarpc::CallCallback done);\n"
              "    // $fn$: the future becomes ready when the call ends; `context` must\n"
              "    // outlive that.\n"
              "    std::future<::rdmarpc::StatusOr<$resp$>> $sf$(\n"
              "        ::rdmarpc::ClientContext* context, const $req$& request);\n\n");
    }
    p.Print(
        "   private:\n"
        "    std::shared_ptr<::rdmarpc::ChannelInterface> channel_;\n"
        "  };\n\n"
        "  static std::unique_ptr<Stub> NewStub(\n"
        "      std::shared_ptr<::rdmarpc::ChannelInterface> channel) {\n"
        "    return std::make_unique<Stub>(std::move(channel));\n"
        "  }\n\n"
        "  // Server side: derive, override the handlers you serve, register with\n"
        "  // rdmarpc::ServerBuilder::RegisterService. Override either the blocking\n"
        "  // form or the Async form of a method; the other is then unused.\n"
        "  class Service : public ::rdmarpc::Service {\n"
        "   public:\n"
        "    Service();\n"
        "    ~Service() override = default;\n\n");
    for (const MethodNames& m : s.methods) {
      std::map<std::string, std::string> mv = {{"req", m.request},
                                               {"resp", m.response},
                                               {"vs", m.service_sync},
                                               {"va", m.service_async},
                                               {"fn", m.full_name}};
      p.Print(mv,
              "    // $fn$ on a worker thread; the default answers UNIMPLEMENTED.\n"
              "    virtual ::rdmarpc::Status $vs$(::rdmarpc::ServerContext* context,\n"
              "        const $req$* request, $resp$* response);\n"
              "    // $fn$, finished later: call `done` exactly once, from any thread;\n"
              "    // request and response stay valid until then. The default calls $vs$.\n"
              "    virtual void $va$(::rdmarpc::ServerContext* context,\n"
              "        const $req$* request, $resp$* response, ::rdmarpc::DoneCallback done);\n\n");
    }
    p.Print("  };\n};\n\n");
    for (const MethodNames& m : s.methods) {
      p.Print("static_assert(::rdmarpc::MethodId(\"$fn$\") == $id$u,\n"
              "              \"protoc-gen-rdmarpc and rpc/method_id.h disagree\");\n",
              "fn", m.full_name, "id", absl::StrCat(m.id));
    }
    p.Print("\n");
  }
  CloseNamespace(p, file);
  p.Print("\n#endif  // $guard$\n", "guard", HeaderGuard(file->name()));
}

// Appends `file` to `files` after the files it imports, each once.
void AddWithImports(const FileDescriptor* file, std::set<const FileDescriptor*>* added,
                    std::vector<const FileDescriptor*>* files) {
  if (!added->insert(file).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddWithImports(file->dependency(i), added, files);
  }
  files->push_back(file);
}

// `file` and its imports as serialized FileDescriptorProtos, in a static
// array that every Service of the file hands to SetProtoFiles (the reflection
// service describes them by it). Kept in the rdmarpc code rather than looked
// up in protobuf's generated pool: a .pb.cc that declares only services is
// left out of a static link, and lite files have no descriptors there.
void PrintProtoFiles(Printer& p, const FileDescriptor* file) {
  std::set<const FileDescriptor*> added;
  std::vector<const FileDescriptor*> files;
  AddWithImports(file, &added, &files);
  p.Print(
      "namespace rdmarpc {\nnamespace {\n\n"
      "// $file$ and the files it imports, each after its imports, as serialized\n"
      "// google.protobuf.FileDescriptorProto (rpc/service.h, Service::proto_files).\n"
      "constexpr ::absl::string_view kProtoFiles[] = {\n",
      "file", file->name());
  constexpr size_t kChunk = 72;  // escaped characters a line, about
  for (const FileDescriptor* f : files) {
    google::protobuf::FileDescriptorProto proto;
    f->CopyTo(&proto);
    const std::string bytes = proto.SerializeAsString();
    p.Print("    ::absl::string_view(  // $name$\n", "name", f->name());
    // Split between escapes, never inside one; CEscape writes octal escapes
    // of three digits, so a digit that opens the next piece cannot join one.
    std::string piece;
    for (const char c : bytes) {
      absl::StrAppend(&piece, absl::CEscape(absl::string_view(&c, 1)));
      if (piece.size() >= kChunk) {
        p.Print("        \"$piece$\"\n", "piece", piece);
        piece.clear();
      }
    }
    if (!piece.empty() || bytes.empty()) p.Print("        \"$piece$\"\n", "piece", piece);
    p.Print("        , $n$),\n", "n", absl::StrCat(bytes.size()));
  }
  p.Print("};\n\n}  // namespace\n}  // namespace rdmarpc\n\n");
}

void PrintSource(Printer& p, const FileDescriptor* file, const std::vector<ServiceNames>& services) {
  const std::string base = google::protobuf::compiler::cpp::StripProto(file->name());
  p.Print(
      "// Generated by protoc-gen-rdmarpc from $file$. DO NOT EDIT.\n"
      "#include \"$base$.rdmarpc.pb.h\"\n\n#include <utility>\n\n",
      "file", file->name(), "base", base);
  PrintProtoFiles(p, file);
  OpenNamespace(p, file);
  for (const ServiceNames& s : services) {
    for (const MethodNames& m : s.methods) {
      std::map<std::string, std::string> v = {
          {"q", s.qualified},    {"cls", s.cls},         {"req", m.request},
          {"resp", m.response},
          {"c", m.constant},     {"ss", m.stub_sync},    {"sa", m.stub_async},
          {"sf", m.stub_future}, {"fn", m.full_name}};
      p.Print(v,
              "::rdmarpc::Status $cls$::Stub::$ss$(::rdmarpc::ClientContext* context,\n"
              "    const $req$& request, $resp$* response) {\n"
              "  return channel_->Call($q$::Methods::$c$, context, request, response);\n"
              "}\n\n"
              "void $cls$::Stub::$sa$(::rdmarpc::ClientContext* context, const $req$& request,\n"
              "    $resp$* response, ::rdmarpc::CallCallback done) {\n"
              "  channel_->CallAsync($q$::Methods::$c$, context, request, response, std::move(done));\n"
              "}\n\n"
              "std::future<::rdmarpc::StatusOr<$resp$>> $cls$::Stub::$sf$(\n"
              "    ::rdmarpc::ClientContext* context, const $req$& request) {\n"
              "  struct State {\n"
              "    std::promise<::rdmarpc::StatusOr<$resp$>> promise;\n"
              "    $resp$ response;\n"
              "  };\n"
              "  auto state = std::make_shared<State>();\n"
              "  auto future = state->promise.get_future();\n"
              "  channel_->CallAsync($q$::Methods::$c$, context, request, &state->response,\n"
              "      [state](::rdmarpc::Status status) {\n"
              "        if (status.ok()) {\n"
              "          state->promise.set_value(std::move(state->response));\n"
              "        } else {\n"
              "          state->promise.set_value(std::move(status));\n"
              "        }\n"
              "      });\n"
              "  return future;\n"
              "}\n\n");
    }
    p.Print(
        "$cls$::Service::Service() {\n"
        "  SetProtoFiles({std::begin(::rdmarpc::kProtoFiles), "
        "std::end(::rdmarpc::kProtoFiles)});\n",
        "cls", s.cls);
    for (const MethodNames& m : s.methods) {
      p.Print(
          "  ::rdmarpc::Service::AddMethod($q$::Methods::$c$.full_name,\n"
          "      ::rdmarpc::UnaryHandler<$req$, $resp$>(\n"
          "          [this](::rdmarpc::ServerContext* context, const $req$* request,\n"
          "                 $resp$* response, ::rdmarpc::DoneCallback done) {\n"
          "            this->$va$(context, request, response, std::move(done));\n"
          "          }));\n",
          "q", s.qualified, "c", m.constant, "req", m.request, "resp", m.response, "va",
          m.service_async);
    }
    p.Print("}\n\n");
    for (const MethodNames& m : s.methods) {
      std::map<std::string, std::string> v = {{"cls", s.cls},         {"req", m.request},
                                              {"resp", m.response},   {"vs", m.service_sync},
                                              {"va", m.service_async}, {"fn", m.full_name}};
      p.Print(v,
              "::rdmarpc::Status $cls$::Service::$vs$(::rdmarpc::ServerContext*, const $req$*,\n"
              "    $resp$*) {\n"
              "  return ::rdmarpc::Status(::rdmarpc::StatusCode::kUnimplemented,\n"
              "      \"method $fn$ is not implemented by this server\");\n"
              "}\n\n"
              "void $cls$::Service::$va$(::rdmarpc::ServerContext* context, const $req$* request,\n"
              "    $resp$* response, ::rdmarpc::DoneCallback done) {\n"
              "  std::move(done)(this->$vs$(context, request, response));\n"
              "}\n\n");
    }
  }
  CloseNamespace(p, file);
}

}  // namespace

bool RdmarpcGenerator::Generate(const FileDescriptor* file, const std::string& parameter,
                                GeneratorContext* context, std::string* error) const {
  if (!parameter.empty()) {
    *error = absl::StrCat("protoc-gen-rdmarpc takes no options, got '",
                          parameter, "'");
    return false;
  }
  if (file->service_count() == 0) return true;  // nothing to generate
  for (const auto& part : absl::StrSplit(file->package(), '.')) {
    if (ReservedWords().count(std::string(part))) {
      *error = absl::StrCat("package component '", part,
                            "' is a C++ keyword or macro; protobuf's own C++ code for this "
                            "file cannot compile either. Rename the package.");
      return false;
    }
  }

  std::set<std::string> class_names;
  std::set<const FileDescriptor*> seen;
  CollectClassNames(file, file->package(), &class_names, &seen);
  const std::string ns = Namespace(file);
  std::map<uint32_t, std::string> ids;
  std::vector<ServiceNames> services;
  for (int i = 0; i < file->service_count(); ++i) {
    const ServiceDescriptor* sd = file->service(i);
    ServiceNames s;
    s.service = sd;
    // The outer class may not share a name with its own members, nor with a
    // class protobuf puts in the same namespace.
    static const auto* members =
        new std::set<std::string>{"Stub", "Service", "Methods", "NewStub", "kServiceName"};
    s.cls = Escape(sd->name());
    while (members->count(s.cls) || class_names.count(s.cls)) s.cls += "_";
    class_names.insert(s.cls);
    s.qualified = absl::StrCat(ns, "::", s.cls);
    Scope constants({});
    Scope stub({"Stub", "channel_"});
    Scope server({"Service", "AddMethod", "methods", "Method"});
    for (int j = 0; j < sd->method_count(); ++j) {
      const MethodDescriptor* md = sd->method(j);
      if (md->client_streaming() || md->server_streaming()) {
        *error = absl::StrCat("service ", sd->full_name(), ", rpc ", md->name(),
                              ": streaming rpcs (",
                              md->client_streaming() ? "client" : "server",
                              " stream) are not supported by rdmarpc; use unary rpcs");
        return false;
      }
      MethodNames m;
      m.method = md;
      m.full_name = absl::StrCat("/", sd->full_name(), "/", md->name());
      m.id = MethodId(m.full_name);
      if (auto [it, added] = ids.emplace(m.id, m.full_name); !added) {
        *error = absl::StrCat("rpcs ", it->second, " and ", m.full_name,
                              " have the same method id ", m.id,
                              " (FNV-1a of the full name); rename one");
        return false;
      }
      m.constant = constants.Claim("k" + md->name());
      m.request = google::protobuf::compiler::cpp::QualifiedClassName(md->input_type());
      m.response = google::protobuf::compiler::cpp::QualifiedClassName(md->output_type());
      s.methods.push_back(std::move(m));
    }
    // Blocking names first, so the plain names go to the common case.
    for (auto& m : s.methods) m.stub_sync = stub.Claim(m.method->name());
    for (auto& m : s.methods) m.service_sync = server.Claim(m.method->name());
    for (auto& m : s.methods) m.stub_async = stub.Claim("Async" + m.method->name());
    for (auto& m : s.methods) m.service_async = server.Claim(m.method->name() + "Async");
    for (auto& m : s.methods) m.stub_future = stub.Claim(m.method->name() + "Future");
    services.push_back(std::move(s));
  }

  const std::string base = google::protobuf::compiler::cpp::StripProto(file->name());
  {
    std::unique_ptr<google::protobuf::io::ZeroCopyOutputStream> out(
        context->Open(base + ".rdmarpc.pb.h"));
    Printer p(out.get(), '$');
    PrintHeader(p, file, services);
  }
  {
    std::unique_ptr<google::protobuf::io::ZeroCopyOutputStream> out(
        context->Open(base + ".rdmarpc.pb.cc"));
    Printer p(out.get(), '$');
    PrintSource(p, file, services);
  }
  return true;
}

}  // namespace rdmarpc::codegen
