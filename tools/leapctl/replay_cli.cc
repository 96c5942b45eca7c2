// The command line of `leapctl replay` (flags, --help, output). The logic is
// the replay library (replay/replay.h).
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "tools/leapctl/flags.h"
#include "tools/leapctl/internal/command.h"
#include "replay/replay.h"

namespace leap::leapctl::internal {

using replay::FormatReplayTable;
using replay::ParsePolicies;
using replay::ParseTraceFormat;
using replay::PolicySpec;
using replay::ReplayOptions;
using replay::ReplayReport;
using replay::RunReplay;
using replay::TraceFormat;

namespace {

constexpr char kDescription[] =
    "Replays a request trace through a model of an LLM engine and reports\n"
    "latency after scheduling for each policy: the paper's mean per-token\n"
    "latency (PTL), mean/P90/P95/P99 latency, TTFT, throughput and the P95\n"
    "latency of long requests (> 1,024 output tokens).\n"
    "\n"
    "Engine model (simulated time): up to --resident requests in memory,\n"
    "admitted first come first served; each step decodes one token for up to\n"
    "--slots of them, chosen by the engine shim's CountdownScheduler, and\n"
    "prefills newly admitted prompts (the prefill yields the first token).\n"
    "A step takes step_base + step_per_seq * decode_batch\n"
    "+ prefill_per_token * prompt_tokens (+ a learned predictor's GPU cost\n"
    "per prediction) milliseconds.\n"
    "\n"
    "Policies (--policies, comma-separated):\n"
    "  fcfs       arrival order (no predictions, no waiting cap)\n"
    "  oracle     countdown on the true lengths\n"
    "  leap       LEAP through a real leapd and the engine shim's Client, the\n"
    "             readout frozen; each request's prediction is usable from\n"
    "             its capture point (--capture-fraction into its prefill)\n"
    "             plus the latency measured from Submit to the prediction\n"
    "             (or --prediction-latency-ms, for repeatable runs)\n"
    "  leap-rls   the same readout adapting online (RLS) from completions\n"
    "  learned:rho=R,cost=Cms[,shift_rho=S]   a separate predictor whose\n"
    "             predictions have Spearman R with the true lengths (S after\n"
    "             the shift) and cost C GPU-ms each; presets tie, ssjf, ltr,\n"
    "             trail, egtp ('baselines' = all five)\n"
    "Every length-aware policy uses the waiting cap and aging given, and\n"
    "may name a scheduling discipline after a '+' (docs/SCHEDULING.md):\n"
    "  +bounded[=S]  the countdown with the tail bound: no request's latency\n"
    "                (in steps) beyond S x what a virtual FCFS system gives\n"
    "                it, plus the EDF overflow; default S = 2.5\n"
    "  +bounded-ratio[=S]  the same, its estimates corrected by a ratio per\n"
    "                octave of the estimate (true / estimated length of\n"
    "                the last --bound-calibration completions) instead of\n"
    "                their mean error\n"
    "  +bounded[=S],aging=A  (also after +bounded-ratio) the same, the\n"
    "                requests whose deadline is not at risk ordered by\n"
    "                remaining - A x steps waited (overrides --bounded-aging)\n"
    "  +target[=X]   a latency target of X x FCFS's P99 latency at the\n"
    "                same load (fcfs listed before it): every request's\n"
    "                deadline is its arrival + the target (seconds), the\n"
    "                urgent ones served in arrival order, estimates\n"
    "                corrected per octave, --tail-budget of the deadlines\n"
    "                given up by long requests (and more against banked\n"
    "                credits, --give-up-reserve), the deadlines steered\n"
    "                to keep --target-quantile of the requests within the\n"
    "                target; default X = 1.45\n"
    "  +hrrn         highest response ratio next (baseline)\n"
    "  +aging[=A]    remaining - A x steps waited (linear aging baseline)\n"
    "  +countdown    the plain countdown (the default)\n"
    "and after that (or alone) +prior: length-aware admission, the waiting\n"
    "requests ordered by a prior before prefill (per product line, from the\n"
    "prompt length, learned online from completions), e.g. leap+prior,\n"
    "leap+bounded=2.5+prior.\n"
    "e.g. leap+bounded=1.5. leap+D runs reuse the predictions (and charged\n"
    "latencies) of the first frozen LEAP run instead of asking leapd again.\n"
    "With fcfs and oracle in the list a trade-off table follows (share of the\n"
    "oracle's mean-PTL gain over FCFS, P99 and long-request P95 over FCFS's);\n"
    "--tradeoff-plot draws it. Policies run with and without +prior (e.g.\n"
    "leap,leap+prior) add an admission table; --admission-plot draws it.\n"
    "\n"
    "--engine vllm replaces the engine model by one shaped like vLLM V1's\n"
    "scheduler: every running request advances each step (continuous\n"
    "batching), at most --max-num-seqs running, --max-num-batched-tokens per\n"
    "step (prefills chunked to fit), a KV cache of --kv-blocks blocks of\n"
    "--block-size tokens; when it is full the latest admitted running request\n"
    "is preempted and later recomputed (--preempt rank: the lowest-ranked);\n"
    "waiting requests are admitted in the scheduler's order.\n"
    "\n"
    "LEAP's hidden states are synthetic (leapctl synth's model), conditioned\n"
    "on each request's true output length and domain (--domain, switching to\n"
    "--shift-to at --shift-at). Without --readout a ridge readout is fitted\n"
    "on --train-rows synthetic source-domain requests; without --server a\n"
    "leapd is started for the run (in memory) and stopped at the end.\n"
    "\n"
    "Arrivals: a trace's timestamps, rescaled so the mean rate is load x the\n"
    "capacity measured under FCFS (all requests at t=0); traces without\n"
    "timestamps (and synthetic ones, and --shift-trace runs) get Poisson\n"
    "arrivals at load x capacity, measured per side of the shift.\n"
    "\n"
    "Prints a table; --json writes one object per policy and load (policy,\n"
    "load, mean_ptl, p90_latency, p95_latency, p99_latency,\n"
    "window_p99_latency (the worst P99 over any 10,000 requests consecutive\n"
    "in arrival order; p99_latency with at most 10,000), mean_ttft,\n"
    "throughput, long_p95_latency; seconds and\n"
    "output tokens/s), --plot the mean PTL vs load, one line per policy.\n"
    "Progress goes to stderr.";

absl::StatusOr<std::vector<double>> ParseLoads(absl::string_view list) {
  std::vector<double> out;
  for (absl::string_view t : absl::StrSplit(list, ',')) {
    t = absl::StripAsciiWhitespace(t);
    double v = 0;
    if (!absl::SimpleAtod(t, &v) || !(v > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sweep wants comma-separated load factors > 0, got '", t, "'"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

int ReplayCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err) {
  Command cmd("replay", out, err);
  ReplayOptions o;
  std::string format = "auto", shift_format = "auto";
  std::string policies = "fcfs,oracle,leap,leap-rls";
  std::string sweep;
  std::optional<double> load;
  std::optional<double> prediction_latency_ms;
  int64_t resident = o.engine.resident, slots = o.engine.slots;
  int64_t model_seed = static_cast<int64_t>(o.model_seed);
  std::string engine = "slots";
  std::string preempt = "latest";
  int64_t max_num_seqs = o.engine.max_num_seqs;
  int64_t block_size = o.engine.block_size;
  int64_t seed = static_cast<int64_t>(o.seed);
  FlagSet flags(
      "replay",
      "leapctl replay [--trace FILE [--format azure|lengths|jsonl]] [--load X "
      "| --sweep X,Y,...]\n"
      "               [--policies fcfs,oracle,leap,leap-rls] [--json OUT] "
      "[--plot OUT.png|OUT.svg] [flags]",
      kDescription);
  flags.String("trace", &o.trace_path, "FILE",
               "Request trace (see --format). Default: a synthetic trace of "
               "--requests requests of --domain.");
  flags.String("format", &format, "auto|azure|lengths|jsonl",
               "Trace format: azure (TIMESTAMP,ContextTokens,GeneratedTokens), "
               "lengths (num_prefill_tokens,num_decode_tokens,...; Poisson "
               "arrivals), jsonl (timestamp ms, input_length, output_length); "
               "auto guesses from the extension and header.");
  flags.String("shift-trace", &o.shift_trace_path, "FILE",
               "Take the output and prompt lengths of the requests after "
               "--shift-at from this trace (its first rows); arrivals are then "
               "Poisson.");
  flags.String("shift-format", &shift_format, "auto|azure|lengths|jsonl",
               "Format of --shift-trace.");
  flags.Int64("requests", &o.requests, "N",
              "Requests to replay: the synthetic trace's size (0 = 4000), or "
              "the first N of --trace (0 = all).");
  flags.OptionalDouble("rate", &o.rate, "R",
                       "Arrival rate in requests/s for traces without "
                       "timestamps when neither --load nor --sweep is given.");
  flags.OptionalDouble("load", &load, "X",
                       "Load factor: mean arrival rate = X times the FCFS "
                       "capacity. Default: the trace's own timestamps, else "
                       "--rate, else 1.");
  flags.String("sweep", &sweep, "X,Y,...",
               "Several load factors (one run of every policy at each).");
  flags.String("policies", &policies, "LIST",
               "Policies, comma-separated (see above).");
  flags.String("domain", &o.domain, "NAME",
               "Synthetic domain of the traffic (and of the source readout): "
               "chat, translation, summarization, code.");
  flags.OptionalDouble("shift-at", &o.shift_at, "FRACTION",
                       "Switch the traffic to --shift-to after this fraction "
                       "of the requests, in [0, 1) (0: all of them; the "
                       "readout is still fitted on --domain). Default: no "
                       "shift.");
  flags.String("shift-to", &o.shift_to, "NAME", "Domain after the shift.");
  flags.Int64("dim", &o.dim, "D", "Width of the synthetic hidden states.");
  flags.Int64("train-rows", &o.train_rows, "N",
              "Synthetic source-domain requests the readout is fitted on.");
  flags.String("readout", &o.readout_path, "FILE",
               "Serve this .leapr artifact instead of fitting one (d must be "
               "--dim, trained on leapctl synth features of the same "
               "--model-seed).");
  flags.Int64("model-seed", &model_seed, "S",
              "Seed of the synthetic serving model (as leapctl synth).");
  flags.Int64("seed", &seed, "S",
              "Seed of the synthetic trace, arrivals, features and baselines.");
  flags.String("engine", &engine, "slots|vllm",
               "Engine model: slots (the paper's: --resident, --slots) or "
               "vllm (continuous batching with KV blocks and preemption).");
  flags.Int64("max-num-seqs", &max_num_seqs, "N",
              "vllm: running requests at most.");
  flags.Int64("max-num-batched-tokens", &o.engine.max_num_batched_tokens, "N",
              "vllm: tokens per step (decodes + prefill chunks).");
  flags.Int64("block-size", &block_size, "N", "vllm: tokens per KV block.");
  flags.Int64("kv-blocks", &o.engine.kv_blocks, "N",
              "vllm: KV cache size in blocks.");
  flags.String("preempt", &preempt, "latest|rank",
               "vllm: running requests served in admission order, the latest "
               "admitted preempted when the KV cache is full, as vLLM's FCFS "
               "policy (latest, the default: the scheduler orders only the "
               "waiting queue, the recommended wiring), or in the "
               "scheduler's order, the lowest-ranked preempted, as vLLM's "
               "priority policy given the rank (rank).");
  flags.String("tradeoff-plot", &o.tradeoff_plot_path, "OUT.svg",
               "Write the trade-off plot (share of the oracle's PTL gain vs "
               "P99 latency over FCFS's, one point per knob value).");
  flags.String("admission-plot", &o.admission_plot_path, "OUT.svg",
               "Write the admission plot: per load, each policy P that ran "
               "beside P+prior, its share of the oracle's PTL gain with FCFS "
               "admission and with length-aware admission, with the P99 "
               "ratios to FCFS.");
  flags.Int64("resident", &resident, "N", "Requests held in memory at once.");
  flags.Int64("slots", &slots, "N", "Decode slots per step.");
  flags.Double("step-base-ms", &o.engine.step_base_ms, "MS",
               "Fixed cost of a step (ms).");
  flags.Double("step-per-seq-ms", &o.engine.step_per_seq_ms, "MS",
               "Cost per request decoded in a step (ms).");
  flags.Double("prefill-per-token-ms", &o.engine.prefill_per_token_ms, "MS",
               "Prefill cost per prompt token (ms).");
  flags.Int64("max-prefill-tokens", &o.engine.max_prefill_tokens, "N",
              "Prompt tokens prefilled in one step at most (one request is "
              "always admitted when memory is free).");
  flags.Double("capture-fraction", &o.engine.capture_fraction, "F",
               "How far into a step's prefill the captured layer's hidden "
               "state exists (30/36: layer 30 of Qwen3-8B).");
  flags.Int64("max-tokens", &o.max_tokens, "M",
              "Output budget M: longer outputs are cut to M (the readout "
              "clips predictions to M).");
  flags.Int64("waiting-cap", &o.waiting_cap, "STEPS",
              "Steps without a slot after which a request is promoted (0 "
              "disables); every length-aware policy.");
  flags.Double("aging-rate", &o.aging_rate, "R",
               "Exponential aging: priority = remaining * exp(-R * "
               "steps_waited); 0 disables.");
  flags.Double("bounded-aging", &o.bounded_aging, "A",
               "Every +bounded and +target policy orders requests whose "
               "deadline is not "
               "at risk by remaining - A * steps waited (linear aging) "
               "instead of the countdown; 0 = the countdown. A policy's own "
               "',aging=A' (leap+bounded=2,aging=0.03) overrides it.");
  flags.Int64("bound-calibration", &o.bound_calibration, "N",
              "Every +bounded and +target policy corrects its estimates "
              "with the last N completions (adds the mean error, true - "
              "estimated length; +bounded-ratio and +target multiply by the "
              "ratio of true to estimated per octave of the estimate), so "
              "the deadlines are placed with estimates unbiased for the "
              "mean; 0 = the estimates as ranked.");
  flags.Double("tail-budget", &o.tail_budget, "B",
               "Every +target policy lets up to this share of the requests "
               "(per 10,000 added, in each stage) give up their deadline when "
               "they first turn urgent with at least the mean "
               "completed length left (needs --bound-calibration > 0); 0 = "
               "none against the budget (--give-up-reserve may still give "
               "some up against credits; 1 there for none at all).");
  flags.Double("target-quantile", &o.target_quantile, "Q",
               "Every +target policy steers its urgency test so that this "
               "share of the requests finishes within the target (each "
               "completion's latency tightens or relaxes the deadlines "
               "used, never past the target); 0 = deadlines at the target "
               "itself.");
  flags.Double("give-up-reserve", &o.give_up_reserve, "R",
               "Every +target policy, past --tail-budget: a request that "
               "would give up its deadline still does against one of the "
               "controller's credits while the credits left after setting "
               "it aside stay at or above R x the bank (1 - Q) x 10,000; 1 = "
               "none beyond the budget (needs --target-quantile > 0).");
  flags.OptionalDouble(
      "prediction-latency-ms", &prediction_latency_ms, "MS",
      "LEAP policies: charge every prediction this latency on the "
      "simulated timeline instead of the one measured from Submit to the "
      "prediction, so that runs of a frozen readout (leap, leap+D) repeat "
      "exactly; in [0, 60000]. Default: measured.");
  flags.String("unpredicted", &o.unpredicted, "median|fixed|first|last",
               "Where the scheduler puts a request whose prediction is not "
               "known yet.");
  flags.String("leapd", &o.leapd_path, "PATH",
               "leapd binary to start. Default: next to leapctl (build tree: "
               "../../sidecar/leapd), else PATH.");
  flags.String("leapd-data-dir", &o.leapd_data_dir, "DIR",
               "Start leapd on an embedded RocksDB in DIR (its feedback log, "
               "checkpoints and versions stay there). Default: in memory.");
  flags.String(
      "server", &o.server, "ADDR",
      "Use this running leapd (host:port or unix:///path) instead of "
      "starting one; readouts named replay-* are created and deleted.");
  flags.Double(
      "timeout", &o.timeout_s, "SECONDS",
      "How long to wait for leapd to start and for each admin answer.");
  flags.Double("metrics-from", &o.metrics_from, "FRACTION",
               "Compute the metrics over requests from this fraction of the "
               "trace on (warm-up excluded), in [0, 1).");
  flags.String("json", &o.json_path, "OUT",
               "Write the results as a JSON array (one object per policy and "
               "load).");
  flags.String("requests-csv", &o.requests_csv_path, "OUT.csv",
               "Write every request of every run as one CSV line (policy, "
               "load, id, segment, arrival_s, prompt_tokens, output_tokens, "
               "predicted_tokens, first_token_s, completion_s, latency_s, "
               "max_wait_steps, and the deadline's origin, deadline and "
               "completion on its clock, whether it turned urgent and whether it "
               "gave up its deadline for +bounded and +target policies), "
               "for analysis beyond the table.");
  flags.String("plot", &o.plot_path, "OUT",
               "Write mean PTL vs load: .png (gnuplot; SVG instead when "
               "gnuplot is missing) or .svg.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (prediction_latency_ms.has_value()) {
    o.prediction_latency_s = *prediction_latency_ms / 1e3;
  }

  absl::StatusOr<TraceFormat> f = ParseTraceFormat(format);
  if (!f.ok()) return cmd.UsageError(f.status());
  o.format = *f;
  f = ParseTraceFormat(shift_format);
  if (!f.ok()) return cmd.UsageError(f.status());
  o.shift_format = *f;
  absl::StatusOr<std::vector<PolicySpec>> p = ParsePolicies(policies);
  if (!p.ok()) return cmd.UsageError(p.status());
  o.policies = std::move(*p);
  if (load.has_value() && !sweep.empty()) {
    return cmd.UsageError(
        absl::InvalidArgumentError("give --load or --sweep, not both"));
  }
  if (load.has_value()) o.loads = {*load};
  if (!sweep.empty()) {
    absl::StatusOr<std::vector<double>> l = ParseLoads(sweep);
    if (!l.ok()) return cmd.UsageError(l.status());
    o.loads = std::move(*l);
  }
  if (resident < 1 || resident > (int64_t{1} << 24) || slots < 1 ||
      slots > (int64_t{1} << 24)) {
    return cmd.UsageError(absl::InvalidArgumentError(
        absl::StrCat("--resident and --slots must be in [1, 16777216], got ",
                     resident, " and ", slots)));
  }
  if (model_seed < 0 || seed < 0) {
    return cmd.UsageError(
        absl::InvalidArgumentError("--model-seed and --seed must be >= 0"));
  }
  if (engine == "vllm") {
    o.engine.kind = replay::EngineKind::kVllm;
  } else if (engine != "slots") {
    return cmd.UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--engine must be slots or vllm, got '", engine, "'")));
  }
  if (preempt != "rank" && preempt != "latest") {
    return cmd.UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--preempt must be rank or latest, got '", preempt, "'")));
  }
  o.engine.preempt_latest_admitted = preempt == "latest";
  if (max_num_seqs < 1 || max_num_seqs > (int64_t{1} << 20) ||
      block_size < 1 || block_size > 4096) {
    return cmd.UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--max-num-seqs must be in [1, 1048576] and --block-size in [1, "
        "4096], got ",
        max_num_seqs, " and ", block_size)));
  }
  o.engine.max_num_seqs = static_cast<int>(max_num_seqs);
  o.engine.block_size = static_cast<int>(block_size);
  o.engine.resident = static_cast<int>(resident);
  o.engine.slots = static_cast<int>(slots);
  o.model_seed = static_cast<uint64_t>(model_seed);
  o.seed = static_cast<uint64_t>(seed);
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);

  absl::StatusOr<ReplayReport> r = RunReplay(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << FormatReplayTable(*r);
  return kExitOk;
}

}  // namespace leap::leapctl::internal
