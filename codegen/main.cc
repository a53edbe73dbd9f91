// protoc-gen-rdmarpc: protoc --plugin=protoc-gen-rdmarpc=... --rdmarpc_out=DIR x.proto
#include "codegen/generator.h"
#include "google/protobuf/compiler/plugin.h"

int main(int argc, char* argv[]) {
  rdmarpc::codegen::RdmarpcGenerator generator;
  return google::protobuf::compiler::PluginMain(argc, argv, &generator);
}
