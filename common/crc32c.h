// CRC-32C (Castagnoli), used as the checksum of artifact files and stored
// records. Uses the SSE4.2 instruction when the CPU has it, a table otherwise.
#ifndef LEAP_COMMON_CRC32C_H_
#define LEAP_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace leap {

// Extends `crc` (the value returned for the bytes before) over `n` bytes.
// Crc32c(0, data, n) is the CRC of the bytes alone. Thread-safe.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) {
  return Crc32cExtend(0, data, n);
}

}  // namespace leap

#endif  // LEAP_COMMON_CRC32C_H_
