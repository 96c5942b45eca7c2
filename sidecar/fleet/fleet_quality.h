// Fleet-wide online quality (docs/FLEET.md "Online quality"): the trainer
// counts every member's (prediction, outcome) pairs of a readout from the
// FEEDBACK stream, per version that predicted them, per (product line, arm)
// and overall, each as a rolling Spearman over its newest `window` pairs
// (the same measure a single leapd keeps for its own completions). The
// counter's state travels with the trainer's checkpoints (pairs included),
// so a restart or a takeover goes on from it; a summary without pairs is
// published to every member (CONFIG key quality.<readout>).
#ifndef LEAP_SIDECAR_FLEET_FLEET_QUALITY_H_
#define LEAP_SIDECAR_FLEET_FLEET_QUALITY_H_

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/core/fleet_link.h"

namespace leap::fleet {

// Versions with a series of their own (the newest by number).
inline constexpr size_t kQualityVersions = 64;
// Pairs a checkpoint carries at most (16 bytes each): versions beyond it
// keep their numbers without pairs (see FleetQualityTracker::Encode).
inline constexpr int64_t kQualityCheckpointPairs = 24'000;
// Bytes an encoded quality takes at most, with or without pairs: half a
// STATE chunk (the last chunk carries it, kStateChunkBytes in
// fleet_state.h) less 4 KiB for the fields the trainer adds (readout,
// trainer, positions). Series that do not fit are left out (Encode).
inline constexpr int64_t kQualityEncodeBytes = 1000 * 1000 / 2 - 4096;

// Not thread-safe: guarded by its owner.
class FleetQualityTracker {
 public:
  explicit FleetQualityTracker(int64_t window = 1000) : window_(window) {}

  // One completion's pair.
  void Add(int64_t version, const std::string& product_line,
           const std::string& arm, double predicted, double truth);

  // At most `max_bytes` serialized (so a checkpoint never fails for its
  // quality: quality is dropped, never the checkpoint). First every series'
  // numbers (count, Spearman, window size): overall, the versions, then the
  // (product line, arm) series in (product line, arm) order while they fit;
  // the arms after the first that does not fit are left out (after a
  // restart from this checkpoint they count from zero; members do not see
  // them), counted in arms_left_out(). With pairs (a checkpoint's): then
  // each series gets its pairs while they fit in kQualityCheckpointPairs
  // and in the bytes, in the order overall, arms, versions newest first; a
  // series that does not fit keeps its numbers without pairs. Without
  // pairs: the summary members read.
  leap::v1::fleet::FleetQuality Encode(
      bool with_pairs, int64_t max_bytes = kQualityEncodeBytes) const;
  // (product line, arm) series the last Encode left out.
  int64_t arms_left_out() const { return arms_left_out_; }
  // Replaces the state with a checkpoint's (window kept as constructed).
  void Decode(const leap::v1::fleet::FleetQuality& q);

  int64_t window() const { return window_; }
  int64_t completions() const { return overall_.completions; }

 private:
  struct Series {
    int64_t completions = 0;
    std::deque<std::pair<double, double>> pairs;  // newest `window_`
    // Restored without pairs: reported until a new pair arrives.
    std::optional<std::pair<double, int64_t>> restored;
  };
  void AddTo(Series* s, double predicted, double truth) const;
  static void Fill(const Series& s, bool with_pairs,
                   leap::v1::fleet::FleetQualitySeries* out);
  void Load(const leap::v1::fleet::FleetQualitySeries& in, Series* s) const;

  int64_t window_;
  mutable int64_t arms_left_out_ = 0;
  mutable int64_t arms_left_out_logged_ = 0;
  Series overall_;
  std::map<int64_t, Series> versions_;
  std::map<std::pair<std::string, std::string>, Series> arms_;
};

// CONFIG key of a readout's published quality: quality.<token>.
std::string QualityConfigKey(absl::string_view readout);

// A published summary as the Admin API reports it.
sidecar::FleetQualityView QualityView(const leap::v1::fleet::FleetQuality& q);

}  // namespace leap::fleet

#endif  // LEAP_SIDECAR_FLEET_FLEET_QUALITY_H_
