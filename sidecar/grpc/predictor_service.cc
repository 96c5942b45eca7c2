#include "sidecar/grpc/predictor_service.h"

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
#include "common/thread.h"
#include "sidecar/core/engine_messages.h"
#include "sidecar/grpc/status.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;

// Predictions per Rescore message.
constexpr size_t kRescoreChunk = 4096;

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
  NameThread(writer, "leap-conn-write");
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

CompletionWriters::CompletionWriters(int threads, size_t max_queued)
    : max_queued_(max_queued) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Loop(); });
    NameThread(threads_.back(), "leap-complete");
  }
}

CompletionWriters::~CompletionWriters() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

bool CompletionWriters::Run(std::function<void()> f) {
  absl::MutexLock l(&mu_);
  if (queue_.size() >= max_queued_) return false;
  queue_.push_back(std::move(f));
  return true;
}

void CompletionWriters::Loop() {
  for (;;) {
    std::function<void()> f;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, nothing left
      f = std::move(queue_.front());
      queue_.pop_front();
    }
    f();
  }
}

grpc::ServerUnaryReactor* PredictorService::Complete(
    grpc::CallbackServerContext* ctx, const pb::CompleteRequest* req,
    pb::CompleteResponse* resp) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  absl::StatusOr<readout::FinishReason> reason =
      ReasonFromProto(req->completion().reason());
  if (!reason.ok()) {
    reactor->Finish(ToGrpc(reason.status()));
    return reactor;
  }
  // The feedback log append runs on a completion writer, not on this
  // callback thread; the call is answered after it (acknowledged only once
  // durable). `req` and `resp` live until the reactor is finished.
  const bool queued = writers_.Run([this, reactor, req, resp, reason = *reason] {
    // Fleet mode: the publish is in flight when Complete returns; the call
    // is answered once JetStream acknowledged it (or UNAVAILABLE when it
    // failed).
    absl::StatusOr<CompletionOutcome> o = CompleteWithPrior(
        core_, req->completion().request_id(),
        req->completion().output_tokens(), reason, req->instance_id(),
        /*defer_fleet_ack=*/true, req->completion().prompt_tokens());
    if (!o.ok()) {
      reactor->Finish(ToGrpc(o.status()));
      return;
    }
    std::shared_ptr<PendingFleetAck> ack = std::move(o->fleet_ack);
    resp->set_learned(o->learned);
    resp->set_skip_reason(o->skip_reason);
    resp->set_duplicate(o->duplicate);
    resp->set_duplicate_reason(o->duplicate_reason);
    resp->set_fleet_seq(o->fleet_seq);
    if (ack == nullptr) {
      reactor->Finish(grpc::Status::OK);
      return;
    }
    // Runs inside ack->Set (the ack is alive), on the thread that set it.
    ack->OnDone([reactor, resp, ack_raw = ack.get()] {
      absl::StatusOr<uint64_t> seq = ack_raw->Wait();  // set: no wait
      if (!seq.ok()) {
        reactor->Finish(ToGrpc(seq.status()));
        return;
      }
      resp->set_fleet_seq(*seq);
      reactor->Finish(grpc::Status::OK);
    });
  });
  if (!queued) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("leapd's completion writers are behind (",
                     kCompletionWritersQueue,
                     " unary Completes waiting); resend the completion")));
  }
  return reactor;
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

}  // namespace leap::sidecar
