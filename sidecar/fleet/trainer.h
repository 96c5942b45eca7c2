// The trainer of fleet mode (docs/FLEET.md, "Trainer"): the one member of a
// fleet that holds the lease (key `trainer` in KV LEAP_<fleet>_LEASE) learns
// every readout from the fleet's FEEDBACK stream with exact RLS and
// publishes the versions every member serves.
//
// Lease: claimed with create-if-absent, renewed every lease/3 with an update
// on the expected revision; the bucket's TTL (the lease time) removes the key
// of a holder that died. A failed renewal stops training at once. Versions
// are fenced twice: a trainer publishes only within lease time of its last
// successful renewal, and every publish on leap.<fleet>.ver.<readout> carries
// the subject's expected last sequence, so a deposed trainer that wakes up
// cannot publish over its successor.
//
// Learning, per readout: starts from the newest state it can find (in memory
// from an earlier term, the local checkpoint store, the fleet checkpoint in
// STATE, or the creation state "create"), reads leap.<fleet>.fb.<readout>.>
// (completions .c and control operations .ctl) in stream order from that state's
// fleet_seq + 1 with an ordered consumer, applies everything queued (up to
// max_batch completions) as one exact RLS batch, and publishes a FleetVersion
// at most every version_interval_ms (at once for control operations).
#ifndef LEAP_SIDECAR_FLEET_TRAINER_H_
#define LEAP_SIDECAR_FLEET_TRAINER_H_

#include <nats/nats.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/registry.h"
#include "readout/artifact.h"
#include "readout/readout.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/fleet/fleet_state.h"
#include "storage/state_store.h"

namespace leap::fleet {

// A readout the trainer learns: its static configuration (from the fleet's
// CONFIG). Its initial state is read from STATE (checkpoint "create").
struct TrainerReadout {
  std::string name;
  readout::ReadoutSpec spec;
  readout::Standardizer standardizer;
  // Identifies this incarnation of the name: a local checkpoint of another
  // incarnation is never used, nor a STATE checkpoint or snapshot naming
  // another one; its versions and states carry it (FleetVersion and
  // FleetStateChunk created_unix_ms), and a worker whose fenced version
  // publish or STATE checkpoint finds another incarnation on the subject
  // stops without publishing or writing.
  int64_t created_unix_ms = 0;
};

struct TrainerOptions {
  std::string fleet;   // --fleet_name
  std::string member;  // --fleet_member: who trains, in the lease and versions
  // JetStream replicas of what the trainer creates. Default: 1
  int replicas = 1;
  // Lease time (the lease bucket's TTL). Default: 2000 ms
  int64_t lease_ms = 2000;
  // Minimum time between two versions of a readout. Default: 200 ms
  int64_t version_interval_ms = 200;
  // Fleet checkpoint (theta, P, fleet_seq into STATE) period. Default: 30 s
  int64_t checkpoint_every_ms = 30'000;
  // Local checkpoint period (with local_store). Default: 10 s
  int64_t local_checkpoint_every_ms = 10'000;
  // Most completions applied as one RLS batch (everything queued up to it;
  // leapd --rls_batch_max). Default: 256
  int max_batch = 256;
  // Threads of each RLS update and fold (leapd --rls_threads); 0 = the
  // cores this process may run on. Results do not depend on it. Default: 0
  int rls_threads = 0;
  // Pairs in each rolling Spearman window of the fleet-wide quality (leapd
  // --quality_window). Default: 1000
  int64_t quality_window = 1000;
  // The trainer's own checkpoint store (not the member's: its log is
  // unused); null keeps no local checkpoints.
  storage::StateStore* local_store = nullptr;
  // Where the trainer's metrics go; null: none.
  std::shared_ptr<prometheus::Registry> registry;
  // Called on the lease thread when this member becomes (true) or stops
  // being (false) the trainer. Must not call into the Trainer.
  std::function<void(bool)> on_role;

  absl::Status Validate() const;
};

// Writes a new readout's creation state into STATE as checkpoint "create"
// (FleetMember::SetCreateStateWriter): the state every trainer starts from
// when nothing newer exists. fleet_seq is the FEEDBACK position the readout
// starts after.
absl::Status WriteCreateState(jsCtx* js, const std::string& fleet,
                              const std::string& readout,
                              const readout::ReadoutState& state,
                              uint64_t fleet_seq);

// What a readout's trainer has reached (for stats and tests).
struct TrainerReadoutStatus {
  uint64_t fleet_seq = 0;       // every FEEDBACK message <= it is processed
  int64_t completions_learned = 0;
  int64_t last_version = 0;     // last version published (by anyone) seen
  int64_t published = 0;        // versions this trainer published
  uint64_t fleet_checkpoint_seq = 0;  // fleet_seq of its last STATE checkpoint
  uint64_t local_checkpoint_seq = 0;  // fleet_seq of its last local checkpoint
  bool frozen = false;
  // Why it is frozen ("rls: ..." after a rejected batch; empty otherwise).
  std::string frozen_reason;
  // Completions of rejected RLS batches kept (not applied) until learning
  // resumes.
  int64_t kept = 0;
  // Message ids in the duplicate index (rebuilt from the stream at start).
  int64_t remembered_ids = 0;
  // Fleet-wide quality: every completion with sequence <= quality_seq is
  // counted; quality_completions counted in all.
  uint64_t quality_seq = 0;
  int64_t quality_completions = 0;
  bool running = false;
};

// Thread-safe. Owns the lease thread and, while it holds the lease, one
// worker thread per readout.
class Trainer {
 public:
  // `nc` must stay open for the Trainer's life (not owned). Creates the
  // fleet's streams and lease bucket if they do not exist.
  static absl::StatusOr<std::unique_ptr<Trainer>> Start(natsConnection* nc,
                                                        TrainerOptions options);
  // Clean stop: workers write a final checkpoint (local and fleet), then the
  // lease is released so another member takes over at once. Bounded with
  // NATS down: no lease call and nothing written to NATS once the
  // connection is lost, and each write of the stop waits at most twice the
  // lease time.
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The readouts to train (replaces the set; removed ones stop).
  void SetReadouts(std::vector<TrainerReadout> readouts);
  bool leader() const { return leader_.load(); }
  std::optional<TrainerReadoutStatus> Status(const std::string& readout) const;
  // Asks every running worker for a fleet and local checkpoint at its next
  // step (Status().fleet_checkpoint_seq tells when it is written).
  void RequestCheckpoint();
  // The state a worker holds (theta, P, fleet_seq), after its last batch.
  absl::StatusOr<FleetState> ExportState(const std::string& readout);
  // The fleet-wide quality a worker counted (without pairs), as it would
  // publish it now.
  std::optional<leap::v1::fleet::FleetQuality> Quality(const std::string& readout) const;

  // Crash stand-in (tests): stops every thread with no checkpoint and no
  // lease release; the destructor then does nothing more.
  void Abandon();
  // Tests: stop (true) or restart renewing the lease while workers go on,
  // as a paused process would; with the time fence off a worker publishes
  // whenever it believes it leads (only the sequence fence stops it).
  void TestPauseRenewals(bool paused) { pause_renewals_.store(paused); }
  void TestDisableTimeFence() { time_fence_.store(false); }

 private:
  class Worker;
  struct Families;
  Trainer(natsConnection* nc, jsCtx* js, jsCtx* short_js, kvStore* kv,
          TrainerOptions options);
  void LeaseLoop();
  void Promote() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Demote(bool final_checkpoint);
  // True while this member may publish: it holds the lease and renewed it
  // less than a lease time ago.
  bool FenceOk() const;
  // Reads the lease key: true when it still holds this member's revision.
  bool LeaseStillOurs();
  // The NATS connection is up (a stop writes nothing to NATS otherwise).
  bool Connected() const;
  void StopAll(bool final_checkpoint, bool release);

  natsConnection* const nc_;
  jsCtx* const js_;
  // Waits at most twice the lease time (at least 1 s): what a stop writes.
  jsCtx* const short_js_;
  kvStore* const kv_;
  const TrainerOptions options_;
  std::unique_ptr<Families> families_;

  std::atomic<bool> leader_{false};
  std::atomic<int64_t> last_renew_ms_{0};  // steady clock
  std::atomic<bool> pause_renewals_{false};
  std::atomic<bool> time_fence_{true};
  std::atomic<uint64_t> lease_rev_{0};

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::unique_ptr<Worker>> workers_ ABSL_GUARDED_BY(mu_);
  // Local checkpoints found at start, by readout name.
  std::map<std::string, storage::RecoveredReadout> local_ ABSL_GUARDED_BY(mu_);
  std::thread lease_thread_;
};

}  // namespace leap::fleet

#endif  // LEAP_SIDECAR_FLEET_TRAINER_H_
