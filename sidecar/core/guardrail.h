// The online-quality guardrail: per readout, the rolling Spearman of
// predicted vs. true length over its latest completions is judged after
// every completion while the readout learns. When it falls below a floor,
// or more than a margin below the quality recorded with the last good
// snapshot, learning is frozen (persisted, with the reason) and, when
// configured, the readout is rolled back to that snapshot.
//
// "Last good snapshot": among the readout's snapshots, the newest (by the
// time it was taken) whose recorded rolling Spearman is defined, was
// computed over at least `min_samples` completions and is at or above the
// floor (when a floor is set). Snapshots taken before this recorded their
// sample count never qualify.
#ifndef LEAP_SIDECAR_CORE_GUARDRAIL_H_
#define LEAP_SIDECAR_CORE_GUARDRAIL_H_

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "sidecar/core/quality.h"
#include "storage/state_store.h"

namespace prometheus {
class Counter;
class Gauge;
}  // namespace prometheus

namespace leap::sidecar {

class LiveReadout;

enum class GuardrailAction { kFreeze, kRollback };
absl::StatusOr<GuardrailAction> ParseGuardrailAction(absl::string_view s);
const char* GuardrailActionName(GuardrailAction a);

struct GuardrailOptions {
  // Trip when the rolling Spearman is below this, in [-1, 1]. NaN: no floor.
  double floor = NAN;
  // Trip when it is more than this below the last good snapshot's, in
  // (0, 2]. NaN: no margin check.
  double margin = NAN;
  // Completions in the window before it is judged; also the least a
  // snapshot's recorded quality must cover to count as good. In
  // [2, window]. Default: 500
  int64_t min_samples = 500;
  // Hysteresis, in [0, 1]: a warming guardrail is armed only by a judged
  // window at least this far above its trip line (the floor, and the last
  // good snapshot's Spearman less the margin), so a quality hovering at
  // the line cannot arm it at 0.301 and trip it at 0.299. 0: the first
  // window that does not fail arms it. Default: 0.05
  double hysteresis = 0.05;
  GuardrailAction action = GuardrailAction::kFreeze;

  bool enabled() const { return !std::isnan(floor) || !std::isnan(margin); }
  // `window`: the rolling window's capacity (--quality_window).
  absl::Status Validate(int64_t window) const;
};

// A snapshot the guardrail compares against and rolls back to.
struct GoodSnapshot {
  std::string label;
  double spearman = NAN;
  int64_t spearman_n = 0;
  int64_t version = 0;
  int64_t unix_ms = 0;
};

// True when `s` qualifies as good under `o` (see the file comment).
bool IsGoodSnapshot(const storage::SnapshotInfo& s, const GuardrailOptions& o);
// The last good snapshot among `snapshots`, if any.
std::optional<GoodSnapshot> LastGoodSnapshot(
    const std::vector<storage::SnapshotInfo>& snapshots,
    const GuardrailOptions& o);

struct GuardrailTrip {
  double spearman = NAN;
  int64_t n = 0;
  // "guardrail: spearman 0.12 < floor 0.30 over 500 completions"
  std::string reason;
  // The rollback target (also the margin's reference), if any.
  std::optional<GoodSnapshot> last_good;
};

// The trip logic over a rolling window. Not thread-safe.
//
// A window "fails" when it holds at least min_samples pairs, its Spearman
// is defined, and it is below the floor or more than the margin below the
// last good snapshot's. The guardrail trips when the quality *falls*: it
// starts warming (a cold-start readout predicts badly until it has
// learned) and is armed by the first judged window that clears the trip
// line by the hysteresis; from then on the first failing window trips it
// and disarms it.
class GuardrailMonitor {
 public:
  enum class Phase { kWarming, kArmed, kDisarmed };
  GuardrailMonitor(GuardrailOptions options, int64_t window);
  // Adds a (predicted, true) pair and judges the window (see above);
  // returns the trip, if this pair caused one. Pairs are not recorded while
  // disarmed.
  std::optional<GuardrailTrip> Observe(double predicted, double truth);
  // The reference for the margin check and the rollback target.
  void SetLastGood(std::optional<GoodSnapshot> good) {
    last_good_ = std::move(good);
  }
  const std::optional<GoodSnapshot>& last_good() const { return last_good_; }
  // Empties the window and enters `phase` (warming or armed).
  void Restart(Phase phase);
  void Disarm() { phase_ = Phase::kDisarmed; }
  Phase phase() const { return phase_; }
  bool armed() const { return phase_ == Phase::kArmed; }
  // The window's Spearman (NaN when undefined) and size.
  double spearman(int64_t* n) const;
  const GuardrailOptions& options() const { return options_; }

 private:
  const GuardrailOptions options_;
  const int64_t window_;
  RollingSpearman pairs_;
  Phase phase_ = Phase::kWarming;
  std::optional<GoodSnapshot> last_good_;
};

// What GetStats and `leapctl stats` show.
struct GuardrailStatus {
  // "off" (not configured or the readout cannot learn), "warming"
  // (learning; armed once a judged window passes), "watching" (learning,
  // armed), "paused" (frozen for another reason: not judged), "tripped"
  // (learning frozen by the guardrail until resumed).
  std::string state = "off";
  double spearman = NAN;
  int64_t spearman_n = 0;
  int64_t trips = 0;
  std::string last_trip;  // the reason and what was done; "" if none
  int64_t last_trip_unix_ms = 0;
  std::optional<GoodSnapshot> last_good;
};

// The guardrail of one readout: the monitor, its state and metrics, and
// the action on a trip. Thread-safe.
class ReadoutGuardrail {
 public:
  struct Series {
    prometheus::Gauge* state = nullptr;            // 1 while tripped
    prometheus::Counter* trips_freeze = nullptr;   // action="freeze"
    prometheus::Counter* trips_rollback = nullptr; // action="rollback"
  };
  // `tripped`: the readout was frozen by the guardrail before (recovered).
  ReadoutGuardrail(GuardrailOptions options, int64_t window, Series series,
                   bool tripped);

  // Called by the readout for each judged completion while it learns.
  // Returns the trip when this pair caused one (the guardrail is then
  // "tripped"); the readout freezes itself and has the action run off the
  // caller's thread (LiveReadout::RecordQuality), then reports it with
  // TripDone. Cheap: it never blocks on the readout.
  std::optional<GuardrailTrip> Observe(double predicted, double truth);
  // The trip's action ran: `done` says what it did ("learning frozen; rolled
  // back to ..."), `applied` which action took effect (metrics).
  void TripDone(const GuardrailTrip& trip, const std::string& done,
                GuardrailAction applied);
  GuardrailAction action() const { return action_; }
  // The readout's snapshots changed (or were loaded): recompute the last
  // good one.
  void OnSnapshots(const std::vector<storage::SnapshotInfo>& snapshots);
  // Learning resumed (or the served state replaced by an operator
  // rollback): judge afresh from an empty window; armed at once after a
  // guardrail trip (still bad after a resume trips again), else warming.
  void Rearm();
  GuardrailStatus Status(bool frozen) const;

 private:
  const GuardrailAction action_;
  const Series series_;
  mutable absl::Mutex mu_;
  GuardrailMonitor monitor_ ABSL_GUARDED_BY(mu_);
  bool tripped_ ABSL_GUARDED_BY(mu_);
  int64_t trips_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_trip_ ABSL_GUARDED_BY(mu_);
  int64_t last_trip_unix_ms_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_GUARDRAIL_H_
