#include "sidecar/fleet/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/thread.h"
#include "leap/v1/fleet.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "sidecar/fleet/fleet_quality.h"

namespace leap::fleet {
namespace {

using leap::v1::fleet::FleetCompletion;
using leap::v1::fleet::FleetControl;
using leap::v1::fleet::FleetLease;
using leap::v1::fleet::FleetQuality;
using leap::v1::fleet::FleetVersion;

constexpr char kLeaseKey[] = "trainer";
// Message ids remembered per readout to skip a completion that reached the
// stream twice (outside JetStream's de-duplication window).
constexpr size_t kRememberedIds = 1 << 20;
// An EXPORT operation older than this is not answered (its asker waits
// 10 s).
constexpr int64_t kExportMaxAgeMs = 60'000;
// An EXPORT answer finished more than this after the asker's deadline is
// purged by the trainer (the asker purged before it was written).
constexpr int64_t kExportLatePurgeMs = 2'000;
// How long a SNAPSHOT's write is retried while JetStream is unavailable.
constexpr int64_t kSnapshotRetryMs = 8'000;
// The fleet-wide quality goes to CONFIG at most this often, even when
// versions go out on every pass (--fleet_version_interval_ms=0).
constexpr int64_t kQualityPutMinIntervalMs = 1000;
// How long a batch waits for the next message the server still holds for
// the consumer (beyond the flow-control window already delivered): a
// round trip on a busy machine, not a pacing delay.
constexpr int64_t kBacklogWaitMs = 20;
// The most one batch's reading waits for such messages in all.
constexpr int64_t kBacklogReadMs = 100;
// Rows taken from the stream are applied once this many wait (or the
// batch bound, a due version, an idle stream): at d = 4096 an exact batch
// of 64 costs about half the CPU per completion of batches of a few, and
// applying them as they come keeps the apply before a due version short.
constexpr int kMinApplyBatch = 64;
// After a checkpoint write of W, the next periodic one waits at least
// this many times W after it: at d = 4096 a write (P copy, 64 MiB into
// RocksDB or STATE) can take seconds of a busy core, and the thread must
// not take as much CPU as learning.
constexpr int64_t kCheckpointRestFactor = 4;
// A periodic local checkpoint is written only when it saves a restart more
// than it costs: when re-applying the rows applied since the last one
// would take at least as long as the last local write took (measured by
// the apply time those rows took, an upper bound: a replay applies them
// in full batches). Otherwise it waits, at most this many periods: at
// d = 4096 a write (64 MiB P copy and RocksDB write) took 6-7.5 s of a
// busy core, the ~1,000 rows of 10 s at 100/s ~0.7 s to apply.
constexpr int64_t kLocalCheckpointMaxPeriods = 6;

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
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

// The newest message on a STATE checkpoint subject: its stream sequence,
// and the chunk it carries (parsed = false when it is not a chunk).
struct LastStateChunk {
  uint64_t seq = 0;
  bool parsed = false;
  leap::v1::fleet::FleetStateChunk chunk;
};

// nullopt when the subject holds no message; an error when it cannot be
// read. The one read of a checkpoint subject's last message that the start
// (LoadState), the fence's retry and the purge after a checkpoint share.
absl::StatusOr<std::optional<LastStateChunk>> ReadLastStateChunk(
    jsCtx* js, const std::string& stream, const std::string& subject) {
  natsMsg* raw = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus st = js_GetLastMsg(&raw, js, stream.c_str(), subject.c_str(), nullptr, &code);
  MsgPtr m(raw);
  if (st == NATS_NOT_FOUND || code == JSNoMessageFoundErr) return std::nullopt;
  if (st != NATS_OK) {
    return NatsFailure("reading the last message of " + subject, st, code);
  }
  LastStateChunk last;
  last.seq = natsMsg_GetSequence(m.get());
  last.parsed = last.chunk.ParseFromArray(natsMsg_GetData(m.get()),
                                          natsMsg_GetDataLength(m.get()));
  return last;
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
  if (rls_threads < 0) return absl::InvalidArgumentError("rls_threads must be >= 0");
  if (quality_window < 1) {
    return absl::InvalidArgumentError("quality_window must be >= 1");
  }
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
  s.created_unix_ms = state.created_unix_ms;
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
                   .Help("Version publishes and STATE checkpoints refused by the "
                         "lease or sequence fence or left unwritten for a later "
                         "incarnation of the readout, per readout")
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
                        .Register(r)),
        rls_errors(prometheus::BuildCounter()
                       .Name("leap_fleet_trainer_rls_errors_total")
                       .Help("RLS batches the trainer rejected (learning frozen, "
                             "their completions kept), per readout")
                       .Register(r)),
        kept(prometheus::BuildGauge()
                 .Name("leap_fleet_trainer_kept")
                 .Help("Completions of rejected RLS batches kept for when "
                       "learning resumes, per readout")
                 .Register(r)),
        frozen(prometheus::BuildGauge()
                   .Name("leap_fleet_trainer_frozen")
                   .Help("1 while the trainer does not learn the readout "
                         "(frozen by an operator or by a rejected RLS batch)")
                   .Register(r)),
        batches(prometheus::BuildCounter()
                    .Name("leap_fleet_trainer_batches_total")
                    .Help("RLS batches applied, per readout (completions applied / "
                          "batches = the mean batch)")
                    .Register(r)),
        stage_seconds(prometheus::BuildCounter()
                          .Name("leap_fleet_trainer_seconds_total")
                          .Help("Time the trainer's worker spent, per readout and "
                                "stage (wait, read, apply, publish, "
                                "checkpoint_capture; checkpoint_write on the "
                                "checkpoint thread)")
                          .Register(r)) {}
  prometheus::Counter& takeovers;
  prometheus::Counter& lease_lost;
  prometheus::Family<prometheus::Gauge>& applied_seq;
  prometheus::Family<prometheus::Counter>& published;
  prometheus::Family<prometheus::Counter>& fenced;
  prometheus::Family<prometheus::Counter>& applied;
  prometheus::Family<prometheus::Counter>& skipped;
  prometheus::Family<prometheus::Counter>& checkpoints;
  prometheus::Family<prometheus::Counter>& rls_errors;
  prometheus::Family<prometheus::Gauge>& kept;
  prometheus::Family<prometheus::Gauge>& frozen;
  prometheus::Family<prometheus::Counter>& batches;
  prometheus::Family<prometheus::Counter>& stage_seconds;
};

// ---- One readout --------------------------------------------------------------

class Trainer::Worker {
 public:
  Worker(Trainer* t, TrainerReadout r,
         std::optional<storage::RecoveredReadout> local)
      : t_(t), r_(std::move(r)), n_(r_.spec.dim + 1),
        quality_(t->options_.quality_window) {
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
    NameThread(thread_, "leap-trainer");
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
    s.local_checkpoint_seq = local_checkpoint_seq_;
    s.frozen = frozen_;
    s.frozen_reason = frozen_reason_;
    s.kept = static_cast<int64_t>(kept_seq_.size());
    s.remembered_ids = remembered_;
    s.quality_seq = quality_seq_;
    s.quality_completions = quality_.completions();
    s.running = running_.load();
    return s;
  }

  FleetQuality QualitySummary() const {
    absl::MutexLock lock(&mu_);
    return QualityLocked(/*with_pairs=*/false);
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

  // A state or version naming `created_unix_ms` belongs to this worker's
  // incarnation of the readout (0: written before states named one).
  bool OwnIncarnation(int64_t created_unix_ms) const {
    return created_unix_ms == 0 || created_unix_ms == r_.created_unix_ms;
  }

  void Log(const std::string& what) const {
    std::fprintf(stderr, "leapd: fleet trainer: readout '%s': %s\n",
                 r_.name.c_str(), what.c_str());
  }

  // Time spent in a stage (leap_fleet_trainer_seconds_total).
  void Stage(const char* stage, int64_t since_ns) {
    if (t_->families_ == nullptr) return;
    const double secs = static_cast<double>(SteadyNs() - since_ns) / 1e9;
    t_->families_->stage_seconds.Add({{"readout", r_.name}, {"stage", stage}})
        .Increment(std::max(secs, 0.0));
  }

  void SetGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (t_->families_ == nullptr) return;
    t_->families_->kept.Add({{"readout", r_.name}})
        .Set(static_cast<double>(kept_seq_.size()));
    t_->families_->frozen.Add({{"readout", r_.name}}).Set(frozen_ ? 1 : 0);
  }

  // The fleet-wide quality counted so far, with its position.
  FleetQuality QualityLocked(bool with_pairs) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FleetQuality q = quality_.Encode(with_pairs);
    q.set_readout(r_.name);
    q.set_fleet_seq(quality_seq_);
    q.set_trainer(t_->options_.member);
    q.set_unix_ms(UnixMs());
    q.set_created_unix_ms(r_.created_unix_ms);
    return q;
  }

  readout::RlsOptions RlsOpts() const {
    readout::RlsOptions o;
    o.threads = t_->options_.rls_threads;
    return o;
  }

  // theta, P and the position, consistent with each other (checkpoints
  // also carry the kept completions' sequences).
  FleetState CaptureLocked(bool with_p = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FleetState s;
    s.theta = rls_->theta();
    if (has_p_ && with_p) s.p = rls_->P();
    s.version = last_version_;
    s.completions_learned = learned_;
    s.fleet_seq = fleet_seq_;
    s.frozen = frozen_;
    s.unix_ms = UnixMs();
    s.created_unix_ms = r_.created_unix_ms;
    s.kept_seqs = kept_seq_;
    return s;
  }

  // Appends the standardized row and target of `c` to (u, y); false (with
  // the reason logged and counted) when it cannot be learned.
  bool AugmentRow(const FleetCompletion& c, uint64_t seq, std::vector<float>* u,
                  std::vector<double>* y) {
    const int dt = c.dtype();
    if (dt < 1 || dt > 3) {
      Skip("invalid");
      return false;
    }
    const auto dtype = static_cast<readout::DType>(dt);
    const size_t es = readout::DTypeSize(dtype);
    if (c.features().size() != static_cast<size_t>(r_.spec.dim) * es) {
      Log(absl::StrCat("completion at seq ", seq, " has ", c.features().size(),
                       " feature bytes, expected ", r_.spec.dim * es, "; skipped"));
      Skip("invalid");
      return false;
    }
    readout::FeatureView x{c.features().data(), dtype, r_.spec.dim, 1};
    const size_t off = u->size();
    u->resize(off + n_);
    r_.standardizer.Augment(x, u->data() + off);
    if (!FiniteRow(u->data() + off, n_, c.target())) {
      u->resize(off);
      Log(absl::StrCat("completion at seq ", seq,
                       " has non-finite standardized features or target; skipped"));
      Skip("invalid");
      return false;
    }
    y->push_back(c.target());
    return true;
  }

  // The newest state among memory, the local store and STATE.
  absl::Status LoadState() {
    std::optional<FleetState> best;
    bool from_memory = false;
    {
      absl::MutexLock lock(&mu_);
      if (rls_.has_value()) {
        best = CaptureLocked();
        from_memory = true;
      }
    }
    if (local_state_.has_value() &&
        (!best.has_value() || local_state_->fleet_seq > best->fleet_seq)) {
      best = *local_state_;
      from_memory = false;
    }
    const std::string subject = CheckpointSubject(fleet(), r_.name);
    // The newest checkpoint's last chunk names its fleet_seq: the whole
    // state is read only when it is newer than what this member has.
    bool read_fleet = true;
    // The fleet-wide quality of the newest complete STATE checkpoint (bytes,
    // that state's fleet_seq): where counting goes on unless the start is
    // from memory.
    std::optional<std::pair<std::string, uint64_t>> fleet_quality;
    {
      absl::StatusOr<std::optional<LastStateChunk>> last =
          ReadLastStateChunk(t_->js_, StateStream(fleet()), subject);
      if (!last.ok()) return last.status();
      ckpt_prev_first_seq_ = 0;
      if (last->has_value()) {
        const LastStateChunk& l = **last;
        const leap::v1::fleet::FleetStateChunk& c = l.chunk;
        // Where this term's first STATE checkpoint is fenced.
        ckpt_subject_seq_ = l.seq;
        ckpt_last_incarnation_ = l.parsed ? c.created_unix_ms() : 0;
        // A state of another incarnation of the name is not this readout's
        // (ReadNewestState skips it).
        const bool ours = l.parsed && OwnIncarnation(c.created_unix_ms());
        if (ours && c.last()) fleet_quality.emplace(c.quality(), c.fleet_seq());
        if (best.has_value() && ours && c.last() && c.fleet_seq() <= best->fleet_seq) {
          read_fleet = false;
        }
      } else {
        ckpt_subject_seq_ = 0;
        ckpt_last_incarnation_ = 0;
        read_fleet = false;
      }
    }
    if (read_fleet) {
      absl::StatusOr<FleetState> f = ReadNewestState(
          t_->nc_, t_->js_, StateStream(fleet()), subject, std::nullopt, r_.created_unix_ms);
      if (f.ok()) {
        checkpoint_chunks_ = f->chunks;
        fleet_quality.emplace(f->quality, f->fleet_seq);
        if (!best.has_value() || f->fleet_seq > best->fleet_seq) {
          best = std::move(*f);
          from_memory = false;
        }
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
    if (from_memory) return absl::OkStatus();  // kept rows still in memory
    if (!fleet_quality.has_value()) {
      // The last message was not a complete state's last chunk (a write cut
      // short, or a state of another incarnation): the newest complete one
      // of this incarnation.
      absl::StatusOr<FleetState> f = ReadNewestState(
          t_->nc_, t_->js_, StateStream(fleet()), subject, std::nullopt, r_.created_unix_ms);
      if (f.ok()) {
        fleet_quality.emplace(f->quality, f->fleet_seq);
      } else if (!absl::IsNotFound(f.status())) {
        return f.status();
      }
    }
    // Counting goes on from the checkpoint's quality, at its own position:
    // the completions after it (even those already in theta and P, when
    // the start is a newer local checkpoint) are counted once as they are
    // read again. A checkpoint without quality (the creation state, a
    // trainer that predates it) starts counting after its position.
    FleetQualityTracker quality(t_->options_.quality_window);
    uint64_t quality_seq = best->fleet_seq;
    if (fleet_quality.has_value()) {
      quality_seq = fleet_quality->second;
      FleetQuality q;
      if (fleet_quality->first.empty()) {
        // nothing counted before it
      } else if (q.ParseFromString(fleet_quality->first)) {
        quality.Decode(q);
        quality_seq = q.fleet_seq();
      } else {
        Log(absl::StrCat("unreadable quality in the fleet checkpoint; quality counted "
                         "from seq ", quality_seq));
      }
    }
    // The completions a checkpoint kept (a rejected batch): read back from
    // the stream by sequence.
    std::vector<float> kept_u;
    std::vector<double> kept_y;
    std::vector<uint64_t> kept_seq;
    for (uint64_t seq : best->kept_seqs) {
      natsMsg* raw = nullptr;
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st =
          js_GetMsg(&raw, t_->js_, FeedbackStream(fleet()).c_str(), seq, nullptr, &code);
      if (st != NATS_OK) {
        if (st == NATS_NOT_FOUND || code == JSNoMessageFoundErr) {
          Log(absl::StrCat("kept completion at seq ", seq,
                           " is no longer in the stream; dropped"));
          Skip("invalid");
          continue;
        }
        return NatsFailure(absl::StrCat("reading kept completion ", seq), st, code);
      }
      MsgPtr m(raw);
      FleetCompletion c;
      if (!c.ParseFromArray(natsMsg_GetData(m.get()), natsMsg_GetDataLength(m.get()))) {
        Skip("invalid");
        continue;
      }
      if (AugmentRow(c, seq, &kept_u, &kept_y)) kept_seq.push_back(seq);
    }
    absl::MutexLock lock(&mu_);
    has_p_ = best->p.has_value();
    if (has_p_) {
      rls_.emplace(best->theta, std::move(*best->p), RlsOpts());
    } else {
      rls_.emplace(best->theta, readout::SymMatrix::ScaledIdentity(n_, 1.0f), RlsOpts());
    }
    fleet_seq_ = best->fleet_seq;
    learned_ = best->completions_learned;
    frozen_ = best->frozen || !has_p_;
    // A rejected batch's cause from an earlier term does not describe a
    // state loaded unfrozen (a successor went on from it).
    if (!frozen_) frozen_cause_.clear();
    kept_u_ = std::move(kept_u);
    kept_y_ = std::move(kept_y);
    kept_seq_ = std::move(kept_seq);
    quality_ = std::move(quality);
    quality_seq_ = quality_seq;
    if (!kept_seq_.empty() && frozen_reason_.empty()) {
      frozen_reason_ = "rls: a rejected batch is kept (from the checkpoint)";
    }
    SetGauges();
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
    last_version_created_ = v.created_unix_ms();
    return absl::OkStatus();
  }

  // The FEEDBACK subjects this worker's consumers read: this readout's
  // completions (.c) and control operations (.ctl), in stream order, through
  // one filter subject.
  std::string ConsumerFilter() const {
    return ReadoutFeedbackSubjects(fleet(), r_.name);
  }

  absl::Status Subscribe() {
    const std::string filter = ConsumerFilter();
    jsSubOptions so;
    jsSubOptions_Init(&so);
    const std::string stream = FeedbackStream(fleet());
    so.Stream = stream.c_str();
    so.Ordered = true;
    so.Config.DeliverPolicy = js_DeliverByStartSequence;
    {
      absl::MutexLock lock(&mu_);
      // The quality may be behind theta and P (a start from a local
      // checkpoint): read from the older of the two.
      so.Config.OptStartSeq = std::min(fleet_seq_, quality_seq_) + 1;
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

  // Remembers a completion's message id; false when it was seen before.
  bool Remember(std::string key) {
    if (seen_.contains(key)) return false;
    seen_.insert(key);
    seen_order_.push_back(std::move(key));
    if (seen_order_.size() > kRememberedIds) {
      seen_.erase(seen_order_.front());
      seen_order_.pop_front();
    }
    return true;
  }

  // The duplicate index of a worker that starts without one (a new process,
  // a new readout): the message ids of this readout's completions among the
  // last kRememberedIds FEEDBACK messages up to the state's fleet_seq, read
  // from the stream (headers only). With it a completion the stream stored
  // twice (a resend after JetStream's de-duplication window) is skipped
  // whether or not the trainer restarted in between.
  absl::Status RebuildSeen() {
    uint64_t upto;
    {
      absl::MutexLock lock(&mu_);
      // Up to where the consumer starts: it remembers the rest as it reads.
      upto = std::min(fleet_seq_, quality_seq_);
    }
    if (!seen_order_.empty() || upto == 0) return absl::OkStatus();
    const int64_t t0 = SteadyNs();
    const std::string filter = ConsumerFilter();
    const std::string stream = FeedbackStream(fleet());
    const std::string fb_subject = FeedbackSubject(fleet(), r_.name);
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream.c_str();
    so.Ordered = true;
    so.Config.HeadersOnly = true;
    so.Config.DeliverPolicy = js_DeliverByStartSequence;
    so.Config.OptStartSeq = upto >= kRememberedIds ? upto + 1 - kRememberedIds : 1;
    natsSubscription* sub = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus st = js_SubscribeSync(&sub, t_->js_, filter.c_str(), nullptr, &so, &code);
    if (st != NATS_OK) {
      return NatsFailure("rebuilding the duplicate index from " + stream, st, code);
    }
    natsSubscription_SetPendingLimits(sub, -1, -1);
    absl::Status result = absl::OkStatus();
    // Messages the consumer has from its start: delivered (perhaps already
    // queued here) plus not yet delivered. Each message then says how many
    // are left after it.
    uint64_t pending = 1;
    {
      jsConsumerInfo* ci = nullptr;
      if (natsSubscription_GetConsumerInfo(&ci, sub, nullptr, nullptr) == NATS_OK) {
        pending = ci->NumPending + ci->Delivered.Consumer;
        jsConsumerInfo_Destroy(ci);
      }
    }
    int64_t read = 0;
    while (pending > 0 && !stop_.load()) {
      natsMsg* raw = nullptr;
      st = natsSubscription_NextMsg(&raw, sub, 5000);
      if (st != NATS_OK) {
        result = NatsFailure("rebuilding the duplicate index from " + stream, st);
        break;
      }
      MsgPtr m(raw);
      jsMsgMetaData* meta = nullptr;
      uint64_t seq = 0;
      if (natsMsg_GetMetaData(&meta, m.get()) == NATS_OK) {
        seq = meta->Sequence.Stream;
        pending = meta->NumPending;
        jsMsgMetaData_Destroy(meta);
      } else {
        seq = StreamSequence(m.get());
      }
      if (seq > upto) break;
      ++read;
      if (natsMsg_GetSubject(m.get()) != fb_subject) continue;
      const char* id = nullptr;
      if (natsMsgHeader_Get(m.get(), "Nats-Msg-Id", &id) == NATS_OK && id != nullptr) {
        Remember(std::string(id));
      }
    }
    CloseSubscription(t_->nc_, sub);
    {
      absl::MutexLock lock(&mu_);
      remembered_ = static_cast<int64_t>(seen_order_.size());
    }
    if (result.ok()) {
      Log(absl::StrCat("duplicate index rebuilt from the stream: ", seen_order_.size(),
                       " message ids from ", read, " messages up to seq ", upto, " in ",
                       (SteadyNs() - t0) / 1'000'000, " ms"));
    } else {
      // Incomplete: the next term rebuilds it again.
      seen_.clear();
      seen_order_.clear();
    }
    return result;
  }

  void Run() {
    absl::Status s = LoadState();
    if (s.ok()) s = RebuildSeen();
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
                       last_version_,
                       quality_seq_ < fleet_seq_
                           ? absl::StrCat(", quality counted from seq ", quality_seq_)
                           : std::string()));
      // This term reads from the older of the two positions (a position
      // left by an earlier term must not hide what the quality lacks).
      pos_ = std::min(fleet_seq_, quality_seq_);
      dirty_ = fleet_seq_ > last_published_seq_;
      last_fleet_ckpt_ms_ = SteadyMs();
      last_local_ckpt_ms_ = SteadyMs();
      fleet_captured_seq_ = fleet_checkpoint_seq_;
      local_captured_seq_ = local_checkpoint_seq_;
    }
    {
      absl::MutexLock lock(&ckpt_mu_);
      ckpt_stop_ = false;
      ckpt_drain_ = false;
      ckpt_job_.reset();
    }
    ckpt_thread_ = std::thread([this] { CheckpointLoop(); });
    NameThread(ckpt_thread_, "leap-trainer-ck");
    const int64_t interval = t_->options_.version_interval_ms;
    // The quality put recomputes the Spearman of every series under mu_ and
    // is a synchronous KV put: not on every pass when versions go out at
    // once (an interval of 0).
    const int64_t quality_interval = std::max<int64_t>(interval, kQualityPutMinIntervalMs);
    if (js_KeyValue(&config_kv_, t_->js_, ConfigBucket(fleet()).c_str()) != NATS_OK) {
      config_kv_ = nullptr;
      Log("no CONFIG bucket: the fleet-wide quality is counted but not published");
    }
    {
      absl::MutexLock lock(&mu_);
      quality_dirty_ = true;  // members learn who counts from here
    }
    std::vector<MsgPtr> msgs;
    while (!stop_.load()) {
      int64_t wait_ms = 50;
      if (dirty_ || deferred_) {
        wait_ms = std::clamp<int64_t>(last_publish_ms_ + interval - SteadyMs(), 1, 50);
      }
      natsMsg* raw = nullptr;
      int64_t t0 = SteadyNs();
      natsStatus st = natsSubscription_NextMsg(&raw, sub_, wait_ms);
      Stage("wait", t0);
      if (st == NATS_OK) {
        t0 = SteadyNs();
        msgs.clear();
        msgs.emplace_back(raw);
        // Everything queued, up to the batch bound (control operations may
        // split it): what this client holds and what the server still has
        // for this consumer (each message's NumPending). The server pushes
        // only a flow-control window ahead (a few MiB: ~200 completions at
        // d = 4096 in FP32), so a backlog larger than that is waited for
        // message by message as taking them opens the window again.
        uint64_t server_pending = ServerPending(raw);
        int pending = 0;
        natsSubscription_GetPending(sub_, &pending, nullptr);
        const int64_t read_deadline_ms = SteadyMs() + kBacklogReadMs;
        // Rows already taken and not yet applied count towards the bound.
        const int room = t_->options_.max_batch - static_cast<int>(batch_y_.size());
        while (static_cast<int>(msgs.size()) < room &&
               (pending > 0 || server_pending > 0)) {
          int64_t timeout_ms = 1;
          if (pending == 0) {
            timeout_ms = std::min(kBacklogWaitMs, read_deadline_ms - SteadyMs());
            if (timeout_ms <= 0) break;
          }
          raw = nullptr;
          if (natsSubscription_NextMsg(&raw, sub_, timeout_ms) != NATS_OK) break;
          msgs.emplace_back(raw);
          server_pending = ServerPending(raw);
          natsSubscription_GetPending(sub_, &pending, nullptr);
        }
        // NumPending of the last message taken already counts those buffered
        // here (delivered after it): the larger of the two, not the sum.
        backlog_ = std::max(server_pending, static_cast<uint64_t>(std::max(pending, 0)));
        Stage("read", t0);
        Process(msgs);
        if (stop_.load()) break;
        // The rows wait for more unless kMinApplyBatch (or the batch bound)
        // are taken or a version is due: an exact batch of k costs far less
        // than k batches of one at d = 4096 (P is streamed once per batch),
        // and no version could show them before it is due anyway.
        if (deferred_ &&
            (interval == 0 || SteadyMs() - last_publish_ms_ >= interval ||
             static_cast<int>(batch_y_.size()) >=
                 std::min(t_->options_.max_batch, kMinApplyBatch))) {
          ApplyBatch();
        }
      } else if (st == NATS_TIMEOUT) {
        backlog_ = 0;  // nothing arrived within the wait
        if (deferred_) ApplyBatch();  // due, or the stream is idle
      } else {
        Log(absl::StrCat("reading the stream: ", natsStatus_GetText(st)));
        // The ordered consumer recreates itself; a closed connection ends
        // this term (the lease will not renew either).
        if (st == NATS_CONNECTION_CLOSED || st == NATS_INVALID_SUBSCRIPTION) break;
      }
      if (dirty_ && SteadyMs() - last_publish_ms_ >= interval) Publish(RlsCause(), "");
      if (SteadyMs() - last_quality_put_ms_ >= quality_interval) PublishQuality();
      MaybeCheckpoint(false, /*stopping=*/false);
    }
    // What was taken is applied before the term ends: the duplicate index
    // already holds its message ids, so a later term (this worker, from its
    // in-memory state) must find them in theta and P.
    if (deferred_) ApplyBatch();  // (a rejection publishes nothing now)
    const bool final = final_checkpoint_.load() && !abandoned_;
    if (final) {
      // With NATS down nothing more reaches it (the local checkpoint is
      // still written): the stop stays bounded.
      if (dirty_ && t_->Connected()) Publish(RlsCause(), "", /*stopping=*/true);
      if (t_->Connected()) PublishQuality();
      MaybeCheckpoint(true, /*stopping=*/true);
    }
    if (config_kv_ != nullptr) {
      kvStore_Destroy(config_kv_);
      config_kv_ = nullptr;
    }
    {
      absl::MutexLock lock(&ckpt_mu_);
      ckpt_stop_ = true;
      ckpt_drain_ = final;
    }
    ckpt_thread_.join();
    CloseSubscription(t_->nc_, sub_);
    sub_ = nullptr;
    running_.store(false);
  }

  // Messages the server still holds for this consumer after `m` (its
  // JetStream metadata); 0 when unknown.
  static uint64_t ServerPending(natsMsg* m) {
    jsMsgMetaData* meta = nullptr;
    if (natsMsg_GetMetaData(&meta, m) != NATS_OK || meta == nullptr) return 0;
    const uint64_t n = meta->NumPending;
    jsMsgMetaData_Destroy(meta);
    return n;
  }

  void Process(const std::vector<MsgPtr>& msgs) {
    const std::string fb_subject = FeedbackSubject(fleet(), r_.name);
    const std::string ctl_subject = ControlSubject(fleet(), r_.name);
    int64_t t0 = SteadyNs();
    for (const MsgPtr& m : msgs) {
      const uint64_t seq = StreamSequence(m.get());
      uint64_t done;
      {
        absl::MutexLock lock(&mu_);
        done = fleet_seq_;
      }
      if (seq <= pos_) continue;
      const absl::string_view subject = natsMsg_GetSubject(m.get());
      if (seq <= done) {
        // Already in theta and P: only the quality may lack it.
        pos_ = seq;
        if (subject == fb_subject) CountOnly(m.get(), seq);
        PassQuality(seq);
        continue;
      }
      pos_ = seq;
      if (subject != fb_subject && subject != ctl_subject) {
        moved_ = true;
        PassQuality(seq);
        continue;
      }
      if (subject == ctl_subject) {
        Stage("parse", t0);
        FleetControl c;
        const bool parsed =
            c.ParseFromArray(natsMsg_GetData(m.get()), natsMsg_GetDataLength(m.get()));
        // An EXPORT alone is no reason for a version.
        if (!parsed || c.op() != FleetControl::EXPORT) moved_ = true;
        ApplyBatch();
        if (!parsed) {
          Log(absl::StrCat("unparsable control message at seq ", seq, " skipped"));
          PassQuality(seq);
          t0 = SteadyNs();
          continue;
        }
        Control(c, seq, m.get());
        PassQuality(seq);
        t0 = SteadyNs();
        continue;
      }
      moved_ = true;
      AddCompletion(m.get(), seq);
      PassQuality(seq);
    }
    Stage("parse", t0);
    // Applied by the caller (Run) when the batch is full, a version is due
    // or the stream is idle.
    deferred_ = true;
  }

  void Skip(const std::string& reason) {
    if (t_->families_ != nullptr) {
      t_->families_->skipped.Add({{"readout", r_.name}, {"reason", reason}}).Increment();
    }
  }

  // Counts a completion's (prediction, outcome) pair in the fleet-wide
  // quality, once: only past the position the quality has reached.
  void CountQuality(const FleetCompletion& c, uint64_t seq) {
    absl::MutexLock lock(&mu_);
    if (seq <= quality_seq_) return;
    quality_.Add(c.served_version(), c.product_line(), c.arm(), c.predicted_tokens(),
                 c.true_tokens());
    quality_dirty_ = true;
  }

  // Every message up to `seq` is accounted for in the quality.
  void PassQuality(uint64_t seq) {
    absl::MutexLock lock(&mu_);
    quality_seq_ = std::max(quality_seq_, seq);
  }

  // A completion already in theta and P, read again because the quality is
  // behind (a start from a newer local checkpoint than the fleet's): its
  // id joins the duplicate index, its pair the quality.
  void CountOnly(natsMsg* m, uint64_t seq) {
    const char* id = nullptr;
    if (natsMsgHeader_Get(m, "Nats-Msg-Id", &id) == NATS_OK && id != nullptr &&
        !Remember(std::string(id))) {
      return;
    }
    FleetCompletion c;
    if (c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m))) {
      CountQuality(c, seq);
    }
  }

  void AddCompletion(natsMsg* m, uint64_t seq) {
    const char* id = nullptr;
    if (natsMsgHeader_Get(m, "Nats-Msg-Id", &id) == NATS_OK && id != nullptr) {
      if (!Remember(std::string(id))) {
        Skip("duplicate");
        return;
      }
    }
    FleetCompletion c;
    if (!c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m))) {
      Log(absl::StrCat("unparsable completion at seq ", seq, " skipped"));
      Skip("invalid");
      return;
    }
    // Counted whether or not it is learned (as a single leapd records the
    // quality of a frozen readout's completions).
    CountQuality(c, seq);
    bool frozen;
    {
      absl::MutexLock lock(&mu_);
      frozen = frozen_;
    }
    if (frozen) {
      Skip("frozen");
      return;
    }
    if (AugmentRow(c, seq, &batch_u_, &batch_y_)) batch_seq_.push_back(seq);
  }

  // Applies rows (one exact batch) under mu_. A rejected batch changes
  // nothing it did not apply (pieces applied before a failure stay); the
  // rest is kept with its sequences, learning freezes (as a single leapd
  // keeps such completions queued) until a RESUME retries them.
  absl::Status UpdateLocked(const float* u, const std::vector<double>& y,
                            const std::vector<uint64_t>& seqs, int64_t* applied)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t k = static_cast<int64_t>(y.size());
    const int64_t before = rls_->updates();
    absl::Status s = rls_->Update(u, n_, y);
    *applied = rls_->updates() - before;
    learned_ += *applied;
    if (!s.ok()) {
      frozen_ = true;
      frozen_reason_ = absl::StrCat("rls: ", s.message());
      std::vector<float> ku(u + *applied * n_, u + k * n_);
      std::vector<double> ky(y.begin() + *applied, y.end());
      std::vector<uint64_t> ks(seqs.begin() + *applied, seqs.end());
      // Kept ones come first: they were taken before.
      ku.insert(ku.end(), kept_u_.begin(), kept_u_.end());
      ky.insert(ky.end(), kept_y_.begin(), kept_y_.end());
      ks.insert(ks.end(), kept_seq_.begin(), kept_seq_.end());
      kept_u_ = std::move(ku);
      kept_y_ = std::move(ky);
      kept_seq_ = std::move(ks);
    }
    SetGauges();
    return s;
  }

  // Applies the rows gathered (one exact batch) and moves fleet_seq to the
  // last message processed.
  void ApplyBatch() {
    const int64_t t0 = SteadyNs();
    const int64_t k = static_cast<int64_t>(batch_y_.size());
    absl::Status s = absl::OkStatus();
    int64_t applied = 0;
    {
      absl::MutexLock lock(&mu_);
      if (k > 0) s = UpdateLocked(batch_u_.data(), batch_y_, batch_seq_, &applied);
      if (pos_ > fleet_seq_) {
        fleet_seq_ = pos_;
        if (moved_) dirty_ = true;
      }
      moved_ = false;
      if (t_->families_ != nullptr) {
        t_->families_->applied_seq.Add({{"readout", r_.name}})
            .Set(static_cast<double>(fleet_seq_));
      }
    }
    if (applied > 0) apply_ns_since_local_ += SteadyNs() - t0;
    if (applied > 0 && t_->families_ != nullptr) {
      t_->families_->applied.Add({{"readout", r_.name}})
          .Increment(static_cast<double>(applied));
      t_->families_->batches.Add({{"readout", r_.name}}).Increment();
    }
    batch_u_.clear();
    batch_y_.clear();
    batch_seq_.clear();
    deferred_ = false;
    if (k > 0) Stage("apply", t0);
    if (!s.ok()) RlsRejected(s, k - applied);
  }

  // The cause of the next "rls" version: the freeze of a rejected batch
  // whose version is still due.
  std::string RlsCause() const {
    return frozen_cause_.empty() ? std::string("rls") : frozen_cause_;
  }

  void RlsRejected(const absl::Status& s, int64_t kept_now) {
    int64_t kept;
    {
      absl::MutexLock lock(&mu_);
      kept = static_cast<int64_t>(kept_seq_.size());
    }
    Log(absl::StrCat("RLS batch rejected (", s.message(), "); learning frozen, ",
                     kept_now, " completions kept (", kept,
                     " in all) until it is resumed"));
    if (t_->families_ != nullptr) {
      t_->families_->rls_errors.Add({{"readout", r_.name}}).Increment();
    }
    frozen_cause_ = absl::StrCat("frozen: rls: ", s.message());
    if (stop_.load()) {
      // The term is ending (a clean stop, a lease lost, a crash stand-in):
      // no synchronous publish here, which would wait for NATS (its full
      // timeout while NATS is down) even after the lease is lost. The
      // version stays due (dirty_): a clean stop publishes it with its
      // short timeout while connected and fenced, the next term of this
      // member first thing; a successor replays the batch.
      dirty_ = true;
      return;
    }
    Publish(frozen_cause_, "");
  }

  // On RESUME: the kept completions first, as one batch. False when it was
  // rejected again (frozen again, still kept).
  bool RetryKept() {
    absl::Status s = absl::OkStatus();
    int64_t applied = 0;
    int64_t k = 0;
    {
      absl::MutexLock lock(&mu_);
      if (kept_y_.empty()) return true;
      std::vector<float> u = std::move(kept_u_);
      std::vector<double> y = std::move(kept_y_);
      std::vector<uint64_t> seqs = std::move(kept_seq_);
      kept_u_.clear();
      kept_y_.clear();
      kept_seq_.clear();
      k = static_cast<int64_t>(y.size());
      s = UpdateLocked(u.data(), y, seqs, &applied);
    }
    if (applied > 0 && t_->families_ != nullptr) {
      t_->families_->applied.Add({{"readout", r_.name}})
          .Increment(static_cast<double>(applied));
    }
    if (s.ok()) {
      Log(absl::StrCat("resumed: ", k, " kept completions applied"));
      return true;
    }
    Log(absl::StrCat("resumed: kept batch rejected again (", s.message(),
                     "); learning frozen, ", k - applied, " completions kept"));
    if (t_->families_ != nullptr) {
      t_->families_->rls_errors.Add({{"readout", r_.name}}).Increment();
    }
    return false;
  }

  void Control(const FleetControl& c, uint64_t seq, natsMsg* m) {
    if (c.op() == FleetControl::EXPORT) {
      Export(c, seq, m);
      return;
    }
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
        s.kept_seqs.clear();  // a snapshot is theta and P only
        // The id names the incarnation: a worker of a deleted incarnation
        // answering the same operation (its member has not applied the
        // delete yet) must not take this one's id (JetStream would drop
        // the current incarnation's chunks as duplicates); a replay within
        // the incarnation writes the same ids.
        // Unavailable (no stream leader: a NATS node lost, its streams
        // electing one, measured 4.5-6.2 s) is retried for up to
        // kSnapshotRetryMs under the same id (chunks already stored are
        // de-duplicated), within the 10 s an admin call waits for the answer.
        const std::string snap_id =
            absl::StrCat("snap-", r_.name, "-", r_.created_unix_ms, "-", seq);
        const auto write = [&] {
          return PublishState(t_->js_, StateStream(fleet()),
                              SnapshotSubject(fleet(), r_.name, label), r_.name, snap_id, s);
        };
        const int64_t give_up = SteadyMs() + kSnapshotRetryMs;
        int64_t pause_ms = 100;
        absl::StatusOr<int32_t> w = write();
        while (!w.ok() && absl::IsUnavailable(w.status()) && !stop_.load() &&
               SteadyMs() + pause_ms < give_up) {
          Log(absl::StrCat("snapshot '", label, "' not written yet (retried in ", pause_ms,
                           " ms): ", w.status().message()));
          absl::SleepFor(absl::Milliseconds(pause_ms));
          pause_ms = std::min<int64_t>(pause_ms * 2, 1000);
          w = write();
        }
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
        // stream order (a replay after a crash finds the same one), never
        // one that names another incarnation of the readout.
        absl::StatusOr<FleetState> snap =
            ReadNewestState(t_->nc_, t_->js_, StateStream(fleet()),
                            SnapshotSubject(fleet(), r_.name, label), seq,
                            r_.created_unix_ms);
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
          // Kept completions (frozen after a rejected batch) stay: they are
          // learned on top of the snapshot once resumed.
          absl::MutexLock lock(&mu_);
          if (has_p_) {
            rls_.emplace(snap->theta, std::move(*snap->p), RlsOpts());
          } else {
            rls_.emplace(snap->theta, readout::SymMatrix::ScaledIdentity(n_, 1.0f),
                         RlsOpts());
          }
          learned_ = snap->completions_learned;
        }
        Publish("rollback:" + label, c.op_id());
        return;
      }
      case FleetControl::FREEZE:
      case FleetControl::RESUME: {
        const bool freeze = c.op() == FleetControl::FREEZE;
        bool frozen;
        {
          absl::MutexLock lock(&mu_);
          frozen_ = freeze || !has_p_;
          if (!frozen_) frozen_reason_.clear();
          frozen = frozen_;
          SetGauges();
        }
        if (!frozen && !RetryKept()) {
          std::string reason;
          {
            absl::MutexLock lock(&mu_);
            reason = frozen_reason_;
          }
          Publish("frozen: " + reason, c.op_id());
          return;
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

  // EXPORT: the state now (theta, P, no kept completions, no quality) to
  // the asker's subject; no version, and nothing when read after the
  // asker's deadline_unix_ms (it stopped waiting and purged the subject) or
  // when older than kExportMaxAgeMs (read again after a crash: its asker
  // gave up long ago). An answer finished well past the deadline is purged
  // here: the asker's purge came before it.
  void Export(const FleetControl& c, uint64_t seq, natsMsg* m) {
    jsMsgMetaData* meta = nullptr;
    int64_t age_ms = 0;
    if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
      age_ms = UnixMs() - meta->Timestamp / 1'000'000;
      jsMsgMetaData_Destroy(meta);
    }
    if (age_ms > kExportMaxAgeMs) {
      Log(absl::StrCat("export ", c.op_id(), " at seq ", seq, " is ", age_ms,
                       " ms old; not answered"));
      return;
    }
    const int64_t deadline_ms = c.deadline_unix_ms();
    if (deadline_ms > 0 && UnixMs() > deadline_ms) {
      Log(absl::StrCat("export ", c.op_id(), " at seq ", seq, " read ",
                       UnixMs() - deadline_ms, " ms after its asker's deadline; not answered"));
      return;
    }
    if (!t_->FenceOk()) return;
    FleetState s;
    {
      absl::MutexLock lock(&mu_);
      s = CaptureLocked();
    }
    s.kept_seqs.clear();
    const std::string subject = ExportSubject(fleet(), r_.name, c.op_id());
    absl::StatusOr<int32_t> w = PublishState(t_->js_, StateStream(fleet()), subject,
                                             r_.name, absl::StrCat("export-", c.op_id()), s);
    if (!w.ok()) {
      Log(absl::StrCat("export ", c.op_id(), " not written: ", w.status().message()));
    }
    // Written (or partly) after the asker stopped waiting, beyond any
    // plausible clock difference: nobody reads or purges it but us.
    if (deadline_ms > 0 && UnixMs() > deadline_ms + kExportLatePurgeMs) {
      jsOptions jo;
      jsOptions_Init(&jo);
      jo.Stream.Purge.Subject = subject.c_str();
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st = js_PurgeStream(t_->js_, StateStream(fleet()).c_str(), &jo, &code);
      Log(absl::StrCat("export ", c.op_id(), " finished after its asker's deadline; ",
                       st == NATS_OK ? "purged"
                                     : NatsFailure("purge", st, code).message()));
    }
  }

  // Publishes the current theta as the next version, fenced. False when it
  // was not published (it stays due). `stopping`: the last publish of a
  // clean stop, waiting at most the lease time.
  bool Publish(const std::string& cause, const std::string& op_id,
               bool stopping = false) {
    const int64_t t0 = SteadyNs();
    const bool ok = PublishFenced(cause, op_id, stopping);
    Stage("publish", t0);
    return ok;
  }

  bool PublishFenced(const std::string& cause, const std::string& op_id,
                     bool stopping) {
    jsCtx* js = stopping ? t_->short_js_ : t_->js_;
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
        v.set_created_unix_ms(r_.created_unix_ms);
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
      natsStatus st = js_Publish(&ack, js, subject.c_str(), bytes.data(),
                                 static_cast<int>(bytes.size()), &po, &code);
      if (st == NATS_OK) {
        {
          absl::MutexLock lock(&mu_);
          ver_seq_ = ack->Sequence;
          frozen_cause_.clear();
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
      // A version of another incarnation of the name was published since
      // ours (the readout was deleted and created again): this worker's
      // readout is no longer current, and nothing of it goes on top.
      int64_t other = 0;
      {
        absl::MutexLock lock(&mu_);
        other = last_version_created_;
      }
      if (other != 0 && other != r_.created_unix_ms) {
        Log(absl::StrCat("version publish fenced: readout created again (",
                         other, ", this worker's ", r_.created_unix_ms,
                         "); stopping"));
        stop_.store(true);
        return false;
      }
    }
    return false;
  }

  // The quality counted so far (no pairs) into CONFIG quality.<readout>,
  // when it changed; only while this member may publish.
  void PublishQuality() {
    if (config_kv_ == nullptr || !t_->FenceOk()) return;
    std::string bytes;
    {
      absl::MutexLock lock(&mu_);
      if (!quality_dirty_) return;
      bytes = QualityLocked(/*with_pairs=*/false).SerializeAsString();
      quality_dirty_ = false;
    }
    last_quality_put_ms_ = SteadyMs();
    uint64_t rev = 0;
    const std::string key = QualityConfigKey(r_.name);
    natsStatus st = kvStore_Put(&rev, config_kv_, key.c_str(), bytes.data(),
                                static_cast<int>(bytes.size()));
    if (st != NATS_OK) {
      Log(absl::StrCat("quality not published (retried): ",
                       NatsFailure("put " + key, st).message()));
      absl::MutexLock lock(&mu_);
      quality_dirty_ = true;
    }
  }

  void Fenced() {
    if (t_->families_ != nullptr) {
      t_->families_->fenced.Add({{"readout", r_.name}}).Increment();
    }
  }

  // Checkpoints are written by the checkpoint thread: the worker only
  // copies theta, P and the position under mu_ (one consistent state) and
  // goes on learning. A capture not yet taken by the thread is replaced by
  // a newer one.
  void MaybeCheckpoint(bool force, bool stopping) {
    const int64_t now = SteadyMs();
    const bool requested = checkpoint_requested_.exchange(false);
    force = force || requested;
    int64_t local_write_ns;
    {
      absl::MutexLock lock(&ckpt_mu_);
      local_write_ns = last_local_write_ns_;
      if (ckpt_failed_fleet_) fleet_captured_seq_ = 0;  // retried when due
      if (ckpt_failed_local_) {
        // Due again as if the failed capture had not happened: the age and
        // the apply time since the last local checkpoint that was written
        // (the recovery bound in FLEET.md counts from that one).
        local_captured_seq_ = 0;
        last_local_ckpt_ms_ = local_ckpt_before_capture_ms_;
        apply_ns_since_local_ += apply_ns_at_local_capture_;
      }
      ckpt_failed_fleet_ = ckpt_failed_local_ = false;
      // One write at a time; a periodic capture waits for the thread, and
      // for kCheckpointRestFactor times the last write's duration after it
      // (the thread writes at most 1 / (1 + factor) of the time).
      if (!force && (ckpt_busy_ || ckpt_job_.has_value() || now < ckpt_rest_until_ms_)) {
        return;
      }
    }
    uint64_t seq;
    bool kept;
    {
      absl::MutexLock lock(&mu_);
      seq = fleet_seq_;
      kept = !kept_seq_.empty();
    }
    // While the worker is a full batch or more behind the stream, a
    // periodic checkpoint (its P copy and 64 MiB write at d = 4096 compete
    // with learning for the CPU) waits, for one more period at most: a
    // checkpoint is never older than two periods (plus its write), so what
    // a restart replays from the stream stays bounded.
    const bool behind = backlog_ >= static_cast<uint64_t>(t_->options_.max_batch);
    auto periodic_due = [&](int64_t last_ms, int64_t every_ms) {
      const int64_t age = now - last_ms;
      return age >= every_ms && (!behind || age >= 2 * every_ms);
    };
    const bool fleet_due =
        seq > fleet_captured_seq_ &&
        (force || periodic_due(last_fleet_ckpt_ms_, t_->options_.checkpoint_every_ms));
    // The local store has no place for kept completions: while some are
    // kept only STATE checkpoints are written (a local one would hide them).
    // A periodic local checkpoint also waits while re-applying what it
    // would save costs less than writing it did (kLocalCheckpointMaxPeriods).
    const int64_t local_every = t_->options_.local_checkpoint_every_ms;
    const bool local_worth =
        apply_ns_since_local_ >= local_write_ns ||
        now - last_local_ckpt_ms_ >= kLocalCheckpointMaxPeriods * local_every;
    const bool local_due =
        t_->options_.local_store != nullptr && !kept && seq > local_captured_seq_ &&
        (force || (periodic_due(last_local_ckpt_ms_, local_every) && local_worth));
    if (!fleet_due && !local_due) return;
    const int64_t t0 = SteadyNs();
    CheckpointJob job;
    {
      absl::MutexLock lock(&mu_);
      // P is shared, not copied: the checkpoint thread makes the full
      // symmetric copy (64 MiB at d = 4096) off the learning path.
      job.state = CaptureLocked(/*with_p=*/false);
      if (has_p_) job.shared_p = rls_->SharedP();
      // Always (a pending fleet write may be merged into this one).
      job.state.quality = QualityLocked(/*with_pairs=*/true).SerializeAsString();
    }
    Stage("checkpoint_capture", t0);
    job.local = local_due;
    job.fleet = fleet_due;
    job.stopping = stopping;
    if (local_due) {
      local_ckpt_before_capture_ms_ = last_local_ckpt_ms_;
      apply_ns_at_local_capture_ = apply_ns_since_local_;
      last_local_ckpt_ms_ = now;
      local_captured_seq_ = job.state.fleet_seq;
      apply_ns_since_local_ = 0;
    }
    if (fleet_due) {
      last_fleet_ckpt_ms_ = now;
      fleet_captured_seq_ = job.state.fleet_seq;
    }
    absl::MutexLock lock(&ckpt_mu_);
    if (ckpt_job_.has_value()) {
      // Replaced by a newer state: what it was to write is written now.
      job.local = job.local || ckpt_job_->local;
      job.fleet = job.fleet || ckpt_job_->fleet;
    }
    ckpt_job_ = std::move(job);
  }

  void CheckpointLoop() {
    for (;;) {
      CheckpointJob job;
      {
        absl::MutexLock lock(&ckpt_mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ckpt_mu_) {
          return ckpt_stop_ || ckpt_job_.has_value();
        };
        ckpt_mu_.Await(absl::Condition(&ready));
        if (!ckpt_job_.has_value() || (ckpt_stop_ && !ckpt_drain_)) {
          ckpt_job_.reset();
          return;
        }
        job = std::move(*ckpt_job_);
        ckpt_job_.reset();
        ckpt_busy_ = true;
      }
      const int64_t t0 = SteadyNs();
      if (job.shared_p != nullptr) {
        // Released at once: a fold on the worker copies P first only while
        // it is still held.
        job.state.p = readout::CopySymmetric(*job.shared_p);
        job.shared_p.reset();
      }
      const bool local_ok = !job.local || WriteLocal(job.state);
      // The copy of P and the local write: what the next local checkpoint
      // must save to be worth writing.
      const int64_t local_ns = SteadyNs() - t0;
      const bool fleet_ok = !job.fleet || WriteFleet(job.state, job.stopping);
      Stage("checkpoint_write", t0);
      const int64_t end_ms = SteadyMs();
      absl::MutexLock lock(&ckpt_mu_);
      ckpt_busy_ = false;
      if (job.local && local_ok) last_local_write_ns_ = local_ns;
      ckpt_rest_until_ms_ =
          end_ms + kCheckpointRestFactor * ((SteadyNs() - t0) / 1'000'000);
      if (!local_ok) ckpt_failed_local_ = true;
      if (!fleet_ok) ckpt_failed_fleet_ = true;
    }
  }

  // Checkpoint thread. True when written or not to be written (fenced).
  //
  // Fenced on the subject: every chunk carries the subject's expected last
  // sequence (the last one this worker saw there: at its start or after its
  // own previous checkpoint). When something else was stored since (a new
  // incarnation's creation state, another trainer's checkpoint), JetStream
  // refuses it; if the subject's newest message names another incarnation
  // of the readout (deleted and created again, and this worker's member has
  // not applied that yet), the worker stops and writes nothing more;
  // otherwise, unless the lease is no longer its own (then it stops too),
  // it reads the subject's last sequence and tries once more (a checkpoint
  // of its own whose acknowledgement was lost). A worker whose term began
  // when the subject's newest message already named a later incarnation
  // (created_unix_ms above its own) stops at its first checkpoint without
  // writing it.
  bool WriteFleet(const FleetState& s, bool stopping) {
    // A deposed trainer writes nothing more (its state is a valid prefix,
    // but its successor owns the subject now); with NATS down a stop
    // writes nothing to it.
    if (!t_->FenceOk()) return true;
    if (stopping && !t_->Connected()) {
      Log("NATS unreachable: no final fleet checkpoint (the local one and the "
          "stream keep everything)");
      return true;
    }
    jsCtx* js = stopping ? t_->short_js_ : t_->js_;
    const std::string subject = CheckpointSubject(fleet(), r_.name);
    const std::string stream = StateStream(fleet());
    if (ckpt_last_incarnation_ > r_.created_unix_ms) {
      // The subject's newest message (when this term started) is of a later
      // incarnation of the name: this worker's readout was deleted and
      // created again before its term began. The fence would not refuse
      // this write (nothing was stored since), but it is not this
      // worker's subject any more.
      Log(absl::StrCat("fleet checkpoint fenced: ", subject, " holds a later incarnation ",
                       "of the readout (", ckpt_last_incarnation_, ", this worker's ",
                       r_.created_unix_ms, "); not written, stopping"));
      Fenced();
      stop_.store(true);
      return true;
    }
    absl::StatusOr<int32_t> chunks = absl::InternalError("not written");
    StateFence fence;
    // The first sequence of the newest state before this one when this
    // worker wrote it (what the purge keeps from); 0: not known.
    uint64_t prev_first = ckpt_prev_first_seq_;
    for (int attempt = 0; attempt < 2; ++attempt) {
      fence = StateFence{};
      fence.last_subject_seq = ckpt_subject_seq_;
      const std::string state_id =
          absl::StrCat(t_->options_.member, "-", s.fleet_seq, "-", s.unix_ms,
                       attempt > 0 ? "-r" : "");
      chunks = PublishState(js, stream, subject, r_.name, state_id, s, &fence);
      if (fence.last_subject_seq > ckpt_subject_seq_) {
        ckpt_subject_seq_ = fence.last_subject_seq;
      }
      if (chunks.ok() || !absl::IsFailedPrecondition(chunks.status())) break;
      // Refused: something was stored on the subject since.
      Fenced();
      const int64_t other = NewestStateIncarnation(js, stream, subject);
      if (other < 0) break;  // the subject's last message could not be read
      if (!OwnIncarnation(other)) {
        Log(absl::StrCat("fleet checkpoint fenced: a state of another incarnation of "
                         "the readout (", other, ", this worker's ", r_.created_unix_ms,
                         ") is on ", subject, "; not written, stopping"));
        stop_.store(true);
        return true;
      }
      if (!t_->LeaseStillOurs()) {
        Log(absl::StrCat("fleet checkpoint fenced: another trainer wrote on ", subject,
                         "; not written, stopping"));
        stop_.store(true);
        return true;
      }
      if (attempt == 0) {
        Log(absl::StrCat("fleet checkpoint fenced on ", subject,
                         " (something else was stored there); retried on seq ",
                         ckpt_subject_seq_));
        prev_first = 0;  // the newest state is no longer known
      }
    }
    if (!chunks.ok()) {
      Log(absl::StrCat("fleet checkpoint not written: ", chunks.status().message()));
      return false;
    }
    {
      absl::MutexLock lock(&mu_);
      fleet_checkpoint_seq_ = s.fleet_seq;
    }
    if (t_->families_ != nullptr) {
      t_->families_->checkpoints.Add({{"readout", r_.name}, {"where", "fleet"}})
          .Increment();
    }
    // Keep the last two (the newest may be unreadable, the one before not).
    // When this worker wrote the one before (in this term), by sequence:
    // everything on the subject below that state's first sequence goes, and
    // a state stored after this one (a new incarnation's creation state) is
    // never purged. Otherwise (the first checkpoint of a term, or one retried
    // on top of another write) by count, as many messages kept as the two
    // states have chunks, and only while this write is still the subject's
    // last message (checked just before; nothing else stored since): the
    // stream's sequences also number other subjects' messages, so the state
    // before's first sequence is not known.
    const uint64_t keep = static_cast<uint64_t>(
        *chunks + std::max<int32_t>(checkpoint_chunks_, *chunks));
    checkpoint_chunks_ = *chunks;
    ckpt_prev_first_seq_ = fence.first_seq;
    ckpt_last_incarnation_ = s.created_unix_ms;
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Stream.Purge.Subject = subject.c_str();
    bool purge = false;
    if (prev_first > 0) {
      jo.Stream.Purge.Sequence = prev_first;
      purge = prev_first > 1;
    } else {
      absl::StatusOr<std::optional<LastStateChunk>> last =
          ReadLastStateChunk(js, stream, subject);
      purge = last.ok() && last->has_value() &&
              (*last)->seq == fence.last_subject_seq;
      jo.Stream.Purge.Keep = keep;
      if (!purge) {
        Log(absl::StrCat("old checkpoints on ", subject,
                         " not pruned: something was stored after this one"));
      }
    }
    if (purge) {
      jsErrCode code = static_cast<jsErrCode>(0);
      natsStatus st = js_PurgeStream(js, stream.c_str(), &jo, &code);
      if (st != NATS_OK) {
        Log(absl::StrCat("pruning old checkpoints: ",
                         NatsFailure("purge", st, code).message()));
      }
    }
    return true;
  }

  // Checkpoint thread: the incarnation named by the newest message on the
  // checkpoint subject (0: none named, or the subject is empty), also into
  // ckpt_last_incarnation_, and its sequence into ckpt_subject_seq_; -1 when
  // it cannot be read.
  int64_t NewestStateIncarnation(jsCtx* js, const std::string& stream,
                                 const std::string& subject) {
    absl::StatusOr<std::optional<LastStateChunk>> last =
        ReadLastStateChunk(js, stream, subject);
    if (!last.ok()) {
      Log(std::string(last.status().message()));
      return -1;
    }
    if (!last->has_value()) {
      ckpt_subject_seq_ = 0;
      return 0;
    }
    ckpt_subject_seq_ = (*last)->seq;
    ckpt_last_incarnation_ = (*last)->parsed ? (*last)->chunk.created_unix_ms() : 0;
    return ckpt_last_incarnation_;
  }

  // Checkpoint thread (and the worker's start, before it runs).
  bool WriteLocal(const FleetState& s) {
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
      return false;
    }
    {
      absl::MutexLock lock(&mu_);
      local_checkpoint_seq_ = s.fleet_seq;
    }
    local_state_.reset();  // memory is at least as new from here on
    if (t_->families_ != nullptr) {
      t_->families_->checkpoints.Add({{"readout", r_.name}, {"where", "local"}})
          .Increment();
    }
    return true;
  }

  struct CheckpointJob {
    FleetState state;  // without P while shared_p is set
    // P as the worker left it (upper blocks only: readout::CopySymmetric).
    std::shared_ptr<const readout::SymMatrix> shared_p;
    bool local = false;
    bool fleet = false;
    bool stopping = false;
  };

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
  std::string frozen_reason_ ABSL_GUARDED_BY(mu_);
  // Completions of rejected batches, not applied (rows, targets, stream
  // sequences), in the order taken.
  std::vector<float> kept_u_ ABSL_GUARDED_BY(mu_);
  std::vector<double> kept_y_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> kept_seq_ ABSL_GUARDED_BY(mu_);
  int64_t last_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ver_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // created_unix_ms of the last version read back from the subject (0: not
  // named).
  int64_t last_version_created_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_published_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fleet_checkpoint_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t local_checkpoint_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t remembered_ ABSL_GUARDED_BY(mu_) = 0;
  // Fleet-wide quality: every completion with sequence <= quality_seq_ is
  // counted (once) in quality_.
  FleetQualityTracker quality_ ABSL_GUARDED_BY(mu_);
  uint64_t quality_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool quality_dirty_ ABSL_GUARDED_BY(mu_) = false;
  bool dirty_ = false;  // worker thread (also written under mu_)
  // The cause of a due version that reports a rejected batch ("frozen: rls:
  // ..."); empty otherwise. Worker thread.
  std::string frozen_cause_;

  // The checkpoint thread's hand-over (one pending capture at most).
  absl::Mutex ckpt_mu_;
  std::optional<CheckpointJob> ckpt_job_ ABSL_GUARDED_BY(ckpt_mu_);
  bool ckpt_busy_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  // No periodic capture before this (steady ms): the rest after a write.
  int64_t ckpt_rest_until_ms_ ABSL_GUARDED_BY(ckpt_mu_) = 0;
  bool ckpt_stop_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  bool ckpt_drain_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  bool ckpt_failed_local_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  bool ckpt_failed_fleet_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  // How long the last local checkpoint took (P copy and write), ns.
  int64_t last_local_write_ns_ ABSL_GUARDED_BY(ckpt_mu_) = 0;
  std::thread ckpt_thread_;

  // Worker thread only.
  natsSubscription* sub_ = nullptr;
  // Messages of this readout's consumer not yet taken after the last batch
  // read (held here or still on the server).
  uint64_t backlog_ = 0;
  uint64_t pos_ = 0;  // sequence of the last message taken
  // A message other than an EXPORT was taken since the last ApplyBatch.
  bool moved_ = false;
  // Messages taken (pos_ moved, rows perhaps in batch_u_) and not yet
  // applied: fleet_seq_ still excludes them.
  bool deferred_ = false;
  std::vector<float> batch_u_;
  std::vector<double> batch_y_;
  std::vector<uint64_t> batch_seq_;
  std::unordered_set<std::string> seen_;
  std::deque<std::string> seen_order_;
  int64_t last_publish_ms_ = 0;
  int64_t last_quality_put_ms_ = 0;
  kvStore* config_kv_ = nullptr;  // CONFIG, for quality.<readout>
  int64_t last_fleet_ckpt_ms_ = 0;
  int64_t last_local_ckpt_ms_ = 0;
  uint64_t fleet_captured_seq_ = 0;  // fleet_seq of the last capture handed over
  uint64_t local_captured_seq_ = 0;
  // The apply time (ns) of the rows applied since the last local capture.
  int64_t apply_ns_since_local_ = 0;
  // At the last local capture: the previous capture's time and the apply
  // time then counted, restored when that capture's write fails.
  int64_t local_ckpt_before_capture_ms_ = 0;
  int64_t apply_ns_at_local_capture_ = 0;
  // Checkpoint thread only (set by LoadState before it starts).
  int32_t checkpoint_chunks_ = 0;
  // The checkpoint subject's last sequence this worker saw (at its start,
  // after its own last checkpoint, or read back when fenced): what its next
  // checkpoint is fenced on. Same threads as checkpoint_chunks_.
  uint64_t ckpt_subject_seq_ = 0;
  // The first sequence of this worker's last checkpoint (0: none this term).
  uint64_t ckpt_prev_first_seq_ = 0;
  // The incarnation the subject's newest message named when last seen (0:
  // none named).
  int64_t ckpt_last_incarnation_ = 0;
  std::optional<storage::ReadoutMeta> local_meta_;
  std::optional<storage::ReadoutMeta> stale_local_meta_;
  // Worker start and checkpoint thread (never at the same time).
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
  // What a clean stop writes waits at most twice the lease (at least 1 s).
  jsCtx* short_js = nullptr;
  jo.Wait = std::clamp<int64_t>(2 * options.lease_ms, 1000, 10000);
  if (natsStatus st = natsConnection_JetStream(&short_js, nc, &jo); st != NATS_OK) {
    kvStore_Destroy(kv);
    jsCtx_Destroy(js);
    return NatsFailure("JetStream context", st);
  }

  std::map<std::string, storage::RecoveredReadout> local;
  if (options.local_store != nullptr) {
    absl::StatusOr<storage::RecoveredState> loaded = options.local_store->Load();
    if (!loaded.ok()) {
      kvStore_Destroy(kv);
      jsCtx_Destroy(short_js);
      jsCtx_Destroy(js);
      return loaded.status();
    }
    for (storage::RecoveredReadout& r : loaded->readouts) {
      std::string name = r.meta.name;
      local[name] = std::move(r);
    }
  }
  std::unique_ptr<Trainer> t(new Trainer(nc, js, short_js, kv, std::move(options)));
  {
    absl::MutexLock lock(&t->mu_);
    t->local_ = std::move(local);
  }
  t->lease_thread_ = std::thread([p = t.get()] { p->LeaseLoop(); });
  NameThread(t->lease_thread_, "leap-lease");
  return t;
}

Trainer::Trainer(natsConnection* nc, jsCtx* js, jsCtx* short_js, kvStore* kv,
                 TrainerOptions options)
    : nc_(nc), js_(js), short_js_(short_js), kv_(kv), options_(std::move(options)) {
  if (options_.registry != nullptr) {
    families_ = std::make_unique<Families>(*options_.registry);
  }
}

Trainer::~Trainer() {
  StopAll(/*final_checkpoint=*/true, /*release=*/true);
  kvStore_Destroy(kv_);
  jsCtx_Destroy(short_js_);
  jsCtx_Destroy(js_);
}

void Trainer::StopAll(bool final_checkpoint, bool release) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    stop_ = true;
  }
  // The workers' final checkpoints run while the lease thread ends (it may
  // be in a renewal, at most the lease time).
  const bool was_leader = leader_.load();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, w] : workers_) {
      if (!final_checkpoint) w->abandoned_ = true;
      w->Stop(final_checkpoint && was_leader);
    }
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  if (was_leader && release && FenceOk() && Connected()) {
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

bool Trainer::Connected() const {
  return natsConnection_Status(nc_) == NATS_CONN_STATUS_CONNECTED;
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
      // Deleted (or created again): this incarnation is not current any
      // more, so no last version and no last checkpoint of it (a version
      // would reach the members of a re-created readout, a STATE checkpoint
      // its trainer's start).
      it->second->Stop(/*final_checkpoint=*/false);
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

std::optional<FleetQuality> Trainer::Quality(const std::string& readout) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(readout);
  if (it == workers_.end()) return std::nullopt;
  return it->second->QualitySummary();
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
  bool skipped = false;  // the last turn made no call: wait a claim period
  for (;;) {
    const int64_t wait = !skipped && leader_.load()
                             ? last_renew_ms_.load() + renew_every - SteadyMs()
                             : claim_every;
    skipped = false;
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping),
                           absl::Milliseconds(std::max<int64_t>(wait, 0)));
      if (stop_) return;
    }
    // No lease call while the connection is down: each would wait for its
    // timeout (and hold up a stop). A leader stops training at once, as
    // after a failed renewal.
    if (!Connected()) {
      skipped = true;
      if (leader_.load()) {
        std::fprintf(stderr,
                     "leapd: fleet trainer: %s lost the trainer lease (NATS "
                     "connection down); training stopped\n",
                     options_.member.c_str());
        if (families_ != nullptr) families_->lease_lost.Increment();
        Demote(/*final_checkpoint=*/false);
        if (options_.on_role) options_.on_role(false);
      }
      continue;
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
    if (pause_renewals_.load()) {
      skipped = true;
      continue;
    }
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
      if (stop_) return;  // StopAll has stopped them for good
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
