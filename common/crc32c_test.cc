#include "common/crc32c.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace leap {
namespace {

// Bit-at-a-time CRC-32C straight from the definition (reflected polynomial
// 0x82F63B78, initial value and final xor 0xFFFFFFFF): an independent
// reference for the table and SSE4.2 paths.
uint32_t ReferenceCrc32c(const uint8_t* p, size_t n) {
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) {
      crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
  }
  return ~crc;
}

std::vector<uint8_t> TestBytes(size_t n) {
  std::vector<uint8_t> v(n);
  uint32_t x = 12345;
  for (auto& b : v) {
    x = x * 1103515245u + 12345u;
    b = static_cast<uint8_t>(x >> 16);
  }
  return v;
}

TEST(Crc32cTest, CheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32c(s.data(), s.size()), 0xE3069283u);
}

TEST(Crc32cTest, Empty) { EXPECT_EQ(Crc32c(nullptr, 0), 0u); }

// RFC 3720 (iSCSI) appendix B.4 test vectors.
TEST(Crc32cTest, Rfc3720Vectors) {
  std::vector<uint8_t> zeros(32, 0x00);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  std::vector<uint8_t> ones(32, 0xFF);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  std::vector<uint8_t> up(32), down(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = static_cast<uint8_t>(i);
    down[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(Crc32c(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down.data(), down.size()), 0x113FDB5Cu);
}

TEST(Crc32cTest, MatchesBitwiseReferenceForAllSmallLengths) {
  const std::vector<uint8_t> data = TestBytes(300);
  for (size_t n = 0; n <= data.size(); ++n) {
    EXPECT_EQ(Crc32c(data.data(), n), ReferenceCrc32c(data.data(), n))
        << "n=" << n;
  }
  // Unaligned starts exercise the 8-byte loop on odd addresses.
  for (size_t off = 1; off < 8; ++off) {
    EXPECT_EQ(Crc32c(data.data() + off, 100),
              ReferenceCrc32c(data.data() + off, 100))
        << "off=" << off;
  }
}

TEST(Crc32cTest, ExtendOverSplitBuffersEqualsOneCall) {
  const std::vector<uint8_t> data = TestBytes(1000);
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t split = 0; split <= data.size(); ++split) {
    const uint32_t first = Crc32c(data.data(), split);
    EXPECT_EQ(Crc32cExtend(first, data.data() + split, data.size() - split),
              whole)
        << "split=" << split;
  }
  // Many small pieces.
  uint32_t crc = 0;
  for (size_t i = 0; i < data.size(); i += 7) {
    crc = Crc32cExtend(crc, data.data() + i,
                       std::min<size_t>(7, data.size() - i));
  }
  EXPECT_EQ(crc, whole);
}

}  // namespace
}  // namespace leap
