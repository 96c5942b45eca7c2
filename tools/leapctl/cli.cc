#include "tools/leapctl/cli.h"

#include <algorithm>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "readout/synth.h"
#include "tools/leapctl/commands.h"
#include "tools/leapctl/flags.h"
#include "tools/leapctl/internal/command.h"
#include "replay/replay.h"

namespace leap::leapctl {
namespace {

constexpr char kTopHelp[] =
    "Usage: leapctl <command> [arguments] [flags]\n"
    "\n"
    "Operator tool for LEAP length readouts (a linear readout of the hidden\n"
    "state that predicts sqrt(output tokens)).\n"
    "\n"
    "Offline commands (files only):\n"
    "  train   Fit a ridge readout on features + lengths; write a .leapr "
    "artifact.\n"
    "  eval    Score a readout on features + true lengths (Spearman, Kendall,"
    "\n          MAE by length bucket).\n"
    "  adapt   Update a readout with RLS on finished requests; write a new\n"
    "          artifact version.\n"
    "  synth   Write synthetic features + lengths with a controllable domain\n"
    "          shift.\n"
    "\n"
    "Commands for a running leapd (--server ADDR, default 127.0.0.1:7070):\n"
    "  readouts list|get|create|delete   Manage the served readouts.\n"
    "  versions NAME    Published versions of a readout with their online\n"
    "                   Spearman.\n"
    "  export NAME      Write a readout's current state as a .leapr "
    "artifact.\n"
    "  dataset export --readout NAME --out DIR   Training data leapd kept\n"
    "                   from its traffic: DIR/features.npy, DIR/lengths.npy.\n"
    "  freeze NAME      Stop online adaptation (RLS) of a readout.\n"
    "  resume NAME      Restart online adaptation of a readout.\n"
    "  route set|list|delete   Which readouts (A/B and shadow arms) serve a\n"
    "                   product line.\n"
    "  stats [NAME]     Online quality and counters.\n"
    "  snapshot create NAME LABEL | list NAME   Label / list restorable "
    "states.\n"
    "  rollback NAME LABEL   Restore a snapshot (published as a new "
    "version).\n"
    "  import NAME --artifact R.leapr   Load an artifact (= readouts "
    "create).\n"
    "  bench            Load-test leapd's Connect stream (predictions/s,\n"
    "                   latency).\n"
    "  feed             Simulate an engine: send features and completions "
    "from\n"
    "                   files, report the rolling Spearman as leapd learns.\n"
    "\n"
    "Evaluation (starts its own leapd unless --server is given):\n"
    "  replay   Replay a request trace through an engine model: latency after\n"
    "           scheduling for FCFS, the oracle, LEAP (frozen / RLS) and\n"
    "           learned-predictor baselines; table, JSON and plot.\n"
    "\n"
    "Run 'leapctl <command> --help' for the flags of a command.\n"
    "Exit codes: 0 success, 1 failure, 2 usage error.\n";

// Quotes an argument for the provenance note when it has shell-special
// characters.
std::string QuoteArg(const std::string& a) {
  if (!a.empty() &&
      a.find_first_of(" \t\n'\"\\$`;&|<>()*?[]#~") == std::string::npos) {
    return a;
  }
  return absl::StrCat("'", absl::StrReplaceAll(a, {{"'", "'\\''"}}), "'");
}

using internal::Command;
using internal::OneLine;

std::string Note(const std::vector<std::string>& args) {
  std::vector<std::string> q;
  q.reserve(args.size());
  for (const std::string& a : args) q.push_back(QuoteArg(a));
  return absl::StrCat("leapctl ", absl::StrJoin(q, " "));
}

int Train(const std::vector<std::string>& args,
          const std::vector<std::string>& all, std::ostream& out,
          std::ostream& err) {
  Command cmd("train", out, err);
  TrainOptions o;
  FlagSet flags(
      "train",
      "leapctl train --features F.npy --lengths L.npy --out R.leapr [flags]",
      "Fits the LEAP readout by ridge regression (docs/MATH.md): standardizes "
      "the\n"
      "features, regresses y = sqrt(min(length, M)) on [z; 1] with the bias\n"
      "unpenalized, picks lambda by k-fold cross-validation unless --lambda "
      "is\n"
      "given, and writes a version-1 readout artifact with the RLS matrix\n"
      "P0 = (U'U + lambda D)^-1 (unless --no-p). Prints n, d, lambda (and the\n"
      "CV table), the training MSE, the time and the output path; progress\n"
      "goes to stderr.");
  flags.String("features", &o.features_path, "PATH",
               "Features: .npy float32 or float16, shape [n, d], d in "
               "[1, 16384], all finite.",
               true);
  flags.String("lengths", &o.lengths_path, "PATH",
               "True output lengths in tokens: .npy int32 or int64, shape [n].",
               true);
  flags.String("out", &o.out_path, "PATH",
               "Readout artifact (.leapr) to write (atomically).", true);
  flags.OptionalDouble("lambda", &o.lambda, "X",
                       "Ridge penalty (>= 0). Default: chosen by "
                       "cross-validation over lambda/n in {1e-5, ..., 10}.");
  flags.Int64("max-tokens", &o.max_tokens, "M",
              "Output budget M: targets are sqrt(min(length, M)) and "
              "predictions are clipped to [1, M].");
  flags.Int64("layer", &o.layer, "N",
              "Model layer the features were captured at, recorded in the "
              "artifact (-1 = unknown).");
  flags.String("model", &o.model_id, "ID",
               "Serving model id recorded in the artifact (e.g. "
               "Qwen/Qwen3-8B). Default: empty.");
  flags.Int64("folds", &o.folds, "K",
              "Cross-validation folds (ignored with --lambda).");
  flags.Bool("no-p", &o.no_p,
             "Do not compute or store P0: a smaller, frozen readout that "
             "'leapctl adapt' refuses.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  o.note = Note(all);
  absl::StatusOr<TrainReport> r = RunTrain(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << FormatTrainReport(*r);
  return kExitOk;
}

int Eval(const std::vector<std::string>& args, std::ostream& out,
         std::ostream& err) {
  Command cmd("eval", out, err);
  EvalOptions o;
  bool json = false;
  FlagSet flags(
      "eval",
      "leapctl eval --readout R.leapr --features F.npy --lengths L.npy "
      "[--json]",
      "Predicts every row with the folded readout (one dot product on the raw\n"
      "features, fp32 or fp16 read in place; clip(score, 1, sqrt(M))^2) and\n"
      "compares with the true lengths: Spearman's rho and Kendall's tau-b of\n"
      "predicted vs. true tokens, and the mean absolute error in tokens "
      "overall\n"
      "and per true-length bucket (<=256, 257-1024, >1024).");
  flags.String("readout", &o.readout_path, "PATH", "Readout artifact (.leapr).",
               true);
  flags.String("features", &o.features_path, "PATH",
               "Features: .npy float32 or float16, shape [n, d] with the "
               "readout's d, all finite.",
               true);
  flags.String("lengths", &o.lengths_path, "PATH",
               "True output lengths: .npy int32 or int64, shape [n].", true);
  flags.Bool("json", &json,
             "Print exactly one JSON object instead of text: {\"n\", "
             "\"spearman\", \"kendall_tau\", \"mae\", \"mae_by_bucket\": "
             "{\"le_256\", \"257_1024\", \"gt_1024\"}}; undefined values and "
             "empty buckets are null.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  absl::StatusOr<EvalReport> r = RunEval(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatEvalJson(*r) : FormatEvalReport(*r));
  return kExitOk;
}

int Adapt(const std::vector<std::string>& args,
          const std::vector<std::string>& all, std::ostream& out,
          std::ostream& err) {
  Command cmd("adapt", out, err);
  AdaptOptions o;
  FlagSet flags(
      "adapt",
      "leapctl adapt --readout R.leapr --features F.npy --lengths L.npy "
      "--out R2.leapr [flags]",
      "Adapts a readout to new traffic with exact batched recursive least\n"
      "squares, anchored at the offline fit by the artifact's P (docs/MATH.md).\n"
      "Rows are learned in file order, --batch completions per update, each\n"
      "standardized with the readout's own mean and scale and with target\n"
      "sqrt(min(length, M)). Writes the adapted state as the next version\n"
      "(version + 1, completions_learned += rows learned). Prints rows\n"
      "learned and skipped, batches, throughput and time.");
  flags.String("readout", &o.readout_path, "PATH",
               "Readout artifact to start from; must contain the RLS matrix "
               "P (i.e. not trained with --no-p).",
               true);
  flags.String("features", &o.features_path, "PATH",
               "Features of finished requests: .npy float32 or float16, "
               "shape [n, d] with the readout's d, all finite.",
               true);
  flags.String("lengths", &o.lengths_path, "PATH",
               "Their output lengths: .npy int32 or int64, shape [n].", true);
  flags.String("out", &o.out_path, "PATH",
               "Adapted artifact to write (atomically).", true);
  flags.Int64("batch", &o.batch, "K",
              "Completions per RLS update, in [1, 65536]. Only changes "
              "timing, not the result.");
  flags.String("finish-reasons", &o.finish_reasons_path, "PATH",
               "Optional .npy int32/int64 [n] of finish reasons: 1 stop, 2 "
               "length, 3 cancelled, 4 aborted. Cancelled and aborted rows "
               "are skipped; 'length' rows below M are censored and skipped. "
               "Default: every row is a natural stop.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  o.note = Note(all);
  absl::StatusOr<AdaptReport> r = RunAdapt(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << FormatAdaptReport(*r);
  return kExitOk;
}

int Synth(const std::vector<std::string>& args, std::ostream& out,
          std::ostream& err) {
  Command cmd("synth", out, err);
  SynthCommandOptions o;
  int64_t model_seed = static_cast<int64_t>(o.generator.model_seed);
  int64_t nuisance_rank = o.generator.nuisance_rank;
  std::string domain_help;
  for (const std::string& name : readout::BuiltinDomainNames()) {
    const readout::SynthDomain dom = *readout::BuiltinDomain(name);
    absl::StrAppendFormat(&domain_help,
                          "  %-14s median %5g tokens, log_sigma %.2g, angle "
                          "%2g deg, offset %g\n",
                          dom.name, dom.median_tokens, dom.log_sigma,
                          dom.angle_deg, dom.offset);
  }
  FlagSet flags(
      "synth",
      "leapctl synth --out-features F.npy --out-lengths L.npy --n N [flags]",
      absl::StrCat(
          "Writes synthetic hidden-state-like features and output lengths.\n"
          "\n"
          "Data model: a fixed 'serving model' is drawn from --model-seed: a\n"
          "mean mu0 (with a few massive activations), per-feature scales s,\n"
          "--nuisance-rank nuisance directions f_j, a base length direction "
          "v0,\n"
          "and per domain a direction v_perp orthogonal to v0 and an offset\n"
          "direction o. A request of a domain draws its length L log-normally\n"
          "(median, log_sigma; clipped to [1, M]) and gets\n"
          "  t = (ln L - ln median) / log_sigma\n"
          "  x = mu0 + offset*sqrt(d)*s*o + s*(signal*t*v + sum_j g_j f_j + "
          "eps)\n"
          "with v = cos(angle) v0 + sin(angle) v_perp, g_j ~ N(0, "
          "nuisance^2),\n"
          "eps ~ N(0, noise^2 I). A readout fitted on one domain sees "
          "another's\n"
          "length signal only through cos(angle); RLS can learn the rest.\n"
          "Files meant to be used together must share --model-seed and --dim;\n"
          "give each file its own --seed.\n"
          "\n"
          "Built-in domains:\n",
          domain_help));
  flags.String("out-features", &o.features_path, "PATH",
               "Features to write: .npy [n, d] of --dtype.", true);
  flags.String("out-lengths", &o.lengths_path, "PATH",
               "Lengths to write: .npy int64 [n].", true);
  flags.Int64("n", &o.n, "N", "Rows to draw (>= 1).", true);
  flags.Int64("dim", &o.generator.dim, "D", "Feature width d, in [1, 16384].");
  flags.String(
      "domain", &o.domain, "NAME",
      absl::StrCat("Built-in domain: ",
                   absl::StrJoin(readout::BuiltinDomainNames(), "|"), "."));
  flags.OptionalDouble("median", &o.median_tokens, "T",
                       "Override the domain's median length in tokens (>= 1).");
  flags.OptionalDouble("log-sigma", &o.log_sigma, "S",
                       "Override the domain's sigma of ln(length) (> 0).");
  flags.OptionalDouble("angle", &o.angle_deg, "DEG",
                       "Override the angle between the domain's length "
                       "direction and the base one, in degrees.");
  flags.OptionalDouble("offset", &o.offset, "X",
                       "Override the domain's mean shift, in units of the "
                       "per-feature scale times sqrt(d).");
  flags.Double("signal", &o.generator.signal, "A",
               "Amplitude of the length signal along v (>= 0).");
  flags.Double("noise", &o.generator.noise, "B",
               "Isotropic noise amplitude (>= 0).");
  flags.Double("nuisance", &o.generator.nuisance, "C",
               "Amplitude of the nuisance factors (>= 0).");
  flags.Int64("nuisance-rank", &nuisance_rank, "R",
              "Number of nuisance directions, in [0, 1024].");
  flags.Int64("model-seed", &model_seed, "S",
              "Seed of the fixed model (directions, means, scales); >= 0.");
  flags.Int64("seed", &o.seed, "S", "Seed of the per-row draws; >= 0.");
  flags.String("dtype", &o.dtype, "float32|float16",
               "Element type of the features file.");
  flags.Int64("max-tokens", &o.generator.max_tokens, "M",
              "Output budget M: lengths are clipped to [1, M].");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (model_seed < 0) {
    return cmd.UsageError(absl::InvalidArgumentError(
        absl::StrCat("--model-seed must be >= 0, got ", model_seed)));
  }
  if (nuisance_rank < 0 || nuisance_rank > 1024) {
    return cmd.UsageError(absl::InvalidArgumentError(absl::StrCat(
        "--nuisance-rank must be in [0, 1024], got ", nuisance_rank)));
  }
  o.generator.model_seed = static_cast<uint64_t>(model_seed);
  o.generator.nuisance_rank = static_cast<int>(nuisance_rank);
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  absl::StatusOr<SynthReport> r = RunSynth(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << FormatSynthReport(*r);
  return kExitOk;
}

}  // namespace

int RunLeapctl(const std::vector<std::string>& all, std::ostream& out,
               std::ostream& err) {
  if (all.empty()) {
    err << kTopHelp;
    return kExitUsage;
  }
  const std::string& command = all[0];
  const std::vector<std::string> args(all.begin() + 1, all.end());
  if (command == "--help" || command == "-h" || command == "help") {
    if (command == "help" && !args.empty()) {
      std::vector<std::string> sub = args;
      sub.push_back("--help");
      return RunLeapctl(sub, out, err);
    }
    out << kTopHelp;
    return kExitOk;
  }
  if (command == "train") return Train(args, all, out, err);
  if (command == "eval") return Eval(args, out, err);
  if (command == "adapt") return Adapt(args, all, out, err);
  if (command == "synth") return Synth(args, out, err);
  if (command == "readouts") return internal::ReadoutsCommand(args, out, err);
  if (command == "versions") return internal::VersionsCommand(args, out, err);
  if (command == "export") return internal::ExportCommand(args, out, err);
  if (command == "dataset") return internal::DatasetCommand(args, out, err);
  if (command == "freeze") {
    return internal::AdaptationCommand(true, args, out, err);
  }
  if (command == "resume") {
    return internal::AdaptationCommand(false, args, out, err);
  }
  if (command == "route") return internal::RouteCommand(args, out, err);
  if (command == "stats") return internal::StatsCommand(args, out, err);
  if (command == "bench") return internal::BenchCommand(args, out, err);
  if (command == "feed") return internal::FeedCommand(args, out, err);
  if (command == "snapshot") return internal::SnapshotCommand(args, out, err);
  if (command == "rollback") return internal::RollbackCommand(args, out, err);
  if (command == "import") return internal::ImportCommand(args, out, err);
  if (command == "replay") return internal::ReplayCommand(args, out, err);
  err << "leapctl: error: unknown command '" << OneLine(command)
      << "' (commands: train, eval, adapt, synth, readouts, versions, export, "
         "dataset, "
         "freeze, resume, route, stats, bench, feed, snapshot, rollback, import, "
         "replay; "
         "see 'leapctl --help')"
      << std::endl;
  return kExitUsage;
}

}  // namespace leap::leapctl
