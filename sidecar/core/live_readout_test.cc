// Unit tests of LiveReadout, in process: RLS batches and their publishes
// (theta against the FP64 anchored closed form), partial batches flushed
// after their deadline, freezing, an RLS failure that stops adaptation and
// keeps serving the last good version, rollback dropping what was queued,
// online quality per version, and durability through a real RocksDB store
// (checkpoints bit for bit; a completion whose log write fails is neither
// acknowledged nor learned).
#include "sidecar/core/live_readout.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/barrier.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "storage/rocksdb_store.h"
#include "tests/support/readout_fixtures.h"

namespace leap::sidecar {
namespace {

constexpr int64_t kDim = 16;
constexpr absl::Duration kDeadline = absl::Seconds(30);

// Waits for publishes (events, with a deadline; no sleeps).
class VersionWatch : public PublishListener {
 public:
  void OnPublish(const std::string&,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    absl::MutexLock lock(&mu_);
    latest_ = std::max(latest_, v->version);
    ++count_;
  }
  // True once a version >= v was published (false at the deadline).
  bool AwaitVersion(int64_t v) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return latest_ >= v; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), kDeadline);
  }
  int count() {
    absl::MutexLock lock(&mu_);
    return count_;
  }

 private:
  absl::Mutex mu_;
  int64_t latest_ ABSL_GUARDED_BY(mu_) = 0;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

class LiveReadoutTest : public ::testing::Test {
 protected:
  LiveReadoutTest() : state_(testing::RandomState(kDim, 21)) {
    hub_.Subscribe(watch_);
  }
  std::unique_ptr<LiveReadout> Make(LiveReadoutOptions o,
                                    storage::StateStore* store = nullptr,
                                    storage::ReadoutMeta meta = {}) {
    LiveReadoutInit init;
    init.name = "r";
    init.state = state_;
    init.store = store;
    init.meta = std::move(meta);
    return std::make_unique<LiveReadout>(std::move(init), o, &metrics_, &hub_);
  }
  // A RocksDB store in `tmp` (its folder "db").
  static std::unique_ptr<storage::StateStore> OpenStore(
      const ::leap::testing::ScopedTempDir& tmp) {
    auto opened = storage::OpenRocksStore(tmp.File("db"));
    EXPECT_TRUE(opened.ok()) << opened.status();
    return opened.ok() ? std::move(*opened) : nullptr;
  }
  // Creates readout `name` of state_ (at version 1, with P unless
  // without_p) in `store`; returns its metadata, incarnation assigned.
  storage::ReadoutMeta CreateInStore(storage::StateStore& store,
                                     const std::string& name = "r",
                                     bool without_p = false) {
    storage::ReadoutMeta meta;
    meta.name = name;
    meta.spec = state_.spec;
    meta.standardizer = state_.standardizer;
    meta.has_p = !without_p;
    storage::ReadoutCheckpoint initial;
    initial.version = 1;
    initial.theta = state_.theta;
    if (!without_p) initial.p = state_.p;
    EXPECT_TRUE(store.CreateReadout(&meta, initial).ok());
    return meta;
  }
  static LiveReadoutOptions Options(int batch, absl::Duration flush = absl::Hours(1)) {
    LiveReadoutOptions o;
    o.rls_batch = batch;
    // Fixed batches (these tests count versions); the adaptive ones are
    // tested with rls_batch_max set explicitly.
    o.rls_batch_max = batch;
    o.flush_after_ns = absl::ToInt64Nanoseconds(flush);
    return o;
  }
  // Learns one random completion (also into `reference` when given).
  void Learn(LiveReadout& r, testing::ClosedForm* reference = nullptr,
             bool nan = false) {
    std::vector<float> x = testing::RandomFeatures(state_, rng_);
    if (nan) x[2] = std::nanf("");
    const double y = 5.0 + 20.0 * std::abs(std::sin(++n_));
    ASSERT_TRUE(r.Learn({absl::StrCat("c", n_), readout::FeatureView::F32(x.data(), kDim), y, {}})
                    .ok());
    if (reference != nullptr) reference->Learn(x, y);
  }

  Metrics metrics_;
  PublishHub hub_;
  std::shared_ptr<VersionWatch> watch_ = std::make_shared<VersionWatch>();
  readout::ReadoutState state_;
  std::mt19937_64 rng_{3};
  int n_ = 0;
};

TEST_F(LiveReadoutTest, FullBatchesPublishTheClosedForm) {
  auto r = Make(Options(3));
  testing::ClosedForm reference(state_);
  EXPECT_EQ(r->current()->version, 1);
  EXPECT_EQ(r->current()->cause, "create");
  for (int i = 0; i < 3; ++i) Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(2));
  EXPECT_EQ(r->current()->completions_learned, 3);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
  // The next three are one batch (the flush deadline is an hour away): the
  // next version holds all six, and there is no version of four or five.
  for (int i = 0; i < 3; ++i) Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(3));
  const auto versions = r->Versions();
  ASSERT_EQ(versions.size(), 3u);
  EXPECT_EQ(versions[2].completions_learned, 6);
  EXPECT_EQ(versions[2].cause, "rls");
  EXPECT_EQ(r->completions_learned(), 6);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
  // The published folded weights are those of the learned theta.
  const Eigen::VectorXd theta = r->Export().theta;
  std::vector<float> x = testing::RandomFeatures(state_, rng_);
  auto score = r->current()->folded.Score(readout::FeatureView::F32(x.data(), kDim));
  ASSERT_TRUE(score.ok());
  std::vector<double> xd(x.begin(), x.end());
  EXPECT_NEAR(*score, testing::ReferenceScore(state_.standardizer, theta, xd),
              testing::ScoreTolerance(state_.standardizer, theta, xd));
}

TEST_F(LiveReadoutTest, APartialBatchIsAppliedAfterItsDeadline) {
  auto r = Make(Options(8, absl::Milliseconds(5)));
  testing::ClosedForm reference(state_);
  Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(2));
  EXPECT_EQ(r->completions_learned(), 1);
  r->WaitIdle();
  EXPECT_EQ(r->backlog(), 0);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
}

TEST_F(LiveReadoutTest, FrozenQueuesAndResumes) {
  auto r = Make(Options(2));
  ASSERT_TRUE(r->SetFrozen(true).ok());
  EXPECT_TRUE(r->frozen());
  testing::ClosedForm reference(state_);
  for (int i = 0; i < 4; ++i) Learn(*r, &reference);
  r->WaitIdle();  // returns while frozen: nothing will be applied
  EXPECT_EQ(r->backlog(), 4);
  EXPECT_EQ(r->current()->version, 1);
  EXPECT_EQ(r->Export().theta, state_.theta);
  ASSERT_TRUE(r->SetFrozen(false).ok());
  r->WaitIdle();
  EXPECT_EQ(r->backlog(), 0);
  EXPECT_EQ(r->current()->version, 3);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
}

// Adaptive batches: a backlog is applied in batches of up to rls_batch_max,
// and the result is the closed form whatever the batch sizes.
TEST_F(LiveReadoutTest, ABacklogIsAppliedInBatchesOfUpToTheMaximum) {
  for (int max : {2, 256}) {
    LiveReadoutOptions o = Options(2);
    o.rls_batch_max = max;
    o.rls_threads = 2;
    auto r = Make(o);
    ASSERT_TRUE(r->SetFrozen(true).ok());
    testing::ClosedForm reference(state_);
    for (int i = 0; i < 300; ++i) Learn(*r, &reference);
    ASSERT_TRUE(r->SetFrozen(false).ok());
    r->WaitIdle();
    EXPECT_EQ(r->backlog(), 0);
    EXPECT_EQ(r->completions_learned(), 300);
    // 150 batches of 2, or 256 + 44.
    EXPECT_EQ(r->current()->version, max == 2 ? 151 : 3) << max;
    const auto versions = r->Versions();
    if (max == 256) {
      ASSERT_GE(versions.size(), 2u);
      EXPECT_EQ(versions[versions.size() - 2].completions_learned, 256);
    }
    EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6) << max;
  }
}

TEST_F(LiveReadoutTest, ACompletionThatCannotBeAppliedIsDroppedWithoutFreezing) {
  auto r = Make(Options(1));
  const int published = watch_->count();
  Learn(*r, nullptr, /*nan=*/true);
  r->WaitIdle();
  EXPECT_FALSE(r->frozen());
  EXPECT_EQ(r->frozen_reason(), "");
  EXPECT_EQ(r->backlog(), 0);
  EXPECT_EQ(r->current()->version, 1);
  EXPECT_EQ(r->Export().theta, state_.theta);
  EXPECT_EQ(watch_->count(), published);
  // The ones after it are learned.
  testing::ClosedForm reference(state_);
  Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(2));
  EXPECT_EQ(r->completions_learned(), 1);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
}

TEST_F(LiveReadoutTest, AnRlsFailureFreezesWithItsReasonAndKeepsTheCompletions) {
  // An indefinite P: every update is rejected (loss of definiteness).
  state_.p = readout::SymMatrix::ScaledIdentity(kDim + 1, -1.0f);
  auto r = Make(Options(2));
  const int published = watch_->count();
  Learn(*r);
  Learn(*r);
  r->WaitIdle();
  EXPECT_TRUE(r->frozen());
  EXPECT_NE(r->frozen_reason().find("rls: RLS batch rejected"), std::string::npos)
      << r->frozen_reason();
  EXPECT_EQ(r->backlog(), 2);  // kept, not cleared
  EXPECT_EQ(r->current()->version, 1);
  EXPECT_EQ(watch_->count(), published);
  // A resume retries them; the failure recurs and freezes it again, with
  // the completions still kept.
  ASSERT_TRUE(r->SetFrozen(false).ok());
  r->WaitIdle();
  EXPECT_TRUE(r->frozen());
  EXPECT_FALSE(r->frozen_reason().empty());
  EXPECT_EQ(r->backlog(), 2);
  EXPECT_EQ(r->completions_learned(), 0);
}

TEST_F(LiveReadoutTest, RollbackDropsCompletionsNotYetApplied) {
  auto r = Make(Options(8));  // a partial batch waits (an hour)
  ASSERT_TRUE(r->Snapshot("s").ok());
  for (int i = 0; i < 3; ++i) Learn(*r);
  EXPECT_EQ(r->backlog(), 3);
  auto v = r->Rollback("s");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, 2);
  EXPECT_EQ(r->backlog(), 0);
  r->WaitIdle();
  EXPECT_EQ(r->completions_learned(), 0);
  EXPECT_EQ(r->Export().theta, state_.theta);
  EXPECT_EQ(r->current()->cause, "rollback:s");
  auto list = r->ListSnapshots();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].label, "s");
  EXPECT_TRUE(absl::IsInvalidArgument(r->Snapshot(std::string(129, 'x')).status()));
  EXPECT_TRUE(absl::IsNotFound(r->Rollback("none").status()));
}

TEST_F(LiveReadoutTest, RollbackWhileFrozenKeepsTheQueueForAfterResuming) {
  auto r = Make(Options(2));
  testing::ClosedForm reference(state_);
  for (int i = 0; i < 2; ++i) Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(2));
  ASSERT_TRUE(r->Snapshot("s").ok());
  ASSERT_TRUE(r->SetFrozen(true).ok());
  for (int i = 0; i < 2; ++i) Learn(*r, &reference);
  ASSERT_TRUE(r->Rollback("s").ok());
  EXPECT_EQ(r->backlog(), 2);
  ASSERT_TRUE(r->SetFrozen(false).ok());
  r->WaitIdle();
  // Applied on top of the snapshot, which here is the state they followed.
  EXPECT_EQ(r->completions_learned(), 4);
  EXPECT_LT(testing::RelErr(r->Export().theta, reference.Theta()), 1e-6);
}

TEST_F(LiveReadoutTest, QualityIsKeptPerVersion) {
  auto r = Make(Options(1));
  int64_t n = 0;
  EXPECT_TRUE(std::isnan(r->spearman(&n)));
  EXPECT_EQ(n, 0);
  for (int i = 1; i <= 10; ++i) r->RecordQuality(1, 10.0 * i, 7.0 * i + 1);
  EXPECT_DOUBLE_EQ(r->spearman(&n), 1.0);
  EXPECT_EQ(n, 10);
  Learn(*r);
  ASSERT_TRUE(watch_->AwaitVersion(2));
  for (int i = 1; i <= 5; ++i) r->RecordQuality(2, 10.0 * i, 100.0 - i);
  const auto versions = r->Versions();
  ASSERT_EQ(versions.size(), 2u);
  EXPECT_DOUBLE_EQ(versions[0].spearman, 1.0);
  EXPECT_EQ(versions[0].spearman_n, 10);
  EXPECT_DOUBLE_EQ(versions[1].spearman, -1.0);
  EXPECT_EQ(versions[1].spearman_n, 5);
  EXPECT_EQ(r->spearman(&n) < 1.0, true);
  EXPECT_EQ(n, 15);
}

TEST_F(LiveReadoutTest, KeepsTheNewestVersionRecords) {
  LiveReadoutOptions o = Options(1);
  o.versions_kept = 3;
  auto r = Make(o);
  for (int i = 0; i < 5; ++i) Learn(*r);
  ASSERT_TRUE(watch_->AwaitVersion(6));
  const auto versions = r->Versions();
  ASSERT_EQ(versions.size(), 3u);
  EXPECT_EQ(versions[0].version, 4);
  EXPECT_EQ(versions[2].version, 6);
  EXPECT_EQ(versions[2].completions_learned, 5);
}

TEST_F(LiveReadoutTest, NonAdaptiveReadoutServesAndNeverLearns) {
  state_ = testing::RandomState(kDim, 22, /*with_p=*/false);
  auto r = Make(Options(1));
  EXPECT_FALSE(r->adaptive());
  EXPECT_TRUE(r->frozen());
  EXPECT_TRUE(absl::IsFailedPrecondition(r->SetFrozen(false)));
  r->WaitIdle();  // returns: nothing to apply
  EXPECT_FALSE(r->Export().p.has_value());
  EXPECT_EQ(r->current()->version, 1);
}

// ------------------------------------------------------------ durability

// A store whose feedback log refuses every write.
class LogFailsStore : public storage::StateStore {
 public:
  absl::Status CreateReadout(storage::ReadoutMeta*,
                             const storage::ReadoutCheckpoint&) override {
    return absl::OkStatus();
  }
  absl::Status DeleteReadout(const storage::ReadoutMeta&) override { return absl::OkStatus(); }
  absl::Status SetFrozen(const storage::ReadoutMeta&, bool, const std::string&) override {
    return absl::OkStatus();
  }
  absl::Status PutRoute(const std::string&, const std::string&) override {
    return absl::OkStatus();
  }
  absl::Status DeleteRoute(const std::string&) override { return absl::OkStatus(); }
  absl::Status AppendLog(const storage::ReadoutMeta&,
                         std::span<const storage::LogRecord>) override {
    return absl::InternalError("disk full");
  }
  absl::StatusOr<bool> WasRecorded(const std::string&) override { return false; }
  absl::Status WriteCheckpoint(const storage::ReadoutMeta&,
                               const storage::ReadoutCheckpoint&) override {
    return absl::OkStatus();
  }
  absl::Status PutVersion(const storage::ReadoutMeta&, const storage::VersionEntry&,
                          const Eigen::VectorXd&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<Eigen::VectorXd> GetVersionTheta(const storage::ReadoutMeta&,
                                                  int64_t) override {
    return absl::NotFoundError("none");
  }
  absl::Status PutSnapshot(const storage::ReadoutMeta&, const storage::SnapshotInfo&,
                           const storage::ReadoutCheckpoint&) override {
    return absl::OkStatus();
  }
  absl::StatusOr<storage::ReadoutCheckpoint> GetSnapshot(const storage::ReadoutMeta&,
                                                         const std::string&) override {
    return absl::NotFoundError("none");
  }
  absl::StatusOr<std::vector<storage::SnapshotInfo>> ListSnapshots(
      const storage::ReadoutMeta&) override {
    return std::vector<storage::SnapshotInfo>{};
  }
  absl::StatusOr<storage::RecoveredState> Load() override {
    return storage::RecoveredState{};
  }
  std::map<std::string, int64_t> BytesPerFamily() override { return {}; }
};

TEST_F(LiveReadoutTest, ACompletionNotLoggedIsNeitherAcknowledgedNorLearned) {
  LogFailsStore store;
  auto r = Make(Options(1), &store);
  std::vector<float> x = testing::RandomFeatures(state_, rng_);
  absl::Status s = r->Learn({"c", readout::FeatureView::F32(x.data(), kDim), 10.0, {}}).status();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_NE(s.message().find("disk full"), std::string::npos) << s;
  r->WaitIdle();
  EXPECT_EQ(r->backlog(), 0);
  EXPECT_EQ(r->completions_learned(), 0);
  EXPECT_EQ(r->current()->version, 1);
}

// Learn says what it wrote: the log position, and the dataset record given
// with the completion only when it went into the log's write. Without a
// store nothing is written and the record is left to the caller as it was
// (Core then appends it on its own); with one, log and dataset record are
// both in the store.
TEST_F(LiveReadoutTest, LearnSaysWhetherItWroteTheDatasetRecord) {
  std::vector<float> x = testing::RandomFeatures(state_, rng_);
  const auto f32 = readout::FeatureView::F32(x.data(), kDim);
  auto make_record = [&] {
    storage::DatasetRecord d;
    d.features = testing::Bytes(x);
    d.tokens = 321;
    return d;
  };
  {
    auto r = Make(Options(8));
    storage::DatasetRecord d = make_record();
    Learnable item{"c", f32, 10.0, {}};
    item.dataset = &d;
    absl::StatusOr<Learned> learned = r->Learn(item);
    ASSERT_TRUE(learned.ok()) << learned.status();
    EXPECT_EQ(learned->seq, 1u);
    EXPECT_FALSE(learned->dataset.has_value());
    EXPECT_EQ(d.features, testing::Bytes(x));  // still the caller's
    EXPECT_EQ(d.tokens, 321);
  }
  const ::leap::testing::ScopedTempDir tmp("live_readout_dataset");
  std::unique_ptr<storage::StateStore> store = OpenStore(tmp);
  ASSERT_NE(store, nullptr);
  auto r = Make(Options(8), store.get(), CreateInStore(*store));
  storage::DatasetRecord d = make_record();
  Learnable item{"c1", f32, 10.0, {}};
  item.dataset = &d;
  absl::StatusOr<Learned> learned = r->Learn(item);
  ASSERT_TRUE(learned.ok()) << learned.status();
  EXPECT_EQ(learned->seq, 1u);
  ASSERT_TRUE(learned->dataset.has_value());
  ASSERT_TRUE(learned->dataset->ok()) << learned->dataset->status();
  EXPECT_EQ((*learned->dataset)->records, 1);
  // No dataset record given: none written.
  learned = r->Learn({"c2", f32, 11.0, {}});
  ASSERT_TRUE(learned.ok()) << learned.status();
  EXPECT_EQ(learned->seq, 2u);
  EXPECT_FALSE(learned->dataset.has_value());
  std::vector<storage::DatasetRecord> kept;
  ASSERT_TRUE(store
                  ->ScanDataset("r", 0,
                                [&](const storage::DatasetRecord& rec) {
                                  kept.push_back(rec);
                                  return true;
                                })
                  .ok());
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].features, testing::Bytes(x));
  EXPECT_EQ(kept[0].tokens, 321);
  r.reset();
  auto loaded = store->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->readouts.size(), 1u);
  EXPECT_EQ(loaded->readouts[0].log.size(), 2u);
}

TEST_F(LiveReadoutTest, CheckpointsInTheStoreHoldTheExactState) {
  const ::leap::testing::ScopedTempDir tmp("live_readout_test");
  std::unique_ptr<storage::StateStore> store = OpenStore(tmp);
  ASSERT_NE(store, nullptr);
  const storage::ReadoutMeta meta = CreateInStore(*store);
  LiveReadoutOptions o = Options(2);
  o.checkpoint_every_batches = 2;
  auto r = Make(o, store.get(), meta);
  testing::ClosedForm reference(state_);
  for (int i = 0; i < 7; ++i) Learn(*r, &reference);
  ASSERT_TRUE(watch_->AwaitVersion(4));  // three full batches; one waits
  // A clean stop applies the last one and leaves a checkpoint of everything.
  r->Stop(/*drain=*/true);
  const readout::ReadoutState final_state = r->Export();
  EXPECT_EQ(final_state.completions_learned, 7);
  EXPECT_LT(testing::RelErr(final_state.theta, reference.Theta()), 1e-6);
  r.reset();
  auto loaded = store->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->readouts.size(), 1u);
  const storage::RecoveredReadout& rec = loaded->readouts[0];
  EXPECT_EQ(rec.checkpoint.completions_learned, 7);
  EXPECT_EQ(rec.checkpoint.last_seq, 7u);
  EXPECT_TRUE(rec.log.empty());
  EXPECT_EQ(rec.checkpoint.theta, final_state.theta);
  ASSERT_TRUE(rec.checkpoint.p.has_value());
  for (int64_t i = 0; i <= kDim; ++i) {
    for (int64_t j = 0; j <= kDim; ++j) {
      ASSERT_EQ((*rec.checkpoint.p)(i, j), (*final_state.p)(i, j));
    }
  }
  // Every published version is in the history.
  EXPECT_EQ(rec.max_version, 5);
  store.reset();
}

TEST_F(LiveReadoutTest, AnRlsFailureFreezeIsDurable) {
  const ::leap::testing::ScopedTempDir tmp("live_readout_freeze");
  std::unique_ptr<storage::StateStore> store = OpenStore(tmp);
  ASSERT_NE(store, nullptr);
  // An indefinite P: the first update is rejected and freezes learning.
  state_.p = readout::SymMatrix::ScaledIdentity(kDim + 1, -1.0f);
  const storage::ReadoutMeta meta = CreateInStore(*store);
  auto r = Make(Options(1), store.get(), meta);
  Learn(*r);
  r->WaitIdle();
  ASSERT_TRUE(r->frozen());
  EXPECT_FALSE(r->frozen_reason().empty());
  const std::string reason = r->frozen_reason();
  r.reset();
  auto loaded = store->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->readouts.size(), 1u);
  EXPECT_TRUE(loaded->readouts[0].meta.frozen);
  EXPECT_EQ(loaded->readouts[0].meta.frozen_reason, reason);
  // The completion is still in the log (acknowledged, never lost).
  EXPECT_EQ(loaded->readouts[0].log.size(), 1u);
  store.reset();
}

// Fleet mode: a serving-only readout records completions in its log (the
// outbox) without learning, serves installed versions under their own
// numbers, and prunes confirmed log records with a theta-only checkpoint.
TEST_F(LiveReadoutTest, ServingOnlyRecordsInstallsAndPrunes) {
  const ::leap::testing::ScopedTempDir tmp("live_readout_serving");
  std::unique_ptr<storage::StateStore> store = OpenStore(tmp);
  ASSERT_NE(store, nullptr);
  const storage::ReadoutMeta meta = CreateInStore(*store, "r", /*without_p=*/true);
  LiveReadoutOptions o = Options(1, absl::Milliseconds(1));
  o.serving_only = true;
  auto r = Make(o, store.get(), meta);  // the state has P: ignored
  EXPECT_FALSE(r->adaptive());
  EXPECT_FALSE(r->frozen());
  // Recorded with increasing log positions; nothing learned or published.
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 3; ++i) {
    std::vector<float> x = testing::RandomFeatures(state_, rng_);
    absl::StatusOr<Learned> learned =
        r->Learn({absl::StrCat("s", i), readout::FeatureView::F32(x.data(), kDim), 7.0, {}});
    ASSERT_TRUE(learned.ok()) << learned.status();
    seqs.push_back(learned->seq);
  }
  EXPECT_EQ(seqs, (std::vector<uint64_t>{1, 2, 3}));
  r->WaitIdle();
  EXPECT_EQ(r->backlog(), 0);
  EXPECT_EQ(r->completions_learned(), 0);
  EXPECT_EQ(r->current()->version, 1);
  EXPECT_EQ(watch_->count(), 0);

  // A version from the trainer: served under its number, announced.
  InstalledVersion v;
  v.version = 7;
  v.theta = state_.theta * 0.5;
  v.completions_learned = 40;
  v.cause = "rls";
  v.fleet_seq = 99;
  v.published_unix_ms = 1234;
  auto installed = r->InstallVersion(v);
  ASSERT_TRUE(installed.ok()) << installed.status();
  EXPECT_TRUE(*installed);
  ASSERT_TRUE(watch_->AwaitVersion(7));
  EXPECT_EQ(r->current()->version, 7);
  EXPECT_EQ(r->current()->fleet_seq, 99u);
  EXPECT_EQ(r->current()->cause, "rls");
  EXPECT_EQ(r->completions_learned(), 40);
  const std::vector<float> x = testing::RandomFeatures(state_, rng_);
  const std::vector<double> xd(x.begin(), x.end());
  EXPECT_NEAR(*r->current()->folded.Score(readout::FeatureView::F32(x.data(), kDim)),
              testing::ReferenceScore(state_.standardizer, v.theta, xd),
              testing::ScoreTolerance(state_.standardizer, v.theta, xd));
  EXPECT_EQ(r->Versions().back().version, 7);
  // Not newer: ignored. Wrong width or a NaN: refused.
  v.version = 7;
  EXPECT_FALSE(*r->InstallVersion(v));
  v.version = 5;
  EXPECT_FALSE(*r->InstallVersion(v));
  v.version = 8;
  v.theta = Eigen::VectorXd::Zero(kDim);
  EXPECT_EQ(r->InstallVersion(v).status().code(), absl::StatusCode::kInvalidArgument);
  v.theta = state_.theta;
  v.theta[3] = NAN;
  EXPECT_EQ(r->InstallVersion(v).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r->current()->version, 7);
  // The frozen flag follows the fleet's.
  v.theta = state_.theta;
  v.frozen = true;
  ASSERT_TRUE(*r->InstallVersion(v));
  EXPECT_TRUE(r->frozen());

  // Records 1 and 2 confirmed: pruned; 3 stays in the log.
  ASSERT_TRUE(r->ConfirmLog(2).ok());
  r.reset();
  auto loaded = store->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->readouts.size(), 1u);
  const storage::RecoveredReadout& rec = loaded->readouts[0];
  EXPECT_EQ(rec.checkpoint.last_seq, 2u);
  EXPECT_EQ(rec.checkpoint.version, 8);
  EXPECT_FALSE(rec.checkpoint.p.has_value());
  ASSERT_EQ(rec.log.size(), 1u);
  EXPECT_EQ(rec.log[0].seq, 3u);
  EXPECT_EQ(rec.log[0].request_id, "s2");
  store.reset();
}

TEST_F(LiveReadoutTest, ALearningReadoutRefusesInstalledVersions) {
  auto r = Make(Options(1));
  InstalledVersion v;
  v.version = 9;
  v.theta = state_.theta;
  EXPECT_EQ(r->InstallVersion(v).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r->current()->version, 1);
}

// Records the thread each publish ran on, by cause (OnPublish runs on the
// publishing thread).
class PublishThreads : public PublishListener {
 public:
  void OnPublish(const std::string&,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    absl::MutexLock lock(&mu_);
    threads_[v->cause] = std::this_thread::get_id();
  }
  std::optional<std::thread::id> Of(const std::string& cause) {
    absl::MutexLock lock(&mu_);
    auto it = threads_.find(cause);
    if (it == threads_.end()) return std::nullopt;
    return it->second;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
};

// The guardrail's trip action (persisting the freeze, the rollback: store
// writes, a wait for a batch in flight, a checkpoint) runs on the RLS
// thread, never on the thread of the completion that tripped it: that
// thread only finds learning frozen when RecordQuality returns.
TEST_F(LiveReadoutTest, AGuardrailTripActsOffTheCompletingThread) {
  auto threads = std::make_shared<PublishThreads>();
  hub_.Subscribe(threads);
  LiveReadoutOptions o = Options(8);
  o.quality_window = 20;
  o.guardrail.floor = 0.3;
  o.guardrail.min_samples = 10;
  o.guardrail.hysteresis = 0;
  o.guardrail.action = GuardrailAction::kRollback;
  auto r = Make(o);
  // Ranked perfectly: armed, and a good snapshot.
  for (int i = 0; i < 20; ++i) r->RecordQuality(1, 10 + i, 10 + i);
  EXPECT_EQ(r->guardrail().state, "watching");
  ASSERT_TRUE(r->Snapshot("good").ok());
  ASSERT_TRUE(r->guardrail().last_good.has_value());
  // Then ranked backwards until the window falls below the floor.
  int tripped_at = -1;
  for (int i = 0; i < 20 && tripped_at < 0; ++i) {
    r->RecordQuality(1, 100 - i, 10 + i);
    if (r->frozen()) tripped_at = i;  // frozen when RecordQuality returns
  }
  ASSERT_GE(tripped_at, 0);
  EXPECT_EQ(r->frozen_reason().rfind("guardrail: spearman ", 0), 0u)
      << r->frozen_reason();
  r->WaitIdle();  // returns once the trip's action ran
  EXPECT_EQ(r->current()->cause, "rollback:good");
  const std::optional<std::thread::id> rolled_back_on = threads->Of("rollback:good");
  ASSERT_TRUE(rolled_back_on.has_value());
  EXPECT_NE(*rolled_back_on, std::this_thread::get_id());
  const GuardrailStatus g = r->guardrail();
  EXPECT_EQ(g.state, "tripped");
  EXPECT_EQ(g.trips, 1);
  EXPECT_NE(g.last_trip.find("; learning frozen; rolled back to snapshot 'good'"),
            std::string::npos)
      << g.last_trip;
  EXPECT_TRUE(r->frozen());
  // A resume re-arms it (armed at once after a trip).
  ASSERT_TRUE(r->SetFrozen(false).ok());
  EXPECT_EQ(r->guardrail().state, "watching");
}

// Rollback (admin client 1) racing Resume (admin client 2) on a frozen
// readout with queued completions: they serialize, so the end state is one
// of the two orders, and memory and the store agree on it. Rollback first
// keeps the queue (frozen) and the resume applies it on top of the
// snapshot: 4 learned. Resume first lets the queue go to the RLS thread and
// the rollback then restores the snapshot: 2 learned. Interleaved (the
// defect), the rollback kept the queue while the resumed RLS thread
// applied it to the state being replaced: memory showed 2 learned while
// its checkpoint left both records in the log for a restart to learn.
TEST_F(LiveReadoutTest, RollbackRacingResumeSerializes) {
  const ::leap::testing::ScopedTempDir tmp("live_readout_race");
  std::unique_ptr<storage::StateStore> store = OpenStore(tmp);
  ASSERT_NE(store, nullptr);
  int orders[2] = {0, 0};  // [rollback first, resume first]
  for (int round = 0; round < 30; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const storage::ReadoutMeta meta = CreateInStore(*store, absl::StrCat("r", round));
    LiveReadoutInit init;
    init.name = meta.name;
    init.state = state_;
    init.store = store.get();
    init.meta = meta;
    auto r = std::make_unique<LiveReadout>(std::move(init), Options(2),
                                           &metrics_, &hub_);
    testing::ClosedForm reference(state_);
    for (int i = 0; i < 2; ++i) Learn(*r, &reference);
    r->WaitIdle();
    ASSERT_EQ(r->completions_learned(), 2);
    ASSERT_TRUE(r->Snapshot("s").ok());
    const Eigen::VectorXd snapshot_theta = r->Export().theta;
    ASSERT_TRUE(r->SetFrozen(true).ok());
    for (int i = 0; i < 2; ++i) Learn(*r, &reference);
    ASSERT_EQ(r->backlog(), 2);
    absl::Barrier* start = new absl::Barrier(2);  // deleted by the last one
    absl::Status rolled, resumed;
    std::thread a([&] {
      if (start->Block()) delete start;
      rolled = r->Rollback("s").status();
    });
    std::thread b([&] {
      if (start->Block()) delete start;
      resumed = r->SetFrozen(false);
    });
    a.join();
    b.join();
    ASSERT_TRUE(rolled.ok()) << rolled;
    ASSERT_TRUE(resumed.ok()) << resumed;
    r->WaitIdle();
    EXPECT_FALSE(r->frozen());
    EXPECT_EQ(r->backlog(), 0);
    const int64_t learned = r->completions_learned();
    const readout::ReadoutState now = r->Export();
    EXPECT_EQ(r->current()->completions_learned, learned);
    if (learned == 4) {
      ++orders[0];
      EXPECT_EQ(r->current()->cause, "rls");
      EXPECT_LT(testing::RelErr(now.theta, reference.Theta()), 1e-6);
    } else {
      ++orders[1];
      ASSERT_EQ(learned, 2);
      EXPECT_EQ(r->current()->cause, "rollback:s");
      EXPECT_EQ(now.theta, snapshot_theta);
    }
    // What a restart would recover: the checkpoint plus the log after it.
    r->Stop(/*drain=*/true);
    r.reset();
    auto loaded = store->Load();
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    bool found = false;
    for (const storage::RecoveredReadout& rec : loaded->readouts) {
      if (rec.meta.name != meta.name) continue;
      found = true;
      EXPECT_FALSE(rec.meta.frozen);
      EXPECT_EQ(rec.checkpoint.completions_learned +
                    static_cast<int64_t>(rec.log.size()),
                learned)
          << "checkpoint at " << rec.checkpoint.completions_learned
          << " learned, log " << rec.log.size();
    }
    EXPECT_TRUE(found);
    if (HasFailure()) break;
  }
  std::printf("rollback-first %d, resume-first %d\n", orders[0], orders[1]);
  store.reset();
}

// Recovery replays a batch wider than RLS's fold buffer (256 rows): it is
// applied in pieces, and when a later piece fails the earlier ones stay in
// theta and P. They count as learned and are never queued again: P equals
// the FP64 closed form of exactly the rows learned once.
TEST_F(LiveReadoutTest, APartlyReplayedBatchIsNotAppliedTwice) {
  // d = 2, identity standardization, P0 = diag(1, -4, 1): rows (r, 0) keep
  // S = I + U P U' definite; a row (0, 1) makes it indefinite (u'Pu < -3).
  readout::ReadoutState st;
  st.spec.dim = 2;
  st.spec.lambda = 1.0;
  st.standardizer.mean = Eigen::VectorXd::Zero(2);
  st.standardizer.scale = Eigen::VectorXd::Ones(2);
  st.theta = Eigen::VectorXd::Zero(3);
  st.theta[2] = 10.0;
  Eigen::MatrixXd p0 = Eigen::MatrixXd::Identity(3, 3);
  p0(1, 1) = -4.0;
  st.p = readout::SymMatrix::FromDouble(p0);
  st.version = 1;
  state_ = st;
  constexpr int kGood = 256, kBad = 44, kRows = kGood + kBad;
  testing::ClosedForm reference(st);
  Eigen::MatrixXd a = p0.inverse();  // P^-1 of the rows learned once
  std::vector<storage::LogRecord> log;
  for (int i = 0; i < kRows; ++i) {
    std::vector<float> x = {i < kGood ? static_cast<float>(std::sin(i) * 2) : 0.0f,
                            i < kGood ? 0.0f : 1.0f};
    storage::LogRecord rec;
    rec.seq = static_cast<uint64_t>(i + 1);
    rec.request_id = absl::StrCat("c", i);
    rec.features = testing::Bytes(x);
    rec.target = 5.0 + (i % 7);
    if (i < kGood) {
      reference.Learn(x, rec.target);
      Eigen::Vector3d u(double{x[0]}, double{x[1]}, 1.0);
      a += u * u.transpose();
    }
    log.push_back(std::move(rec));
  }
  // The history: one "rls" version of all 300 rows (the live batch that
  // published it succeeded; replaying it does not).
  storage::VersionEntry h;
  h.version = 2;
  h.completions_learned = kRows;
  h.cause = "rls";
  h.has_last_seq = true;
  h.last_seq = kRows;
  auto r = Make(Options(8));
  std::vector<std::string> problems;
  r->RecoverLog(std::move(log), {h}, 2, &problems);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("after 256 of its rows"), std::string::npos)
      << problems[0];
  // A new number for the new state, after every number used.
  EXPECT_EQ(r->current()->version, 3);
  EXPECT_EQ(r->current()->completions_learned, kGood);
  r->WaitIdle();  // the rest is retried by the RLS thread and fails again
  EXPECT_TRUE(r->frozen());
  EXPECT_EQ(r->backlog(), kBad);
  EXPECT_EQ(r->completions_learned(), kGood);
  const readout::ReadoutState now = r->Export();
  const Eigen::MatrixXd want_p = a.inverse();
  const Eigen::MatrixXd got_p = now.p->ToDouble();
  EXPECT_LT((got_p - want_p).norm() / want_p.norm(), 1e-5)
      << "P\n" << got_p << "\nwant\n" << want_p;
  EXPECT_LT(testing::RelErr(now.theta, reference.Theta()), 1e-6);
}

TEST(LiveReadoutOptions, Validate) {
  LiveReadoutOptions o;
  EXPECT_TRUE(o.Validate().ok());
  o.rls_batch = 0;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.flush_after_ns = 0;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.quality_window = 1;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.rls_batch_max = 0;
  EXPECT_FALSE(o.Validate().ok());
  o.rls_batch_max = 4097;
  EXPECT_FALSE(o.Validate().ok());
  o = {};
  o.rls_threads = -1;
  EXPECT_FALSE(o.Validate().ok());
}

}  // namespace
}  // namespace leap::sidecar
