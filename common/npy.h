// Reader and writer for NumPy's .npy array files (format versions 1.0, 2.0
// and 3.0), limited to little-endian, C-order arrays of the dtypes in
// NpyDType. Used to exchange probe weights, activations and calibration
// tensors with the Python tooling.
//
// Format reference: numpy/lib/format.py ("NEP 1"). A file is the magic
// "\x93NUMPY", a major and minor version byte, a little-endian header length
// (uint16 for 1.0, uint32 for 2.0 and 3.0), an ASCII (3.0: UTF-8) Python dict
// literal {'descr': ..., 'fortran_order': ..., 'shape': (...)}, and the raw
// array bytes.
#ifndef LEAP_COMMON_NPY_H_
#define LEAP_COMMON_NPY_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace leap {

// NpyArray::data holds raw little-endian bytes and as<T>() reinterprets them.
static_assert(std::endian::native == std::endian::little,
              "common/npy assumes a little-endian host");

// Element types a .npy file may hold here. kFloat16 is IEEE binary16, stored
// and exposed as its uint16_t bit pattern (see common/half.h).
enum class NpyDType { kFloat16, kFloat32, kFloat64, kInt32, kInt64 };

// NumPy's name of the dtype: "float16", "float32", "float64", "int32",
// "int64".
std::string_view NpyDTypeName(NpyDType dtype);

// Bytes per element: 2, 4, 8, 4, 8.
size_t NpyDTypeSize(NpyDType dtype);

namespace npy_internal {
// Whether C++ type T is the element type of `dtype` (uint16_t for kFloat16).
template <class T>
constexpr bool DTypeMatches(NpyDType dtype) {
  if constexpr (std::is_same_v<T, uint16_t>) return dtype == NpyDType::kFloat16;
  if constexpr (std::is_same_v<T, float>) return dtype == NpyDType::kFloat32;
  if constexpr (std::is_same_v<T, double>) return dtype == NpyDType::kFloat64;
  if constexpr (std::is_same_v<T, int32_t>) return dtype == NpyDType::kInt32;
  if constexpr (std::is_same_v<T, int64_t>) return dtype == NpyDType::kInt64;
  return false;
}
// Prints which types mismatched and aborts. Never returns.
[[noreturn]] void DTypeMismatch(NpyDType actual, std::string_view requested);
}  // namespace npy_internal

// An in-memory array as stored in a .npy file. A plain value type; not
// synchronized.
struct NpyArray {
  // Element type.
  NpyDType dtype = NpyDType::kFloat32;
  // Dimensions, outermost first; empty for a 0-d (scalar) array.
  std::vector<int64_t> shape;
  // num_elements() * NpyDTypeSize(dtype) raw little-endian bytes, C order.
  std::vector<uint8_t> data;

  // Product of `shape` (1 for a 0-d array).
  int64_t num_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }

  // The elements as T, which must be the dtype's C++ type: uint16_t
  // (float16 bits), float, double, int32_t or int64_t. Asking for any other
  // type is a programming error and aborts. The pointer is valid while
  // `data` is unchanged.
  template <class T>
  const T* as() const {
    static_assert(std::is_same_v<T, uint16_t> || std::is_same_v<T, float> ||
                      std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
                      std::is_same_v<T, int64_t>,
                  "NpyArray::as<T>: T must be uint16_t, float, double, "
                  "int32_t or int64_t");
    if (!npy_internal::DTypeMatches<T>(dtype)) {
      npy_internal::DTypeMismatch(
          dtype, std::is_same_v<T, uint16_t>  ? "uint16_t (float16)"
                 : std::is_same_v<T, float>   ? "float"
                 : std::is_same_v<T, double>  ? "double"
                 : std::is_same_v<T, int32_t> ? "int32_t"
                                              : "int64_t");
    }
    return reinterpret_cast<const T*>(data.data());
  }
};

// Reads the .npy file at `path`. Accepts format versions 1.0, 2.0 and 3.0,
// descr '<f2', '<f4', '<f8', '<i4', '<i8' (also with '=' or '|' or no byte
// order mark, meaning native = little-endian), fortran_order False.
// Errors: NotFound if the file does not exist, another errno-derived code for
// other I/O failures, InvalidArgument for malformed or unsupported content.
// Every message starts with `path`. Thread-safe.
absl::StatusOr<NpyArray> ReadNpy(const std::string& path);

// Writes a C-order little-endian array of `dtype` and `shape` whose bytes
// start at `data` (num_elements * NpyDTypeSize(dtype) bytes; may be null if
// there are none) to `path` in format 1.0, or 2.0 when the header does not
// fit 1.0. The file is written to a temporary file in the same directory,
// flushed and renamed over `path`, so readers see the old file or the whole
// new one. Errors: InvalidArgument for a negative dimension or an overflowing
// shape; an errno-derived code (message starting with `path`) for I/O
// failures. Thread-safe for distinct paths.
absl::Status WriteNpy(const std::string& path, NpyDType dtype,
                      std::span<const int64_t> shape, const void* data);

}  // namespace leap

#endif  // LEAP_COMMON_NPY_H_
