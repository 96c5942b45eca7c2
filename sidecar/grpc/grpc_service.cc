#include "sidecar/grpc/grpc_service.h"

#include "sidecar/core/engine_messages.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <thread>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;

// Predictions per Rescore message.
constexpr size_t kRescoreChunk = 4096;

void FillInfo(LiveReadout& r, pb::ReadoutInfo* info) {
  info->set_name(r.name());
  info->set_dim(r.spec().dim);
  info->set_layer(r.spec().layer);
  info->set_model_id(r.spec().model_id);
  info->set_max_tokens(r.spec().max_tokens);
  info->set_lambda(r.spec().lambda);
  info->set_version(r.current()->version);
  info->set_completions_learned(r.completions_learned());
  info->set_frozen(r.frozen());
  info->set_frozen_reason(r.frozen_reason());
  info->set_rls_backlog(r.backlog());
  info->set_created_unix_ms(r.created_unix_ms());
}

void FillVersion(const VersionRecord& v, pb::VersionInfo* out) {
  out->set_version(v.version);
  out->set_completions_learned(v.completions_learned);
  out->set_published_unix_ms(v.published_unix_ms);
  out->set_cause(v.cause);
  out->set_spearman(v.spearman);
  out->set_spearman_n(v.spearman_n);
}

void FillGuardrail(const GuardrailStatus& g, pb::GuardrailStats* out) {
  out->set_state(g.state);
  out->set_spearman(g.spearman);
  out->set_spearman_n(g.spearman_n);
  out->set_trips(g.trips);
  out->set_last_trip(g.last_trip);
  out->set_last_trip_unix_ms(g.last_trip_unix_ms);
  if (g.last_good.has_value()) {
    out->set_last_good_label(g.last_good->label);
    out->set_last_good_spearman(g.last_good->spearman);
    out->set_last_good_spearman_n(g.last_good->spearman_n);
  }
}

std::string TooSlow(int64_t queued, int64_t bound) {
  return absl::StrCat("consumer too slow: ", queued,
                      " bytes queued (leapd --outbox_bytes=", bound,
                      "; queued versions were coalesced to the newest first)");
}

// One engine's Connect stream. The handler thread reads and answers; a
// writer thread owns every Write (answers, publish notices, rescores), so a
// publish never waits on a slow engine and answers keep their order. The
// outbox is bounded by OutboxLimits: publish notices coalesce per readout,
// answers cannot, so an engine that stops reading while it keeps sending is
// dropped.
class ConnectSession final : public PublishListener, public LiveTracker {
 public:
  ConnectSession(uint64_t id, grpc::ServerContext* ctx,
                 grpc::ServerReaderWriter<pb::SidecarMessage,
                                          pb::EngineMessage>* stream,
                 OutboxLimits* limits)
      : id_(id), ctx_(ctx), stream_(stream), limits_(limits) {}

  ~ConnectSession() override {
    absl::MutexLock lock(&mu_);
    SetBytes(0, 0);
  }

  uint64_t id() const { return id_; }

  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    absl::MutexLock lock(&mu_);
    if (closed_ || dropped_ > 0) return;
    pb::SidecarMessage m;
    m.mutable_published()->set_readout(readout);
    m.mutable_published()->set_version(v->version);
    PushLocked(std::move(m));
    if (dropped_ == 0) {
      auto& slot = rescore_[readout];
      if (slot == nullptr || slot->version < v->version) slot = v;
      return;
    }
    // Dropped by a publish: the handler may be blocked reading an idle
    // stream and would never notice, so the call is cancelled (the engine
    // sees the stream end and reconnects; the reason is logged and counted).
    // Under mu_: the handler closes the session (under mu_) before its
    // context goes away, and TryCancel never calls back into the session.
    ctx_->TryCancel();
  }

  // Queues an answer; false when the session was dropped as too slow.
  bool Send(pb::SidecarMessage m) {
    absl::MutexLock lock(&mu_);
    if (dropped_ > 0) return false;
    PushLocked(std::move(m));
    return dropped_ == 0;
  }

  // Bytes queued when the session was dropped as too slow; 0 if it was not.
  int64_t dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }

  void Track(std::shared_ptr<LiveRequest> r) override {
    absl::MutexLock lock(&live_mu_);
    live_[r->request_id] = std::move(r);
  }

  void Untrack(absl::string_view id) override {
    absl::MutexLock lock(&live_mu_);
    live_.erase(id);
  }

  // Runs on the writer thread until Close() and the outbox is flushed (or
  // the session is dropped).
  void WriterLoop() {
    for (;;) {
      std::deque<std::pair<pb::SidecarMessage, int64_t>> batch;
      std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>>
          rescore;
      grpc::ServerContext* cancel = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return closed_ || dropped_ > 0 || !outbox_.empty() ||
                 !rescore_.empty() || cancel_ != nullptr;
        };
        mu_.Await(absl::Condition(&ready));
        if (dropped_ > 0 || (closed_ && outbox_.empty())) return;
        batch.swap(outbox_);
        rescore.swap(rescore_);
        inflight_ += queued_;  // still counted until written
        queued_ = 0;
        cancel = cancel_;
      }
      for (auto& [m, size] : batch) {
        if (!broken_ && !stream_->Write(m)) broken_ = true;
        absl::MutexLock lock(&mu_);
        inflight_ -= size;
        SetBytes(queued_, inflight_);
      }
      if (cancel != nullptr) {
        cancel->TryCancel();
        return;
      }
      for (auto& [name, v] : rescore) Rescore(name, *v);
    }
  }

  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  // leapd is stopping: tell the engine (a message-level UNAVAILABLE error),
  // then cancel the call once that is written, so a handler blocked reading
  // an idle stream returns at once instead of at the drain deadline.
  void ShutDown(grpc::ServerContext* ctx) {
    pb::SidecarMessage m;
    m.mutable_error()->set_code(static_cast<int>(absl::StatusCode::kUnavailable));
    m.mutable_error()->set_message("leapd is shutting down");
    const int64_t size = static_cast<int64_t>(m.ByteSizeLong());
    absl::MutexLock lock(&mu_);
    if (dropped_ > 0) {
      // The writer is gone: nobody else would cancel the call.
      ctx->TryCancel();
      return;
    }
    outbox_.emplace_back(std::move(m), size);
    queued_ += size;
    SetBytes(queued_, inflight_);
    cancel_ = ctx;
  }

 private:
  void PushLocked(pb::SidecarMessage m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t size = static_cast<int64_t>(m.ByteSizeLong());
    outbox_.emplace_back(std::move(m), size);
    queued_ += size;
    if (queued_ + inflight_ > limits_->bound()) CoalesceLocked();
    if (queued_ + inflight_ > limits_->bound()) {
      dropped_ = queued_ + inflight_;
      outbox_.clear();
      rescore_.clear();
      queued_ = 0;
      limits_->metrics().OutboxDropped("connect").Increment();
      std::fprintf(stderr, "leapd: Connect stream %llu dropped: %s\n",
                   static_cast<unsigned long long>(id_),
                   TooSlow(dropped_, limits_->bound()).c_str());
    }
    SetBytes(queued_, inflight_);
  }

  // Keeps only the newest queued publish notice of each readout.
  void CoalesceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::flat_hash_map<std::string, int64_t> newest;
    for (const auto& [m, size] : outbox_) {
      if (!m.has_published()) continue;
      int64_t& n = newest[m.published().readout()];
      n = std::max(n, m.published().version());
    }
    std::deque<std::pair<pb::SidecarMessage, int64_t>> kept;
    for (auto& [m, size] : outbox_) {
      if (m.has_published() &&
          m.published().version() < newest[m.published().readout()]) {
        queued_ -= size;
        limits_->metrics().outbox_coalesced().Increment();
        continue;
      }
      kept.emplace_back(std::move(m), size);
    }
    outbox_.swap(kept);
  }

  void SetBytes(int64_t queued, int64_t inflight)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t total = queued + inflight;
    limits_->Account(total - accounted_, total);
    accounted_ = total;
  }

  void Rescore(const std::string& name, const PublishedVersion& v) {
    std::vector<std::shared_ptr<LiveRequest>> mine;
    {
      absl::MutexLock lock(&live_mu_);
      for (auto it = live_.begin(); it != live_.end();) {
        if (it->second->gone.load()) {
          live_.erase(it++);
          continue;
        }
        mine.push_back(it->second);  // RescorePredictions picks `name`'s
        ++it;
      }
    }
    std::vector<pb::Prediction> predictions;
    RescorePredictions(name, v, mine, &predictions);
    pb::SidecarMessage m;
    pb::Rescore* rs = m.mutable_rescore();
    rs->set_readout(name);
    rs->set_version(v.version);
    for (auto& p : predictions) {
      *rs->add_predictions() = std::move(p);
      if (static_cast<size_t>(rs->predictions_size()) >= kRescoreChunk) {
        if (!broken_ && !stream_->Write(m)) broken_ = true;
        rs->clear_predictions();
      }
    }
    if (rs->predictions_size() > 0 && !broken_ && !stream_->Write(m)) {
      broken_ = true;
    }
  }

  const uint64_t id_;
  grpc::ServerContext* const ctx_;
  grpc::ServerReaderWriter<pb::SidecarMessage, pb::EngineMessage>* const
      stream_;
  OutboxLimits* const limits_;
  absl::Mutex mu_;
  std::deque<std::pair<pb::SidecarMessage, int64_t>> outbox_
      ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;    // bytes in outbox_
  int64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;  // taken, not yet written
  int64_t accounted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>>
      rescore_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ServerContext* cancel_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool broken_ = false;  // writer thread only
  absl::Mutex live_mu_;  // never held with mu_
  absl::flat_hash_map<std::string, std::shared_ptr<LiveRequest>> live_
      ABSL_GUARDED_BY(live_mu_);
};

// A WatchReadout call's queue of publishes of one readout, bounded by
// OutboxLimits: over the bound it keeps only the newest version; if that
// and the message being written are still over, the watch is dropped.
class WatchListener final : public PublishListener {
 public:
  WatchListener(std::string name, bool weights, OutboxLimits* limits)
      : name_(std::move(name)), weights_(weights), limits_(limits) {}
  ~WatchListener() override {
    absl::MutexLock lock(&mu_);
    queue_.clear();
    queued_ = inflight_ = 0;
    SetBytes();
  }

  // Bytes of the ReadoutVersion message for `v` (an estimate a few bytes
  // over, computed without building it).
  int64_t MessageBytes(const PublishedVersion& v) const {
    return 128 + static_cast<int64_t>(name_.size()) +
           (weights_ ? static_cast<int64_t>(v.folded.w().size() * sizeof(float))
                     : 0);
  }

  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    if (readout != name_) return;
    absl::MutexLock lock(&mu_);
    if (dropped_ > 0) return;
    queue_.push_back(v);
    queued_ += MessageBytes(*v);
    if (queued_ + inflight_ > limits_->bound() && queue_.size() > 1) {
      limits_->metrics().outbox_coalesced().Increment(
          static_cast<double>(queue_.size() - 1));
      queue_.erase(queue_.begin(), queue_.end() - 1);
      queued_ = MessageBytes(*queue_.back());
    }
    if (queued_ + inflight_ > limits_->bound()) {
      dropped_ = queued_ + inflight_;
      queue_.clear();
      queued_ = 0;
      limits_->metrics().OutboxDropped("watch").Increment();
      std::fprintf(stderr, "leapd: WatchReadout of %s dropped: %s\n",
                   name_.c_str(), TooSlow(dropped_, limits_->bound()).c_str());
    }
    SetBytes();
  }

  // Waits up to `timeout` for a version; null on timeout or when the watch
  // was dropped (then *dropped is the bytes queued at the time). The
  // version returned counts as queued until Written().
  std::shared_ptr<const PublishedVersion> Next(absl::Duration timeout,
                                               int64_t* dropped) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !queue_.empty() || dropped_ > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    *dropped = dropped_;
    if (dropped_ > 0 || queue_.empty()) return nullptr;
    auto v = queue_.front();
    queue_.pop_front();
    const int64_t size = MessageBytes(*v);
    queued_ -= size;
    inflight_ = size;
    return v;
  }

  void Written() {
    absl::MutexLock lock(&mu_);
    inflight_ = 0;
    SetBytes();
  }

 private:
  void SetBytes() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t total = queued_ + inflight_;
    limits_->Account(total - accounted_, total);
    accounted_ = total;
  }

  const std::string name_;
  const bool weights_;
  OutboxLimits* const limits_;
  absl::Mutex mu_;
  std::deque<std::shared_ptr<const PublishedVersion>> queue_
      ABSL_GUARDED_BY(mu_);
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t inflight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t accounted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

void FillVersionProto(const std::string& name, const PublishedVersion& v,
                      bool weights, pb::ReadoutVersion* out) {
  out->set_readout(name);
  out->set_version(v.version);
  out->set_dim(v.folded.dim());
  out->set_max_tokens(v.folded.max_tokens());
  out->set_bias(v.folded.b());
  out->set_completions_learned(v.completions_learned);
  out->set_published_unix_ms(v.published_unix_ms);
  out->set_cause(v.cause);
  out->set_fleet_seq(v.fleet_seq);
  if (weights) {
    out->set_w(reinterpret_cast<const char*>(v.folded.w().data()),
               v.folded.w().size() * sizeof(float));
  }
}

}  // namespace

void OutboxLimits::Account(int64_t delta, int64_t consumer_total) {
  if (delta != 0) metrics_->outbox_bytes().Increment(static_cast<double>(delta));
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (consumer_total > peak &&
         !peak_.compare_exchange_weak(peak, consumer_total)) {
  }
  if (consumer_total > peak) {
    metrics_->outbox_peak_bytes().Set(static_cast<double>(consumer_total));
  }
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

grpc::Status PredictorService::Connect(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<pb::SidecarMessage, pb::EngineMessage>* stream) {
  pb::EngineMessage in;
  if (!stream->Read(&in)) return grpc::Status::OK;
  if (!in.has_hello()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "the first message of a Connect stream must be hello");
  }
  if (!core_->serving()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "leapd is recovering (replaying its feedback log); "
                        "retry shortly");
  }
  const pb::Hello hello = in.hello();
  absl::StatusOr<readout::DType> dtype = CheckHello(hello);
  if (!dtype.ok()) return ToGrpc(dtype.status());
  if (absl::Status s = CheckHelloIdentity(*core_, hello); !s.ok()) {
    core_->metrics().RequestErrors(absl::StatusCodeToString(s.code())).Increment();
    return ToGrpc(s);
  }
  auto session = std::make_shared<ConnectSession>(
      next_session_.fetch_add(1), ctx, stream, &outbox_);
  core_->hub().Subscribe(session);
  core_->metrics().connected_engines().Increment();
  {
    pb::SidecarMessage ack;
    ack.set_seq(in.seq());
    ack.mutable_hello_ack()->set_sidecar_id(sidecar_id_);
    ack.mutable_hello_ack()->set_max_batch_bytes(core_->options().max_batch_bytes);
    session->Send(std::move(ack));
  }
  std::thread writer([&session] { session->WriterLoop(); });
  {
    absl::MutexLock lock(&sessions_mu_);
    sessions_[ctx] = session;
    if (shutting_down_.load()) session->ShutDown(ctx);
  }

  while (!shutting_down_.load() && stream->Read(&in)) {
    pb::SidecarMessage out;
    HandleEngineMessage(core_, session->id(), hello, *dtype, &in, &out,
                        session.get());
    if (!session->Send(std::move(out))) break;  // dropped as too slow
  }
  {
    absl::MutexLock lock(&sessions_mu_);
    sessions_.erase(ctx);
  }
  session->Close();
  writer.join();
  core_->metrics().connected_engines().Decrement();
  if (const int64_t queued = session->dropped(); queued > 0) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        TooSlow(queued, outbox_.bound()));
  }
  return grpc::Status::OK;
}

void PredictorService::BeginShutdown() {
  absl::MutexLock lock(&sessions_mu_);
  shutting_down_.store(true);
  for (auto& [ctx, session] : sessions_) {
    static_cast<ConnectSession*>(session.get())->ShutDown(ctx);
  }
}

grpc::Status PredictorService::Predict(grpc::ServerContext*,
                                       const pb::PredictRequest* req,
                                       pb::PredictResponse* resp) {
  if (static_cast<int64_t>(req->record().features().size()) >
      core_->options().max_batch_bytes) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("features of ", req->record().features().size(),
                                     " bytes exceed the limit of ",
                                     core_->options().max_batch_bytes));
  }
  absl::StatusOr<readout::DType> dtype = DTypeFromProto(req->dtype());
  if (!dtype.ok()) return ToGrpc(dtype.status());
  ScoreRequest r;
  r.request_id = req->record().request_id();
  r.instance = req->instance_id();
  r.product_line = req->record().product_line();
  r.features = req->record().features();
  r.dtype = *dtype;
  r.request_max_tokens = req->record().decoding().max_tokens();
  absl::StatusOr<ScoreResult> s = core_->Predict(r, 0, nullptr);
  if (!s.ok()) {
    core_->metrics().RequestErrors(absl::StatusCodeToString(s.status().code()))
        .Increment();
    return ToGrpc(s.status());
  }
  ToPrediction(*s, req->record().request_id(), resp->mutable_prediction());
  return grpc::Status::OK;
}

grpc::Status PredictorService::Complete(grpc::ServerContext*,
                                        const pb::CompleteRequest* req,
                                        pb::CompleteResponse* resp) {
  absl::StatusOr<readout::FinishReason> reason =
      ReasonFromProto(req->completion().reason());
  if (!reason.ok()) return ToGrpc(reason.status());
  absl::StatusOr<CompletionOutcome> o = core_->Complete(
      req->completion().request_id(), req->completion().output_tokens(),
      *reason, req->instance_id());
  if (!o.ok()) return ToGrpc(o.status());
  resp->set_learned(o->learned);
  resp->set_skip_reason(o->skip_reason);
  resp->set_duplicate(o->duplicate);
  resp->set_duplicate_reason(o->duplicate_reason);
  resp->set_fleet_seq(o->fleet_seq);
  return grpc::Status::OK;
}

grpc::Status PredictorService::WatchReadout(
    grpc::ServerContext* ctx, const pb::WatchReadoutRequest* req,
    grpc::ServerWriter<pb::ReadoutVersion>* writer) {
  auto listener = std::make_shared<WatchListener>(
      req->readout(), req->include_weights(), &outbox_);
  core_->hub().Subscribe(listener);  // before reading current: no gap
  std::shared_ptr<const PublishedVersion> current;
  {
    absl::StatusOr<std::shared_ptr<LiveReadout>> r =
        core_->GetReadout(req->readout());
    if (!r.ok()) return ToGrpc(r.status());
    current = (*r)->current();  // the readout itself is not kept
  }
  pb::ReadoutVersion msg;
  FillVersionProto(req->readout(), *current, req->include_weights(), &msg);
  if (!writer->Write(msg)) return grpc::Status::OK;
  int64_t last = current->version;
  while (!ctx->IsCancelled() && !shutting_down_.load()) {
    int64_t dropped = 0;
    auto v = listener->Next(absl::Milliseconds(100), &dropped);
    if (dropped > 0) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          TooSlow(dropped, outbox_.bound()));
    }
    if (v == nullptr) continue;
    if (v->version <= last) {
      listener->Written();
      continue;
    }
    msg.Clear();
    FillVersionProto(req->readout(), *v, req->include_weights(), &msg);
    const bool ok = writer->Write(msg);
    listener->Written();
    if (!ok) break;
    last = v->version;
  }
  return grpc::Status::OK;
}

// ------------------------------------------------------------------ Admin

grpc::Status AdminService::CheckAdmin(grpc::ServerContext* ctx) {
  grpc::Status s = auth_.Check(*ctx);
  if (!s.ok()) core_->metrics().RequestErrors("UNAUTHENTICATED").Increment();
  return s;
}

grpc::Status AdminService::CheckAdminWrite(grpc::ServerContext* ctx) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  // A change made while the feedback log is being replayed would interleave
  // with the replay (a rollback under it, a route to a readout not yet
  // back): refused until leapd serves, like the data plane.
  if (!core_->serving()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "leapd is recovering (replaying its feedback log); "
                        "admin changes are refused until it serves; retry "
                        "shortly");
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListReadouts(grpc::ServerContext* ctx,
                                        const pb::ListReadoutsRequest*,
                                        pb::ListReadoutsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  for (auto& r : core_->ListReadouts()) FillInfo(*r, resp->add_readouts());
  return grpc::Status::OK;
}

grpc::Status AdminService::GetReadout(grpc::ServerContext* ctx,
                                      const pb::GetReadoutRequest* req,
                                      pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  FillInfo(**r, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::CreateReadout(grpc::ServerContext* ctx,
                                         const pb::CreateReadoutRequest* req,
                                         pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  readout::ReadoutState state;
  if (req->has_cold_start()) {
    const pb::ColdStart& c = req->cold_start();
    if (!(c.lambda() > 0.0)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("cold start lambda must be > 0, got ",
                                       c.lambda()));
    }
    state.spec.dim = c.dim();
    state.spec.layer = c.has_layer() ? c.layer() : -1;
    state.spec.model_id = c.model_id();
    state.spec.max_tokens = c.max_tokens() == 0 ? readout::kDefaultMaxTokens
                                                : c.max_tokens();
    state.spec.lambda = c.lambda();
    absl::Status s = state.spec.Validate();
    if (!s.ok()) return ToGrpc(s);
    state.standardizer = readout::Standardizer::Identity(c.dim());
    state.theta = Eigen::VectorXd::Zero(c.dim() + 1);
    state.p = readout::SymMatrix::ScaledIdentity(
        c.dim() + 1, static_cast<float>(1.0 / c.lambda()));
    state.version = 1;
  } else if (req->source_case() == pb::CreateReadoutRequest::kArtifact) {
    auto parsed = readout::ParseArtifact(req->artifact(), "uploaded artifact");
    if (!parsed.ok()) return ToGrpc(parsed.status());
    state = std::move(*parsed);
    if (state.version < 1) state.version = 1;
  } else {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "CreateReadout needs an artifact or a cold_start");
  }
  // Fleet mode: created for the whole fleet (every member applies it).
  absl::Status s = core_->fleet() != nullptr
                       ? core_->fleet()->CreateReadout(req->name(), std::move(state))
                       : core_->CreateReadout(req->name(), std::move(state));
  if (!s.ok()) return ToGrpc(s);
  FillInfo(**core_->GetReadout(req->name()), resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::DeleteReadout(grpc::ServerContext* ctx,
                                         const pb::DeleteReadoutRequest* req,
                                         pb::DeleteReadoutResponse*) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  if (core_->fleet() != nullptr) {
    return ToGrpc(core_->fleet()->DeleteReadout(req->name()));
  }
  return ToGrpc(core_->DeleteReadout(req->name()));
}

grpc::Status AdminService::ListVersions(grpc::ServerContext* ctx,
                                        const pb::ListVersionsRequest* req,
                                        pb::ListVersionsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  if (req->limit() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "limit must be >= 0");
  }
  FillQualityHistory(**r, req->limit(), core_->options().readout.quality_window,
                     resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::ExportReadout(grpc::ServerContext* ctx,
                                         const pb::ExportReadoutRequest* req,
                                         pb::ExportReadoutResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  readout::ReadoutState state = (*r)->Export();
  state.note = absl::StrCat("exported from leapd readout '", req->name(), "'");
  auto bytes = readout::SerializeArtifact(state);
  if (!bytes.ok()) return ToGrpc(bytes.status());
  resp->set_artifact(std::move(*bytes));
  resp->set_version(state.version);
  return grpc::Status::OK;
}

grpc::Status AdminService::SetAdaptation(grpc::ServerContext* ctx,
                                         const pb::SetAdaptationRequest* req,
                                         pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  absl::Status s = core_->fleet() != nullptr
                       ? core_->fleet()->SetFrozen(req->name(), req->frozen())
                       : (*r)->SetFrozen(req->frozen());
  if (!s.ok()) return ToGrpc(s);
  FillInfo(**r, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::SetRoute(grpc::ServerContext* ctx,
                                    const pb::SetRouteRequest* req,
                                    pb::Route* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  Route route;
  route.product_line = req->route().product_line();
  for (const auto& a : req->route().arms()) {
    route.arms.push_back({a.name(), a.readout(), a.percent(), a.shadow()});
  }
  absl::Status s = core_->fleet() != nullptr ? core_->fleet()->SetRoute(route)
                                              : core_->SetRoute(route);
  if (!s.ok()) return ToGrpc(s);
  for (const Route& r : core_->ListRoutes()) {
    if (r.product_line != route.product_line) continue;
    resp->set_product_line(r.product_line);
    for (const auto& a : r.arms) {
      pb::Arm* arm = resp->add_arms();
      arm->set_name(a.name);
      arm->set_readout(a.readout);
      arm->set_percent(a.percent);
      arm->set_shadow(a.shadow);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListRoutes(grpc::ServerContext* ctx,
                                      const pb::ListRoutesRequest*,
                                      pb::ListRoutesResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  for (const Route& r : core_->ListRoutes()) {
    pb::Route* out = resp->add_routes();
    out->set_product_line(r.product_line);
    for (const auto& a : r.arms) {
      pb::Arm* arm = out->add_arms();
      arm->set_name(a.name);
      arm->set_readout(a.readout);
      arm->set_percent(a.percent);
      arm->set_shadow(a.shadow);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::DeleteRoute(grpc::ServerContext* ctx,
                                       const pb::DeleteRouteRequest* req,
                                       pb::DeleteRouteResponse*) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  if (core_->fleet() != nullptr) {
    return ToGrpc(core_->fleet()->DeleteRoute(req->product_line()));
  }
  return ToGrpc(core_->DeleteRoute(req->product_line()));
}

grpc::Status AdminService::GetStats(grpc::ServerContext* ctx,
                                    const pb::GetStatsRequest* req,
                                    pb::StatsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  if (!req->readout().empty()) {
    auto r = core_->GetReadout(req->readout());
    if (!r.ok()) return ToGrpc(r.status());
  }
  for (auto& r : core_->ListReadouts()) {
    if (!req->readout().empty() && r->name() != req->readout()) continue;
    pb::ReadoutStats* s = resp->add_readouts();
    FillInfo(*r, s->mutable_info());
    ReadoutMetrics& m = r->metrics();
    s->set_predictions(static_cast<int64_t>(m.predictions_serving->Value() +
                                            m.predictions_shadow->Value()));
    s->set_completions_learned(r->completions_learned());
    s->set_skipped_cancelled(static_cast<int64_t>(m.skipped_cancelled->Value()));
    s->set_skipped_censored(static_cast<int64_t>(m.skipped_censored->Value()));
    s->set_skipped_frozen(static_cast<int64_t>(m.skipped_frozen->Value()));
    int64_t n = 0;
    s->set_spearman(r->spearman(&n));
    s->set_spearman_n(n);
    for (const VersionRecord& v : r->Versions()) {
      if (v.spearman_n > 0 || v.version == r->current()->version) {
        FillVersion(v, s->add_versions());
      }
    }
    FillGuardrail(r->guardrail(), s->mutable_guardrail());
  }
  for (const ArmStat& a : core_->ArmStats()) {
    if (!req->readout().empty() && a.readout != req->readout()) continue;
    pb::ArmStats* s = resp->add_arms();
    s->set_product_line(a.product_line);
    s->set_arm(a.arm);
    s->set_readout(a.readout);
    s->set_shadow(a.shadow);
    s->set_predictions(a.predictions);
    s->set_completions(a.completions);
    s->set_spearman(a.spearman);
    s->set_spearman_n(a.spearman_n);
  }
  resp->set_live_requests(core_->cache().size());
  resp->set_feature_cache_bytes(core_->cache().bytes());
  resp->set_unknown_completions(core_->unknown_completions());
  resp->set_evicted_capacity(core_->cache().evicted_capacity());
  resp->set_evicted_ttl(core_->cache().evicted_ttl());
  if (core_->store() != nullptr) {
    for (const auto& [family, bytes] : core_->store()->BytesPerFamily()) {
      (*resp->mutable_storage_bytes())[family] = bytes;
    }
  }
  if (core_->fleet() != nullptr) {
    const FleetStatus f = core_->fleet()->Status();
    pb::FleetStats* out = resp->mutable_fleet();
    out->set_fleet(f.fleet);
    out->set_member(f.member);
    out->set_role(f.role);
    out->set_trainer(f.trainer);
    out->set_degraded(f.degraded);
    out->set_degraded_reason(f.degraded_reason);
    out->set_last_fleet_seq(f.last_fleet_seq);
    out->set_unconfirmed(f.unconfirmed);
  }
  return grpc::Status::OK;
}

namespace {
void FillSnapshot(const storage::SnapshotInfo& i, pb::SnapshotInfo* out) {
  out->set_label(i.label);
  out->set_version(i.version);
  out->set_completions_learned(i.completions_learned);
  out->set_spearman(i.spearman);
  out->set_unix_ms(i.unix_ms);
  out->set_spearman_n(i.spearman_n);
}
}  // namespace

grpc::Status AdminService::CreateSnapshot(grpc::ServerContext* ctx,
                                          const pb::CreateSnapshotRequest* req,
                                          pb::SnapshotInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto info = core_->fleet() != nullptr
                  ? core_->fleet()->Snapshot(req->readout(), req->label())
                  : core_->Snapshot(req->readout(), req->label());
  if (!info.ok()) return ToGrpc(info.status());
  FillSnapshot(*info, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::ListSnapshots(grpc::ServerContext* ctx,
                                         const pb::ListSnapshotsRequest* req,
                                         pb::ListSnapshotsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->readout());
  if (!r.ok()) return ToGrpc(r.status());
  auto list = core_->fleet() != nullptr
                  ? core_->fleet()->ListSnapshots(req->readout())
                  : (*r)->ListSnapshots();
  if (!list.ok()) return ToGrpc(list.status());
  for (const auto& i : *list) FillSnapshot(i, resp->add_snapshots());
  return grpc::Status::OK;
}

grpc::Status AdminService::Rollback(grpc::ServerContext* ctx,
                                    const pb::RollbackRequest* req,
                                    pb::RollbackResponse* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto v = core_->fleet() != nullptr
               ? core_->fleet()->Rollback(req->readout(), req->label())
               : core_->Rollback(req->readout(), req->label());
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_version(*v);
  return grpc::Status::OK;
}

}  // namespace leap::sidecar
