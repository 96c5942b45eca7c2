// The sidecar's state and logic, independent of the transport: readouts,
// routing, the live-request cache, learning and online quality. The gRPC
// services (and later the shared-memory server) are thin layers over it.
#ifndef LEAP_SIDECAR_CORE_CORE_H_
#define LEAP_SIDECAR_CORE_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "common/ids.h"
#include "readout/artifact.h"
#include "readout/target.h"
#include "sidecar/core/feature_cache.h"
#include "sidecar/core/fleet_link.h"
#include "sidecar/core/live_readout.h"
#include "sidecar/core/metrics.h"
#include "sidecar/core/prior_table.h"
#include "sidecar/core/quality.h"
#include "sidecar/core/routing.h"
#include "storage/state_store.h"

namespace leap::sidecar {

struct CoreOptions {
  LiveReadoutOptions readout;
  FeatureCacheOptions cache;
  // Largest feature payload of one batch message. Default: 64 MiB
  int64_t max_batch_bytes = int64_t{64} << 20;
  // Longest request id / product line. Default: 256
  int64_t max_id_bytes = static_cast<int64_t>(kMaxIdBytes);
  // With a store: keep the features and true lengths of finished requests
  // (the dataset, docs/STORAGE.md). Default: true
  bool dataset = true;
  // Serve an engine whose Hello.model_id or Hello.layer differs from the
  // metadata of a readout of its width (leapd --allow_hello_mismatch);
  // otherwise such a hello is refused with FAILED_PRECONDITION.
  // Default: false
  bool allow_hello_mismatch = false;
  // With a store: fsync its feedback log (StateStore::SyncLog) before a
  // completion is acknowledged (leapd --sync_log, with the store's own
  // per-append sync off): Complete syncs once per call, or, with
  // defer_log_sync, the caller once for all the completions of a message
  // (SyncFeedbackLog). Default: false (an acknowledged completion survives
  // kill -9 of leapd, not a power loss)
  bool sync_feedback_log = false;

  absl::Status Validate() const;
};

// One request to score.
struct ScoreRequest {
  absl::string_view request_id;
  // The engine instance that owns it (Hello.instance_id); "" = the shared
  // namespace of engines that do not set one. Live requests and dedup are
  // scoped by (instance, request_id).
  absl::string_view instance;
  absl::string_view product_line;
  absl::string_view features;  // little-endian values of dtype
  // When set, holds the same bytes as `features` and Predict takes them by
  // swap instead of copying (the gRPC handler owns its parsed message).
  std::string* owned_features = nullptr;
  // When set, `features` points into `external_slot` of this owner's memory
  // (a shared-memory slot): the live request reads it in place, no copy is
  // made, and the Core guarantees exactly one Release(external_slot).
  std::shared_ptr<ExternalFeatures> external_owner;
  uint32_t external_slot = 0;
  readout::DType dtype = readout::DType::kFloat32;
  int64_t request_max_tokens = 0;
};

// The serving arm's prediction.
struct ScoreResult {
  std::string arm;
  std::string readout;
  int64_t version = 0;
  double predicted_tokens = 0;
  double score = 0;
  // The readout is a bootstrap placeholder (Prediction.cold).
  bool cold = false;
};

// Told of every record appended to a readout's dataset (on the completing
// thread; must not block or call into the Core).
class DatasetObserver {
 public:
  virtual ~DatasetObserver() = default;
  virtual void OnDatasetRecord(const std::string& readout,
                               const storage::DatasetStats& stats) = 0;
};

// What happened to a completion.
struct CompletionOutcome {
  // The serving readout learns it (queued for RLS).
  bool learned = false;
  // "", "cancelled", "censored", "frozen" or "readout_deleted".
  std::string skip_reason;
  // The request was already recorded (a completion resent after a
  // reconnect): acknowledged again, not learned twice.
  bool duplicate = false;
  // Why it counts as a duplicate: "resent" or "resent_not_live" (see
  // Metrics::DuplicateCompletions).
  std::string duplicate_reason;
  // Fleet mode: the FEEDBACK stream sequence of the completion (0 when not
  // published or no longer known).
  uint64_t fleet_seq = 0;
  // Fleet mode with defer_fleet_ack: the serving readout's publish, still
  // in flight (for a duplicate: the publish its outbox record still awaits,
  // FleetLink::ResolveDuplicate). The completion may be acknowledged to the engine only once
  // it is set and OK (its value is then the fleet_seq); an error is the
  // completion's answer (UNAVAILABLE: the engine resends it).
  std::shared_ptr<PendingFleetAck> fleet_ack;
  // A duplicate returned by Complete with defer_log_sync under
  // CoreOptions::sync_feedback_log: counts and logs it as acknowledged; the
  // caller runs it once the log is synced and the completion acknowledged
  // (never when the sync failed). Empty otherwise (Complete did it).
  std::function<void()> announce_duplicate;
};

// Online quality of one (product line, arm).
struct ArmStat {
  std::string product_line, arm, readout;
  bool shadow = false;
  int64_t predictions = 0;
  int64_t completions = 0;
  double spearman = 0;
  int64_t spearman_n = 0;
};

// Thread-safe: gRPC handlers (Predictor, Admin) and the shm loop call it
// from their own threads; admin calls are serialized by admin_mu_, the request
// path (Predict, Complete, Cancel) takes no lock but arms_mu_ and the
// FeatureCache's. Shutdown from one thread, after the servers stopped.
class Core {
 public:
  // `store` (may be null: state in memory only) must outlive the Core.
  Core(CoreOptions options, Metrics* metrics,
       storage::StateStore* store = nullptr);

  // Resumes from durable state: readouts from their newest valid
  // checkpoint and the feedback log after it, replayed in the batches
  // recorded with their versions (publishing nothing: each readout resumes
  // at the version its state had), then the completions acknowledged but
  // not yet applied before the crash (published as new versions); returns
  // once all of it is applied (or a readout is frozen), then installs the
  // routes. Problems are printed as "recovery: ..." lines.
  absl::Status Recover(storage::RecoveredState state);
  // While false the data plane refuses work with UNAVAILABLE ("recovering"):
  // leapd starts serving only after Recover. Default: true
  void SetServing(bool serving) { serving_.store(serving); }
  bool serving() const { return serving_.load(); }
  ~Core();

  PublishHub& hub() { return hub_; }
  // Fleet mode (options().readout.serving_only): learnable completions are
  // published through `fleet` after the local outbox append, and the Admin
  // service forwards fleet-wide operations to it. Set once, before serving;
  // `fleet` must outlive the Core's serving.
  void SetFleet(FleetLink* fleet) { fleet_.store(fleet); }
  FleetLink* fleet() const { return fleet_.load(); }
  const CoreOptions& options() const { return options_; }
  Metrics& metrics() { return *metrics_; }

  // --- readouts
  // ALREADY_EXISTS for a taken name; INVALID_ARGUMENT for a bad name/state.
  absl::Status CreateReadout(const std::string& name,
                             readout::ReadoutState state);
  absl::Status DeleteReadout(const std::string& name);
  // A bootstrap placeholder (docs/BOOTSTRAP.md): frozen, no P, predictions
  // flagged cold; `reason` is its frozen reason ("bootstrap: ...").
  absl::Status CreateColdReadout(const std::string& name,
                                 readout::ReadoutState state,
                                 const std::string& reason);
  // Swaps readout `name` for `state` (a new incarnation in the store): its
  // first version is numbered after the old one's, published with `cause`
  // (engines rescore their live requests); routes keep pointing at `name`.
  // NOT_FOUND for an unknown name, INVALID_ARGUMENT for another width.
  absl::Status ReplaceReadout(const std::string& name,
                              readout::ReadoutState state,
                              const std::string& cause);
  // At most one; null to stop. Set before traffic.
  void SetDatasetObserver(DatasetObserver* o) { dataset_observer_.store(o); }
  absl::StatusOr<std::shared_ptr<LiveReadout>> GetReadout(
      absl::string_view name) const;
  std::vector<std::shared_ptr<LiveReadout>> ListReadouts() const;

  // --- routing
  // INVALID_ARGUMENT for a bad route, NOT_FOUND when an arm names an
  // unknown readout.
  absl::Status SetRoute(Route route);
  absl::Status DeleteRoute(const std::string& product_line);
  std::vector<Route> ListRoutes() const;

  // --- data plane
  // Scores one request with its serving arm (and shadows) and makes it live.
  // `session` owns it (0 = none); the live entry is returned in `live`.
  absl::StatusOr<ScoreResult> Predict(const ScoreRequest& request,
                                      uint64_t session,
                                      std::shared_ptr<LiveRequest>* live);
  // Predict for each request, in order, with one routing snapshot, one
  // cache lock and the rows of each readout scored together (up to four
  // per pass over its weights). results[i] / lives[i] are what Predict
  // would return for requests[i] after the ones before it.
  void PredictBatch(absl::Span<const ScoreRequest> requests, uint64_t session,
                    std::vector<absl::StatusOr<ScoreResult>>* results,
                    std::vector<std::shared_ptr<LiveRequest>>* lives);
  // How a live request ended: learned or skipped by rule. NOT_FOUND
  // (counted) for an unknown id; INVALID_ARGUMENT for bad counts, with the
  // request left live.
  // `instance` is the owning engine instance (see ScoreRequest::instance).
  // With a store, a completion is a duplicate (acknowledged, not learned,
  // counted and logged with its reason) only when it repeats a recorded
  // one within the dedup window: same instance, id, features and outcome
  // ("resent"), or same instance and id while the request is not live
  // ("resent_not_live"). A reused id with new features is learned.
  // Fleet mode: the completion is acknowledged only after JetStream's
  // publish acknowledgement. By default Complete waits for it; with
  // `defer_fleet_ack` it returns with the publish in flight
  // (CompletionOutcome::fleet_ack), so a batch of completions is published
  // in one pipelined round trip and a caller can answer later; a resent
  // duplicate whose record's publish is still in flight (or failed and is
  // published again) returns the same way, with the ack to wait for, and
  // is counted and logged as a duplicate once that ack is OK.
  // With CoreOptions::sync_feedback_log an OK outcome (a duplicate too) is
  // returned only after the store's log was synced (else UNAVAILABLE; a
  // store whose sync failed fails every later one, so the engine's resend
  // is acknowledged, as a duplicate, only after leapd restarts); with
  // `defer_log_sync` the sync is the caller's, who calls SyncFeedbackLog
  // before acknowledging.
  absl::StatusOr<CompletionOutcome> Complete(absl::string_view request_id,
                                             int64_t output_tokens,
                                             readout::FinishReason reason,
                                             absl::string_view instance = "",
                                             bool defer_fleet_ack = false,
                                             bool defer_log_sync = false);
  // With CoreOptions::sync_feedback_log and a store: fsyncs the feedback
  // log (counted in leap_feedback_log_syncs_total); UNAVAILABLE when that
  // fails. Otherwise OK at once.
  absl::Status SyncFeedbackLog();
  // Drops a live request without learning. NOT_FOUND (counted) if unknown.
  absl::Status Cancel(absl::string_view request_id,
                      absl::string_view instance = "");
  // Drops exactly this live request (not another one that took its id
  // since); false when it is no longer live.
  bool CancelExact(const LiveRequest& r);
  // Cancel for each id, under one cache lock; status[i] for ids[i].
  void CancelBatch(absl::Span<const absl::string_view> ids,
                   std::vector<absl::Status>* status,
                   absl::string_view instance = "");

  // --- length priors before prefill (prior_table.h): learned by
  // CompleteWithPrior, served by AnswerPriorQueries / QueryPrior.
  PriorTable& priors() { return priors_; }

  // --- stats
  std::vector<ArmStat> ArmStats() const;
  int64_t unknown_completions() const { return unknown_.load(); }
  const FeatureCache& cache() const { return cache_; }

  // --- snapshots
  absl::StatusOr<storage::SnapshotInfo> Snapshot(const std::string& readout,
                                                 const std::string& label);
  absl::StatusOr<int64_t> Rollback(const std::string& readout,
                                   const std::string& label);
  storage::StateStore* store() const { return store_; }

  // Blocks until every readout applied its queued completions.
  void WaitIdle();
  // Stops every RLS thread (applying queued completions when `drain`).
  void Shutdown(bool drain);

 private:
  using ReadoutMap = std::map<std::string, std::shared_ptr<LiveReadout>,
                              std::less<>>;
  struct ArmState {
    std::string readout;
    bool shadow = false;
    std::atomic<int64_t> predictions{0};
    int64_t completions = 0;  // guarded by arms_mu_
    RollingSpearman window;   // guarded by arms_mu_
    prometheus::Gauge* gauge = nullptr;
    prometheus::Gauge* samples = nullptr;  // completions in `window`
    explicit ArmState(int64_t n) : window(n) {}
  };
  ArmState* Arm(const std::string& product_line, const sidecar::Arm& arm);
  // Complete without the log sync of sync_feedback_log; a duplicate's
  // announcement is left in announce_duplicate when `hold_announcement`.
  absl::StatusOr<CompletionOutcome> CompleteUnsynced(
      absl::string_view request_id, int64_t output_tokens,
      readout::FinishReason reason, absl::string_view instance,
      bool defer_fleet_ack, bool hold_announcement);
  absl::Status CheckRequest(const ScoreRequest& r) const;
  absl::Status CreateReadoutImpl(const std::string& name,
                                 readout::ReadoutState state, bool cold,
                                 const std::string& reason);
  // The dataset record of a finished request (its features and length)
  // when one is to be kept (enabled, the true length known), under the
  // serving readout's name (r.scores[0].readout).
  std::optional<storage::DatasetRecord> DatasetRecordFor(
      const LiveRequest& r, readout::FeatureView x, int64_t output_tokens,
      readout::FinishReason reason);
  // Reports a dataset append's result (a log line, or the observer).
  void DatasetAppended(const std::string& name,
                       const absl::StatusOr<storage::DatasetStats>& st);
  absl::Status InstallRouteLocked(Route route, bool persist)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(admin_mu_);

  const CoreOptions options_;
  Metrics* const metrics_;
  storage::StateStore* const store_;
  PublishHub hub_;
  FeatureCache cache_;

  absl::Mutex admin_mu_;  // serializes writers of readouts_ and routes_

  std::atomic<std::shared_ptr<const ReadoutMap>> readouts_;
  std::atomic<std::shared_ptr<const RoutingTable>> routes_;

  mutable absl::Mutex arms_mu_ ABSL_ACQUIRED_AFTER(admin_mu_);
  std::map<std::pair<std::string, std::string>, std::unique_ptr<ArmState>>
      arms_ ABSL_GUARDED_BY(arms_mu_);

  std::atomic<int64_t> unknown_{0};
  std::atomic<DatasetObserver*> dataset_observer_{nullptr};
  std::atomic<bool> serving_{true};
  std::atomic<FleetLink*> fleet_{nullptr};
  PriorTable priors_;
};

// Engine instance ids (Hello.instance_id): at most 128 bytes, no NUL.
absl::Status ValidateInstanceId(absl::string_view instance);

// A route as JSON (how the store keeps it) and back.
std::string RouteToJson(const Route& r);
absl::StatusOr<Route> RouteFromJson(absl::string_view json);

// Readout names: [A-Za-z0-9._-]{1,64}.
absl::Status ValidateReadoutName(absl::string_view name);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_CORE_H_
