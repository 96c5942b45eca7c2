#include "engine_shim/scheduler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace leap::shim {
namespace {

// The error for an id the scheduler does not hold.
absl::Status NotLive(absl::string_view request_id) {
  return absl::NotFoundError(absl::StrCat("request ", request_id, " is not live"));
}

// Tiers of the sort key, first served first.
constexpr int kTierUrgent = -1;
constexpr int kTierPromoted = 0;
constexpr int kTierUnpredictedFirst = 1;
constexpr int kTierRanked = 2;
constexpr int kTierUnpredictedLast = 3;

absl::Status CheckTokens(absl::string_view what, double value) {
  if (!std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SchedulerOptions::Validate() const {
  if (slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots must be >= 1, got ", slots));
  }
  if (waiting_cap < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "waiting_cap must be >= 0 (0 disables), got ", waiting_cap));
  }
  if (!std::isfinite(aging_rate) || aging_rate < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "aging_rate must be finite and >= 0 (0 disables), got ", aging_rate));
  }
  if (absl::Status s = CheckTokens("remaining_floor", remaining_floor);
      !s.ok()) {
    return s;
  }
  switch (unpredicted) {
    case UnpredictedPolicy::kMedian:
    case UnpredictedPolicy::kFixed:
    case UnpredictedPolicy::kFirst:
    case UnpredictedPolicy::kLast:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown unpredicted policy ", static_cast<int>(unpredicted)));
  }
  switch (policy) {
    case SchedulingPolicy::kCountdown:
    case SchedulingPolicy::kBounded:
    case SchedulingPolicy::kHrrn:
    case SchedulingPolicy::kLinearAging:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown scheduling policy ", static_cast<int>(policy)));
  }
  if (!std::isfinite(max_slowdown) || max_slowdown < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_slowdown must be finite and >= 1, got ", max_slowdown));
  }
  if (!std::isfinite(latency_target_s) || latency_target_s < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "latency_target_s must be finite and >= 0, got ", latency_target_s));
  }
  if (!(target_quantile >= 0 && target_quantile < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_quantile must be in [0, 1), got ", target_quantile));
  }
  if (!(tail_budget >= 0 && tail_budget <= 0.5)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tail_budget must be in [0, 0.5], got ", tail_budget));
  }
  if (!(give_up_reserve >= 0 && give_up_reserve <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give_up_reserve must be in [0, 1], got ", give_up_reserve));
  }
  if (tail_budget_window < 1 || tail_budget_window > (1 << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tail_budget_window must be in [1, 16777216], got ",
        tail_budget_window));
  }
  if (tail_window < 0 || tail_window > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tail_window must be in [0, 1048576], got ", tail_window));
  }
  if (!(tail_quantile >= 0 && tail_quantile <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tail_quantile must be in [0, 1], got ", tail_quantile));
  }
  if (calibration_window < 0 || calibration_window > (1 << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration_window must be in [0, 1048576], got ",
        calibration_window));
  }
  switch (calibration) {
    case BoundCalibration::kAdditive:
    case BoundCalibration::kRatio:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown bound calibration ", static_cast<int>(calibration)));
  }
  if (!std::isfinite(bounded_linear_aging) || bounded_linear_aging < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bounded_linear_aging must be finite and >= 0, got ",
        bounded_linear_aging));
  }
  if (!std::isfinite(linear_aging) || linear_aging < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear_aging must be finite and >= 0, got ", linear_aging));
  }
  return CheckTokens("unpredicted_tokens", unpredicted_tokens);
}

absl::string_view SchedulingPolicyName(SchedulingPolicy policy) {
  switch (policy) {
    case SchedulingPolicy::kCountdown:
      return "countdown";
    case SchedulingPolicy::kBounded:
      return "bounded";
    case SchedulingPolicy::kHrrn:
      return "hrrn";
    case SchedulingPolicy::kLinearAging:
      return "linear-aging";
  }
  return "unknown";
}

absl::string_view BoundCalibrationName(BoundCalibration calibration) {
  switch (calibration) {
    case BoundCalibration::kAdditive:
      return "additive";
    case BoundCalibration::kRatio:
      return "ratio";
  }
  return "unknown";
}

absl::StatusOr<CountdownScheduler> CountdownScheduler::Create(
    SchedulerOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return CountdownScheduler(options);
}

absl::Status CountdownScheduler::Add(absl::string_view request_id) {
  auto [it, inserted] = index_.try_emplace(request_id, live_.size());
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request_id, " is already live"));
  }
  Request& r = live_.emplace_back();
  r.id = std::string(request_id);
  r.arrival = next_arrival_++;
  r.added_step = counters_.steps;
  r.origin = Now();
  ++counters_.added;
  return absl::OkStatus();
}

absl::Status CountdownScheduler::Add(absl::string_view request_id,
                                     const CarriedDeadline& carried) {
  if (!std::isfinite(carried.age) || carried.age < 0 ||
      !std::isfinite(carried.virtual_left) ||
      !std::isfinite(carried.virtual_estimate) ||
      carried.virtual_estimate < 0 || !std::isfinite(carried.tail_reference) ||
      carried.tail_reference < 0 ||
      (carried.holds_credit && !carried.gave_up)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "carried deadline of ", request_id,
        " must have finite fields, age, estimate and tail reference >= 0, "
        "and holds_credit only with gave_up; got age ",
        carried.age, ", virtual_left ", carried.virtual_left, ", estimate ",
        carried.virtual_estimate, ", tail reference ",
        carried.tail_reference, ", gave_up ", carried.gave_up,
        ", holds_credit ", carried.holds_credit));
  }
  if (absl::Status s = Add(request_id); !s.ok()) return s;
  if (options_.policy != SchedulingPolicy::kBounded) return absl::OkStatus();
  Request& r = live_.back();
  const double now = Now();
  r.origin = now - carried.age;
  if (Targeted()) {
    r.deadline = r.origin + options_.latency_target_s;
    r.was_urgent = carried.was_urgent;
    r.gave_up = carried.gave_up;
    if (r.gave_up && carried.holds_credit && options_.target_quantile > 0) {
      // Given up against a credit in an earlier stage: this stage sets one
      // of its own aside until the request leaves it (its miss is charged
      // only at completion).
      r.holds_credit = true;
      ++credits_set_aside_;
    } else if (r.gave_up && options_.tail_budget > 0) {
      // A deadline given up in an earlier stage counts against this one's
      // budget too (pruned here as well, so the window stays bounded even
      // if this stage never gives one up itself).
      PruneBudgetWindow();
      gave_up_.push_back(next_arrival_);
    }
    return absl::OkStatus();
  }
  r.virtual_finish = now + carried.virtual_left;
  r.virtual_estimate = carried.virtual_estimate;
  r.tail_reference = carried.tail_reference;
  r.deadline = r.origin + options_.max_slowdown *
                              std::max({r.virtual_finish - r.origin,
                                        r.tail_reference, 1.0});
  return absl::OkStatus();
}

absl::StatusOr<CarriedDeadline> CountdownScheduler::Carry(
    absl::string_view request_id) const {
  auto it = index_.find(request_id);
  if (it == index_.end()) {
    return NotLive(request_id);
  }
  const Request& r = live_[it->second];
  if (!r.deadline.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " has no deadline"));
  }
  const double now = Now();
  CarriedDeadline c;
  c.age = now - r.origin;
  if (Targeted()) {
    c.was_urgent = r.was_urgent;
    c.gave_up = r.gave_up;
    c.holds_credit = r.holds_credit;
    return c;
  }
  c.virtual_left = r.virtual_finish - now;
  c.virtual_estimate = r.virtual_estimate;
  c.tail_reference = r.tail_reference;
  return c;
}

absl::Status CountdownScheduler::SetPrediction(absl::string_view request_id,
                                               double predicted_tokens) {
  return SetPredictionImpl(request_id, predicted_tokens, /*first_only=*/true);
}

absl::Status CountdownScheduler::Rescore(absl::string_view request_id,
                                         double predicted_tokens) {
  return SetPredictionImpl(request_id, predicted_tokens, /*first_only=*/false);
}

absl::Status CountdownScheduler::SetPredictionImpl(absl::string_view request_id,
                                                   double value,
                                                   bool first_only) {
  if (absl::Status s = CheckTokens("predicted_tokens", value); !s.ok()) {
    return s;
  }
  auto it = index_.find(request_id);
  if (it == index_.end()) {
    return NotLive(request_id);
  }
  Request& r = live_[it->second];
  if (first_only && r.predicted_tokens.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " already has a prediction (",
                     *r.predicted_tokens, "); use Rescore for a new one"));
  }
  if (!r.predicted_tokens.has_value() && r.deadline.has_value() &&
      !Targeted()) {
    // Its virtual FCFS finish was placed with the unpredicted estimate: the
    // first prediction corrects it (for this request only).
    Calibrate();
    const double estimate =
        std::max(1.0, BoundWork(value, r.generated, /*unpredicted=*/0));
    r.virtual_finish += estimate - r.virtual_estimate;
    r.virtual_estimate = estimate;
    r.deadline = r.origin + options_.max_slowdown *
                                std::max({r.virtual_finish - r.origin,
                                          r.tail_reference, 1.0});
  }
  r.predicted_tokens = value;
  ++r.predictions;
  return absl::OkStatus();
}

absl::Status CountdownScheduler::SetPrior(absl::string_view request_id,
                                          double prior_tokens) {
  if (absl::Status s = CheckTokens("prior_tokens", prior_tokens); !s.ok()) {
    return s;
  }
  auto it = index_.find(request_id);
  if (it == index_.end()) {
    return NotLive(request_id);
  }
  Request& r = live_[it->second];
  if (r.predicted_tokens.has_value()) return absl::OkStatus();
  r.prior_tokens = prior_tokens;
  return absl::OkStatus();
}

absl::Status CountdownScheduler::Remove(absl::string_view request_id) {
  auto it = index_.find(request_id);
  if (it == index_.end()) {
    return NotLive(request_id);
  }
  const size_t pos = it->second;
  if (live_[pos].holds_credit) --credits_set_aside_;
  index_.erase(it);
  if (pos + 1 != live_.size()) {
    live_[pos] = std::move(live_.back());
    index_[live_[pos].id] = pos;
  }
  live_.pop_back();
  ++counters_.removed;
  return absl::OkStatus();
}

absl::Status CountdownScheduler::ObserveCompletion(double estimate_tokens,
                                                   double actual_tokens) {
  if (absl::Status s = CheckTokens("estimate_tokens", estimate_tokens);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckTokens("actual_tokens", actual_tokens); !s.ok()) {
    return s;
  }
  const size_t window = static_cast<size_t>(options_.calibration_window);
  if (options_.policy != SchedulingPolicy::kBounded || window == 0) {
    return absl::OkStatus();
  }
  const std::pair<double, double> sample(estimate_tokens, actual_tokens);
  if (samples_.size() < window) {
    samples_.push_back(sample);
  } else {
    samples_[samples_next_] = sample;
    samples_next_ = (samples_next_ + 1) % window;
  }
  correction_stale_ = true;
  return absl::OkStatus();
}

namespace {

// kRatio: the octave of an estimate, x' = max(x, 1) in [2^b, 2^(b+1)).
int Octave(double x) {
  return std::min(std::ilogb(std::max(x, 1.0)), kCalibrationOctaves - 1);
}

}  // namespace

void CountdownScheduler::Calibrate() {
  if (!correction_stale_) return;
  correction_stale_ = false;
  // Oldest first, so the sums do not depend on where the ring starts.
  const size_t m = samples_.size();
  double actual_total = 0;
  for (size_t j = 0; j < m; ++j) {
    actual_total += samples_[(samples_next_ + j) % m].second;
  }
  mean_actual_ = m > 0 ? actual_total / static_cast<double>(m) : 0;
  if (options_.calibration == BoundCalibration::kAdditive) {
    double sum = 0;
    for (size_t j = 0; j < m; ++j) {
      const auto& [estimate, actual] = samples_[(samples_next_ + j) % m];
      sum += actual - estimate;
    }
    correction_ = sum / static_cast<double>(m);
    return;
  }
  constexpr int kOctaves = kCalibrationOctaves;
  double actual_sum[kOctaves] = {}, estimate_sum[kOctaves] = {};
  int64_t count[kOctaves] = {};
  for (size_t j = 0; j < m; ++j) {
    const auto& [estimate, actual] = samples_[(samples_next_ + j) % m];
    const int b = Octave(estimate);
    actual_sum[b] += actual;
    estimate_sum[b] += std::max(estimate, 1.0);
    ++count[b];
  }
  // Groups of octaves from the bottom up, each closed once it holds
  // kCalibrationMinGroup completions; a short (or empty) top group joins
  // the last closed one. Sums add octave by octave, bottom up.
  octave_ratio_.assign(kOctaves, 1.0);
  int first = 0;        // first octave of the open group
  int last_first = -1;  // first octave of the last closed group
  double a = 0, e = 0, last_a = 0, last_e = 0;
  int64_t c = 0;
  const auto close = [&](int from, int to, double sa, double se) {
    const double ratio = se > 0 ? sa / se : 1.0;
    for (int b = from; b < to; ++b) octave_ratio_[b] = ratio;
  };
  for (int b = 0; b < kOctaves; ++b) {
    a += actual_sum[b];
    e += estimate_sum[b];
    c += count[b];
    if (c >= kCalibrationMinGroup) {
      close(first, b + 1, a, e);
      last_first = first;
      last_a = a;
      last_e = e;
      first = b + 1;
      a = e = 0;
      c = 0;
    }
  }
  if (first < kOctaves) {
    if (last_first >= 0) {
      close(last_first, kOctaves, last_a + a, last_e + e);
    } else {
      close(first, kOctaves, a, e);
    }
  }
}

double CountdownScheduler::service_correction() {
  Calibrate();
  return options_.calibration == BoundCalibration::kAdditive ? correction_
                                                            : 0.0;
}

double CountdownScheduler::service_ratio(double estimate_tokens) {
  Calibrate();
  return RatioFor(estimate_tokens);
}

double CountdownScheduler::RatioFor(double x) const {
  if (options_.calibration != BoundCalibration::kRatio ||
      octave_ratio_.empty()) {
    return 1.0;
  }
  return octave_ratio_[static_cast<size_t>(Octave(x))];
}

double CountdownScheduler::BoundWork(std::optional<double> total,
                                     int64_t generated,
                                     double unpredicted_remaining) const {
  const double g = static_cast<double>(generated);
  if (options_.calibration == BoundCalibration::kAdditive) {
    const double delta = correction_;
    if (!total.has_value()) return unpredicted_remaining + delta;
    return std::max(*total - g, options_.remaining_floor) + delta;
  }
  if (!total.has_value()) {
    return std::max(unpredicted_remaining, 1.0) *
           RatioFor(unpredicted_remaining);
  }
  const double ratio = RatioFor(*total);
  return std::max(std::max(*total, 1.0) * ratio - g,
                  options_.remaining_floor * ratio);
}

absl::StatusOr<RequestStats> CountdownScheduler::GetRequest(
    absl::string_view request_id) const {
  auto it = index_.find(request_id);
  if (it == index_.end()) {
    return NotLive(request_id);
  }
  const Request& r = live_[it->second];
  RequestStats stats;
  stats.predicted_tokens = r.predicted_tokens;
  stats.prior_tokens = r.prior_tokens;
  stats.generated = r.generated;
  stats.steps_waited = r.steps_waited;
  stats.arrival = r.arrival;
  stats.predictions = r.predictions;
  stats.added_step = r.added_step;
  stats.waited_total = r.waited_total;
  stats.deadline = r.deadline;
  stats.deadline_origin = r.origin;
  stats.was_urgent = r.was_urgent;
  stats.gave_up = r.gave_up;
  stats.holds_credit = r.holds_credit;
  return stats;
}

double CountdownScheduler::Remaining(const Request& r) const {
  return std::max(*Estimate(r) - static_cast<double>(r.generated),
                  options_.remaining_floor);
}

double CountdownScheduler::UnpredictedRemaining() {
  const double fixed =
      std::max(options_.unpredicted_tokens, options_.remaining_floor);
  if (options_.unpredicted != UnpredictedPolicy::kMedian) return fixed;
  scratch_.clear();
  for (const Request& r : live_) {
    if (r.predicted_tokens.has_value()) scratch_.push_back(Remaining(r));
  }
  if (scratch_.empty()) return fixed;
  // Lower median: an actual remaining value, no averaging.
  auto mid = scratch_.begin() + (scratch_.size() - 1) / 2;
  std::nth_element(scratch_.begin(), mid, scratch_.end());
  return *mid;
}

int64_t CountdownScheduler::CountAgingPromotions(size_t k) {
  // Tier sizes do not depend on aging, so the ranked tier gets the same k2
  // slots with or without it; count the chosen ones that the un-aged order
  // (remaining, arrival) would not have put among its first k2.
  size_t k2 = 0;
  for (size_t i = 0; i < k; ++i) k2 += candidates_[i].tier == kTierRanked;
  raw_keys_.clear();
  for (const Candidate& c : candidates_) {
    if (c.tier == kTierRanked) raw_keys_.emplace_back(c.remaining, c.arrival);
  }
  if (k2 == 0 || k2 == raw_keys_.size()) return 0;
  auto nth = raw_keys_.begin() + (k2 - 1);
  std::nth_element(raw_keys_.begin(), nth, raw_keys_.end());
  const std::pair<double, uint64_t> threshold = *nth;
  int64_t moved = 0;
  for (size_t i = 0; i < k; ++i) {
    const Candidate& c = candidates_[i];
    if (c.tier == kTierRanked &&
        std::make_pair(c.remaining, c.arrival) > threshold) {
      ++moved;
    }
  }
  return moved;
}

void CountdownScheduler::PruneBudgetWindow() {
  // Deadlines given up while the last tail_budget_window requests were
  // added (an event at arrival count N counts while fewer than
  // tail_budget_window requests have been added since).
  const uint64_t window = static_cast<uint64_t>(options_.tail_budget_window);
  while (!gave_up_.empty() && gave_up_.front() + window <= next_arrival_) {
    gave_up_.pop_front();
  }
}

bool CountdownScheduler::BudgetLeft() {
  PruneBudgetWindow();
  const uint64_t window = static_cast<uint64_t>(options_.tail_budget_window);
  const double added = static_cast<double>(
      std::min<uint64_t>(window, next_arrival_));
  // (The epsilon keeps a product such as 0.29 x 100 = 28.999... at 29.)
  return static_cast<double>(gave_up_.size() + 1) <=
         std::floor(options_.tail_budget * added + 1e-9);
}

void CountdownScheduler::AssignDeadlines(double unpredicted_remaining) {
  // New requests enter the virtual FCFS system in arrival order.
  new_requests_.clear();
  for (size_t i = 0; i < live_.size(); ++i) {
    if (!live_[i].deadline.has_value()) new_requests_.push_back(i);
  }
  if (new_requests_.empty()) return;
  if (Targeted()) {
    // One target for everybody: no virtual FCFS system.
    for (size_t i : new_requests_) {
      live_[i].deadline = live_[i].origin + options_.latency_target_s;
    }
    return;
  }
  std::sort(new_requests_.begin(), new_requests_.end(),
            [&](size_t a, size_t b) {
              return live_[a].arrival < live_[b].arrival;
            });
  const double now = static_cast<double>(counters_.steps);
  const size_t servers = static_cast<size_t>(options_.slots);
  const auto later = std::greater<double>();  // min-heap
  for (size_t i : new_requests_) {
    Request& r = live_[i];
    const double estimate = std::max(
        1.0, BoundWork(Estimate(r), r.generated, unpredicted_remaining));
    double start = now;
    if (virtual_free_.size() >= servers) {
      std::pop_heap(virtual_free_.begin(), virtual_free_.end(), later);
      start = std::max(now, virtual_free_.back());
      virtual_free_.pop_back();
    }
    const double finish = start + estimate;
    virtual_free_.push_back(finish);
    std::push_heap(virtual_free_.begin(), virtual_free_.end(), later);
    const double added = static_cast<double>(r.added_step);
    r.virtual_estimate = estimate;
    r.virtual_finish = finish;
    r.tail_reference = 0;
    const size_t window = static_cast<size_t>(options_.tail_window);
    if (window > 0) {
      if (!recent_latency_.empty()) {
        scratch_.assign(recent_latency_.begin(), recent_latency_.end());
        const size_t at = static_cast<size_t>(std::floor(
            options_.tail_quantile * static_cast<double>(scratch_.size() - 1)));
        std::nth_element(scratch_.begin(), scratch_.begin() + at,
                         scratch_.end());
        r.tail_reference = scratch_[at];
      }
      if (recent_latency_.size() < window) {
        recent_latency_.push_back(finish - added);
      } else {
        recent_latency_[recent_next_] = finish - added;
        recent_next_ = (recent_next_ + 1) % window;
      }
    }
    r.deadline = added + options_.max_slowdown *
                             std::max({finish - added, r.tail_reference, 1.0});
  }
}

void CountdownScheduler::Rank(size_t k) {
  const size_t n = live_.size();
  bool any_unpredicted = false;
  for (const Request& r : live_) {
    any_unpredicted |= !Estimate(r).has_value();
  }
  const double unpredicted_remaining =
      any_unpredicted ? UnpredictedRemaining() : 0;
  const SchedulingPolicy policy = options_.policy;
  if (policy == SchedulingPolicy::kBounded) {
    Calibrate();
    AssignDeadlines(unpredicted_remaining);
  }
  const int64_t cap = options_.waiting_cap;
  const double rate = options_.aging_rate;
  const double now = Now();
  const double step = StepTime();
  // kBounded: the work left the bound sees, and the urgency test, once per
  // request and step.
  work_left_.clear();
  at_risk_.clear();
  if (policy == SchedulingPolicy::kBounded) {
    for (const Request& r : live_) {
      const double work = std::max(
          0.0, BoundWork(Estimate(r), r.generated, unpredicted_remaining));
      work_left_.push_back(work);
      at_risk_.push_back(now + step * work > EffectiveDeadline(r) - step);
    }
  }
  const double q = options_.target_quantile;
  const bool on_credit = q > 0 && options_.give_up_reserve < 1;
  if (policy == SchedulingPolicy::kBounded && Targeted() &&
      (options_.tail_budget > 0 || on_credit) && mean_actual_ > 0) {
    // give_up_reserve: the credits that must stay, not set aside, once one
    // more is (never reached when the reserve is the whole bank or there is
    // no controller).
    const double bank =
        (1 - q) * static_cast<double>(options_.tail_budget_window);
    const double keep = options_.give_up_reserve * bank;
    // tail_budget: requests turning urgent for the first time with enough
    // work left give up their deadline, in arrival order, while the budget
    // lasts (so the choice does not depend on the order of live_), then
    // while give_up_reserve's credits last.
    giving_up_.clear();
    for (size_t i = 0; i < n; ++i) {
      const Request& r = live_[i];
      if (!r.gave_up && !r.was_urgent && at_risk_[i] &&
          work_left_[i] >= kTailBudgetMinWork * mean_actual_) {
        giving_up_.push_back(i);
      }
    }
    std::sort(giving_up_.begin(), giving_up_.end(), [&](size_t a, size_t b) {
      return live_[a].arrival < live_[b].arrival;
    });
    for (size_t i : giving_up_) {
      if (options_.tail_budget > 0 && BudgetLeft()) {
        // When (in arrivals) it gave up: the budget is a rate per arrivals.
        gave_up_.push_back(next_arrival_);
      } else if (on_credit &&
                 // (The epsilon keeps 0.5 x 100 = 50.000...04 at 50.)
                 target_credits_ -
                         static_cast<double>(credits_set_aside_ + 1) + 1e-9 >=
                     keep) {
        live_[i].holds_credit = true;
        ++credits_set_aside_;
        ++counters_.credit_give_ups;
      } else {
        break;  // neither the budget nor the credits move back this step
      }
      live_[i].gave_up = true;
      ++counters_.deadlines_given_up;
    }
  }

  candidates_.clear();
  for (size_t i = 0; i < n; ++i) {
    Request& r = live_[i];
    Candidate c;
    c.arrival = r.arrival;
    c.index = static_cast<uint32_t>(i);
    const bool estimated = Estimate(r).has_value();
    const double remaining =
        estimated ? Remaining(r) : unpredicted_remaining;
    const bool urgent =
        policy == SchedulingPolicy::kBounded && !r.gave_up && at_risk_[i];
    r.was_urgent |= urgent;
    if (urgent) {
      c.tier = kTierUrgent;
      c.priority = EffectiveDeadline(r);
    } else if (cap > 0 && r.steps_waited >= cap) {
      c.tier = kTierPromoted;
      c.priority = -static_cast<double>(r.steps_waited);
    } else if (!estimated &&
               options_.unpredicted == UnpredictedPolicy::kFirst) {
      c.tier = kTierUnpredictedFirst;
    } else if (!estimated &&
               options_.unpredicted == UnpredictedPolicy::kLast) {
      c.tier = kTierUnpredictedLast;
    } else {
      c.tier = kTierRanked;
      c.remaining = remaining;
      const double waited = static_cast<double>(r.waited_total);
      switch (policy) {
        case SchedulingPolicy::kHrrn: {
          const double service = std::max(remaining, 1.0);
          c.priority = -(waited + service) / service;
          break;
        }
        case SchedulingPolicy::kLinearAging:
          c.priority = remaining - options_.linear_aging * waited;
          break;
        case SchedulingPolicy::kBounded:
          if (options_.bounded_linear_aging > 0) {
            c.priority = remaining - options_.bounded_linear_aging * waited;
            break;
          }
          [[fallthrough]];
        case SchedulingPolicy::kCountdown:
          c.priority =
              rate > 0
                  ? remaining *
                        std::exp(-rate * static_cast<double>(r.steps_waited))
                  : remaining;
          break;
      }
    }
    candidates_.push_back(c);
  }

  auto less = [](const Candidate& a, const Candidate& b) {
    return std::tie(a.tier, a.priority, a.arrival) <
           std::tie(b.tier, b.priority, b.arrival);
  };
  // The key is a total order (arrival is unique), so the first k after
  // nth_element are exactly the k smallest.
  if (k < n) {
    std::nth_element(candidates_.begin(), candidates_.begin() + k,
                     candidates_.end(), less);
  }
  std::sort(candidates_.begin(), candidates_.begin() + k, less);
}

void CountdownScheduler::CommitSelected() {
  ++counters_.steps;
  for (size_t i = 0; i < live_.size(); ++i) {
    Request& r = live_[i];
    if (selected_[i]) {
      ++r.generated;
      r.steps_waited = 0;
      ++counters_.selections;
    } else {
      ++r.steps_waited;
      ++r.waited_total;
      counters_.max_steps_waited =
          std::max(counters_.max_steps_waited, r.steps_waited);
    }
  }
}

std::vector<std::string> CountdownScheduler::Order(size_t k) {
  const size_t n = live_.size();
  k = std::min(k, n);
  std::vector<std::string> out;
  if (n == 0) return out;
  Rank(k);
  out.reserve(k);
  for (size_t i = 0; i < k; ++i) {
    out.push_back(live_[candidates_[i].index].id);
  }
  return out;
}

absl::Status CountdownScheduler::MarkSelected(
    const std::vector<std::string>& ids) {
  selected_.assign(live_.size(), 0);
  for (const std::string& id : ids) {
    auto it = index_.find(id);
    if (it == index_.end()) {
      return NotLive(id);
    }
    if (selected_[it->second]) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", id, " is listed twice"));
    }
    selected_[it->second] = 1;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> CountdownScheduler::OrderAmong(
    const std::vector<std::string>& ids) {
  if (absl::Status s = MarkSelected(ids); !s.ok()) return s;
  std::vector<std::string> out;
  if (ids.empty()) return out;
  Rank(0);
  std::vector<const Candidate*> chosen;
  chosen.reserve(ids.size());
  for (const Candidate& c : candidates_) {
    if (selected_[c.index]) chosen.push_back(&c);
  }
  std::sort(chosen.begin(), chosen.end(),
            [](const Candidate* a, const Candidate* b) {
              return std::tie(a->tier, a->priority, a->arrival) <
                     std::tie(b->tier, b->priority, b->arrival);
            });
  out.reserve(chosen.size());
  for (const Candidate* c : chosen) out.push_back(live_[c->index].id);
  return out;
}

absl::Status CountdownScheduler::Commit(const std::vector<std::string>& ran) {
  if (absl::Status s = MarkSelected(ran); !s.ok()) return s;
  CommitSelected();
  return absl::OkStatus();
}

absl::Status CountdownScheduler::ObserveLatency(double latency_s) {
  if (absl::Status s = CheckTokens("latency_s", latency_s); !s.ok()) return s;
  const double q = options_.target_quantile;
  if (options_.policy != SchedulingPolicy::kBounded || !Targeted() || q <= 0) {
    return absl::OkStatus();
  }
  // Credits: 1 - q earned per report, at most (1 - q) x tail_budget_window
  // banked, one spent per latency beyond the target. In debt the urgency
  // test tightens exponentially with the debt (an integral controller:
  // the debt stops moving exactly when 1 - q of the reports are beyond the
  // target), the debt kept where the scale reaches its floor.
  const double bank =
      (1 - q) * static_cast<double>(options_.tail_budget_window);
  target_credits_ = std::min(bank, target_credits_ + (1 - q));
  ++counters_.latencies_observed;
  if (latency_s > options_.latency_target_s) {
    target_credits_ -= 1;
    ++counters_.latencies_beyond_target;
  }
  target_credits_ =
      std::max(target_credits_, std::log(kTargetMinScale) / kTargetGain);
  target_scale_ = std::max(
      kTargetMinScale, std::exp(kTargetGain * std::min(0.0, target_credits_)));
  return absl::OkStatus();
}

absl::Status CountdownScheduler::SetTime(double now_s, double step_s) {
  if (!std::isfinite(now_s) || !std::isfinite(step_s) || step_s < 0 ||
      (has_time_ && now_s < time_now_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SetTime needs finite values, step_s >= 0 and a clock that does not "
        "go back (it reads ",
        time_now_, "); got now_s ", now_s, ", step_s ", step_s));
  }
  time_now_ = now_s;
  time_step_ = step_s;
  has_time_ = true;
  return absl::OkStatus();
}

absl::Status CountdownScheduler::CommitIdle(int64_t steps) {
  if (steps < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("idle steps must be >= 0, got ", steps));
  }
  if (!live_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "idle steps need an empty scheduler; ", live_.size(),
        " requests are live"));
  }
  counters_.steps += steps;
  return absl::OkStatus();
}

std::vector<std::string> CountdownScheduler::Select(int slots) {
  const size_t n = live_.size();
  const size_t k = slots <= 0 ? 0 : std::min(static_cast<size_t>(slots), n);
  std::vector<std::string> chosen;
  selected_.assign(n, 0);

  if (k > 0) {
    Rank(k);
    chosen.reserve(k);
    for (size_t i = 0; i < k; ++i) {
      const Candidate& c = candidates_[i];
      counters_.cap_promotions += c.tier == kTierPromoted;
      counters_.urgent_selections += c.tier == kTierUrgent;
      selected_[c.index] = 1;
      chosen.push_back(live_[c.index].id);
    }
    if (options_.aging_rate > 0 &&
        options_.policy != SchedulingPolicy::kHrrn &&
        options_.policy != SchedulingPolicy::kLinearAging) {
      counters_.aging_promotions += CountAgingPromotions(k);
    }
  } else if (options_.policy == SchedulingPolicy::kBounded && n > 0) {
    // Requests present at this step still get their deadline now.
    Rank(0);
  }
  CommitSelected();
  return chosen;
}

}  // namespace leap::shim
