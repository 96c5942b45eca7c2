#include "sidecar/fleet/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "leap/v1/fleet.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"

namespace leap::fleet {
namespace {

using leap::v1::fleet::FleetCompletion;
using leap::v1::fleet::FleetControl;
using leap::v1::fleet::FleetLease;
using leap::v1::fleet::FleetVersion;

constexpr char kLeaseKey[] = "trainer";
// Message ids remembered per readout to skip a completion that reached the
// stream twice (outside JetStream's de-duplication window).
constexpr size_t kRememberedIds = 1 << 20;

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct MsgDel {
  void operator()(natsMsg* m) const { natsMsg_Destroy(m); }
};
using MsgPtr = std::unique_ptr<natsMsg, MsgDel>;

std::string ThetaBytes(const Eigen::VectorXd& theta) {
  return std::string(reinterpret_cast<const char*>(theta.data()),
                     theta.size() * sizeof(double));
}

bool FiniteRow(const float* u, int64_t n, double y) {
  if (!std::isfinite(y)) return false;
  for (int64_t j = 0; j < n; ++j) {
    if (!std::isfinite(u[j])) return false;
  }
  return true;
}

}  // namespace

absl::Status TrainerOptions::Validate() const {
  if (fleet.empty()) return absl::InvalidArgumentError("fleet name is empty");
  if (member.empty()) return absl::InvalidArgumentError("member id is empty");
  if (lease_ms < 100) {
    return absl::InvalidArgumentError("fleet_lease_ms must be >= 100");
  }
  if (version_interval_ms < 0 || checkpoint_every_ms < 0 ||
      local_checkpoint_every_ms < 0) {
    return absl::InvalidArgumentError("trainer intervals must be >= 0");
  }
  if (max_batch < 1) return absl::InvalidArgumentError("max_batch must be >= 1");
  if (replicas < 1 || replicas > 5) {
    return absl::InvalidArgumentError("fleet_replicas must be in [1, 5]");
  }
  return absl::OkStatus();
}

absl::Status WriteCreateState(jsCtx* js, const std::string& fleet,
                              const std::string& readout,
                              const readout::ReadoutState& state,
                              uint64_t fleet_seq) {
  FleetState s;
  s.theta = state.theta;
  s.p = state.p;
  s.version = state.version;
  s.completions_learned = state.completions_learned;
  s.fleet_seq = fleet_seq;
  s.frozen = !state.p.has_value();
  s.unix_ms = UnixMs();
  // One id per incarnation: a re-created name is never de-duplicated away.
  absl::StatusOr<int32_t> n =
      PublishState(js, StateStream(fleet), CheckpointSubject(fleet, readout), readout,
                   absl::StrCat("create-", readout, "-", state.created_unix_ms), s);
  return n.status();
}

// ---- Metrics ----------------------------------------------------------------

struct Trainer::Families {
  explicit Families(prometheus::Registry& r)
      :         takeovers(prometheus::BuildCounter()
                      .Name("leap_fleet_trainer_terms_total")
                      .Help("Times this member won the trainer lease")
                      .Register(r)
                      .Add({})),
        lease_lost(prometheus::BuildCounter()
                       .Name("leap_fleet_trainer_lease_lost_total")
                       .Help("Lease renewals that failed (training stopped)")
                       .Register(r)
                       .Add({})),
        applied_seq(prometheus::BuildGauge()
                        .Name("leap_fleet_trainer_applied_seq")
                        .Help("FEEDBACK stream sequence the trainer has processed, "
                              "per readout")
                        .Register(r)),
        published(prometheus::BuildCounter()
                      .Name("leap_fleet_trainer_versions_published_total")
                      .Help("Versions published by this trainer, per readout")
                      .Register(r)),
        fenced(prometheus::BuildCounter()
                   .Name("leap_fleet_trainer_publish_fenced_total")
                   .Help("Version publishes refused by the lease or sequence "
                         "fence, per readout")
                   .Register(r)),
        applied(prometheus::BuildCounter()
                    .Name("leap_fleet_trainer_completions_applied_total")
                    .Help("Completions applied by RLS, per readout")
                    .Register(r)),
        skipped(prometheus::BuildCounter()
                    .Name("leap_fleet_trainer_completions_skipped_total")
                    .Help("Completions not applied, per readout and reason "
                          "(duplicate, frozen, invalid)")
                    .Register(r)),
        checkpoints(prometheus::BuildCounter()
                        .Name("leap_fleet_trainer_checkpoints_total")
                        .Help("Checkpoints written, per readout and where "
                              "(local, fleet)")
                        .Register(r)) {}
  prometheus::Counter& takeovers;
  prometheus::Counter& lease_lost;
  prometheus::Family<prometheus::Gauge>& applied_seq;
  prometheus::Family<prometheus::Counter>& published;
  prometheus::Family<prometheus::Counter>& fenced;
  prometheus::Family<prometheus::Counter>& applied;
  prometheus::Family<prometheus::Counter>& skipped;
  prometheus::Family<prometheus::Counter>& checkpoints;
};

// ---- One readout --------------------------------------------------------------

class Trainer::Worker {
 public:
  Worker(Trainer* t, TrainerReadout r,
         std::optional<storage::RecoveredReadout> local)
      : t_(t), r_(std::move(r)), n_(r_.spec.dim + 1) {
    if (local.has_value() &&
        local->meta.created_unix_ms == r_.created_unix_ms &&
        local->checkpoint.theta.size() == n_) {
      local_meta_ = local->meta;
      FleetState s;
      s.theta = local->checkpoint.theta;
      s.p = local->checkpoint.p;
      s.version = local->checkpoint.version;
      s.completions_learned = local->checkpoint.completions_learned;
      s.fleet_seq = local->checkpoint.last_seq;
      s.frozen = local->meta.frozen;
      s.unix_ms = local->checkpoint.unix_ms;
      local_state_ = std::move(s);
    } else if (local.has_value()) {
      stale_local_meta_ = local->meta;
    }
  }
  ~Worker() { Stop(/*final_checkpoint=*/false); }

  const TrainerReadout& readout() const { return r_; }
  bool running() const { return running_.load(); }

  void Start() {
    Stop(false);
    stop_.store(false);
    running_.store(true);
    thread_ = std::thread([this] { Run(); });
  }

  void Stop(bool final_checkpoint) {
    final_checkpoint_.store(final_checkpoint);
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
    running_.store(false);
  }

  void RequestCheckpoint() { checkpoint_requested_.store(true); }

  TrainerReadoutStatus Status() const {
    absl::MutexLock lock(&mu_);
    TrainerReadoutStatus s;
    s.fleet_seq = fleet_seq_;
    s.completions_learned = learned_;
    s.last_version = last_version_;
    s.published = published_;
    s.fleet_checkpoint_seq = fleet_checkpoint_seq_;
    s.frozen = frozen_;
    s.running = running_.load();
    return s;
  }

  absl::StatusOr<FleetState> Export() {
    absl::MutexLock lock(&mu_);
    if (!rls_.has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat("readout '", r_.name, "' has no trainer state yet"));
    }
    return CaptureLocked();
  }

 private:
  const std::string& fleet() const { return t_->options_.fleet; }

  void Log(const std::string& what) const {
    std::fprintf(stderr, "leapd: fleet trainer: readout '%s': %s\n",
                 r_.name.c_str(), what.c_str());
  }

  FleetState CaptureLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FleetState s;
    s.theta = rls_->theta();
    if (has_p_) s.p = rls_->P();
    s.version = last_version_;
    s.completions_learned = learned_;
    s.fleet_seq = fleet_seq_;
    s.frozen = frozen_;
    s.unix_ms = UnixMs();
    return s;
  }

  // The newest state among memory, the local store and STATE.
  absl::Status LoadState() {
    std::optional<FleetState> best;
    {
      absl::MutexLock lock(&mu_);
      if (rls_.has_value()) best = CaptureLocked();
    }
    if (local_state_.has_value() &&
        (!best.has_value() || local_state_->fleet_seq > best->fleet_seq)) {
      best = *local_state_;
    }
    const std::string subject = CheckpointSubject(fleet(), r_.name);
    // The newest checkpoint's last chunk names its fleet_seq: the whole
    // state is read only when it is newer than what this member has.
    bool read_fleet = true;
    {
      natsMsg* raw = nullptr;
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st = js_GetLastMsg(&raw, t_->js_, StateStream(fleet()).c_str(),
                                    subject.c_str(), nullptr, &code);
      if (st == NATS_OK) {
        MsgPtr m(raw);
        leap::v1::fleet::FleetStateChunk c;
        if (best.has_value() &&
            c.ParseFromArray(natsMsg_GetData(m.get()),
                             natsMsg_GetDataLength(m.get())) &&
            c.last() && c.fleet_seq() <= best->fleet_seq) {
          read_fleet = false;
        }
      } else if (st == NATS_NOT_FOUND || code == JSNoMessageFoundErr) {
        read_fleet = false;
      } else {
        return NatsFailure("reading the last checkpoint chunk of " + subject, st,
                         code);
      }
    }
    if (read_fleet) {
      absl::StatusOr<FleetState> f =
          ReadNewestState(t_->js_, StateStream(fleet()), subject);
      if (f.ok()) {
        checkpoint_chunks_ = f->chunks;
        if (!best.has_value() || f->fleet_seq > best->fleet_seq) best = std::move(*f);
      } else if (!absl::IsNotFound(f.status())) {
        return f.status();
      }
    }
    if (!best.has_value()) {
      return absl::NotFoundError(absl::StrCat(
          "no state for readout '", r_.name, "' (no checkpoint \"create\" in ",
          StateStream(fleet()), ")"));
    }
    if (best->theta.size() != n_ ||
        (best->p.has_value() && best->p->n() != n_)) {
      return absl::DataLossError(absl::StrCat(
          "state of readout '", r_.name, "' has width ", best->theta.size(),
          ", the readout ", n_));
    }
    absl::MutexLock lock(&mu_);
    has_p_ = best->p.has_value();
    if (has_p_) {
      rls_.emplace(best->theta, std::move(*best->p));
    } else {
      rls_.emplace(best->theta, readout::SymMatrix::ScaledIdentity(n_, 1.0f));
    }
    fleet_seq_ = best->fleet_seq;
    learned_ = best->completions_learned;
    frozen_ = best->frozen || !has_p_;
    return absl::OkStatus();
  }

  // The last published version: its stream sequence (the fence) and number.
  absl::Status RefreshLastVersion() {
    const std::string subject = VersionSubject(fleet(), r_.name);
    natsMsg* raw = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus st = js_GetLastMsg(&raw, t_->js_, VersionsStream(fleet()).c_str(),
                                  subject.c_str(), nullptr, &code);
    absl::MutexLock lock(&mu_);
    if (st == NATS_NOT_FOUND || code == JSNoMessageFoundErr) {
      ver_seq_ = 0;
      return absl::OkStatus();
    }
    if (st != NATS_OK) {
      return NatsFailure("reading the last version of " + subject, st, code);
    }
    MsgPtr m(raw);
    FleetVersion v;
    if (!v.ParseFromArray(natsMsg_GetData(m.get()), natsMsg_GetDataLength(m.get()))) {
      return absl::DataLossError("unparsable FleetVersion on " + subject);
    }
    ver_seq_ = natsMsg_GetSequence(m.get());
    last_version_ = v.version();
    last_published_seq_ = v.fleet_seq();
    return absl::OkStatus();
  }

  absl::Status Subscribe() {
    // This readout's completions (.c) and control operations (.ctl), in
    // stream order, through one filter subject.
    const std::string filter = ReadoutFeedbackSubjects(fleet(), r_.name);
    jsSubOptions so;
    jsSubOptions_Init(&so);
    const std::string stream = FeedbackStream(fleet());
    so.Stream = stream.c_str();
    so.Ordered = true;
    so.Config.DeliverPolicy = js_DeliverByStartSequence;
    {
      absl::MutexLock lock(&mu_);
      so.Config.OptStartSeq = fleet_seq_ + 1;
    }
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus st = js_SubscribeSync(&sub_, t_->js_, filter.c_str(), nullptr, &so, &code);
    if (st != NATS_OK) {
      sub_ = nullptr;
      return NatsFailure("subscribing to " + filter, st, code);
    }
    natsSubscription_SetPendingLimits(sub_, -1, -1);
    return absl::OkStatus();
  }

  void Run() {
    absl::Status s = LoadState();
    if (s.ok()) s = RefreshLastVersion();
    if (s.ok()) s = Subscribe();
    if (!s.ok()) {
      Log(absl::StrCat("cannot start training: ", s.message()));
      // Retried at the next term or when the readout set changes.
      running_.store(false);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      Log(absl::StrCat("training from fleet_seq ", fleet_seq_, ", last version ",
                       last_version_));
      dirty_ = fleet_seq_ > last_published_seq_;
      last_fleet_ckpt_ms_ = SteadyMs();
      last_local_ckpt_ms_ = SteadyMs();
    }
    const int64_t interval = t_->options_.version_interval_ms;
    std::vector<MsgPtr> msgs;
    while (!stop_.load()) {
      int64_t wait_ms = 50;
      if (dirty_) {
        wait_ms = std::clamp<int64_t>(last_publish_ms_ + interval - SteadyMs(), 1, 50);
      }
      natsMsg* raw = nullptr;
      natsStatus st = natsSubscription_NextMsg(&raw, sub_, wait_ms);
      if (st == NATS_OK) {
        msgs.clear();
        msgs.emplace_back(raw);
        int pending = 0;
        natsSubscription_GetPending(sub_, &pending, nullptr);
        // Everything queued, up to the batch bound (control operations may
        // split it).
        while (pending-- > 0 && static_cast<int>(msgs.size()) < t_->options_.max_batch) {
          raw = nullptr;
          if (natsSubscription_NextMsg(&raw, sub_, 1) != NATS_OK) break;
          msgs.emplace_back(raw);
        }
        Process(msgs);
        if (stop_.load()) break;
      } else if (st != NATS_TIMEOUT) {
        Log(absl::StrCat("reading the stream: ", natsStatus_GetText(st)));
        // The ordered consumer recreates itself; a closed connection ends
        // this term (the lease will not renew either).
        if (st == NATS_CONNECTION_CLOSED || st == NATS_INVALID_SUBSCRIPTION) break;
      }
      if (dirty_ && SteadyMs() - last_publish_ms_ >= interval) Publish("rls", "");
      MaybeCheckpoint(false);
    }
    if (final_checkpoint_.load() && !abandoned_) {
      if (dirty_) Publish("rls", "");
      MaybeCheckpoint(true);
    }
    natsSubscription_Destroy(sub_);
    sub_ = nullptr;
    running_.store(false);
  }

  void Process(const std::vector<MsgPtr>& msgs) {
    const std::string fb_subject = FeedbackSubject(fleet(), r_.name);
    const std::string ctl_subject = ControlSubject(fleet(), r_.name);
    for (const MsgPtr& m : msgs) {
      const uint64_t seq = StreamSequence(m.get());
      uint64_t done;
      {
        absl::MutexLock lock(&mu_);
        done = fleet_seq_;
      }
      if (seq <= done || seq <= pos_) continue;  // already in the state
      pos_ = seq;
      const absl::string_view subject = natsMsg_GetSubject(m.get());
      if (subject != fb_subject && subject != ctl_subject) continue;
      if (subject == ctl_subject) {
        ApplyBatch();
        FleetControl c;
        if (!c.ParseFromArray(natsMsg_GetData(m.get()), natsMsg_GetDataLength(m.get()))) {
          Log(absl::StrCat("unparsable control message at seq ", seq, " skipped"));
          continue;
        }
        Control(c, seq);
        continue;
      }
      AddCompletion(m.get(), seq);
    }
    ApplyBatch();
  }

  void Skip(const std::string& reason) {
    if (t_->families_ != nullptr) {
      t_->families_->skipped.Add({{"readout", r_.name}, {"reason", reason}}).Increment();
    }
  }

  void AddCompletion(natsMsg* m, uint64_t seq) {
    const char* id = nullptr;
    if (natsMsgHeader_Get(m, "Nats-Msg-Id", &id) == NATS_OK && id != nullptr) {
      std::string key(id);
      if (seen_.contains(key)) {
        Skip("duplicate");
        return;
      }
      seen_.insert(key);
      seen_order_.push_back(std::move(key));
      if (seen_order_.size() > kRememberedIds) {
        seen_.erase(seen_order_.front());
        seen_order_.pop_front();
      }
    }
    bool frozen;
    {
      absl::MutexLock lock(&mu_);
      frozen = frozen_;
    }
    if (frozen) {
      Skip("frozen");
      return;
    }
    FleetCompletion c;
    if (!c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m))) {
      Log(absl::StrCat("unparsable completion at seq ", seq, " skipped"));
      Skip("invalid");
      return;
    }
    const int dt = c.dtype();
    if (dt < 1 || dt > 3) {
      Skip("invalid");
      return;
    }
    const auto dtype = static_cast<readout::DType>(dt);
    const size_t es = readout::DTypeSize(dtype);
    if (c.features().size() != static_cast<size_t>(r_.spec.dim) * es) {
      Log(absl::StrCat("completion at seq ", seq, " has ", c.features().size(),
                       " feature bytes, expected ", r_.spec.dim * es, "; skipped"));
      Skip("invalid");
      return;
    }
    readout::FeatureView x{c.features().data(), dtype, r_.spec.dim, 1};
    const size_t off = batch_u_.size();
    batch_u_.resize(off + n_);
    r_.standardizer.Augment(x, batch_u_.data() + off);
    if (!FiniteRow(batch_u_.data() + off, n_, c.target())) {
      batch_u_.resize(off);
      Log(absl::StrCat("completion at seq ", seq,
                       " has non-finite standardized features or target; skipped"));
      Skip("invalid");
      return;
    }
    batch_y_.push_back(c.target());
  }

  // Applies the rows gathered (one exact batch) and moves fleet_seq to the
  // last message processed.
  void ApplyBatch() {
    const int64_t k = static_cast<int64_t>(batch_y_.size());
    absl::Status s = absl::OkStatus();
    int64_t applied = 0;
    {
      absl::MutexLock lock(&mu_);
      if (k > 0) {
        const int64_t before = rls_->updates();
        s = rls_->Update(batch_u_.data(), n_, batch_y_);
        applied = rls_->updates() - before;
        learned_ += applied;
        if (!s.ok()) {
          // Never publish a state that failed: learning stops (frozen, in
          // every version from now on) until an operator resumes, typically
          // after a rollback to a healthy snapshot.
          frozen_ = true;
        }
      }
      if (pos_ > fleet_seq_) {
        fleet_seq_ = pos_;
        dirty_ = true;
      }
      if (t_->families_ != nullptr) {
        t_->families_->applied_seq.Add({{"readout", r_.name}})
            .Set(static_cast<double>(fleet_seq_));
      }
    }
    if (applied > 0) ++batches_since_local_;
    if (applied > 0 && t_->families_ != nullptr) {
      t_->families_->applied.Add({{"readout", r_.name}})
          .Increment(static_cast<double>(applied));
    }
    batch_u_.clear();
    batch_y_.clear();
    if (!s.ok()) {
      Log(absl::StrCat("RLS batch of ", k, " rejected (", s.message(),
                       "); learning frozen"));
      Skip("invalid");
      Publish(absl::StrCat("frozen: rls: ", s.message()), "");
    }
  }

  void Control(const FleetControl& c, uint64_t seq) {
    {
      absl::MutexLock lock(&mu_);
      fleet_seq_ = seq;  // the op is part of the state from here on
    }
    const std::string& label = c.label();
    switch (c.op()) {
      case FleetControl::SNAPSHOT: {
        FleetState s;
        {
          absl::MutexLock lock(&mu_);
          s = CaptureLocked();
        }
        s.label = label;
        absl::StatusOr<int32_t> w = PublishState(
            t_->js_, StateStream(fleet()), SnapshotSubject(fleet(), r_.name, label),
            r_.name, absl::StrCat("snap-", r_.name, "-", seq), s);
        if (!w.ok()) {
          Log(absl::StrCat("snapshot '", label, "' not written: ", w.status().message()));
          Publish(absl::StrCat("error: snapshot ", label, ": ", w.status().message()),
                  c.op_id());
          return;
        }
        Publish("snapshot:" + label, c.op_id());
        return;
      }
      case FleetControl::ROLLBACK: {
        // The newest snapshot of that label taken before this operation in
        // stream order (a replay after a crash finds the same one).
        absl::StatusOr<FleetState> snap =
            ReadNewestState(t_->js_, StateStream(fleet()),
                            SnapshotSubject(fleet(), r_.name, label), seq);
        bool has_p;
        {
          absl::MutexLock lock(&mu_);
          has_p = has_p_;
        }
        if (!snap.ok() || snap->theta.size() != n_ ||
            snap->p.has_value() != has_p) {
          const std::string why =
              snap.ok() ? "snapshot does not match the readout"
                        : std::string(snap.status().message());
          Log(absl::StrCat("rollback to '", label, "' failed: ", why));
          Publish(absl::StrCat("error: rollback:", label, ": ", why), c.op_id());
          return;
        }
        {
          absl::MutexLock lock(&mu_);
          if (has_p_) {
            rls_.emplace(snap->theta, std::move(*snap->p));
          } else {
            rls_.emplace(snap->theta, readout::SymMatrix::ScaledIdentity(n_, 1.0f));
          }
          learned_ = snap->completions_learned;
        }
        Publish("rollback:" + label, c.op_id());
        return;
      }
      case FleetControl::FREEZE:
      case FleetControl::RESUME: {
        const bool freeze = c.op() == FleetControl::FREEZE;
        {
          absl::MutexLock lock(&mu_);
          frozen_ = freeze || !has_p_;
        }
        Publish(freeze ? "freeze" : "resume", c.op_id());
        return;
      }
      default:
        Log(absl::StrCat("unknown control op ", static_cast<int>(c.op()),
                         " at seq ", seq, " skipped"));
        return;
    }
  }

  // Publishes the current theta as the next version, fenced. False when it
  // was not published (it stays due).
  bool Publish(const std::string& cause, const std::string& op_id) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      if (!t_->FenceOk()) {
        Fenced();
        stop_.store(true);
        return false;
      }
      FleetVersion v;
      uint64_t expect;
      {
        absl::MutexLock lock(&mu_);
        v.set_readout(r_.name);
        v.set_version(last_version_ + 1);
        v.set_theta(ThetaBytes(rls_->theta()));
        v.set_completions_learned(learned_);
        v.set_fleet_seq(fleet_seq_);
        v.set_published_unix_ms(UnixMs());
        v.set_cause(cause);
        v.set_trainer(t_->options_.member);
        v.set_op_id(op_id);
        v.set_frozen(frozen_);
        expect = ver_seq_;
      }
      const std::string bytes = v.SerializeAsString();
      const std::string stream = VersionsStream(fleet());
      const std::string subject = VersionSubject(fleet(), r_.name);
      jsPubOptions po;
      jsPubOptions_Init(&po);
      po.ExpectStream = stream.c_str();
      if (expect > 0) {
        po.ExpectLastSubjectSeq = expect;
      } else {
        po.ExpectNoMessage = true;
      }
      jsPubAck* ack = nullptr;
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st = js_Publish(&ack, t_->js_, subject.c_str(), bytes.data(),
                                 static_cast<int>(bytes.size()), &po, &code);
      if (st == NATS_OK) {
        {
          absl::MutexLock lock(&mu_);
          ver_seq_ = ack->Sequence;
          last_version_ = v.version();
          last_published_seq_ = v.fleet_seq();
          ++published_;
          dirty_ = false;
        }
        jsPubAck_Destroy(ack);
        last_publish_ms_ = SteadyMs();
        if (t_->families_ != nullptr) {
          t_->families_->published.Add({{"readout", r_.name}}).Increment();
        }
        return true;
      }
      if (ack != nullptr) jsPubAck_Destroy(ack);
      if (code != JSStreamWrongLastSequenceErr) {
        Log(absl::StrCat("version ", v.version(), " not published (retried): ",
                         NatsFailure("publish", st, code).message()));
        last_publish_ms_ = SteadyMs();  // retry after an interval
        return false;
      }
      // Someone else published on this subject since: a deposed trainer
      // that slipped in before its successor's first publish, or (if the
      // lease is no longer ours) the successor itself.
      Fenced();
      if (!t_->LeaseStillOurs()) {
        Log("version publish fenced: another trainer published; stopping");
        stop_.store(true);
        return false;
      }
      if (absl::Status s = RefreshLastVersion(); !s.ok()) {
        Log(absl::StrCat("re-reading the last version: ", s.message()));
        return false;
      }
    }
    return false;
  }

  void Fenced() {
    if (t_->families_ != nullptr) {
      t_->families_->fenced.Add({{"readout", r_.name}}).Increment();
    }
  }

  void MaybeCheckpoint(bool force) {
    const int64_t now = SteadyMs();
    const bool requested = checkpoint_requested_.exchange(false);
    force = force || requested;
    FleetState s;
    uint64_t seq;
    {
      absl::MutexLock lock(&mu_);
      seq = fleet_seq_;
    }
    const bool fleet_due =
        seq > fleet_checkpoint_seq_local_ &&
        (force || now - last_fleet_ckpt_ms_ >= t_->options_.checkpoint_every_ms);
    const bool local_due =
        t_->options_.local_store != nullptr && seq > local_checkpoint_seq_ &&
        (force || now - last_local_ckpt_ms_ >= t_->options_.local_checkpoint_every_ms);
    if (!fleet_due && !local_due && !requested) return;
    {
      absl::MutexLock lock(&mu_);
      s = CaptureLocked();
    }
    if (local_due) {
      WriteLocal(s);
      last_local_ckpt_ms_ = now;
    }
    if (fleet_due) {
      // A deposed trainer writes nothing more (its state is a valid prefix,
      // but its successor owns the subject now).
      if (!t_->FenceOk()) return;
      const std::string state_id =
          absl::StrCat(t_->options_.member, "-", s.fleet_seq, "-", s.unix_ms);
      absl::StatusOr<int32_t> chunks =
          PublishState(t_->js_, StateStream(fleet()), CheckpointSubject(fleet(), r_.name),
                       r_.name, state_id, s);
      last_fleet_ckpt_ms_ = now;
      if (!chunks.ok()) {
        Log(absl::StrCat("fleet checkpoint not written: ", chunks.status().message()));
        return;
      }
      fleet_checkpoint_seq_local_ = s.fleet_seq;
      {
        absl::MutexLock lock(&mu_);
        fleet_checkpoint_seq_ = s.fleet_seq;
      }
      if (t_->families_ != nullptr) {
        t_->families_->checkpoints.Add({{"readout", r_.name}, {"where", "fleet"}})
            .Increment();
      }
      // Keep the last two (the newest may be unreadable, the one before not).
      const std::string subject = CheckpointSubject(fleet(), r_.name);
      jsOptions jo;
      jsOptions_Init(&jo);
      jo.Stream.Purge.Subject = subject.c_str();
      jo.Stream.Purge.Keep = static_cast<uint64_t>(
          *chunks + std::max<int32_t>(checkpoint_chunks_, *chunks));
      checkpoint_chunks_ = *chunks;
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st = js_PurgeStream(t_->js_, StateStream(fleet()).c_str(), &jo, &code);
      if (st != NATS_OK) {
        Log(absl::StrCat("pruning old checkpoints: ",
                         NatsFailure("purge", st, code).message()));
      }
    }
  }

  void WriteLocal(const FleetState& s) {
    storage::StateStore* store = t_->options_.local_store;
    storage::ReadoutCheckpoint c;
    c.version = s.version;
    c.completions_learned = s.completions_learned;
    c.last_seq = s.fleet_seq;
    c.unix_ms = s.unix_ms;
    c.theta = s.theta;
    c.p = s.p;
    absl::Status st = absl::OkStatus();
    if (!local_meta_.has_value()) {
      if (stale_local_meta_.has_value()) {
        store->DeleteReadout(*stale_local_meta_).IgnoreError();
        stale_local_meta_.reset();
      }
      storage::ReadoutMeta meta;
      meta.name = r_.name;
      meta.spec = r_.spec;
      meta.standardizer = r_.standardizer;
      meta.frozen = s.frozen;
      meta.has_p = s.p.has_value();
      meta.created_unix_ms = r_.created_unix_ms;
      st = store->CreateReadout(&meta, c);
      if (st.ok()) local_meta_ = meta;
    } else {
      st = store->WriteCheckpoint(*local_meta_, c);
      if (st.ok() && local_meta_->frozen != s.frozen) {
        st = store->SetFrozen(*local_meta_, s.frozen);
        if (st.ok()) local_meta_->frozen = s.frozen;
      }
    }
    if (!st.ok()) {
      Log(absl::StrCat("local checkpoint not written: ", st.message()));
      return;
    }
    local_checkpoint_seq_ = s.fleet_seq;
    batches_since_local_ = 0;
    local_state_.reset();  // memory is at least as new from here on
    if (t_->families_ != nullptr) {
      t_->families_->checkpoints.Add({{"readout", r_.name}, {"where", "local"}})
          .Increment();
    }
  }

 public:
  bool abandoned_ = false;

 private:
  Trainer* const t_;
  const TrainerReadout r_;
  const int64_t n_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> running_{false};
  std::atomic<bool> final_checkpoint_{false};
  std::atomic<bool> checkpoint_requested_{false};

  // Guarded by mu_: what Status/Export read; written by the worker thread.
  mutable absl::Mutex mu_;
  std::optional<readout::RlsState> rls_ ABSL_GUARDED_BY(mu_);
  bool has_p_ ABSL_GUARDED_BY(mu_) = true;
  uint64_t fleet_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t learned_ ABSL_GUARDED_BY(mu_) = 0;
  bool frozen_ ABSL_GUARDED_BY(mu_) = false;
  int64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ver_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_published_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fleet_checkpoint_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool dirty_ = false;  // worker thread (also written under mu_)

  // Worker thread only.
  natsSubscription* sub_ = nullptr;
  uint64_t pos_ = 0;  // sequence of the last message taken
  std::vector<float> batch_u_;
  std::vector<double> batch_y_;
  std::unordered_set<std::string> seen_;
  std::deque<std::string> seen_order_;
  int64_t last_publish_ms_ = 0;
  int64_t last_fleet_ckpt_ms_ = 0;
  int64_t last_local_ckpt_ms_ = 0;
  uint64_t fleet_checkpoint_seq_local_ = 0;
  uint64_t local_checkpoint_seq_ = 0;
  int64_t batches_since_local_ = 0;
  int32_t checkpoint_chunks_ = 0;
  std::optional<storage::ReadoutMeta> local_meta_;
  std::optional<storage::ReadoutMeta> stale_local_meta_;
  std::optional<FleetState> local_state_;
};

// ---- Trainer ----------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Start(natsConnection* nc,
                                                        TrainerOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  jsCtx* js = nullptr;
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = 10000;
  if (natsStatus st = natsConnection_JetStream(&js, nc, &jo); st != NATS_OK) {
    return NatsFailure("JetStream context", st);
  }
  if (absl::Status s = EnsureFleetStreams(js, options.fleet, options.replicas,
                                          options.lease_ms);
      !s.ok()) {
    jsCtx_Destroy(js);
    return s;
  }
  kvStore* kv = nullptr;
  if (natsStatus st = js_KeyValue(&kv, js, LeaseBucket(options.fleet).c_str());
      st != NATS_OK) {
    jsCtx_Destroy(js);
    return NatsFailure("opening bucket " + LeaseBucket(options.fleet), st);
  }
  std::map<std::string, storage::RecoveredReadout> local;
  if (options.local_store != nullptr) {
    absl::StatusOr<storage::RecoveredState> loaded = options.local_store->Load();
    if (!loaded.ok()) {
      kvStore_Destroy(kv);
      jsCtx_Destroy(js);
      return loaded.status();
    }
    for (storage::RecoveredReadout& r : loaded->readouts) {
      std::string name = r.meta.name;
      local[name] = std::move(r);
    }
  }
  std::unique_ptr<Trainer> t(new Trainer(js, kv, std::move(options)));
  {
    absl::MutexLock lock(&t->mu_);
    t->local_ = std::move(local);
  }
  t->lease_thread_ = std::thread([p = t.get()] { p->LeaseLoop(); });
  return t;
}

Trainer::Trainer(jsCtx* js, kvStore* kv, TrainerOptions options)
    : js_(js), kv_(kv), options_(std::move(options)) {
  if (options_.registry != nullptr) {
    families_ = std::make_unique<Families>(*options_.registry);
  }
}

Trainer::~Trainer() {
  StopAll(/*final_checkpoint=*/true, /*release=*/true);
  kvStore_Destroy(kv_);
  jsCtx_Destroy(js_);
}

void Trainer::StopAll(bool final_checkpoint, bool release) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  const bool was_leader = leader_.load();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, w] : workers_) {
      if (!final_checkpoint) w->abandoned_ = true;
      w->Stop(final_checkpoint && was_leader);
    }
  }
  if (was_leader && release && FenceOk()) {
    // Our own key, renewed less than a lease ago: deleting it lets another
    // member claim at once instead of after the TTL.
    kvStore_Delete(kv_, kLeaseKey);
  }
  leader_.store(false);
  if (was_leader && options_.on_role) options_.on_role(false);
}

void Trainer::Abandon() { StopAll(/*final_checkpoint=*/false, /*release=*/false); }

bool Trainer::FenceOk() const {
  if (!leader_.load()) return false;
  if (!time_fence_.load()) return true;
  return SteadyMs() - last_renew_ms_.load() < options_.lease_ms;
}

bool Trainer::LeaseStillOurs() {
  kvEntry* e = nullptr;
  if (kvStore_Get(&e, kv_, kLeaseKey) != NATS_OK) return false;
  FleetLease lease;
  const bool ours =
      lease.ParseFromArray(kvEntry_Value(e), kvEntry_ValueLen(e)) &&
      lease.member() == options_.member;
  uint64_t rev = kvEntry_Revision(e);
  kvEntry_Destroy(e);
  return ours && rev == lease_rev_.load();
}

void Trainer::SetReadouts(std::vector<TrainerReadout> readouts) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  std::map<std::string, TrainerReadout> want;
  for (TrainerReadout& r : readouts) want[r.name] = std::move(r);
  for (auto it = workers_.begin(); it != workers_.end();) {
    auto w = want.find(it->first);
    if (w == want.end() ||
        w->second.created_unix_ms != it->second->readout().created_unix_ms) {
      it->second->Stop(/*final_checkpoint=*/leader_.load());
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [name, r] : want) {
    if (workers_.contains(name)) continue;
    std::optional<storage::RecoveredReadout> local;
    if (auto l = local_.find(name); l != local_.end()) local = l->second;
    auto w = std::make_unique<Worker>(this, std::move(r), std::move(local));
    if (leader_.load()) w->Start();
    workers_[name] = std::move(w);
  }
}

std::optional<TrainerReadoutStatus> Trainer::Status(const std::string& readout) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(readout);
  if (it == workers_.end()) return std::nullopt;
  return it->second->Status();
}

void Trainer::RequestCheckpoint() {
  absl::MutexLock lock(&mu_);
  for (auto& [name, w] : workers_) w->RequestCheckpoint();
}

absl::StatusOr<FleetState> Trainer::ExportState(const std::string& readout) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(readout);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("no readout '", readout, "'"));
  }
  return it->second->Export();
}

void Trainer::Promote() {
  leader_.store(true);
  for (auto& [name, w] : workers_) w->Start();
}

void Trainer::Demote(bool final_checkpoint) {
  leader_.store(false);
  absl::MutexLock lock(&mu_);
  for (auto& [name, w] : workers_) w->Stop(final_checkpoint);
}

void Trainer::LeaseLoop() {
  const int64_t renew_every = std::max<int64_t>(options_.lease_ms / 3, 1);
  const int64_t claim_every = std::max<int64_t>(options_.lease_ms / 8, 1);
  auto lease_bytes = [this](int64_t acquired) {
    FleetLease l;
    l.set_member(options_.member);
    l.set_acquired_unix_ms(acquired);
    l.set_renewed_unix_ms(UnixMs());
    return l.SerializeAsString();
  };
  int64_t acquired = 0;
  for (;;) {
    const int64_t wait =
        leader_.load() ? last_renew_ms_.load() + renew_every - SteadyMs() : claim_every;
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping),
                           absl::Milliseconds(std::max<int64_t>(wait, 0)));
      if (stop_) return;
    }
    if (!leader_.load()) {
      acquired = UnixMs();
      const std::string bytes = lease_bytes(acquired);
      const int64_t sent = SteadyMs();
      uint64_t rev = 0;
      natsStatus st = kvStore_Create(&rev, kv_, kLeaseKey, bytes.data(),
                                     static_cast<int>(bytes.size()));
      if (st != NATS_OK) continue;  // held by someone (or NATS unreachable)
      std::fprintf(stderr, "leapd: fleet trainer: %s holds the trainer lease\n",
                   options_.member.c_str());
      last_renew_ms_.store(sent);
      if (families_ != nullptr) families_->takeovers.Increment();
      {
        absl::MutexLock lock(&mu_);
        lease_rev_.store(rev);
        if (stop_) return;
        Promote();
      }
      if (options_.on_role) options_.on_role(true);
      continue;
    }
    if (pause_renewals_.load()) continue;
    const std::string bytes = lease_bytes(acquired);
    const int64_t sent = SteadyMs();
    const uint64_t rev = lease_rev_.load();
    uint64_t next = 0;
    natsStatus st = kvStore_Update(&next, kv_, kLeaseKey, bytes.data(),
                                   static_cast<int>(bytes.size()), rev);
    if (st == NATS_OK) {
      lease_rev_.store(next);
      last_renew_ms_.store(sent);
      // A worker that stopped on its own (a fence it hit while the lease
      // was in doubt, a state it could not load yet) starts again.
      absl::MutexLock lock(&mu_);
      for (auto& [name, w] : workers_) {
        if (!w->running()) w->Start();
      }
      continue;
    }
    std::fprintf(stderr,
                 "leapd: fleet trainer: %s lost the trainer lease (%s); training "
                 "stopped\n",
                 options_.member.c_str(), natsStatus_GetText(st));
    if (families_ != nullptr) families_->lease_lost.Increment();
    Demote(/*final_checkpoint=*/false);
    if (options_.on_role) options_.on_role(false);
  }
}

}  // namespace leap::fleet
