// A readout being served: its published version (read lock-free by the
// predicting threads), its RLS state and the RLS worker thread that learns
// from completions and publishes new versions.
#ifndef LEAP_SIDECAR_CORE_LIVE_READOUT_H_
#define LEAP_SIDECAR_CORE_LIVE_READOUT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "readout/artifact.h"
#include "readout/readout.h"
#include "readout/rls.h"
#include "sidecar/core/guardrail.h"
#include "sidecar/core/metrics.h"
#include "sidecar/core/quality.h"
#include "sidecar/core/quality_history.h"
#include "storage/state_store.h"

namespace leap::sidecar {

// One published version: what predictions use. Immutable.
struct PublishedVersion {
  int64_t version = 0;
  readout::FoldedReadout folded;
  int64_t completions_learned = 0;
  int64_t published_unix_ms = 0;
  std::string cause;  // "create", "rls", ...
  // Fleet mode: every FEEDBACK stream message with sequence <= fleet_seq is
  // in it (0 outside fleet mode).
  uint64_t fleet_seq = 0;
};

// Receives every publish of every readout. OnPublish runs on the publishing
// thread (an RLS worker or an admin handler), with that readout's state_mu_
// held (PublishHub's own lock released): it must not block and must not call
// into a LiveReadout.
class PublishListener {
 public:
  virtual ~PublishListener() = default;
  virtual void OnPublish(const std::string& readout,
                         const std::shared_ptr<const PublishedVersion>& v) = 0;
};

// Fans publishes out to listeners that are still alive. Thread-safe: any
// thread subscribes; Notify calls the listeners after releasing mu_.
class PublishHub {
 public:
  void Subscribe(std::weak_ptr<PublishListener> l);
  void Notify(const std::string& readout,
              const std::shared_ptr<const PublishedVersion>& v);

 private:
  absl::Mutex mu_;
  std::vector<std::weak_ptr<PublishListener>> listeners_ ABSL_GUARDED_BY(mu_);
};

struct LiveReadoutOptions {
  // Completions per RLS batch when learning keeps up. Default: 8
  int rls_batch = 8;
  // With a backlog (more than rls_batch queued) the worker applies up to
  // this many queued completions in one exact batch: P is streamed once for
  // all of them. The result never depends on batch sizes. Default: 256
  int rls_batch_max = 256;
  // Threads of each readout's RLS update and fold; 0 = the cores this
  // process may run on. Results do not depend on it. Default: 0
  int rls_threads = 0;
  // A partial batch is applied once its oldest completion waited this long.
  // Default: 200 ms
  int64_t flush_after_ns = 200'000'000;
  // Pairs in each rolling Spearman window. Default: 1000
  int64_t quality_window = 1000;
  // Version records kept in memory (the oldest are dropped). Default: 10000
  int64_t versions_kept = 10000;
  // (predicted, true) pairs kept per readout for windowed quality, in
  // memory and (with a store) on disk. Default: 100000
  int64_t quality_kept = 100000;
  // With a store: a checkpoint of theta and P is written after this many
  // RLS batches or this much time since the last one, whichever is first.
  // Default: 256 batches, 60 s
  int64_t checkpoint_every_batches = 256;
  int64_t checkpoint_every_ns = int64_t{60} * 1'000'000'000;
  // The online-quality guardrail (off unless a floor or margin is set).
  GuardrailOptions guardrail;
  // Fleet mode (docs/FLEET.md): the readout only serves. No RLS here and no
  // P: Learn records a completion in the feedback log (the member's outbox)
  // and queues nothing; versions arrive through InstallVersion. Default:
  // false
  bool serving_only = false;

  absl::Status Validate() const;
};

// Metadata of one published version, with its online quality.
struct VersionRecord {
  int64_t version = 0;
  int64_t completions_learned = 0;
  int64_t published_unix_ms = 0;
  std::string cause;
  double spearman = 0;  // NaN until 2 pairs
  int64_t spearman_n = 0;
};

// Everything a LiveReadout starts from: a new readout or a recovered one.
struct LiveReadoutInit {
  std::string name;
  readout::ReadoutState state;  // spec, standardizer, theta, P, version...
  bool frozen = false;
  // Why it is frozen when an RLS failure froze it ("" otherwise).
  std::string frozen_reason;
  // Cause recorded for the first published version ("create", "recovered").
  std::string cause = "create";
  // Durable state; null keeps everything in memory.
  storage::StateStore* store = nullptr;
  storage::ReadoutMeta meta;  // incarnation assigned by the store
  // Feedback-log records with seq <= last_seq are already in theta and P.
  uint64_t last_seq = 0;
  // Versions published before (recovered from the store), oldest first.
  std::vector<storage::VersionEntry> history;
  // A bootstrap placeholder (docs/BOOTSTRAP.md): its predictions are
  // flagged cold and it records training data until it is replaced.
  bool cold = false;
};

// A completion to learn.
struct Learnable {
  absl::string_view request_id;
  readout::FeatureView x;  // contiguous
  double target = 0;
  // Recorded in the store's dedup index with the log record.
  std::vector<std::string> dedup_keys;
  // When set and the readout has a store: this dataset record of the
  // readout's name is written (moved from) with the log record, in one
  // durable write (StateStore::AppendLogAndDataset). Learned::dataset says
  // whether it was; untouched when no store write was tried, moved from
  // once one was (even when it failed).
  storage::DatasetRecord* dataset = nullptr;
};

// What Learn wrote.
struct Learned {
  // The record's sequence in the feedback log.
  uint64_t seq = 0;
  // Set exactly when Learnable::dataset was written with the log record:
  // the dataset append's result. Unset (no dataset given, or no store):
  // nothing of it was written, and the caller still holds the record.
  std::optional<absl::StatusOr<storage::DatasetStats>> dataset;
};

// A version learned elsewhere (fleet mode: a FleetVersion) to serve as is.
struct InstalledVersion {
  int64_t version = 0;
  Eigen::VectorXd theta;  // standardized space, d + 1, bias last
  int64_t completions_learned = 0;
  int64_t published_unix_ms = 0;
  std::string cause;
  uint64_t fleet_seq = 0;
  bool frozen = false;
};

// Thread-safe unless stated: gRPC handlers, the shm loop and admin calls may
// call any public method from any thread. It owns two threads: the RLS worker
// (WorkerLoop: applies queued completions, publishes) and the checkpointer
// (CheckpointLoop: writes captured state); Stop and the destructor join them
// and must not be called from them.
class LiveReadout {
 public:
  // Starts the RLS thread when the state has a P matrix (and the checkpoint
  // thread when there is a store).
  LiveReadout(LiveReadoutInit init, LiveReadoutOptions options,
              Metrics* metrics, PublishHub* hub);
  ~LiveReadout();
  LiveReadout(const LiveReadout&) = delete;
  LiveReadout& operator=(const LiveReadout&) = delete;

  const std::string& name() const { return name_; }
  const readout::ReadoutSpec& spec() const { return spec_; }
  // The current version. Lock-free.
  std::shared_ptr<const PublishedVersion> current() const {
    return current_.load(std::memory_order_acquire);
  }
  // True when the readout has P (can learn).
  bool adaptive() const { return adaptive_; }
  // A bootstrap placeholder: predictions are flagged cold.
  bool cold() const { return cold_; }
  bool frozen() const { return frozen_.load(); }
  // Why learning is frozen when leapd froze it (an RLS failure, the quality
  // guardrail); "" when it is not frozen or an operator froze it.
  std::string frozen_reason() const;
  // FailedPrecondition when unfreezing a readout without P. Resuming after
  // an RLS failure retries the completions that were kept queued (a failure
  // that recurs freezes it again, with its reason). Serialized with the RLS
  // thread's own freezes: the flag in memory and in the store always end in
  // the state of whichever happened last. Serialized with Rollback and the
  // guardrail's trip action (admin_mu_): each runs whole, one at a time.
  absl::Status SetFrozen(bool frozen) { return SetFrozen(frozen, ""); }
  // The same, recording (and persisting) why it is frozen.
  absl::Status SetFrozen(bool frozen, const std::string& reason);
  // The guardrail's state ("off" when not configured). While the RLS
  // thread acts on a trip, waits (up to 10 s) until it has, so the status
  // says what the trip did.
  GuardrailStatus guardrail() const;

  // Records one completion durably in the feedback log (when there is a
  // store), then queues it for the RLS thread (standardized here, off that
  // thread). Only after this returns OK may the completion be acknowledged.
  // UNAVAILABLE, writing nothing, when the log write fails.
  absl::StatusOr<Learned> Learn(const Learnable& item);
  // Queues a record recovered from the log (already durable).
  void Replay(const storage::LogRecord& record);
  // Recovery, before the readout serves: replays `log` (the records after
  // the checkpoint it was built from, in seq order) in exactly the batches
  // recorded with the versions in `history`, publishing nothing, and resumes
  // at the newest version so reached with that version's stored theta, so
  // the version number names the same state as before the crash. Records
  // never applied before the crash are queued for the RLS thread; versions
  // published for them are numbered after `max_version`, so no number is
  // reused. Anything it could not replay faithfully goes to `problems`.
  void RecoverLog(std::vector<storage::LogRecord> log,
                  const std::vector<storage::VersionEntry>& history,
                  int64_t max_version, std::vector<std::string>* problems);

  // Serving-only readouts (LiveReadoutOptions::serving_only): serves `v`
  // under its own number and notifies the hub (rescoring, WatchReadout) as
  // a local publish does; records it in the version history (and the
  // store). Returns false, changing nothing, for a version not newer than
  // the current one. INVALID_ARGUMENT for a theta of the wrong size or with
  // a non-finite value; FAILED_PRECONDITION for a readout that learns.
  absl::StatusOr<bool> InstallVersion(const InstalledVersion& v);
  // Serving-only readouts with a store: every log record with seq <= seq is
  // confirmed in the fleet's stream; writes a checkpoint of the served theta
  // (no P) at that position, which prunes them from the log.
  absl::Status ConfirmLog(uint64_t seq);

  // Labels the current state (theta, P, version, quality) for rollback.
  absl::StatusOr<storage::SnapshotInfo> Snapshot(const std::string& label);
  absl::StatusOr<std::vector<storage::SnapshotInfo>> ListSnapshots();
  // Restores a snapshot's theta and P exactly, drops completions not yet
  // applied (unless learning is frozen: then they stay queued and are
  // applied on top of the snapshot once resumed), checkpoints, and publishes
  // it as a new version. Serialized with SetFrozen (see there).
  absl::StatusOr<int64_t> Rollback(const std::string& label);
  const storage::ReadoutMeta& meta() const { return meta_; }
  // Adds a (predicted, true) pair to the windows of `version` and overall.
  // When the pair trips the guardrail, learning is frozen in memory before
  // this returns (no batch starts after it); persisting the freeze and the
  // rollback run on the RLS thread, after any batch already in flight, so
  // the caller (a completion on a serving thread) never waits for them.
  void RecordQuality(int64_t version, double predicted_tokens,
                     double true_tokens);

  // Completions queued and not yet applied.
  int64_t backlog() const;
  int64_t completions_learned() const;
  int64_t created_unix_ms() const { return created_unix_ms_; }
  double spearman(int64_t* n) const;
  std::vector<VersionRecord> Versions() const;
  // Quality over tumbling windows of quality_window completions (the newest
  // `limit`, 0 = all kept), and per snapshot label; restored from the store
  // after a restart.
  std::vector<QualityWindow> QualityWindows(int64_t limit) const;
  std::vector<LabelQuality> LabelQualities();
  ReadoutMetrics& metrics() { return metrics_; }

  // The full state (theta, P, standardization) as of the last applied batch.
  readout::ReadoutState Export();
  // Blocks until every queued completion is applied.
  void WaitIdle();
  // Stops the RLS thread; with `drain`, applies what is queued first.
  void Stop(bool drain);

 private:
  struct Pending {
    std::vector<float> u;
    double y;
    int64_t enqueued_ns;
    uint64_t seq;
  };
  void WorkerLoop();
  // The guardrail's action on a pending trip (the RLS thread, or Stop once
  // it has joined it): persists the freeze and rolls back when configured.
  // Nothing when an operator resumed since the trip.
  void ActOnTrip() ABSL_LOCKS_EXCLUDED(admin_mu_, mu_);
  absl::Status SetFrozenLocked(bool frozen, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_);
  absl::StatusOr<int64_t> RollbackLocked(const std::string& label)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_);
  // Refills the quality windows from the store (construction only).
  void RestoreQuality();
  absl::StatusOr<storage::SnapshotInfo> TakeSnapshot(const std::string& label);
  void CheckpointLoop();
  void Enqueue(const readout::FeatureView& x, double target, uint64_t seq);
  // Publishes theta as the next version. Caller holds state_mu_.
  void PublishLocked(const Eigen::VectorXd& theta, int64_t learned,
                     const std::string& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Copies the state for a checkpoint. Caller holds state_mu_. With
  // `shared_p`, P is not copied into the result: *shared_p gets the RLS
  // state's shared P instead (no mirror, no 64 MiB copy on the RLS thread;
  // the checkpoint thread copies it with readout::CopySymmetric).
  storage::ReadoutCheckpoint CaptureLocked(
      std::shared_ptr<const readout::SymMatrix>* shared_p = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  absl::Status WriteCheckpoint(const storage::ReadoutCheckpoint& c);

  const std::string name_;
  const readout::ReadoutSpec spec_;
  const readout::Standardizer standardizer_;
  const LiveReadoutOptions options_;
  const bool adaptive_;
  const bool cold_;
  const int64_t created_unix_ms_;
  Metrics* const metrics_owner_;
  ReadoutMetrics metrics_;
  PublishHub* const hub_;
  std::atomic<std::shared_ptr<const PublishedVersion>> current_;
  std::atomic<bool> frozen_;

  // Lock order: admin_mu_, freeze_mu_, log_mu_, then any one of mu_,
  // ckpt_mu_, state_mu_; then quality_mu_ (taken under state_mu_ when
  // publishing).
  // Serializes the state-changing admin actions (SetFrozen, Rollback, the
  // guardrail's trip action) end to end, so concurrent ones never
  // interleave (held for their whole duration; never by the RLS thread
  // while a batch is in flight).
  absl::Mutex admin_mu_ ABSL_ACQUIRED_BEFORE(freeze_mu_, log_mu_);
  // Queue, worker control.
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(log_mu_);
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_ ABSL_GUARDED_BY(mu_) = false;
  std::string frozen_reason_ ABSL_GUARDED_BY(mu_);
  // A guardrail trip whose action has not run yet (frozen_ is already set).
  std::optional<GuardrailTrip> pending_trip_ ABSL_GUARDED_BY(mu_);
  // Orders freeze/resume by the operator with freezes by RLS failures
  // (taken before mu_; never held while waiting for the RLS thread).
  absl::Mutex freeze_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  std::atomic<int64_t> learned_;
  std::atomic<int64_t> version_;

  // Durability.
  storage::StateStore* const store_;
  const storage::ReadoutMeta meta_;
  absl::Mutex log_mu_;  // orders seq assignment with the queue
  uint64_t next_seq_ ABSL_GUARDED_BY(log_mu_);

  // RLS state: the worker updates it; Export/Snapshot/Rollback read or
  // replace it. Publishing happens under it, so versions are ordered.
  absl::Mutex state_mu_ ABSL_ACQUIRED_AFTER(log_mu_);
  std::optional<readout::RlsState> rls_ ABSL_GUARDED_BY(state_mu_);
  Eigen::VectorXd theta_ ABSL_GUARDED_BY(state_mu_);
  uint64_t applied_seq_ ABSL_GUARDED_BY(state_mu_) = 0;
  int64_t batches_since_ckpt_ ABSL_GUARDED_BY(state_mu_) = 0;
  int64_t last_ckpt_ns_ ABSL_GUARDED_BY(state_mu_) = 0;
  std::map<std::string, storage::ReadoutCheckpoint> memory_snapshots_
      ABSL_GUARDED_BY(state_mu_);
  std::map<std::string, storage::SnapshotInfo> memory_snapshot_info_
      ABSL_GUARDED_BY(state_mu_);

  // Checkpoint hand-off (one slot: a newer capture replaces a waiting one).
  absl::Mutex ckpt_mu_ ABSL_ACQUIRED_AFTER(log_mu_);
  std::optional<storage::ReadoutCheckpoint> ckpt_pending_
      ABSL_GUARDED_BY(ckpt_mu_);
  // ckpt_pending_'s P, still to be copied (by the checkpoint thread).
  std::shared_ptr<const readout::SymMatrix> ckpt_pending_p_
      ABSL_GUARDED_BY(ckpt_mu_);
  bool ckpt_stop_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  bool ckpt_busy_ ABSL_GUARDED_BY(ckpt_mu_) = false;
  std::thread checkpointer_;

  // Versions and quality.
  mutable absl::Mutex quality_mu_ ABSL_ACQUIRED_AFTER(state_mu_);
  std::deque<VersionRecord> versions_ ABSL_GUARDED_BY(quality_mu_);
  std::map<int64_t, RollingSpearman> per_version_ ABSL_GUARDED_BY(quality_mu_);
  RollingSpearman overall_ ABSL_GUARDED_BY(quality_mu_);
  QualityHistory history_ ABSL_GUARDED_BY(quality_mu_);

  // Null unless configured and the readout can learn.
  std::unique_ptr<ReadoutGuardrail> guardrail_;

  std::thread worker_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_LIVE_READOUT_H_
