// Offline Ridge fit of the readout and the RLS initial state (docs/MATH.md):
//   theta0 = (U'U + lambda D)^-1 U'y,   P0 = (U'U + lambda D)^-1,
// with u = [z; 1], D = diag(1, ..., 1, 0) (the bias is not penalized),
// y = sqrt(min(tokens, M)). lambda comes from k-fold cross-validation over a
// grid when not given. All sums and solves are FP64; P0 is stored in FP32.
#ifndef LEAP_READOUT_RIDGE_H_
#define LEAP_READOUT_RIDGE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "Eigen/Core"
#include "absl/status/statusor.h"
#include "readout/features.h"
#include "readout/readout.h"
#include "readout/rls.h"

namespace leap::readout {

// n feature rows of width d, row-major, rows `row_stride` elements apart.
struct FeatureMatrix {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // 0 = cols

  FeatureView Row(int64_t i) const;
};

struct RidgeOptions {
  // Penalty lambda. When unset it is chosen by k-fold cross-validation.
  std::optional<double> lambda;
  // Cross-validation grid, as lambda / (training rows of the fold): with
  // standardized features the Gram diagonal is about n, so these are
  // relative penalties. Default: 1e-5, 1e-4, ..., 10.
  std::vector<double> relative_lambda_grid = {1e-5, 1e-4, 1e-3, 1e-2,
                                              1e-1, 1.0,  10.0};
  // Folds for cross-validation. Default: 5
  int folds = 5;
  // Output budget M of the readout (targets are clipped at sqrt(M)).
  // Default: 2048
  int64_t max_tokens = kDefaultMaxTokens;
  // Scales are floored at sigma_floor_ratio * median(scale) (and at 1e-12)
  // so a feature that is constant in training never divides by ~0.
  // Default: 1e-3
  double sigma_floor_ratio = 1e-3;
  // Seed of the fold assignment (a fixed seed gives a reproducible fit).
  uint64_t seed = 1;
  // Compute P0 (needed for RLS; skip for a frozen readout). Default: true
  bool compute_p0 = true;
  // Receives human-readable progress lines (e.g. for stderr); may be empty.
  std::function<void(const std::string&)> progress;

  absl::Status Validate() const;
};

// Mean squared error of the sqrt target on held-out folds for one lambda.
struct CvPoint {
  double lambda = 0;
  double relative_lambda = 0;
  double mse = 0;
};

struct RidgeResult {
  Standardizer standardizer;
  Eigen::VectorXd theta;  // d + 1, bias last
  double lambda = 0;
  std::vector<CvPoint> cv;  // empty when lambda was given
  SymMatrix p0;             // (d+1)^2, empty unless compute_p0
  double train_mse = 0;     // on the sqrt target, unclipped scores
};

// Fits the readout. InvalidArgument on mismatched sizes, negative lengths,
// non-finite features, or fewer rows than the folds need.
absl::StatusOr<RidgeResult> FitRidge(const FeatureMatrix& x,
                                     std::span<const int64_t> lengths,
                                     const RidgeOptions& options);

// Mean and floored population scale of the columns of x.
absl::StatusOr<Standardizer> FitStandardizer(const FeatureMatrix& x,
                                             double sigma_floor_ratio);

}  // namespace leap::readout

#endif  // LEAP_READOUT_RIDGE_H_
