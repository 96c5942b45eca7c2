// LengthPrior: a length prediction that exists before prefill, for
// length-aware admission (docs/SCHEDULING.md, "Length-aware admission").
//
// One small online ridge regression per product line on what the engine
// knows at arrival:
//   x = (1, log1p(prompt_tokens), log1p(max_tokens or the budget M),
//        [max_tokens set and below M])
//   y = sqrt(min(output_tokens, cap)), cap = max_tokens if set, else M
// learned from completions (a completion cut at its max_tokens or at M is
// learned at the cap, a lower bound of its true length, as for the
// readouts). The fit is the closed form w = (X'X + lambda D)^-1 X'y, D the
// identity without the intercept, recomputed lazily after new completions
// (d = 4: microseconds). The prior is max(w.x, 0)^2 tokens, capped at the
// request's cap; absent until the product line has `min_samples`
// completions.
//
// Deterministic, no I/O, no clock. Not thread-safe: callers serialize.
#ifndef LEAP_SIDECAR_CORE_LENGTH_PRIOR_H_
#define LEAP_SIDECAR_CORE_LENGTH_PRIOR_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace leap::core {

// What is known about a request before its prefill.
struct PriorRequest {
  int64_t prompt_tokens = 0;
  // The request's max_tokens; 0 = none (the budget applies).
  int64_t max_tokens = 0;
};

struct LengthPriorOptions {
  // Output budget M: longer outputs are learned as M. Default: 2048
  int64_t budget = 2048;
  // Ridge penalty on the non-intercept weights. Finite, >= 0. Default: 1
  double ridge = 1.0;
  // Completions of a product line before it gives priors. Default: 32
  int64_t min_samples = 32;

  // OK, or kInvalidArgument naming the first bad field.
  absl::Status Validate() const;
};

// The model of one product line.
class LengthPrior {
 public:
  static constexpr int kDim = 4;

  explicit LengthPrior(const LengthPriorOptions& options) : o_(options) {}

  // Learns one completion. kInvalidArgument for negative token counts.
  absl::Status Learn(const PriorRequest& request, int64_t output_tokens);

  // The prior in tokens, or nullopt before min_samples completions.
  std::optional<double> Predict(const PriorRequest& request) const;

  int64_t samples() const { return samples_; }

  // The features of a request (exposed for tests).
  std::array<double, kDim> Features(const PriorRequest& request) const;

 private:
  void Solve() const;

  LengthPriorOptions o_;
  int64_t samples_ = 0;
  // Sufficient statistics X'X (row-major) and X'y.
  std::array<double, kDim * kDim> xtx_{};
  std::array<double, kDim> xty_{};
  mutable std::array<double, kDim> w_{};
  mutable bool dirty_ = false;
};

// One LengthPrior per product line, created on its first completion.
class LengthPriors {
 public:
  explicit LengthPriors(const LengthPriorOptions& options) : o_(options) {}
  absl::Status Learn(absl::string_view product_line,
                     const PriorRequest& request, int64_t output_tokens);
  std::optional<double> Predict(absl::string_view product_line,
                                const PriorRequest& request) const;
  size_t product_lines() const { return lines_.size(); }

 private:
  LengthPriorOptions o_;
  absl::flat_hash_map<std::string, LengthPrior> lines_;
};

}  // namespace leap::core

#endif  // LEAP_SIDECAR_CORE_LENGTH_PRIOR_H_
