#include "sidecar/core/live_readout.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/thread.h"

namespace leap::sidecar {
namespace {

// True when an augmented row and its target can enter an RLS update.
bool FiniteRow(const float* u, int64_t n, double y) {
  if (!std::isfinite(y)) return false;
  for (int64_t j = 0; j < n; ++j) {
    if (!std::isfinite(u[j])) return false;
  }
  return true;
}

// Quality windows of this many recent versions are kept.
constexpr size_t kVersionWindows = 64;

}  // namespace

void PublishHub::Subscribe(std::weak_ptr<PublishListener> l) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(l));
}

void PublishHub::Notify(const std::string& readout,
                        const std::shared_ptr<const PublishedVersion>& v) {
  std::vector<std::shared_ptr<PublishListener>> live;
  {
    absl::MutexLock lock(&mu_);
    size_t keep = 0;
    for (auto& w : listeners_) {
      if (auto l = w.lock()) {
        live.push_back(std::move(l));
        listeners_[keep++] = w;
      }
    }
    listeners_.resize(keep);
  }
  for (auto& l : live) l->OnPublish(readout, v);
}

absl::Status LiveReadoutOptions::Validate() const {
  if (rls_batch < 1 || rls_batch > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("rls_batch must be in [1, 4096], got ", rls_batch));
  }
  if (rls_batch_max < 1 || rls_batch_max > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rls_batch_max must be in [1, 4096], got ", rls_batch_max));
  }
  if (rls_threads < 0 || rls_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rls_threads must be in [0, 1024] (0: the available cores), got ",
        rls_threads));
  }
  if (flush_after_ns <= 0) {
    return absl::InvalidArgumentError("flush_after must be > 0");
  }
  if (quality_window < 2) {
    return absl::InvalidArgumentError("quality_window must be >= 2");
  }
  if (versions_kept < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("versions_kept must be >= 1, got ", versions_kept));
  }
  return guardrail.Validate(quality_window);
}

namespace {
readout::RlsOptions RlsOptionsOf(const LiveReadoutOptions& o) {
  readout::RlsOptions r;
  r.threads = o.rls_threads;
  return r;
}
}  // namespace

LiveReadout::LiveReadout(LiveReadoutInit init, LiveReadoutOptions options,
                         Metrics* metrics, PublishHub* hub)
    : name_(std::move(init.name)),
      spec_(init.state.spec),
      standardizer_(init.state.standardizer),
      options_(options),
      adaptive_(init.state.p.has_value() && !options.serving_only),
      cold_(init.cold),
      created_unix_ms_(init.meta.created_unix_ms > 0 ? init.meta.created_unix_ms
                                                     : UnixMs()),
      metrics_owner_(metrics),
      metrics_(metrics->ForReadout(name_)),
      hub_(hub),
      frozen_(init.frozen ||
              (!init.state.p.has_value() && !options.serving_only)),
      learned_(init.state.completions_learned),
      version_(std::max<int64_t>(init.state.version, 1)),
      store_(init.store),
      meta_(init.meta),
      next_seq_(init.last_seq + 1),
      overall_(options.quality_window),
      history_(options.quality_kept, options.quality_window) {
  if (frozen_.load()) frozen_reason_ = init.frozen_reason;
  {
    absl::MutexLock lock(&state_mu_);
    theta_ = init.state.theta;
    applied_seq_ = init.last_seq;
    last_ckpt_ns_ = NowNs();
    if (adaptive_) {
      rls_.emplace(init.state.theta, std::move(*init.state.p),
                   RlsOptionsOf(options_));
    }
    auto v = std::make_shared<PublishedVersion>(PublishedVersion{
        version_.load(),
        readout::FoldedReadout::Fold(standardizer_, theta_, spec_.max_tokens),
        learned_.load(), UnixMs(), init.cause});
    current_.store(v);
    absl::MutexLock qlock(&quality_mu_);
    // The recorded history as it was (a recovered readout starts at one of
    // its versions and publishes nothing new for it).
    bool listed = false;
    for (const storage::VersionEntry& h : init.history) {
      if (!listed && h.version > v->version) {
        versions_.push_back({v->version, v->completions_learned,
                             v->published_unix_ms, v->cause, NAN, 0});
        listed = true;
      }
      if (h.version == v->version) listed = true;
      versions_.push_back({h.version, h.completions_learned, h.unix_ms, h.cause,
                           NAN, 0});
    }
    if (!listed) {
      versions_.push_back({v->version, v->completions_learned,
                           v->published_unix_ms, v->cause, NAN, 0});
    }
    while (static_cast<int64_t>(versions_.size()) > options_.versions_kept) {
      versions_.pop_front();
    }
  }
  metrics_.version->Set(static_cast<double>(version_.load()));
  metrics_.frozen->Set(frozen_.load() ? 1 : 0);
  metrics_.spearman->Set(NAN);
  RestoreQuality();
  if (options_.guardrail.enabled() && adaptive_) {
    guardrail_ = std::make_unique<ReadoutGuardrail>(
        options_.guardrail, options_.quality_window,
        ReadoutGuardrail::Series{metrics_.guardrail_state,
                                 metrics_.guardrail_trips_freeze,
                                 metrics_.guardrail_trips_rollback},
        frozen_.load() && frozen_reason_.rfind("guardrail:", 0) == 0);
    if (absl::StatusOr<std::vector<storage::SnapshotInfo>> snaps =
            ListSnapshots();
        snaps.ok()) {
      guardrail_->OnSnapshots(*snaps);
    }
  }
  if (adaptive_) {
    worker_ = std::thread([this] { WorkerLoop(); });
    NameThread(worker_, "leap-rls");  // the RLS helpers it starts inherit it
  }
  if (store_ != nullptr && adaptive_) {
    checkpointer_ = std::thread([this] { CheckpointLoop(); });
    NameThread(checkpointer_, "leap-ckpt");
  }
}

LiveReadout::~LiveReadout() {
  Stop(/*drain=*/false);
  metrics_owner_->RemoveReadout(name_, metrics_);
}

std::string LiveReadout::frozen_reason() const {
  absl::MutexLock lock(&mu_);
  return frozen_.load() ? frozen_reason_ : std::string();
}

absl::Status LiveReadout::SetFrozen(bool frozen, const std::string& reason) {
  absl::MutexLock admin(&admin_mu_);
  return SetFrozenLocked(frozen, reason);
}

absl::Status LiveReadout::SetFrozenLocked(bool frozen,
                                          const std::string& reason) {
  if (!frozen && !adaptive_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "readout '", name_,
        "' has no P matrix and cannot adapt; import an artifact with P"));
  }
  absl::Status persisted = absl::OkStatus();
  {
    absl::MutexLock order(&freeze_mu_);
    if (store_ != nullptr) {
      persisted = store_->SetFrozen(meta_, frozen, reason);
      // A resume that cannot be persisted is not done (a restart would come
      // back frozen). A freeze is the safe direction: it holds in memory
      // even when persisting it failed, and the error is returned.
      if (!persisted.ok() && !frozen) return persisted;
    }
    absl::MutexLock lock(&mu_);
    frozen_.store(frozen);
    frozen_reason_ = frozen ? reason : "";
    metrics_.frozen->Set(frozen ? 1 : 0);
    // Resumed before the RLS thread acted on a guardrail trip: the resume
    // is the later decision, the trip's action is dropped.
    if (!frozen) pending_trip_.reset();
  }
  if (!frozen && guardrail_ != nullptr) guardrail_->Rearm();
  absl::MutexLock lock(&mu_);
  if (frozen) {
    // Immediate: once this returns no batch is applied (and no version
    // published) until resumed; queued completions wait, they are not lost.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !in_flight_ || stop_;
    };
    mu_.Await(absl::Condition(&idle));
  }
  return persisted;
}

void LiveReadout::Enqueue(const readout::FeatureView& x, double target,
                          uint64_t seq) {
  Pending p;
  p.u.resize(spec_.dim + 1);
  standardizer_.Augment(x, p.u.data());
  p.y = target;
  p.enqueued_ns = NowNs();
  p.seq = seq;
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(p));
  metrics_.rls_backlog->Set(static_cast<double>(queue_.size()));
}

absl::StatusOr<Learned> LiveReadout::Learn(const Learnable& item) {
  absl::MutexLock lock(&log_mu_);
  Learned out;
  out.seq = next_seq_;
  if (store_ != nullptr) {
    storage::LogRecord rec;
    rec.seq = out.seq;
    rec.request_id = std::string(item.request_id);
    rec.dtype = item.x.dtype;
    rec.features.assign(static_cast<const char*>(item.x.data),
                        item.x.dim * readout::DTypeSize(item.x.dtype));
    rec.target = item.target;
    rec.dedup_keys = item.dedup_keys;
    absl::Status s;
    if (item.dataset != nullptr) {
      absl::StatusOr<storage::DatasetStats> appended =
          absl::UnknownError("dataset record not written");
      s = store_->AppendLogAndDataset(meta_, {&rec, 1}, name_,
                                      std::move(*item.dataset), &appended);
      if (s.ok()) out.dataset = std::move(appended);
    } else {
      s = store_->AppendLog(meta_, {&rec, 1});
    }
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "feedback not recorded (not acknowledged): ", s.message()));
    }
  }
  ++next_seq_;
  // Serving only: the record waits in the log (the outbox) for the fleet.
  if (!options_.serving_only) Enqueue(item.x, item.target, out.seq);
  return out;
}

absl::StatusOr<bool> LiveReadout::InstallVersion(const InstalledVersion& v) {
  if (!options_.serving_only) {
    return absl::FailedPreconditionError(absl::StrCat(
        "readout '", name_, "' learns here; it cannot install versions"));
  }
  if (v.theta.size() != spec_.dim + 1 || !v.theta.allFinite()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "readout '", name_, "' version ", v.version, ": theta has ",
        v.theta.size(), " values (want ", spec_.dim + 1,
        ") or a non-finite one"));
  }
  {
    absl::MutexLock lock(&mu_);
    frozen_.store(v.frozen);
    frozen_reason_.clear();
    metrics_.frozen->Set(v.frozen ? 1 : 0);
  }
  absl::MutexLock lock(&state_mu_);
  if (v.version <= version_.load()) return false;
  auto pv = std::make_shared<PublishedVersion>(PublishedVersion{
      v.version,
      readout::FoldedReadout::Fold(standardizer_, v.theta, spec_.max_tokens),
      v.completions_learned, v.published_unix_ms, v.cause, v.fleet_seq});
  theta_ = v.theta;
  learned_.store(v.completions_learned);
  version_.store(v.version);
  if (store_ != nullptr) {
    storage::VersionEntry entry{v.version, v.completions_learned,
                                v.published_unix_ms, v.cause};
    absl::Status s = store_->PutVersion(meta_, entry, v.theta);
    if (!s.ok()) {
      std::fprintf(stderr, "leapd: readout '%s': version %lld not stored: %s\n",
                   name_.c_str(), static_cast<long long>(v.version),
                   std::string(s.message()).c_str());
    }
  }
  current_.store(pv, std::memory_order_release);
  {
    absl::MutexLock qlock(&quality_mu_);
    // A recovered member starts at its checkpoint's version but lists every
    // version it had stored, newer ones too; the catch-up at start installs
    // one of those again. Each number is listed once, in order: a listed
    // one is replaced, a new one goes in its place.
    const VersionRecord rec{pv->version, pv->completions_learned,
                            pv->published_unix_ms, pv->cause, NAN, 0};
    auto at = versions_.end();
    while (at != versions_.begin() && std::prev(at)->version >= pv->version) {
      --at;
    }
    if (at != versions_.end() && at->version == pv->version) {
      *at = rec;
    } else {
      versions_.insert(at, rec);
    }
    while (static_cast<int64_t>(versions_.size()) > options_.versions_kept) {
      versions_.pop_front();
    }
  }
  metrics_.version->Set(static_cast<double>(pv->version));
  metrics_.publishes->Increment();
  hub_->Notify(name_, pv);
  return true;
}

absl::Status LiveReadout::ConfirmLog(uint64_t seq) {
  if (store_ == nullptr || !options_.serving_only) return absl::OkStatus();
  storage::ReadoutCheckpoint c;
  {
    absl::MutexLock lock(&state_mu_);
    if (seq <= applied_seq_) return absl::OkStatus();
    applied_seq_ = seq;
    c.version = current()->version;
    c.completions_learned = learned_.load();
    c.last_seq = seq;
    c.unix_ms = UnixMs();
    c.theta = theta_;
  }
  return WriteCheckpoint(c);
}

void LiveReadout::Replay(const storage::LogRecord& rec) {
  const int64_t dim =
      static_cast<int64_t>(rec.features.size() / readout::DTypeSize(rec.dtype));
  if (dim != spec_.dim) return;  // checked by the caller; never learned
  absl::MutexLock lock(&log_mu_);
  next_seq_ = std::max(next_seq_, rec.seq + 1);
  Enqueue({rec.features.data(), rec.dtype, dim, 1}, rec.target, rec.seq);
}

void LiveReadout::RecoverLog(std::vector<storage::LogRecord> log,
                             const std::vector<storage::VersionEntry>& history,
                             int64_t max_version,
                             std::vector<std::string>* problems) {
  const int64_t n = spec_.dim + 1;
  size_t pos = 0;
  auto problem = [&](std::string text) {
    problems->push_back(absl::StrCat("readout '", name_, "': ", text));
  };
  if (options_.serving_only) {
    // The records are the outbox of fleet mode: the fleet member republishes
    // them; nothing is learned here.
    absl::MutexLock lock(&log_mu_);
    for (const storage::LogRecord& rec : log) {
      next_seq_ = std::max(next_seq_, rec.seq + 1);
    }
    return;
  }
  if (adaptive_) {  // rls_ is set exactly when adaptive_ (read under state_mu_)
    absl::MutexLock lock(&state_mu_);
    const int64_t start = current()->version;
    const storage::VersionEntry* reached = nullptr;
    int64_t learned = learned_.load();
    std::vector<float> u;
    std::vector<double> y;
    std::vector<size_t> row_at;  // the log index of each finite row
    // Rows of a batch that failed part-way: RlsState::Update applies a
    // batch wider than its fold buffer in pieces, and pieces applied before
    // the failure stay in theta and P. They are counted as learned (and
    // never queued again), like the RLS thread's own partial batches.
    int64_t partial_rows = 0;
    uint64_t partial_seq = 0;
    for (const storage::VersionEntry& h : history) {
      if (h.version <= start) continue;
      if (h.cause != "rls" || !h.has_last_seq || h.last_seq <= applied_seq_) {
        if (pos < log.size()) {
          problem(absl::StrCat("version ", h.version, " (", h.cause,
                               ") has no replayable batch; the log after "
                               "version ",
                               reached != nullptr ? reached->version : start,
                               " is learned as new versions"));
        }
        break;
      }
      size_t end = pos;
      while (end < log.size() && log[end].seq <= h.last_seq) ++end;
      const int64_t k = static_cast<int64_t>(end - pos);
      if (k == 0) {
        problem(absl::StrCat("the log does not hold version ", h.version,
                             "'s batch; the rest is learned as new versions"));
        break;
      }
      u.assign(static_cast<size_t>(k * n), 0.0f);
      y.resize(k);
      row_at.clear();
      bool bad = false;
      int64_t rows = 0;  // the rows the RLS thread applied (finite ones)
      for (int64_t i = 0; i < k; ++i) {
        const storage::LogRecord& rec = log[pos + i];
        const int64_t dim = static_cast<int64_t>(
            rec.features.size() / readout::DTypeSize(rec.dtype));
        if (dim != spec_.dim) {
          bad = true;
          break;
        }
        standardizer_.Augment({rec.features.data(), rec.dtype, dim, 1},
                              u.data() + rows * n);
        y[rows] = rec.target;
        if (FiniteRow(u.data() + rows * n, n, rec.target)) {
          row_at.push_back(pos + i);
          ++rows;
        }
      }
      y.resize(rows);
      if (bad) {
        problem(absl::StrCat("a record of version ", h.version,
                             "'s batch has the wrong width"));
        break;
      }
      if (learned + rows != h.completions_learned) {
        problem(absl::StrCat("the log does not hold version ", h.version,
                             "'s batch; the rest is learned as new versions"));
        break;
      }
      const int64_t before = rls_->updates();
      absl::Status s = rls_->Update(u.data(), n, y);
      if (!s.ok()) {
        // Update leaves the state as it was unless it applied pieces (each
        // piece is all or nothing). Pieces applied are in theta and P now:
        // they must not be queued (and applied) a second time.
        const int64_t applied = rls_->updates() - before;
        if (applied > 0) {
          partial_rows = applied;
          const size_t last = row_at[static_cast<size_t>(applied - 1)];
          partial_seq = log[last].seq;
          pos = last + 1;
        }
        problem(absl::StrCat("replaying version ", h.version, ": ",
                             s.message(),
                             applied > 0
                                 ? absl::StrCat(" (after ", applied,
                                                " of its rows, kept applied "
                                                "and published as a new "
                                                "version)")
                                 : std::string()));
        break;
      }
      applied_seq_ = h.last_seq;
      learned += rows;
      pos = end;
      reached = &h;
    }
    if (partial_rows > 0) {
      // The state is the version reached plus the rows of a partial batch:
      // no number named it before, so it is published under a new one
      // (after every number used), with the log position it includes.
      theta_ = rls_->theta();
      applied_seq_ = partial_seq;
      learned += partial_rows;
      learned_.store(learned);
      version_.store(std::max({version_.load(), max_version,
                               reached != nullptr ? reached->version : 0}));
      PublishLocked(theta_, learned, "rls");
      ++batches_since_ckpt_;
    } else if (reached != nullptr) {
      // Serve exactly the state that had this number: the theta it was
      // published with (replay reproduces P; theta is taken as stored).
      absl::StatusOr<Eigen::VectorXd> stored =
          store_ != nullptr ? store_->GetVersionTheta(meta_, reached->version)
                            : absl::NotFoundError("no store");
      Eigen::VectorXd theta = rls_->theta();
      if (stored.ok() && stored->size() == n) {
        theta = *std::move(stored);
        readout::SymMatrix p = rls_->P();
        rls_.emplace(theta, std::move(p), RlsOptionsOf(options_));
      } else {
        problem(absl::StrCat("version ", reached->version,
                             "'s theta not readable (",
                             stored.status().message(),
                             "); serving the replayed theta"));
      }
      theta_ = theta;
      learned_.store(learned);
      version_.store(reached->version);
      auto v = std::make_shared<PublishedVersion>(PublishedVersion{
          reached->version,
          readout::FoldedReadout::Fold(standardizer_, theta_, spec_.max_tokens),
          learned, reached->unix_ms, reached->cause});
      current_.store(v, std::memory_order_release);
      ++batches_since_ckpt_;
    }
  }
  // New versions never reuse a number that was published before, and new
  // log records never reuse a sequence number (the records replayed above
  // did not pass through Replay, which advances it for the rest).
  if (version_.load() < max_version) version_.store(max_version);
  {
    absl::MutexLock lock(&log_mu_);
    if (!log.empty()) next_seq_ = std::max(next_seq_, log.back().seq + 1);
    absl::MutexLock state_lock(&state_mu_);
    next_seq_ = std::max(next_seq_, applied_seq_ + 1);
  }
  metrics_.version->Set(static_cast<double>(current()->version));
  for (; pos < log.size(); ++pos) Replay(log[pos]);
}

void LiveReadout::RestoreQuality() {
  if (store_ == nullptr) return;
  int64_t total = 0;
  absl::StatusOr<std::vector<storage::QualityPair>> pairs = store_->LoadQuality(
      storage::ReadoutQualitySeries(meta_.incarnation), options_.quality_kept,
      &total);
  if (!pairs.ok()) {
    std::fprintf(stderr, "leapd: readout '%s': quality not restored: %s\n",
                 name_.c_str(), std::string(pairs.status().message()).c_str());
    return;
  }
  absl::MutexLock lock(&quality_mu_);
  history_.Restore(*pairs, total);
  for (const storage::QualityPair& p : *pairs) {
    auto it = per_version_.find(p.version);
    if (it == per_version_.end()) {
      it = per_version_.emplace(p.version, RollingSpearman(options_.quality_window))
               .first;
      while (per_version_.size() > kVersionWindows) {
        per_version_.erase(per_version_.begin());
      }
    }
    it->second.Add(p.predicted, p.truth);
    overall_.Add(p.predicted, p.truth);
  }
  if (!pairs->empty()) {
    metrics_.spearman->Set(overall_.Value());
    metrics_.spearman_samples->Set(static_cast<double>(overall_.size()));
  }
}

std::vector<QualityWindow> LiveReadout::QualityWindows(int64_t limit) const {
  absl::MutexLock lock(&quality_mu_);
  return history_.Windows(limit);
}

std::vector<LabelQuality> LiveReadout::LabelQualities() {
  std::vector<std::pair<int64_t, std::string>> marks;
  if (absl::StatusOr<std::vector<storage::SnapshotInfo>> snaps = ListSnapshots();
      snaps.ok()) {
    for (const storage::SnapshotInfo& s : *snaps) marks.emplace_back(s.version, s.label);
  }
  absl::MutexLock lock(&quality_mu_);
  return history_.Labels(std::move(marks));
}

void LiveReadout::RecordQuality(int64_t version, double predicted_tokens,
                                double true_tokens) {
  const storage::QualityPair pair{version, predicted_tokens, true_tokens,
                                  UnixMs()};
  if (store_ != nullptr) {
    absl::Status s = store_->AppendQuality(
        storage::ReadoutQualitySeries(meta_.incarnation), pair);
    if (!s.ok()) {
      std::fprintf(stderr, "leapd: readout '%s': quality pair not stored: %s\n",
                   name_.c_str(), std::string(s.message()).c_str());
    }
  }
  {
    absl::MutexLock lock(&quality_mu_);
    history_.Add(pair);
    auto it = per_version_.find(version);
    if (it == per_version_.end()) {
      it = per_version_.emplace(version, RollingSpearman(options_.quality_window))
               .first;
      while (per_version_.size() > kVersionWindows) {
        per_version_.erase(per_version_.begin());
      }
    }
    it->second.Add(predicted_tokens, true_tokens);
    overall_.Add(predicted_tokens, true_tokens);
    metrics_.spearman->Set(overall_.Value());
    metrics_.spearman_samples->Set(static_cast<double>(overall_.size()));
  }
  // Judged only while learning: its actions stop and undo learning.
  if (guardrail_ != nullptr && !frozen_.load()) {
    std::optional<GuardrailTrip> trip =
        guardrail_->Observe(predicted_tokens, true_tokens);
    if (trip.has_value()) {
      // Frozen in memory at once (the RLS thread starts no batch after
      // this); persisting it and the rollback are the RLS thread's
      // (ActOnTrip): a completion never waits for a store write, a batch in
      // flight or a checkpoint.
      absl::MutexLock lock(&mu_);
      frozen_.store(true);
      frozen_reason_ = trip->reason;
      metrics_.frozen->Set(1);
      pending_trip_ = std::move(trip);
    }
  }
}

void LiveReadout::ActOnTrip() {
  absl::MutexLock admin(&admin_mu_);
  GuardrailTrip trip;
  {
    absl::MutexLock lock(&mu_);
    if (!pending_trip_.has_value()) return;  // resumed since, or none
    trip = *pending_trip_;
  }
  std::string done;
  GuardrailAction applied = GuardrailAction::kFreeze;
  absl::Status frozen = SetFrozenLocked(true, trip.reason);
  if (!frozen.ok()) {
    // In memory it is frozen all the same; only persisting failed.
    done = absl::StrCat("learning frozen (not persisted: ", frozen.message(),
                        ")");
  } else {
    done = "learning frozen";
  }
  if (guardrail_->action() == GuardrailAction::kRollback) {
    if (!trip.last_good.has_value()) {
      absl::StrAppend(&done, "; no good snapshot to roll back to");
    } else {
      absl::StatusOr<int64_t> v = RollbackLocked(trip.last_good->label);
      if (v.ok()) {
        applied = GuardrailAction::kRollback;
        absl::StrAppend(
            &done, absl::StrFormat(
                       "; rolled back to snapshot '%s' (spearman %.3f over %d) "
                       "as version %d",
                       trip.last_good->label, trip.last_good->spearman,
                       trip.last_good->spearman_n, *v));
      } else {
        absl::StrAppend(&done, "; rollback to snapshot '",
                        trip.last_good->label,
                        "' failed: ", v.status().message());
      }
    }
  }
  std::fprintf(stderr, "leapd: readout '%s': %s; %s\n", name_.c_str(),
               trip.reason.c_str(), done.c_str());
  guardrail_->TripDone(trip, done, applied);
  absl::MutexLock lock(&mu_);
  pending_trip_.reset();
}

GuardrailStatus LiveReadout::guardrail() const {
  if (guardrail_ == nullptr) return GuardrailStatus{};
  {
    // A trip whose action is under way on the RLS thread is reported once
    // it is done (what it did is part of the status): an admin read waits
    // for it, boundedly; serving never calls this.
    absl::MutexLock lock(&mu_);
    auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_trip_.has_value() || stop_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&settled), absl::Seconds(10));
  }
  return guardrail_->Status(frozen_.load());
}

int64_t LiveReadout::backlog() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size()) + (in_flight_ ? 1 : 0);
}

int64_t LiveReadout::completions_learned() const { return learned_.load(); }

double LiveReadout::spearman(int64_t* n) const {
  absl::MutexLock lock(&quality_mu_);
  if (n != nullptr) *n = overall_.size();
  return overall_.Value();
}

std::vector<VersionRecord> LiveReadout::Versions() const {
  absl::MutexLock lock(&quality_mu_);
  std::vector<VersionRecord> out(versions_.begin(), versions_.end());
  for (VersionRecord& r : out) {
    auto it = per_version_.find(r.version);
    if (it != per_version_.end()) {
      r.spearman = it->second.Value();
      r.spearman_n = it->second.size();
    } else {
      r.spearman = NAN;
      r.spearman_n = 0;
    }
  }
  return out;
}

readout::ReadoutState LiveReadout::Export() {
  readout::ReadoutState s;
  s.spec = spec_;
  s.standardizer = standardizer_;
  absl::MutexLock lock(&state_mu_);
  s.theta = theta_;
  if (rls_.has_value()) s.p = rls_->P();
  s.version = current()->version;
  s.completions_learned = learned_.load();
  s.created_unix_ms = UnixMs();
  return s;
}

storage::ReadoutCheckpoint LiveReadout::CaptureLocked(
    std::shared_ptr<const readout::SymMatrix>* shared_p) {
  storage::ReadoutCheckpoint c;
  c.version = current()->version;
  c.completions_learned = learned_.load();
  c.last_seq = applied_seq_;
  c.unix_ms = UnixMs();
  c.theta = theta_;
  if (rls_.has_value()) {
    if (shared_p != nullptr) {
      *shared_p = rls_->SharedP();
    } else {
      c.p = rls_->P();
    }
  }
  batches_since_ckpt_ = 0;
  last_ckpt_ns_ = NowNs();
  return c;
}

absl::Status LiveReadout::WriteCheckpoint(const storage::ReadoutCheckpoint& c) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = store_->WriteCheckpoint(meta_, c);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!s.ok()) {
    std::fprintf(stderr, "leapd: readout '%s': checkpoint failed: %s\n",
                 name_.c_str(), std::string(s.message()).c_str());
    metrics_.checkpoint_errors->Increment();
    return s;
  }
  metrics_.checkpoint_seconds->Observe(secs);
  metrics_.checkpoint_bytes->Set(
      static_cast<double>(c.theta.size() * 8 + (c.p ? c.p->payload_bytes() : 0)));
  return absl::OkStatus();
}

void LiveReadout::CheckpointLoop() {
  for (;;) {
    storage::ReadoutCheckpoint c;
    std::shared_ptr<const readout::SymMatrix> p;
    {
      absl::MutexLock lock(&ckpt_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ckpt_mu_) {
        return ckpt_stop_ || ckpt_pending_.has_value();
      };
      ckpt_mu_.Await(absl::Condition(&ready));
      if (!ckpt_pending_.has_value()) return;  // stop, nothing pending
      c = std::move(*ckpt_pending_);
      ckpt_pending_.reset();
      p = std::move(ckpt_pending_p_);
      ckpt_busy_ = true;
    }
    if (p != nullptr) {
      c.p = readout::CopySymmetric(*p);  // off the RLS thread
      p.reset();
    }
    WriteCheckpoint(c).IgnoreError();  // counted and logged; the next one retries
    absl::MutexLock lock(&ckpt_mu_);
    ckpt_busy_ = false;
  }
}

absl::StatusOr<storage::SnapshotInfo> LiveReadout::Snapshot(
    const std::string& label) {
  absl::StatusOr<storage::SnapshotInfo> info = TakeSnapshot(label);
  if (info.ok() && guardrail_ != nullptr) {
    // Labels may be replaced: the last good one is recomputed from all.
    if (absl::StatusOr<std::vector<storage::SnapshotInfo>> snaps =
            ListSnapshots();
        snaps.ok()) {
      guardrail_->OnSnapshots(*snaps);
    }
  }
  return info;
}

absl::StatusOr<storage::SnapshotInfo> LiveReadout::TakeSnapshot(
    const std::string& label) {
  if (label.empty() || label.size() > 128 ||
      label.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("snapshot label must be 1-128 bytes, no NUL");
  }
  storage::SnapshotInfo info;
  info.label = label;
  int64_t n = 0;
  info.spearman = spearman(&n);
  info.spearman_n = n;
  info.unix_ms = UnixMs();
  absl::MutexLock lock(&state_mu_);
  storage::ReadoutCheckpoint c;
  c.version = current()->version;
  c.completions_learned = learned_.load();
  c.last_seq = applied_seq_;
  c.unix_ms = info.unix_ms;
  c.theta = theta_;
  if (rls_.has_value()) c.p = rls_->P();
  info.version = c.version;
  info.completions_learned = c.completions_learned;
  if (store_ != nullptr) {
    absl::Status s = store_->PutSnapshot(meta_, info, c);
    if (!s.ok()) return s;
  } else {
    memory_snapshots_[label] = std::move(c);
    memory_snapshot_info_[label] = info;
  }
  return info;
}

absl::StatusOr<std::vector<storage::SnapshotInfo>> LiveReadout::ListSnapshots() {
  if (store_ != nullptr) return store_->ListSnapshots(meta_);
  absl::MutexLock lock(&state_mu_);
  std::vector<storage::SnapshotInfo> out;
  for (const auto& [label, info] : memory_snapshot_info_) out.push_back(info);
  return out;
}

absl::StatusOr<int64_t> LiveReadout::Rollback(const std::string& label) {
  absl::MutexLock admin(&admin_mu_);
  return RollbackLocked(label);
}

absl::StatusOr<int64_t> LiveReadout::RollbackLocked(const std::string& label) {
  storage::ReadoutCheckpoint snap;
  if (store_ != nullptr) {
    absl::StatusOr<storage::ReadoutCheckpoint> s = store_->GetSnapshot(meta_, label);
    if (!s.ok()) return s.status();
    snap = std::move(*s);
  } else {
    absl::MutexLock lock(&state_mu_);
    auto it = memory_snapshots_.find(label);
    if (it == memory_snapshots_.end()) {
      return absl::NotFoundError(absl::StrCat("readout '", name_,
                                              "' has no snapshot '", label, "'"));
    }
    snap = it->second;
  }
  if (snap.theta.size() != spec_.dim + 1 ||
      snap.p.has_value() != adaptive_) {
    return absl::FailedPreconditionError("snapshot does not match the readout");
  }
  // No new completion may be logged while the state is swapped.
  absl::MutexLock log_lock(&log_mu_);
  int64_t dropped = 0;
  uint64_t first_kept = 0;  // seq of the oldest completion kept queued
  {
    absl::MutexLock lock(&mu_);
    if (frozen_.load()) {
      // Frozen (e.g. after an RLS failure): the acknowledged completions
      // stay queued and are applied on top of the snapshot once resumed.
      if (!queue_.empty()) first_kept = queue_.front().seq;
    } else {
      dropped = static_cast<int64_t>(queue_.size());
      queue_.clear();
    }
    metrics_.rls_backlog->Set(0);
    // A batch the worker already took is applied (and published) before
    // the snapshot replaces the state, never on top of it.
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !in_flight_ || stop_;
    };
    mu_.Await(absl::Condition(&idle));
  }
  {
    // A checkpoint captured before the rollback must not be written after
    // it (it would resurrect the pre-rollback state on recovery).
    absl::MutexLock lock(&ckpt_mu_);
    ckpt_pending_.reset();
    ckpt_pending_p_.reset();
    auto written = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(ckpt_mu_) {
      return !ckpt_busy_;
    };
    ckpt_mu_.Await(absl::Condition(&written));
  }
  absl::MutexLock lock(&state_mu_);  // waits for a batch in flight
  theta_ = snap.theta;
  if (snap.p.has_value()) {
    rls_.emplace(snap.theta, std::move(*snap.p), RlsOptionsOf(options_));
  }
  learned_.store(snap.completions_learned);
  // The dropped records are not in it; kept ones are replayed after it.
  applied_seq_ = first_kept > 0 ? first_kept - 1 : next_seq_ - 1;
  PublishLocked(theta_, snap.completions_learned, "rollback:" + label);
  if (store_ != nullptr) {
    // Durable at once: recovery must not replay pre-rollback feedback.
    storage::ReadoutCheckpoint c = CaptureLocked();
    absl::Status written = WriteCheckpoint(c);
    if (!written.ok()) {
      return absl::UnavailableError(absl::StrCat(
          "rollback applied and published but not durable (a restart would "
          "undo it): ", written.message()));
    }
  }
  // An operator's rollback while learning replaces the judged state.
  if (guardrail_ != nullptr && !frozen_.load()) guardrail_->Rearm();
  if (dropped > 0) {
    std::fprintf(stderr,
                 "leapd: readout '%s': rollback to '%s' dropped %lld completions "
                 "not yet applied\n",
                 name_.c_str(), label.c_str(), static_cast<long long>(dropped));
  }
  return current()->version;
}

void LiveReadout::WaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ((queue_.empty() && !in_flight_) || stop_ || !adaptive_ ||
            (frozen_.load() && !in_flight_)) &&
           (!pending_trip_.has_value() || stop_);
  };
  mu_.Await(absl::Condition(&idle));
}

void LiveReadout::Stop(bool drain) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    drain_ = drain;
  }
  if (worker_.joinable()) worker_.join();
  // A trip the RLS thread had no time to act on: its freeze is persisted
  // (and its rollback done) here.
  if (guardrail_ != nullptr) ActOnTrip();
  if (checkpointer_.joinable()) {
    {
      absl::MutexLock lock(&ckpt_mu_);
      ckpt_stop_ = true;
    }
    checkpointer_.join();
    if (drain) {
      // A clean stop leaves an empty log behind: restart is a plain load.
      absl::MutexLock lock(&state_mu_);
      if (batches_since_ckpt_ > 0) {
        storage::ReadoutCheckpoint c = CaptureLocked();
        WriteCheckpoint(c).IgnoreError();  // the log still has everything
      }
    }
  }
}

void LiveReadout::WorkerLoop() {
  const int64_t n = spec_.dim + 1;
  std::vector<float> u;
  std::vector<double> y;
  std::vector<Pending> batch;
  for (;;) {
    batch.clear();
    bool act = false;
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        // A guardrail trip: its action runs here, between batches, so its
        // rollback is published after any batch already applied and before
        // any later one.
        if (pending_trip_.has_value() && !stop_) {
          act = true;
          break;
        }
        const bool paused = frozen_.load();
        if (stop_ && (!drain_ || queue_.empty() || paused)) return;
        if (!paused &&
            (static_cast<int>(queue_.size()) >= options_.rls_batch ||
             (!queue_.empty() && (stop_ || NowNs() - queue_.front().enqueued_ns >=
                                                options_.flush_after_ns)))) {
          break;
        }
        if (queue_.empty() || paused) {
          auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return stop_ || pending_trip_.has_value() ||
                   (!frozen_.load() && !queue_.empty());
          };
          mu_.Await(absl::Condition(&ready));
        } else {
          // A partial batch: wait for more or for its flush deadline.
          const int64_t wait_ns = options_.flush_after_ns -
                                  (NowNs() - queue_.front().enqueued_ns);
          auto full = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return stop_ || pending_trip_.has_value() ||
                   static_cast<int>(queue_.size()) >= options_.rls_batch;
          };
          mu_.AwaitWithTimeout(absl::Condition(&full),
                               absl::Nanoseconds(std::max<int64_t>(wait_ns, 0)));
        }
      }
      if (!act) {
        // Adaptive: whatever queued up behind a batch (a backlog) is applied
        // in one exact batch of up to rls_batch_max; same result, P streamed
        // once instead of once per rls_batch.
        const int k = std::min<int>(
            std::max(options_.rls_batch, options_.rls_batch_max),
            static_cast<int>(queue_.size()));
        for (int i = 0; i < k; ++i) {
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
        in_flight_ = true;
        metrics_.rls_backlog->Set(static_cast<double>(queue_.size()));
      }
    }
    if (act) {
      ActOnTrip();
      continue;
    }
    // A completion whose standardized row or target is not finite can
    // never be applied: it is dropped (logged, counted in rls_errors), so it
    // neither freezes learning nor blocks the ones behind it. Recovery
    // drops the same rows (RecoverLog).
    {
      size_t keep = 0;
      for (size_t i = 0; i < batch.size(); ++i) {
        if (FiniteRow(batch[i].u.data(), n, batch[i].y)) {
          if (keep != i) batch[keep] = std::move(batch[i]);
          ++keep;
          continue;
        }
        std::fprintf(stderr,
                     "leapd: readout '%s': completion (log seq %llu) dropped: "
                     "its standardized features or target are not finite\n",
                     name_.c_str(), static_cast<unsigned long long>(batch[i].seq));
        metrics_.rls_errors->Increment();
      }
      batch.resize(keep);
      if (batch.empty()) {
        absl::MutexLock lock(&mu_);
        in_flight_ = false;
        continue;
      }
    }
    const int64_t k = static_cast<int64_t>(batch.size());
    u.resize(k * n);
    y.resize(k);
    for (int64_t i = 0; i < k; ++i) {
      std::copy(batch[i].u.begin(), batch[i].u.end(), u.begin() + i * n);
      y[i] = batch[i].y;
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s;
    std::optional<storage::ReadoutCheckpoint> ckpt;
    std::shared_ptr<const readout::SymMatrix> ckpt_p;
    int64_t applied = k;
    {
      absl::MutexLock lock(&state_mu_);
      const int64_t before = rls_->updates();
      s = rls_->Update(u.data(), n, y);
      // A batch wider than RLS's fold buffer is applied in pieces: those
      // applied before a failure stay applied (and are published).
      if (!s.ok()) applied = rls_->updates() - before;
      if (applied > 0) {
        theta_ = rls_->theta();
        applied_seq_ = batch[applied - 1].seq;
        const int64_t learned = learned_.fetch_add(applied) + applied;
        metrics_.rls_batch_seconds->Observe(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                .count());
        metrics_.learned->Increment(static_cast<double>(applied));
        PublishLocked(theta_, learned, "rls");
        ++batches_since_ckpt_;
        if (store_ != nullptr &&
            (batches_since_ckpt_ >= options_.checkpoint_every_batches ||
             NowNs() - last_ckpt_ns_ >= options_.checkpoint_every_ns)) {
          ckpt = CaptureLocked(&ckpt_p);
        }
      }
    }
    if (ckpt.has_value()) {
      absl::MutexLock lock(&ckpt_mu_);
      ckpt_pending_ = std::move(ckpt);  // replaces a capture not yet written
      ckpt_pending_p_ = std::move(ckpt_p);
    }
    if (!s.ok()) {
      // Never publish a state that failed: stop adapting (durably, with the
      // reason), keep serving the last good version, and keep the
      // completions not applied at the head of the queue (they are in the
      // log, acknowledged): a resume retries them.
      const std::string reason = absl::StrCat("rls: ", s.message());
      std::fprintf(stderr,
                   "leapd: readout '%s': %s; learning frozen, %lld completions "
                   "kept for when it is resumed\n",
                   name_.c_str(), std::string(s.message()).c_str(),
                   static_cast<long long>(k - applied));
      metrics_.rls_errors->Increment();
      absl::MutexLock order(&freeze_mu_);
      if (store_ != nullptr) {
        absl::Status persisted = store_->SetFrozen(meta_, true, reason);
        if (!persisted.ok()) {
          std::fprintf(stderr,
                       "leapd: readout '%s': freeze not stored (a restart "
                       "retries the batch): %s\n",
                       name_.c_str(), std::string(persisted.message()).c_str());
        }
      }
      absl::MutexLock lock(&mu_);
      frozen_.store(true);
      frozen_reason_ = reason;
      metrics_.frozen->Set(1);
      for (int64_t i = k - 1; i >= applied; --i) {
        queue_.push_front(std::move(batch[i]));
      }
      metrics_.rls_backlog->Set(static_cast<double>(queue_.size()));
      in_flight_ = false;
      continue;
    }
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
  }
}

void LiveReadout::PublishLocked(const Eigen::VectorXd& theta, int64_t learned,
                                const std::string& cause) {
  auto v = std::make_shared<PublishedVersion>(PublishedVersion{
      version_.fetch_add(1) + 1,
      readout::FoldedReadout::Fold(standardizer_, theta, spec_.max_tokens),
      learned, UnixMs(), cause});
  if (store_ != nullptr) {
    // Recorded before anyone can see it, with the log position its state
    // includes: recovery replays the same batches and resumes at a version
    // under the number it had (see RecoverLog).
    storage::VersionEntry entry{v->version, learned, v->published_unix_ms,
                                cause};
    entry.has_last_seq = true;
    entry.last_seq = applied_seq_;
    absl::Status s = store_->PutVersion(meta_, entry, theta);
    if (!s.ok()) {
      std::fprintf(stderr, "leapd: readout '%s': version %lld not stored: %s\n",
                   name_.c_str(), static_cast<long long>(v->version),
                   std::string(s.message()).c_str());
    }
  }
  current_.store(v, std::memory_order_release);
  {
    absl::MutexLock lock(&quality_mu_);
    versions_.push_back({v->version, v->completions_learned,
                         v->published_unix_ms, v->cause, NAN, 0});
    while (static_cast<int64_t>(versions_.size()) > options_.versions_kept) {
      versions_.pop_front();
    }
  }
  metrics_.version->Set(static_cast<double>(v->version));
  metrics_.publishes->Increment();
  hub_->Notify(name_, v);
}

}  // namespace leap::sidecar
