#include "sidecar/core/guardrail.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "sidecar/core/live_readout.h"

namespace leap::sidecar {

absl::StatusOr<GuardrailAction> ParseGuardrailAction(absl::string_view s) {
  if (s == "freeze") return GuardrailAction::kFreeze;
  if (s == "rollback") return GuardrailAction::kRollback;
  return absl::InvalidArgumentError(absl::StrCat(
      "guardrail action must be 'freeze' or 'rollback', got '", s, "'"));
}

const char* GuardrailActionName(GuardrailAction a) {
  return a == GuardrailAction::kRollback ? "rollback" : "freeze";
}

absl::Status GuardrailOptions::Validate(int64_t window) const {
  if (!std::isnan(floor) && !(floor >= -1 && floor <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("guardrail floor must be in [-1, 1], got ", floor));
  }
  if (!std::isnan(margin) && !(margin > 0 && margin <= 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("guardrail margin must be in (0, 2], got ", margin));
  }
  if (!(hysteresis >= 0 && hysteresis <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "guardrail hysteresis must be in [0, 1], got ", hysteresis));
  }
  if (enabled() && (min_samples < 2 || min_samples > window)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "guardrail min_samples must be in [2, quality_window = ", window,
        "], got ", min_samples));
  }
  return absl::OkStatus();
}

bool IsGoodSnapshot(const storage::SnapshotInfo& s, const GuardrailOptions& o) {
  if (!std::isfinite(s.spearman) || s.spearman_n < o.min_samples) return false;
  return std::isnan(o.floor) || s.spearman >= o.floor;
}

std::optional<GoodSnapshot> LastGoodSnapshot(
    const std::vector<storage::SnapshotInfo>& snapshots,
    const GuardrailOptions& o) {
  const storage::SnapshotInfo* best = nullptr;
  for (const storage::SnapshotInfo& s : snapshots) {
    if (!IsGoodSnapshot(s, o)) continue;
    if (best == nullptr || s.unix_ms > best->unix_ms ||
        (s.unix_ms == best->unix_ms && s.version > best->version)) {
      best = &s;
    }
  }
  if (best == nullptr) return std::nullopt;
  return GoodSnapshot{best->label, best->spearman, best->spearman_n,
                      best->version, best->unix_ms};
}

GuardrailMonitor::GuardrailMonitor(GuardrailOptions options, int64_t window)
    : options_(options), window_(window), pairs_(window) {}

void GuardrailMonitor::Restart(Phase phase) {
  pairs_ = RollingSpearman(window_);
  phase_ = phase;
}

double GuardrailMonitor::spearman(int64_t* n) const {
  if (n != nullptr) *n = pairs_.size();
  return pairs_.Value();
}

std::optional<GuardrailTrip> GuardrailMonitor::Observe(double predicted,
                                                       double truth) {
  if (phase_ == Phase::kDisarmed) return std::nullopt;
  pairs_.Add(predicted, truth);
  const int64_t n = pairs_.size();
  if (n < options_.min_samples) return std::nullopt;
  const double rho = pairs_.Value();
  if (std::isnan(rho)) return std::nullopt;  // undefined: nothing to judge
  GuardrailTrip trip;
  trip.spearman = rho;
  trip.n = n;
  trip.last_good = last_good_;
  if (!std::isnan(options_.floor) && rho < options_.floor) {
    trip.reason = absl::StrFormat(
        "guardrail: spearman %.3f < floor %g over %d completions", rho,
        options_.floor, n);
  } else if (!std::isnan(options_.margin) && last_good_.has_value() &&
             rho < last_good_->spearman - options_.margin) {
    trip.reason = absl::StrFormat(
        "guardrail: spearman %.3f dropped %.3f below %.3f of snapshot '%s' "
        "(margin %g) over %d completions",
        rho, last_good_->spearman - rho, last_good_->spearman,
        last_good_->label, options_.margin, n);
  } else {
    // A passing window arms a warming guardrail when it clears every trip
    // line by the hysteresis.
    const bool clear =
        (std::isnan(options_.floor) || rho >= options_.floor + options_.hysteresis) &&
        (std::isnan(options_.margin) || !last_good_.has_value() ||
         rho >= last_good_->spearman - options_.margin + options_.hysteresis);
    if (clear) phase_ = Phase::kArmed;
    return std::nullopt;
  }
  if (phase_ == Phase::kWarming) return std::nullopt;
  phase_ = Phase::kDisarmed;
  return trip;
}

ReadoutGuardrail::ReadoutGuardrail(GuardrailOptions options, int64_t window,
                                   Series series, bool tripped)
    : action_(options.action),
      series_(series),
      monitor_(options, window),
      tripped_(tripped) {
  if (tripped) monitor_.Disarm();
  if (series_.state != nullptr) series_.state->Set(tripped ? 1 : 0);
}

std::optional<GuardrailTrip> ReadoutGuardrail::Observe(double predicted,
                                                      double truth) {
  absl::MutexLock lock(&mu_);
  std::optional<GuardrailTrip> trip = monitor_.Observe(predicted, truth);
  if (!trip.has_value()) return std::nullopt;
  // Only this caller gets the trip: the monitor stays disarmed until
  // learning resumes.
  tripped_ = true;
  ++trips_;
  if (series_.state != nullptr) series_.state->Set(1);
  return trip;
}

void ReadoutGuardrail::TripDone(const GuardrailTrip& trip,
                                const std::string& done,
                                GuardrailAction applied) {
  {
    absl::MutexLock lock(&mu_);
    last_trip_ = absl::StrCat(trip.reason, "; ", done);
    last_trip_unix_ms_ = UnixMs();
  }
  prometheus::Counter* c = applied == GuardrailAction::kRollback
                               ? series_.trips_rollback
                               : series_.trips_freeze;
  if (c != nullptr) c->Increment();
}

void ReadoutGuardrail::OnSnapshots(
    const std::vector<storage::SnapshotInfo>& snapshots) {
  absl::MutexLock lock(&mu_);
  monitor_.SetLastGood(LastGoodSnapshot(snapshots, monitor_.options()));
}

void ReadoutGuardrail::Rearm() {
  absl::MutexLock lock(&mu_);
  monitor_.Restart(tripped_ ? GuardrailMonitor::Phase::kArmed
                            : GuardrailMonitor::Phase::kWarming);
  tripped_ = false;
  if (series_.state != nullptr) series_.state->Set(0);
}

GuardrailStatus ReadoutGuardrail::Status(bool frozen) const {
  absl::MutexLock lock(&mu_);
  GuardrailStatus s;
  s.state = tripped_ ? "tripped"
             : frozen ? "paused"
             : monitor_.phase() == GuardrailMonitor::Phase::kWarming
                 ? "warming"
                 : "watching";
  s.spearman = monitor_.spearman(&s.spearman_n);
  s.trips = trips_;
  s.last_trip = last_trip_;
  s.last_trip_unix_ms = last_trip_unix_ms_;
  s.last_good = monitor_.last_good();
  return s;
}

}  // namespace leap::sidecar
