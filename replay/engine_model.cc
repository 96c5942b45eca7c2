#include "replay/engine_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <deque>
#include <limits>
#include <numbers>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "readout/stats.h"

namespace leap::replay {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

absl::Status CheckNonNegative(const char* name, double v) {
  if (!std::isfinite(v) || v < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be finite and >= 0, got ", v));
  }
  return absl::OkStatus();
}

int64_t ParseId(const std::string& key) {
  int64_t v = -1;
  std::from_chars(key.data(), key.data() + key.size(), v);
  return v;
}

// Standard normal CDF and its inverse (bisection: exact to ~1e-12, and
// only called once per request).
double Phi(double x) { return 0.5 * std::erfc(-x / std::numbers::sqrt2); }
double PhiInverse(double p) {
  double lo = -12, hi = 12;
  for (int i = 0; i < 100; ++i) {
    const double mid = 0.5 * (lo + hi);
    (Phi(mid) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

}  // namespace

absl::Status EngineOptions::Validate() const {
  if (resident < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("resident must be >= 1, got ", resident));
  }
  if (slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots must be >= 1, got ", slots));
  }
  RETURN_IF_ERROR(CheckNonNegative("step_base_ms", step_base_ms));
  RETURN_IF_ERROR(CheckNonNegative("step_per_seq_ms", step_per_seq_ms));
  RETURN_IF_ERROR(
      CheckNonNegative("prefill_per_token_ms", prefill_per_token_ms));
  if (step_base_ms + step_per_seq_ms <= 0) {
    return absl::InvalidArgumentError(
        "a decode step must take time: step_base_ms + step_per_seq_ms > 0");
  }
  if (max_prefill_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_prefill_tokens must be >= 1, got ", max_prefill_tokens));
  }
  if (!(capture_fraction >= 0 && capture_fraction <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "capture_fraction must be in [0, 1], got ", capture_fraction));
  }
  if (kind != EngineKind::kSlots && kind != EngineKind::kVllm) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown engine kind ", static_cast<int>(kind)));
  }
  if (max_num_seqs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_num_seqs must be >= 1, got ", max_num_seqs));
  }
  if (max_num_batched_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_num_batched_tokens must be >= 1, got ", max_num_batched_tokens));
  }
  if (block_size < 1 || kv_blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size and kv_blocks must be >= 1, got ", block_size,
                     " and ", kv_blocks));
  }
  return absl::OkStatus();
}

TablePredictor::TablePredictor(std::vector<double> values, double latency_s,
                               bool on_gpu, double gpu_ms)
    : values_(std::move(values)),
      latency_s_(latency_s),
      on_gpu_(on_gpu),
      gpu_ms_(gpu_ms) {}

TablePredictor::TablePredictor(std::vector<double> values,
                               std::vector<double> latencies)
    : values_(std::move(values)),
      latency_s_(0),
      on_gpu_(false),
      gpu_ms_(0),
      latencies_(std::move(latencies)) {}

absl::Status TablePredictor::Prefilled(
    std::span<const SimRequest* const> requests, double capture_s,
    double end_s) {
  for (const SimRequest* r : requests) {
    if (r->id < 0 || static_cast<size_t>(r->id) >= values_.size()) {
      return absl::InternalError(
          absl::StrCat("no prediction for request ", r->id));
    }
    const size_t i = static_cast<size_t>(r->id);
    if (!latencies_.empty()) {
      if (i >= latencies_.size() || !std::isfinite(values_[i])) continue;
      pending_.push_back({r->id, capture_s + latencies_[i]});
      continue;
    }
    pending_.push_back({r->id, on_gpu_ ? end_s : capture_s + latency_s_});
  }
  return absl::OkStatus();
}

absl::Status TablePredictor::Collect(double now_s,
                                     std::vector<PredictionUpdate>* out) {
  size_t keep = 0;
  for (const Pending& p : pending_) {
    if (p.ready_s <= now_s) {
      out->push_back({p.id, values_[static_cast<size_t>(p.id)], false});
    } else {
      pending_[keep++] = p;
    }
  }
  pending_.resize(keep);
  return absl::OkStatus();
}

absl::Status TablePredictor::Finished(const SimRequest& request) {
  return absl::OkStatus();
}

namespace {

// Empty steps (step_base_ms each) an idle engine passes in `gap_s`
// seconds: the tail bound's clock counts steps, and its virtual FCFS system
// drains while the engine idles. At most 10^7.
int64_t IdleSteps(double gap_s, const EngineOptions& e) {
  if (!(gap_s > 0) || e.step_base_ms <= 0) return 0;
  return static_cast<int64_t>(
      std::min(1e7, std::floor(gap_s * 1000.0 / e.step_base_ms)));
}

// What both engine models share: the requests by id (validated) and in
// arrival order, and the result with every request's fixed fields filled in.
struct Run {
  std::vector<const SimRequest*> by_id;
  std::vector<const SimRequest*> order;
  SimResult result;
};

// Checks ids (0..n-1, no repeats) and arrivals (finite, >= 0), and with
// cache_tokens > 0 that every request fits in the KV cache.
absl::StatusOr<Run> StartRun(std::span<const SimRequest> requests,
                             int64_t cache_tokens, const EngineOptions& e) {
  const size_t n = requests.size();
  Run run;
  run.by_id.assign(n, nullptr);
  for (const SimRequest& r : requests) {
    if (r.id < 0 || static_cast<size_t>(r.id) >= n ||
        run.by_id[static_cast<size_t>(r.id)] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ids must be 0..", n - 1, " without repeats; got ", r.id));
    }
    if (!std::isfinite(r.arrival_s) || r.arrival_s < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r.id,
                       ": arrival must be finite and >= 0, got ", r.arrival_s));
    }
    if (cache_tokens > 0) {
      const int64_t need = std::max<int64_t>(r.prompt_tokens, 1) +
                           std::max<int64_t>(r.output_tokens, 1);
      if (need > cache_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", r.id, " needs ", need,
            " tokens of KV cache, more than the whole cache (", e.kv_blocks,
            " blocks of ", e.block_size, ")"));
      }
    }
    run.by_id[static_cast<size_t>(r.id)] = &r;
  }
  run.order = run.by_id;
  std::stable_sort(run.order.begin(), run.order.end(),
                   [](const SimRequest* a, const SimRequest* b) {
                     return a->arrival_s < b->arrival_s;
                   });
  run.result.requests.resize(n);
  for (const SimRequest& r : requests) {
    RequestResult& o = run.result.requests[static_cast<size_t>(r.id)];
    o.id = r.id;
    o.segment = r.segment;
    o.arrival_s = r.arrival_s;
    o.output_tokens = std::max<int64_t>(r.output_tokens, 1);
    o.predicted_tokens = kNaN;
    o.deadline_origin_step = kNaN;
    o.deadline_step = kNaN;
    o.completion_step = kNaN;
  }
  return run;
}

// Hands the predictions known at `now_s` to the scheduler (requests not
// `live` any more are skipped; a first prediction may come as a rescore),
// then counts the requests that joined last step and are still unpredicted.
absl::Status ApplyPredictions(Predictor& predictor, double now_s,
                              const std::vector<char>& live,
                              std::vector<char>& predicted,
                              const std::vector<int64_t>& joined_last,
                              shim::CountdownScheduler& sched,
                              std::vector<PredictionUpdate>& updates,
                              SimResult& result) {
  const size_t n = live.size();
  updates.clear();
  RETURN_IF_ERROR(predictor.Collect(now_s, &updates));
  for (const PredictionUpdate& u : updates) {
    if (u.id < 0 || static_cast<size_t>(u.id) >= n) {
      return absl::InternalError(
          absl::StrCat("prediction for unknown request ", u.id));
    }
    const size_t i = static_cast<size_t>(u.id);
    if (!live[i]) continue;  // finished meanwhile
    if (predicted[i] && !u.rescore) continue;
    // Rescore is also accepted as the first prediction (a publish may
    // overtake the initial one).
    absl::Status s = sched.Rescore(std::to_string(u.id), u.tokens);
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prediction for request ", u.id, ": ", s.message()));
    }
    if (!predicted[i]) {
      predicted[i] = 1;
      result.requests[i].predicted_tokens = u.tokens;
    }
  }
  for (int64_t id : joined_last) {
    if (live[static_cast<size_t>(id)] && !predicted[static_cast<size_t>(id)]) {
      ++result.late_predictions;
    }
  }
  return absl::OkStatus();
}

// A finishing request's deadline (kBounded), before it leaves `sched`: the
// step it counts from, the deadline, and the steps committed so far (its
// last token's step is the last one committed).
absl::Status RecordDeadline(const shim::CountdownScheduler& sched, int64_t id,
                            double completion_s, SimResult& result) {
  absl::StatusOr<shim::RequestStats> st = sched.GetRequest(std::to_string(id));
  if (!st.ok()) return absl::InternalError(st.status().message());
  RequestResult& o = result.requests[static_cast<size_t>(id)];
  if (st->deadline.has_value()) {
    o.deadline_origin_step = st->deadline_origin;
    o.deadline_step = *st->deadline;
  }
  o.was_urgent = st->was_urgent;
  o.gave_up = st->gave_up;
  o.completion_step = sched.options().latency_target_s > 0
                          ? completion_s
                          : static_cast<double>(sched.counters().steps);
  return absl::OkStatus();
}

// The engine's clock for the schedulers (CountdownScheduler::SetTime): the
// simulated time and a moving average of the step duration over about the
// last kStepAverage steps (seconds).
constexpr double kStepAverage = 100;
struct StepClock {
  double step_s;
  explicit StepClock(const EngineOptions& e)
      : step_s((e.step_base_ms + e.step_per_seq_ms * e.slots) / 1000.0) {}
  void Took(double seconds) { step_s += (seconds - step_s) / kStepAverage; }
};

absl::Status SetTime(shim::CountdownScheduler& sched, double now_s,
                     const StepClock& clock) {
  absl::Status s = sched.SetTime(now_s, clock.step_s);
  if (!s.ok()) return absl::InternalError(s.message());
  return absl::OkStatus();
}

// The end of a step that ends at `end`: bookkeeping and progress.
void EndStep(const SimOptions& options, const shim::CountdownScheduler& sched,
             size_t finished, size_t n, double end, double& t,
             SimResult& result) {
  result.max_live =
      std::max(result.max_live, static_cast<int64_t>(sched.size()));
  t = end;
  ++result.steps;
  if (options.progress && options.progress_every_steps > 0 &&
      result.steps % options.progress_every_steps == 0) {
    options.progress(static_cast<int64_t>(finished), static_cast<int64_t>(n));
  }
}

absl::StatusOr<SimResult> SimulateVllm(std::span<const SimRequest> requests,
                                       const SimOptions& options,
                                       Predictor& predictor);

}  // namespace

absl::StatusOr<SimResult> Simulate(std::span<const SimRequest> requests,
                                   const SimOptions& options,
                                   Predictor& predictor) {
  const EngineOptions& e = options.engine;
  RETURN_IF_ERROR(e.Validate());
  if (e.kind == EngineKind::kVllm) {
    return SimulateVllm(requests, options, predictor);
  }
  ASSIGN_OR_RETURN(shim::CountdownScheduler sched,
                   shim::CountdownScheduler::Create(options.scheduler));
  const size_t n = requests.size();
  ASSIGN_OR_RETURN(Run run, StartRun(requests, 0, e));
  const std::vector<const SimRequest*>& by_id = run.by_id;
  const std::vector<const SimRequest*>& order = run.order;
  SimResult& result = run.result;

  // Length-aware admission: the waiting queue ranked by the prior. Under
  // the tail bound the waiting queue is a scheduler too (without a prior:
  // each request placed at the mean output length of the recent
  // completions when it arrives, so close to first come first served but
  // not exactly: the mean drifts between arrivals, and requests arriving
  // before any completion stay unpredicted), and each admitted request
  // carries its deadline
  // into the decode scheduler: one deadline from arrival.
  const bool bounded =
      options.scheduler.policy == shim::SchedulingPolicy::kBounded;
  std::optional<shim::CountdownScheduler> admit;
  std::vector<std::optional<shim::CarriedDeadline>> carried(n);
  // The estimate each request was placed with in the admission queue (NaN:
  // none), reported with its true length at completion (ObserveCompletion:
  // the bound's estimates are corrected by the mean error).
  std::vector<double> queue_estimate(n, kNaN);
  // Output lengths of the last kRecentLengths completions (a ring), and sum.
  constexpr size_t kRecentLengths = 1000;
  std::vector<double> recent_lengths;
  size_t recent_next = 0;
  double recent_sum = 0;
  if (options.prior != nullptr || bounded) {
    shim::SchedulerOptions ao = options.scheduler;
    ao.waiting_cap = 0;
    ASSIGN_OR_RETURN(admit, shim::CountdownScheduler::Create(ao));
  }
  std::vector<std::string> admitted_keys;

  // Per request: decode slots received, consecutive steps without one, and
  // its position in `members` (the requests in the scheduler).
  std::vector<int64_t> decoded(n, 0), waited(n, 0);
  std::vector<char> in_sched(n, 0), predicted(n, 0);
  std::vector<size_t> member_pos(n, 0);
  std::vector<int64_t> members, joined, joined_last;
  std::deque<int64_t> queue;
  std::vector<PredictionUpdate> updates;
  std::vector<const SimRequest*> admitted;
  std::vector<int64_t> selected_ids;
  size_t next = 0;
  int64_t resident = 0;
  size_t finished = 0;
  double t = 0;

  const auto finish = [&](int64_t id, double at) -> absl::Status {
    result.requests[static_cast<size_t>(id)].completion_s = at;
    --resident;
    ++finished;
    if (in_sched[static_cast<size_t>(id)]) {
      if (bounded) {
        RETURN_IF_ERROR(RecordDeadline(sched, id, at, result));
      }
      absl::Status s = sched.Remove(std::to_string(id));
      if (!s.ok()) return absl::InternalError(s.message());
      in_sched[static_cast<size_t>(id)] = 0;
      const size_t pos = member_pos[static_cast<size_t>(id)];
      members[pos] = members.back();
      member_pos[static_cast<size_t>(members[pos])] = pos;
      members.pop_back();
    }
    if (options.prior != nullptr) {
      RETURN_IF_ERROR(options.prior->Learn(*by_id[static_cast<size_t>(id)]));
    }
    const double len = static_cast<double>(
        result.requests[static_cast<size_t>(id)].output_tokens);
    if (bounded) {
      // Both stages learn the error of the estimate they placed it with:
      // the queue its prior (or the recent mean), decode its prediction.
      const double queued = queue_estimate[static_cast<size_t>(id)];
      const double predicted_tokens =
          result.requests[static_cast<size_t>(id)].predicted_tokens;
      // Both stages steer their urgency test by the latency from arrival
      // (target_quantile).
      const double latency = at - by_id[static_cast<size_t>(id)]->arrival_s;
      absl::Status s = sched.ObserveLatency(latency);
      if (s.ok() && admit.has_value()) s = admit->ObserveLatency(latency);
      if (s.ok() && !std::isnan(queued)) {
        s = admit->ObserveCompletion(queued, len);
      }
      if (s.ok() && !std::isnan(predicted_tokens)) {
        s = sched.ObserveCompletion(predicted_tokens, len);
      }
      if (!s.ok()) return absl::InternalError(s.message());
    }
    if (recent_lengths.size() < kRecentLengths) {
      recent_lengths.push_back(len);
    } else {
      recent_sum -= recent_lengths[recent_next];
      recent_lengths[recent_next] = len;
      recent_next = (recent_next + 1) % kRecentLengths;
    }
    recent_sum += len;
    return predictor.Finished(*by_id[static_cast<size_t>(id)]);
  };

  StepClock clock(e);
  while (finished < n) {
    while (next < n && order[next]->arrival_s <= t) {
      const SimRequest& r = *order[next++];
      if (!admit.has_value()) {
        queue.push_back(r.id);
      } else {
        // A latency target's deadline counts from the arrival itself.
        RETURN_IF_ERROR(SetTime(*admit, r.arrival_s, clock));
        const std::string key = std::to_string(r.id);
        absl::Status s = admit->Add(key);
        std::optional<double> v;
        if (options.prior != nullptr) v = options.prior->At(r);
        if (!v.has_value() && bounded && !recent_lengths.empty()) {
          // No prior: the mean output length of the recent completions, so
          // that the virtual FCFS system of the deadlines carries the work
          // the engine actually sees (it only ranks such requests among
          // themselves in arrival order).
          v = recent_sum / static_cast<double>(recent_lengths.size());
        }
        if (s.ok() && v.has_value()) {
          s = admit->SetPrior(key, *v);
          queue_estimate[static_cast<size_t>(r.id)] = *v;
        }
        if (!s.ok()) return absl::InternalError(s.message());
      }
    }
    if (resident == 0 && queue.empty() &&
        (!admit.has_value() || admit->size() == 0)) {
      if (bounded) {
        // The slowdown bound's clock is the step count: an idle engine passes
        // the gap in empty steps, so the virtual FCFS system drains
        // meanwhile (a latency target reads the time, SetTime).
        // Both schedulers are empty: the gap is committed in O(1).
        const int64_t idle = IdleSteps(order[next]->arrival_s - t, e);
        absl::Status s = sched.CommitIdle(idle);
        if (s.ok()) s = admit->CommitIdle(idle);
        if (!s.ok()) return absl::InternalError(s.message());
      }
      t = order[next]->arrival_s;
      continue;
    }

    if (bounded) {
      RETURN_IF_ERROR(SetTime(sched, t, clock));
      RETURN_IF_ERROR(SetTime(*admit, t, clock));
    }
    // Predictions known at the start of this step.
    RETURN_IF_ERROR(ApplyPredictions(predictor, t, in_sched, predicted,
                                     joined_last, sched, updates, result));

    // Decode slots.
    selected_ids.clear();
    if (sched.size() > 0) {
      for (const std::string& key : sched.Select(e.slots)) {
        selected_ids.push_back(ParseId(key));
      }
    } else if (bounded) {
      // Every engine step is a step of the deadlines' clock.
      absl::Status s = sched.Commit({});
      if (!s.ok()) return absl::InternalError(s.message());
    }
    for (int64_t id : members) ++waited[static_cast<size_t>(id)];
    for (int64_t id : selected_ids) waited[static_cast<size_t>(id)] = 0;
    for (int64_t id : members) {
      RequestResult& o = result.requests[static_cast<size_t>(id)];
      o.max_wait_steps =
          std::max(o.max_wait_steps, waited[static_cast<size_t>(id)]);
    }
    if (options.record_order) result.decode_order.push_back(selected_ids);

    // Admission into free memory: FCFS, or in the admission scheduler's
    // order (the first that does not fit the prefill budget stops it).
    admitted.clear();
    int64_t prefill_tokens = 0;
    if (admit.has_value()) {
      admitted_keys.clear();
      if (admit->size() > 0) {
        const size_t room = static_cast<size_t>(std::max<int64_t>(
            e.resident - resident, 0));
        for (std::string& key : admit->Order(room)) {
          const SimRequest* r = by_id[static_cast<size_t>(ParseId(key))];
          if (!admitted.empty() &&
              prefill_tokens + r->prompt_tokens > e.max_prefill_tokens) {
            break;
          }
          admitted.push_back(r);
          prefill_tokens += r->prompt_tokens;
          admitted_keys.push_back(std::move(key));
        }
        absl::Status s = admit->Commit(admitted_keys);
        for (const std::string& key : admitted_keys) {
          if (s.ok() && bounded) {
            absl::StatusOr<shim::CarriedDeadline> c = admit->Carry(key);
            if (!c.ok()) return absl::InternalError(c.status().message());
            carried[static_cast<size_t>(ParseId(key))] = *c;
          }
          if (s.ok()) s = admit->Remove(key);
        }
        if (!s.ok()) return absl::InternalError(s.message());
      } else if (bounded) {
        absl::Status s = admit->Commit({});
        if (!s.ok()) return absl::InternalError(s.message());
      }
    } else {
      while (!queue.empty() &&
             resident + static_cast<int64_t>(admitted.size()) < e.resident) {
        const SimRequest* r = by_id[static_cast<size_t>(queue.front())];
        if (!admitted.empty() &&
            prefill_tokens + r->prompt_tokens > e.max_prefill_tokens) {
          break;
        }
        admitted.push_back(r);
        prefill_tokens += r->prompt_tokens;
        queue.pop_front();
      }
    }

    const double prefill_ms =
        e.prefill_per_token_ms * static_cast<double>(prefill_tokens);
    const double step_ms =
        e.step_base_ms +
        e.step_per_seq_ms * static_cast<double>(selected_ids.size()) +
        prefill_ms +
        predictor.GpuMsPerPrediction() * static_cast<double>(admitted.size());
    const double end = t + step_ms / 1000.0;
    clock.Took(step_ms / 1000.0);
    const double capture =
        end - (1.0 - e.capture_fraction) * prefill_ms / 1000.0;

    for (int64_t id : selected_ids) {
      const size_t i = static_cast<size_t>(id);
      if (++decoded[i] >= result.requests[i].output_tokens - 1) {
        RETURN_IF_ERROR(finish(id, end));
      }
    }
    resident += static_cast<int64_t>(admitted.size());
    for (const SimRequest* r : admitted) {
      result.requests[static_cast<size_t>(r->id)].first_token_s = end;
    }
    if (!admitted.empty()) {
      RETURN_IF_ERROR(predictor.Prefilled(admitted, capture, end));
    }
    joined.clear();
    for (const SimRequest* r : admitted) {
      const size_t i = static_cast<size_t>(r->id);
      if (result.requests[i].output_tokens <= 1) {
        RETURN_IF_ERROR(finish(r->id, end));
        continue;
      }
      absl::Status s = carried[i].has_value()
                           ? sched.Add(std::to_string(r->id), *carried[i])
                           : sched.Add(std::to_string(r->id));
      if (!s.ok()) return absl::InternalError(s.message());
      in_sched[i] = 1;
      member_pos[i] = members.size();
      members.push_back(r->id);
      joined.push_back(r->id);
    }
    joined_last.swap(joined);
    EndStep(options, sched, finished, n, end, t, result);
  }
  result.end_s = t;
  result.counters = sched.counters();
  if (admit.has_value()) {
    result.queue_deadlines_given_up = admit->counters().deadlines_given_up;
    result.queue_credit_give_ups = admit->counters().credit_give_ups;
  }
  return std::move(run.result);
}

namespace {

absl::StatusOr<SimResult> SimulateVllm(std::span<const SimRequest> requests,
                                       const SimOptions& options,
                                       Predictor& predictor) {
  const EngineOptions& e = options.engine;
  shim::SchedulerOptions so = options.scheduler;
  so.slots = e.max_num_seqs;  // the virtual FCFS of the tail bound
  ASSIGN_OR_RETURN(shim::CountdownScheduler sched,
                   shim::CountdownScheduler::Create(so));
  const size_t n = requests.size();
  const int64_t bs = e.block_size;
  const int64_t cache_tokens = e.kv_blocks * bs;
  ASSIGN_OR_RETURN(Run run, StartRun(requests, cache_tokens, e));
  const std::vector<const SimRequest*>& by_id = run.by_id;
  const std::vector<const SimRequest*>& order = run.order;
  SimResult& result = run.result;
  // Per request: KV tokens computed, output tokens produced, blocks held,
  // running flag, admission counter (running order among unranked ones).
  std::vector<int64_t> computed(n, 0), produced(n, 0), blocks(n, 0);
  std::vector<char> running_flag(n, 0), predicted(n, 0), live(n, 0),
      prefilled_once(n, 0);
  std::vector<int64_t> admitted_at(n, 0);  // admission counter
  int64_t admissions = 0;
  std::vector<int64_t> running;  // ids
  std::vector<int64_t> waiting;  // ids (unordered; the scheduler ranks)
  int64_t free_blocks = e.kv_blocks;
  size_t next = 0, finished = 0;
  double t = 0;
  std::vector<PredictionUpdate> updates;
  std::vector<int64_t> joined_last, joined;
  std::vector<int64_t> top_ids;
  std::vector<std::string> running_keys;
  std::vector<int64_t> scheduled, chunk;  // this step: ids and tokens
  std::vector<const SimRequest*> prefilled;
  std::vector<std::string> committed;
  const auto target = [&](size_t i) {
    return std::max<int64_t>(by_id[i]->prompt_tokens, 1) + produced[i];
  };
  const auto remove_from = [](std::vector<int64_t>& v, int64_t id) {
    auto it = std::find(v.begin(), v.end(), id);
    if (it != v.end()) v.erase(it);
  };

  StepClock clock(e);
  const bool bounded = so.policy == shim::SchedulingPolicy::kBounded;
  while (finished < n) {
    while (next < n && order[next]->arrival_s <= t) {
      const SimRequest& r = *order[next++];
      const int64_t id = r.id;
      if (bounded) RETURN_IF_ERROR(SetTime(sched, r.arrival_s, clock));
      absl::Status s = sched.Add(std::to_string(id));
      if (s.ok() && options.prior != nullptr) {
        if (std::optional<double> v = options.prior->At(r); v.has_value()) {
          s = sched.SetPrior(std::to_string(id), *v);
        }
      }
      if (!s.ok()) return absl::InternalError(s.message());
      live[static_cast<size_t>(id)] = 1;
      waiting.push_back(id);
    }
    if (running.empty() && waiting.empty()) {
      if (so.policy == shim::SchedulingPolicy::kBounded) {
        // As in the slots engine: the idle gap passes in empty steps.
        // The scheduler is empty: the gap is committed in O(1).
        const int64_t idle = IdleSteps(order[next]->arrival_s - t, e);
        absl::Status s = sched.CommitIdle(idle);
        if (!s.ok()) return absl::InternalError(s.message());
      }
      t = order[next]->arrival_s;
      continue;
    }
    if (bounded) RETURN_IF_ERROR(SetTime(sched, t, clock));
    RETURN_IF_ERROR(ApplyPredictions(predictor, t, live, predicted,
                                     joined_last, sched, updates, result));

    // The scheduler's order of the coming step: the first max_num_seqs hold
    // every admission candidate (at most max_num_seqs - running are
    // admitted, and at most `running` of them are running).
    top_ids.clear();
    for (const std::string& key :
         sched.Order(static_cast<size_t>(e.max_num_seqs))) {
      top_ids.push_back(ParseId(key));
    }
    // Running requests in the scheduler's order (exact among themselves),
    // or with preempt_latest_admitted in admission order (vLLM's FCFS
    // policy: its running list, whose last entry is the victim).
    if (e.preempt_latest_admitted) {
      std::sort(running.begin(), running.end(), [&](int64_t a, int64_t b) {
        return admitted_at[static_cast<size_t>(a)] <
               admitted_at[static_cast<size_t>(b)];
      });
    } else if (!running.empty()) {
      running_keys.clear();
      for (int64_t id : running) running_keys.push_back(std::to_string(id));
      absl::StatusOr<std::vector<std::string>> ordered =
          sched.OrderAmong(running_keys);
      if (!ordered.ok()) return absl::InternalError(ordered.status().message());
      for (size_t r = 0; r < ordered->size(); ++r) {
        running[r] = ParseId((*ordered)[r]);
      }
    }

    int64_t budget = e.max_num_batched_tokens;
    scheduled.clear();
    chunk.clear();
    bool preempted_any = false;
    const auto blocks_for = [&](size_t i, int64_t tokens) {
      const int64_t want = (computed[i] + tokens + bs - 1) / bs;
      return std::max<int64_t>(want - blocks[i], 0);
    };
    // 1. Running requests.
    for (size_t idx = 0; idx < running.size() && budget > 0;) {
      const int64_t id = running[idx];
      const size_t i = static_cast<size_t>(id);
      const int64_t tokens = std::min(target(i) - computed[i], budget);
      bool self_preempted = false;
      while (blocks_for(i, tokens) > free_blocks) {
        // Preempt the last running request: the lowest-ranked, or with
        // preempt_latest_admitted the latest admitted.
        const size_t worst = running.size() - 1;
        const int64_t victim = running[worst];
        const size_t v = static_cast<size_t>(victim);
        auto sit = std::find(scheduled.begin(), scheduled.end(), victim);
        if (sit != scheduled.end()) {
          const size_t pos = static_cast<size_t>(sit - scheduled.begin());
          budget += chunk[pos];
          scheduled.erase(sit);
          chunk.erase(chunk.begin() + static_cast<long>(pos));
        }
        free_blocks += blocks[v];
        blocks[v] = 0;
        result.recomputed_tokens += computed[v];
        computed[v] = 0;
        running_flag[v] = 0;
        running.erase(running.begin() + static_cast<long>(worst));
        if (worst < idx) --idx;
        waiting.push_back(victim);
        ++result.preemptions;
        preempted_any = true;
        if (victim == id) {
          self_preempted = true;
          break;
        }
      }
      if (self_preempted) break;
      const int64_t need = blocks_for(i, tokens);
      free_blocks -= need;
      blocks[i] += need;
      scheduled.push_back(id);
      chunk.push_back(tokens);
      budget -= tokens;
      ++idx;
    }
    // 2. Admission, only when nobody was preempted.
    if (!preempted_any) {
      // The ranked prefix holds every candidate: at most `running` of its
      // max_num_seqs entries run, and at most max_num_seqs - running are
      // admitted.
      for (int64_t id : top_ids) {
        if (budget <= 0 ||
            static_cast<int64_t>(running.size()) >= e.max_num_seqs) {
          break;
        }
        if (running_flag[static_cast<size_t>(id)]) continue;
        const size_t i = static_cast<size_t>(id);
        const int64_t tokens = std::min(target(i) - computed[i], budget);
        const int64_t need = blocks_for(i, tokens);
        if (need > free_blocks) break;
        free_blocks -= need;
        blocks[i] += need;
        remove_from(waiting, id);
        admitted_at[i] = ++admissions;
        running.push_back(id);
        running_flag[i] = 1;
        scheduled.push_back(id);
        chunk.push_back(tokens);
        budget -= tokens;
      }
    }
    if (scheduled.empty()) {
      return absl::InternalError(absl::StrCat(
          "vllm model: nothing could be scheduled at t=", t, " (", running.size(),
          " running, ", waiting.size(), " waiting, ", free_blocks,
          " free blocks)"));
    }

    // Step time and effects.
    int64_t prefill_tokens = 0, decoding = 0;
    for (size_t s2 = 0; s2 < scheduled.size(); ++s2) {
      const size_t i = static_cast<size_t>(scheduled[s2]);
      const bool decode = produced[i] > 0 && target(i) - computed[i] == 1 &&
                          computed[i] > 0;
      if (decode) {
        ++decoding;
      } else {
        prefill_tokens += chunk[s2];
      }
    }
    const double prefill_ms =
        e.prefill_per_token_ms * static_cast<double>(prefill_tokens);
    const double step_ms = e.step_base_ms +
                           e.step_per_seq_ms * static_cast<double>(decoding) +
                           prefill_ms;
    const double end = t + step_ms / 1000.0;
    clock.Took(step_ms / 1000.0);
    const double capture =
        end - (1.0 - e.capture_fraction) * prefill_ms / 1000.0;
    committed.clear();
    prefilled.clear();
    joined.clear();
    std::vector<int64_t> done;
    for (size_t s2 = 0; s2 < scheduled.size(); ++s2) {
      const int64_t id = scheduled[s2];
      const size_t i = static_cast<size_t>(id);
      computed[i] += chunk[s2];
      if (computed[i] < target(i)) continue;  // a prefill chunk
      // A token.
      if (produced[i] == 0) {
        result.requests[i].first_token_s = end;
      } else {
        committed.push_back(std::to_string(id));
      }
      ++produced[i];
      if (!prefilled_once[i]) {
        prefilled_once[i] = 1;
        prefilled.push_back(by_id[i]);
        joined.push_back(id);
      }
      if (produced[i] >= result.requests[i].output_tokens) done.push_back(id);
    }
    absl::Status cs = sched.Commit(committed);
    if (!cs.ok()) return absl::InternalError(cs.message());
    if (!prefilled.empty()) {
      RETURN_IF_ERROR(predictor.Prefilled(prefilled, capture, end));
    }
    for (int64_t id : done) {
      const size_t i = static_cast<size_t>(id);
      result.requests[i].completion_s = end;
      free_blocks += blocks[i];
      blocks[i] = 0;
      running_flag[i] = 0;
      live[i] = 0;
      remove_from(running, id);
      if (so.policy == shim::SchedulingPolicy::kBounded) {
        RETURN_IF_ERROR(RecordDeadline(sched, id, end, result));
      }
      absl::Status s = sched.Remove(std::to_string(id));
      if (s.ok()) s = sched.ObserveLatency(end - by_id[i]->arrival_s);
      // The bound learns the error of the prediction, which placed its
      // virtual job (a prior's placement is replaced by the first
      // prediction).
      const double predicted_tokens = result.requests[i].predicted_tokens;
      if (s.ok() && !std::isnan(predicted_tokens)) {
        s = sched.ObserveCompletion(
            predicted_tokens,
            static_cast<double>(result.requests[i].output_tokens));
      }
      if (!s.ok()) return absl::InternalError(s.message());
      ++finished;
      if (options.prior != nullptr) {
        RETURN_IF_ERROR(options.prior->Learn(*by_id[i]));
      }
      RETURN_IF_ERROR(predictor.Finished(*by_id[i]));
    }
    joined_last.swap(joined);
    EndStep(options, sched, finished, n, end, t, result);
  }
  result.end_s = t;
  result.counters = sched.counters();
  return std::move(run.result);
}

}  // namespace

absl::StatusOr<double> MeasureCapacity(std::span<const SimRequest> requests,
                                       const EngineOptions& engine) {
  if (requests.empty()) {
    return absl::InvalidArgumentError("no requests to measure capacity on");
  }
  std::vector<SimRequest> at_zero(requests.begin(), requests.end());
  for (size_t i = 0; i < at_zero.size(); ++i) {
    at_zero[i].arrival_s = 0;
    at_zero[i].id = static_cast<int64_t>(i);
  }
  SimOptions o;
  o.engine = engine;
  o.scheduler.slots =
      engine.kind == EngineKind::kVllm ? engine.max_num_seqs : engine.slots;
  o.scheduler.waiting_cap = 0;
  o.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
  NoPredictor none;
  ASSIGN_OR_RETURN(SimResult r, Simulate(at_zero, o, none));
  return static_cast<double>(at_zero.size()) / r.end_s;
}

double Percentile(std::vector<double> x, double p) {
  if (x.empty()) return kNaN;
  std::sort(x.begin(), x.end());
  const double rank = p / 100.0 * static_cast<double>(x.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, x.size() - 1);
  return x[lo] + (rank - static_cast<double>(lo)) * (x[hi] - x[lo]);
}

double WorstWindowPercentile(std::span<const double> x, size_t window,
                             double p) {
  const size_t n = x.size();
  if (n == 0 || window == 0) return kNaN;
  if (n <= window) {
    return Percentile(std::vector<double>(x.begin(), x.end()), p);
  }
  // rank_of[i]: x[i]'s position in ascending order (ties by index), so each
  // window's k-th smallest is a prefix-count search over ranks.
  std::vector<size_t> by_value(n);
  for (size_t i = 0; i < n; ++i) by_value[i] = i;
  std::stable_sort(by_value.begin(), by_value.end(),
                   [&](size_t a, size_t b) { return x[a] < x[b]; });
  std::vector<size_t> rank_of(n);
  for (size_t r = 0; r < n; ++r) rank_of[by_value[r]] = r;
  std::vector<int64_t> tree(n + 1, 0);  // Fenwick, 1-based over ranks
  const auto add = [&](size_t rank, int64_t d) {
    for (size_t i = rank + 1; i <= n; i += i & (~i + 1)) tree[i] += d;
  };
  size_t top = 1;
  while (top * 2 <= n) top *= 2;
  // The value of the k-th smallest (0-based) present rank.
  const auto kth = [&](size_t k) {
    size_t pos = 0;
    int64_t left = static_cast<int64_t>(k);
    for (size_t step = top; step > 0; step /= 2) {
      if (pos + step <= n && tree[pos + step] <= left) {
        pos += step;
        left -= tree[pos];
      }
    }
    return x[by_value[pos]];  // pos: 0-based rank of the answer
  };
  const double rank = p / 100.0 * static_cast<double>(window - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, window - 1);
  const double frac = rank - static_cast<double>(lo);
  for (size_t i = 0; i < window; ++i) add(rank_of[i], 1);
  double worst = -std::numeric_limits<double>::infinity();
  for (size_t begin = 0;; ++begin) {
    const double a = kth(lo);
    worst = std::max(worst, a + frac * (kth(hi) - a));
    if (begin + window == n) break;
    add(rank_of[begin], -1);
    add(rank_of[begin + window], 1);
  }
  return worst;
}

Metrics ComputeMetrics(std::span<const RequestResult> results,
                       const std::function<bool(const RequestResult&)>& keep) {
  Metrics m;
  std::vector<double> latency, long_latency, pred, truth;
  std::vector<std::pair<double, size_t>> by_arrival;  // (arrival, index)
  double ptl = 0, ttft = 0, tokens = 0;
  double first_arrival = std::numeric_limits<double>::infinity();
  double last_completion = -std::numeric_limits<double>::infinity();
  for (const RequestResult& r : results) {
    if (keep && !keep(r)) continue;
    const double lat = r.completion_s - r.arrival_s;
    const double out =
        static_cast<double>(std::max<int64_t>(r.output_tokens, 1));
    by_arrival.emplace_back(r.arrival_s, latency.size());
    latency.push_back(lat);
    ptl += lat / out;
    ttft += r.first_token_s - r.arrival_s;
    tokens += out;
    first_arrival = std::min(first_arrival, r.arrival_s);
    last_completion = std::max(last_completion, r.completion_s);
    if (r.output_tokens > kLongTokens) long_latency.push_back(lat);
    if (!std::isnan(r.predicted_tokens)) {
      pred.push_back(r.predicted_tokens);
      truth.push_back(out);
    }
  }
  m.n = static_cast<int64_t>(latency.size());
  if (m.n == 0) {
    m.mean_ptl = m.mean_latency = m.p90_latency = m.p95_latency =
        m.p99_latency = m.window_p99_latency = m.mean_ttft = m.throughput =
            m.spearman = kNaN;
    return m;
  }
  const double n = static_cast<double>(m.n);
  m.mean_ptl = ptl / n;
  double sum = 0;
  for (double l : latency) sum += l;
  m.mean_latency = sum / n;
  m.mean_ttft = ttft / n;
  m.p90_latency = Percentile(latency, 90);
  m.p95_latency = Percentile(latency, 95);
  m.p99_latency = Percentile(latency, 99);
  std::sort(by_arrival.begin(), by_arrival.end());
  std::vector<double> in_arrival_order;
  in_arrival_order.reserve(latency.size());
  for (const auto& [arrival, i] : by_arrival) in_arrival_order.push_back(latency[i]);
  m.window_p99_latency = WorstWindowPercentile(in_arrival_order, kP99Window, 99);
  const double span = last_completion - first_arrival;
  m.throughput = span > 0 ? tokens / span : kNaN;
  m.n_long = static_cast<int64_t>(long_latency.size());
  if (!long_latency.empty()) {
    m.long_p95_latency = Percentile(std::move(long_latency), 95);
  }
  m.spearman = kNaN;
  if (pred.size() >= 2) {
    double weighted = 0, weight = 0;
    for (size_t begin = 0; begin < pred.size();) {
      size_t end = std::min(pred.size(), begin + kRankWindow);
      if (pred.size() - end < kRankWindow / 5) end = pred.size();
      const std::span<const double> p(pred.data() + begin, end - begin);
      const std::span<const double> t(truth.data() + begin, end - begin);
      const double rho = readout::Spearman(p, t);
      if (std::isfinite(rho)) {
        weighted += rho * static_cast<double>(end - begin);
        weight += static_cast<double>(end - begin);
      }
      begin = end;
    }
    if (weight > 0) m.spearman = weighted / weight;
  }
  return m;
}

std::vector<double> CopulaPredictions(std::span<const int64_t> lengths,
                                      double rho, uint64_t seed) {
  const size_t n = lengths.size();
  std::vector<double> out(n);
  if (n == 0) return out;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u01;
  std::normal_distribution<double> n01;
  // Rank with random tie-breaking.
  std::vector<std::pair<int64_t, double>> key(n);
  for (size_t i = 0; i < n; ++i) key[i] = {lengths[i], u01(rng)};
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(),
            [&](size_t a, size_t b) { return key[a] < key[b]; });
  std::vector<double> sorted(n);
  for (size_t k = 0; k < n; ++k) {
    sorted[k] = static_cast<double>(lengths[idx[k]]);
  }
  const double r =
      std::clamp(2.0 * std::sin(std::numbers::pi * rho / 6.0), -1.0, 1.0);
  const double noise = std::sqrt(std::max(0.0, 1.0 - r * r));
  for (size_t k = 0; k < n; ++k) {
    const double z =
        PhiInverse((static_cast<double>(k) + 0.5) / static_cast<double>(n));
    const double s = r * z + noise * n01(rng);
    const double q = Phi(s) * static_cast<double>(n);
    const size_t at = std::min(n - 1, static_cast<size_t>(std::max(0.0, q)));
    out[idx[k]] = sorted[at];
  }
  return out;
}

}  // namespace leap::replay
