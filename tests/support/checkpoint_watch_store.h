// A StateStore that forwards everything to another one (e.g. a RocksDB
// store) and sees every checkpoint written through it, so that a test waits
// for a checkpoint written on another thread (a fleet member pruning its
// outbox, a trainer's local checkpoint) instead of polling a metric or a
// status. Header only; test-only.
#ifndef LEAP_TESTS_SUPPORT_CHECKPOINT_WATCH_STORE_H_
#define LEAP_TESTS_SUPPORT_CHECKPOINT_WATCH_STORE_H_

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "storage/state_store.h"

namespace leap::testing {

class CheckpointWatchStore : public storage::StateStore {
 public:
  explicit CheckpointWatchStore(std::unique_ptr<storage::StateStore> inner)
      : inner_(std::move(inner)) {}

  // Waits (up to `timeout`) for a checkpoint of `readout` written OK (or
  // its initial one, CreateReadout) that satisfies `pred`; false at the
  // timeout. theta and P are not kept: `pred` sees the other fields.
  bool AwaitCheckpoint(const std::string& readout,
                       const std::function<bool(const storage::ReadoutCheckpoint&)>& pred,
                       absl::Duration timeout = absl::Seconds(20)) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& [name, c] : written_) {
        if (name == readout && pred(c)) return true;
      }
      return false;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), timeout);
  }

  absl::Status WriteCheckpoint(const storage::ReadoutMeta& meta,
                               const storage::ReadoutCheckpoint& c) override {
    absl::Status s = inner_->WriteCheckpoint(meta, c);
    if (s.ok()) Seen(meta.name, c);
    return s;
  }
  absl::Status CreateReadout(storage::ReadoutMeta* meta,
                             const storage::ReadoutCheckpoint& initial) override {
    absl::Status s = inner_->CreateReadout(meta, initial);
    if (s.ok()) Seen(meta->name, initial);
    return s;
  }
  absl::Status DeleteReadout(const storage::ReadoutMeta& meta) override {
    return inner_->DeleteReadout(meta);
  }
  absl::Status SetFrozen(const storage::ReadoutMeta& meta, bool frozen,
                         const std::string& reason) override {
    return inner_->SetFrozen(meta, frozen, reason);
  }
  absl::Status PutRoute(const std::string& product_line,
                        const std::string& route_json) override {
    return inner_->PutRoute(product_line, route_json);
  }
  absl::Status DeleteRoute(const std::string& product_line) override {
    return inner_->DeleteRoute(product_line);
  }
  absl::Status AppendLog(const storage::ReadoutMeta& meta,
                         std::span<const storage::LogRecord> records) override {
    return inner_->AppendLog(meta, records);
  }
  absl::Status SyncLog() override { return inner_->SyncLog(); }
  absl::StatusOr<bool> WasRecorded(const std::string& key) override {
    return inner_->WasRecorded(key);
  }
  absl::Status PutVersion(const storage::ReadoutMeta& meta, const storage::VersionEntry& v,
                          const Eigen::VectorXd& theta) override {
    return inner_->PutVersion(meta, v, theta);
  }
  absl::StatusOr<Eigen::VectorXd> GetVersionTheta(const storage::ReadoutMeta& meta,
                                                  int64_t version) override {
    return inner_->GetVersionTheta(meta, version);
  }
  absl::Status PutSnapshot(const storage::ReadoutMeta& meta, const storage::SnapshotInfo& info,
                           const storage::ReadoutCheckpoint& state) override {
    return inner_->PutSnapshot(meta, info, state);
  }
  absl::StatusOr<storage::ReadoutCheckpoint> GetSnapshot(const storage::ReadoutMeta& meta,
                                                         const std::string& label) override {
    return inner_->GetSnapshot(meta, label);
  }
  absl::StatusOr<std::vector<storage::SnapshotInfo>> ListSnapshots(
      const storage::ReadoutMeta& meta) override {
    return inner_->ListSnapshots(meta);
  }
  absl::StatusOr<storage::RecoveredState> Load() override { return inner_->Load(); }
  std::map<std::string, int64_t> BytesPerFamily() override { return inner_->BytesPerFamily(); }
  absl::StatusOr<storage::DatasetStats> AppendDataset(const std::string& readout,
                                                      storage::DatasetRecord record) override {
    return inner_->AppendDataset(readout, std::move(record));
  }
  absl::StatusOr<storage::DatasetStats> GetDatasetStats(const std::string& readout) override {
    return inner_->GetDatasetStats(readout);
  }
  absl::Status AppendLogAndDataset(const storage::ReadoutMeta& meta,
                                   std::span<const storage::LogRecord> records,
                                   const std::string& dataset_name,
                                   storage::DatasetRecord dataset_record,
                                   absl::StatusOr<storage::DatasetStats>* dataset) override {
    return inner_->AppendLogAndDataset(meta, records, dataset_name, std::move(dataset_record),
                                       dataset);
  }
  absl::Status ScanDataset(const std::string& readout, int64_t limit,
                           const std::function<bool(const storage::DatasetRecord&)>& fn,
                           int64_t* corrupt) override {
    return inner_->ScanDataset(readout, limit, fn, corrupt);
  }
  absl::Status AppendQuality(const std::string& series,
                             const storage::QualityPair& pair) override {
    return inner_->AppendQuality(series, pair);
  }
  absl::StatusOr<std::vector<storage::QualityPair>> LoadQuality(const std::string& series,
                                                                int64_t max,
                                                                int64_t* total) override {
    return inner_->LoadQuality(series, max, total);
  }

 private:
  void Seen(const std::string& readout, const storage::ReadoutCheckpoint& c) {
    storage::ReadoutCheckpoint seen;
    seen.version = c.version;
    seen.completions_learned = c.completions_learned;
    seen.last_seq = c.last_seq;
    seen.unix_ms = c.unix_ms;
    absl::MutexLock l(&mu_);
    written_.emplace_back(readout, std::move(seen));
  }

  const std::unique_ptr<storage::StateStore> inner_;
  absl::Mutex mu_;
  std::vector<std::pair<std::string, storage::ReadoutCheckpoint>> written_ ABSL_GUARDED_BY(mu_);
};

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_CHECKPOINT_WATCH_STORE_H_
