#include "sidecar/core/prior_table.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "sidecar/core/core.h"
#include "sidecar/core/engine_messages.h"

namespace leap::sidecar {

namespace pb = ::leap::v1;

absl::StatusOr<bool> PriorTable::Learn(absl::string_view product_line,
                                       int64_t budget,
                               const core::PriorRequest& request,
                               int64_t output_tokens) {
  absl::MutexLock lock(&mu_);
  auto it = lines_.find(product_line);
  if (it == lines_.end()) {
    if (lines_.size() >= kMaxProductLines) return false;
    core::LengthPriorOptions o;
    o.budget = std::max<int64_t>(budget, 1);
    it = lines_.emplace(std::string(product_line), core::LengthPrior(o)).first;
  }
  if (absl::Status s = it->second.Learn(request, output_tokens); !s.ok()) {
    return s;
  }
  return true;
}

PriorAnswer PriorTable::Predict(absl::string_view product_line,
                                const core::PriorRequest& request) const {
  absl::MutexLock lock(&mu_);
  PriorAnswer a;
  auto it = lines_.find(product_line);
  if (it == lines_.end()) return a;
  a.samples = it->second.samples();
  std::optional<double> p = it->second.Predict(request);
  if (p.has_value()) {
    a.available = true;
    a.predicted_tokens = *p;
  }
  return a;
}

size_t PriorTable::product_lines() const {
  absl::MutexLock lock(&mu_);
  return lines_.size();
}

absl::Status CheckArrival(const Core& core, const pb::ArrivalRecord& r) {
  const int64_t max_id = core.options().max_id_bytes;
  if (r.request_id().empty()) {
    return absl::InvalidArgumentError("arrival record: request_id is empty");
  }
  if (r.request_id().find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        "arrival record: request_id must not contain NUL");
  }
  absl::Status too_long =
      CheckIdBytes("request_id", r.request_id(), static_cast<size_t>(max_id));
  if (too_long.ok()) {
    too_long = CheckIdBytes("product_line", r.product_line(),
                            static_cast<size_t>(max_id));
  }
  if (!too_long.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival record: ", too_long.message()));
  }
  if (r.prompt_tokens() < 1 || r.prompt_tokens() > readout::kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival record: prompt_tokens must be in [1, ",
                     readout::kMaxReportedTokens, "], got ", r.prompt_tokens()));
  }
  const int64_t cap = r.decoding().max_tokens();
  if (cap < 0 || cap > readout::kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival record: decoding max_tokens must be in [0, ",
                     readout::kMaxReportedTokens, "], got ", cap));
  }
  return absl::OkStatus();
}

absl::StatusOr<PriorAnswer> QueryPrior(Core& core, const pb::ArrivalRecord& r) {
  if (!core.serving()) {
    return absl::UnavailableError("recovering: not serving yet");
  }
  if (absl::Status s = CheckArrival(core, r); !s.ok()) return s;
  core::PriorRequest q;
  q.prompt_tokens = r.prompt_tokens();
  q.max_tokens = r.decoding().max_tokens();
  PriorAnswer a = core.priors().Predict(r.product_line(), q);
  (a.available ? core.metrics().prior_answered()
               : core.metrics().prior_unavailable())
      .Increment();
  return a;
}

void AnswerPriorQueries(Core* core, const pb::PriorQueryBatch& in,
                        pb::PriorBatch* out) {
  for (const pb::ArrivalRecord& r : in.records()) {
    absl::StatusOr<PriorAnswer> a = QueryPrior(*core, r);
    if (!a.ok()) {
      AddRequestError(r.request_id(), a.status(), out->mutable_errors(),
                      core->metrics());
      continue;
    }
    pb::LengthPrior* p = out->add_priors();
    p->set_request_id(r.request_id());
    p->set_available(a->available);
    p->set_predicted_tokens(a->predicted_tokens);
    p->set_samples(a->samples);
  }
}

absl::StatusOr<CompletionOutcome> CompleteWithPrior(
    Core* core, absl::string_view request_id, int64_t output_tokens,
    readout::FinishReason reason, absl::string_view instance,
    bool defer_fleet_ack, int64_t prompt_tokens, bool defer_log_sync) {
  // No live request has a longer id: refused as too long, not as unknown.
  if (absl::Status s = CheckIdBytes(
          "request_id", request_id,
          static_cast<size_t>(core->options().max_id_bytes));
      !s.ok()) {
    return s;
  }
  if (prompt_tokens < 0 || prompt_tokens > readout::kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("completion prompt_tokens must be in [0, ",
                     readout::kMaxReportedTokens, "] (0 = not given), got ",
                     prompt_tokens));
  }
  const bool teaches = prompt_tokens > 0 &&
                       (reason == readout::FinishReason::kStop ||
                        reason == readout::FinishReason::kLength);
  // What the prior needs of the request is read before Core::Complete takes
  // it out of the cache.
  std::string product_line;
  core::PriorRequest q;
  int64_t budget = readout::kDefaultMaxTokens;
  bool found = false;
  if (teaches) {
    std::shared_ptr<LiveRequest> r =
        core->cache().Find(LiveRequestKey(instance, request_id));
    if (r != nullptr) {
      found = true;
      product_line = r->product_line;
      q.prompt_tokens = prompt_tokens;
      q.max_tokens = r->request_max_tokens;
      if (!r->scores.empty()) {
        if (std::shared_ptr<LiveReadout> ro = r->scores[0].scorer.lock()) {
          budget = ro->spec().max_tokens;
        }
      }
    }
  }
  absl::StatusOr<CompletionOutcome> o =
      core->Complete(request_id, output_tokens, reason, instance,
                     defer_fleet_ack, defer_log_sync);
  if (found && o.ok() && !o->duplicate) {
    // Counts were validated by Complete: Learn cannot fail here.
    absl::StatusOr<bool> learned =
        core->priors().Learn(product_line, budget, q, output_tokens);
    if (learned.ok() && *learned) core->metrics().prior_learned().Increment();
    core->metrics().prior_product_lines().Set(
        static_cast<double>(core->priors().product_lines()));
  }
  return o;
}

}  // namespace leap::sidecar
