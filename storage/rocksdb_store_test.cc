// Unit tests of RocksStore on a real RocksDB in a temporary directory:
// create / load round trips (theta and P bit for bit, across P chunks),
// the feedback log after a checkpoint, dedup of recorded request ids,
// checkpoint retention and the fallback past a corrupt newest checkpoint
// (no feedback lost), snapshots, versions, routes, frozen flags, deletes
// (a re-created name never sees the old records) and reopening.
#include "storage/rocksdb_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/readout_fixtures.h"

namespace leap::storage {
namespace {

constexpr int64_t kDim = 12;

class RocksStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>(absl::StrCat(
        "rocks_store_test_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    dir_ = tmp_->File("db");
    state_ = testing::RandomState(kDim, 7);
  }
  void TearDown() override {
    store_.reset();
    tmp_.reset();
  }
  void Open(RocksStoreOptions o = {}) {
    store_.reset();
    auto s = OpenRocksStore(dir_, o);
    // Nothing can go on without the store: end the test here.
    if (!s.ok()) throw std::runtime_error(s.status().ToString());
    store_ = std::move(*s);
  }
  void Close() { store_.reset(); }
  RecoveredState Load() {
    auto s = store_->Load();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : RecoveredState{};
  }

  ReadoutMeta Meta(const std::string& name) {
    ReadoutMeta m;
    m.name = name;
    m.spec = state_.spec;
    m.standardizer = state_.standardizer;
    m.has_p = true;
    m.created_unix_ms = 1700000000000;
    return m;
  }
  // A checkpoint whose theta and P carry `tag` (so each is recognizable).
  ReadoutCheckpoint Checkpoint(int64_t version, uint64_t last_seq, double tag) {
    ReadoutCheckpoint c;
    c.version = version;
    c.completions_learned = static_cast<int64_t>(last_seq);
    c.last_seq = last_seq;
    c.unix_ms = 1700000000000 + version;
    c.theta = state_.theta;
    c.theta[0] = tag;
    c.p = *state_.p;
    (*c.p)(1, 1) = static_cast<float>(tag);
    return c;
  }
  LogRecord Record(uint64_t seq) {
    LogRecord r;
    r.seq = seq;
    r.request_id = absl::StrCat("req-", seq);
    r.dedup_keys = {absl::StrCat("key-", seq, "-a"), absl::StrCat("key-", seq, "-b")};
    std::mt19937_64 rng(seq);
    r.features = testing::Bytes(testing::RandomFeatures(state_, rng));
    r.target = std::sqrt(static_cast<double>(seq * 10));
    return r;
  }
  ReadoutMeta Create(const std::string& name, double tag = 0.25) {
    ReadoutMeta m = Meta(name);
    EXPECT_TRUE(store_->CreateReadout(&m, Checkpoint(1, 0, tag)).ok());
    return m;
  }

  static void ExpectSameP(const readout::SymMatrix& a, const readout::SymMatrix& b) {
    ASSERT_EQ(a.n(), b.n());
    for (int64_t i = 0; i < a.n(); ++i) {
      for (int64_t j = 0; j < a.n(); ++j) ASSERT_EQ(a(i, j), b(i, j)) << i << "," << j;
    }
  }

  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::string dir_;
  readout::ReadoutState state_;
  std::unique_ptr<StateStore> store_;
};

TEST_F(RocksStoreTest, CreatedReadoutsLoadBitForBitAcrossPChunks) {
  state_ = testing::RandomState(63, 7);
  RocksStoreOptions o;
  o.chunk_bytes = 4096;  // P of 64 x 64 floats in 4 chunks
  Open(o);
  ReadoutMeta a = Create("a", 0.5);
  ReadoutMeta b = Create("b", 0.75);
  EXPECT_NE(a.incarnation, 0u);
  EXPECT_NE(a.incarnation, b.incarnation);
  ASSERT_TRUE(store_->PutRoute("chat", R"({"route":"chat"})").ok());
  ASSERT_TRUE(store_->PutRoute("", R"({"route":""})").ok());
  Close();
  Open(o);
  RecoveredState st = Load();
  EXPECT_TRUE(st.problems.empty());
  ASSERT_EQ(st.readouts.size(), 2u);
  for (const RecoveredReadout& r : st.readouts) {
    const double tag = r.meta.name == "a" ? 0.5 : 0.75;
    EXPECT_EQ(r.meta.incarnation, r.meta.name == "a" ? a.incarnation : b.incarnation);
    EXPECT_EQ(r.meta.spec.dim, 63);
    EXPECT_EQ(r.meta.spec.lambda, state_.spec.lambda);
    EXPECT_EQ(r.meta.created_unix_ms, 1700000000000);
    EXPECT_TRUE(r.meta.has_p);
    EXPECT_FALSE(r.meta.frozen);
    EXPECT_EQ(r.meta.standardizer.mean, state_.standardizer.mean);
    EXPECT_EQ(r.meta.standardizer.scale, state_.standardizer.scale);
    const ReadoutCheckpoint want = Checkpoint(1, 0, tag);
    EXPECT_EQ(r.checkpoint.theta, want.theta);
    ASSERT_TRUE(r.checkpoint.p.has_value());
    ExpectSameP(*r.checkpoint.p, *want.p);
    EXPECT_EQ(r.checkpoint.version, 1);
    EXPECT_TRUE(r.log.empty());
  }
  EXPECT_EQ(st.routes.size(), 2u);
  EXPECT_EQ(st.routes["chat"], R"({"route":"chat"})");
  ASSERT_TRUE(store_->DeleteRoute("chat").ok());
  EXPECT_EQ(Load().routes.count("chat"), 0u);
}

TEST_F(RocksStoreTest, LoadReturnsTheLogAfterTheNewestCheckpointInOrder) {
  Open();
  ReadoutMeta m = Create("r");
  std::vector<LogRecord> recs;
  for (uint64_t seq = 1; seq <= 10; ++seq) recs.push_back(Record(seq));
  ASSERT_TRUE(store_->AppendLog(m, {recs.data(), 4}).ok());
  ASSERT_TRUE(store_->AppendLog(m, {recs.data() + 4, 6}).ok());
  ASSERT_TRUE(store_->WriteCheckpoint(m, Checkpoint(3, 4, 1.5)).ok());
  Close();
  Open();
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  const RecoveredReadout& r = st.readouts[0];
  EXPECT_EQ(r.checkpoint.last_seq, 4u);
  EXPECT_EQ(r.checkpoint.version, 3);
  EXPECT_EQ(r.checkpoint.theta[0], 1.5);
  ASSERT_EQ(r.log.size(), 6u);
  for (size_t i = 0; i < r.log.size(); ++i) {
    const LogRecord& want = recs[4 + i];
    EXPECT_EQ(r.log[i].seq, want.seq);
    EXPECT_EQ(r.log[i].request_id, want.request_id);
    EXPECT_EQ(r.log[i].features, want.features);
    EXPECT_EQ(r.log[i].dtype, want.dtype);
    EXPECT_EQ(r.log[i].target, want.target);
  }
}

TEST_F(RocksStoreTest, DedupKeysAreRememberedWithinTheWindow) {
  Open();
  ReadoutMeta m = Create("r");
  std::vector<LogRecord> recs = {Record(1), Record(2)};
  ASSERT_TRUE(store_->AppendLog(m, recs).ok());
  EXPECT_TRUE(*store_->WasRecorded("key-1-a"));
  EXPECT_TRUE(*store_->WasRecorded("key-1-b"));
  EXPECT_TRUE(*store_->WasRecorded("key-2-a"));
  EXPECT_FALSE(*store_->WasRecorded("key-3-a"));
  // The keys are what counts, not the request id.
  EXPECT_FALSE(*store_->WasRecorded("req-1"));
  Close();
  Open();
  EXPECT_TRUE(*store_->WasRecorded("key-2-b"));
  // A window of 0 ms: nothing counts as recent.
  RocksStoreOptions o;
  o.dedup_window_ms = 0;
  Open(o);
  EXPECT_FALSE(*store_->WasRecorded("key-1-a"));
}

TEST_F(RocksStoreTest, CorruptNewestCheckpointFallsBackWithoutLosingFeedback) {
  Open();  // checkpoints_kept = 2
  ReadoutMeta m = Create("r");
  std::vector<LogRecord> recs;
  for (uint64_t seq = 1; seq <= 9; ++seq) recs.push_back(Record(seq));
  ASSERT_TRUE(store_->AppendLog(m, {recs.data(), 3}).ok());
  ASSERT_TRUE(store_->WriteCheckpoint(m, Checkpoint(2, 3, 2.0)).ok());
  ASSERT_TRUE(store_->AppendLog(m, {recs.data() + 3, 3}).ok());
  ASSERT_TRUE(store_->WriteCheckpoint(m, Checkpoint(3, 6, 3.0)).ok());
  ASSERT_TRUE(store_->AppendLog(m, {recs.data() + 6, 3}).ok());
  Close();
  ASSERT_TRUE(CorruptNewestCheckpoint(dir_, "r").ok());
  Open();
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  const RecoveredReadout& r = st.readouts[0];
  // The older checkpoint, and the log from it: records 4..9.
  EXPECT_EQ(r.checkpoint.version, 2);
  EXPECT_EQ(r.checkpoint.theta[0], 2.0);
  ASSERT_EQ(r.log.size(), 6u);
  EXPECT_EQ(r.log.front().seq, 4u);
  EXPECT_EQ(r.log.back().seq, 9u);
  ASSERT_EQ(st.problems.size(), 1u);
  EXPECT_NE(st.problems[0].find("corrupt"), std::string::npos) << st.problems[0];
  EXPECT_NE(st.problems[0].find("'r'"), std::string::npos) << st.problems[0];
  // The version history still knows the newer version.
  EXPECT_GE(r.max_version, 2);
}

TEST_F(RocksStoreTest, RetentionKeepsTheNewestCheckpointsAndTheirLog) {
  RocksStoreOptions o;
  o.checkpoints_kept = 1;
  Open(o);
  ReadoutMeta m = Create("r");
  for (uint64_t seq = 1; seq <= 6; ++seq) {
    std::vector<LogRecord> one = {Record(seq)};
    ASSERT_TRUE(store_->AppendLog(m, one).ok());
    if (seq % 2 == 0) {
      ASSERT_TRUE(store_->WriteCheckpoint(m, Checkpoint(1 + seq / 2, seq, seq)).ok());
    }
  }
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  EXPECT_EQ(st.readouts[0].checkpoint.last_seq, 6u);
  EXPECT_TRUE(st.readouts[0].log.empty());
  // With only one checkpoint kept, a corrupt one leaves nothing to load:
  // the readout is skipped and the problem says so.
  Close();
  ASSERT_TRUE(CorruptNewestCheckpoint(dir_, "r").ok());
  Open(o);
  st = Load();
  EXPECT_TRUE(st.readouts.empty());
  ASSERT_EQ(st.problems.size(), 2u);
  EXPECT_NE(st.problems[1].find("no valid checkpoint"), std::string::npos)
      << st.problems[1];
}

// Superseded checkpoints leave the disk when the next one is written, not
// at RocksDB's next compaction of the family: the checkpoint family's size
// stays at the kept checkpoints, and those still load (the newest bit for
// bit, and the previous one behind a corrupt newest). Without the prompt
// compaction the same writes leave the range-deleted files in place.
TEST_F(RocksStoreTest, PrunedCheckpointsGiveTheirSpaceBackAtOnce) {
  state_ = testing::RandomState(255, 9);  // P: 4 x 256^2 bytes = 256 KiB
  const double p_bytes = 4.0 * 256 * 256;
  for (const bool compact : {false, true}) {
    SCOPED_TRACE(compact ? "compact_pruned_checkpoints" : "RocksDB's own compactions");
    std::filesystem::remove_all(dir_);
    RocksStoreOptions o;
    o.checkpoints_kept = 2;
    o.chunk_bytes = 64 << 10;  // P in 4 chunks
    o.compact_pruned_checkpoints = compact;
    Open(o);
    ReadoutMeta m = Create("r");
    std::vector<double> in_p;  // the family's size after each write, in P
    for (int64_t i = 1; i <= 8; ++i) {
      ASSERT_TRUE(store_->WriteCheckpoint(m, Checkpoint(1 + i, 0, 100.0 + i)).ok());
      in_p.push_back(static_cast<double>(store_->BytesPerFamily()["checkpoints"]) / p_bytes);
    }
    std::printf("%s: checkpoints family after writes 1..8, in P:",
                compact ? "compacted" : "not compacted");
    for (double x : in_p) std::printf(" %.2f", x);
    std::printf("\n");
    if (compact) {
      // The 2 kept, plus manifests, theta and SST metadata.
      for (double x : in_p) EXPECT_LT(x, 2.2);
      EXPECT_GT(in_p.back(), 1.9);
    } else {
      // 3 checkpoints' files after the 2nd write: RocksDB compacts the
      // family at 4 files, so the pruned first one is still there.
      EXPECT_GT(in_p[1], 2.9);
    }
    Close();
    Open(o);
    RecoveredState st = Load();
    ASSERT_EQ(st.readouts.size(), 1u);
    EXPECT_EQ(st.readouts[0].checkpoint.version, 9);
    EXPECT_EQ(st.readouts[0].checkpoint.theta[0], 108.0);
    ExpectSameP(*st.readouts[0].checkpoint.p, *Checkpoint(9, 0, 108.0).p);
    Close();
    ASSERT_TRUE(CorruptNewestCheckpoint(dir_, "r").ok());
    Open(o);
    st = Load();
    ASSERT_EQ(st.readouts.size(), 1u);
    EXPECT_EQ(st.readouts[0].checkpoint.version, 8);
    ExpectSameP(*st.readouts[0].checkpoint.p, *Checkpoint(8, 0, 107.0).p);
    Close();
  }
}

TEST_F(RocksStoreTest, SnapshotsRoundTripAndReplaceTheirLabel) {
  Open();
  ReadoutMeta m = Create("r");
  SnapshotInfo info{"good", 4, 30, 0.8, 1700000000123};
  ASSERT_TRUE(store_->PutSnapshot(m, info, Checkpoint(4, 30, 4.5)).ok());
  SnapshotInfo nan_info{"nan", 5, 31, NAN, 1700000000124};
  ASSERT_TRUE(store_->PutSnapshot(m, nan_info, Checkpoint(5, 31, 5.5)).ok());
  Close();
  Open();
  auto got = store_->GetSnapshot(m, "good");
  ASSERT_TRUE(got.ok()) << got.status();
  const ReadoutCheckpoint want = Checkpoint(4, 30, 4.5);
  EXPECT_EQ(got->theta, want.theta);
  ExpectSameP(*got->p, *want.p);
  EXPECT_EQ(got->version, 4);
  EXPECT_EQ(got->completions_learned, 30);
  auto list = store_->ListSnapshots(m);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  for (const SnapshotInfo& s : *list) {
    if (s.label == "good") {
      EXPECT_EQ(s.version, 4);
      EXPECT_EQ(s.completions_learned, 30);
      EXPECT_DOUBLE_EQ(s.spearman, 0.8);
      EXPECT_EQ(s.unix_ms, 1700000000123);
    } else {
      EXPECT_EQ(s.label, "nan");
      EXPECT_TRUE(std::isnan(s.spearman));
    }
  }
  // The same label again replaces the state.
  ASSERT_TRUE(store_->PutSnapshot(m, info, Checkpoint(6, 40, 6.5)).ok());
  EXPECT_EQ(store_->GetSnapshot(m, "good")->theta[0], 6.5);
  EXPECT_EQ(store_->ListSnapshots(m)->size(), 2u);
  absl::Status missing = store_->GetSnapshot(m, "none").status();
  EXPECT_TRUE(absl::IsNotFound(missing)) << missing;
}

TEST_F(RocksStoreTest, VersionsAreKeptWithinTheRetention) {
  RocksStoreOptions o;
  o.versions_kept = 3;
  Open(o);
  ReadoutMeta m = Create("r");
  for (int64_t v = 2; v <= 7; ++v) {
    VersionEntry e{v, v * 8, 1700000000000 + v, "rls"};
    e.has_last_seq = v % 2 == 0;
    e.last_seq = static_cast<uint64_t>(v * 8);
    Eigen::VectorXd theta = state_.theta;
    theta[1] = static_cast<double>(v);
    ASSERT_TRUE(store_->PutVersion(m, e, theta).ok());
  }
  Close();
  Open(o);
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  const RecoveredReadout& r = st.readouts[0];
  EXPECT_EQ(r.max_version, 7);
  ASSERT_GE(r.versions.size(), 3u);
  EXPECT_LE(r.versions.size(), 4u);
  EXPECT_EQ(r.versions.back().version, 7);
  EXPECT_EQ(r.versions.back().completions_learned, 56);
  EXPECT_EQ(r.versions.back().cause, "rls");
  for (size_t i = 1; i < r.versions.size(); ++i) {
    EXPECT_EQ(r.versions[i].version, r.versions[i - 1].version + 1);
  }
  for (const VersionEntry& e : r.versions) {
    EXPECT_EQ(e.has_last_seq, e.version % 2 == 0) << e.version;
    if (e.has_last_seq) {
      EXPECT_EQ(e.last_seq, static_cast<uint64_t>(e.version * 8));
    }
  }
  // Each kept version's theta, exactly; a pruned one is NOT_FOUND.
  auto theta = store_->GetVersionTheta(m, 6);
  ASSERT_TRUE(theta.ok()) << theta.status();
  Eigen::VectorXd want = state_.theta;
  want[1] = 6.0;
  EXPECT_EQ(*theta, want);
  EXPECT_TRUE(absl::IsNotFound(store_->GetVersionTheta(m, 2).status()));
  EXPECT_TRUE(absl::IsNotFound(store_->GetVersionTheta(m, 99).status()));
}

TEST_F(RocksStoreTest, DeletedNamesComeBackWithNothingOfTheOldReadout) {
  Open();
  ReadoutMeta old = Create("r", 0.5);
  std::vector<LogRecord> recs = {Record(1), Record(2)};
  ASSERT_TRUE(store_->AppendLog(old, recs).ok());
  ASSERT_TRUE(store_->PutSnapshot(old, {"s", 1, 0, NAN, 0}, Checkpoint(1, 0, 0.5)).ok());
  ASSERT_TRUE(store_->SetFrozen(old, true, "rls: P lost definiteness").ok());
  EXPECT_TRUE(Load().readouts[0].meta.frozen);
  EXPECT_EQ(Load().readouts[0].meta.frozen_reason, "rls: P lost definiteness");
  // Resumed: the reason goes with the flag.
  ASSERT_TRUE(store_->SetFrozen(old, false).ok());
  EXPECT_FALSE(Load().readouts[0].meta.frozen);
  EXPECT_EQ(Load().readouts[0].meta.frozen_reason, "");
  ASSERT_TRUE(store_->SetFrozen(old, true).ok());
  ASSERT_TRUE(store_->DeleteReadout(old).ok());
  EXPECT_TRUE(Load().readouts.empty());
  ReadoutMeta again = Create("r", 0.625);
  EXPECT_GT(again.incarnation, old.incarnation);
  Close();
  Open();
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  EXPECT_EQ(st.readouts[0].meta.incarnation, again.incarnation);
  EXPECT_FALSE(st.readouts[0].meta.frozen);
  EXPECT_EQ(st.readouts[0].checkpoint.theta[0], 0.625);
  EXPECT_TRUE(st.readouts[0].log.empty());
  EXPECT_TRUE(store_->ListSnapshots(again)->empty());
  // Incarnations are never reused, across reopening too.
  ReadoutMeta third = Create("t");
  EXPECT_GT(third.incarnation, again.incarnation);
}

TEST_F(RocksStoreTest, FrozenReadoutWithoutP) {
  Open();
  ReadoutMeta m = Meta("fixed");
  m.has_p = false;
  m.frozen = true;
  ReadoutCheckpoint c = Checkpoint(1, 0, 0.5);
  c.p.reset();
  ASSERT_TRUE(store_->CreateReadout(&m, c).ok());
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  EXPECT_FALSE(st.readouts[0].meta.has_p);
  EXPECT_TRUE(st.readouts[0].meta.frozen);
  EXPECT_FALSE(st.readouts[0].checkpoint.p.has_value());
  EXPECT_EQ(st.readouts[0].checkpoint.theta, c.theta);
}

// A data folder costs its content on disk, not RocksDB's WAL preallocation
// (1.1 x the largest write buffer: 141 MiB per folder before allow_fallocate
// was turned off): the blocks allocated under an open store holding one
// readout and a synced feedback log stay far below it.
TEST_F(RocksStoreTest, AnOpenStoreReservesNoWalSpaceAheadOfItsContent) {
  RocksStoreOptions o;
  o.sync_log = true;
  Open(o);
  const ReadoutMeta m = Create("r");
  std::vector<LogRecord> log;
  for (uint64_t seq = 1; seq <= 32; ++seq) log.push_back(Record(seq));
  ASSERT_TRUE(store_->AppendLog(m, log).ok());
  int64_t allocated = 0, wal_files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_)) {
    struct stat st;
    ASSERT_EQ(::lstat(e.path().c_str(), &st), 0) << e.path();
    allocated += int64_t{st.st_blocks} * 512;
    if (e.path().extension() == ".log") ++wal_files;
  }
  EXPECT_GE(wal_files, 1);  // the live WAL is there, and counted
  EXPECT_LT(allocated, int64_t{8} << 20) << allocated << " bytes allocated";
  // Still durable: a reopen finds every record.
  Close();
  Open();
  const RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  EXPECT_EQ(st.readouts[0].log.size(), 32u);
}

TEST_F(RocksStoreTest, OptionsAreValidated) {
  RocksStoreOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.checkpoints_kept = 0;
  EXPECT_EQ(o.Validate().message(), "checkpoints_kept must be >= 1, got 0");
  EXPECT_FALSE(OpenRocksStore(dir_, o).ok());
  o = {};
  o.versions_kept = -3;
  EXPECT_EQ(o.Validate().message(), "versions_kept must be >= 1, got -3");
}

// The dataset keeps the newest records within both bounds, survives a
// reopen (stats and records), and reads back what was written.
TEST_F(RocksStoreTest, DatasetRetentionByCountAndBytes) {
  RocksStoreOptions o;
  o.dataset_max_records = 5;
  o.dataset_max_bytes = 1 << 20;
  Open(o);
  auto rec = [](int64_t i, size_t bytes) {
    DatasetRecord r;
    r.dtype = readout::DType::kFloat32;
    r.features.assign(bytes, static_cast<char>('a' + i % 26));
    r.tokens = 100 + i;
    r.unix_ms = i;
    return r;
  };
  for (int64_t i = 0; i < 8; ++i) {
    auto st = store_->AppendDataset("chat", rec(i, 64));
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->records, std::min<int64_t>(i + 1, 5));
  }
  ASSERT_TRUE(store_->AppendDataset("other", rec(0, 64)).ok());
  Close();
  Open(o);
  auto st = store_->GetDatasetStats("chat");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->records, 5);
  EXPECT_EQ(st->first_seq, 4u);
  EXPECT_EQ(st->next_seq, 9u);
  EXPECT_EQ(st->bytes, 5 * (64 + 21));
  std::vector<int64_t> tokens;
  ASSERT_TRUE(store_->ScanDataset("chat", 0, [&](const DatasetRecord& r) {
    tokens.push_back(r.tokens);
    EXPECT_EQ(r.features, std::string(64, static_cast<char>('a' + (r.tokens - 100) % 26)));
    return true;
  }).ok());
  EXPECT_EQ(tokens, (std::vector<int64_t>{103, 104, 105, 106, 107}));
  tokens.clear();
  ASSERT_TRUE(store_->ScanDataset("chat", 2, [&](const DatasetRecord& r) {
    tokens.push_back(r.tokens);
    return true;
  }).ok());
  EXPECT_EQ(tokens, (std::vector<int64_t>{106, 107}));
  // The byte bound: 3 records of 1000 bytes fit in 3200, a 4th pushes one out.
  o.dataset_max_bytes = 3200;
  Open(o);
  for (int64_t i = 0; i < 4; ++i) ASSERT_TRUE(store_->AppendDataset("big", rec(i, 1000)).ok());
  st = store_->GetDatasetStats("big");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->records, 3);
  EXPECT_LE(st->bytes, 3200);
  // Off: refused.
  o.dataset_max_records = 0;
  Open(o);
  EXPECT_EQ(store_->AppendDataset("chat", rec(9, 8)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A feedback-log record and a dataset record appended together (one
// WriteBatch) are both there after a reopen, the dataset's retention and
// stats apply as for AppendDataset; with no dataset kept the log record is
// still written and the dataset's result says why.
TEST_F(RocksStoreTest, ALogRecordAndItsDatasetRecordAreAppendedTogether) {
  RocksStoreOptions o;
  o.dataset_max_records = 2;
  Open(o);
  ReadoutMeta m = Create("chat");
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    LogRecord r = Record(seq);
    DatasetRecord d;
    d.dtype = r.dtype;
    d.features = r.features;
    d.tokens = static_cast<int64_t>(seq) * 10;
    d.unix_ms = static_cast<int64_t>(seq);
    absl::StatusOr<DatasetStats> ds = absl::UnknownError("unset");
    ASSERT_TRUE(store_->AppendLogAndDataset(m, {&r, 1}, "chat", std::move(d), &ds).ok());
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ(ds->records, std::min<int64_t>(static_cast<int64_t>(seq), 2));
    EXPECT_EQ(ds->next_seq, seq + 1);
  }
  Close();
  Open(o);
  RecoveredState st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  ASSERT_EQ(st.readouts[0].log.size(), 3u);
  EXPECT_EQ(st.readouts[0].log[2].features, Record(3).features);
  EXPECT_TRUE(*store_->WasRecorded("key-3-b"));
  std::vector<int64_t> tokens;
  ASSERT_TRUE(store_->ScanDataset("chat", 0, [&](const DatasetRecord& r) {
    tokens.push_back(r.tokens);
    EXPECT_EQ(r.features, Record(static_cast<uint64_t>(r.tokens / 10)).features);
    return true;
  }).ok());
  EXPECT_EQ(tokens, (std::vector<int64_t>{20, 30}));
  // No dataset: the log record alone.
  o.dataset_max_records = 0;
  Open(o);
  LogRecord r = Record(4);
  absl::StatusOr<DatasetStats> ds = absl::UnknownError("unset");
  ASSERT_TRUE(store_->AppendLogAndDataset(m, {&r, 1}, "chat", DatasetRecord{}, &ds).ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kFailedPrecondition);
  st = Load();
  ASSERT_EQ(st.readouts.size(), 1u);
  EXPECT_EQ(st.readouts[0].log.size(), 4u);
}

// Quality pairs: the newest come back in order with the count ever
// appended, after a reopen.
TEST_F(RocksStoreTest, QualityPairsPersist) {
  Open();
  const std::string series = ReadoutQualitySeries(3);
  for (int64_t i = 0; i < 10; ++i) {
    ASSERT_TRUE(store_->AppendQuality(series, {i / 4, 1.0 * i, 2.0 * i, i}).ok());
  }
  ASSERT_TRUE(store_->AppendQuality(ArmQualitySeries("", "a", "r"), {1, 1, 1, 1}).ok());
  Close();
  Open();
  int64_t total = 0;
  auto pairs = store_->LoadQuality(series, 4, &total);
  ASSERT_TRUE(pairs.ok());
  EXPECT_EQ(total, 10);
  ASSERT_EQ(pairs->size(), 4u);
  EXPECT_EQ((*pairs)[0].predicted, 6.0);
  EXPECT_EQ((*pairs)[3].truth, 18.0);
  EXPECT_EQ((*pairs)[3].version, 2);
  ASSERT_TRUE(store_->AppendQuality(series, {5, 0, 0, 0}).ok());
  pairs = store_->LoadQuality(series, 100, &total);
  ASSERT_TRUE(pairs.ok());
  EXPECT_EQ(total, 11);
  EXPECT_EQ(pairs->size(), 11u);
}

}  // namespace
}  // namespace leap::storage
