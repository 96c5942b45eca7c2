// The seam between the Core and fleet mode (leapd --fleet, docs/FLEET.md):
// what the Core and the Admin service ask of the fleet member, without
// sidecar/core depending on NATS. Implemented by leap::fleet::FleetMember.
#ifndef LEAP_SIDECAR_CORE_FLEET_LINK_H_
#define LEAP_SIDECAR_CORE_FLEET_LINK_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "readout/artifact.h"
#include "readout/features.h"
#include "storage/state_store.h"

namespace leap::sidecar {

struct Route;

// One learnable completion, recorded in the local outbox (the readout's
// feedback log) and now to be published to the fleet.
struct FleetCompletionRecord {
  std::string readout;
  std::string request_id;
  std::string instance;
  std::string product_line;
  std::string arm;
  readout::DType dtype = readout::DType::kFloat32;
  absl::string_view features;  // raw little-endian values
  double target = 0;
  double predicted_tokens = 0;
  int64_t served_version = 0;
  double true_tokens = 0;
  // Its sequence in the readout's local log, and the dedup keys recorded
  // with it.
  uint64_t local_seq = 0;
  std::vector<std::string> dedup_keys;
};

// What GetStats and health say about fleet mode.
struct FleetStatus {
  std::string fleet;
  std::string member;
  std::string role;     // "trainer" or "member"
  std::string trainer;  // member id holding the lease ("" unknown)
  bool degraded = false;
  std::string degraded_reason;
  uint64_t last_fleet_seq = 0;  // newest FEEDBACK sequence this member acked
  int64_t unconfirmed = 0;      // outbox records not yet in the stream
};

// Fleet-wide online quality of a readout (docs/FLEET.md "Online quality"):
// what the trainer counted over every member's completions.
struct FleetQualitySeriesView {
  int64_t version = 0;       // a version's series (0 otherwise)
  std::string product_line;  // an arm's series
  std::string arm;
  int64_t completions = 0;   // counted in all
  double spearman = 0;       // over the newest spearman_n (NaN if undefined)
  int64_t spearman_n = 0;
};
struct FleetQualityView {
  uint64_t fleet_seq = 0;  // every completion up to this sequence counted
  int64_t window = 0;
  std::string trainer;
  int64_t unix_ms = 0;
  FleetQualitySeriesView overall;
  std::vector<FleetQualitySeriesView> versions;
  std::vector<FleetQualitySeriesView> arms;
};

// One completion's publish to the fleet's stream, in flight (fleet mode,
// Core::Complete with defer_fleet_ack, and the resend of a completion whose
// publish is still in flight or failed): set once, from the thread that
// receives JetStream's acknowledgement, to the completion's FEEDBACK
// sequence or UNAVAILABLE. Thread-safe.
//
// The result is kept as a code and a message, and every Wait() builds its
// own Status from them: an error Status shares one reference-counted
// representation between its copies, counted inside libabsl, where
// ThreadSanitizer does not see the ordering; copies of one Status handed to
// several threads made it report the last owner's free as a race.
class PendingFleetAck {
 public:
  // The first call wins; runs the callbacks registered by OnDone.
  void Set(const absl::StatusOr<uint64_t>& result) {
    std::vector<std::function<void()>> run;
    {
      absl::MutexLock l(&mu_);
      if (set_) return;
      set_ = true;
      if (result.ok()) {
        seq_ = *result;
      } else {
        code_ = result.status().code();
        message_ = std::string(result.status().message());
      }
      run.swap(on_done_);
    }
    for (auto& f : run) f();
  }
  // Blocks until set.
  absl::StatusOr<uint64_t> Wait() {
    absl::MutexLock l(&mu_);
    mu_.Await(absl::Condition(&set_));
    if (code_ != absl::StatusCode::kOk) return absl::Status(code_, message_);
    return seq_;
  }
  bool done() const {
    absl::MutexLock l(&mu_);
    return set_;
  }
  // `f` runs once the result is set (at once, here, when it already is).
  void OnDone(std::function<void()> f) {
    {
      absl::MutexLock l(&mu_);
      if (!set_) {
        on_done_.push_back(std::move(f));
        return;
      }
    }
    f();
  }

 private:
  mutable absl::Mutex mu_;
  bool set_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::StatusCode code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  std::string message_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> on_done_ ABSL_GUARDED_BY(mu_);
};

// Thread-safe.
class FleetLink {
 public:
  virtual ~FleetLink() = default;

  // Publishes a completion already recorded in the local outbox; returns
  // its FEEDBACK stream sequence once JetStream acknowledged it.
  // UNAVAILABLE when NATS cannot be reached (the record stays in the
  // outbox and is republished later).
  virtual absl::StatusOr<uint64_t> PublishCompletion(
      const FleetCompletionRecord& c) = 0;
  // The same without waiting: `ack` is set once JetStream acknowledged it
  // (or the publish failed), from another thread; many completions can be
  // in flight at once. The record is copied before this returns. By
  // default it waits (PublishCompletion).
  virtual void PublishCompletionAsync(const FleetCompletionRecord& c,
                                      std::shared_ptr<PendingFleetAck> ack) {
    ack->Set(PublishCompletion(c));
  }
  // A resent completion whose dedup key was recorded: the returned ack is
  // set to its stream sequence once its outbox record is in the stream (0
  // when the sequence is no longer known), or to UNAVAILABLE when it cannot
  // be. Never waits for NATS: the ack is set already when the answer is
  // known now; while the record's publish is in flight the resend shares
  // that publish's ack, and a record whose publish failed is published
  // again asynchronously (the ack is then set from the thread that receives
  // JetStream's acknowledgement).
  virtual std::shared_ptr<PendingFleetAck> ResolveDuplicate(
      const std::vector<std::string>& dedup_keys) = 0;

  // Fleet-wide admin operations (any member; every member applies them).
  virtual absl::Status CreateReadout(const std::string& name,
                                     readout::ReadoutState state) = 0;
  virtual absl::Status DeleteReadout(const std::string& name) = 0;
  virtual absl::Status SetRoute(const Route& route) = 0;
  virtual absl::Status DeleteRoute(const std::string& product_line) = 0;
  virtual absl::StatusOr<storage::SnapshotInfo> Snapshot(
      const std::string& readout, const std::string& label) = 0;
  virtual absl::StatusOr<int64_t> Rollback(const std::string& readout,
                                           const std::string& label) = 0;
  virtual absl::Status SetFrozen(const std::string& readout, bool frozen) = 0;
  // The readout's complete state as the fleet's trainer holds it now (theta
  // and P of one version), asked with an EXPORT operation that adds no
  // version (ExportReadout with from_trainer, docs/FLEET.md).
  virtual absl::StatusOr<readout::ReadoutState> ExportState(
      const std::string& readout) = 0;
  // The fleet's snapshots of a readout (in the STATE stream).
  virtual absl::StatusOr<std::vector<storage::SnapshotInfo>> ListSnapshots(
      const std::string& readout) = 0;

  virtual FleetStatus Status() const = 0;
  // The newest fleet-wide quality the trainer published for this
  // incarnation of the readout; nullopt when there is none (yet).
  virtual std::optional<FleetQualityView> Quality(
      const std::string& readout) const {
    (void)readout;
    return std::nullopt;
  }
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_FLEET_LINK_H_
