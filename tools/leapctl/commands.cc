#include "tools/leapctl/commands.h"

#include <filesystem>

#include <cstring>

#include <cstdio>

#include <cerrno>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/half.h"
#include "common/npy.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "readout/features.h"
#include "readout/readout.h"
#include "readout/rls.h"
#include "tools/leapctl/data.h"

namespace leap::leapctl {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Report(const ProgressFn& progress, const std::string& line) {
  if (progress) progress(line);
}

// Prefixes `path: ` unless the message already names the file first.
absl::Status Annotate(const absl::Status& s, const std::string& path,
                      absl::string_view what = "") {
  if (s.ok()) return s;
  std::string msg(s.message());
  if (!absl::StartsWith(msg, path)) {
    msg = absl::StrCat(path, ": ", what, msg);
  } else if (!what.empty()) {
    msg = absl::StrCat(path, ": ", what, msg.substr(path.size() + 2));
  }
  return absl::Status(s.code(), msg);
}

absl::Status Usage(absl::string_view what) {
  return absl::InvalidArgumentError(what);
}

absl::Status CheckMaxTokens(int64_t m) {
  if (m < 1 || m > readout::kMaxReportedTokens) {
    return Usage(absl::StrCat("--max-tokens must be in [1, ",
                              readout::kMaxReportedTokens, "], got ", m));
  }
  return absl::OkStatus();
}

absl::Status CheckDimMatches(const LoadedFeatures& f,
                             const readout::ReadoutState& state,
                             const std::string& readout_path) {
  if (f.cols() != state.spec.dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        f.path, ": feature width d=", f.cols(), " does not match the readout ",
        readout_path, " (dim ", state.spec.dim, ")"));
  }
  return absl::OkStatus();
}

std::string FormatNumber(double v) {
  if (std::isnan(v)) return "nan";
  return absl::StrFormat("%.4f", v);
}

nlohmann::json JsonNumber(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

// Progress every ~10% of `total` (only when `total` is large enough to take a
// noticeable time).
class Ticker {
 public:
  Ticker(const ProgressFn& progress, std::string what, int64_t total,
         int64_t min_total)
      : progress_(progress),
        what_(std::move(what)),
        total_(total),
        enabled_(total >= min_total),
        step_(std::max<int64_t>(1, total / 10)),
        next_(step_) {}
  void Tick(int64_t done) {
    if (!enabled_ || done < next_) return;
    Report(progress_, absl::StrFormat("%s: %d/%d rows", what_, done, total_));
    next_ = done + step_;
  }

 private:
  const ProgressFn& progress_;
  std::string what_;
  int64_t total_;
  bool enabled_;
  int64_t step_;
  int64_t next_;
};

}  // namespace

// ---- train -----------------------------------------------------------------

absl::Status TrainOptions::Validate() const {
  if (features_path.empty()) return Usage("missing required flag --features");
  if (lengths_path.empty()) return Usage("missing required flag --lengths");
  if (out_path.empty()) return Usage("missing required flag --out");
  if (lambda.has_value() && !(*lambda >= 0.0)) {
    return Usage(absl::StrCat("--lambda must be >= 0, got ", *lambda));
  }
  RETURN_IF_ERROR(CheckMaxTokens(max_tokens));
  if (folds < 2 || folds > 100) {
    return Usage(absl::StrCat("--folds must be in [2, 100], got ", folds));
  }
  if (layer < -1 || layer > std::numeric_limits<int32_t>::max()) {
    return Usage(absl::StrCat("--layer must be >= -1, got ", layer));
  }
  return absl::OkStatus();
}

// Whether `path` can be written, tried with a probe file beside it (and
// removed): an unwritable --out is reported before a long fit, not after.
static absl::Status CheckWritable(const std::string& path) {
  const std::string probe =
      absl::StrCat(path, ".leapctl-probe-", static_cast<long>(getpid()));
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (f == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot write ", path, ": ", std::strerror(errno),
        " (checked before fitting)"));
  }
  std::fclose(f);
  std::remove(probe.c_str());
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", path, ": it is a directory"));
  }
  return absl::OkStatus();
}

absl::StatusOr<TrainReport> RunTrain(const TrainOptions& o,
                                     const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  RETURN_IF_ERROR(CheckWritable(o.out_path));
  const auto t0 = Clock::now();
  Report(progress, absl::StrCat("reading ", o.features_path));
  ASSIGN_OR_RETURN(LabeledFeatures in,
                   LoadLabeledFeatures(o.features_path, o.lengths_path, ""));
  LoadedFeatures& f = in.features;
  std::vector<int64_t>& lengths = in.lengths;
  Report(progress, absl::StrFormat("fitting ridge readout: n=%d d=%d %s",
                                   f.rows(), f.cols(),
                                   o.lambda.has_value()
                                       ? absl::StrCat("lambda=", *o.lambda)
                                       : absl::StrCat(o.folds, "-fold CV")));

  readout::RidgeOptions ro;
  ro.lambda = o.lambda;
  ro.folds = static_cast<int>(o.folds);
  ro.max_tokens = o.max_tokens;
  ro.compute_p0 = !o.no_p;
  ro.progress = progress;
  absl::StatusOr<readout::RidgeResult> fit = FitRidge(f.matrix, lengths, ro);
  if (!fit.ok()) return Annotate(fit.status(), o.features_path, "fit failed: ");

  readout::ReadoutState state;
  state.spec.dim = f.cols();
  state.spec.layer = static_cast<int32_t>(o.layer);
  state.spec.model_id = o.model_id;
  state.spec.max_tokens = o.max_tokens;
  state.spec.lambda = fit->lambda;
  state.standardizer = std::move(fit->standardizer);
  state.theta = std::move(fit->theta);
  if (!o.no_p) state.p = std::move(fit->p0);
  state.version = 1;
  state.completions_learned = 0;
  state.train_rows = f.rows();
  state.note = o.note;
  state.created_unix_ms = UnixMs();
  RETURN_IF_ERROR(Annotate(state.Validate(), o.features_path,
                           "fitted readout is invalid: "));
  Report(progress, absl::StrCat("writing ", o.out_path));
  RETURN_IF_ERROR(Annotate(readout::WriteArtifact(o.out_path, state),
                           o.out_path, "cannot write artifact: "));

  TrainReport r;
  r.n = f.rows();
  r.d = f.cols();
  r.lambda = fit->lambda;
  r.cv = fit->cv;
  r.folds = o.folds;
  r.train_mse = fit->train_mse;
  r.has_p = state.p.has_value();
  r.seconds = SecondsSince(t0);
  r.out_path = o.out_path;
  return r;
}

std::string FormatTrainReport(const TrainReport& r) {
  std::string s = absl::StrFormat("n: %d\nd: %d\n", r.n, r.d);
  if (r.cv.empty()) {
    absl::StrAppendFormat(&s, "lambda: %.6g (given)\n", r.lambda);
  } else {
    absl::StrAppendFormat(&s, "lambda: %.6g (chosen by %d-fold CV)\n", r.lambda,
                          r.folds);
    absl::StrAppend(&s, "cv:\n");
    absl::StrAppendFormat(&s, "  %12s  %10s  %14s\n", "lambda", "lambda/n",
                          "held-out mse");
    for (const readout::CvPoint& p : r.cv) {
      absl::StrAppendFormat(&s, "  %12.6g  %10.3g  %14.6g%s\n", p.lambda,
                            p.relative_lambda, p.mse,
                            p.lambda == r.lambda ? "  <- chosen" : "");
    }
  }
  absl::StrAppendFormat(&s, "train_mse: %.6g (sqrt-token target)\n",
                        r.train_mse);
  absl::StrAppendFormat(&s, "rls_matrix_p: %s\n", r.has_p ? "yes" : "no");
  absl::StrAppendFormat(&s, "time_s: %.3f\n", r.seconds);
  absl::StrAppendFormat(&s, "out: %s\n", r.out_path);
  return s;
}

// ---- eval ------------------------------------------------------------------

absl::Status EvalOptions::Validate() const {
  if (readout_path.empty()) return Usage("missing required flag --readout");
  if (features_path.empty()) return Usage("missing required flag --features");
  if (lengths_path.empty()) return Usage("missing required flag --lengths");
  return absl::OkStatus();
}

absl::StatusOr<EvalReport> RunEval(const EvalOptions& o,
                                   const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(readout::ReadoutState state,
                   readout::ReadArtifact(o.readout_path));
  Report(progress, absl::StrCat("reading ", o.features_path));
  ASSIGN_OR_RETURN(
      LabeledFeatures in,
      LoadLabeledFeatures(o.features_path, o.lengths_path, "",
                          [&](const LoadedFeatures& x) {
                            return CheckDimMatches(x, state, o.readout_path);
                          }));
  LoadedFeatures& f = in.features;
  std::vector<int64_t>& lengths = in.lengths;

  const readout::FoldedReadout folded = state.Fold();
  std::vector<double> predicted(f.rows());
  std::vector<double> truth(f.rows());
  Ticker ticker(progress, "predicting", f.rows(), 100000);
  for (int64_t i = 0; i < f.rows(); ++i) {
    absl::StatusOr<double> p = folded.PredictTokens(f.matrix.Row(i));
    if (!p.ok()) {
      return Annotate(p.status(), o.features_path,
                      absl::StrCat("row ", i, ": "));
    }
    predicted[i] = *p;
    truth[i] = static_cast<double>(lengths[i]);
    ticker.Tick(i + 1);
  }
  EvalReport r;
  r.n = f.rows();
  r.spearman = readout::Spearman(predicted, truth);
  r.kendall_tau = readout::KendallTauB(predicted, truth);
  r.errors = readout::LengthErrors(predicted, truth);
  r.seconds = SecondsSince(t0);
  return r;
}

std::string FormatEvalReport(const EvalReport& r) {
  const readout::LengthErrorReport& e = r.errors;
  std::string s = absl::StrFormat("n: %d\n", r.n);
  absl::StrAppend(&s, "spearman: ", FormatNumber(r.spearman), "\n");
  absl::StrAppend(&s, "kendall_tau: ", FormatNumber(r.kendall_tau), "\n");
  absl::StrAppendFormat(&s, "mae: %s tokens\n", FormatNumber(e.mae));
  absl::StrAppendFormat(&s, "mae <=256: %s (n=%d)\n", FormatNumber(e.mae_short),
                        e.n_short);
  absl::StrAppendFormat(&s, "mae 257-1024: %s (n=%d)\n",
                        FormatNumber(e.mae_medium), e.n_medium);
  absl::StrAppendFormat(&s, "mae >1024: %s (n=%d)\n", FormatNumber(e.mae_long),
                        e.n_long);
  absl::StrAppendFormat(&s, "time_s: %.3f\n", r.seconds);
  return s;
}

std::string FormatEvalJson(const EvalReport& r) {
  const readout::LengthErrorReport& e = r.errors;
  nlohmann::json j;
  j["n"] = r.n;
  j["spearman"] = JsonNumber(r.spearman);
  j["kendall_tau"] = JsonNumber(r.kendall_tau);
  j["mae"] = JsonNumber(e.mae);
  nlohmann::json buckets;
  buckets["le_256"] = e.n_short > 0 ? JsonNumber(e.mae_short) : nullptr;
  buckets["257_1024"] = e.n_medium > 0 ? JsonNumber(e.mae_medium) : nullptr;
  buckets["gt_1024"] = e.n_long > 0 ? JsonNumber(e.mae_long) : nullptr;
  j["mae_by_bucket"] = std::move(buckets);
  return j.dump() + "\n";
}

// ---- adapt -----------------------------------------------------------------

absl::Status AdaptOptions::Validate() const {
  if (readout_path.empty()) return Usage("missing required flag --readout");
  if (features_path.empty()) return Usage("missing required flag --features");
  if (lengths_path.empty()) return Usage("missing required flag --lengths");
  if (out_path.empty()) return Usage("missing required flag --out");
  if (batch < 1 || batch > 65536) {
    return Usage(absl::StrCat("--batch must be in [1, 65536], got ", batch));
  }
  return absl::OkStatus();
}

absl::StatusOr<AdaptReport> RunAdapt(const AdaptOptions& o,
                                     const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(readout::ReadoutState state,
                   readout::ReadArtifact(o.readout_path));
  if (!state.p.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        o.readout_path,
        ": readout has no RLS matrix P (it was trained with --no-p); "
        "retrain without --no-p to adapt it"));
  }
  Report(progress, absl::StrCat("reading ", o.features_path));
  ASSIGN_OR_RETURN(
      LabeledFeatures in,
      LoadLabeledFeatures(o.features_path, o.lengths_path,
                          o.finish_reasons_path, [&](const LoadedFeatures& x) {
                            return CheckDimMatches(x, state, o.readout_path);
                          }));
  LoadedFeatures& f = in.features;
  std::vector<int64_t>& lengths = in.lengths;
  std::vector<int32_t>& reasons = in.reasons;

  const int64_t d = f.cols();
  const int64_t ld = d + 1;
  const int64_t m = state.spec.max_tokens;
  readout::RlsState rls(std::move(state.theta), std::move(*state.p));
  state.p.reset();

  AdaptReport r;
  r.rows = f.rows();
  std::vector<float> u(static_cast<size_t>(o.batch * ld));
  std::vector<double> y;
  y.reserve(o.batch);
  int64_t batch_first_row = 0;
  Clock::duration update_time{};
  const auto apply = [&](int64_t last_row) -> absl::Status {
    if (y.empty()) return absl::OkStatus();
    const auto t = Clock::now();
    absl::Status s = rls.Update(u.data(), ld, y);
    update_time += Clock::now() - t;
    if (!s.ok()) {
      return absl::Status(
          s.code(),
          absl::StrCat(o.readout_path, ": RLS update ", r.batches + 1,
                       " failed (rows ", batch_first_row, "..", last_row,
                       " of ", o.features_path, "): ", s.message()));
    }
    ++r.batches;
    r.learned += static_cast<int64_t>(y.size());
    y.clear();
    return absl::OkStatus();
  };

  Report(progress, absl::StrFormat("adapting: %d rows, batches of %d, d=%d",
                                   f.rows(), o.batch, d));
  Ticker ticker(progress, "adapt", f.rows(), 1000);
  for (int64_t i = 0; i < f.rows(); ++i) {
    if (!reasons.empty()) {
      const auto reason = static_cast<readout::FinishReason>(reasons[i]);
      absl::StatusOr<readout::FeedbackAction> action =
          readout::ClassifyFeedback(lengths[i], reason, 0, m);
      if (!action.ok()) {
        return Annotate(action.status(), o.finish_reasons_path,
                        absl::StrCat("row ", i, ": "));
      }
      if (*action == readout::FeedbackAction::kSkipCancelled) {
        ++(reason == readout::FinishReason::kAborted ? r.skipped_aborted
                                                     : r.skipped_cancelled);
        continue;
      }
      if (*action == readout::FeedbackAction::kSkipCensored) {
        ++r.skipped_censored;
        continue;
      }
    }
    if (y.empty()) batch_first_row = i;
    state.standardizer.Augment(f.matrix.Row(i),
                               u.data() + static_cast<int64_t>(y.size()) * ld);
    y.push_back(readout::TargetFromTokens(lengths[i], m));
    if (static_cast<int64_t>(y.size()) == o.batch) RETURN_IF_ERROR(apply(i));
    ticker.Tick(i + 1);
  }
  RETURN_IF_ERROR(apply(f.rows() - 1));

  {
    const auto t = Clock::now();
    RETURN_IF_ERROR(Annotate(rls.CheckHealth(), o.readout_path,
                             "adapted RLS state is unhealthy: "));
    state.theta = rls.theta();
    state.p = rls.P();  // flushes pending columns; copies P
    update_time += Clock::now() - t;
  }
  state.version += 1;
  state.completions_learned += r.learned;
  state.note =
      state.note.empty() ? o.note : absl::StrCat(state.note, " ; ", o.note);
  state.created_unix_ms = UnixMs();
  RETURN_IF_ERROR(Annotate(state.Validate(), o.readout_path,
                           "adapted readout is invalid: "));
  Report(progress, absl::StrCat("writing ", o.out_path));
  RETURN_IF_ERROR(Annotate(readout::WriteArtifact(o.out_path, state),
                           o.out_path, "cannot write artifact: "));
  r.version = state.version;
  r.completions_learned = state.completions_learned;
  r.update_seconds = std::chrono::duration<double>(update_time).count();
  r.seconds = SecondsSince(t0);
  r.out_path = o.out_path;
  return r;
}

std::string FormatAdaptReport(const AdaptReport& r) {
  std::string s = absl::StrFormat("rows: %d\nlearned: %d\n", r.rows, r.learned);
  absl::StrAppendFormat(
      &s, "skipped: %d (cancelled=%d aborted=%d censored_length=%d)\n",
      r.skipped_cancelled + r.skipped_aborted + r.skipped_censored,
      r.skipped_cancelled, r.skipped_aborted, r.skipped_censored);
  absl::StrAppendFormat(&s, "batches: %d\n", r.batches);
  const double rate = r.update_seconds > 0
                          ? static_cast<double>(r.learned) / r.update_seconds
                          : 0.0;
  absl::StrAppendFormat(&s, "throughput: %.1f completions/s (RLS updates)\n",
                        rate);
  absl::StrAppendFormat(&s, "update_time_s: %.3f\n", r.update_seconds);
  absl::StrAppendFormat(&s, "time_s: %.3f\n", r.seconds);
  absl::StrAppendFormat(&s, "version: %d\ncompletions_learned: %d\n", r.version,
                        r.completions_learned);
  absl::StrAppendFormat(&s, "out: %s\n", r.out_path);
  return s;
}

// ---- synth -----------------------------------------------------------------

absl::Status SynthCommandOptions::Validate() const {
  if (features_path.empty()) {
    return Usage("missing required flag --out-features");
  }
  if (lengths_path.empty()) return Usage("missing required flag --out-lengths");
  if (n < 1) return Usage(absl::StrCat("--n must be >= 1, got ", n));
  if (generator.dim < readout::kMinDim || generator.dim > readout::kMaxDim) {
    return Usage(absl::StrCat("--dim must be in [", readout::kMinDim, ", ",
                              readout::kMaxDim, "], got ", generator.dim));
  }
  // Keep the in-memory matrix under 64 GiB (and n * d from overflowing).
  if (n > (int64_t{16} << 30) / generator.dim) {
    return Usage(absl::StrCat("--n ", n, " x --dim ", generator.dim,
                              " is too large (limit 2^34 elements)"));
  }
  RETURN_IF_ERROR(CheckMaxTokens(generator.max_tokens));
  if (seed < 0) return Usage("--seed must be >= 0");
  if (!(generator.signal >= 0) || !(generator.noise >= 0) ||
      !(generator.nuisance >= 0)) {
    return Usage("--signal, --noise and --nuisance must be >= 0");
  }
  if (generator.nuisance_rank < 0 || generator.nuisance_rank > 1024) {
    return Usage("--nuisance-rank must be in [0, 1024]");
  }
  if (median_tokens.has_value() && !(*median_tokens >= 1)) {
    return Usage(absl::StrCat("--median must be >= 1, got ", *median_tokens));
  }
  if (log_sigma.has_value() && !(*log_sigma > 0)) {
    return Usage(absl::StrCat("--log-sigma must be > 0, got ", *log_sigma));
  }
  if (dtype != "float32" && dtype != "float16") {
    return Usage(
        absl::StrCat("--dtype must be float32 or float16, got '", dtype, "'"));
  }
  absl::StatusOr<readout::SynthDomain> dom = readout::BuiltinDomain(domain);
  if (!dom.ok())
    return Usage(absl::StrCat("--domain: ", dom.status().message()));
  return absl::OkStatus();
}

absl::StatusOr<SynthReport> RunSynth(const SynthCommandOptions& o,
                                     const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const auto t0 = Clock::now();
  ASSIGN_OR_RETURN(readout::SynthDomain domain,
                   readout::BuiltinDomain(o.domain));
  if (o.median_tokens.has_value()) domain.median_tokens = *o.median_tokens;
  if (o.log_sigma.has_value()) domain.log_sigma = *o.log_sigma;
  if (o.angle_deg.has_value()) domain.angle_deg = *o.angle_deg;
  if (o.offset.has_value()) domain.offset = *o.offset;
  ASSIGN_OR_RETURN(readout::SynthGenerator gen,
                   readout::SynthGenerator::Create(o.generator));

  const int64_t n = o.n;
  const int64_t d = o.generator.dim;
  const bool fp16 = o.dtype == "float16";
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  std::vector<float> row;
  if (fp16) {
    f16.resize(static_cast<size_t>(n * d));
    row.resize(static_cast<size_t>(d));
  } else {
    f32.resize(static_cast<size_t>(n * d));
  }
  std::vector<int64_t> lengths(static_cast<size_t>(n));
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed));
  Report(progress,
         absl::StrFormat("drawing %d rows of d=%d (%s)", n, d, domain.name));
  Ticker ticker(progress, "synth", n, 2'000'000 / d + 1);
  for (int64_t i = 0; i < n; ++i) {
    float* x = fp16 ? row.data() : f32.data() + i * d;
    lengths[i] = gen.Draw(domain, rng, x);
    if (fp16) {
      uint16_t* h = f16.data() + i * d;
      for (int64_t j = 0; j < d; ++j) h[j] = FloatToFp16(x[j]);
    }
    ticker.Tick(i + 1);
  }

  const int64_t shape[2] = {n, d};
  Report(progress, absl::StrCat("writing ", o.features_path));
  RETURN_IF_ERROR(Annotate(
      fp16 ? WriteNpy(o.features_path, NpyDType::kFloat16, shape, f16.data())
           : WriteNpy(o.features_path, NpyDType::kFloat32, shape, f32.data()),
      o.features_path, "cannot write: "));
  const int64_t lshape[1] = {n};
  RETURN_IF_ERROR(Annotate(
      WriteNpy(o.lengths_path, NpyDType::kInt64, lshape, lengths.data()),
      o.lengths_path, "cannot write: "));

  SynthReport r;
  r.n = n;
  r.d = d;
  r.domain = domain;
  r.dtype = o.dtype;
  std::vector<int64_t> sorted = lengths;
  std::sort(sorted.begin(), sorted.end());
  r.median_length =
      n % 2 == 1 ? static_cast<double>(sorted[n / 2])
                 : 0.5 * static_cast<double>(sorted[n / 2 - 1] + sorted[n / 2]);
  double sum = 0;
  for (int64_t l : lengths) sum += static_cast<double>(l);
  r.mean_length = sum / static_cast<double>(n);
  r.seconds = SecondsSince(t0);
  r.features_path = o.features_path;
  r.lengths_path = o.lengths_path;
  return r;
}

std::string FormatSynthReport(const SynthReport& r) {
  std::string s =
      absl::StrFormat("n: %d\nd: %d\ndtype: %s\n", r.n, r.d, r.dtype);
  absl::StrAppendFormat(
      &s, "domain: %s (median=%g log_sigma=%g angle=%g offset=%g)\n",
      r.domain.name, r.domain.median_tokens, r.domain.log_sigma,
      r.domain.angle_deg, r.domain.offset);
  absl::StrAppendFormat(&s, "length_median: %g\nlength_mean: %.1f\n",
                        r.median_length, r.mean_length);
  absl::StrAppendFormat(&s, "time_s: %.3f\n", r.seconds);
  absl::StrAppendFormat(&s, "features: %s\nlengths: %s\n", r.features_path,
                        r.lengths_path);
  return s;
}

}  // namespace leap::leapctl
