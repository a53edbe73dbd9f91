#include "transport/buffer.h"

#include <cstring>
#include <memory>

namespace rdmarpc::transport {

Buffer Buffer::Allocate(size_t size) {
  char* data = size ? new char[size] : nullptr;
  return Buffer(data, size, [](char* d, size_t) { delete[] d; });
}

Buffer Buffer::CopyOf(const void* data, size_t size) {
  Buffer b = Allocate(size);
  if (size) memcpy(b.data(), data, size);
  return b;
}

}  // namespace rdmarpc::transport
