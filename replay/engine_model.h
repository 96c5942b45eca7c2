// The engine model of `leapctl replay`: a discrete-step LLM engine driven by
// a request trace, whose decode slots are assigned by the product's own
// CountdownScheduler (engine_shim/scheduler.h), plus the metrics of a run.
//
// Model. Time is simulated. Up to `resident` requests are in memory; each
// step decodes one token for each of at most `slots` of them (chosen by the
// scheduler) and prefills the prompts of requests newly admitted into free
// memory, first come first served (at most `max_prefill_tokens` prompt
// tokens per step, but always at least one request when memory is free).
// A step takes
//   step_base_ms + step_per_seq_ms * decode_batch
//     + prefill_per_token_ms * prefill_tokens
//     + gpu_ms_per_prediction * requests_predicted_on_the_GPU
// milliseconds. Prefill yields a request's first token (TTFT ends with the
// step that prefilled it); every later token takes one decode slot, so a
// request of L output tokens needs L - 1 decode slots (L = 0 counts as 1).
// Newly prefilled requests join the scheduler for the next step.
//
// Predictions. A Predictor sees the requests a step prefilled, with the
// simulated time their hidden state exists (the capture point: a fraction
// `capture_fraction` through that step's prefill), and before each step
// hands over the predictions known by then. Until a request's prediction is
// known the scheduler ranks it by its UnpredictedPolicy. Each new prediction
// goes through SetPrediction (or Rescore after a readout publish).
#ifndef LEAP_REPLAY_ENGINE_MODEL_H_
#define LEAP_REPLAY_ENGINE_MODEL_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine_shim/scheduler.h"

namespace leap::replay {

// One request as the engine sees it.
struct SimRequest {
  // Unique, 0..n-1 (the index into the run's request vector).
  int64_t id = 0;
  double arrival_s = 0;
  int64_t prompt_tokens = 0;
  // True output length (0 is treated as 1).
  int64_t output_tokens = 1;
  // 0 before a domain shift, 1 after.
  int segment = 0;
};

// Which engine the replay models.
enum class EngineKind {
  // The paper's setup (the file comment): `resident` requests in memory,
  // admitted FCFS, `slots` of them decoded per step, chosen by the scheduler.
  kSlots,
  // Shaped like vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py):
  // continuous batching, every running request advances each step, see
  // SimulateVllm.
  kVllm,
};

// The engine's shape and step-time model (see the file comment).
struct EngineOptions {
  // Default: kSlots
  EngineKind kind = EngineKind::kSlots;
  // Requests held in memory at once. Default: 512
  int resident = 512;
  // Decode slots per step. Default: 64
  int slots = 64;
  // Fixed cost of one step (weights read, launch overhead), ms.
  // Default: 12 (Qwen3-8B-class model on one datacenter GPU, eager mode)
  double step_base_ms = 12.0;
  // Extra cost per request decoded in the step (its KV cache read), ms.
  // Default: 0.12 (64 requests: 19.7 ms per step)
  double step_per_seq_ms = 0.12;
  // Prefill cost per prompt token, ms. Default: 0.05 (20,000 tokens/s)
  double prefill_per_token_ms = 0.05;
  // Prompt tokens prefilled in one step at most. Default: 16384
  int64_t max_prefill_tokens = 16384;
  // Fraction of a step's prefill done when the captured layer's hidden state
  // exists (layer 30 of Qwen3-8B's 36). In [0, 1]. Default: 30/36
  double capture_fraction = 30.0 / 36.0;

  // ---- kVllm only
  // Running requests at most (vLLM's max_num_seqs). Default: 256
  int max_num_seqs = 256;
  // Tokens scheduled per step at most, decode and prefill chunks together
  // (max_num_batched_tokens; prefills are chunked to fit). Default: 8192
  int64_t max_num_batched_tokens = 8192;
  // KV cache: blocks of block_size tokens. Defaults: 16 and 22000 (352k
  // tokens: Qwen3-8B's 144 KiB per token in ~50 GB of an 80 GB GPU).
  int block_size = 16;
  int64_t kv_blocks = 22000;
  // Order of the running requests, whose last is preempted when the cache
  // is full: true = admission order (vLLM's FCFS policy: the latest
  // admitted is the victim; the scheduler orders only the waiting queue:
  // the wiring docs/ENGINE_WIRING.md recommends), false = the scheduler's
  // order (vLLM's PRIORITY policy with the priority set from it: the
  // lowest-ranked is the victim). Default: true (false before December 5
  // 2026)
  bool preempt_latest_admitted = true;

  // InvalidArgument naming the first bad field.
  absl::Status Validate() const;
};

// A prediction the scheduler may use from the start of the next step.
struct PredictionUpdate {
  int64_t id = 0;
  double tokens = 0;
  // A new value after a readout publish (Rescore) rather than the first.
  bool rescore = false;
};

// Where a simulated run gets its predictions. Called from the simulation
// loop only (one thread).
class Predictor {
 public:
  virtual ~Predictor() = default;
  // GPU milliseconds added to a step for each request it prefills (a
  // separate predictor model on the GPU). Default: none.
  virtual double GpuMsPerPrediction() const { return 0; }
  // Requests prefilled by the step that ends at `end_s`; their hidden states
  // exist at `capture_s` <= end_s.
  virtual absl::Status Prefilled(std::span<const SimRequest* const> requests,
                                 double capture_s, double end_s) = 0;
  // Appends the predictions known at simulated time `now_s` (the start of a
  // step) and not handed over before.
  virtual absl::Status Collect(double now_s,
                               std::vector<PredictionUpdate>* out) = 0;
  // The request finished (its true length is known now).
  virtual absl::Status Finished(const SimRequest& request) = 0;
};

// No predictions at all (FCFS runs).
class NoPredictor : public Predictor {
 public:
  absl::Status Prefilled(std::span<const SimRequest* const>, double,
                         double) override {
    return absl::OkStatus();
  }
  absl::Status Collect(double, std::vector<PredictionUpdate>*) override {
    return absl::OkStatus();
  }
  absl::Status Finished(const SimRequest&) override { return absl::OkStatus(); }
};

// Known predictions per request id (values[id]): the oracle (true lengths),
// the learned-predictor baselines, and test seams. A prediction is ready
// `latency_s` after the capture point; with `on_gpu` it is ready when the
// step ends instead and each one adds `gpu_ms` to its step.
class TablePredictor : public Predictor {
 public:
  TablePredictor(std::vector<double> values, double latency_s, bool on_gpu,
                 double gpu_ms);
  // Per-request latencies (latencies[id], seconds; NaN values = never
  // predicted), e.g. recorded from a LEAP run.
  TablePredictor(std::vector<double> values, std::vector<double> latencies);
  double GpuMsPerPrediction() const override { return on_gpu_ ? gpu_ms_ : 0; }
  absl::Status Prefilled(std::span<const SimRequest* const> requests,
                         double capture_s, double end_s) override;
  absl::Status Collect(double now_s,
                       std::vector<PredictionUpdate>* out) override;
  absl::Status Finished(const SimRequest& request) override;

 private:
  struct Pending {
    int64_t id;
    double ready_s;
  };
  std::vector<double> values_;
  double latency_s_;
  bool on_gpu_;
  double gpu_ms_;
  std::vector<double> latencies_;
  std::vector<Pending> pending_;
};

// A length prior known before prefill (length-aware admission,
// docs/SCHEDULING.md): asked once per request at its arrival, taught every
// completion. Called from the simulation loop only.
class AdmissionPrior {
 public:
  virtual ~AdmissionPrior() = default;
  // The prior of a request that has just arrived, or nullopt (no prior: the
  // request is placed as unpredicted).
  virtual std::optional<double> At(const SimRequest& request) = 0;
  // The request finished (its true length is known now).
  virtual absl::Status Learn(const SimRequest& request) = 0;
};

// What happened to one request.
struct RequestResult {
  int64_t id = 0;
  int segment = 0;
  double arrival_s = 0;
  double first_token_s = 0;
  double completion_s = 0;
  // As in the trace (0 is reported as 1).
  int64_t output_tokens = 1;
  // The first prediction the scheduler used; NaN when none arrived.
  double predicted_tokens = 0;
  // Longest run of consecutive steps this request spent in the scheduler
  // without a decode slot.
  int64_t max_wait_steps = 0;
  // Tail bound (kBounded) only, else NaN, and NaN for a request that never
  // reached the decode scheduler (done at prefill): on the deadlines' clock
  // (engine steps, idle gaps included; with a latency target, seconds of
  // simulated time), the point its deadline counts from, its deadline as it
  // stood at completion, and the steps committed up to and including the
  // one that produced its last token (with a target: its completion time).
  // (StartRun sets all three to NaN first.)
  double deadline_origin_step = 0;
  double deadline_step = 0;
  double completion_step = 0;
  // kBounded: it was urgent in the decode scheduler (or, with a latency
  // target, in the admission queue it was carried from), and it gave up its
  // deadline (tail_budget); both false for a request done at prefill (it
  // never reached the decode scheduler).
  bool was_urgent = false;
  bool gave_up = false;
};

struct SimOptions {
  EngineOptions engine;
  shim::SchedulerOptions scheduler;
  // Record the ids decoded by every step, in the scheduler's order.
  bool record_order = false;
  // Length-aware admission (nullptr = none). kSlots: the admission queue is
  // ordered by a second CountdownScheduler (the same options, waiting cap
  // off) in which each waiting request carries its prior, instead of FCFS.
  // kVllm: each request gets its prior (SetPrior) when it joins the
  // scheduler at arrival, so the waiting queue is ordered by it.
  AdmissionPrior* prior = nullptr;
  // Called every ~progress_every_steps steps with (finished, total).
  int64_t progress_every_steps = 0;
  std::function<void(int64_t, int64_t)> progress;
};

struct SimResult {
  // Indexed by request id.
  std::vector<RequestResult> requests;
  int64_t steps = 0;
  double end_s = 0;
  // Most requests the scheduler held at once.
  int64_t max_live = 0;
  // Predictions that were not known at the start of the first step after
  // the request's prefill (the request waited unpredicted).
  int64_t late_predictions = 0;
  // kVllm: preemptions (each one frees the request's KV cache; it is
  // recomputed when readmitted) and the tokens recomputed.
  int64_t preemptions = 0;
  int64_t recomputed_tokens = 0;
  shim::SchedulerCounters counters;
  // Slots engine with an admission scheduler: deadlines it gave up
  // (tail_budget, give_up_reserve) before admission, and of those the ones
  // given up against credits (`counters` are the decode stage's).
  int64_t queue_deadlines_given_up = 0;
  int64_t queue_credit_give_ups = 0;
  // Per step: ids decoded, in the scheduler's order (record_order only).
  std::vector<std::vector<int64_t>> decode_order;
};

// Runs the engine over `requests` (ids 0..n-1 in any order; arrivals >= 0).
// Errors come from the options or the predictor. Dispatches on
// options.engine.kind.
//
// kVllm (SimulateVllm), after vLLM V1's Scheduler.schedule(): every request
// joins the CountdownScheduler at arrival (unpredicted until its prefill's
// capture point plus the prediction latency), in a waiting queue. Each step,
// with a budget of max_num_batched_tokens:
//  1. Running requests, in admission order (engine.preempt_latest_admitted,
//     the default; else in the scheduler's order), each get the tokens they
//     need (1 when decoding, else the rest of their prompt [+ output to
//     recompute], cut to the budget: chunked prefill). KV blocks are
//     allocated for them; when the cache is full the last of that order is
//     preempted (blocks freed, progress lost, back to waiting): the latest
//     admitted, as vLLM's FCFS policy, or the lowest-ranked, as vLLM's
//     priority policy picks max (priority, arrival); if that was the request
//     itself it waits.
//  2. Only if nobody was preempted: waiting requests in the scheduler's order
//     are admitted while running < max_num_seqs, budget remains and their
//     first chunk's blocks fit; the first that does not fit stops admission.
// A request whose computed tokens reach prompt + output so far produces a
// token (the first one ends TTFT); those that produced a later token are
// committed to the scheduler as having held a slot. The step takes
// step_base_ms + step_per_seq_ms * decoding + prefill_per_token_ms * prefill
// tokens (recomputation included). FCFS (no predictions, equal remaining) is
// then vLLM's FCFS policy (with preempt_latest_admitted = false, except that
// the request preempted is the latest arrival rather than the latest
// admission).
absl::StatusOr<SimResult> Simulate(std::span<const SimRequest> requests,
                                   const SimOptions& options,
                                   Predictor& predictor);

// FCFS throughput with every request arriving at time 0, in requests/s:
// n / (time the last one finishes). The capacity the load factor refers to.
absl::StatusOr<double> MeasureCapacity(std::span<const SimRequest> requests,
                                       const EngineOptions& engine);

// ---- metrics
// -----------------------------------------------------------------

// Percentile p in [0, 100] by linear interpolation between order statistics
// (x sorted ascending, rank p/100 * (n - 1); NumPy's default). NaN when x is
// empty.
double Percentile(std::vector<double> x, double p);

// The largest percentile p (as Percentile) over every `window` consecutive
// values of x (x in arrival order); Percentile(x, p) when x holds at most
// `window` values. O(n log n): order statistics from a Fenwick tree over
// the values' ranks. NaN when x is empty or window is 0.
double WorstWindowPercentile(std::span<const double> x, size_t window,
                             double p);

// The window of Metrics::window_p99_latency: requests in arrival order, as
// many as SchedulerOptions::tail_budget_window's default (the latency
// target's controller banks at most (1 - q) x that many credits, so a burst
// can spend only its own period's share of misses).
inline constexpr size_t kP99Window = 10000;
static_assert(kP99Window ==
              static_cast<size_t>(shim::SchedulerOptions{}.tail_budget_window));

// The paper's metrics over a set of finished requests. Times in seconds.
struct Metrics {
  int64_t n = 0;
  // Mean over requests of (completion - arrival) / output tokens, s/token.
  double mean_ptl = 0;
  // Latency = completion - arrival.
  double mean_latency = 0;
  double p90_latency = 0;
  double p95_latency = 0;
  double p99_latency = 0;
  // The worst P99 latency over any kP99Window requests consecutive in
  // arrival order (equal arrivals in result order; p99_latency itself with
  // at most kP99Window requests): a P99 objective judged per period, where
  // one burst's misses count against that period alone.
  double window_p99_latency = 0;
  // Mean of first token - arrival.
  double mean_ttft = 0;
  // Output tokens of these requests per second, over the span from the
  // first arrival to the last completion among them.
  double throughput = 0;
  // P95 latency of the requests with more than kLongTokens output tokens;
  // nullopt when there are none.
  std::optional<double> long_p95_latency;
  int64_t n_long = 0;
  // Ranking quality among contemporaneous requests: the Spearman of first
  // prediction vs true length within consecutive windows of kRankWindow
  // predicted requests (in result order; a last window under a fifth of
  // that joins the one before), averaged weighted by size. Windows keep a
  // predictor whose scale drifts (RLS adapting) from being penalized for
  // comparing requests the scheduler never held together. NaN when fewer
  // than 2 requests got a prediction.
  double spearman = 0;
};

inline constexpr int64_t kLongTokens = 1024;
inline constexpr size_t kRankWindow = 500;

// Metrics over the requests for which `keep` is true (all when empty).
Metrics ComputeMetrics(
    std::span<const RequestResult> results,
    const std::function<bool(const RequestResult&)>& keep = nullptr);

// ---- learned-predictor baseline ---------------------------------------------

// Predictions with Spearman ~ rho to `lengths`: a Gaussian copula. Each
// length gets its normal score z (rank-based, ties broken at random), then
// s = r z + sqrt(1 - r^2) e with e ~ N(0, 1) and r = 2 sin(pi rho / 6) (the
// Pearson correlation whose Spearman is rho for a bivariate normal), and the
// prediction is the empirical quantile of `lengths` at Phi(s): the same
// marginal as the true lengths, ranked with quality rho. rho in [-1, 1].
std::vector<double> CopulaPredictions(std::span<const int64_t> lengths,
                                      double rho, uint64_t seed);

}  // namespace leap::replay

#endif  // LEAP_REPLAY_ENGINE_MODEL_H_
