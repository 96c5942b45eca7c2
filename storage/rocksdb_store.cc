#include "storage/rocksdb_store.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/base/dynamic_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/crc32c.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "rocksdb/convenience.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/write_batch.h"

namespace leap::storage {
namespace {

using nlohmann::json;

constexpr const char* kFamilies[] = {"default",  "meta",      "checkpoints",
                                     "log",      "versions",  "snapshots",
                                     "dedup",    "dataset",   "quality"};
enum Cf {
  kDefault = 0, kMeta, kCheckpoints, kLog, kVersions, kSnapshots, kDedup,
  kDataset, kQuality
};

void PutU64(std::string& s, uint64_t v) {
  for (int i = 7; i >= 0; --i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
std::string Prefix(uint64_t inc) {
  std::string s;
  PutU64(s, inc);
  return s;
}
std::string Key2(uint64_t inc, uint64_t n) {
  std::string s = Prefix(inc);
  PutU64(s, n);
  return s;
}
template <typename T>
void Append(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
T Read(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// RocksDB groups concurrent writers: the group's leader copies the other
// writers' WriteBatches into its own and writes them for them, after a
// hand-off inside librocksdb. Debian's librocksdb is not built with
// ThreadSanitizer, so TSan sees the leader read a buffer another thread
// filled (the follower's batch, past its 12-byte header) with no ordering
// between them. Under TSan the accesses a thread makes during a RocksDB write
// are ignored, as for an uninstrumented library; elsewhere this is nothing.
class RocksWriteScope {
 public:
  RocksWriteScope() { ABSL_ANNOTATE_IGNORE_READS_AND_WRITES_BEGIN(); }
  ~RocksWriteScope() { ABSL_ANNOTATE_IGNORE_READS_AND_WRITES_END(); }
  RocksWriteScope(const RocksWriteScope&) = delete;
  RocksWriteScope& operator=(const RocksWriteScope&) = delete;
};
rocksdb::Status Write(rocksdb::DB* db, const rocksdb::WriteOptions& wo,
                      rocksdb::WriteBatch* b) {
  RocksWriteScope scope;
  return db->Write(wo, b);
}

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsIOError()) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

// Checkpoint / snapshot payload keys: base + 'M' manifest, 'T' theta,
// 'C' + u32 chunk index.
std::string Part(const std::string& base, char kind, uint32_t idx = 0) {
  std::string k = base;
  k.push_back(kind);
  if (kind == 'C') {
    for (int i = 3; i >= 0; --i) k.push_back(static_cast<char>((idx >> (8 * i)) & 0xFF));
  }
  return k;
}

std::string PackedP(const readout::SymMatrix& p) {
  const int64_t n = p.n();
  std::string out(static_cast<size_t>(n * n) * 4, '\0');
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(out.data() + i * n * 4, p.row(i), n * 4);
  }
  return out;
}

}  // namespace

absl::Status RocksStoreOptions::Validate() const {
  if (checkpoints_kept < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoints_kept must be >= 1, got ", checkpoints_kept));
  }
  if (versions_kept < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("versions_kept must be >= 1, got ", versions_kept));
  }
  if (chunk_bytes < 4096 || chunk_bytes % 4 != 0) {
    return absl::InvalidArgumentError("chunk_bytes must be >= 4096, multiple of 4");
  }
  if (dataset_max_records < 0) {
    return absl::InvalidArgumentError("dataset_max_records must be >= 0");
  }
  if (dataset_max_bytes < 1) {
    return absl::InvalidArgumentError("dataset_max_bytes must be >= 1");
  }
  if (quality_kept < 1) return absl::InvalidArgumentError("quality_kept must be >= 1");
  return absl::OkStatus();
}

std::string ReadoutQualitySeries(uint64_t incarnation) {
  return absl::StrCat("R", Prefix(incarnation));
}

std::string ArmQualitySeries(const std::string& product_line,
                             const std::string& arm,
                             const std::string& readout) {
  std::string s = "A" + product_line;
  s.push_back('\0');
  s += arm;
  s.push_back('\0');
  s += readout;
  s.push_back('\0');
  return s;
}

// Thread-safe (any thread: admin handlers, RLS workers, checkpointers); mu_
// guards the id counters, RocksDB does its own locking for the rest.
class RocksStore final : public StateStore {
 public:
  RocksStore(RocksStoreOptions o, rocksdb::DB* db,
             std::vector<rocksdb::ColumnFamilyHandle*> h)
      : o_(o), db_(db), h_(std::move(h)) {}

  ~RocksStore() override {
    rocksdb::FlushOptions fo;
    db_->Flush(fo, h_);
    for (auto* h : h_) db_->DestroyColumnFamilyHandle(h);
    delete db_;
  }

  absl::Status Init() {
    absl::MutexLock lock(&mu_);
    std::string v;
    auto s = db_->Get(rocksdb::ReadOptions(), h_[kMeta], "next_incarnation", &v);
    if (s.ok() && v.size() == 8) {
      next_inc_ = GetU64(v.data());
    } else if (!s.IsNotFound()) {
      return FromRocks(s, "reading next_incarnation");
    }
    return absl::OkStatus();
  }

  // Writes a batch of checkpoint/snapshot payload straight to an SST: no
  // 64 MiB in the WAL (which recovery would replay), durable once Flush
  // returns. A crash before that loses the whole batch, never part of it.
  absl::Status WriteBulk(rocksdb::WriteBatch& b, int cf) {
    rocksdb::WriteOptions wo;
    wo.disableWAL = true;
    RETURN_IF_ERROR(FromRocks(Write(db_, wo, &b), "write state"));
    rocksdb::FlushOptions fo;
    fo.wait = true;
    return FromRocks(db_->Flush(fo, h_[cf]), "flush state");
  }

  // ---------------------------------------------------------------- meta
  static json MetaJson(const ReadoutMeta& m) {
    return {{"name", m.name},
            {"incarnation", m.incarnation},
            {"dim", m.spec.dim},
            {"layer", m.spec.layer},
            {"model_id", m.spec.model_id},
            {"max_tokens", m.spec.max_tokens},
            {"lambda", m.spec.lambda},
            {"frozen", m.frozen},
            {"frozen_reason", m.frozen_reason},
            {"has_p", m.has_p},
            {"created_unix_ms", m.created_unix_ms}};
  }

  absl::Status CreateReadout(ReadoutMeta* meta,
                             const ReadoutCheckpoint& initial) override {
    absl::MutexLock lock(&mu_);
    meta->incarnation = next_inc_++;
    rocksdb::WriteBatch b;
    std::string next;
    PutU64(next, next_inc_);
    b.Put(h_[kMeta], "next_incarnation", next);
    b.Put(h_[kMeta], "readout:" + meta->name, MetaJson(*meta).dump());
    std::string st;
    const int64_t d = meta->spec.dim;
    st.append(reinterpret_cast<const char*>(meta->standardizer.mean.data()), d * 8);
    st.append(reinterpret_cast<const char*>(meta->standardizer.scale.data()), d * 8);
    const uint32_t crc = Crc32c(st.data(), st.size());
    Append(st, crc);
    b.Put(h_[kMeta], "std:" + Prefix(meta->incarnation), st);
    // The first checkpoint is durable before the readout exists.
    rocksdb::WriteBatch ck;
    AddCheckpoint(ck, *meta, initial, 1);
    RETURN_IF_ERROR(WriteBulk(ck, kCheckpoints));
    next_ckpt_[meta->incarnation] = 2;
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return FromRocks(Write(db_, wo, &b), "create readout");
  }

  absl::Status DeleteReadout(const ReadoutMeta& meta) override {
    absl::MutexLock lock(&mu_);
    rocksdb::WriteBatch b;
    b.Delete(h_[kMeta], "readout:" + meta.name);
    b.Delete(h_[kMeta], "std:" + Prefix(meta.incarnation));
    for (int cf : {kCheckpoints, kLog, kVersions, kSnapshots}) {
      b.DeleteRange(h_[cf], Prefix(meta.incarnation), Prefix(meta.incarnation + 1));
    }
    b.DeleteRange(h_[kQuality], ReadoutQualitySeries(meta.incarnation),
                  ReadoutQualitySeries(meta.incarnation + 1));
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return FromRocks(Write(db_, wo, &b), "delete readout");
  }

  absl::Status SetFrozen(const ReadoutMeta& meta, bool frozen,
                         const std::string& reason) override {
    ReadoutMeta m = meta;
    m.frozen = frozen;
    m.frozen_reason = frozen ? reason : "";
    rocksdb::WriteOptions wo;
    wo.sync = true;
    rocksdb::WriteBatch b;
    b.Put(h_[kMeta], "readout:" + m.name, MetaJson(m).dump());
    return FromRocks(Write(db_, wo, &b), "set frozen");
  }

  absl::Status PutRoute(const std::string& pl, const std::string& route) override {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    rocksdb::WriteBatch b;
    b.Put(h_[kMeta], "route:" + pl, route);
    return FromRocks(Write(db_, wo, &b), "put route");
  }

  absl::Status DeleteRoute(const std::string& pl) override {
    rocksdb::WriteOptions wo;
    wo.sync = true;
    rocksdb::WriteBatch b;
    b.Delete(h_[kMeta], "route:" + pl);
    return FromRocks(Write(db_, wo, &b), "delete route");
  }

  // ----------------------------------------------------------------- log
  void AddLog(rocksdb::WriteBatch& b, const ReadoutMeta& meta,
              std::span<const LogRecord> records) {
    std::string now;
    PutU64(now, static_cast<uint64_t>(UnixMs()));
    for (const LogRecord& r : records) {
      std::string v;
      v.reserve(r.features.size() + r.request_id.size() + 32);
      v.append(4, '\0');  // crc placeholder
      v.push_back(static_cast<char>(r.dtype));
      Append(v, r.target);
      const uint16_t idlen = static_cast<uint16_t>(r.request_id.size());
      Append(v, idlen);
      v += r.request_id;
      v += r.features;
      const uint32_t crc = Crc32c(v.data() + 4, v.size() - 4);
      std::memcpy(v.data(), &crc, 4);
      b.Put(h_[kLog], Key2(meta.incarnation, r.seq), v);
      for (const std::string& key : r.dedup_keys) b.Put(h_[kDedup], key, now);
    }
  }

  absl::Status AppendLog(const ReadoutMeta& meta,
                         std::span<const LogRecord> records) override {
    rocksdb::WriteBatch b;
    AddLog(b, meta, records);
    rocksdb::WriteOptions wo;
    wo.sync = o_.sync_log;
    return FromRocks(Write(db_, wo, &b), "append feedback log");
  }

  // One WriteBatch, so one write-ahead-log write: the dataset record is
  // kept exactly when the log records are. A dataset record that cannot be
  // prepared (no dataset kept, its stats unreadable) does not stop the log
  // append: *dataset says why.
  absl::Status AppendLogAndDataset(
      const ReadoutMeta& meta, std::span<const LogRecord> records,
      const std::string& dataset_name, DatasetRecord dataset_record,
      absl::StatusOr<DatasetStats>* dataset) override {
    rocksdb::WriteBatch b;
    AddLog(b, meta, records);
    absl::MutexLock lock(&ds_mu_);
    absl::StatusOr<DatasetStats> st =
        AddDatasetLocked(b, dataset_name, std::move(dataset_record));
    rocksdb::WriteOptions wo;
    wo.sync = o_.sync_log;
    RETURN_IF_ERROR(FromRocks(Write(db_, wo, &b), "append feedback log"));
    if (st.ok()) ds_stats_[dataset_name] = *st;
    if (dataset != nullptr) *dataset = std::move(st);
    return absl::OkStatus();
  }

  absl::Status SyncLog() override {
    // Every write that had returned when this call began has a sequence
    // number <= `want` and is in the WAL file (manual_wal_flush is off): a
    // sync that started after `want` was published covers it, so concurrent
    // callers share one fsync instead of queueing one each.
    const rocksdb::SequenceNumber want = db_->GetLatestSequenceNumber();
    absl::MutexLock lock(&sync_mu_);
    if (!sync_error_.ok()) return sync_error_;
    if (synced_seq_ >= want) return absl::OkStatus();
    const rocksdb::SequenceNumber covered = db_->GetLatestSequenceNumber();
    absl::Status s = FromRocks(db_->SyncWAL(), "sync the write-ahead log");
    if (!s.ok()) {
      // Permanent until the store is reopened: after a failed fsync a later
      // one that succeeds does not prove the earlier pages reached the disk.
      sync_error_ = absl::Status(
          s.code(), absl::StrCat(s.message(),
                                 " (a failed sync fails every later one until "
                                 "the store is reopened)"));
      return sync_error_;
    }
    synced_seq_ = covered;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> WasRecorded(const std::string& key) override {
    std::string v;
    auto s = db_->Get(rocksdb::ReadOptions(), h_[kDedup], key, &v);
    if (s.IsNotFound()) return false;
    RETURN_IF_ERROR(FromRocks(s, "dedup lookup"));
    if (v.size() != 8) return false;
    return UnixMs() - static_cast<int64_t>(GetU64(v.data())) < o_.dedup_window_ms;
  }

  // --------------------------------------------------------- checkpoints
  void AddCheckpoint(rocksdb::WriteBatch& b, const ReadoutMeta& meta,
                     const ReadoutCheckpoint& c, uint64_t id) {
    AddState(b, h_[kCheckpoints], Key2(meta.incarnation, id), c, json::object());
  }

  void AddState(rocksdb::WriteBatch& b, rocksdb::ColumnFamilyHandle* cf,
                const std::string& base, const ReadoutCheckpoint& c, json extra) {
    const std::string theta(reinterpret_cast<const char*>(c.theta.data()),
                            c.theta.size() * 8);
    json m = std::move(extra);
    m["version"] = c.version;
    m["learned"] = c.completions_learned;
    m["last_seq"] = c.last_seq;
    m["unix_ms"] = c.unix_ms;
    m["n"] = c.theta.size();
    m["theta_crc"] = Crc32c(theta.data(), theta.size());
    m["has_p"] = c.p.has_value();
    json crcs = json::array();
    if (c.p.has_value()) {
      const std::string packed = PackedP(*c.p);
      uint32_t idx = 0;
      for (size_t off = 0; off < packed.size(); off += o_.chunk_bytes, ++idx) {
        const size_t len = std::min<size_t>(o_.chunk_bytes, packed.size() - off);
        b.Put(cf, Part(base, 'C', idx), rocksdb::Slice(packed.data() + off, len));
        crcs.push_back(Crc32c(packed.data() + off, len));
      }
    }
    m["chunk_crcs"] = crcs;
    b.Put(cf, Part(base, 'T'), theta);
    b.Put(cf, Part(base, 'M'), m.dump());  // same batch: atomic with chunks
  }

  // Reads and verifies a state written by AddState.
  absl::StatusOr<ReadoutCheckpoint> ReadState(rocksdb::ColumnFamilyHandle* cf,
                                              const std::string& base,
                                              json* manifest_out = nullptr) {
    std::string mtext;
    RETURN_IF_ERROR(FromRocks(db_->Get(rocksdb::ReadOptions(), cf, Part(base, 'M'), &mtext),
                              "manifest"));
    json m = json::parse(mtext, nullptr, false);
    if (m.is_discarded()) return absl::DataLossError("manifest is not JSON");
    ReadoutCheckpoint c;
    try {
      c.version = m.at("version").get<int64_t>();
      c.completions_learned = m.at("learned").get<int64_t>();
      c.last_seq = m.at("last_seq").get<uint64_t>();
      c.unix_ms = m.at("unix_ms").get<int64_t>();
      const int64_t n = m.at("n").get<int64_t>();
      std::string theta;
      RETURN_IF_ERROR(FromRocks(db_->Get(rocksdb::ReadOptions(), cf, Part(base, 'T'), &theta),
                                "theta"));
      if (static_cast<int64_t>(theta.size()) != n * 8 ||
          Crc32c(theta.data(), theta.size()) != m.at("theta_crc").get<uint32_t>()) {
        return absl::DataLossError("theta failed its CRC-32C check");
      }
      c.theta.resize(n);
      std::memcpy(c.theta.data(), theta.data(), theta.size());
      if (m.at("has_p").get<bool>()) {
        readout::SymMatrix p(n);
        const auto& crcs = m.at("chunk_crcs");
        const size_t total = static_cast<size_t>(n * n) * 4;
        std::string packed;
        packed.reserve(total);
        std::string chunk;
        size_t off = 0;
        for (uint32_t idx = 0; idx < crcs.size(); ++idx) {
          RETURN_IF_ERROR(FromRocks(
              db_->Get(rocksdb::ReadOptions(), cf, Part(base, 'C', idx), &chunk),
              absl::StrCat("P chunk ", idx)));
          if (Crc32c(chunk.data(), chunk.size()) != crcs[idx].get<uint32_t>()) {
            return absl::DataLossError(
                absl::StrCat("P chunk ", idx, " failed its CRC-32C check"));
          }
          if (off + chunk.size() > total) return absl::DataLossError("P too long");
          packed += chunk;
          off += chunk.size();
        }
        if (off == total) {
          for (int64_t i = 0; i < n; ++i) {
            std::memcpy(p.row(i), packed.data() + i * n * 4, n * 4);
          }
        }
        if (off != total) return absl::DataLossError("P incomplete");
        c.p = std::move(p);
      }
    } catch (const json::exception& e) {
      return absl::DataLossError(absl::StrCat("manifest field: ", e.what()));
    }
    if (manifest_out != nullptr) *manifest_out = std::move(m);
    return c;
  }

  // Checkpoint ids of a readout, newest first.
  std::vector<uint64_t> CheckpointIds(uint64_t inc) {
    std::vector<uint64_t> ids;
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kCheckpoints]));
    const std::string pre = Prefix(inc);
    for (it->Seek(pre); it->Valid() && it->key().starts_with(pre); it->Next()) {
      const rocksdb::Slice k = it->key();
      if (k.size() == 17 && k[16] == 'M') ids.push_back(GetU64(k.data() + 8));
    }
    std::sort(ids.rbegin(), ids.rend());
    return ids;
  }

  absl::Status WriteCheckpoint(const ReadoutMeta& meta,
                               const ReadoutCheckpoint& c) override {
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      uint64_t& next = next_ckpt_[meta.incarnation];
      if (next == 0) {
        auto ids = CheckpointIds(meta.incarnation);
        next = ids.empty() ? 1 : ids.front() + 1;
      }
      id = next++;
    }
    rocksdb::WriteBatch b;
    AddCheckpoint(b, meta, c, id);
    RETURN_IF_ERROR(WriteBulk(b, kCheckpoints));
    // Retention: keep the newest checkpoints_kept; keep the log from the
    // oldest kept one, so a corrupt newer checkpoint loses nothing.
    auto ids = CheckpointIds(meta.incarnation);
    rocksdb::WriteBatch prune;
    uint64_t oldest_kept_seq = c.last_seq;
    uint64_t newest_pruned = 0;  // ids are newest first: 0 = none pruned
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string base = Key2(meta.incarnation, ids[i]);
      if (static_cast<int>(i) < o_.checkpoints_kept) {
        std::string mtext;
        if (db_->Get(rocksdb::ReadOptions(), h_[kCheckpoints], Part(base, 'M'), &mtext).ok()) {
          json m = json::parse(mtext, nullptr, false);
          if (!m.is_discarded() && m.contains("last_seq")) {
            oldest_kept_seq = std::min(oldest_kept_seq, m["last_seq"].get<uint64_t>());
          }
        }
        continue;
      }
      if (newest_pruned == 0) newest_pruned = ids[i];
      prune.DeleteRange(h_[kCheckpoints], base, Key2(meta.incarnation, ids[i] + 1));
    }
    prune.DeleteRange(h_[kLog], Key2(meta.incarnation, 0),
                      Key2(meta.incarnation, oldest_kept_seq + 1));
    PruneDedupLocked(prune);
    RETURN_IF_ERROR(FromRocks(Write(db_, rocksdb::WriteOptions(), &prune), "prune"));
    if (newest_pruned == 0 || !o_.compact_pruned_checkpoints) return absl::OkStatus();
    // Each checkpoint is written as its own SST file (WriteBulk flushes
    // it): files wholly inside the pruned range are dropped first without
    // reading them (DeleteFilesInRange), and the compaction then takes the
    // range deletions and what is left. Kept checkpoints are rewritten only
    // if RocksDB's own compaction had already merged a pruned and a kept
    // one into one file (possible with more kept checkpoints than the L0
    // trigger, 4). On this thread (the
    // readout's checkpoint thread), so the space is back when it returns.
    // The checkpoint is durable and pruned already: a failed compaction
    // (a shutdown under way) only leaves the space to RocksDB's own.
    const std::string begin = Key2(meta.incarnation, 0);
    const std::string end = Key2(meta.incarnation, newest_pruned + 1);
    const rocksdb::Slice from(begin), to(end);
    rocksdb::DeleteFilesInRange(db_, h_[kCheckpoints], &from, &to)
        .PermitUncheckedError();
    rocksdb::CompactRangeOptions co;
    co.exclusive_manual_compaction = false;  // other readouts' compactions go on
    db_->CompactRange(co, h_[kCheckpoints], &from, &to).PermitUncheckedError();
    return absl::OkStatus();
  }

  void PruneDedupLocked(rocksdb::WriteBatch& b) {
    const int64_t now = UnixMs();
    {
      absl::MutexLock lock(&mu_);
      if (now - last_dedup_prune_ms_ < 60 * 1000) return;
      last_dedup_prune_ms_ = now;
    }
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kDedup]));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->value().size() != 8 ||
          now - static_cast<int64_t>(GetU64(it->value().data())) >= o_.dedup_window_ms) {
        b.Delete(h_[kDedup], it->key());
      }
    }
  }

  absl::Status PutVersion(const ReadoutMeta& meta, const VersionEntry& v,
                          const Eigen::VectorXd& theta) override {
    std::string val;
    Append(val, v.completions_learned);
    Append(val, v.unix_ms);
    const uint16_t len = static_cast<uint16_t>(v.cause.size());
    Append(val, len);
    val += v.cause;
    val.append(reinterpret_cast<const char*>(theta.data()), theta.size() * 8);
    const uint32_t crc = Crc32c(val.data(), val.size());
    Append(val, crc);
    // Added after the CRC so older releases still read the entry.
    if (v.has_last_seq) Append(val, v.last_seq);
    rocksdb::WriteBatch b;
    b.Put(h_[kVersions], Key2(meta.incarnation, static_cast<uint64_t>(v.version)), val);
    if (v.version > o_.versions_kept) {
      b.DeleteRange(h_[kVersions], Key2(meta.incarnation, 0),
                    Key2(meta.incarnation,
                         static_cast<uint64_t>(v.version - o_.versions_kept)));
    }
    return FromRocks(Write(db_, rocksdb::WriteOptions(), &b), "put version");
  }

  absl::StatusOr<Eigen::VectorXd> GetVersionTheta(const ReadoutMeta& meta,
                                                  int64_t version) override {
    std::string v;
    RETURN_IF_ERROR(FromRocks(
        db_->Get(rocksdb::ReadOptions(), h_[kVersions],
                 Key2(meta.incarnation, static_cast<uint64_t>(version)), &v),
        absl::StrCat("version ", version)));
    const size_t n = static_cast<size_t>(meta.spec.dim + 1);
    if (v.size() < 18) return absl::DataLossError("version entry too short");
    const size_t plain = 18 + size_t{Read<uint16_t>(v.data() + 16)} + n * 8 + 4;
    if (v.size() != plain && v.size() != plain + 8) {
      return absl::DataLossError("version entry has the wrong size");
    }
    if (Crc32c(v.data(), plain - 4) != Read<uint32_t>(v.data() + plain - 4)) {
      return absl::DataLossError(
          absl::StrCat("version ", version, " failed its CRC-32C check"));
    }
    Eigen::VectorXd theta(static_cast<Eigen::Index>(n));
    std::memcpy(theta.data(), v.data() + plain - 4 - n * 8, n * 8);
    return theta;
  }

  // ------------------------------------------------------------ snapshots
  static std::string SnapBase(uint64_t inc, const std::string& label) {
    std::string s = Prefix(inc);
    s += label;
    s.push_back('\0');
    return s;
  }

  absl::Status PutSnapshot(const ReadoutMeta& meta, const SnapshotInfo& info,
                           const ReadoutCheckpoint& state) override {
    rocksdb::WriteBatch b;
    const std::string base = SnapBase(meta.incarnation, info.label);
    b.DeleteRange(h_[kSnapshots], base, base + '\xff');
    AddState(b, h_[kSnapshots], base, state,
             {{"label", info.label},
              {"spearman", std::isfinite(info.spearman) ? json(info.spearman) : json()},
              {"spearman_n", info.spearman_n},
              {"taken_unix_ms", info.unix_ms}});
    return WriteBulk(b, kSnapshots);
  }

  absl::StatusOr<ReadoutCheckpoint> GetSnapshot(const ReadoutMeta& meta,
                                                const std::string& label) override {
    auto s = ReadState(h_[kSnapshots], SnapBase(meta.incarnation, label));
    if (!s.ok() && absl::IsNotFound(s.status())) {
      return absl::NotFoundError(absl::StrCat("readout '", meta.name,
                                              "' has no snapshot '", label, "'"));
    }
    return s;
  }

  absl::StatusOr<std::vector<SnapshotInfo>> ListSnapshots(
      const ReadoutMeta& meta) override {
    std::vector<SnapshotInfo> out;
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kSnapshots]));
    const std::string pre = Prefix(meta.incarnation);
    for (it->Seek(pre); it->Valid() && it->key().starts_with(pre); it->Next()) {
      const rocksdb::Slice k = it->key();
      if (k.size() < 10 || k[k.size() - 1] != 'M' || k[k.size() - 2] != '\0') continue;
      json m = json::parse(it->value().ToString(), nullptr, false);
      if (m.is_discarded()) continue;
      SnapshotInfo s;
      s.label = std::string(k.data() + 8, k.size() - 10);
      s.version = m.value("version", int64_t{0});
      s.completions_learned = m.value("learned", int64_t{0});
      s.spearman = m["spearman"].is_number() ? m["spearman"].get<double>() : NAN;
      s.spearman_n = m.value("spearman_n", int64_t{0});
      s.unix_ms = m.value("taken_unix_ms", int64_t{0});
      out.push_back(std::move(s));
    }
    return out;
  }

  // ------------------------------------------------------------- recovery
  absl::StatusOr<RecoveredState> Load() override {
    RecoveredState out;
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kMeta]));
    for (it->Seek("readout:"); it->Valid() && it->key().starts_with("readout:");
         it->Next()) {
      json m = json::parse(it->value().ToString(), nullptr, false);
      if (m.is_discarded()) {
        out.problems.push_back(absl::StrCat("metadata of '", it->key().ToString(),
                                            "' is not JSON; readout skipped"));
        continue;
      }
      RecoveredReadout r;
      try {
        r.meta.name = m.at("name").get<std::string>();
        r.meta.incarnation = m.at("incarnation").get<uint64_t>();
        r.meta.spec.dim = m.at("dim").get<int64_t>();
        r.meta.spec.layer = m.at("layer").get<int32_t>();
        r.meta.spec.model_id = m.at("model_id").get<std::string>();
        r.meta.spec.max_tokens = m.at("max_tokens").get<int64_t>();
        r.meta.spec.lambda = m.at("lambda").get<double>();
        r.meta.frozen = m.at("frozen").get<bool>();
        r.meta.frozen_reason = m.value("frozen_reason", std::string());
        r.meta.has_p = m.at("has_p").get<bool>();
        r.meta.created_unix_ms = m.at("created_unix_ms").get<int64_t>();
      } catch (const json::exception& e) {
        out.problems.push_back(absl::StrCat("metadata of '", it->key().ToString(),
                                            "': ", e.what(), "; readout skipped"));
        continue;
      }
      const std::string& name = r.meta.name;
      std::string st;
      const int64_t d = r.meta.spec.dim;
      if (!db_->Get(rocksdb::ReadOptions(), h_[kMeta], "std:" + Prefix(r.meta.incarnation), &st)
               .ok() ||
          static_cast<int64_t>(st.size()) != d * 16 + 4 ||
          Crc32c(st.data(), d * 16) != Read<uint32_t>(st.data() + d * 16)) {
        out.problems.push_back(absl::StrCat("readout '", name,
                                            "': standardization missing or corrupt; "
                                            "readout skipped"));
        continue;
      }
      r.meta.standardizer.mean.resize(d);
      r.meta.standardizer.scale.resize(d);
      std::memcpy(r.meta.standardizer.mean.data(), st.data(), d * 8);
      std::memcpy(r.meta.standardizer.scale.data(), st.data() + d * 8, d * 8);
      bool found = false;
      for (uint64_t id : CheckpointIds(r.meta.incarnation)) {
        auto c = ReadState(h_[kCheckpoints], Key2(r.meta.incarnation, id));
        if (!c.ok()) {
          out.problems.push_back(absl::StrCat("readout '", name, "': checkpoint ", id,
                                              " is corrupt (", c.status().message(),
                                              "); falling back to an older one"));
          continue;
        }
        if (c->theta.size() != d + 1 || (c->p.has_value() && c->p->n() != d + 1)) {
          out.problems.push_back(absl::StrCat("readout '", name, "': checkpoint ", id,
                                              " has the wrong size; skipped"));
          continue;
        }
        r.checkpoint = std::move(*c);
        found = true;
        break;
      }
      if (!found) {
        out.problems.push_back(absl::StrCat("readout '", name,
                                            "': no valid checkpoint; readout skipped"));
        continue;
      }
      // The log after the checkpoint, in order; corrupt records are skipped.
      std::unique_ptr<rocksdb::Iterator> li(
          db_->NewIterator(rocksdb::ReadOptions(), h_[kLog]));
      const std::string pre = Prefix(r.meta.incarnation);
      for (li->Seek(Key2(r.meta.incarnation, r.checkpoint.last_seq + 1));
           li->Valid() && li->key().starts_with(pre); li->Next()) {
        const rocksdb::Slice v = li->value();
        const uint64_t seq = GetU64(li->key().data() + 8);
        if (v.size() < 15 ||
            Crc32c(v.data() + 4, v.size() - 4) != Read<uint32_t>(v.data())) {
          out.problems.push_back(absl::StrCat("readout '", name, "': log record ", seq,
                                              " failed its CRC-32C check; skipped"));
          continue;
        }
        LogRecord rec;
        rec.seq = seq;
        rec.dtype = static_cast<readout::DType>(v[4]);
        rec.target = Read<double>(v.data() + 5);
        const uint16_t idlen = Read<uint16_t>(v.data() + 13);
        if (15 + size_t{idlen} > v.size()) continue;
        rec.request_id.assign(v.data() + 15, idlen);
        rec.features.assign(v.data() + 15 + idlen, v.size() - 15 - idlen);
        r.log.push_back(std::move(rec));
      }
      std::unique_ptr<rocksdb::Iterator> vi(
          db_->NewIterator(rocksdb::ReadOptions(), h_[kVersions]));
      r.max_version = r.checkpoint.version;
      for (vi->Seek(pre); vi->Valid() && vi->key().starts_with(pre); vi->Next()) {
        const rocksdb::Slice v = vi->value();
        if (v.size() < 22) continue;
        VersionEntry e;
        e.version = static_cast<int64_t>(GetU64(vi->key().data() + 8));
        e.completions_learned = Read<int64_t>(v.data());
        e.unix_ms = Read<int64_t>(v.data() + 8);
        const uint16_t len = Read<uint16_t>(v.data() + 16);
        if (18 + size_t{len} <= v.size()) e.cause.assign(v.data() + 18, len);
        const size_t plain = 18 + size_t{len} + static_cast<size_t>(d + 1) * 8 + 4;
        if (v.size() == plain + 8) {
          e.has_last_seq = true;
          e.last_seq = Read<uint64_t>(v.data() + plain);
        }
        r.max_version = std::max(r.max_version, e.version);
        r.versions.push_back(std::move(e));
      }
      out.readouts.push_back(std::move(r));
    }
    for (it->Seek("route:"); it->Valid() && it->key().starts_with("route:"); it->Next()) {
      out.routes[it->key().ToString().substr(6)] = it->value().ToString();
    }
    {
      absl::MutexLock lock(&mu_);
      for (const auto& r : out.readouts) {
        auto ids = CheckpointIds(r.meta.incarnation);
        next_ckpt_[r.meta.incarnation] = ids.empty() ? 1 : ids.front() + 1;
      }
    }
    return out;
  }

  // -------------------------------------------------------------- dataset
  // Keys: NAME NUL seq (u64 big-endian) per record; NAME \x01 holds the
  // stats (first_seq, next_seq, records, bytes as u64), in the same batch.
  static std::string DsKey(const std::string& name, uint64_t seq) {
    std::string k = name;
    k.push_back('\0');
    PutU64(k, seq);
    return k;
  }
  static std::string DsStatsKey(const std::string& name) {
    std::string k = name;
    k.push_back('\x01');
    return k;
  }

  absl::StatusOr<DatasetStats> DatasetStatsLocked(const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ds_mu_) {
    auto it = ds_stats_.find(name);
    if (it != ds_stats_.end()) return it->second;
    DatasetStats st;
    std::string v;
    auto s = db_->Get(rocksdb::ReadOptions(), h_[kDataset], DsStatsKey(name), &v);
    if (s.ok() && v.size() == 32) {
      st.first_seq = GetU64(v.data());
      st.next_seq = GetU64(v.data() + 8);
      st.records = static_cast<int64_t>(GetU64(v.data() + 16));
      st.bytes = static_cast<int64_t>(GetU64(v.data() + 24));
    } else if (!s.ok() && !s.IsNotFound()) {
      return FromRocks(s, "dataset stats");
    }
    ds_stats_[name] = st;
    return st;
  }

  // Adds a dataset record (and the retention's deletions and the new
  // stats) to `b`; the stats to keep once `b` is written.
  absl::StatusOr<DatasetStats> AddDatasetLocked(rocksdb::WriteBatch& b,
                                                const std::string& name,
                                                DatasetRecord r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ds_mu_) {
    if (o_.dataset_max_records == 0) {
      return absl::FailedPreconditionError("no dataset is kept (--dataset_max_records=0)");
    }
    ASSIGN_OR_RETURN(DatasetStats st, DatasetStatsLocked(name));
    std::string v;
    v.reserve(r.features.size() + 21);
    v.append(4, '\0');
    v.push_back(static_cast<char>(r.dtype));
    Append(v, r.tokens);
    Append(v, r.unix_ms);
    v += r.features;
    const uint32_t crc = Crc32c(v.data() + 4, v.size() - 4);
    std::memcpy(v.data(), &crc, 4);
    if (st.records == 0) st.first_seq = st.next_seq;
    r.seq = st.next_seq++;
    b.Put(h_[kDataset], DsKey(name, r.seq), v);
    st.records += 1;
    st.bytes += static_cast<int64_t>(v.size());
    // Retention: drop the oldest beyond either bound.
    uint64_t cut = st.first_seq;
    if (st.records > o_.dataset_max_records || st.bytes > o_.dataset_max_bytes) {
      std::unique_ptr<rocksdb::Iterator> it(
          db_->NewIterator(rocksdb::ReadOptions(), h_[kDataset]));
      const std::string end = DsKey(name, r.seq);
      for (it->Seek(DsKey(name, st.first_seq));
           it->Valid() && it->key().compare(end) < 0 &&
           (st.records > o_.dataset_max_records || st.bytes > o_.dataset_max_bytes);
           it->Next()) {
        st.records -= 1;
        st.bytes -= static_cast<int64_t>(it->value().size());
        cut = GetU64(it->key().data() + it->key().size() - 8) + 1;
      }
      b.DeleteRange(h_[kDataset], DsKey(name, st.first_seq), DsKey(name, cut));
      st.first_seq = cut;
    }
    std::string sv;
    PutU64(sv, st.first_seq);
    PutU64(sv, st.next_seq);
    PutU64(sv, static_cast<uint64_t>(st.records));
    PutU64(sv, static_cast<uint64_t>(st.bytes));
    b.Put(h_[kDataset], DsStatsKey(name), sv);
    return st;
  }

  absl::StatusOr<DatasetStats> AppendDataset(const std::string& name,
                                             DatasetRecord r) override {
    absl::MutexLock lock(&ds_mu_);
    rocksdb::WriteBatch b;
    ASSIGN_OR_RETURN(DatasetStats st, AddDatasetLocked(b, name, std::move(r)));
    rocksdb::WriteOptions wo;
    wo.sync = o_.sync_log;
    RETURN_IF_ERROR(FromRocks(Write(db_, wo, &b), "append dataset"));
    ds_stats_[name] = st;
    return st;
  }

  absl::StatusOr<DatasetStats> GetDatasetStats(const std::string& name) override {
    absl::MutexLock lock(&ds_mu_);
    return DatasetStatsLocked(name);
  }

  absl::Status ScanDataset(const std::string& name, int64_t limit,
                           const std::function<bool(const DatasetRecord&)>& fn,
                           int64_t* corrupt) override {
    uint64_t from = 0;
    {
      absl::MutexLock lock(&ds_mu_);
      ASSIGN_OR_RETURN(DatasetStats st, DatasetStatsLocked(name));
      from = st.first_seq;
      if (limit > 0 && st.records > limit) {
        from = st.next_seq - static_cast<uint64_t>(limit);
      }
    }
    if (corrupt != nullptr) *corrupt = 0;
    // An iterator reads one consistent view of the store.
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kDataset]));
    std::string pre = name;
    pre.push_back('\0');
    for (it->Seek(DsKey(name, from)); it->Valid() && it->key().starts_with(pre);
         it->Next()) {
      const rocksdb::Slice v = it->value();
      if (it->key().size() != pre.size() + 8) continue;
      if (v.size() < 21 || Crc32c(v.data() + 4, v.size() - 4) != Read<uint32_t>(v.data())) {
        if (corrupt != nullptr) ++*corrupt;
        continue;
      }
      DatasetRecord r;
      r.seq = GetU64(it->key().data() + pre.size());
      r.dtype = static_cast<readout::DType>(v[4]);
      r.tokens = Read<int64_t>(v.data() + 5);
      r.unix_ms = Read<int64_t>(v.data() + 13);
      r.features.assign(v.data() + 21, v.size() - 21);
      if (!fn(r)) break;
    }
    return FromRocks(it->status(), "scan dataset");
  }

  // -------------------------------------------------------------- quality
  // Keys: series + seq (u64 big-endian); value: version i64, predicted
  // f64, truth f64, unix_ms i64. The newest quality_kept per series stay.
  absl::Status AppendQuality(const std::string& series,
                             const QualityPair& p) override {
    uint64_t seq;
    {
      absl::MutexLock lock(&q_mu_);
      auto it = q_next_.find(series);
      if (it == q_next_.end()) {
        int64_t total = 0;
        LastQualitySeq(series, &total);
        it = q_next_.emplace(series, static_cast<uint64_t>(total) + 1).first;
      }
      seq = it->second++;
    }
    std::string v;
    Append(v, p.version);
    Append(v, p.predicted);
    Append(v, p.truth);
    Append(v, p.unix_ms);
    rocksdb::WriteBatch b;
    std::string key = series;
    PutU64(key, seq);
    b.Put(h_[kQuality], key, v);
    const uint64_t kept = static_cast<uint64_t>(o_.quality_kept);
    if (seq > kept && seq % 256 == 0) {
      std::string from = series, to = series;
      PutU64(from, 0);
      PutU64(to, seq - kept);
      b.DeleteRange(h_[kQuality], from, to);
    }
    return FromRocks(Write(db_, rocksdb::WriteOptions(), &b), "append quality");
  }

  void LastQualitySeq(const std::string& series, int64_t* total) {
    *total = 0;
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kQuality]));
    std::string end = series;
    PutU64(end, ~uint64_t{0});
    it->SeekForPrev(end);
    if (it->Valid() && it->key().size() == series.size() + 8 &&
        it->key().starts_with(series)) {
      *total = static_cast<int64_t>(GetU64(it->key().data() + series.size()));
    }
  }

  absl::StatusOr<std::vector<QualityPair>> LoadQuality(const std::string& series,
                                                       int64_t max,
                                                       int64_t* total) override {
    int64_t last = 0;
    LastQualitySeq(series, &last);
    if (total != nullptr) *total = last;
    std::vector<QualityPair> out;
    const uint64_t first = last > max ? static_cast<uint64_t>(last - max) + 1 : 0;
    std::string from = series;
    PutU64(from, first);
    std::unique_ptr<rocksdb::Iterator> it(
        db_->NewIterator(rocksdb::ReadOptions(), h_[kQuality]));
    for (it->Seek(from); it->Valid() && it->key().starts_with(series); it->Next()) {
      if (it->key().size() != series.size() + 8 || it->value().size() != 32) continue;
      const char* v = it->value().data();
      out.push_back({Read<int64_t>(v), Read<double>(v + 8), Read<double>(v + 16),
                     Read<int64_t>(v + 24)});
    }
    RETURN_IF_ERROR(FromRocks(it->status(), "load quality"));
    return out;
  }

  std::map<std::string, int64_t> BytesPerFamily() override {
    std::map<std::string, int64_t> out;
    for (int cf = kMeta; cf <= kQuality; ++cf) {
      uint64_t sst = 0, mem = 0;
      db_->GetIntProperty(h_[cf], rocksdb::DB::Properties::kTotalSstFilesSize, &sst);
      db_->GetIntProperty(h_[cf], rocksdb::DB::Properties::kCurSizeAllMemTables, &mem);
      out[kFamilies[cf]] = static_cast<int64_t>(sst + mem);
    }
    return out;
  }

  rocksdb::DB* db() { return db_; }
  rocksdb::ColumnFamilyHandle* handle(int cf) { return h_[cf]; }

 private:
  const RocksStoreOptions o_;
  rocksdb::DB* db_;
  std::vector<rocksdb::ColumnFamilyHandle*> h_;
  absl::Mutex mu_;
  uint64_t next_inc_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, uint64_t> next_ckpt_ ABSL_GUARDED_BY(mu_);
  int64_t last_dedup_prune_ms_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex ds_mu_;  // dataset appends are serialized per store
  std::map<std::string, DatasetStats> ds_stats_ ABSL_GUARDED_BY(ds_mu_);
  absl::Mutex q_mu_;
  std::map<std::string, uint64_t> q_next_ ABSL_GUARDED_BY(q_mu_);
  absl::Mutex sync_mu_;  // SyncLog: one at a time
  rocksdb::SequenceNumber synced_seq_ ABSL_GUARDED_BY(sync_mu_) = 0;
  absl::Status sync_error_ ABSL_GUARDED_BY(sync_mu_);
};

absl::StatusOr<std::unique_ptr<StateStore>> OpenRocksStore(
    const std::string& dir, const RocksStoreOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  dbo.max_background_jobs = 2;
  // No fallocate: RocksDB would otherwise reserve 1.1 x the largest write
  // buffer (141 MiB, for the checkpoint families' 128 MiB) ahead of the live
  // WAL, which holds a few MiB: a data folder's disk then pays for its
  // content only. Durability is unchanged (the same writes are synced).
  dbo.allow_fallocate = o.preallocate_wal;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const char* name : kFamilies) {
    rocksdb::ColumnFamilyOptions co;
    if (std::string(name) == "checkpoints" || std::string(name) == "snapshots") {
      co.write_buffer_size = 128 << 20;  // a 64 MiB checkpoint fits one memtable
      co.compression = rocksdb::kNoCompression;
    }
    cfs.emplace_back(name, co);
  }
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(dbo, dir, cfs, &handles, &db);
  if (!s.ok()) return FromRocks(s, absl::StrCat("opening RocksDB in ", dir));
  auto store = std::make_unique<RocksStore>(o, db, std::move(handles));
  RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<StateStore>(std::move(store));
}

absl::Status CorruptNewestCheckpoint(const std::string& dir,
                                     const std::string& name) {
  ASSIGN_OR_RETURN(auto base, OpenRocksStore(dir));
  auto* store = static_cast<RocksStore*>(base.get());
  std::string mtext;
  RETURN_IF_ERROR(FromRocks(store->db()->Get(rocksdb::ReadOptions(),
                                             store->handle(kMeta),
                                             "readout:" + name, &mtext),
                            "readout metadata"));
  const uint64_t inc = json::parse(mtext).at("incarnation").get<uint64_t>();
  auto ids = store->CheckpointIds(inc);
  if (ids.empty()) return absl::NotFoundError("no checkpoint");
  const std::string b = Key2(inc, ids.front());
  for (const std::string& key : {Part(b, 'C', 0), Part(b, 'T')}) {
    std::string v;
    if (!store->db()->Get(rocksdb::ReadOptions(), store->handle(kCheckpoints), key, &v).ok()) {
      continue;
    }
    v[v.size() / 2] ^= 0x5A;
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return FromRocks(store->db()->Put(wo, store->handle(kCheckpoints), key, v),
                     "corrupting");
  }
  return absl::NotFoundError("checkpoint has no payload");
}

}  // namespace leap::storage
