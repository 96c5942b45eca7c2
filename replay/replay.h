// `leapctl replay`: latency after scheduling, on a request trace, for
// first-come-first-served, the oracle, LEAP (frozen and with online RLS,
// through a real leapd and the engine shim) and a family of learned
// predictors with a given ranking quality and GPU cost.
//
// A run: read (or synthesize) the trace; measure the engine's capacity
// under FCFS; for each load factor place the arrivals (Poisson at load x
// capacity, or the trace's timestamps rescaled to it); for each policy
// simulate the engine (engine_model.h) and compute the paper's metrics. LEAP
// policies need features: every request gets synthetic hidden states
// conditioned on its true output length and its domain (SynthGenerator), the
// domain switching at --shift-at; the readout is a ridge fit on synthetic
// source-domain requests (or --readout), served by leapd frozen ("leap") or
// adapting from completions ("leap-rls"), each run on a fresh copy.
#ifndef LEAP_REPLAY_REPLAY_H_
#define LEAP_REPLAY_REPLAY_H_

#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/progress.h"
#include "replay/engine_model.h"
#include "replay/trace.h"

namespace leap::replay {

// One scheduling policy of a replay.
struct PolicySpec {
  enum class Kind { kFcfs, kOracle, kLeap, kLeapRls, kLearned };
  Kind kind = Kind::kFcfs;
  // As printed and written to JSON: "fcfs", "oracle", "leap", "leap-rls",
  // a preset name ("ltr") or "learned:rho=R,cost=Cms[,shift_rho=S]".
  std::string name;
  // kLearned: Spearman of the predictions with the true lengths, before and
  // after a domain shift, and GPU milliseconds per prediction.
  double rho = 0;
  std::optional<double> shift_rho;
  double cost_ms = 0;
  // The scheduling discipline ("+bounded=S", "+hrrn", "+aging=A",
  // "+countdown" after the predictor's name; default: the countdown with
  // --waiting-cap and --aging-rate), and its knob (S or A).
  shim::SchedulingPolicy discipline = shim::SchedulingPolicy::kCountdown;
  double knob = 0;
  bool has_discipline = false;
  // "+bounded-ratio[=S]": kBounded with BoundCalibration::kRatio (the
  // bound's estimates corrected by a ratio per octave of the estimate
  // instead of the mean error).
  bool ratio_calibration = false;
  // "+bounded[=S],aging=A" (also after "+bounded-ratio"): this policy's
  // SchedulerOptions::bounded_linear_aging (the ranked tier ordered by
  // remaining - A * steps waited); unset = --bounded-aging.
  std::optional<double> bounded_aging;
  // "+target=X": kBounded with a latency target
  // (SchedulerOptions::latency_target_s) of X times FCFS's P99 latency at
  // the same load (fcfs must be listed before it); `knob` is X.
  bool latency_target = false;
  // "+prior" at the end of the name: length-aware admission, the waiting
  // requests ordered by a prior learned online from completions (prompt
  // length per product line, sidecar/core/length_prior.h).
  bool prior_admission = false;
  // The predictor's part of the name ("leap" in "leap+bounded=2").
  std::string predictor;
};

// Default knob of "+bounded" (S) and "+aging" (tokens per step waited).
inline constexpr double kDefaultSlowdown = 2.5;
// Default knob of "+target" (X: the latency target over FCFS's P99).
inline constexpr double kDefaultTarget = 1.45;
inline constexpr double kDefaultLinearAging = 1;

// A named learned-predictor baseline resembling one of the paper's
// separate predictors. The numbers are assumptions (see README, "Replay
// evaluation"): `basis` says where they come from.
struct LearnedPreset {
  std::string name;
  double rho = 0;
  double shift_rho = 0;
  double cost_ms = 0;
  std::string basis;
};
const std::vector<LearnedPreset>& LearnedPresets();

// Parses a comma-separated policy list: fcfs, oracle, leap, leap-rls,
// presets (tie, ssjf, ltr, trail, egtp), "baselines" (all presets) and
// learned:rho=R,cost=Cms[,shift_rho=S] (its own commas are understood), each
// but fcfs optionally followed by a discipline: +bounded[=S] (S >= 1),
// +hrrn, +aging[=A] (linear, A >= 0 tokens per step waited), +countdown,
// and after it (or alone) +prior (length-aware admission).
// InvalidArgument for an unknown name, a bad parameter or a repeat.
absl::StatusOr<std::vector<PolicySpec>> ParsePolicies(absl::string_view list);

// Inputs of `leapctl replay`.
struct ReplayOptions {
  // Trace file; empty = synthetic trace.
  std::string trace_path;
  TraceFormat format = TraceFormat::kAuto;
  // Lengths of the requests after the shift come from this trace (first
  // rows) instead of --trace. Needs shift_at. Arrivals are then Poisson.
  std::string shift_trace_path;
  TraceFormat shift_format = TraceFormat::kAuto;
  // Requests to replay: synthetic trace size, or the first N of the trace.
  // 0 = 4000 (synthetic) or every row (trace).
  int64_t requests = 0;
  // Arrival rate (requests/s) for traces without timestamps when no load is
  // given.
  std::optional<double> rate;
  // Load factors relative to the FCFS capacity; empty = the trace's own
  // timestamps (or --rate), else 1.0.
  std::vector<double> loads;
  std::vector<PolicySpec> policies;

  // Domain of the traffic before the shift (built-in synthetic domain).
  // Default: chat
  std::string domain = "chat";
  // Fraction of the requests (in trace order) after which the domain
  // switches to shift_to, in [0, 1); 0 = every replayed request is in the
  // shifted domain (the readout is still fitted on `domain`). Unset = no
  // shift.
  std::optional<double> shift_at;
  // Default: translation
  std::string shift_to = "translation";

  // Feature width of the synthetic hidden states. Default: 256
  int64_t dim = 256;
  // Rows of the on-the-fly source readout. Default: 4000
  int64_t train_rows = 4000;
  // A .leapr artifact to serve instead (its d must equal dim, and it must
  // have been trained on features of the same synthetic model: --model-seed).
  std::string readout_path;
  // Seed of the synthetic serving model (as `leapctl synth --model-seed`).
  // Default: 7
  uint64_t model_seed = 7;
  // Seed of everything drawn per run (trace, arrivals, features, baselines).
  // Default: 1
  uint64_t seed = 1;

  EngineOptions engine;
  // Print the trade-off table (gain captured vs P99 ratio to FCFS) and, with
  // tradeoff_plot_path, plot it (one series per predictor+discipline, one
  // point per knob value). Needs fcfs and oracle among the policies.
  std::string tradeoff_plot_path;
  // With P and P+prior among the policies (and fcfs, oracle): plot, per
  // load, each such P's share of the oracle's gain with FCFS admission and
  // with length-aware admission side by side, the P99 ratios on the bars.
  std::string admission_plot_path;
  // Output budget M: longer outputs are cut to M. Default: 2048
  int64_t max_tokens = 2048;
  // Scheduler of every length-aware policy (FCFS runs with the cap off).
  // Defaults: 128, 0, median
  int64_t waiting_cap = 128;
  double aging_rate = 0;
  std::string unpredicted = "median";
  // Linear aging (tokens per step waited) of the ranked tier of every
  // +bounded and +target policy (SchedulerOptions::bounded_linear_aging).
  // Default: 0
  double bounded_aging = 0;
  // Completions (the last N) from which every +bounded and +target policy
  // learns the correction of its estimates (the mean error; the ratio per
  // octave for +bounded-ratio and +target)
  // (SchedulerOptions::calibration_window); 0 = the estimates as ranked.
  // Default: 1000
  int64_t bound_calibration = 1000;
  // Every +target policy's SchedulerOptions::tail_budget. Default: 0.005
  double tail_budget = 0.005;
  // Every +target policy's SchedulerOptions::target_quantile (the engines
  // report each completion's latency, ObserveLatency). Default: 0.99
  double target_quantile = 0.99;
  // Every +target policy's SchedulerOptions::give_up_reserve. Default: 0.5
  double give_up_reserve = 0.5;
  // LEAP policies: charge every prediction this latency (s) on the
  // simulated timeline instead of the one measured from Submit to the
  // prediction (LeapPredictorOptions::charged_latency_s); the runs of a
  // frozen readout are then repeatable. In [0, 60]; unset = measured.
  std::optional<double> prediction_latency_s;

  // leapd: this binary (default: FindLeapd()) started for the run, or a
  // running one at `server`.
  std::string leapd_path;
  std::string server;
  // Embedded RocksDB directory for the leapd this run starts ("" = memory).
  std::string leapd_data_dir;
  // Seconds to wait for leapd to start and for each admin answer.
  // Default: 30
  double timeout_s = 30;

  // Metrics cover requests whose index in the trace is >= metrics_from * n.
  // Default: 0
  double metrics_from = 0;
  std::string json_path;
  std::string plot_path;
  // Per-request results of every run as CSV (FormatRequestsCsvHeader and
  // AppendRequestsCsv), "" = none.
  std::string requests_csv_path;

  // InvalidArgument (a usage error) for values out of range.
  absl::Status Validate() const;
};

// One policy at one load.
struct ReplayRow {
  std::string policy;
  double load = 0;
  // Over the metrics window, and over the requests after the shift.
  Metrics metrics;
  std::optional<Metrics> after_shift;
  // LEAP only: measured prediction latency (s) percentiles, predictions not
  // known by the first step after prefill, per-request errors, the highest
  // readout version used (1 + RLS publishes) and rescores received.
  std::optional<double> latency_p50;
  std::optional<double> latency_p99;
  int64_t late = 0;
  int64_t errors = 0;
  int64_t max_version = 0;
  int64_t rescores = 0;
  // With prediction_latency_s: predictions due that missed the wait
  // (LeapPredictorOptions::max_wait, 2 s; LeapPredictor::wait_timeouts); the
  // run then does not repeat.
  int64_t wait_timeouts = 0;
  // Reused the predictions (and measured latencies) of the run's first
  // frozen LEAP arm instead of asking leapd again.
  bool reused_predictions = false;
  // kVllm: preemptions and recomputed tokens; kBounded: urgent selections.
  int64_t preemptions = 0;
  int64_t recomputed_tokens = 0;
  int64_t urgent_selections = 0;
  // Deadlines given up (SchedulerOptions::tail_budget, give_up_reserve): in
  // decode, and in the admission queue (slots engine); and of all those the
  // ones given up against the controller's credits (give_up_reserve).
  int64_t deadlines_given_up = 0;
  int64_t queue_deadlines_given_up = 0;
  int64_t credit_give_ups = 0;
  double seconds = 0;
};

struct ReplayReport {
  std::string trace;  // what was replayed, one line
  int64_t requests = 0;
  int64_t shift_index = -1;  // first request after the shift; -1 = none
  int64_t clipped = 0;       // outputs cut to max_tokens
  // FCFS capacity, requests/s (per segment when arrivals are Poisson and
  // there is a shift; capacity_after is then set).
  double capacity = 0;
  std::optional<double> capacity_after;
  std::vector<ReplayRow> rows;
  std::vector<PolicySpec> policies;
  std::string plot_written;  // actual plot path ("" when none)
  std::string tradeoff_plot_written;
  std::string admission_plot_written;
  EngineKind engine = EngineKind::kSlots;
  // vllm: EngineOptions::preempt_latest_admitted of the run.
  bool preempt_latest_admitted = true;
  // ReplayOptions::prediction_latency_s (unset: measured latencies charged).
  std::optional<double> prediction_latency_s;
};

// Runs the replay. Progress goes to `progress` (stderr in the CLI).
absl::StatusOr<ReplayReport> RunReplay(const ReplayOptions& options,
                                       const ProgressFn& progress);

// The table printed on stdout.
std::string FormatReplayTable(const ReplayReport& report);
// Per load, every policy's share of the oracle's mean-PTL gain over FCFS,
// (PTL_fcfs - PTL) / (PTL_fcfs - PTL_oracle), and its P99 latency and
// long-request P95 as ratios to FCFS's. Empty without fcfs and oracle rows.
struct TradeoffPoint {
  std::string policy;
  double load = 0;
  double gain = 0;
  double p99_ratio = 0;
  std::optional<double> long_p95_ratio;
};
std::vector<TradeoffPoint> Tradeoff(const ReplayReport& report);
std::string FormatTradeoffTable(const ReplayReport& report);
// Length-aware admission against FCFS admission: for every policy P+prior
// whose P ran too at the same load, both shares of the oracle's gain and
// both P99 ratios to FCFS (from Tradeoff), in row order.
struct AdmissionPoint {
  std::string policy;  // P (without "+prior")
  double load = 0;
  double gain_without = 0, gain_with = 0;
  double p99_without = 0, p99_with = 0;
};
std::vector<AdmissionPoint> Admission(const ReplayReport& report);
// "" when there is no pair.
std::string FormatAdmissionTable(const ReplayReport& report);
// SVG bars: per (P, load), the gain share with FCFS admission and with the
// prior side by side, each labelled with its P99 ratio to FCFS.
absl::StatusOr<std::string> WriteAdmissionPlot(const ReplayReport& report,
                                               const std::string& path);
// SVG: gain captured (y) vs P99 ratio to FCFS (x), one panel per load, one
// series per predictor+discipline (points joined in knob order).
absl::StatusOr<std::string> WriteTradeoffPlot(const ReplayReport& report,
                                              const std::string& path);
// A JSON array: one object per policy and load with exactly the keys
// policy, load, mean_ptl (s/token), p90_latency, p95_latency, p99_latency,
// window_p99_latency (the worst P99 over any 10,000 requests consecutive in
// arrival order; p99_latency with at most 10,000), mean_ttft (s), throughput (output tokens/s),
// long_p95_latency (s; null without requests over 1,024 tokens). NaN is
// null.
std::string FormatReplayJson(const ReplayReport& report);
// The per-request CSV (--requests-csv): a header line, then one line per
// request of every run, in run order then request id: policy, load, id,
// segment, arrival_s, prompt_tokens, output_tokens (as replayed, after the
// cut to max_tokens), predicted_tokens (the scheduler's first prediction;
// empty when none), first_token_s, completion_s, latency_s (completion -
// arrival), max_wait_steps, and, for +bounded and +target policies only
// (else empty), deadline_origin, deadline and completion on the deadlines'
// clock (steps, or seconds with a latency target; empty for a request done
// at prefill), urgent and gave_up (1 or 0: it turned urgent, it gave up its
// deadline under the tail budget or against a credit; 0 under other
// policies).
std::string FormatRequestsCsvHeader();
void AppendRequestsCsv(const std::string& policy, double load,
                       std::span<const SimRequest> requests,
                       const SimResult& sim, std::string* out);
// Writes the plot of mean PTL vs load (one line per policy): PNG through
// gnuplot when `path` ends in .png and gnuplot runs, else SVG written
// directly (a .png path then becomes .svg). Returns the path written.
absl::StatusOr<std::string> WriteReplayPlot(const ReplayReport& report,
                                            const std::string& path);

}  // namespace leap::replay

#endif  // LEAP_REPLAY_REPLAY_H_
