// Buffer: move-only bytes whose owner decides how they are given back.
//
// Messages cross the transport boundary as Buffers so that no layer has to copy
// a payload to hand it on: the TCP transport gives heap memory, the RDMA
// transport gives a slice of a registered pool whose release returns it to the
// pool (and, for an advertised buffer, only once the peer can no longer READ
// it). Whoever holds the Buffer last releases it by destroying it.
//
//   Buffer b = Buffer::Allocate(128);
//   memcpy(b.data(), src, 128);
//   Buffer moved = std::move(b);      // b is now empty
//   // moved's memory is released when it goes out of scope
#ifndef RDMARPC_TRANSPORT_BUFFER_H_
#define RDMARPC_TRANSPORT_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/functional/any_invocable.h"

namespace rdmarpc::transport {

class Buffer {
 public:
  using Releaser = absl::AnyInvocable<void(char* data, size_t size) &&>;

  Buffer() = default;
  // Wraps memory the caller owns; `release` runs exactly once, when the Buffer
  // (or the last Buffer it was moved into) is destroyed or reset.
  Buffer(char* data, size_t size, Releaser release)
      : data_(data), size_(size), release_(std::move(release)) {}
  // Heap memory, freed on release.
  static Buffer Allocate(size_t size);
  static Buffer CopyOf(const void* data, size_t size);

  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      release_ = std::move(other.release_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  char* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // Makes the Buffer look shorter (never longer); the release still covers the
  // whole original memory.
  void Truncate(size_t size) {
    if (size < size_) size_ = size;
  }

  void Reset() {
    if (release_) std::move(release_)(data_, size_);
    release_ = nullptr;
    data_ = nullptr;
    size_ = 0;
  }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
  Releaser release_;
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_BUFFER_H_
