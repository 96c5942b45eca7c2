#include "sidecar/core/engine_messages.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/ids.h"
#include "sidecar/core/prior_table.h"

namespace leap::sidecar {

namespace pb = ::leap::v1;

absl::StatusOr<readout::DType> DTypeFromProto(pb::FeatureDType d) {
  switch (d) {
    case pb::FEATURE_DTYPE_FLOAT32:
      return readout::DType::kFloat32;
    case pb::FEATURE_DTYPE_BFLOAT16:
      return readout::DType::kBFloat16;
    case pb::FEATURE_DTYPE_FLOAT16:
      return readout::DType::kFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "feature dtype must be FLOAT32, BFLOAT16 or FLOAT16, got ",
          pb::FeatureDType_Name(d).empty() ? std::to_string(d)
                                           : pb::FeatureDType_Name(d)));
  }
}

absl::StatusOr<readout::FinishReason> ReasonFromProto(pb::FinishReason r) {
  switch (r) {
    case pb::FINISH_REASON_STOP:
      return readout::FinishReason::kStop;
    case pb::FINISH_REASON_LENGTH:
      return readout::FinishReason::kLength;
    case pb::FINISH_REASON_CANCELLED:
      return readout::FinishReason::kCancelled;
    case pb::FINISH_REASON_ABORTED:
      return readout::FinishReason::kAborted;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "finish reason must be STOP, LENGTH, CANCELLED or ABORTED, got ",
          static_cast<int>(r)));
  }
}

void ToPrediction(const ScoreResult& s, const std::string& id,
                  pb::Prediction* p) {
  p->set_request_id(id);
  p->set_predicted_tokens(s.predicted_tokens);
  p->set_score(s.score);
  p->set_readout(s.readout);
  p->set_version(s.version);
  p->set_arm(s.arm);
  if (s.cold) p->set_cold(true);
}

void AddRequestError(const std::string& id, const absl::Status& s,
                     google::protobuf::RepeatedPtrField<pb::RequestError>* out,
                     Metrics& metrics) {
  pb::RequestError* e = out->Add();
  // Bounded echo: ids beyond 4 KiB name no live request anyway.
  e->set_request_id(id.substr(0, 4096));
  e->set_code(static_cast<int>(s.code()));
  e->set_message(std::string(s.message()));
  metrics.RequestErrors(absl::StatusCodeToString(s.code())).Increment();
}

absl::StatusOr<readout::DType> CheckHello(const pb::Hello& hello) {
  if (absl::Status s = ValidateInstanceId(hello.instance_id()); !s.ok()) {
    return s;
  }
  // Bounded like the ids of a record (docs/WIRE.md, "Sizes"): a hello
  // always fits a shm attach request and the log lines that name it.
  if (absl::Status s = CheckIdBytes("engine_id", hello.engine_id()); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckIdBytes("model_id", hello.model_id()); !s.ok()) {
    return s;
  }
  absl::StatusOr<readout::DType> dtype = DTypeFromProto(hello.dtype());
  if (!dtype.ok()) return dtype.status();
  if (hello.dim() < readout::kMinDim || hello.dim() > readout::kMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello dim must be in [", readout::kMinDim, ", ",
                     readout::kMaxDim, "], got ", hello.dim()));
  }
  return *dtype;
}

absl::Status CheckHelloIdentity(const Core& core, const pb::Hello& hello) {
  std::string mismatch;
  for (const auto& r : core.ListReadouts()) {
    const readout::ReadoutSpec& spec = r->spec();
    if (spec.dim != hello.dim()) continue;
    const bool model_differs = !hello.model_id().empty() &&
                               !spec.model_id.empty() &&
                               hello.model_id() != spec.model_id;
    // Hello.layer 0 is proto3's unset value (the shim sends -1 for "not
    // known"): only a positive layer is compared.
    const bool layer_differs =
        hello.layer() > 0 && spec.layer >= 0 && hello.layer() != spec.layer;
    if (!model_differs && !layer_differs) continue;
    absl::StrAppend(&mismatch, mismatch.empty() ? "" : "; ", "readout '",
                    r->name(), "' was trained on model_id '", spec.model_id,
                    "' layer ", spec.layer);
  }
  if (mismatch.empty()) return absl::OkStatus();
  const std::string msg = absl::StrCat(
      "hello of engine '", hello.engine_id(), "' declares model_id '",
      hello.model_id(), "' layer ", hello.layer(), ", but ", mismatch);
  if (core.options().allow_hello_mismatch) {
    std::printf("leapd: warning: %s; served anyway (--allow_hello_mismatch)\n",
                msg.c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  }
  std::printf("leapd: refused: %s\n", msg.c_str());
  std::fflush(stdout);
  return absl::FailedPreconditionError(absl::StrCat(
      msg, " (start leapd with --allow_hello_mismatch to serve it anyway)"));
}

void HandleEngineMessage(Core* core, uint64_t session, const pb::Hello& hello,
                         readout::DType dtype, pb::EngineMessage* in,
                         pb::SidecarMessage* out, LiveTracker* tracker) {
  Metrics& metrics = core->metrics();
  out->set_seq(in->seq());
  switch (in->body_case()) {
    case pb::EngineMessage::kFeatures: {
      const auto& records = in->features().records();
      int64_t bytes = 0;
      for (const auto& r : records) bytes += r.features().size();
      if (bytes > core->options().max_batch_bytes) {
        AddRequestError("",
                        absl::ResourceExhaustedError(absl::StrCat(
                            "feature batch of ", bytes,
                            " bytes exceeds the limit of ",
                            core->options().max_batch_bytes, " bytes")),
                        out->mutable_predictions()->mutable_errors(), metrics);
        break;
      }
      pb::PredictionBatch* batch = out->mutable_predictions();
      const int64_t want =
          hello.dim() * static_cast<int64_t>(readout::DTypeSize(dtype));
      // Size errors first pass; the rest scored as one batch; answers in
      // record order.
      std::vector<ScoreRequest> reqs;
      std::vector<int> req_of(records.size(), -1);
      std::vector<absl::Status> size_error(records.size());
      auto* mutable_records = in->mutable_features()->mutable_records();
      for (int k = 0; k < records.size(); ++k) {
        auto& r = (*mutable_records)[k];
        if (static_cast<int64_t>(r.features().size()) != want) {
          size_error[k] = absl::InvalidArgumentError(absl::StrCat(
              "record has ", r.features().size(),
              " bytes of features; hello declared dim ", hello.dim(), " ",
              readout::DTypeName(dtype), " (", want, " bytes)"));
          continue;
        }
        ScoreRequest req;
        req.request_id = r.request_id();
        req.instance = hello.instance_id();
        req.product_line = r.product_line();
        req.features = r.features();
        req.owned_features = r.mutable_features();
        req.dtype = dtype;
        req.request_max_tokens = r.decoding().max_tokens();
        req_of[k] = static_cast<int>(reqs.size());
        reqs.push_back(req);
      }
      std::vector<absl::StatusOr<ScoreResult>> results;
      std::vector<std::shared_ptr<LiveRequest>> lives;
      core->PredictBatch(reqs, session, &results, &lives);
      for (int k = 0; k < records.size(); ++k) {
        const auto& r = records[k];
        if (req_of[k] < 0) {
          AddRequestError(r.request_id(), size_error[k], batch->mutable_errors(),
                          metrics);
          continue;
        }
        const absl::StatusOr<ScoreResult>& s = results[req_of[k]];
        if (!s.ok()) {
          AddRequestError(r.request_id(), s.status(), batch->mutable_errors(),
                          metrics);
          continue;
        }
        ToPrediction(*s, r.request_id(), batch->add_predictions());
        // Tracked before the answer is queued, so every publish from now on
        // rescores it. A rescore may then reach the engine before this
        // prediction; both carry the version and the newer one wins (the
        // shim's scheduler and binding compare versions).
        tracker->Track(std::move(lives[req_of[k]]));
      }
      break;
    }
    case pb::EngineMessage::kCompletions: {
      StartCompletions(core, hello, in->completions())
          ->Finish(out->mutable_ack(), tracker);
      break;
    }
    case pb::EngineMessage::kCancels: {
      const auto& ids = in->cancels().request_ids();
      std::vector<absl::string_view> views(ids.begin(), ids.end());
      CancelRequests(core, views, out->mutable_ack(), tracker,
                     hello.instance_id());
      break;
    }
    case pb::EngineMessage::kPriorQueries:
      AnswerPriorQueries(core, in->prior_queries(), out->mutable_priors());
      break;
    case pb::EngineMessage::kHello:
      out->mutable_error()->set_code(
          static_cast<int>(absl::StatusCode::kFailedPrecondition));
      out->mutable_error()->set_message("hello may only be sent once");
      break;
    default:
      out->mutable_error()->set_code(
          static_cast<int>(absl::StatusCode::kInvalidArgument));
      out->mutable_error()->set_message("empty engine message");
      break;
  }
}

std::shared_ptr<CompletionsAnswer> StartCompletions(
    Core* core, const pb::Hello& hello, const pb::CompletionBatch& completions) {
  auto answer = std::make_shared<CompletionsAnswer>();
  answer->core_ = core;
  answer->entries_.reserve(completions.completions_size());
  // Every completion first, each publish in flight; then the answer waits
  // for JetStream's acknowledgements, one round trip for the message.
  // With --sync_log the feedback log is synced once for the whole message,
  // before any of it is acknowledged.
  bool any_ok = false;
  for (const auto& c : completions.completions()) {
    absl::StatusOr<readout::FinishReason> reason = ReasonFromProto(c.reason());
    answer->entries_.push_back(
        {c.request_id(),
         reason.ok() ? CompleteWithPrior(core, c.request_id(), c.output_tokens(),
                                         *reason, hello.instance_id(),
                                         /*defer_fleet_ack=*/true,
                                         c.prompt_tokens(),
                                         /*defer_log_sync=*/true)
                     : absl::StatusOr<CompletionOutcome>(reason.status())});
    any_ok |= answer->entries_.back().outcome.ok();
  }
  if (any_ok) {
    const absl::Status synced = core->SyncFeedbackLog();
    for (auto& e : answer->entries_) {
      if (!e.outcome.ok()) continue;
      if (!synced.ok()) {
        // Nothing of the message is acknowledged: each completion is
        // resent, and acknowledged as a duplicate once a sync succeeds
        // (for a store whose sync failed: after leapd restarts).
        e.outcome = synced;
      } else if (e.outcome->announce_duplicate) {
        e.outcome->announce_duplicate();
        e.outcome->announce_duplicate = nullptr;
      }
    }
  }
  std::vector<std::shared_ptr<PendingFleetAck>> acks;
  for (const auto& e : answer->entries_) {
    if (e.outcome.ok() && e.outcome->fleet_ack != nullptr) {
      acks.push_back(e.outcome->fleet_ack);
    }
  }
  {
    absl::MutexLock l(&answer->mu_);
    answer->waiting_ = static_cast<int>(acks.size());
  }
  // (The callbacks hold the answer until the last one ran.)
  for (const auto& ack : acks) ack->OnDone([answer] { answer->AckArrived(); });
  return answer;
}

void CompletionsAnswer::AckArrived() {
  std::vector<std::function<void()>> run;
  {
    absl::MutexLock l(&mu_);
    if (--waiting_ != 0) return;
    run.swap(on_ready_);
  }
  for (auto& f : run) f();
}

bool CompletionsAnswer::ready() const {
  absl::MutexLock l(&mu_);
  return waiting_ == 0;
}

void CompletionsAnswer::OnReady(std::function<void()> f) {
  {
    absl::MutexLock l(&mu_);
    if (waiting_ != 0) {
      on_ready_.push_back(std::move(f));
      return;
    }
  }
  f();
}

void CompletionsAnswer::Finish(pb::Ack* ack, LiveTracker* tracker) {
  {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(+[](int* w) { return *w == 0; }, &waiting_));
  }
  Metrics& metrics = core_->metrics();
  for (Entry& e : entries_) {
    absl::StatusOr<CompletionOutcome>& o = e.outcome;
    if (o.ok() && o->fleet_ack != nullptr) {
      absl::StatusOr<uint64_t> seq = o->fleet_ack->Wait();  // set: no wait
      if (!seq.ok()) {
        o = seq.status();
      } else {
        o->fleet_seq = *seq;
      }
    }
    if (!o.ok()) {
      AddRequestError(e.request_id, o.status(), ack->mutable_errors(), metrics);
      continue;
    }
    tracker->Untrack(e.request_id);
    if (o->duplicate) ack->set_duplicates(ack->duplicates() + 1);
    if (o->learned) {
      ack->set_accepted(ack->accepted() + 1);
    } else {
      ack->set_skipped(ack->skipped() + 1);
    }
  }
}

void CancelRequests(Core* core, absl::Span<const absl::string_view> ids,
                    pb::Ack* ack, LiveTracker* tracker,
                    absl::string_view instance) {
  std::vector<absl::Status> status;
  core->CancelBatch(ids, &status, instance);
  const size_t max_id = static_cast<size_t>(core->options().max_id_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!status[i].ok()) {
      // No live request has a longer id: refused as too long, not unknown.
      absl::Status too_long = CheckIdBytes("request_id", ids[i], max_id);
      AddRequestError(std::string(ids[i]), too_long.ok() ? status[i] : too_long,
                      ack->mutable_errors(), core->metrics());
      continue;
    }
    tracker->Untrack(ids[i]);
    ack->set_accepted(ack->accepted() + 1);
  }
}

void RescorePredictions(const std::string& name, const PublishedVersion& v,
                        const std::vector<std::shared_ptr<LiveRequest>>& live,
                        std::vector<pb::Prediction>* out) {
  for (const auto& r : live) {
    if (r->gone.load() || r->scores.empty() || r->scores[0].readout != name) {
      continue;
    }
    auto score = v.folded.Score(r->view());
    if (!score.ok()) continue;
    pb::Prediction p;
    p.set_request_id(r->request_id);
    p.set_score(*score);
    p.set_predicted_tokens(readout::RequestTokensFromScore(
        *score, v.folded.max_tokens(), r->request_max_tokens));
    p.set_readout(name);
    p.set_version(v.version);
    p.set_arm(r->scores[0].arm);
    out->push_back(std::move(p));
  }
}

}  // namespace leap::sidecar
