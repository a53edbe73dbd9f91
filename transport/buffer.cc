#include "transport/buffer.h"

#include <cstring>
#include <memory>
#include <new>

namespace rdmarpc::transport {

Buffer Buffer::Allocate(size_t size) {
  char* data = size ? new char[size] : nullptr;
  return Buffer(data, size, [](char* d, size_t) { delete[] d; });
}

std::optional<Buffer> Buffer::TryAllocate(size_t size) {
  if (size == 0) return Buffer();
  char* data = new (std::nothrow) char[size];
  if (data == nullptr) return std::nullopt;
  return Buffer(data, size, [](char* d, size_t) { delete[] d; });
}

Buffer Buffer::CopyOf(const void* data, size_t size) {
  Buffer b = Allocate(size);
  if (size) memcpy(b.data(), data, size);
  return b;
}

}  // namespace rdmarpc::transport
