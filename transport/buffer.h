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
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

namespace rdmarpc::transport {

class Buffer {
 public:
  Buffer() = default;
  // Wraps memory the caller owns; `release(data, size)` runs exactly once,
  // when the Buffer (or the last Buffer it was moved into) is destroyed or
  // reset. The releaser is stored in the Buffer as it is, not type-erased
  // into a callable object: a Buffer is moved several times per message on
  // the transports' fast paths, and a move must be a plain copy of a few
  // words, with no call through a manager function. So the releaser has to
  // be trivially copyable and at most two pointers in size: capture pointers
  // and indices, never an owning object (a shared_ptr, a std::string). To
  // keep something alive until the release, count it yourself (the RDMA
  // endpoint counts its loans).
  template <typename Release>
  Buffer(char* data, size_t size, Release release) : data_(data), size_(size) {
    static_assert(std::is_trivially_copyable_v<Release>,
                  "a Buffer releaser must be trivially copyable (capture pointers, not owners)");
    static_assert(sizeof(Release) <= sizeof(Context) && alignof(Release) <= alignof(Context),
                  "a Buffer releaser captures at most two pointers");
    static_assert(std::is_invocable_r_v<void, Release&, char*, size_t>,
                  "a Buffer releaser is called as release(data, size)");
    ::new (static_cast<void*>(context_.bytes)) Release(release);
    release_ = [](Context& c, char* d, size_t n) {
      (*std::launder(reinterpret_cast<Release*>(c.bytes)))(d, n);
    };
  }
  // Heap memory, freed on release.
  static Buffer Allocate(size_t size);
  // Allocate's memory, or nullopt when the process has none to give (its
  // address-space limit, a host with strict overcommit): for sizes that a
  // peer chooses, where running out must fail one message, not throw
  // std::bad_alloc on a thread that cannot catch it.
  static std::optional<Buffer> TryAllocate(size_t size);
  static Buffer CopyOf(const void* data, size_t size);

  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        release_(std::exchange(other.release_, nullptr)),
        context_(other.context_) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      release_ = std::exchange(other.release_, nullptr);
      context_ = other.context_;
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
    if (release_ != nullptr) std::exchange(release_, nullptr)(context_, data_, size_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  // The releaser's captures, copied bytewise on every move.
  struct Context {
    alignas(void*) unsigned char bytes[2 * sizeof(void*)];
  };
  static_assert(std::is_trivially_copyable_v<Context>);

  char* data_ = nullptr;
  size_t size_ = 0;
  void (*release_)(Context&, char*, size_t) = nullptr;  // null: nothing to release
  Context context_{};
};

}  // namespace rdmarpc::transport

#endif  // RDMARPC_TRANSPORT_BUFFER_H_
