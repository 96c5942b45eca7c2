// Online quality that lasts: the (predicted, true) pairs of a readout kept in
// order (and persisted by the store, see docs/STORAGE.md "Quality"), reported
// over tumbling windows of N completions and per snapshot label, rather than
// per version (a version every rls_batch completions is too small a sample).
#ifndef LEAP_SIDECAR_CORE_QUALITY_HISTORY_H_
#define LEAP_SIDECAR_CORE_QUALITY_HISTORY_H_

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "storage/state_store.h"

namespace leap::sidecar {

// Spearman over the pairs of `window` consecutive completions.
struct QualityWindow {
  int64_t first_completion = 0;  // index (0 = the first ever recorded)
  int64_t completions = 0;       // < window only for the newest, open one
  int64_t first_version = 0;
  int64_t last_version = 0;
  int64_t start_unix_ms = 0;
  int64_t end_unix_ms = 0;
  double spearman = 0;  // NaN with < 2 pairs or no variation
};

// Spearman over the completions predicted by versions in
// [from_version, to_version) (to_version 0: open-ended).
struct LabelQuality {
  std::string label;
  int64_t from_version = 0;
  int64_t to_version = 0;
  int64_t completions = 0;
  double spearman = 0;
};

// Not thread-safe: guarded by the owner's mutex.
class QualityHistory {
 public:
  // Keeps the newest `kept` pairs; windows hold `window` completions.
  QualityHistory(int64_t kept, int64_t window) : kept_(kept), window_(window) {}
  // `total` pairs were recorded before the ones restored (pairs.size() of
  // them are the newest): window boundaries stay where they were.
  void Restore(const std::vector<storage::QualityPair>& pairs, int64_t total);
  void Add(const storage::QualityPair& p);
  // The newest `limit` windows (0 = all whose pairs are kept), oldest first.
  std::vector<QualityWindow> Windows(int64_t limit) const;
  // One entry per (version, label), sorted by version; a label's range
  // ends at the next label's version.
  std::vector<LabelQuality> Labels(
      std::vector<std::pair<int64_t, std::string>> marks) const;
  int64_t total() const { return total_; }
  int64_t window() const { return window_; }

 private:
  int64_t kept_;
  int64_t window_;
  int64_t total_ = 0;  // pairs ever added (index of the next one)
  std::deque<storage::QualityPair> pairs_;  // the newest, up to kept_
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_QUALITY_HISTORY_H_
