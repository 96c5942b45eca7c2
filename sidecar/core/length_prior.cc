#include "sidecar/core/length_prior.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace leap::core {

absl::Status LengthPriorOptions::Validate() const {
  if (budget < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget must be >= 1, got ", budget));
  }
  if (!std::isfinite(ridge) || ridge < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ridge must be finite and >= 0, got ", ridge));
  }
  if (min_samples < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_samples must be >= 1, got ", min_samples));
  }
  return absl::OkStatus();
}

std::array<double, LengthPrior::kDim> LengthPrior::Features(
    const PriorRequest& request) const {
  const bool capped = request.max_tokens > 0 && request.max_tokens < o_.budget;
  const int64_t cap = capped ? request.max_tokens : o_.budget;
  return {1.0,
          std::log1p(static_cast<double>(std::max<int64_t>(
              request.prompt_tokens, 0))),
          std::log1p(static_cast<double>(cap)), capped ? 1.0 : 0.0};
}

absl::Status LengthPrior::Learn(const PriorRequest& request,
                                int64_t output_tokens) {
  if (request.prompt_tokens < 0 || request.max_tokens < 0 ||
      output_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token counts must be >= 0, got prompt ", request.prompt_tokens,
        ", max_tokens ", request.max_tokens, ", output ", output_tokens));
  }
  const std::array<double, kDim> x = Features(request);
  const int64_t cap = request.max_tokens > 0
                          ? std::min(request.max_tokens, o_.budget)
                          : o_.budget;
  const double y = std::sqrt(static_cast<double>(std::min(output_tokens, cap)));
  for (int i = 0; i < kDim; ++i) {
    for (int j = 0; j < kDim; ++j) xtx_[i * kDim + j] += x[i] * x[j];
    xty_[i] += x[i] * y;
  }
  ++samples_;
  dirty_ = true;
  return absl::OkStatus();
}

void LengthPrior::Solve() const {
  // Gaussian elimination with partial pivoting on (X'X + lambda D) w = X'y.
  std::array<double, kDim * kDim> a = xtx_;
  std::array<double, kDim> b = xty_;
  for (int i = 1; i < kDim; ++i) a[i * kDim + i] += o_.ridge;
  // A constant feature with no ridge would make the system singular; the
  // tiny jitter keeps it solvable (its weight then stays ~0).
  for (int i = 0; i < kDim; ++i) a[i * kDim + i] += 1e-9;
  for (int c = 0; c < kDim; ++c) {
    int p = c;
    for (int r = c + 1; r < kDim; ++r) {
      if (std::abs(a[r * kDim + c]) > std::abs(a[p * kDim + c])) p = r;
    }
    if (p != c) {
      for (int j = 0; j < kDim; ++j) std::swap(a[c * kDim + j], a[p * kDim + j]);
      std::swap(b[c], b[p]);
    }
    for (int r = c + 1; r < kDim; ++r) {
      const double f = a[r * kDim + c] / a[c * kDim + c];
      for (int j = c; j < kDim; ++j) a[r * kDim + j] -= f * a[c * kDim + j];
      b[r] -= f * b[c];
    }
  }
  for (int c = kDim - 1; c >= 0; --c) {
    double s = b[c];
    for (int j = c + 1; j < kDim; ++j) s -= a[c * kDim + j] * w_[j];
    w_[c] = s / a[c * kDim + c];
  }
  dirty_ = false;
}

std::optional<double> LengthPrior::Predict(const PriorRequest& request) const {
  if (samples_ < o_.min_samples) return std::nullopt;
  if (dirty_) Solve();
  const std::array<double, kDim> x = Features(request);
  double s = 0;
  for (int i = 0; i < kDim; ++i) s += w_[i] * x[i];
  if (!std::isfinite(s)) return std::nullopt;
  s = std::max(s, 0.0);
  const int64_t cap = request.max_tokens > 0
                          ? std::min(request.max_tokens, o_.budget)
                          : o_.budget;
  return std::min(s * s, static_cast<double>(cap));
}

absl::Status LengthPriors::Learn(absl::string_view product_line,
                                 const PriorRequest& request,
                                 int64_t output_tokens) {
  auto it = lines_.find(product_line);
  if (it == lines_.end()) {
    it = lines_.emplace(std::string(product_line), LengthPrior(o_)).first;
  }
  return it->second.Learn(request, output_tokens);
}

std::optional<double> LengthPriors::Predict(absl::string_view product_line,
                                            const PriorRequest& request) const {
  auto it = lines_.find(product_line);
  if (it == lines_.end()) return std::nullopt;
  return it->second.Predict(request);
}

}  // namespace leap::core
