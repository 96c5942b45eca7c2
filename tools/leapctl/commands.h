// The logic of leapctl's subcommands, callable without a process: each
// command is an options struct (with documented defaults and Validate()), a
// Run function returning a report or an error Status, and a formatter for
// the report. tools/leapctl/cli.h maps command lines onto these.
//
// Every error Status names the file at fault first ("f.npy: ..."). Progress
// lines for slow steps go to the `progress` callback (stderr in the CLI).
// Functions are thread-compatible: concurrent calls on different files are
// fine.
#ifndef LEAP_TOOLS_LEAPCTL_COMMANDS_H_
#define LEAP_TOOLS_LEAPCTL_COMMANDS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/progress.h"
#include "readout/ridge.h"
#include "readout/stats.h"
#include "readout/synth.h"
#include "readout/target.h"

namespace leap::leapctl {

using ::leap::ProgressFn;  // common/progress.h

// ---- train -----------------------------------------------------------------

// Inputs of `leapctl train`.
struct TrainOptions {
  // Feature matrix (.npy float32/float16 [n, d]). Required.
  std::string features_path;
  // Output lengths (.npy int32/int64 [n]). Required.
  std::string lengths_path;
  // Artifact to write (.leapr). Required.
  std::string out_path;
  // Ridge penalty; chosen by cross-validation when unset.
  std::optional<double> lambda;
  // Output budget M. Default: 2048
  int64_t max_tokens = readout::kDefaultMaxTokens;
  // Layer the features come from, recorded in the artifact. Default: -1
  int64_t layer = -1;
  // Serving model id, recorded in the artifact. Default: empty
  std::string model_id;
  // Cross-validation folds (only when lambda is unset). Default: 5
  int64_t folds = 5;
  // Skip P0 (a frozen readout that cannot be adapted). Default: false
  bool no_p = false;
  // Stored as the artifact's note (the command line).
  std::string note;

  // InvalidArgument (a usage error) for a missing path or a value out of
  // range.
  absl::Status Validate() const;
};

// What `leapctl train` did (printed on stdout).
struct TrainReport {
  int64_t n = 0;
  int64_t d = 0;
  double lambda = 0;
  // Empty when lambda was given.
  std::vector<readout::CvPoint> cv;
  int64_t folds = 0;
  double train_mse = 0;
  bool has_p = false;
  double seconds = 0;
  std::string out_path;
};

// Loads and checks the files, fits the ridge readout (FitRidge) and writes a
// version-1 artifact with P0 unless no_p.
absl::StatusOr<TrainReport> RunTrain(const TrainOptions& options,
                                     const ProgressFn& progress);
// Human-readable "key: value" lines, with the CV table when there is one.
std::string FormatTrainReport(const TrainReport& report);

// ---- eval ------------------------------------------------------------------

// Inputs of `leapctl eval`.
struct EvalOptions {
  // Readout artifact (.leapr). Required.
  std::string readout_path;
  // Feature matrix and true output lengths. Required.
  std::string features_path;
  std::string lengths_path;

  // InvalidArgument (a usage error) for a missing path or a value out of
  // range.
  absl::Status Validate() const;
};

// Metrics of predicted vs. true tokens.
struct EvalReport {
  int64_t n = 0;
  // Predicted vs. true tokens; NaN when undefined (e.g. constant
  // predictions).
  double spearman = 0;
  double kendall_tau = 0;
  readout::LengthErrorReport errors;
  double seconds = 0;
};

// Predicts every row with the folded readout and scores the predictions.
absl::StatusOr<EvalReport> RunEval(const EvalOptions& options,
                                   const ProgressFn& progress);
// Human-readable lines.
std::string FormatEvalReport(const EvalReport& report);
// One JSON object: {"n", "spearman", "kendall_tau", "mae", "mae_by_bucket":
// {"le_256", "257_1024", "gt_1024"}}; NaN and empty buckets are null.
std::string FormatEvalJson(const EvalReport& report);

// ---- adapt -----------------------------------------------------------------

// Inputs of `leapctl adapt`.
struct AdaptOptions {
  // Readout artifact to start from; must contain P. Required.
  std::string readout_path;
  // Features and true lengths of finished requests, learned in row order.
  // Required.
  std::string features_path;
  std::string lengths_path;
  // Adapted artifact to write. Required.
  std::string out_path;
  // Completions per RLS update. Default: 8
  int64_t batch = 8;
  // Optional int32/int64 .npy of FinishReason codes, one per row; rows are
  // then filtered through ClassifyFeedback. Empty: every row is learned.
  std::string finish_reasons_path;
  // Appended to the artifact's note (the command line).
  std::string note;

  // InvalidArgument (a usage error) for a missing path or a value out of
  // range.
  absl::Status Validate() const;
};

// What `leapctl adapt` did.
struct AdaptReport {
  int64_t rows = 0;
  int64_t learned = 0;
  int64_t batches = 0;
  // Skipped rows by finish reason.
  int64_t skipped_cancelled = 0;
  int64_t skipped_aborted = 0;
  int64_t skipped_censored = 0;     // finish reason "length" below M
  int64_t version = 0;              // of the written artifact
  int64_t completions_learned = 0;  // total, in the written artifact
  double update_seconds = 0;        // RLS updates only
  double seconds = 0;               // whole command
  std::string out_path;
};

// Runs batched RLS from the artifact's (theta, P) over the rows in order
// and writes the next version. FailedPrecondition when the artifact has no P.
absl::StatusOr<AdaptReport> RunAdapt(const AdaptOptions& options,
                                     const ProgressFn& progress);
// Human-readable "key: value" lines.
std::string FormatAdaptReport(const AdaptReport& report);

// ---- synth -----------------------------------------------------------------

// Inputs of `leapctl synth`.
struct SynthCommandOptions {
  // Output files. Required.
  std::string features_path;
  std::string lengths_path;
  // Rows to draw. Required, >= 1.
  int64_t n = 0;
  // Generator (dim, max_tokens, model_seed, signal, noise, nuisance).
  readout::SynthOptions generator;
  // Built-in domain name; see readout::BuiltinDomainNames(). Default: chat
  std::string domain = "chat";
  // Overrides of the domain's fields.
  std::optional<double> median_tokens;
  std::optional<double> log_sigma;
  std::optional<double> angle_deg;
  std::optional<double> offset;
  // Seed of the per-row draws. Default: 1
  int64_t seed = 1;
  // "float32" or "float16". Default: float32
  std::string dtype = "float32";

  // InvalidArgument (a usage error) for a missing path or a value out of
  // range.
  absl::Status Validate() const;
};

// What `leapctl synth` wrote.
struct SynthReport {
  int64_t n = 0;
  int64_t d = 0;
  readout::SynthDomain domain;
  std::string dtype;
  double median_length = 0;
  double mean_length = 0;
  double seconds = 0;
  std::string features_path;
  std::string lengths_path;
};

// Draws n rows with readout::SynthGenerator and writes both files
// (atomically, each).
absl::StatusOr<SynthReport> RunSynth(const SynthCommandOptions& options,
                                     const ProgressFn& progress);
// Human-readable "key: value" lines.
std::string FormatSynthReport(const SynthReport& report);

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_COMMANDS_H_
