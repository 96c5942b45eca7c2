// The member side of fleet mode (leapd --fleet, docs/FLEET.md): every leapd
// of a fleet runs one FleetMember. It owns the NATS connection and
//  - publishes each learnable completion, already in the local outbox (the
//    readout's feedback log), to leap.<fleet>.fb.<readout>.c with a message id
//    that is the same on every member, and answers the Core with the stream
//    sequence once JetStream acknowledged it (UNAVAILABLE while it cannot);
//    outbox records not yet confirmed are republished at start and after a
//    reconnect;
//  - watches leap.<fleet>.ver.> and installs every FleetVersion into the
//    local (serving-only) LiveReadout, which rescores live requests;
//  - watches the CONFIG bucket: readouts and routes created or deleted on
//    any member are applied here;
//  - forwards fleet-wide admin operations: readouts and routes to CONFIG,
//    snapshot/rollback/freeze/resume as FleetControl messages, waiting for
//    the FleetVersion that answers them;
//  - reports degraded (NATS unreachable), the trainer's id and its role.
// The trainer (sidecar/fleet/trainer.h) plugs in through ReadoutsListener,
// SetRole and nats().
#ifndef LEAP_SIDECAR_FLEET_MEMBER_H_
#define LEAP_SIDECAR_FLEET_MEMBER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "readout/artifact.h"
#include "sidecar/core/core.h"
#include "sidecar/core/fleet_link.h"
#include "sidecar/fleet/nats_client.h"
#include "storage/state_store.h"

namespace leap::fleet {

struct FleetMemberOptions {
  NatsClientOptions nats;
  std::string fleet;   // --fleet_name
  std::string member;  // --fleet_member
  // JetStream replicas of the streams and buckets this member creates when
  // they do not exist. Default: 1
  int replicas = 1;
  // TTL of the LEASE bucket (created here when absent). Default: 2000 ms
  int64_t lease_ms = 2000;
  // How long a snapshot/rollback/freeze waits for the trainer's answer.
  // Default: 10 s
  int64_t op_timeout_ms = 10'000;
  // JetStream de-duplication window of FEEDBACK. Default: 10 min
  int64_t duplicate_window_ms = 10 * 60 * 1000;
  // Called when degraded changes (from a NATS or request thread; must not
  // block).
  std::function<void(bool degraded)> on_degraded;
  // Tests only: called on the versions thread when a version arrives for a
  // readout this member has not created yet, before it is kept for the
  // CONFIG watcher (which installs it when it creates the readout).
  std::function<void(const std::string& readout)> before_early_version;

  absl::Status Validate() const;
};

// A readout as the fleet's CONFIG declares it (what the trainer learns).
struct FleetReadoutEntry {
  std::string name;
  readout::ReadoutSpec spec;
  readout::Standardizer standardizer;
  int64_t created_unix_ms = 0;
};

// Writes the creation state (theta, P, with fleet_seq) of a readout into
// the STATE stream as checkpoint "create" (the trainer's format; set by
// leapd when the trainer library is linked).
using CreateStateWriter = std::function<absl::Status(
    NatsClient& nats, const std::string& readout,
    const readout::ReadoutState& state, uint64_t fleet_seq)>;

class FleetMember : public sidecar::FleetLink {
 public:
  // Connects (in the background when no server answers yet); registers the
  // fleet metrics in core->metrics(). Nothing else happens before Start.
  static absl::StatusOr<std::unique_ptr<FleetMember>> Create(
      sidecar::Core* core, FleetMemberOptions options);
  ~FleetMember() override;

  // Creates the fleet's streams and buckets if absent, starts the CONFIG,
  // VERSIONS and LEASE watchers and republishes `outbox` (log records left
  // in the local store, by readout name). Waits up to `wait_ms` for NATS and
  // the first CONFIG pass (readouts, routes, newest versions); when NATS is
  // not reachable by then it returns OK and goes on in the background,
  // degraded (predictions are served from the local state).
  absl::Status Start(
      std::map<std::string, std::vector<storage::LogRecord>> outbox,
      int64_t wait_ms);
  // Stops the watchers (the Core is left as it is). Idempotent.
  void Stop();

  NatsClient& nats() { return *nats_; }
  const FleetMemberOptions& options() const { return options_; }
  // Set before Start: writes a new readout's creation state into STATE.
  void SetCreateStateWriter(CreateStateWriter w) { create_state_ = std::move(w); }
  // Called with the full list after every CONFIG change (and once after
  // the first pass), from the CONFIG watcher thread.
  void SetReadoutsListener(
      std::function<void(const std::vector<FleetReadoutEntry>&)> l);
  // The trainer says whether this member holds the lease.
  void SetRole(bool trainer);
  bool ready() const { return ready_.load(); }
  bool degraded() const { return degraded_.load(); }

  // sidecar::FleetLink
  absl::StatusOr<uint64_t> PublishCompletion(
      const sidecar::FleetCompletionRecord& c) override;
  // Pipelined: JetStream's acknowledgement sets `ack` from a nats.c thread.
  void PublishCompletionAsync(
      const sidecar::FleetCompletionRecord& c,
      std::shared_ptr<sidecar::PendingFleetAck> ack) override;
  std::shared_ptr<sidecar::PendingFleetAck> ResolveDuplicate(
      const std::vector<std::string>& dedup_keys) override;
  absl::Status CreateReadout(const std::string& name,
                             readout::ReadoutState state) override;
  absl::Status DeleteReadout(const std::string& name) override;
  absl::Status SetRoute(const sidecar::Route& route) override;
  absl::Status DeleteRoute(const std::string& product_line) override;
  absl::StatusOr<storage::SnapshotInfo> Snapshot(
      const std::string& readout, const std::string& label) override;
  absl::StatusOr<int64_t> Rollback(const std::string& readout,
                                   const std::string& label) override;
  absl::Status SetFrozen(const std::string& readout, bool frozen) override;
  absl::StatusOr<std::vector<storage::SnapshotInfo>> ListSnapshots(
      const std::string& readout) override;
  // Asks the trainer: an EXPORT operation, answered by the complete state
  // (theta, P) on STATE subject leap.<fleet>.ckpt.<readout>.export.<op id>
  // (read back, then purged) and no version.
  absl::StatusOr<readout::ReadoutState> ExportState(
      const std::string& readout) override;
  sidecar::FleetStatus Status() const override;
  // The newest quality.<readout> the trainer published in CONFIG, for the
  // readout's current incarnation.
  std::optional<sidecar::FleetQualityView> Quality(
      const std::string& readout) const override;

  // The JetStream message id of a completion: the same on every member for
  // the same (readout, request, features, target).
  static std::string MessageId(absl::string_view readout,
                               absl::string_view request_id, int dtype,
                               absl::string_view features, double target);

 private:
  struct Pending {
    std::string readout;
    uint64_t local_seq = 0;
    std::string subject, msg_id, payload;
    std::vector<std::string> dedup_keys;  // empty for recovered records
    // The acknowledgement of its asynchronous publish (PublishCompletionAsync
    // or the publish of a resend), null when none was started: a resend
    // while it is not set shares it.
    std::shared_ptr<sidecar::PendingFleetAck> inflight;
  };
  struct Known {
    std::string readout;
    uint64_t local_seq = 0;
    uint64_t fleet_seq = 0;  // 0 while unconfirmed
  };
  struct OpResult {
    int64_t version = 0;
    int64_t completions_learned = 0;
    int64_t unix_ms = 0;
    std::string cause;
  };

  FleetMember(sidecar::Core* core, FleetMemberOptions options);
  void OnConnection(bool connected);
  void SetDegraded(bool degraded, const std::string& reason);
  void MaintainLoop();
  absl::Status SetUp();
  // Records a completion as pending (outbox record not yet confirmed).
  Pending Register(const sidecar::FleetCompletionRecord& c,
                   std::shared_ptr<sidecar::PendingFleetAck> inflight = nullptr);
  // Publishes `p` asynchronously; `ack` is set with the outcome.
  void PublishPendingAsync(std::shared_ptr<const Pending> p,
                           std::shared_ptr<sidecar::PendingFleetAck> ack);
  absl::StatusOr<uint64_t> PublishPending(const Pending& p);
  // The bookkeeping of a publish's result (metrics, degraded, Confirm).
  absl::StatusOr<uint64_t> Published(const Pending& p,
                                     const absl::StatusOr<PublishResult>& r);
  void Confirm(const Pending& p, uint64_t seq);
  void PruneOutboxes();
  void OnVersion(const StreamMsg& m);
  void InstallVersionMsg(const std::string& readout, const std::string& data);
  // Takes the kept early versions of `readout` out of early_versions_ and
  // installs those of incarnation `created_unix_ms` (or of none named);
  // those of other incarnations are dropped.
  void InstallEarlyVersions(const std::string& readout, int64_t created_unix_ms);
  void OnConfig(const KvEntry& e);
  void OnConfigInitialDone();
  void OnLease(const KvEntry& e);
  void NotifyReadouts();
  absl::StatusOr<OpResult> RunControl(const std::string& readout, int op,
                                      const std::string& label);

  sidecar::Core* const core_;
  const FleetMemberOptions options_;
  std::unique_ptr<NatsClient> nats_;
  CreateStateWriter create_state_;

  std::atomic<bool> degraded_{true};
  std::atomic<bool> ready_{false};
  std::atomic<bool> trainer_role_{false};
  std::atomic<uint64_t> last_fleet_seq_{0};

  // Metrics (owned by the Core's registry).
  prometheus::Gauge* g_degraded_ = nullptr;
  prometheus::Gauge* g_trainer_ = nullptr;
  prometheus::Gauge* g_unconfirmed_ = nullptr;
  prometheus::Gauge* g_last_seq_ = nullptr;
  prometheus::Counter* c_published_ = nullptr;
  prometheus::Counter* c_duplicates_ = nullptr;
  prometheus::Counter* c_publish_errors_ = nullptr;
  prometheus::Counter* c_versions_ = nullptr;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool set_up_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::string degraded_reason_ ABSL_GUARDED_BY(mu_);
  std::string trainer_ ABSL_GUARDED_BY(mu_);
  // Outbox records not yet confirmed, by (readout, local seq).
  std::map<std::pair<std::string, uint64_t>, Pending> pending_
      ABSL_GUARDED_BY(mu_);
  // Dedup key -> record (bounded, oldest dropped first).
  std::unordered_map<std::string, Known> known_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> known_order_ ABSL_GUARDED_BY(mu_);
  // Per readout: highest local seq seen, and the last one pruned.
  std::map<std::string, uint64_t> max_local_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> pruned_ ABSL_GUARDED_BY(mu_);
  // Versions that arrived before their readout's CONFIG entry: per readout
  // name, the newest one of each incarnation they name (FleetVersion
  // created_unix_ms; 0 = not named). A readout's name outlives its
  // incarnations: a version of a deleted one can arrive after the delete.
  std::map<std::string, std::map<int64_t, std::string>> early_versions_
      ABSL_GUARDED_BY(mu_);
  // op_id -> answer.
  std::map<std::string, OpResult> ops_ ABSL_GUARDED_BY(mu_);
  // CONFIG readouts as last seen (name -> entry).
  std::map<std::string, FleetReadoutEntry> config_ ABSL_GUARDED_BY(mu_);
  bool config_initial_done_ ABSL_GUARDED_BY(mu_) = false;
  // CONFIG quality.<readout> as last seen: (created_unix_ms, summary).
  std::map<std::string, std::pair<int64_t, sidecar::FleetQualityView>> quality_
      ABSL_GUARDED_BY(mu_);
  std::function<void(const std::vector<FleetReadoutEntry>&)> readouts_listener_
      ABSL_GUARDED_BY(mu_);

  std::unique_ptr<KvBucket> config_kv_;
  std::unique_ptr<KvBucket> lease_kv_;
  std::unique_ptr<KvWatcher> config_watch_;
  std::unique_ptr<KvWatcher> lease_watch_;
  std::unique_ptr<Subscription> versions_sub_;
  std::thread maintainer_;
};

}  // namespace leap::fleet

#endif  // LEAP_SIDECAR_FLEET_MEMBER_H_
