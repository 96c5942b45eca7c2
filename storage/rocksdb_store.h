// StateStore on an embedded RocksDB, one column family per kind of data:
// meta (readouts, routes), checkpoints (P in 1 MiB chunks), log (feedback),
// versions, snapshots, dedup (recently recorded request ids), dataset
// (features and true lengths kept for training), quality (online pairs).
#ifndef LEAP_STORAGE_ROCKSDB_STORE_H_
#define LEAP_STORAGE_ROCKSDB_STORE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "storage/state_store.h"

namespace leap::storage {

struct RocksStoreOptions {
  // fsync the write-ahead log on every feedback append. Off, an append is
  // still in the OS before it is acknowledged, so it survives kill -9 of
  // leapd; on, it also survives a power loss, at ~1 fsync per append.
  // leapd leaves it off and calls SyncLog once before each acknowledgement
  // instead (--sync_log). Default: false
  bool sync_log = false;
  // Valid checkpoints kept per readout; the log is kept from the oldest, so
  // a corrupt newest checkpoint falls back without losing feedback.
  // Default: 2
  int checkpoints_kept = 2;
  // Published versions kept per readout (history). Default: 10000
  int64_t versions_kept = 10000;
  // How long a recorded request id is remembered for dedup. Default: 1 h
  int64_t dedup_window_ms = 3600 * 1000;
  // Bytes per stored chunk of P. Default: 1 MiB
  int64_t chunk_bytes = int64_t{1} << 20;
  // Dataset retention per readout name (leapd --dataset_max_records,
  // --dataset_max_bytes): the oldest records are deleted beyond either
  // bound. 0 records: no dataset is kept. Default: 100000 records, 1 GiB
  int64_t dataset_max_records = 100000;
  int64_t dataset_max_bytes = int64_t{1} << 30;
  // Quality pairs kept per series (a readout, a route arm). Default: 100000
  int64_t quality_kept = 100000;
  // Compact the checkpoint family's range that retention just deleted, in
  // WriteCheckpoint, so the superseded checkpoints' files leave the disk at
  // once instead of at RocksDB's next compaction of the family (which waits
  // for 4 files). Not a leapd flag: rocksdb_store_benchmark turns it off to
  // measure the difference. Default: true
  bool compact_pruned_checkpoints = true;
  // Let RocksDB preallocate (fallocate) the write-ahead log. Not a leapd
  // flag: rocksdb_store_benchmark turns it on to measure the difference.
  // Default: false
  bool preallocate_wal = false;

  absl::Status Validate() const;
};

// Opens (creating if needed) the store in `dir`.
absl::StatusOr<std::unique_ptr<StateStore>> OpenRocksStore(
    const std::string& dir, const RocksStoreOptions& options = {});

// Test and operator aid: flips one byte in the payload of the newest
// checkpoint of readout `name` (P chunk if present, else theta), through
// RocksDB, so the store's own checksums must catch it.
absl::Status CorruptNewestCheckpoint(const std::string& dir,
                                     const std::string& name);

}  // namespace leap::storage

#endif  // LEAP_STORAGE_ROCKSDB_STORE_H_
