// Durable state of leapd, behind an interface (docs/STORAGE.md): the sidecar is
// written against StateStore, and the RocksDB code stays in storage/.
//
// What is kept, per readout (identified by an incarnation number, so a
// deleted and re-created name never sees the old records):
//  - metadata: spec, standardization, frozen flag;
//  - checkpoints: theta, P (chunked), version, completions learned, and the
//    last feedback-log sequence number they include;
//  - the feedback log: every acknowledged completion (raw features + target)
//    after the last checkpoint;
//  - published versions (theta and provenance), within a retention policy;
//  - snapshots: labelled complete states for rollback.
// Plus the routing table and a dedup index of recorded completions.
#ifndef LEAP_STORAGE_STATE_STORE_H_
#define LEAP_STORAGE_STATE_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "readout/features.h"
#include "readout/readout.h"
#include "readout/rls.h"

namespace leap::storage {

// A readout's identity and static configuration.
struct ReadoutMeta {
  std::string name;
  uint64_t incarnation = 0;  // assigned by the store, never reused
  readout::ReadoutSpec spec;
  readout::Standardizer standardizer;
  bool frozen = false;
  // Why it is frozen when not by an operator (e.g. "rls: ..."); "" otherwise.
  std::string frozen_reason;
  bool has_p = true;
  int64_t created_unix_ms = 0;
};

// A complete restorable state of a readout at one point.
struct ReadoutCheckpoint {
  int64_t version = 0;
  int64_t completions_learned = 0;
  // Every log record with seq <= last_seq is included.
  uint64_t last_seq = 0;
  int64_t unix_ms = 0;
  Eigen::VectorXd theta;
  std::optional<readout::SymMatrix> p;
};

// One acknowledged completion, as learned.
struct LogRecord {
  uint64_t seq = 0;
  std::string request_id;
  readout::DType dtype = readout::DType::kFloat32;
  std::string features;  // raw little-endian values
  double target = 0;     // sqrt(min(tokens, M))
  // Dedup keys recorded with it (not stored in the log itself): a later
  // WasRecorded(key) within the dedup window is true.
  std::vector<std::string> dedup_keys;
};

// A published version (for history and audit).
struct VersionEntry {
  int64_t version = 0;
  int64_t completions_learned = 0;
  int64_t unix_ms = 0;
  std::string cause;
  // Feedback-log records with seq <= last_seq are in this version's state
  // (for "rls" versions: the batch applied is (previous last_seq, last_seq]).
  // Recovery replays the log in exactly these batches, so every version
  // number names the same state before and after a crash. Unknown (false)
  // for versions written by older releases.
  bool has_last_seq = false;
  uint64_t last_seq = 0;
};

struct SnapshotInfo {
  std::string label;
  int64_t version = 0;
  int64_t completions_learned = 0;
  double spearman = 0;  // rolling Spearman when taken (NaN if unknown)
  int64_t unix_ms = 0;
  int64_t spearman_n = 0;  // completions the Spearman covered (0 if unknown)
};

// What recovery found for one readout.
struct RecoveredReadout {
  ReadoutMeta meta;
  ReadoutCheckpoint checkpoint;     // newest valid one
  std::vector<LogRecord> log;       // records after it, in seq order
  std::vector<VersionEntry> versions;
  int64_t max_version = 0;          // newest version ever recorded
};

struct RecoveredState {
  std::vector<RecoveredReadout> readouts;
  // product line -> route, as the JSON the sidecar stored.
  std::map<std::string, std::string> routes;
  // Problems found and worked around (corrupt checkpoint skipped, ...).
  std::vector<std::string> problems;
};

// One finished request kept for training (the "dataset" family, see
// docs/STORAGE.md): raw features and the true output length, for
// `leapctl dataset export` and bootstrap training.
struct DatasetRecord {
  uint64_t seq = 0;  // assigned by the store, increasing per readout name
  readout::DType dtype = readout::DType::kFloat32;
  std::string features;  // raw little-endian values
  int64_t tokens = 0;    // true output tokens (not clipped)
  int64_t unix_ms = 0;
};

// What the dataset of one readout name holds now.
struct DatasetStats {
  int64_t records = 0;
  int64_t bytes = 0;          // record values, features included
  uint64_t first_seq = 0;     // oldest kept record (when records > 0)
  uint64_t next_seq = 1;      // the next record's seq
};

// One (predicted, true) pair of the online quality, as persisted.
struct QualityPair {
  int64_t version = 0;  // the readout version that predicted it
  double predicted = 0;
  double truth = 0;
  int64_t unix_ms = 0;
};

// Thread-safe: leapd calls it from admin handlers, the RLS worker and the
// checkpoint thread of each readout, concurrently.
class StateStore {
 public:
  virtual ~StateStore() = default;

  // Registers a readout with its initial state; fills meta->incarnation.
  virtual absl::Status CreateReadout(ReadoutMeta* meta,
                                     const ReadoutCheckpoint& initial) = 0;
  virtual absl::Status DeleteReadout(const ReadoutMeta& meta) = 0;
  // `reason` (empty for an operator's freeze) is kept with the flag, e.g.
  // why an RLS update failed; Load returns it in ReadoutMeta::frozen_reason.
  virtual absl::Status SetFrozen(const ReadoutMeta& meta, bool frozen,
                                 const std::string& reason = "") = 0;
  virtual absl::Status PutRoute(const std::string& product_line,
                                const std::string& route_json) = 0;
  virtual absl::Status DeleteRoute(const std::string& product_line) = 0;

  // Durably appends completions (and their dedup keys to the dedup index)
  // before returning, per the sync policy. All or nothing.
  virtual absl::Status AppendLog(const ReadoutMeta& meta,
                                 std::span<const LogRecord> records) = 0;
  // Makes every append that returned before this call durable against a
  // power loss (fsync of the write-ahead log), whatever the sync policy: a
  // caller that appends with the policy off and acknowledges only after
  // SyncLog gets one fsync for many appends (concurrent callers may share
  // one). A failure is permanent: every later call fails too until the
  // store is reopened. Stores without a log of their own have nothing to do.
  virtual absl::Status SyncLog() { return absl::OkStatus(); }
  // True when a record carrying dedup key `key` was appended recently
  // (within the dedup window): a resent completion must not be learned twice.
  virtual absl::StatusOr<bool> WasRecorded(const std::string& key) = 0;

  // Writes a checkpoint atomically (a manifest written after its chunks),
  // then prunes the log up to last_seq and old checkpoints.
  virtual absl::Status WriteCheckpoint(const ReadoutMeta& meta,
                                       const ReadoutCheckpoint& c) = 0;
  virtual absl::Status PutVersion(const ReadoutMeta& meta,
                                  const VersionEntry& v,
                                  const Eigen::VectorXd& theta) = 0;
  // The theta stored with a published version (CRC-checked); NOT_FOUND when
  // it was pruned or never written.
  virtual absl::StatusOr<Eigen::VectorXd> GetVersionTheta(
      const ReadoutMeta& meta, int64_t version) = 0;

  virtual absl::Status PutSnapshot(const ReadoutMeta& meta,
                                   const SnapshotInfo& info,
                                   const ReadoutCheckpoint& state) = 0;
  virtual absl::StatusOr<ReadoutCheckpoint> GetSnapshot(
      const ReadoutMeta& meta, const std::string& label) = 0;
  virtual absl::StatusOr<std::vector<SnapshotInfo>> ListSnapshots(
      const ReadoutMeta& meta) = 0;

  // Everything needed to resume, with corrupt records skipped and reported.
  virtual absl::StatusOr<RecoveredState> Load() = 0;
  // Approximate bytes on disk per kind of data.
  virtual std::map<std::string, int64_t> BytesPerFamily() = 0;

  // --- dataset: (features, true tokens) of finished requests, per readout
  // name, oldest pruned beyond the retention bounds. Unimplemented by
  // default (stores without it keep no dataset).
  virtual absl::StatusOr<DatasetStats> AppendDataset(
      const std::string& /*readout*/, DatasetRecord /*record*/) {
    return absl::UnimplementedError("this store keeps no dataset");
  }
  virtual absl::StatusOr<DatasetStats> GetDatasetStats(
      const std::string& /*readout*/) {
    return absl::UnimplementedError("this store keeps no dataset");
  }
  // AppendLog, then AppendDataset(dataset_name, dataset_record), as one
  // durable write where the store can (RocksDB: one WriteBatch, one
  // write-ahead-log write): the result is AppendLog's, and the dataset
  // record is kept only with the log records. *dataset (when not null) is
  // AppendDataset's result; a dataset record that cannot be kept does not
  // fail the log append.
  virtual absl::Status AppendLogAndDataset(
      const ReadoutMeta& meta, std::span<const LogRecord> records,
      const std::string& dataset_name, DatasetRecord dataset_record,
      absl::StatusOr<DatasetStats>* dataset) {
    absl::Status log = AppendLog(meta, records);
    if (!log.ok()) return log;
    absl::StatusOr<DatasetStats> st =
        AppendDataset(dataset_name, std::move(dataset_record));
    if (dataset != nullptr) *dataset = std::move(st);
    return absl::OkStatus();
  }
  // Calls `fn` for the records, oldest first (the newest `limit` when
  // limit > 0), from one consistent view; stops early when fn returns
  // false. Corrupt records are skipped and counted in *corrupt.
  virtual absl::Status ScanDataset(
      const std::string& /*readout*/, int64_t /*limit*/,
      const std::function<bool(const DatasetRecord&)>& /*fn*/,
      int64_t* /*corrupt*/ = nullptr) {
    return absl::UnimplementedError("this store keeps no dataset");
  }

  // --- quality: (predicted, true) pairs of a series (a readout
  // incarnation, or a route arm), the newest kept per the retention bound.
  virtual absl::Status AppendQuality(const std::string& /*series*/,
                                     const QualityPair& /*pair*/) {
    return absl::OkStatus();
  }
  // The newest `max` pairs of a series (oldest first) and, in *total, how
  // many were ever appended to it.
  virtual absl::StatusOr<std::vector<QualityPair>> LoadQuality(
      const std::string& /*series*/, int64_t /*max*/, int64_t* total) {
    if (total != nullptr) *total = 0;
    return std::vector<QualityPair>{};
  }
};

// Quality series names: a readout's (by incarnation, so a re-created name
// starts fresh) and a route arm's (product line, arm, readout).
std::string ReadoutQualitySeries(uint64_t incarnation);
std::string ArmQualitySeries(const std::string& product_line,
                             const std::string& arm,
                             const std::string& readout);

}  // namespace leap::storage

#endif  // LEAP_STORAGE_STATE_STORE_H_
