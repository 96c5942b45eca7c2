// Scalar conversions between IEEE fp16 / bfloat16 bit patterns and float.
// Exact (every fp16 and bf16 value is representable as a float); used for
// reference paths and file I/O. Hot loops use the vector kernels instead.
#ifndef LEAP_COMMON_HALF_H_
#define LEAP_COMMON_HALF_H_

#include <bit>
#include <cmath>
#include <cstdint>

namespace leap {

inline float Bf16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// Round-to-nearest-even; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: value = man * 2^-24
      float v = std::ldexp(static_cast<float>(man), -24);
      return sign ? -v : v;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return std::bit_cast<float>(bits);
}

// Round-to-nearest-even; overflow goes to infinity; NaN stays NaN.
inline uint16_t FloatToFp16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;           // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;          // >= 65520 -> inf
  if (a < 0x38800000u) {                                // subnormal or zero
    // value / 2^-24, rounded to nearest even.
    const float v = std::bit_cast<float>(a) * 16777216.0f;
    const float r = std::nearbyint(v);
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);  // round mantissa to 10 bits
  r -= 112u << 23;
  return sign | static_cast<uint16_t>(r >> 13);
}

}  // namespace leap

#endif  // LEAP_COMMON_HALF_H_
