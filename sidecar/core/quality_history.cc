#include "sidecar/core/quality_history.h"

#include <algorithm>
#include <cmath>

#include "readout/stats.h"

namespace leap::sidecar {

void QualityHistory::Restore(const std::vector<storage::QualityPair>& pairs,
                             int64_t total) {
  pairs_.assign(pairs.begin(), pairs.end());
  while (static_cast<int64_t>(pairs_.size()) > kept_) pairs_.pop_front();
  total_ = std::max<int64_t>(total, static_cast<int64_t>(pairs.size()));
}

void QualityHistory::Add(const storage::QualityPair& p) {
  pairs_.push_back(p);
  ++total_;
  while (static_cast<int64_t>(pairs_.size()) > kept_) pairs_.pop_front();
}

std::vector<QualityWindow> QualityHistory::Windows(int64_t limit) const {
  std::vector<QualityWindow> out;
  const int64_t first_kept = total_ - static_cast<int64_t>(pairs_.size());
  // Only whole windows whose pairs are all kept (plus the open newest one).
  int64_t start = (first_kept + window_ - 1) / window_ * window_;
  if (limit > 0) {
    const int64_t newest_start = total_ == 0 ? 0 : (total_ - 1) / window_ * window_;
    start = std::max(start, newest_start - (limit - 1) * window_);
  }
  std::vector<double> pred, truth;
  for (int64_t w = start; w < total_; w += window_) {
    const int64_t end = std::min(total_, w + window_);
    pred.clear();
    truth.clear();
    QualityWindow q;
    q.first_completion = w;
    q.completions = end - w;
    for (int64_t i = w; i < end; ++i) {
      const storage::QualityPair& p = pairs_[static_cast<size_t>(i - first_kept)];
      pred.push_back(p.predicted);
      truth.push_back(p.truth);
      if (i == w) {
        q.first_version = p.version;
        q.start_unix_ms = p.unix_ms;
      }
      q.first_version = std::min(q.first_version, p.version);
      q.last_version = std::max(q.last_version, p.version);
      q.end_unix_ms = p.unix_ms;
    }
    q.spearman = readout::Spearman(pred, truth);
    out.push_back(q);
  }
  return out;
}

std::vector<LabelQuality> QualityHistory::Labels(
    std::vector<std::pair<int64_t, std::string>> marks) const {
  std::sort(marks.begin(), marks.end());
  std::vector<LabelQuality> out;
  std::vector<double> pred, truth;
  for (size_t m = 0; m < marks.size(); ++m) {
    LabelQuality l;
    l.label = marks[m].second;
    l.from_version = marks[m].first;
    l.to_version = m + 1 < marks.size() ? marks[m + 1].first : 0;
    pred.clear();
    truth.clear();
    for (const storage::QualityPair& p : pairs_) {
      if (p.version < l.from_version) continue;
      if (l.to_version != 0 && p.version >= l.to_version) continue;
      pred.push_back(p.predicted);
      truth.push_back(p.truth);
    }
    l.completions = static_cast<int64_t>(pred.size());
    l.spearman = readout::Spearman(pred, truth);
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace leap::sidecar
