#include "transport/rdma/size_classes.h"

#include <random>

#include "gtest/gtest.h"

namespace rdmarpc::transport::rdma {
namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;

// The smallest class that holds `size`, found by walking the classes.
int WalkedClassOf(size_t size) {
  int cls = 0;
  while (cls < kSizeClasses && ClassBytes(cls) < size) ++cls;
  return cls;
}

TEST(SizeClasses, FourStepsPerDoublingFrom16KiBTo1GiB) {
  const size_t expected[] = {16 * kKiB, 20 * kKiB, 24 * kKiB, 28 * kKiB, 32 * kKiB,
                             40 * kKiB, 48 * kKiB, 56 * kKiB, 64 * kKiB, 80 * kKiB};
  for (int cls = 0; cls < 10; ++cls) EXPECT_EQ(ClassBytes(cls), expected[cls]) << cls;
  EXPECT_EQ(ClassBytes(kSizeClasses - 1), size_t{1} << 30);
  for (int cls = 1; cls < kSizeClasses; ++cls) {
    EXPECT_GT(ClassBytes(cls), ClassBytes(cls - 1)) << cls;
    EXPECT_EQ(ClassBytes(cls) % 4096, 0u) << cls;
  }
}

TEST(SizeClasses, EachSizeGetsTheSmallestClassThatHoldsIt) {
  for (size_t size : {size_t{0}, size_t{1}, kMinBlock - 1, kMinBlock}) {
    EXPECT_EQ(SizeClassOf(size), 0) << size;
  }
  for (int cls = 0; cls < kSizeClasses; ++cls) {
    const size_t bytes = ClassBytes(cls);
    EXPECT_EQ(SizeClassOf(bytes), cls) << bytes;
    EXPECT_EQ(SizeClassOf(bytes - 1), WalkedClassOf(bytes - 1)) << bytes - 1;
    EXPECT_EQ(SizeClassOf(bytes + 1), cls + 1) << bytes + 1;
  }
  EXPECT_EQ(SizeClassOf(kLargestBlock + 1), kSizeClasses);
  EXPECT_EQ(SizeClassOf(~size_t{0}), kSizeClasses);
}

// What the classes are for: a payload just past a power of two (a 1 MiB
// field and its few bytes of framing) pins a quarter more, not twice.
TEST(SizeClasses, ABlockIsAtMostAQuarterLargerThanItsPayload) {
  EXPECT_EQ(ClassBytes(SizeClassOf(kMiB + 8)), kMiB + kMiB / 4);
  EXPECT_EQ(ClassBytes(SizeClassOf(40 * kMiB + 8)), 48 * kMiB);
  std::mt19937_64 random(5);
  std::uniform_int_distribution<size_t> sizes(kMinBlock + 1, kLargestBlock);
  for (int i = 0; i < 100000; ++i) {
    const size_t size = sizes(random);
    const int cls = SizeClassOf(size);
    ASSERT_EQ(cls, WalkedClassOf(size)) << size;
    ASSERT_GE(ClassBytes(cls), size);
    ASSERT_LT(ClassBytes(cls), size + size / 4) << size;
  }
}

}  // namespace
}  // namespace rdmarpc::transport::rdma
