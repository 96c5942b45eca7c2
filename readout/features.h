// Feature vectors as they arrive from an engine: the hidden state of the last
// prompt token at one layer, in fp32, bf16 or fp16, read in place.
#ifndef LEAP_READOUT_FEATURES_H_
#define LEAP_READOUT_FEATURES_H_

#include <cstddef>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/wire.h"

namespace leap::readout {

// Element type of a feature vector (common/wire.h).
using ::leap::DType;
using ::leap::DTypeName;
using ::leap::DTypeSize;
using ::leap::ParseDType;

// Smallest and largest feature width a readout accepts.
inline constexpr int64_t kMinDim = 1;
inline constexpr int64_t kMaxDim = 16384;

// A read-only view of one feature vector: `dim` elements of `dtype`, element
// i at data + i * stride * DTypeSize(dtype). Does not own the memory.
struct FeatureView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t dim = 0;
  // Distance between consecutive elements, in elements (1 = contiguous).
  int64_t stride = 1;

  static FeatureView F32(const float* p, int64_t n) {
    return {p, DType::kFloat32, n, 1};
  }
  // Element i converted to float (exact for every dtype).
  float At(int64_t i) const;
};

// Checks width and that every element is finite. Costs one pass; the
// prediction path gets the same check for free from the dot product.
absl::Status ValidateFeatures(const FeatureView& x, int64_t expected_dim);

}  // namespace leap::readout

#endif  // LEAP_READOUT_FEATURES_H_
