// Size classes of the registered pool (registered_pool.h): four per doubling,
// from 16 KiB to 1 GiB.
//
// Why four: every pool block is pinned memory, counted against
// RdmaOptions::max_registered_bytes and the locked-memory limit, at both ends
// of a call. Payloads cluster just above powers of two: a 1 MiB `bytes`
// field is 1 MiB and a few bytes once serialized. With one class per
// doubling such a payload pinned twice its size at each end; with four, a
// payload pins at most a quarter more than its size. More classes would cut
// that further, but would spread idle blocks, each kept for reuse, over more
// free lists.
//
// Class c holds kMinBlock << (c / 4), plus a quarter of that for each step
// of c % 4: 16, 20, 24, 28, 32, 40, 48, 56, 64 KiB, ... Every class is a
// whole number of 4 KiB pages.
//
// What not to rely on: a block's capacity is only at least what was asked
// for; nothing outside the pool should depend on the classes themselves.
#ifndef RDMARPC_TRANSPORT_RDMA_SIZE_CLASSES_H_
#define RDMARPC_TRANSPORT_RDMA_SIZE_CLASSES_H_

#include <cstddef>

namespace rdmarpc::transport::rdma {

inline constexpr int kMinBlockLog2 = 14;
inline constexpr size_t kMinBlock = size_t{1} << kMinBlockLog2;  // 16 KiB
inline constexpr int kStepsPerDoubling = 4;
inline constexpr int kSizeClasses = 16 * kStepsPerDoubling + 1;  // 16 KiB .. 1 GiB

// Bytes of a block of class `cls` (0 <= cls < kSizeClasses).
constexpr size_t ClassBytes(int cls) {
  const size_t base = kMinBlock << (cls / kStepsPerDoubling);
  return base + base / kStepsPerDoubling * (cls % kStepsPerDoubling);
}

inline constexpr size_t kLargestBlock = ClassBytes(kSizeClasses - 1);

// The smallest class whose blocks hold `size` bytes; kSizeClasses when
// `size` is beyond kLargestBlock. No loop: it runs once per large payload.
constexpr int SizeClassOf(size_t size) {
  if (size <= kMinBlock) return 0;
  if (size > kLargestBlock) return kSizeClasses;
  // The doubling: kMinBlock << d < size <= kMinBlock << (d + 1).
  const int d = 63 - __builtin_clzll(size - 1) - kMinBlockLog2;
  const size_t base = kMinBlock << d;
  const size_t step = base / kStepsPerDoubling;
  return d * kStepsPerDoubling + static_cast<int>((size - base + step - 1) / step);
}

static_assert(sizeof(size_t) == sizeof(unsigned long long), "SizeClassOf counts 64-bit zeros");
static_assert(kLargestBlock == size_t{1} << 30, "classes reach 1 GiB");
static_assert(ClassBytes(1) % 4096 == 0, "the smallest step is whole pages");

}  // namespace rdmarpc::transport::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_SIZE_CLASSES_H_
