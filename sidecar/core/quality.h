// Online ranking quality: a rolling Spearman of predicted vs true length.
#ifndef LEAP_SIDECAR_CORE_QUALITY_H_
#define LEAP_SIDECAR_CORE_QUALITY_H_

#include <cstdint>
#include <vector>

namespace leap::sidecar {

// The last `capacity` (predicted, true) pairs. Not thread-safe: guard with
// the owner's mutex.
class RollingSpearman {
 public:
  explicit RollingSpearman(int64_t capacity = 1000) : capacity_(capacity) {}
  void Add(double predicted, double truth);
  // Spearman over the window; NaN with fewer than 2 pairs or no variation.
  double Value() const;
  int64_t size() const { return static_cast<int64_t>(pred_.size()); }
  // Pairs ever added.
  int64_t total() const { return total_; }

 private:
  int64_t capacity_;
  int64_t next_ = 0;
  int64_t total_ = 0;
  std::vector<double> pred_, truth_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_QUALITY_H_
