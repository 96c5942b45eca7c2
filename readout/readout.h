// The LEAP readout: standardization, folded weights and prediction.
//
// Math (docs/MATH.md): z = (x - mu) / sigma, u = [z; 1], score = u' theta,
// predicted tokens = clip(score, 1, sqrt(M))^2. At publish time the
// standardization is folded into w = theta[0..d) / sigma and
// b = theta[d] - sum_i theta_i mu_i / sigma_i, so a prediction is ONE dot
// product on the raw features plus a bias, read in place in any dtype.
#ifndef LEAP_READOUT_READOUT_H_
#define LEAP_READOUT_READOUT_H_

#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "readout/features.h"
#include "readout/target.h"

namespace leap::readout {

// What a readout reads and predicts.
struct ReadoutSpec {
  // Feature width d (the model's hidden size). Required, in [1, 16384].
  int64_t dim = 0;
  // Model layer the features are taken from; -1 when unknown.
  int32_t layer = -1;
  // Identifier of the serving model (e.g. "Qwen/Qwen3-8B"); may be empty.
  std::string model_id;
  // Output-token budget M: predictions are clipped to [1, M].
  // Default: 2048
  int64_t max_tokens = kDefaultMaxTokens;
  // Ridge penalty the readout was fitted with (anchors RLS: P0 uses it).
  double lambda = 0.0;

  absl::Status Validate() const;
};

// Per-feature standardization z = (x - mean) / scale, scale > 0.
struct Standardizer {
  Eigen::VectorXd mean;
  Eigen::VectorXd scale;

  // mean 0, scale 1 (cold start).
  static Standardizer Identity(int64_t dim);
  int64_t dim() const { return mean.size(); }
  // Writes u = [z; 1] (dim + 1 floats) for features x (no validation).
  void Augment(const FeatureView& x, float* u) const;
  // Same, in double.
  void Augment(const FeatureView& x, double* u) const;
  // Sizes agree, every scale is finite and > 0, every mean finite.
  absl::Status Validate() const;
};

// Allocates 64-byte aligned storage (a cache line): the kernels' loads of
// the weights then never span two lines.
template <typename T>
struct CacheAlignedAllocator {
  using value_type = T;
  CacheAlignedAllocator() = default;
  template <typename U>
  CacheAlignedAllocator(const CacheAlignedAllocator<U>&) {}  // NOLINT
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheAlignedAllocator<U>&) const { return true; }
};

// Immutable folded weights: what predicting threads use. Safe to share
// between threads without locks (publish a new object to change it).
class FoldedReadout {
 public:
  // Folds theta (dim + 1, bias last) with the standardization.
  static FoldedReadout Fold(const Standardizer& standardizer,
                            const Eigen::VectorXd& theta, int64_t max_tokens);

  // score = w . x + b (unclipped). InvalidArgument when the width differs or
  // an element is NaN/Inf (checked for free: any non-finite element makes
  // the dot product non-finite).
  absl::StatusOr<double> Score(const FeatureView& x) const;
  // clip(Score(x), 1, sqrt(M))^2.
  absl::StatusOr<double> PredictTokens(const FeatureView& x) const;
  // Score of each of `n` rows into scores[r] (errors as Score's, per row in
  // status[r]). Contiguous fp32 and bf16 rows are scored up to four per pass
  // over w; each row's result is the same whatever the other rows are (it
  // may differ from Score's in the last bits: another summation order).
  void ScoreRows(const FeatureView* xs, int64_t n, double* scores,
                 absl::Status* status) const;

  int64_t dim() const { return static_cast<int64_t>(w_.size()); }
  const std::vector<float>& w() const { return w_; }
  double b() const { return b_; }
  int64_t max_tokens() const { return max_tokens_; }

 private:
  FoldedReadout(std::vector<float> w, double b, int64_t max_tokens);
  std::vector<float> w_;
  // What the kernels read: w, and w in the bf16 kernel's order, each
  // 64-byte aligned (w_ itself is in a plain vector for w()).
  std::vector<float, CacheAlignedAllocator<float>> w_kernel_;
  std::vector<float, CacheAlignedAllocator<float>> w_bf16_;
  double b_ = 0.0;
  int64_t max_tokens_ = kDefaultMaxTokens;
};

}  // namespace leap::readout

#endif  // LEAP_READOUT_READOUT_H_
