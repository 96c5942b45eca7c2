// CountdownScheduler: decides, step by step, which live requests get a decode
// slot (docs/SCHEDULING.md): the paper's countdown with a waiting cap, and
// optionally a tail bound (SchedulingPolicy::kBounded) or one of two
// baselines (HRRN, linear aging).
//
// Ordering of one step, first to last:
//   0. (kBounded only) Urgent requests: now + remaining > deadline - 1
//      (waiting one more step would finish it after its deadline), earliest
//      deadline first; ties by arrival. `now` is the number of steps before
//      this one. The deadline is fixed at a request's
//      first step: added + S * max(F - added, Q), F its finish in a virtual
//      FCFS system of `slots` servers fed the same requests in arrival order
//      with their estimates (S = max_slowdown), Q the tail_quantile of the
//      virtual latencies of the last tail_window requests. A request still unpredicted then
//      is placed with the unpredicted estimate; its first prediction moves
//      its own F by the difference (later virtual jobs are not moved).
//      A request added with a CarriedDeadline (Add(id, carried), from an
//      earlier stage's Carry) keeps that stage's deadline: origin + S *
//      max(F - origin, Q), origin its first step there (one deadline from
//      arrival). kBounded with bounded_linear_aging > 0 ranks tier 2 by
//      remaining - bounded_linear_aging * waited. The estimates of the
//      bound (virtual jobs, and `remaining` in the urgency test) carry the
//      correction learned from completions (ObserveCompletion,
//      calibration_window): job = max(1, x + delta), work left =
//      max(0, remaining + delta); delta = 0 until a completion is reported.
//      With BoundCalibration::kRatio the correction is a factor per octave
//      of the estimate instead (see BoundCalibration and BoundWork).
//      With a latency target (latency_target_s > 0) the clock is the
//      engine's, in seconds (SetTime): every deadline is the clock at Add
//      plus the target (no virtual FCFS system), a request is urgent when
//      now + step_s x work left > deadline - step_s, and up to tail_budget
//      of the requests (per tail_budget_window added) give up their
//      deadline when they first turn urgent with at least
//      kTailBudgetMinWork x the mean completed length left (in arrival
//      order; urgent as the controller below reads the deadline, so in
//      its debt earlier); a request that gave up is never urgent again. With
//      target_quantile q > 0 the urgency test reads the deadline as origin
//      + s x the target, s in [kTargetMinScale, 1] steered by the reported
//      latencies (ObserveLatency) so that a share q of them stays within
//      the target (credits earned per report, spent per latency beyond),
//      as far as tightening can: at the floor nothing tightens further.
//      Past the tail budget a request that would give up still does while
//      the credits not set aside stay at or above give_up_reserve x the
//      bank after setting one aside for it (until its Remove).
//   1. Promoted requests: steps_waited >= waiting_cap (when the cap is on).
//      Most steps waited first; ties by arrival (FCFS).
//   2. Everybody else by effective priority, smallest first; ties by arrival:
//        remaining = max(L̂ − generated, remaining_floor)
//        kCountdown, kBounded: remaining * exp(-aging_rate * steps_waited)
//        kHrrn:         -(waited + max(remaining, 1)) / max(remaining, 1)
//        kLinearAging:  remaining - linear_aging * waited
//      (waited: all steps without a slot since Add; with aging_rate == 0 the
//      countdown priority is exactly `remaining`). Requests without a
//      prediction yet are placed by their prior (SetPrior) when they have
//      one, ranked like a prediction L̂ = prior, else by `UnpredictedPolicy`
//      (the ranked policies use the unpredicted remaining as their
//      remaining).
// Every key ends in the arrival counter, so the order is total and the result
// is deterministic: it does not depend on hash order or on the order in which
// requests were added, removed or rescored.
//
// Starvation bound (proved in scheduler_test.cc, WaitingBound*): with
// waiting_cap = W >= 1 and every step given at least k >= 1 slots, a request
// that reaches the cap while L requests are live (itself included) is selected
// after at most W + floor((L - 1) / k) consecutive steps without a slot. More
// precisely the extra wait is floor(A / k), A being the promoted requests
// ranked ahead of it when it reaches the cap, so when more than k requests hit
// the cap together the last of them waits past W.
//
// Cost of one Select over n live requests with k slots: O(n + k log k)
// (nth_element, then sort of the chosen k), plus O(n) when aging is on (to
// count aging promotions) or when the median policy needs a median. No I/O,
// no clocks, no randomness.
//
// Thread safety: none. The engine's step loop owns the scheduler and is the
// only caller of every method; predictions and rescores that arrive on other
// threads must be handed to the step loop (e.g. queued and applied before the
// next Select).
#ifndef LEAP_ENGINE_SHIM_SCHEDULER_H_
#define LEAP_ENGINE_SHIM_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace leap::shim {

// Where a request that has no prediction yet (the sidecar is late or down) is
// placed among the non-promoted requests. The waiting cap applies to it as to
// any request.
enum class UnpredictedPolicy {
  // Ranked as if its remaining length were the lower median of the remaining
  // lengths of the live predicted requests (or `unpredicted_tokens` when none
  // is predicted). It does not count down, and aging applies as usual.
  // The default: a request the predictor has not seen is treated like a
  // typical request of the current mix. It neither jumps ahead of the short
  // requests the scheduler exists to favour, nor sinks behind every long one
  // and waits for the cap. With the sidecar down all requests share one value
  // and the scheduler degrades to FCFS (plus aging and the cap), which is what
  // an engine without a predictor would do. The median follows the traffic,
  // so no length scale has to be configured.
  kMedian,
  // Ranked as if its remaining length were `unpredicted_tokens` (floored);
  // does not count down.
  kFixed,
  // Ahead of all predicted non-promoted requests, FCFS among themselves.
  kFirst,
  // Behind all predicted requests, FCFS among themselves.
  kLast,
};

// How the ranked tier is ordered, and whether the tail bound applies
// (docs/SCHEDULING.md, "Tail bound").
enum class SchedulingPolicy {
  // Shortest predicted remaining first (the paper's countdown). The default.
  kCountdown,
  // The countdown plus the slowdown bound: a request whose remaining work no
  // longer fits before its deadline (see the file comment) is served ahead of
  // everybody, earliest deadline first. Knob: max_slowdown.
  kBounded,
  // Highest response ratio next, on predicted remaining work (baseline).
  kHrrn,
  // Remaining minus linear_aging tokens per step waited (baseline).
  kLinearAging,
};

// kBounded: how the bound corrects its service estimates from reported
// completions (ObserveCompletion; docs/SCHEDULING.md, "Estimates unbiased
// for the mean"). Either way the corrected estimates of the window's
// completions add up to their actual lengths (before the clamps).
enum class BoundCalibration {
  // x + delta, delta = the mean of (actual - estimate) over the window: one
  // number for every request, right for an error that does not depend on
  // the length.
  kAdditive,
  // x' * ratio(x), x' = max(x, 1): ratio = sum actual / sum x' over the
  // window's completions whose estimate falls in the same group of octaves
  // of x' ([2^b, 2^(b+1)), b = 0..kCalibrationOctaves - 1, the last one
  // open), octaves merged from the bottom up until a group holds at least
  // kCalibrationMinGroup completions (a short top group joins the one
  // below). A piecewise-constant estimate of E[actual | estimate] /
  // estimate: right for an error that grows with the length (a
  // multiplicative bias, or a prior that regresses to the mean).
  kRatio,
};

// BoundCalibration::kRatio: octaves of the estimate, and the fewest
// completions a group of octaves must hold to get its own ratio.
inline constexpr int kCalibrationOctaves = 32;
inline constexpr int kCalibrationMinGroup = 64;

// Configuration of a CountdownScheduler. All fields are validated by
// Validate(); CountdownScheduler::Create rejects invalid options.
struct SchedulerOptions {
  // Decode slots per step used by Select() without an argument.
  // Default: 64
  int slots = 64;

  // Consecutive steps without a slot after which a request is promoted ahead
  // of all others. 0 disables the cap.
  // Default: 128
  int waiting_cap = 128;

  // Exponential aging: priority = remaining * exp(-aging_rate *
  // steps_waited). Must be finite and >= 0; 0 disables aging.
  // Default: 0
  double aging_rate = 0;

  // Lower bound of remaining = max(L̂ − generated, remaining_floor), so a
  // request that outlives its prediction keeps a positive priority and
  // requests past their prediction are served FCFS. Finite, >= 0.
  // Default: 1
  double remaining_floor = 1;

  // Placement of requests without a prediction; see UnpredictedPolicy.
  // Default: kMedian
  UnpredictedPolicy unpredicted = UnpredictedPolicy::kMedian;

  // Remaining length assumed for unpredicted requests under kFixed, and under
  // kMedian while no live request is predicted. Finite, >= 0.
  // Default: 256
  double unpredicted_tokens = 256;

  // Order of the ranked tier and the tail bound; see SchedulingPolicy.
  // Default: kCountdown
  SchedulingPolicy policy = SchedulingPolicy::kCountdown;

  // kBounded: S, the latency a request may have, in steps since Add, as a
  // multiple of max(the latency the virtual FCFS system (same slots, same
  // estimates) gives it, the tail reference below). Finite, >= 1.
  // Default: 2.5
  double max_slowdown = 2.5;

  // kBounded: the tail reference Q is the `tail_quantile` order statistic
  // (index floor(q * (m - 1)) of the m sorted values) of the virtual FCFS
  // latencies of the last `tail_window` requests before this one; a request
  // may take S x max(its own virtual latency, Q). With tail_window = 0 the
  // reference is off (every request's bound is its own). The reference is
  // what a P99 target is judged against: a request FCFS would serve quickly
  // may wait up to S x the recent FCFS P99, a request in FCFS's own tail up
  // to S x its FCFS latency. tail_window in [0, 1 << 20], tail_quantile in
  // [0, 1]. Defaults: 1000, 0.99
  int tail_window = 1000;
  double tail_quantile = 0.99;

  // kBounded: a latency target in seconds of the engine's clock (SetTime).
  // When > 0, every request's deadline is its origin (the clock at Add; for
  // a request added with a CarriedDeadline, the first stage's) plus
  // latency_target_s, the same for every request, instead of S x its
  // virtual FCFS latency (max_slowdown, tail_window and tail_quantile are
  // then unused), and the urgency test is in seconds: now + work left x
  // step_s > origin + s x latency_target_s - step_s (now and step_s from the
  // latest SetTime; s = target_scale(), 1 unless target_quantile's
  // controller is in debt). Urgent requests, all with the same target, are
  // then served in arrival order. 0 = the slowdown bound, in steps. Unused by other policies.
  // Finite, >= 0.
  // Default: 0
  double latency_target_s = 0;

  // kBounded with latency_target_s > 0: the share of requests that may give
  // up their deadline (docs/SCHEDULING.md, "The latency target"). A request
  // that turns urgent for the first time (under target_quantile's reading
  // of the deadline) gives it up, and is ranked as if
  // it had no deadline from then on, when its work left is at least
  // kTailBudgetMinWork times the mean length of the completions in the
  // calibration window and fewer than floor(tail_budget x
  // min(tail_budget_window, requests added)) deadlines were given up while
  // the last tail_budget_window requests were added (a rate). A P99 target
  // tolerates 1% of requests beyond it; giving up the rescue of a few long
  // ones keeps it from pushing many shorter requests past the target. A
  // request that gave up is bounded only by the waiting cap (and aging), if
  // any. Needs reported completions (ObserveCompletion, calibration_window
  // > 0) for the mean; without them nobody gives up. With two stages each
  // has this budget, and a request carried in given up counts against the
  // receiving stage's (unless it gave it up against a credit: see
  // give_up_reserve). In [0, 0.5]; 0 = none given up against the budget
  // (give_up_reserve may still give some up against credits).
  // Default: 0.005
  double tail_budget = 0.005;

  // kBounded with latency_target_s > 0: q, the share of requests the
  // controller keeps within the target (ObserveLatency): when more than
  // 1 - q of the reported latencies exceed latency_target_s, beyond what
  // the last tail_budget_window requests' allowance banked, the urgency
  // test tightens (deadline origin + s x latency_target_s, s down to
  // kTargetMinScale); when fewer do, s returns to 1. The deadlines never
  // move past the target itself. Requests that gave up their deadline
  // (tail_budget, give_up_reserve) count like any other. In [0, 1); 0 = no
  // controller (s = 1).
  // Default: 0.99
  double target_quantile = 0.99;

  // kBounded with latency_target_s > 0 and target_quantile q > 0: once
  // tail_budget is spent, a request that would give up its deadline (the
  // same test: turning urgent for the first time with at least
  // kTailBudgetMinWork x the mean left) still gives it up, against one of
  // the controller's credits, while the credits c minus those set aside
  // (one per live request that gave up this way) minus its own stay at or
  // above give_up_reserve x the bank ((1 - q) x tail_budget_window). Its
  // credit stays set aside while it is live in this stage (released at
  // Remove; its latency, once reported, costs 1 if beyond the target like
  // any other). A miss chosen here is known when it is chosen, unlike the
  // misses the controller learns of at completion, so it is spent only
  // from a bank well filled by requests that finished within the target;
  // the set-aside credits do not move c or the scale. Since c never exceeds
  // the bank, a stage gives none up this way while floor((1 -
  // give_up_reserve) x the bank) credits are set aside (50 at the
  // defaults), however high c is. A request carried
  // into another stage (Carry, Add(id, carried)) holds one of that stage's
  // credits there (CarriedDeadline::holds_credit). In [0, 1]; 1 = none
  // beyond tail_budget.
  // Default: 0.5
  double give_up_reserve = 0.5;

  // The window of tail_budget, in requests added: the period over which an
  // operator's P99 is judged (a short window spreads the budget thin across
  // a burst; an endless one would let a long quiet period bank it). Also
  // sets target_quantile's bank: at most (1 - q) x tail_budget_window
  // credits. In [1, 1 << 24]. Default: 10000
  int tail_budget_window = 10000;

  // kBounded: the ranked tier (requests whose deadline is not at risk) is
  // ordered by remaining - bounded_linear_aging * waited (linear aging)
  // instead of the countdown; 0 = the countdown. Finite, >= 0.
  // Default: 0
  double bounded_linear_aging = 0;

  // kBounded: the service estimates the bound uses (each new request's job
  // in the virtual FCFS system, the first prediction's correction of it, and
  // the work left in the urgency test) are the ranking estimate x plus a
  // correction delta learned from completions (ObserveCompletion): delta =
  // the mean of (actual - estimate) over the last `calibration_window`
  // completions reported, so that the corrected estimates are unbiased for
  // the mean work of those completions (a prediction of sqrt(length)
  // squared underestimates the mean length by Var(sqrt(length)); delta
  // estimates that term). A job is max(1, x + delta); the work left in the
  // urgency test max(0, remaining + delta). With no completion reported, or
  // calibration_window = 0, delta = 0 (the estimates as ranked). In
  // [0, 1 << 20]. Default: 1000
  int calibration_window = 1000;

  // kBounded: the form of that correction (see BoundCalibration): with
  // kRatio a job is max(1, x' * ratio(x)) and the work left of a request
  // with estimate x that generated g tokens max(0, x' * ratio(x) - g,
  // remaining_floor * ratio(x)) (kAdditive: max(0, remaining + delta)).
  // Default: kAdditive
  BoundCalibration calibration = BoundCalibration::kAdditive;

  // kLinearAging: tokens of priority gained per step waited. Finite, >= 0.
  // Default: 1
  double linear_aging = 1;

  // OK, or kInvalidArgument naming the first bad field and its value.
  absl::Status Validate() const;
};

// "countdown", "bounded", "hrrn", "linear-aging".
absl::string_view SchedulingPolicyName(SchedulingPolicy policy);

// "additive", "ratio".
absl::string_view BoundCalibrationName(BoundCalibration calibration);

// A snapshot of one live request.
struct RequestStats {
  // L̂, absent until SetPrediction or Rescore.
  std::optional<double> predicted_tokens;
  // The prior given by SetPrior (used while predicted_tokens is absent).
  std::optional<double> prior_tokens;
  // Decode steps in which the request held a slot.
  int64_t generated = 0;
  // Consecutive steps without a slot, up to now (0 right after a slot).
  int64_t steps_waited = 0;
  // Position in arrival order (0 for the first request ever added).
  uint64_t arrival = 0;
  // Number of SetPrediction/Rescore calls that changed L̂.
  int64_t predictions = 0;
  // Steps (Select/Commit calls) before the request was added.
  int64_t added_step = 0;
  // kBounded: the point its deadline counts from: added_step, or earlier for
  // a request added with a CarriedDeadline (coming step - age); with
  // latency_target_s > 0 the clock (SetTime) at Add, in seconds.
  double deadline_origin = 0;
  // All steps without a slot since Add.
  int64_t waited_total = 0;
  // kBounded: the deadline in steps, or in seconds of SetTime's clock with
  // a latency target (absent before the request's first step, and under
  // other policies). With a latency target this is origin + the target;
  // the urgency test reads origin + target_scale() x the target.
  std::optional<double> deadline;
  // kBounded: it has been urgent (here, or with a latency target in an
  // earlier stage it was carried from).
  bool was_urgent = false;
  // It gave up its deadline (tail_budget, or against a credit:
  // give_up_reserve); it is never urgent again.
  bool gave_up = false;
  // It gave its deadline up against one of this stage's credits (here, or
  // carried in so), which stays set aside until its Remove.
  bool holds_credit = false;
};

// tail_budget: a request gives up its deadline only if its work left is at
// least this many times the mean length of the recent completions.
inline constexpr double kTailBudgetMinWork = 1;

// target_quantile's controller: the log of the scale per credit of debt,
// and the scale's floor.
inline constexpr double kTargetGain = 0.02;
inline constexpr double kTargetMinScale = 0.5;

// kBounded: where a live request stands against its deadline, relative to the
// scheduler's coming step, so that a second scheduler (the next stage of the
// same engine: admission, then decode) keeps one deadline from the request's
// first step in the first stage (CountdownScheduler::Carry and Add).
// With latency_target_s > 0 only `age` (in seconds of SetTime's clock) and
// the two flags are used, and Carry returns the virtual fields as 0.
struct CarriedDeadline {
  // Steps (seconds with a latency target) from its first step in the first
  // stage to the coming step.
  double age = 0;
  // Its virtual FCFS finish minus the coming step (may be negative).
  double virtual_left = 0;
  // The estimate its virtual FCFS job was placed with, and the tail
  // reference Q it entered with.
  double virtual_estimate = 0;
  double tail_reference = 0;
  // Whether it has been urgent (only the first time may it give its
  // deadline up), whether it gave up its deadline (tail_budget or
  // give_up_reserve), and whether against a credit (give_up_reserve; only
  // with gave_up), in the first stage. The receiving stage sets one of its
  // own credits aside for a request carried in with holds_credit (when it
  // runs the controller, target_quantile > 0; else, like one given up
  // against the budget, it counts against its tail budget).
  bool was_urgent = false;
  bool gave_up = false;
  bool holds_credit = false;
};

// Monotonic counters since creation (for metrics).
struct SchedulerCounters {
  // Select calls.
  int64_t steps = 0;
  // Slots handed out (sum of the sizes of all selections).
  int64_t selections = 0;
  // Selections of requests that had reached the waiting cap.
  int64_t cap_promotions = 0;
  // Selections that aging decided: requests chosen that would not have been
  // chosen for the same slots had aging_rate been 0 (always 0 without aging).
  int64_t aging_promotions = 0;
  // Largest steps_waited any request has reached.
  int64_t max_steps_waited = 0;
  // kBounded: selections of urgent requests (Select only).
  int64_t urgent_selections = 0;
  // kBounded: requests that gave up their deadline (tail_budget, and
  // give_up_reserve's), and of those the ones that gave it up against a
  // credit (give_up_reserve).
  int64_t deadlines_given_up = 0;
  int64_t credit_give_ups = 0;
  // kBounded with a latency target and target_quantile > 0: latencies
  // reported (ObserveLatency), and those beyond the target.
  int64_t latencies_observed = 0;
  int64_t latencies_beyond_target = 0;
  // Add calls that succeeded / Remove calls that succeeded.
  int64_t added = 0;
  int64_t removed = 0;
};

// The engine-side countdown scheduler. Not thread-safe: owned and called only
// by the engine's step loop (see the file comment).
class CountdownScheduler {
 public:
  // A scheduler with `options`, or kInvalidArgument from options.Validate().
  static absl::StatusOr<CountdownScheduler> Create(SchedulerOptions options);

  CountdownScheduler(CountdownScheduler&&) = default;
  CountdownScheduler& operator=(CountdownScheduler&&) = default;

  // Makes `request_id` live, without a prediction, generated = 0, at the end
  // of the arrival order. kAlreadyExists if it is live already (an id may be
  // reused after Remove; it then counts as a new arrival).
  absl::Status Add(absl::string_view request_id);

  // Add, for a request that comes from another stage with its deadline
  // (kBounded; docs/SCHEDULING.md, "One deadline from arrival"): its deadline
  // is origin + S * max(virtual finish - origin, Q, 1) with origin = the
  // coming step - carried.age and virtual finish = the coming step +
  // carried.virtual_left, fixed now (it does not enter this scheduler's
  // virtual FCFS system nor its tail window), and its first prediction
  // corrects it as for any request. Under other policies the carried state is
  // ignored (a plain Add). kInvalidArgument for a non-finite field, a negative
  // age or a negative estimate; else as Add.
  absl::Status Add(absl::string_view request_id,
                   const CarriedDeadline& carried);

  // The carried state of a live request that has a deadline, for Add on the
  // next stage's scheduler. kNotFound for an unknown id, kFailedPrecondition
  // when it has no deadline (not kBounded, or before its first step).
  absl::StatusOr<CarriedDeadline> Carry(absl::string_view request_id) const;

  // Sets the first prediction L̂ (in tokens). kNotFound for an unknown id,
  // kInvalidArgument for a non-finite or negative value, kFailedPrecondition
  // if the request already has a prediction (a newer L̂ goes through Rescore;
  // this also drops a late initial prediction that a publish overtook).
  absl::Status SetPrediction(absl::string_view request_id,
                             double predicted_tokens);

  // Replaces L̂ after a readout publish; generated tokens are kept, so the
  // countdown continues from the new L̂. Also accepted as the first prediction
  // of a request that has none. Errors as SetPrediction, except that it never
  // returns kFailedPrecondition.
  absl::Status Rescore(absl::string_view request_id, double predicted_tokens);

  // A length prior known before prefill (docs/SCHEDULING.md, "Length-aware
  // admission"): until the request's first prediction it is ranked as if
  // predicted with L̂ = prior_tokens, under every UnpredictedPolicy, and a
  // deadline fixed meanwhile is placed with it (the first prediction corrects
  // it as for the unpredicted estimate). It does not count as a prediction
  // (predictions stays 0) and is not part of the median of kMedian. Ignored
  // once the request is predicted; a later SetPrior replaces an earlier one.
  // Errors as SetPrediction, never kFailedPrecondition.
  absl::Status SetPrior(absl::string_view request_id, double prior_tokens);

  // Forgets a finished or cancelled request. kNotFound for an unknown id.
  absl::Status Remove(absl::string_view request_id);

  // kBounded: a finished request's length, for the bound's correction
  // (SchedulerOptions::calibration_window): `estimate_tokens`, what this
  // scheduler ranked it by when its deadline was placed (its prediction, or
  // its prior, or the value the caller placed it with), and `actual_tokens`,
  // the output it produced. Keyed by value, not by id, so a stage that hands
  // requests on before they finish (admission) can be told later. Report
  // natural completions only (a cancelled request's length says nothing).
  // Under other policies, or with calibration_window = 0, ignored.
  // kInvalidArgument for a non-finite or negative value.
  absl::Status ObserveCompletion(double estimate_tokens, double actual_tokens);

  // The bound's current additive correction delta in tokens (0 before any
  // reported completion, and under BoundCalibration::kRatio).
  double service_correction();

  // BoundCalibration::kRatio: the factor the bound applies to an estimate
  // of `estimate_tokens` (1 before any reported completion, and under
  // kAdditive).
  double service_ratio(double estimate_tokens);

  // Decides one decode step and commits it: returns up to `slots` live
  // request ids (all of them when fewer are live), in priority order. The
  // returned requests get generated += 1 and steps_waited = 0; every other
  // live request gets steps_waited += 1. `slots` <= 0 selects nobody (every
  // request waits). Deciding and committing are one call so the two cannot
  // drift apart; an engine that could not run a selected request should
  // Remove it (or accept that it was counted).
  std::vector<std::string> Select(int slots);

  // Select(options().slots).
  std::vector<std::string> Select() { return Select(options_.slots); }

  // For engines that do not hand out slots (every admitted request decodes
  // each step, as in vLLM): the first `k` live requests of the coming step in
  // the order Select would use (all when k >= size()), without committing
  // the step. Like Select it decides for every live request what a step
  // decides once: deadlines of new requests are fixed here, and with a
  // latency target a request at risk is marked urgent or gives up its
  // deadline (tail_budget, give_up_reserve); a second Order, OrderAmong or Select at the same
  // clock decides nothing new.
  std::vector<std::string> Order(size_t k);

  // The live requests `ids` in the coming step's order (the relative order
  // Order would give them), without committing the step (the decisions of
  // Order above are taken for every live request): O(n + m log m).
  // kNotFound for an id that is not live, kInvalidArgument for a repeat.
  absl::StatusOr<std::vector<std::string>> OrderAmong(
      const std::vector<std::string>& ids);

  // Commits one step in which the requests `ran` held a slot (generated += 1,
  // steps_waited = 0) and every other live request waited; the same state
  // change as Select's. kNotFound for an id that is not live (nothing is
  // committed then), kInvalidArgument for a repeated id.
  absl::Status Commit(const std::vector<std::string>& ran);

  // kBounded with latency_target_s > 0: the engine's clock, in seconds (any
  // origin, monotonic; the same clock for every stage), and how long a
  // decode step takes now (the engine's own estimate, e.g. a moving average
  // of its last steps), for the urgency test. Call it before every Select,
  // Order or OrderAmong, and before Add at a request's arrival (its deadline
  // counts from the clock at Add); until the first call the clock reads 0
  // and a step takes 0 s, so nobody turns urgent. Under every other
  // configuration the values are kept and unused. kInvalidArgument for a
  // non-finite value, step_s < 0, or now_s below the previous call's
  // (nothing changes then).
  absl::Status SetTime(double now_s, double step_s);

  // kBounded with latency_target_s > 0 and target_quantile q > 0: a
  // finished request's latency from arrival (seconds of SetTime's clock),
  // for the target's controller (docs/SCHEDULING.md, "Holding the target"):
  // each report earns 1 - q credits (at most (1 - q) x tail_budget_window
  // banked) and one beyond latency_target_s costs 1; while the credits c
  // are negative the urgency test reads the deadline as origin + s x
  // latency_target_s, s = exp(kTargetGain x c) >= kTargetMinScale (c is
  // kept >= log(kTargetMinScale) / kTargetGain), else s = 1. In a steady
  // overload the debt stops moving exactly when a share 1 - q of the
  // requests ends beyond the target, unless s reaches its floor first (an
  // overload no urgency test can absorb); a burst first spends the banked
  // credits. From the floor s is back at 1 after about
  // -log(kTargetMinScale) / kTargetGain / (1 - q) reports within the target
  // (3,466 at q = 0.99). Report natural completions only, once each (each stage that
  // is told keeps its own credits). Ignored under other configurations.
  // kInvalidArgument for a non-finite or negative value.
  absl::Status ObserveLatency(double latency_s);

  // The controller's factor s on latency_target_s in the urgency test (1
  // while the credits are not negative), and its credits (0 at creation).
  double target_scale() const { return target_scale_; }
  double target_credits() const { return target_credits_; }
  // give_up_reserve: the credits set aside by live requests that gave their
  // deadline up against one.
  int64_t credits_set_aside() const { return credits_set_aside_; }

  // Commits `steps` empty steps at once while no request is live: exactly
  // what `steps` calls of Commit({}) would do then (the step count moves,
  // nothing else: the virtual FCFS system's free times are absolute, so it
  // drains by itself), in O(1). For an idle engine that passes a gap in
  // empty steps (docs/SCHEDULING.md, "One deadline from arrival").
  // kFailedPrecondition while a request is live, kInvalidArgument for
  // steps < 0.
  absl::Status CommitIdle(int64_t steps);

  // Number of live requests.
  size_t size() const { return live_.size(); }

  // A snapshot of a live request, or kNotFound.
  absl::StatusOr<RequestStats> GetRequest(absl::string_view request_id) const;

  // Counters since creation.
  const SchedulerCounters& counters() const { return counters_; }

  // True when aging_rate > 0 (a gauge for metrics).
  bool aging_enabled() const { return options_.aging_rate > 0; }

  // The options the scheduler was created with.
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Request {
    std::string id;
    std::optional<double> predicted_tokens;
    std::optional<double> prior_tokens;
    int64_t generated = 0;
    int64_t steps_waited = 0;
    uint64_t arrival = 0;
    int64_t predictions = 0;
    int64_t added_step = 0;
    int64_t waited_total = 0;
    std::optional<double> deadline;
    // kBounded: the step its deadline counts from (added_step, or earlier
    // for a request carried from another stage), the estimate and finish
    // of its virtual FCFS job, and the tail reference Q when it entered.
    double origin = 0;
    double virtual_estimate = 0;
    double virtual_finish = 0;
    double tail_reference = 0;
    bool was_urgent = false;
    bool gave_up = false;
    // Gave its deadline up against a credit (give_up_reserve), set aside
    // until Remove.
    bool holds_credit = false;
  };
  // Sort key of one live request for one step; compared lexicographically
  // on (tier, priority, arrival).
  struct Candidate {
    int tier = 0;
    double priority = 0;
    uint64_t arrival = 0;
    double remaining = 0;  // un-aged, for counting aging promotions
    uint32_t index = 0;    // into live_
  };

  explicit CountdownScheduler(SchedulerOptions options) : options_(options) {}

  absl::Status SetPredictionImpl(absl::string_view request_id, double value,
                                 bool first_only);
  double Remaining(const Request& r) const;
  // kBounded's clock: seconds (SetTime) under a latency target, else steps;
  // and the clock time of one decode step (seconds, or 1 step).
  bool Targeted() const { return options_.latency_target_s > 0; }
  double Now() const {
    return Targeted() ? time_now_ : static_cast<double>(counters_.steps);
  }
  double StepTime() const { return Targeted() ? time_step_ : 1.0; }
  // The deadline of the urgency test (after AssignDeadlines): with a
  // latency target origin + target_scale_ x the target, else the deadline.
  double EffectiveDeadline(const Request& r) const {
    return Targeted() ? r.origin + target_scale_ * options_.latency_target_s
                      : *r.deadline;
  }
  // Prediction, else prior: the L̂ the request is ranked by, if any.
  static std::optional<double> Estimate(const Request& r) {
    return r.predicted_tokens.has_value() ? r.predicted_tokens
                                          : r.prior_tokens;
  }
  double UnpredictedRemaining();
  int64_t CountAgingPromotions(size_t k);
  // Fills candidates_ for the coming step (assigning new deadlines first)
  // and puts the k smallest first, sorted.
  void Rank(size_t k);
  // Marks the live requests `ids` in selected_ (the others 0): NOT_FOUND
  // for an id not live, INVALID_ARGUMENT for one listed twice.
  absl::Status MarkSelected(const std::vector<std::string>& ids);
  // The state change of one step; selected_[i] marks live_[i] as chosen.
  void CommitSelected();
  void AssignDeadlines(double unpredicted_remaining);
  // tail_budget: drops the window's expired events, then whether one more
  // deadline may be given up now (fewer than floor(tail_budget x
  // min(tail_budget_window, added)) were given up, here or in an earlier
  // stage, while the last tail_budget_window requests were added).
  bool BudgetLeft();
  // tail_budget: drops the events older than the window.
  void PruneBudgetWindow();
  // Recomputes the correction from the window when a report came since.
  void Calibrate();
  // The bound's work left (before its clamp) of a request ranked by
  // `total` (prediction or prior; nullopt: unpredicted, placed at
  // `unpredicted_remaining`) that generated `generated` tokens: kAdditive
  // max(total - generated, floor) + delta (unpredicted: u + delta), kRatio
  // max(x' * ratio - generated, floor * ratio) (unpredicted: u' * ratio).
  // Calibrate() first.
  double BoundWork(std::optional<double> total, int64_t generated,
                   double unpredicted_remaining) const;
  // kRatio: the ratio for an estimate (after Calibrate()).
  double RatioFor(double x) const;

  SchedulerOptions options_;
  // Live requests, unordered (swap-remove); index_ maps id to position.
  std::vector<Request> live_;
  absl::flat_hash_map<std::string, size_t> index_;
  uint64_t next_arrival_ = 0;
  SchedulerCounters counters_;
  // Scratch buffers reused across steps.
  std::vector<Candidate> candidates_;
  std::vector<double> scratch_;
  std::vector<std::pair<double, uint64_t>> raw_keys_;
  std::vector<char> selected_;
  // kBounded: free times of the busy servers of the virtual FCFS system
  // (min-heap, at most `slots` entries).
  std::vector<double> virtual_free_;
  // SetTime: the engine's clock and step duration, in seconds, and whether
  // it was called (the first call may set any finite clock).
  double time_now_ = 0;
  double time_step_ = 0;
  bool has_time_ = false;
  // ObserveLatency: the credits and the factor on latency_target_s in the
  // urgency test.
  double target_credits_ = 0;
  double target_scale_ = 1;
  // give_up_reserve: credits set aside (live requests with holds_credit).
  int64_t credits_set_aside_ = 0;
  // tail_budget: the arrival count (next_arrival_) at each deadline given up
  // (or carried in given up) within the last tail_budget_window arrivals,
  // oldest first.
  std::deque<uint64_t> gave_up_;
  std::vector<size_t> giving_up_;  // scratch
  // Rank (kBounded): each live request's work left and urgency test.
  std::vector<double> work_left_;
  std::vector<char> at_risk_;
  // The mean actual length of the calibration window's completions (0
  // without any: the tail budget then gives nothing up).
  double mean_actual_ = 0;
  std::vector<size_t> new_requests_;
  // Virtual FCFS latencies of the last tail_window requests (a ring).
  std::vector<double> recent_latency_;
  size_t recent_next_ = 0;
  // kBounded: (estimate, actual) of the last calibration_window reported
  // completions (a ring, oldest at samples_next_ once full); the additive
  // correction (mean of actual - estimate) or the ratio of each octave,
  // recomputed, summing oldest first, when stale.
  std::vector<std::pair<double, double>> samples_;
  size_t samples_next_ = 0;
  double correction_ = 0;
  std::vector<double> octave_ratio_;
  bool correction_stale_ = false;
};

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_SCHEDULER_H_
