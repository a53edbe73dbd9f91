// Method ids: the 32-bit number that names a method on the wire.
//
// A method's id is the 32-bit FNV-1a hash of its full name
// "/package.Service/Method" (exactly as in gRPC's :path). Client and server
// derive it independently, so no table is exchanged and ids never depend on
// the order of declarations. A collision between two methods is detected where
// both are known: the protoc plugin refuses a file with two colliding methods,
// and the Server refuses to start when two registered methods collide, naming
// both (rename one). The full name still travels nowhere on the wire; errors
// and logs print it from the method table.
#ifndef RDMARPC_RPC_METHOD_ID_H_
#define RDMARPC_RPC_METHOD_ID_H_

#include <cstdint>
#include <string_view>

namespace rdmarpc {

constexpr uint32_t MethodId(std::string_view full_name) {
  uint32_t h = 2166136261u;
  for (char c : full_name) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;
  }
  return h;
}

static_assert(MethodId("") == 2166136261u, "FNV-1a offset basis");
static_assert(MethodId("a") == 0xe40c292cu, "FNV-1a of 'a'");

}  // namespace rdmarpc

#endif  // RDMARPC_RPC_METHOD_ID_H_
