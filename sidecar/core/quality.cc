#include "sidecar/core/quality.h"

#include "readout/stats.h"

namespace leap::sidecar {

void RollingSpearman::Add(double predicted, double truth) {
  ++total_;
  if (static_cast<int64_t>(pred_.size()) < capacity_) {
    pred_.push_back(predicted);
    truth_.push_back(truth);
    return;
  }
  pred_[next_] = predicted;
  truth_[next_] = truth;
  next_ = (next_ + 1) % capacity_;
}

double RollingSpearman::Value() const {
  return readout::Spearman(pred_, truth_);
}

}  // namespace leap::sidecar
