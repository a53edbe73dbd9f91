#include "transport/buffer.h"

#include <cstring>
#include <utility>

#include "gtest/gtest.h"

namespace rdmarpc::transport {
namespace {

// What a releaser saw: how often it ran and with which bytes.
struct Released {
  int times = 0;
  char* data = nullptr;
  size_t size = 0;
};

Buffer Counted(char* data, size_t size, Released* r) {
  return Buffer(data, size, [r](char* d, size_t n) {
    ++r->times;
    r->data = d;
    r->size = n;
  });
}

TEST(Buffer, ReleasesOnceWhereItWasLastMoved) {
  char bytes[16];
  Released r;
  {
    Buffer a = Counted(bytes, sizeof bytes, &r);
    Buffer b = std::move(a);
    Buffer c;
    c = std::move(b);
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(c.data(), bytes);
    EXPECT_EQ(c.size(), sizeof bytes);
    EXPECT_EQ(r.times, 0);
  }
  EXPECT_EQ(r.times, 1);
  EXPECT_EQ(r.data, bytes);
}

TEST(Buffer, AssignmentReleasesWhatItHeld) {
  char first[8], second[8];
  Released r1, r2;
  Buffer a = Counted(first, sizeof first, &r1);
  a = Counted(second, sizeof second, &r2);
  EXPECT_EQ(r1.times, 1);
  EXPECT_EQ(r2.times, 0);
  EXPECT_EQ(a.data(), second);
  a.Reset();
  EXPECT_EQ(r2.times, 1);
  EXPECT_TRUE(a.empty());
  a.Reset();
  EXPECT_EQ(r2.times, 1) << "a second Reset releases nothing";
}

TEST(Buffer, ReleaserKeepsBothCapturedWords) {
  // Two words of capture travel through moves intact.
  char bytes[4];
  Released r;
  int tag = 0;
  {
    Buffer a(bytes, sizeof bytes, [r = &r, tag = &tag](char*, size_t) {
      ++r->times;
      *tag = 42;
    });
    Buffer b = std::move(a);
  }
  EXPECT_EQ(r.times, 1);
  EXPECT_EQ(tag, 42);
}

TEST(Buffer, TruncateShortensButNeverLengthens) {
  char bytes[32];
  Released r;
  {
    Buffer a = Counted(bytes, sizeof bytes, &r);
    a.Truncate(10);
    EXPECT_EQ(a.size(), 10u);
    a.Truncate(20);
    EXPECT_EQ(a.size(), 10u);
  }
  EXPECT_EQ(r.times, 1);
  EXPECT_EQ(r.data, bytes);
}

TEST(Buffer, AllocateAndCopyOf) {
  const char text[] = "payload";
  Buffer b = Buffer::CopyOf(text, sizeof text);
  ASSERT_EQ(b.size(), sizeof text);
  EXPECT_EQ(memcmp(b.data(), text, sizeof text), 0);
  EXPECT_NE(b.data(), text);
  Buffer empty = Buffer::Allocate(0);
  EXPECT_TRUE(empty.empty());
}

}  // namespace
}  // namespace rdmarpc::transport
