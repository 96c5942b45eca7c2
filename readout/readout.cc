#include "readout/readout.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "readout/internal/kernels.h"

namespace leap::readout {

absl::Status ReadoutSpec::Validate() const {
  if (dim < kMinDim || dim > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "readout dim must be in [", kMinDim, ", ", kMaxDim, "], got ", dim));
  }
  if (max_tokens < 1 || max_tokens > kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be in [1, ", kMaxReportedTokens,
                     "], got ", max_tokens));
  }
  if (!(lambda >= 0.0) || !std::isfinite(lambda)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lambda must be finite and >= 0, got ", lambda));
  }
  if (layer < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer must be >= 0 (or -1 for unknown), got ", layer));
  }
  return absl::OkStatus();
}

Standardizer Standardizer::Identity(int64_t dim) {
  return {Eigen::VectorXd::Zero(dim), Eigen::VectorXd::Ones(dim)};
}

void Standardizer::Augment(const FeatureView& x, float* u) const {
  const int64_t d = dim();
  for (int64_t i = 0; i < d; ++i) {
    u[i] = static_cast<float>((static_cast<double>(x.At(i)) - mean[i]) /
                              scale[i]);
  }
  u[d] = 1.0f;
}

void Standardizer::Augment(const FeatureView& x, double* u) const {
  const int64_t d = dim();
  for (int64_t i = 0; i < d; ++i) {
    u[i] = (static_cast<double>(x.At(i)) - mean[i]) / scale[i];
  }
  u[d] = 1.0;
}

absl::Status Standardizer::Validate() const {
  if (mean.size() != scale.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("standardizer mean has ", mean.size(),
                     " entries but scale has ", scale.size()));
  }
  for (int64_t i = 0; i < mean.size(); ++i) {
    if (!std::isfinite(mean[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("standardizer mean[", i, "] is not finite"));
    }
    if (!(scale[i] > 0.0) || !std::isfinite(scale[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "standardizer scale[", i, "] must be finite and > 0, got ",
          scale[i]));
    }
  }
  return absl::OkStatus();
}

FoldedReadout::FoldedReadout(std::vector<float> w, double b,
                             int64_t max_tokens)
    : w_(std::move(w)),
      w_kernel_(w_.begin(), w_.end()),
      w_bf16_(w_.size()),
      b_(b),
      max_tokens_(max_tokens) {
  internal::PermuteForBf16(w_.data(), static_cast<int64_t>(w_.size()),
                           w_bf16_.data());
}

FoldedReadout FoldedReadout::Fold(const Standardizer& standardizer,
                                  const Eigen::VectorXd& theta,
                                  int64_t max_tokens) {
  const int64_t d = standardizer.dim();
  std::vector<float> w(d);
  // Accumulate the bias in long double: sum_i theta_i mu_i / sigma_i can
  // cancel heavily when features have large means.
  long double b = theta[d];
  for (int64_t i = 0; i < d; ++i) {
    const double wi = theta[i] / standardizer.scale[i];
    w[i] = static_cast<float>(wi);
    b -= static_cast<long double>(wi) * standardizer.mean[i];
  }
  return FoldedReadout(std::move(w), static_cast<double>(b), max_tokens);
}

absl::StatusOr<double> FoldedReadout::Score(const FeatureView& x) const {
  if (x.dim != dim()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature dimension mismatch: expected ", dim(), ", got ", x.dim));
  }
  if (x.data == nullptr) {
    return absl::InvalidArgumentError("feature data is null");
  }
  const internal::Kernels& k = internal::BestKernels();
  float dot;
  if (x.stride != 1) {
    double acc = 0.0;
    for (int64_t i = 0; i < x.dim; ++i) acc += w_[i] * x.At(i);
    dot = static_cast<float>(acc);
  } else if (x.dtype == DType::kFloat32) {
    dot = k.dot_f32(w_kernel_.data(), static_cast<const float*>(x.data),
                    x.dim);
  } else if (x.dtype == DType::kBFloat16) {
    dot = k.dot_bf16(w_bf16_.data(), static_cast<const uint16_t*>(x.data),
                     x.dim);
  } else {
    dot = k.dot_f16(w_kernel_.data(), static_cast<const uint16_t*>(x.data),
                    x.dim);
  }
  if (!std::isfinite(dot)) {
    // Slow path only on bad input: name the offending element.
    absl::Status s = ValidateFeatures(x, dim());
    if (!s.ok()) return s;
    return absl::InvalidArgumentError(
        "score overflowed: feature magnitudes too large for the readout");
  }
  return static_cast<double>(dot) + b_;
}

void FoldedReadout::ScoreRows(const FeatureView* xs, int64_t n, double* scores,
                              absl::Status* status) const {
  const internal::Kernels& k = internal::BestKernels();
  int64_t i = 0;
  while (i < n) {
    const FeatureView& x = xs[i];
    const bool rows_kernel = x.dim == dim() && x.data != nullptr &&
                             x.stride == 1 &&
                             (x.dtype == DType::kFloat32 ||
                              x.dtype == DType::kBFloat16);
    if (!rows_kernel) {
      absl::StatusOr<double> s = Score(x);
      status[i] = s.status();
      scores[i] = s.ok() ? *s : 0.0;
      ++i;
      continue;
    }
    // The run of up to kMaxRows rows like this one.
    int rows = 1;
    while (rows < internal::kMaxRows && i + rows < n &&
           xs[i + rows].dtype == x.dtype && xs[i + rows].dim == x.dim &&
           xs[i + rows].stride == 1 && xs[i + rows].data != nullptr) {
      ++rows;
    }
    float dots[internal::kMaxRows];
    if (x.dtype == DType::kFloat32) {
      const float* p[internal::kMaxRows];
      for (int r = 0; r < rows; ++r) p[r] = static_cast<const float*>(xs[i + r].data);
      k.dot_rows_f32(w_kernel_.data(), p, rows, dim(), dots);
    } else {
      const uint16_t* p[internal::kMaxRows];
      for (int r = 0; r < rows; ++r) p[r] = static_cast<const uint16_t*>(xs[i + r].data);
      k.dot_rows_bf16(w_bf16_.data(), p, rows, dim(), dots);
    }
    for (int r = 0; r < rows; ++r) {
      if (std::isfinite(dots[r])) {
        status[i + r] = absl::OkStatus();
        scores[i + r] = static_cast<double>(dots[r]) + b_;
      } else {
        absl::StatusOr<double> s = Score(xs[i + r]);  // names the bad element
        status[i + r] = s.ok() ? absl::InvalidArgumentError(
                                     "score overflowed: feature magnitudes too "
                                     "large for the readout")
                               : s.status();
        scores[i + r] = 0.0;
      }
    }
    i += rows;
  }
}

absl::StatusOr<double> FoldedReadout::PredictTokens(
    const FeatureView& x) const {
  absl::StatusOr<double> s = Score(x);
  if (!s.ok()) return s.status();
  return TokensFromScore(*s, max_tokens_);
}

}  // namespace leap::readout
