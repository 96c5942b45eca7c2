#include "readout/features.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"

namespace leap::readout {

float FeatureView::At(int64_t i) const {
  const int64_t off = i * stride;
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[off];
    case DType::kBFloat16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[off]);
    case DType::kFloat16:
      return Fp16ToFloat(static_cast<const uint16_t*>(data)[off]);
  }
  return NAN;
}

absl::Status ValidateFeatures(const FeatureView& x, int64_t expected_dim) {
  if (x.dim != expected_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("feature dimension mismatch: expected ", expected_dim,
                     ", got ", x.dim));
  }
  if (x.data == nullptr && x.dim > 0) {
    return absl::InvalidArgumentError("feature data is null");
  }
  for (int64_t i = 0; i < x.dim; ++i) {
    const float v = x.At(i);
    if (!std::isfinite(v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feature element ", i, " is not finite (", v, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace leap::readout
