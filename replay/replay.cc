#include "replay/replay.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "client/process.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "readout/synth.h"
#include "common/file.h"
#include "client/engine_connection.h"
#include "replay/leap_driver.h"
#include "sidecar/core/length_prior.h"

namespace leap::replay {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Length-aware admission's prior: one LengthPrior per product line (the
// request's segment: the traffic before and after a shift), from the
// prompt length (the traces carry no max_tokens: every request has the
// budget), learned from every completion.
class OnlineAdmissionPrior : public AdmissionPrior {
 public:
  explicit OnlineAdmissionPrior(int64_t budget)
      : priors_([budget] {
          core::LengthPriorOptions o;
          o.budget = budget;
          return o;
        }()) {}
  std::optional<double> At(const SimRequest& r) override {
    return priors_.Predict(Line(r), {r.prompt_tokens, 0});
  }
  absl::Status Learn(const SimRequest& r) override {
    return priors_.Learn(Line(r), {r.prompt_tokens, 0},
                         std::max<int64_t>(r.output_tokens, 1));
  }

 private:
  static std::string Line(const SimRequest& r) {
    return absl::StrCat("segment-", r.segment);
  }
  core::LengthPriors priors_;
};

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A built-in domain whose length scale is the segment's own: median and
// sigma of ln(length) of `lengths`, so the features carry a unit-variance
// length signal whatever the trace (the direction and offset stay the
// domain's).
readout::SynthDomain FitDomain(readout::SynthDomain d,
                               std::vector<int64_t> lengths) {
  if (lengths.empty()) return d;
  std::sort(lengths.begin(), lengths.end());
  d.median_tokens =
      static_cast<double>(std::max<int64_t>(lengths[lengths.size() / 2], 1));
  double mean = 0, sq = 0;
  for (int64_t l : lengths)
    mean += std::log(static_cast<double>(std::max<int64_t>(l, 1)));
  mean /= static_cast<double>(lengths.size());
  for (int64_t l : lengths) {
    const double v =
        std::log(static_cast<double>(std::max<int64_t>(l, 1))) - mean;
    sq += v * v;
  }
  d.log_sigma =
      std::max(0.05, std::sqrt(sq / static_cast<double>(lengths.size())));
  return d;
}

absl::StatusOr<shim::UnpredictedPolicy> ParseUnpredicted(absl::string_view s) {
  if (s == "median") return shim::UnpredictedPolicy::kMedian;
  if (s == "fixed") return shim::UnpredictedPolicy::kFixed;
  if (s == "first") return shim::UnpredictedPolicy::kFirst;
  if (s == "last") return shim::UnpredictedPolicy::kLast;
  return absl::InvalidArgumentError(absl::StrCat(
      "--unpredicted must be median, fixed, first or last, got '", s, "'"));
}

nlohmann::json JsonNumber(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

}  // namespace

const std::vector<LearnedPreset>& LearnedPresets() {
  static const auto* presets = new std::vector<LearnedPreset>{
      {"ltr", 0.65, 0.50, 2.5,
       "separate ranking model (110-185M-parameter class); the paper's "
       "strongest baseline, so the best ranking of the presets"},
      {"tie", 0.60, 0.40, 2.0,
       "separate text encoder (110-185M) with an uncertainty head; ranks below "
       "frozen LEAP after a shift (the paper: frozen LEAP at 0.498 on Aya "
       "still schedules better than TIE)"},
      {"ssjf", 0.55, 0.40, 1.5,
       "small proxy model (BERT-base class, ~110M) on the prompt"},
      {"egtp", 0.60, 0.45, 3.0,
       "hidden states pooled by per-token entropy: needs the logits of every "
       "prompt token (vocabulary x d x prompt length FLOPs)"},
      {"trail", 0.50, 0.40, 1.0,
       "MLP (millions of parameters) on hidden states, refreshed during "
       "decode (cost amortized per request); the weakest in the paper"},
  };
  return *presets;
}

absl::StatusOr<std::vector<PolicySpec>> ParsePolicies(absl::string_view list) {
  std::vector<std::string> tokens;
  for (absl::string_view t : absl::StrSplit(list, ',')) {
    t = absl::StripAsciiWhitespace(t);
    if (t.empty()) continue;
    // A learned spec's own parameters (rho=, cost=, shift_rho=) continue it.
    const absl::string_view key = t.substr(0, t.find('='));
    if (!absl::StrContains(t, ':') && absl::StrContains(t, '=') &&
        (key == "rho" || key == "cost" || key == "shift_rho") &&
        !tokens.empty() && absl::StartsWith(tokens.back(), "learned:")) {
      absl::StrAppend(&tokens.back(), ",", t);
    } else if (key == "aging" && !tokens.empty() &&
               absl::StrContains(tokens.back(), "+bounded") &&
               !absl::StrContains(tokens.back(), ",aging=") &&
               !absl::EndsWith(tokens.back(), "+prior")) {
      // "+bounded=S,aging=A": the bound's own linear aging continues it.
      absl::StrAppend(&tokens.back(), ",", t);
    } else {
      tokens.push_back(std::string(t));
    }
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError("--policies is empty");
  }
  std::vector<PolicySpec> out;
  std::set<std::string> seen;
  const auto add = [&](PolicySpec p) -> absl::Status {
    if (!seen.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy '", p.name, "' is listed twice"));
    }
    out.push_back(std::move(p));
    return absl::OkStatus();
  };
  const auto preset = [](const LearnedPreset& lp) {
    PolicySpec p;
    p.kind = PolicySpec::Kind::kLearned;
    p.name = lp.name;
    p.rho = lp.rho;
    p.shift_rho = lp.shift_rho;
    p.cost_ms = lp.cost_ms;
    return p;
  };
  for (const std::string& full : tokens) {
    std::string token = full;
    const bool prior_admission = absl::EndsWith(token, "+prior");
    if (prior_admission) token.resize(token.size() - 6);
    if (prior_admission && (token == "fcfs" || token == "baselines")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy '", full, "': ", token, " takes no +prior"));
    }
    std::string t = token;
    std::string disc;
    if (const size_t plus = token.find('+'); plus != std::string::npos) {
      t = token.substr(0, plus);
      disc = token.substr(plus + 1);
    }
    PolicySpec p;
    p.name = t;
    if (const size_t c = disc.find(",aging="); c != std::string::npos) {
      const std::string a = disc.substr(c + 7);
      double v = 0;
      if (!absl::SimpleAtod(a, &v) || !std::isfinite(v) || v < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "policy '", token, "': the bound's aging rate must be >= 0, got '",
            a, "'"));
      }
      p.bounded_aging = v;
      disc.resize(c);
    }
    if (!disc.empty() || token.find('+') != std::string::npos) {
      if (t == "fcfs" || t == "baselines") {
        return absl::InvalidArgumentError(absl::StrCat(
            "policy '", token, "': ", t, " takes no discipline"));
      }
      std::pair<absl::string_view, absl::string_view> kv =
          absl::StrSplit(disc, absl::MaxSplits('=', 1));
      const bool has_value = disc.find('=') != std::string::npos;
      double v = 0;
      if (has_value &&
          (!absl::SimpleAtod(kv.second, &v) || !std::isfinite(v))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "policy '", token, "': bad knob '", kv.second, "'"));
      }
      p.has_discipline = true;
      if (kv.first == "bounded" || kv.first == "bounded-ratio") {
        p.discipline = shim::SchedulingPolicy::kBounded;
        p.ratio_calibration = kv.first == "bounded-ratio";
        p.knob = has_value ? v : kDefaultSlowdown;
        if (p.knob < 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              "policy '", token, "': the slowdown S must be >= 1"));
        }
      } else if (kv.first == "target") {
        p.discipline = shim::SchedulingPolicy::kBounded;
        p.latency_target = true;
        p.knob = has_value ? v : kDefaultTarget;
        if (!(p.knob > 0)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "policy '", token,
              "': the target (a multiple of FCFS's P99) must be > 0"));
        }
        if (!seen.contains("fcfs")) {
          return absl::InvalidArgumentError(absl::StrCat(
              "policy '", token,
              "': +target=X needs fcfs listed before it (its latency target "
              "is X times FCFS's P99 latency at each load)"));
        }
      } else if (kv.first == "aging") {
        p.discipline = shim::SchedulingPolicy::kLinearAging;
        p.knob = has_value ? v : kDefaultLinearAging;
        if (p.knob < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "policy '", token, "': the aging rate must be >= 0"));
        }
      } else if (kv.first == "hrrn" && !has_value) {
        p.discipline = shim::SchedulingPolicy::kHrrn;
      } else if (kv.first == "countdown" && !has_value) {
        p.discipline = shim::SchedulingPolicy::kCountdown;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "policy '", token, "': unknown discipline '", disc,
            "' (bounded[=S][,aging=A], bounded-ratio[=S][,aging=A], "
            "target[=X], aging[=A], hrrn, countdown)"));
      }
      if (p.bounded_aging.has_value() &&
          (p.discipline != shim::SchedulingPolicy::kBounded ||
           p.latency_target)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "policy '", token, "': ',aging=A' follows only +bounded[=S] or "
            "+bounded-ratio[=S]"));
      }
    }
    if (t == "fcfs") {
      p.kind = PolicySpec::Kind::kFcfs;
    } else if (t == "oracle") {
      p.kind = PolicySpec::Kind::kOracle;
    } else if (t == "leap") {
      p.kind = PolicySpec::Kind::kLeap;
    } else if (t == "leap-rls") {
      p.kind = PolicySpec::Kind::kLeapRls;
    } else if (t == "baselines") {
      for (const LearnedPreset& lp : LearnedPresets()) {
        RETURN_IF_ERROR(add(preset(lp)));
      }
      continue;
    } else if (absl::StartsWith(t, "learned:")) {
      p.kind = PolicySpec::Kind::kLearned;
      bool have_rho = false;
      for (absl::string_view kv :
           absl::StrSplit(absl::string_view(t).substr(8), ',')) {
        std::pair<absl::string_view, absl::string_view> parts =
            absl::StrSplit(kv, absl::MaxSplits('=', 1));
        absl::string_view value = parts.second;
        double v = 0;
        if (parts.first == "cost") absl::ConsumeSuffix(&value, "ms");
        if (!absl::SimpleAtod(value, &v) || !std::isfinite(v)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "policy '", t,
              "': expected rho=R, cost=Cms or shift_rho=S, got '", kv, "'"));
        }
        if (parts.first == "rho" || parts.first == "shift_rho") {
          if (v < -1 || v > 1) {
            return absl::InvalidArgumentError(absl::StrCat(
                "policy '", t, "': ", parts.first, " must be in [-1, 1]"));
          }
          if (parts.first == "rho") {
            p.rho = v;
            have_rho = true;
          } else {
            p.shift_rho = v;
          }
        } else if (parts.first == "cost") {
          if (v < 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("policy '", t, "': cost must be >= 0"));
          }
          p.cost_ms = v;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("policy '", t, "': unknown parameter '", parts.first,
                           "' (rho, cost, shift_rho)"));
        }
      }
      if (!have_rho) {
        return absl::InvalidArgumentError(
            absl::StrCat("policy '", t, "': rho=R is required"));
      }
      p.name = absl::StrFormat("learned:rho=%g,cost=%gms", p.rho, p.cost_ms);
      if (p.shift_rho.has_value()) {
        absl::StrAppendFormat(&p.name, ",shift_rho=%g", *p.shift_rho);
      }
    } else {
      auto it =
          std::find_if(LearnedPresets().begin(), LearnedPresets().end(),
                       [&](const LearnedPreset& lp) { return lp.name == t; });
      if (it == LearnedPresets().end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "unknown policy '", t,
            "' (fcfs, oracle, leap, leap-rls, tie, ssjf, ltr, trail, egtp, "
            "baselines, learned:rho=R,cost=Cms[,shift_rho=S])"));
      }
      PolicySpec q = preset(*it);
      q.has_discipline = p.has_discipline;
      q.discipline = p.discipline;
      q.knob = p.knob;
      q.ratio_calibration = p.ratio_calibration;
      q.bounded_aging = p.bounded_aging;
      q.latency_target = p.latency_target;
      p = std::move(q);
    }
    p.predictor = p.name;
    if (p.has_discipline) {
      absl::StrAppend(&p.name, "+",
                      p.latency_target ? "target"
                      : p.discipline == shim::SchedulingPolicy::kLinearAging
                          ? "aging"
                          : shim::SchedulingPolicyName(p.discipline));
      if (p.ratio_calibration) absl::StrAppend(&p.name, "-ratio");
      if (p.discipline == shim::SchedulingPolicy::kBounded ||
          p.discipline == shim::SchedulingPolicy::kLinearAging) {
        absl::StrAppendFormat(&p.name, "=%g", p.knob);
      }
      if (p.bounded_aging.has_value()) {
        absl::StrAppendFormat(&p.name, ",aging=%g", *p.bounded_aging);
      }
    }
    if (prior_admission) {
      p.prior_admission = true;
      absl::StrAppend(&p.name, "+prior");
    }
    RETURN_IF_ERROR(add(std::move(p)));
  }
  return out;
}

absl::Status ReplayOptions::Validate() const {
  const auto bad = [](auto... parts) {
    return absl::InvalidArgumentError(absl::StrCat(parts...));
  };
  if (policies.empty()) return bad("no policies");
  if (requests < 0) return bad("--requests must be >= 0, got ", requests);
  if (rate.has_value() && !(*rate > 0 && std::isfinite(*rate))) {
    return bad("--rate must be > 0, got ", *rate);
  }
  for (double l : loads) {
    if (!(l > 0 && std::isfinite(l))) return bad("loads must be > 0, got ", l);
  }
  if (shift_at.has_value() && !(*shift_at >= 0 && *shift_at < 1)) {
    return bad("--shift-at must be in [0, 1), got ", *shift_at);
  }
  if (!shift_trace_path.empty() && !shift_at.has_value()) {
    return bad("--shift-trace needs --shift-at");
  }
  if (!shift_trace_path.empty() && trace_path.empty()) {
    return bad("--shift-trace needs --trace");
  }
  if (dim < 1 || dim > 16384)
    return bad("--dim must be in [1, 16384], got ", dim);
  if (train_rows < 16)
    return bad("--train-rows must be >= 16, got ", train_rows);
  if (max_tokens < 1) return bad("--max-tokens must be >= 1, got ", max_tokens);
  if (waiting_cap < 0 || waiting_cap > (int64_t{1} << 30)) {
    return bad("--waiting-cap must be >= 0 (0 disables), got ", waiting_cap);
  }
  if (!(bounded_aging >= 0 && std::isfinite(bounded_aging))) {
    return bad("--bounded-aging must be >= 0, got ", bounded_aging);
  }
  if (bound_calibration < 0 || bound_calibration > (int64_t{1} << 20)) {
    return bad("--bound-calibration must be in [0, 1048576], got ",
               bound_calibration);
  }
  if (!(target_quantile >= 0 && target_quantile < 1)) {
    return bad("--target-quantile must be in [0, 1), got ", target_quantile);
  }
  if (!(give_up_reserve >= 0 && give_up_reserve <= 1)) {
    return bad("--give-up-reserve must be in [0, 1], got ", give_up_reserve);
  }
  if (prediction_latency_s.has_value() &&
      !(*prediction_latency_s >= 0 && *prediction_latency_s <= 60)) {
    return bad("--prediction-latency-ms must be in [0, 60000], got ",
               *prediction_latency_s * 1e3);
  }
  if (!(tail_budget >= 0 && tail_budget <= 0.5)) {
    return bad("--tail-budget must be in [0, 0.5], got ", tail_budget);
  }
  if (!(aging_rate >= 0 && std::isfinite(aging_rate))) {
    return bad("--aging-rate must be >= 0, got ", aging_rate);
  }
  RETURN_IF_ERROR(ParseUnpredicted(unpredicted).status());
  RETURN_IF_ERROR(readout::BuiltinDomain(domain).status());
  RETURN_IF_ERROR(readout::BuiltinDomain(shift_to).status());
  if (!(timeout_s > 0 && timeout_s <= 86400)) {
    return bad("--timeout must be in (0, 86400], got ", timeout_s);
  }
  if (!(metrics_from >= 0 && metrics_from < 1)) {
    return bad("--metrics-from must be in [0, 1), got ", metrics_from);
  }
  if (!tradeoff_plot_path.empty() &&
      !absl::EndsWith(tradeoff_plot_path, ".svg")) {
    return bad("--tradeoff-plot must end in .svg, got '", tradeoff_plot_path,
               "'");
  }
  if (!admission_plot_path.empty() &&
      !absl::EndsWith(admission_plot_path, ".svg")) {
    return bad("--admission-plot must end in .svg, got '", admission_plot_path,
               "'");
  }
  if (!plot_path.empty() && !absl::EndsWith(plot_path, ".png") &&
      !absl::EndsWith(plot_path, ".svg")) {
    return bad("--plot must end in .png or .svg, got '", plot_path, "'");
  }
  return engine.Validate();
}

absl::StatusOr<ReplayReport> RunReplay(const ReplayOptions& o,
                                       const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const auto say = [&](const std::string& s) {
    if (progress) progress(s);
  };
  ReplayReport rep;
  rep.engine = o.engine.kind;
  rep.preempt_latest_admitted = o.engine.preempt_latest_admitted;
  rep.prediction_latency_s = o.prediction_latency_s;
  rep.policies = o.policies;
  ASSIGN_OR_RETURN(readout::SynthDomain dom0, readout::BuiltinDomain(o.domain));
  readout::SynthDomain dom1 = dom0;
  if (o.shift_at.has_value()) {
    ASSIGN_OR_RETURN(dom1, readout::BuiltinDomain(o.shift_to));
  }

  // ---- the trace
  Trace trace;
  int64_t n = 0, k = 0;
  // Output lengths of the source domain: what the readout is fitted on.
  std::vector<int64_t> source_pool;
  const auto pool_from = [&](const Trace& t) {
    for (const TraceRow& row : t.rows) {
      source_pool.push_back(
          std::clamp<int64_t>(row.output_tokens, 1, o.max_tokens));
    }
  };
  const auto shift_index = [&](int64_t total) {
    return o.shift_at.has_value()
               ? std::clamp<int64_t>(
                     static_cast<int64_t>(std::llround(*o.shift_at * total)), 0,
                     total)
               : total;
  };
  if (o.trace_path.empty()) {
    n = o.requests > 0 ? o.requests : 4000;
    k = shift_index(n);
    trace = SyntheticTrace(n, dom0, dom1, k, o.max_tokens, o.seed);
    pool_from(SyntheticTrace(o.train_rows, dom0, dom0, o.train_rows,
                             o.max_tokens, o.seed + 3));
  rep.trace = absl::StrFormat("synthetic: %d requests, %s (median %g tokens)",
                                n, dom0.name, dom0.median_tokens);
    if (k < n) {
      absl::StrAppendFormat(&rep.trace, " then %s (median %g) from request %d",
                            dom1.name, dom1.median_tokens, k);
    }
    rep.trace += ", Poisson arrivals";
  } else if (!o.shift_trace_path.empty()) {
    say(absl::StrCat("reading ", o.trace_path, " and ", o.shift_trace_path));
    ASSIGN_OR_RETURN(Trace a, ReadTrace(o.trace_path, o.format));
    pool_from(a);
    n = o.requests > 0 ? o.requests : static_cast<int64_t>(a.rows.size());
    k = shift_index(n);
    if (static_cast<int64_t>(a.rows.size()) < k) {
      return absl::InvalidArgumentError(absl::StrCat(
          o.trace_path, ": ", a.rows.size(), " rows, the shift needs ", k));
    }
    ASSIGN_OR_RETURN(Trace b,
                     ReadTrace(o.shift_trace_path, o.shift_format, n - k));
    if (static_cast<int64_t>(b.rows.size()) < n - k) {
      return absl::InvalidArgumentError(absl::StrCat(
          o.shift_trace_path, ": ", b.rows.size(), " rows, need ", n - k));
    }
    trace.rows.assign(a.rows.begin(), a.rows.begin() + k);
    trace.rows.insert(trace.rows.end(), b.rows.begin(),
                      b.rows.begin() + (n - k));
    trace.has_timestamps = false;
    rep.trace = absl::StrFormat(
        "%d requests: lengths of %s (domain %s), then from request %d lengths "
        "of %s (domain %s); Poisson arrivals",
        n, o.trace_path, dom0.name, k, o.shift_trace_path, dom1.name);
  } else {
    say(absl::StrCat("reading ", o.trace_path));
    ASSIGN_OR_RETURN(trace, ReadTrace(o.trace_path, o.format));
    pool_from(trace);
    if (o.requests > 0 &&
        static_cast<int64_t>(trace.rows.size()) > o.requests) {
      trace.rows.resize(static_cast<size_t>(o.requests));
    }
    n = static_cast<int64_t>(trace.rows.size());
    k = shift_index(n);
    rep.trace = absl::StrFormat("%s (%s): %d requests, domain %s", o.trace_path,
                                TraceFormatName(trace.format), n, dom0.name);
    if (k < n) {
      absl::StrAppendFormat(&rep.trace, ", %s from request %d", dom1.name, k);
    }
    rep.trace += trace.has_timestamps ? ", the trace's arrival times"
                                      : ", Poisson arrivals";
  }
  rep.requests = n;
  rep.shift_index = k < n ? k : -1;
  const bool poisson = !trace.has_timestamps;

  std::vector<SimRequest> reqs(static_cast<size_t>(n));
  std::vector<int64_t> seg_lengths[2];
  for (int64_t i = 0; i < n; ++i) {
    const TraceRow& row = trace.rows[static_cast<size_t>(i)];
    SimRequest& r = reqs[static_cast<size_t>(i)];
    r.id = i;
    r.prompt_tokens = row.prompt_tokens;
    r.output_tokens = std::max<int64_t>(row.output_tokens, 1);
    if (r.output_tokens > o.max_tokens) {
      r.output_tokens = o.max_tokens;
      ++rep.clipped;
    }
    r.segment = i < k ? 0 : 1;
    seg_lengths[r.segment].push_back(r.output_tokens);
  }
  if (rep.clipped > 0) {
    say(absl::StrCat(rep.clipped, " outputs longer than --max-tokens ",
                     o.max_tokens, " were cut to it"));
  }

  // ---- capacity and loads
  const bool per_segment = poisson && k > 0 && k < n;
  if (per_segment) {
    ASSIGN_OR_RETURN(rep.capacity,
                     MeasureCapacity(std::span(reqs).subspan(0, k), o.engine));
    ASSIGN_OR_RETURN(double after,
                     MeasureCapacity(std::span(reqs).subspan(k), o.engine));
    rep.capacity_after = after;
    say(absl::StrFormat(
        "FCFS capacity: %.3f requests/s before the shift, %.3f after (all "
        "requests at t=0)",
        rep.capacity, after));
  } else {
    ASSIGN_OR_RETURN(rep.capacity, MeasureCapacity(reqs, o.engine));
    say(absl::StrFormat("FCFS capacity: %.3f requests/s (all requests at t=0)",
                        rep.capacity));
  }
  std::vector<double> loads = o.loads;
  bool native_times = false;
  if (loads.empty()) {
    if (!poisson) {
      native_times = true;
      loads = {TraceRate(trace) / rep.capacity};
      say(absl::StrFormat(
          "the trace's own arrivals: %.3f requests/s = load %.3f",
          TraceRate(trace), loads[0]));
    } else if (o.rate.has_value()) {
      loads = {*o.rate / rep.capacity};
    } else {
      loads = {1.0};
    }
  }

  // ---- LEAP: features, readout, leapd
  const bool need_leap = std::any_of(
      o.policies.begin(), o.policies.end(), [](const PolicySpec& p) {
        return p.kind == PolicySpec::Kind::kLeap ||
               p.kind == PolicySpec::Kind::kLeapRls;
      });
  std::vector<float> features;
  std::string artifact;
  std::unique_ptr<LeapdProcess> leapd;
  client::ServerOptions server;
  server.timeout_s = o.timeout_s;
  if (need_leap) {
    readout::SynthOptions so;
    so.dim = o.dim;
    so.max_tokens = o.max_tokens;
    so.model_seed = o.model_seed;
    ASSIGN_OR_RETURN(readout::SynthGenerator gen,
                     readout::SynthGenerator::Create(so));
    const readout::SynthDomain domains[2] = {FitDomain(dom0, source_pool),
                                             FitDomain(dom1, seg_lengths[1])};
    const auto t0 = Clock::now();
    features = RequestFeatures(gen, reqs, domains, o.seed);
    say(absl::StrFormat(
        "synthetic hidden states for %d requests (d=%d) in %.1f s", n, o.dim,
        Since(t0)));
    readout::ReadoutState state;
    if (!o.readout_path.empty()) {
      ASSIGN_OR_RETURN(state, readout::ReadArtifact(o.readout_path));
      if (state.spec.dim != o.dim) {
        return absl::InvalidArgumentError(
            absl::StrCat(o.readout_path, ": readout has d=", state.spec.dim,
                         " but --dim is ", o.dim));
      }
    } else {
      const auto t1 = Clock::now();
      ASSIGN_OR_RETURN(
          state, TrainSourceReadout(gen, domains[0], source_pool, o.train_rows,
                                    o.max_tokens, o.seed + 1, progress));
      say(absl::StrFormat("readout fitted in %.1f s (lambda %.4g)", Since(t1),
                          state.spec.lambda));
    }
    ASSIGN_OR_RETURN(artifact, readout::SerializeArtifact(state));
    if (o.server.empty()) {
      std::string path = o.leapd_path;
      if (path.empty()) {
        ASSIGN_OR_RETURN(path, FindLeapd());
      }
      ASSIGN_OR_RETURN(leapd,
                       LeapdProcess::Start(path, absl::Seconds(o.timeout_s),
                                           o.leapd_data_dir));
      server.address = leapd->address();
      say(absl::StrCat("started ", path, " on ", server.address));
    } else {
      server.address = o.server;
    }
  }

  // ---- learned-predictor baselines: predictions per request id
  std::vector<std::vector<double>> learned(o.policies.size());
  for (size_t p = 0; p < o.policies.size(); ++p) {
    const PolicySpec& spec = o.policies[p];
    if (spec.kind != PolicySpec::Kind::kLearned) continue;
    std::vector<double>& v = learned[p];
    v.resize(static_cast<size_t>(n));
    for (int s = 0; s < 2; ++s) {
      const double rho =
          s == 1 && spec.shift_rho.has_value() ? *spec.shift_rho : spec.rho;
      const std::vector<double> pred = CopulaPredictions(
          seg_lengths[s], rho,
          o.seed * 1000003 + p * 31 + static_cast<uint64_t>(s));
      const int64_t base = s == 0 ? 0 : k;
      for (size_t i = 0; i < pred.size(); ++i) {
        v[static_cast<size_t>(base) + i] = pred[i];
      }
    }
  }
  std::vector<double> truth(static_cast<size_t>(n));
  for (const SimRequest& r : reqs) {
    truth[static_cast<size_t>(r.id)] = static_cast<double>(r.output_tokens);
  }

  // ---- the runs
  ASSIGN_OR_RETURN(shim::UnpredictedPolicy unpredicted,
                   ParseUnpredicted(o.unpredicted));
  const std::string run_id = client::RandomRunId("replay");
  std::vector<double> recorded_values, recorded_latency;
  int run_no = 0;
  std::string requests_csv;
  if (!o.requests_csv_path.empty()) requests_csv = FormatRequestsCsvHeader();
  const int64_t metrics_first =
      static_cast<int64_t>(std::ceil(o.metrics_from * static_cast<double>(n)));
  for (size_t li = 0; li < loads.size(); ++li) {
    const double load = loads[li];
    if (native_times) {
      for (int64_t i = 0; i < n; ++i) {
        reqs[static_cast<size_t>(i)].arrival_s =
            trace.rows[static_cast<size_t>(i)].arrival_s;
      }
    } else if (!poisson) {
      const double factor = TraceRate(trace) / (load * rep.capacity);
      for (int64_t i = 0; i < n; ++i) {
        reqs[static_cast<size_t>(i)].arrival_s =
            trace.rows[static_cast<size_t>(i)].arrival_s * factor;
      }
    } else {
      // Same draws at every load: the arrival pattern is only rescaled.
      const double r0 =
          o.loads.empty() && o.rate.has_value() ? *o.rate : load * rep.capacity;
      const double r1 = o.loads.empty() && o.rate.has_value()
                            ? *o.rate
                            : load * rep.capacity_after.value_or(rep.capacity);
      const std::vector<double> at = PoissonArrivals(n, k, r0, r1, o.seed + 7);
      for (int64_t i = 0; i < n; ++i) {
        reqs[static_cast<size_t>(i)].arrival_s = at[static_cast<size_t>(i)];
      }
    }
    for (size_t p = 0; p < o.policies.size(); ++p) {
      const PolicySpec& spec = o.policies[p];
      const auto t0 = Clock::now();
      SimOptions so;
      so.engine = o.engine;
      so.scheduler.slots = o.engine.slots;
      so.scheduler.waiting_cap = static_cast<int>(o.waiting_cap);
      so.scheduler.aging_rate = o.aging_rate;
      so.scheduler.unpredicted = unpredicted;
      if (spec.has_discipline) {
        so.scheduler.policy = spec.discipline;
        if (spec.discipline == shim::SchedulingPolicy::kBounded) {
          if (!spec.latency_target) so.scheduler.max_slowdown = spec.knob;
          so.scheduler.bounded_linear_aging =
              spec.bounded_aging.value_or(o.bounded_aging);
          so.scheduler.calibration_window =
              static_cast<int>(o.bound_calibration);
          so.scheduler.calibration = spec.ratio_calibration
                                         ? shim::BoundCalibration::kRatio
                                         : shim::BoundCalibration::kAdditive;
          if (spec.latency_target) {
            // X times FCFS's P99 at this load (fcfs ran before it).
            auto fcfs = std::find_if(
                rep.rows.begin(), rep.rows.end(), [&](const ReplayRow& r) {
                  return r.policy == "fcfs" && r.load == load;
                });
            if (fcfs == rep.rows.end() ||
                !(fcfs->metrics.p99_latency > 0)) {
              return absl::FailedPreconditionError(absl::StrCat(
                  spec.name, ": no FCFS P99 latency at load ", load));
            }
            so.scheduler.latency_target_s =
                spec.knob * fcfs->metrics.p99_latency;
            // Work left corrected per octave of the estimate: the
            // additive correction lets truncated outputs predicted at half
            // their length miss the target (docs/SCHEDULING.md).
            so.scheduler.calibration = shim::BoundCalibration::kRatio;
            so.scheduler.tail_budget = o.tail_budget;
            so.scheduler.target_quantile = o.target_quantile;
            so.scheduler.give_up_reserve = o.give_up_reserve;
          }
        } else if (spec.discipline == shim::SchedulingPolicy::kLinearAging) {
          so.scheduler.linear_aging = spec.knob;
        }
      }
      if (spec.kind == PolicySpec::Kind::kFcfs) {
        // No predictions: arrival order. The cap would only reshuffle it.
        so.scheduler.waiting_cap = 0;
        so.scheduler.aging_rate = 0;
        so.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
      }
      std::unique_ptr<OnlineAdmissionPrior> prior;
      if (spec.prior_admission) {
        prior = std::make_unique<OnlineAdmissionPrior>(o.max_tokens);
        so.prior = prior.get();
      }
      auto last_report = Clock::now();
      so.progress_every_steps = 2000;
      so.progress = [&](int64_t done, int64_t total) {
        if (Since(last_report) < 5) return;
        last_report = Clock::now();
        say(absl::StrFormat("  load %.2f %s: %d of %d requests finished", load,
                            spec.name, done, total));
      };

      ReplayRow row;
      row.policy = spec.name;
      row.load = load;
      std::unique_ptr<Predictor> predictor;
      std::unique_ptr<LeapArm> arm;
      LeapPredictor* leap = nullptr;
      switch (spec.kind) {
        case PolicySpec::Kind::kFcfs:
          predictor = std::make_unique<NoPredictor>();
          break;
        case PolicySpec::Kind::kOracle:
          predictor = std::make_unique<TablePredictor>(truth, 0.0, false, 0.0);
          break;
        case PolicySpec::Kind::kLearned:
          predictor = std::make_unique<TablePredictor>(learned[p], 0.0, true,
                                                       spec.cost_ms);
          break;
        case PolicySpec::Kind::kLeap:
        case PolicySpec::Kind::kLeapRls: {
          if (spec.kind == PolicySpec::Kind::kLeap &&
              (spec.has_discipline || spec.prior_admission) &&
              !recorded_values.empty()) {
            // The frozen readout's predictions do not depend on the order:
            // reuse those of the first frozen LEAP run, with the latencies
            // charged there (measured, or --prediction-latency-ms).
            predictor = std::make_unique<TablePredictor>(recorded_values,
                                                         recorded_latency);
            row.reused_predictions = true;
            break;
          }
          const std::string name = absl::StrCat(run_id, run_no++);
          ASSIGN_OR_RETURN(
              arm, LeapArm::Create(server, name, artifact,
                                   spec.kind == PolicySpec::Kind::kLeap));
          LeapPredictorOptions lo;
          lo.endpoint = server.address;
          lo.product_line = name;
          lo.dim = o.dim;
          lo.features = features;
          lo.charged_latency_s = o.prediction_latency_s;
          ASSIGN_OR_RETURN(std::unique_ptr<LeapPredictor> lp,
                           LeapPredictor::Create(std::move(lo)));
          leap = lp.get();
          predictor = std::move(lp);
          break;
        }
      }
      ASSIGN_OR_RETURN(SimResult sim, Simulate(reqs, so, *predictor));
      if (!o.requests_csv_path.empty()) {
        AppendRequestsCsv(spec.name, load, reqs, sim, &requests_csv);
      }
      row.metrics = ComputeMetrics(sim.requests, [&](const RequestResult& r) {
        return r.id >= metrics_first;
      });
      if (rep.shift_index >= 0) {
        row.after_shift = ComputeMetrics(
            sim.requests,
            [](const RequestResult& r) { return r.segment == 1; });
      }
      if (spec.kind != PolicySpec::Kind::kFcfs) row.late = sim.late_predictions;
      row.preemptions = sim.preemptions;
      row.recomputed_tokens = sim.recomputed_tokens;
      row.urgent_selections = sim.counters.urgent_selections;
      row.deadlines_given_up = sim.counters.deadlines_given_up;
      row.queue_deadlines_given_up = sim.queue_deadlines_given_up;
      row.credit_give_ups =
          sim.counters.credit_give_ups + sim.queue_credit_give_ups;
      if (leap != nullptr) {
        const std::vector<double> lat = leap->latencies();
        if (!lat.empty()) {
          row.latency_p50 = Percentile(lat, 50);
          row.latency_p99 = Percentile(lat, 99);
        }
        row.errors = leap->errors();
        row.max_version = leap->max_version();
        row.rescores = leap->rescores();
        row.wait_timeouts = leap->wait_timeouts();
        if (spec.kind == PolicySpec::Kind::kLeap && recorded_values.empty() &&
            row.errors == 0) {
          recorded_values.assign(static_cast<size_t>(n), kNaN);
          recorded_latency.assign(static_cast<size_t>(n), kNaN);
          for (const auto& [id, v] : leap->recorded()) {
            if (id < 0 || id >= n) continue;
            recorded_values[static_cast<size_t>(id)] = v.first;
            recorded_latency[static_cast<size_t>(id)] = v.second;
          }
        }
        if (row.errors > 0) {
          say(absl::StrCat("  ", spec.name, ": ", row.errors,
                           " prediction errors; first: ", leap->first_error()));
        }
      }
      predictor.reset();
      if (arm != nullptr) RETURN_IF_ERROR(arm->Remove());
      row.seconds = Since(t0);
      say(absl::StrFormat(
          "load %.2f %-10s mean PTL %.2f ms/token, P99 %.1f s%s (%.1f s)", load,
          spec.name, row.metrics.mean_ptl * 1e3, row.metrics.p99_latency,
          row.after_shift.has_value()
              ? absl::StrFormat(", after the shift %.2f ms/token",
                                row.after_shift->mean_ptl * 1e3)
              : "",
          row.seconds));
      rep.rows.push_back(std::move(row));
    }
  }

  if (!o.json_path.empty()) {
    RETURN_IF_ERROR(WriteFileAtomically(o.json_path, FormatReplayJson(rep)));
  }
  if (!o.requests_csv_path.empty()) {
    RETURN_IF_ERROR(WriteFileAtomically(o.requests_csv_path, requests_csv));
  }
  if (!o.plot_path.empty()) {
    ASSIGN_OR_RETURN(rep.plot_written, WriteReplayPlot(rep, o.plot_path));
  }
  if (!o.tradeoff_plot_path.empty()) {
    ASSIGN_OR_RETURN(rep.tradeoff_plot_written,
                     WriteTradeoffPlot(rep, o.tradeoff_plot_path));
  }
  if (!o.admission_plot_path.empty()) {
    ASSIGN_OR_RETURN(rep.admission_plot_written,
                     WriteAdmissionPlot(rep, o.admission_plot_path));
  }
  return rep;
}

// ---- output ----------------------------------------------------------------

std::string FormatRequestsCsvHeader() {
  return "policy,load,id,segment,arrival_s,prompt_tokens,output_tokens,"
         "predicted_tokens,first_token_s,completion_s,latency_s,"
         "max_wait_steps,deadline_origin,deadline,completion,urgent,gave_up\n";
}

void AppendRequestsCsv(const std::string& policy, double load,
                       std::span<const SimRequest> requests,
                       const SimResult& sim, std::string* out) {
  // Empty for NaN (no prediction, no deadline); %.17g keeps every double.
  const auto num = [](double v) {
    return std::isfinite(v) ? absl::StrFormat("%.17g", v) : std::string();
  };
  std::vector<const SimRequest*> by_id(sim.requests.size(), nullptr);
  for (const SimRequest& q : requests) {
    if (q.id >= 0 && static_cast<size_t>(q.id) < by_id.size()) {
      by_id[static_cast<size_t>(q.id)] = &q;
    }
  }
  for (const RequestResult& r : sim.requests) {
    const SimRequest* q = by_id[static_cast<size_t>(r.id)];
    absl::StrAppend(
        out, policy, ",", absl::StrFormat("%.15g", load), ",", r.id, ",",
        r.segment, ",", num(r.arrival_s), ",",
        q != nullptr ? absl::StrCat(q->prompt_tokens) : std::string(), ",",
        r.output_tokens, ",", num(r.predicted_tokens), ",",
        num(r.first_token_s), ",", num(r.completion_s), ",",
        num(r.completion_s - r.arrival_s), ",", r.max_wait_steps, ",",
        num(r.deadline_origin_step), ",", num(r.deadline_step), ",",
        num(r.completion_step), ",", r.was_urgent ? 1 : 0, ",",
        r.gave_up ? 1 : 0, "\n");
  }
}

std::string FormatReplayTable(const ReplayReport& r) {
  std::string s = absl::StrCat("trace: ", r.trace, "\n");
  s += r.engine == EngineKind::kVllm
           ? absl::StrCat("engine: vllm-shaped (continuous batching, KV "
                          "blocks, preemption of the ",
                          r.preempt_latest_admitted
                              ? "latest admitted: --preempt latest"
                              : "lowest-ranked: --preempt rank",
                          ")\n")
           : "engine: slots (resident requests, decode slots per step)\n";
  absl::StrAppendFormat(&s, "FCFS capacity: %.3f requests/s", r.capacity);
  if (r.capacity_after.has_value()) {
    absl::StrAppendFormat(&s, " before the shift, %.3f after",
                          *r.capacity_after);
  }
  s += "\n\n";
  const bool shift = r.shift_index >= 0;
  size_t w = 6;
  for (const ReplayRow& row : r.rows) w = std::max(w, row.policy.size());
  absl::StrAppendFormat(&s, "%-*s %5s %9s %8s %8s %8s %8s %7s %8s %9s %6s", w,
                        "policy", "load", "PTL", "mean", "P90", "P95", "P99",
                        "TTFT", "tok/s", "long P95", "rho");
  if (shift) {
    absl::StrAppendFormat(&s, " %9s %10s %9s", "PTL after", "mean after",
                          "rho after");
  }
  s += "\n";
  absl::StrAppendFormat(&s, "%-*s %5s %9s %8s %8s %8s %8s %7s %8s %9s %6s", w,
                        "", "", "ms/tok", "s", "s", "s", "s", "s", "", "s", "");
  if (shift) absl::StrAppendFormat(&s, " %9s %10s %9s", "ms/tok", "s", "");
  s += "\n";
  double last_load = kNaN;
  for (const ReplayRow& row : r.rows) {
    if (!std::isnan(last_load) && row.load != last_load) s += "\n";
    last_load = row.load;
    const Metrics& m = row.metrics;
    const auto f = [](double v, int prec) {
      return std::isfinite(v) ? absl::StrFormat("%.*f", prec, v)
                              : std::string("-");
    };
    absl::StrAppendFormat(
        &s, "%-*s %5.2f %9s %8s %8s %8s %8s %7s %8s %9s %6s", w, row.policy,
        row.load, f(m.mean_ptl * 1e3, 2), f(m.mean_latency, 1),
        f(m.p90_latency, 1), f(m.p95_latency, 1), f(m.p99_latency, 1),
        f(m.mean_ttft, 2), f(m.throughput, 0),
        m.long_p95_latency.has_value() ? f(*m.long_p95_latency, 1) : "-",
        f(m.spearman, 2));
    if (shift) {
      absl::StrAppendFormat(
          &s, " %9s %10s %9s", f(row.after_shift->mean_ptl * 1e3, 2),
          f(row.after_shift->mean_latency, 1), f(row.after_shift->spearman, 2));
    }
    s += "\n";
  }
  s += "\n";
  s +=
      "PTL: mean over requests of (completion - arrival) / output tokens; "
      "latencies\nfrom arrival to completion; TTFT to the first token; tok/s: "
      "output tokens per\nsecond; long P95: requests over 1,024 output tokens; "
      "rho: Spearman of the\nscheduler's first prediction vs the true length "
      "within windows of 500\nconsecutive requests; 'after': requests "
      "arriving after the shift.\n";
  for (const ReplayRow& row : r.rows) {
    if (!row.latency_p50.has_value()) continue;
    absl::StrAppendFormat(
        &s,
        "%s @ %.2f: leapd prediction latency p50 %.3f ms, p99 %.3f ms (wall, "
        "%s); %d late; readout v%d; %d rescores%s\n",
        row.policy, row.load, *row.latency_p50 * 1e3, *row.latency_p99 * 1e3,
        r.prediction_latency_s.has_value()
            ? absl::StrFormat("%g ms charged on the timeline instead",
                              *r.prediction_latency_s * 1e3)
            : std::string("charged on the timeline"),
        row.late, row.max_version, row.rescores,
        absl::StrCat(row.errors > 0 ? absl::StrCat("; ", row.errors, " errors")
                                    : "",
                     row.wait_timeouts > 0
                         ? absl::StrCat(
                               "; ", row.wait_timeouts,
                               " predictions missed the ",
                               absl::FormatDuration(
                                   LeapPredictorOptions().max_wait),
                               " wait (this run does not repeat)")
                         : ""));
  }
  for (const PolicySpec& p : r.policies) {
    if (p.kind != PolicySpec::Kind::kLearned) continue;
    absl::StrAppendFormat(&s, "%s: learned predictor, Spearman %g", p.name,
                          p.rho);
    if (p.shift_rho.has_value()) {
      absl::StrAppendFormat(&s, " (%g after a shift)", *p.shift_rho);
    }
    absl::StrAppendFormat(&s, ", %g ms GPU per prediction (assumed)\n",
                          p.cost_ms);
  }
  for (const ReplayRow& row : r.rows) {
    if (row.preemptions == 0 && row.urgent_selections == 0 &&
        row.deadlines_given_up == 0 && row.queue_deadlines_given_up == 0 &&
        !row.reused_predictions) {
      continue;
    }
    absl::StrAppendFormat(&s, "%s @ %.2f:", row.policy, row.load);
    if (row.reused_predictions) s += " predictions of the frozen LEAP run;";
    if (row.preemptions > 0) {
      absl::StrAppendFormat(&s, " %d preemptions (%d tokens recomputed);",
                            row.preemptions, row.recomputed_tokens);
    }
    if (row.urgent_selections > 0) {
      absl::StrAppendFormat(&s, " %d urgent selections;",
                            row.urgent_selections);
    }
    if (row.deadlines_given_up + row.queue_deadlines_given_up > 0) {
      absl::StrAppendFormat(&s,
                            " %d deadlines given up in decode, %d in the "
                            "admission queue (%d of them against credits);",
                            row.deadlines_given_up,
                            row.queue_deadlines_given_up, row.credit_give_ups);
    }
    s += "\n";
  }
  if (const std::string t = FormatTradeoffTable(r); !t.empty()) {
    s += "\n" + t;
  }
  if (const std::string t = FormatAdmissionTable(r); !t.empty()) {
    s += "\n" + t;
  }
  if (!r.plot_written.empty())
    s += absl::StrCat("plot: ", r.plot_written, "\n");
  if (!r.tradeoff_plot_written.empty())
    s += absl::StrCat("trade-off plot: ", r.tradeoff_plot_written, "\n");
  if (!r.admission_plot_written.empty())
    s += absl::StrCat("admission plot: ", r.admission_plot_written, "\n");
  return s;
}

std::vector<TradeoffPoint> Tradeoff(const ReplayReport& r) {
  std::vector<TradeoffPoint> out;
  std::map<double, const ReplayRow*> fcfs, oracle;
  for (const ReplayRow& row : r.rows) {
    if (row.policy == "fcfs") fcfs[row.load] = &row;
    if (row.policy == "oracle") oracle[row.load] = &row;
  }
  for (const ReplayRow& row : r.rows) {
    auto f = fcfs.find(row.load);
    auto o = oracle.find(row.load);
    if (f == fcfs.end() || o == oracle.end()) continue;
    const Metrics& fm = f->second->metrics;
    const Metrics& om = o->second->metrics;
    TradeoffPoint p;
    p.policy = row.policy;
    p.load = row.load;
    const double span = fm.mean_ptl - om.mean_ptl;
    p.gain = span != 0 ? (fm.mean_ptl - row.metrics.mean_ptl) / span : kNaN;
    p.p99_ratio = row.metrics.p99_latency / fm.p99_latency;
    if (row.metrics.long_p95_latency.has_value() &&
        fm.long_p95_latency.has_value()) {
      p.long_p95_ratio = *row.metrics.long_p95_latency / *fm.long_p95_latency;
    }
    out.push_back(std::move(p));
  }
  return out;
}

std::string FormatTradeoffTable(const ReplayReport& r) {
  const std::vector<TradeoffPoint> points = Tradeoff(r);
  if (points.empty()) return "";
  size_t w = 6;
  for (const TradeoffPoint& p : points) w = std::max(w, p.policy.size());
  std::string s = absl::StrFormat(
      "trade-off: share of the oracle's mean-PTL gain over FCFS captured, and "
      "latency ratios to FCFS\n%-*s %5s %7s %9s %13s\n",
      w, "policy", "load", "gain", "P99/fcfs", "longP95/fcfs");
  double last_load = kNaN;
  for (const TradeoffPoint& p : points) {
    if (!std::isnan(last_load) && p.load != last_load) s += "\n";
    last_load = p.load;
    absl::StrAppendFormat(
        &s, "%-*s %5.2f %7s %9s %13s\n", w, p.policy, p.load,
        std::isfinite(p.gain) ? absl::StrFormat("%.3f", p.gain) : "-",
        std::isfinite(p.p99_ratio) ? absl::StrFormat("%.2f", p.p99_ratio)
                                   : "-",
        p.long_p95_ratio.has_value() && std::isfinite(*p.long_p95_ratio)
            ? absl::StrFormat("%.2f", *p.long_p95_ratio)
            : "-");
  }
  return s;
}

std::vector<AdmissionPoint> Admission(const ReplayReport& r) {
  const std::vector<TradeoffPoint> points = Tradeoff(r);
  std::map<std::pair<std::string, double>, const TradeoffPoint*> by;
  for (const TradeoffPoint& p : points) by[{p.policy, p.load}] = &p;
  std::vector<AdmissionPoint> out;
  constexpr absl::string_view kPrior = "+prior";
  for (const TradeoffPoint& p : points) {
    if (!absl::EndsWith(p.policy, kPrior)) continue;
    std::string base = p.policy.substr(0, p.policy.size() - kPrior.size());
    // "oracle+prior" pairs with "oracle"; a bare "+prior" does not parse.
    auto it = by.find({base, p.load});
    if (it == by.end()) continue;
    AdmissionPoint a;
    a.policy = std::move(base);
    a.load = p.load;
    a.gain_without = it->second->gain;
    a.gain_with = p.gain;
    a.p99_without = it->second->p99_ratio;
    a.p99_with = p.p99_ratio;
    out.push_back(std::move(a));
  }
  return out;
}

std::string FormatAdmissionTable(const ReplayReport& r) {
  const std::vector<AdmissionPoint> points = Admission(r);
  if (points.empty()) return "";
  size_t w = 6;
  for (const AdmissionPoint& p : points) w = std::max(w, p.policy.size());
  const auto f = [](double v, int prec) {
    return std::isfinite(v) ? absl::StrFormat("%.*f", prec, v)
                            : std::string("-");
  };
  std::string s = absl::StrFormat(
      "admission: share of the oracle's gain and P99/fcfs, FCFS admission -> "
      "length-aware admission (+prior)\n%-*s %5s %15s %13s\n",
      w, "policy", "load", "gain", "P99/fcfs");
  for (const AdmissionPoint& p : points) {
    absl::StrAppendFormat(&s, "%-*s %5.2f %15s %13s\n", w, p.policy, p.load,
                          absl::StrCat(f(p.gain_without, 3), " -> ",
                                       f(p.gain_with, 3)),
                          absl::StrCat(f(p.p99_without, 2), " -> ",
                                       f(p.p99_with, 2)));
  }
  return s;
}

std::string FormatReplayJson(const ReplayReport& r) {
  nlohmann::json out = nlohmann::json::array();
  for (const ReplayRow& row : r.rows) {
    const Metrics& m = row.metrics;
    nlohmann::json j;
    j["policy"] = row.policy;
    j["load"] = JsonNumber(row.load);
    j["mean_ptl"] = JsonNumber(m.mean_ptl);
    j["p90_latency"] = JsonNumber(m.p90_latency);
    j["p95_latency"] = JsonNumber(m.p95_latency);
    j["p99_latency"] = JsonNumber(m.p99_latency);
    j["window_p99_latency"] = JsonNumber(m.window_p99_latency);
    j["mean_ttft"] = JsonNumber(m.mean_ttft);
    j["throughput"] = JsonNumber(m.throughput);
    j["long_p95_latency"] = m.long_p95_latency.has_value()
                                ? JsonNumber(*m.long_p95_latency)
                                : nlohmann::json(nullptr);
    out.push_back(std::move(j));
  }
  return out.dump(2) + "\n";
}

namespace {

// Policy -> (load, mean PTL in ms/token), in first-seen order.
std::vector<std::pair<std::string, std::vector<std::pair<double, double>>>>
Series(const ReplayReport& r) {
  std::vector<std::pair<std::string, std::vector<std::pair<double, double>>>> s;
  for (const ReplayRow& row : r.rows) {
    auto it = std::find_if(s.begin(), s.end(), [&](const auto& e) {
      return e.first == row.policy;
    });
    if (it == s.end()) {
      s.push_back({row.policy, {}});
      it = s.end() - 1;
    }
    if (std::isfinite(row.metrics.mean_ptl)) {
      it->second.emplace_back(row.load, row.metrics.mean_ptl * 1e3);
    }
  }
  for (auto& e : s) std::sort(e.second.begin(), e.second.end());
  return s;
}

// Round tick step for a span: 1, 2 or 5 times a power of ten.
double TickStep(double span, int want) {
  const double raw = span / std::max(want, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

std::string XmlEscape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                   "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f",
                                   "#bcbd22", "#17becf"};
// gnuplot point types: filled circle, square, triangle, diamond, ...
constexpr int kPointTypes[] = {7, 5, 9, 13, 11, 15};

std::string Svg(const ReplayReport& r) {
  const auto series = Series(r);
  double x0 = INFINITY, x1 = -INFINITY, y1 = 0;
  for (const auto& [name, pts] : series) {
    for (const auto& [x, y] : pts) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y1 = std::max(y1, y);
    }
  }
  if (!std::isfinite(x0)) x0 = 0, x1 = 1;
  if (x1 - x0 < 1e-9) x0 -= 0.1, x1 += 0.1;
  if (y1 <= 0) y1 = 1;
  const double ystep = TickStep(y1 * 1.08, 6);
  y1 = std::ceil(y1 * 1.08 / ystep) * ystep;
  const double xstep = TickStep(x1 - x0, 8);
  const double W = 860, H = 520, L = 80, R = 230, T = 50, B = 60;
  const auto px = [&](double x) {
    return L + (x - x0) / (x1 - x0) * (W - L - R);
  };
  const auto py = [&](double y) { return H - B - y / y1 * (H - T - B); };
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"13\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"28\" font-size=\"16\" text-anchor=\"middle\">Mean "
      "per-token latency vs load</text>\n",
      W, H, W, H, (L + W - R) / 2);
  for (double y = 0; y <= y1 + 1e-9; y += ystep) {
    absl::StrAppendFormat(
        &s,
        "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/>"
        "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
        L, py(y), W - R, py(y), L - 6, py(y) + 4, y);
  }
  for (double x = std::ceil(x0 / xstep) * xstep; x <= x1 + 1e-9; x += xstep) {
    absl::StrAppendFormat(
        &s,
        "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#ddd\"/>"
        "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%g</text>\n",
        px(x), T, px(x), H - B, px(x), H - B + 18,
        std::round(x / xstep) * xstep);
  }
  absl::StrAppendFormat(
      &s,
      "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" "
      "stroke=\"black\"/>\n"
      "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">load (x FCFS "
      "capacity)</text>\n"
      "<text x=\"20\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 "
      "20 %g)\">mean PTL (ms/token)</text>\n",
      L, T, W - L - R, H - T - B, (L + W - R) / 2, H - 18, (T + H - B) / 2,
      (T + H - B) / 2);
  for (size_t i = 0; i < series.size(); ++i) {
    const char* c = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    const auto& [name, pts] = series[i];
    std::string poly;
    for (const auto& [x, y] : pts) {
      absl::StrAppendFormat(&poly, "%.1f,%.1f ", px(x), py(y));
    }
    absl::StrAppendFormat(&s,
                          "<polyline points=\"%s\" fill=\"none\" stroke=\"%s\" "
                          "stroke-width=\"2\"/>\n",
                          poly, c);
    for (const auto& [x, y] : pts) {
      absl::StrAppendFormat(&s,
                            "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" "
                            "fill=\"%s\"/>\n",
                            px(x), py(y), c);
    }
    const double ly = T + 10 + 20 * static_cast<double>(i);
    absl::StrAppendFormat(
        &s,
        "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" "
        "stroke-width=\"2\"/><text x=\"%g\" y=\"%g\">%s</text>\n",
        W - R + 15, ly, W - R + 40, ly, c, W - R + 46, ly + 4, XmlEscape(name));
  }
  s += "</svg>\n";
  return s;
}

// Runs gnuplot on `script` (its output discarded); true when it exited 0.
bool RunGnuplot(const std::string& script) {
  absl::StatusOr<client::ProcessResult> r =
      client::RunProcess({"gnuplot", script});
  return r.ok() && WIFEXITED(r->status) && WEXITSTATUS(r->status) == 0;
}

std::string GnuplotQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

absl::StatusOr<std::string> WriteTradeoffPlot(const ReplayReport& r,
                                              const std::string& path) {
  const std::vector<TradeoffPoint> points = Tradeoff(r);
  // Series: predictor+discipline at one load, points in knob order.
  struct Point {
    double knob, x, y;
  };
  std::map<double, std::map<std::string, std::vector<Point>>> panels;
  for (const TradeoffPoint& p : points) {
    if (!std::isfinite(p.gain) || !std::isfinite(p.p99_ratio)) continue;
    auto spec = std::find_if(r.policies.begin(), r.policies.end(),
                             [&](const PolicySpec& q) { return q.name == p.policy; });
    std::string series = p.policy;
    double knob = 0;
    if (spec != r.policies.end() && spec->has_discipline) {
      const size_t eq = p.policy.rfind('=');
      if (spec->bounded_aging.has_value()) {
        // "leap+bounded=S,aging=A": one series per A, points in S order.
        series = absl::StrFormat(
            "%s+bounded%s,aging=%g%s", spec->predictor,
            spec->ratio_calibration ? "-ratio" : "", *spec->bounded_aging,
            spec->prior_admission ? "+prior" : "");
      } else if (eq != std::string::npos && eq > p.policy.rfind('+')) {
        series = p.policy.substr(0, eq);
      }
      knob = spec->knob;
    }
    panels[p.load][series].push_back({knob, p.p99_ratio, p.gain});
  }
  const double W = 520, H = 420, L = 70, R = 20, T = 50, B = 60, legend = 250;
  const double total_w = W * static_cast<double>(std::max<size_t>(panels.size(), 1)) + legend;
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      total_w, H);
  std::map<std::string, size_t> color_of;
  size_t panel = 0;
  for (auto& [load, series] : panels) {
    double x1 = 1.0, y0 = 0, y1 = 1.0;
    for (auto& [name, pts] : series) {
      std::sort(pts.begin(), pts.end(),
                [](const Point& a, const Point& b) { return a.knob < b.knob; });
      for (const Point& q : pts) {
        x1 = std::max(x1, q.x);
        y0 = std::min(y0, q.y);
        y1 = std::max(y1, q.y);
      }
    }
    x1 = std::ceil(x1 * 1.05 * 4) / 4;
    const double x0 = 0.5;
    const double ox = W * static_cast<double>(panel++);
    const auto px = [&](double x) { return ox + L + (x - x0) / (x1 - x0) * (W - L - R); };
    const auto py = [&](double y) { return H - B - (y - y0) / (y1 * 1.05 - y0) * (H - T - B); };
    absl::StrAppendFormat(
        &s,
        "<text x=\"%g\" y=\"28\" font-size=\"14\" text-anchor=\"middle\">load "
        "%.2f</text>\n<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" "
        "fill=\"none\" stroke=\"black\"/>\n"
        "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">P99 latency / "
        "FCFS's</text>\n<text x=\"%g\" y=\"%g\" text-anchor=\"middle\" "
        "transform=\"rotate(-90 %g %g)\">share of the oracle's PTL "
        "gain</text>\n",
        ox + (L + W - R) / 2, load, ox + L, T, W - L - R, H - T - B,
        ox + (L + W - R) / 2, H - 20, ox + 20, (T + H - B) / 2, ox + 20,
        (T + H - B) / 2);
    const double xs = TickStep(x1 - x0, 6), ys = TickStep(y1 - y0, 6);
    for (double x = std::ceil(x0 / xs) * xs; x <= x1 + 1e-9; x += xs) {
      absl::StrAppendFormat(&s,
                            "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" "
                            "stroke=\"#ddd\"/><text x=\"%.1f\" y=\"%g\" "
                            "text-anchor=\"middle\">%g</text>\n",
                            px(x), T, px(x), H - B, px(x), H - B + 16, x);
    }
    for (double y = std::ceil(y0 / ys) * ys; y <= y1 * 1.05 + 1e-9; y += ys) {
      absl::StrAppendFormat(&s,
                            "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" "
                            "stroke=\"#ddd\"/><text x=\"%g\" y=\"%.1f\" "
                            "text-anchor=\"end\">%g</text>\n",
                            ox + L, py(y), ox + W - R, py(y), ox + L - 4,
                            py(y) + 4, y);
    }
    for (const auto& [name, pts] : series) {
      auto [it, inserted] = color_of.emplace(name, color_of.size());
      const char* c = kColors[it->second % (sizeof(kColors) / sizeof(kColors[0]))];
      std::string poly;
      for (const Point& q : pts) absl::StrAppendFormat(&poly, "%.1f,%.1f ", px(q.x), py(q.y));
      absl::StrAppendFormat(&s,
                            "<polyline points=\"%s\" fill=\"none\" "
                            "stroke=\"%s\" stroke-width=\"1.5\"/>\n",
                            poly, c);
      for (const Point& q : pts) {
        absl::StrAppendFormat(&s,
                              "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" "
                              "fill=\"%s\"/>",
                              px(q.x), py(q.y), c);
        if (q.knob > 0) {
          absl::StrAppendFormat(&s,
                                "<text x=\"%.1f\" y=\"%.1f\" "
                                "font-size=\"9\">%g</text>",
                                px(q.x) + 4, py(q.y) - 4, q.knob);
        }
        s += "\n";
      }
    }
  }
  for (const auto& [name, idx] : color_of) {
    const char* c = kColors[idx % (sizeof(kColors) / sizeof(kColors[0]))];
    const double ly = T + 10 + 18 * static_cast<double>(idx);
    const double lx = total_w - legend + 10;
    absl::StrAppendFormat(&s,
                          "<circle cx=\"%g\" cy=\"%g\" r=\"4\" fill=\"%s\"/>"
                          "<text x=\"%g\" y=\"%g\">%s</text>\n",
                          lx, ly, c, lx + 10, ly + 4, XmlEscape(name));
  }
  s += "</svg>\n";
  RETURN_IF_ERROR(WriteFileAtomically(path, s));
  return path;
}

absl::StatusOr<std::string> WriteAdmissionPlot(const ReplayReport& r,
                                               const std::string& path) {
  const std::vector<AdmissionPoint> points = Admission(r);
  const double group = 110, L = 70, R = 20, T = 60, B = 90, H = 420;
  // Wide enough for the title lines.
  const double W = std::max(
      760.0,
      L + R + group * static_cast<double>(std::max<size_t>(points.size(), 1)));
  double y0 = 0, y1 = 1;
  for (const AdmissionPoint& p : points) {
    for (double g : {p.gain_without, p.gain_with}) {
      if (!std::isfinite(g)) continue;
      y0 = std::min(y0, g);
      y1 = std::max(y1, g);
    }
  }
  y1 *= 1.1;
  const auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%g\" y=\"20\" font-size=\"14\" text-anchor=\"middle\">%s"
      "</text>\n<text x=\"%g\" y=\"38\" text-anchor=\"middle\">share of "
      "the oracle's PTL gain: FCFS admission (grey) vs length-aware admission "
      "(blue); labels: P99 / FCFS's</text>\n"
      "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" "
      "stroke=\"black\"/>\n",
      W, H, W / 2, XmlEscape(r.trace), W / 2, L, T, W - L - R, H - T - B);
  const double ys = TickStep(y1 - y0, 6);
  for (double y = std::ceil(y0 / ys) * ys; y <= y1 + 1e-9; y += ys) {
    absl::StrAppendFormat(&s,
                          "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" "
                          "stroke=\"#ddd\"/><text x=\"%g\" y=\"%.1f\" "
                          "text-anchor=\"end\">%g</text>\n",
                          L, py(y), W - R, py(y), L - 6, py(y) + 4, y);
  }
  absl::StrAppendFormat(&s,
                        "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" "
                        "stroke=\"black\"/>\n",
                        L, py(0), W - R, py(0));
  for (size_t i = 0; i < points.size(); ++i) {
    const AdmissionPoint& p = points[i];
    const double gx = L + group * static_cast<double>(i) + 15;
    const double bw = 35;
    int k = 0;
    for (auto [gain, p99, color] :
         {std::tuple{p.gain_without, p.p99_without, "#999999"},
          std::tuple{p.gain_with, p.p99_with, "#1f77b4"}}) {
      const double x = gx + bw * k++;
      if (std::isfinite(gain)) {
        const double top = std::min(py(gain), py(0));
        absl::StrAppendFormat(
            &s,
            "<rect class=\"bar\" x=\"%g\" y=\"%.1f\" width=\"%g\" "
            "height=\"%.1f\" fill=\"%s\"/>\n",
            x, top, bw - 4, std::abs(py(gain) - py(0)), color);
      }
      absl::StrAppendFormat(
          &s,
          "<text x=\"%g\" y=\"%.1f\" font-size=\"10\" "
          "text-anchor=\"middle\">%s</text>\n",
          x + (bw - 4) / 2,
          (std::isfinite(gain) ? std::min(py(gain), py(0)) : py(0)) - 4,
          std::isfinite(p99) ? absl::StrFormat("%.2fx", p99) : "-");
    }
    absl::StrAppendFormat(
        &s,
        "<text x=\"%g\" y=\"%g\" font-size=\"10\" text-anchor=\"end\" "
        "transform=\"rotate(-35 %g %g)\">%s @ %.2f</text>\n",
        gx + bw, H - B + 14, gx + bw, H - B + 14, XmlEscape(p.policy), p.load);
  }
  s += "</svg>\n";
  RETURN_IF_ERROR(WriteFileAtomically(path, s));
  return path;
}

absl::StatusOr<std::string> WriteReplayPlot(const ReplayReport& r,
                                            const std::string& path) {
  if (absl::EndsWith(path, ".png")) {
    const auto series = Series(r);
    const std::string data = path + ".dat";
    const std::string script = path + ".gp";
    std::string d;
    for (const auto& [name, pts] : series) {
      absl::StrAppend(&d, "# ", name, "\n");
      for (const auto& [x, y] : pts) absl::StrAppendFormat(&d, "%g %g\n", x, y);
      d += "\n\n";
    }
    RETURN_IF_ERROR(WriteFileAtomically(data, d));
    for (const char* terminal :
         {"pngcairo size 900,560 font \",11\"", "png size 900,560"}) {
      std::string g = absl::StrCat(
          "set terminal ", terminal, "\nset output ", GnuplotQuote(path),
          "\nset title \"Mean per-token latency vs load\"\n"
          "set xlabel \"load (x FCFS capacity)\"\n"
          "set ylabel \"mean PTL (ms/token)\"\nset grid\nset key outside "
          "right top\nset yrange [0:*]\nplot ");
      for (size_t i = 0; i < series.size(); ++i) {
        absl::StrAppendFormat(
            &g,
            "%s%s index %d with linespoints lw 2 pt %d ps 1.2 lc rgb \"%s\" "
            "title %s",
            i == 0 ? "" : ", ", GnuplotQuote(data), i, kPointTypes[i % 6],
            kColors[i % (sizeof(kColors) / sizeof(kColors[0]))],
            GnuplotQuote(series[i].first));
      }
      g += "\n";
      RETURN_IF_ERROR(WriteFileAtomically(script, g));
      if (RunGnuplot(script)) {
        std::remove(data.c_str());
        std::remove(script.c_str());
        return path;
      }
    }
    std::remove(data.c_str());
    std::remove(script.c_str());
  }
  std::string svg_path = path;
  if (absl::EndsWith(svg_path, ".png")) {
    svg_path = svg_path.substr(0, svg_path.size() - 4) + ".svg";
  }
  RETURN_IF_ERROR(WriteFileAtomically(svg_path, Svg(r)));
  return svg_path;
}

}  // namespace leap::replay
