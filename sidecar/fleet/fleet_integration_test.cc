// The two halves of fleet mode together, in process, as leapd wires them
// (sidecar/app/leapd_server.cc): a FleetMember over a real Core and RocksDB store,
// and a Trainer on the member's NATS connection that reports its role to
// the member and gets the readouts from the member's CONFIG watcher, against
// a real nats-server started by the test. A readout created through the
// member is trained from the completions the member publishes; the member
// serves the trainer's versions (score against the FP64 closed form); a
// snapshot and a rollback through the member are answered by the trainer,
// and the served weights are the snapshot's bit for bit. nats-server
// (installed by scripts/install-deps) is required: without it the test fails.
// Then two members behind their Admin APIs: the fleet-wide quality.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "Eigen/Dense"
#include "absl/strings/str_cat.h"
#include "client/process.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/support/fleet_member.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/spearman_ref.h"
#include "sidecar/core/core.h"
#include "sidecar/fleet/member.h"
#include "sidecar/grpc/admin_service.h"
#include "sidecar/fleet/trainer.h"
#include "storage/rocksdb_store.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/readout_fixtures.h"

namespace leap::fleet {
namespace {

using ::leap::testing::FleetTestMember;
using ::leap::testing::StartTrainerOn;

constexpr int64_t kDim = 16;
constexpr int64_t kN = kDim + 1;

// Every publish of the member's Core, awaited by condition.
class Recorder : public sidecar::PublishListener {
 public:
  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const sidecar::PublishedVersion>& v) override {
    absl::MutexLock l(&mu_);
    last_ = v;
  }
  std::shared_ptr<const sidecar::PublishedVersion> Await(
      const std::function<bool(const sidecar::PublishedVersion&)>& pred) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return last_ != nullptr && pred(*last_);
    };
    mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(20));
    return cond() ? last_ : nullptr;
  }

 private:
  absl::Mutex mu_;
  std::shared_ptr<const sidecar::PublishedVersion> last_ ABSL_GUARDED_BY(mu_);
};

// Per test: a fresh folder and one nats-server (JetStream on file storage
// in it) on free loopback ports.
class FleetIntegration : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>(absl::StrCat(
        "fleet_integration_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    dir_ = tmp_->path();
    testing::NatsClusterOptions no;
    no.nodes = 1;
    no.dir = (dir_ / "nats").string();
    auto server = testing::NatsCluster::Start(no);
    ASSERT_TRUE(server.ok()) << server.status();
    nats_ = std::move(*server);
    url_ = nats_->url(0);
  }

  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::filesystem::path dir_;
  std::unique_ptr<testing::NatsCluster> nats_;
  std::string url_;
};

TEST_F(FleetIntegration, MemberAndTrainerLearnServeSnapshotAndRollBack) {
  const std::filesystem::path& dir = dir_;
  const std::string& url = url_;

  // The member (serving only), as leapd --fleet builds it.
  auto recorder = std::make_shared<Recorder>();
  FleetTestMember member;
  ASSERT_NO_FATAL_FAILURE(member.Start(
      dir, {.url = url, .fleet = "it", .member = "m1", .listener = recorder}));
  sidecar::Core* core = member.core.get();
  FleetMember* m = member.fleet.get();

  // The trainer on the member's connection.
  auto tstore = storage::OpenRocksStore((dir / "trainer").string());
  ASSERT_TRUE(tstore.ok());
  TrainerOptions to;
  to.fleet = "it";
  to.member = "m1";
  to.lease_ms = 1000;
  to.version_interval_ms = 20;
  to.local_store = tstore->get();
  to.registry = member.metrics.registry();
  auto trainer = StartTrainerOn(m, to);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer* t = trainer->get();

  const readout::ReadoutState st = ::leap::testing::RandomState(kDim, 21);
  ASSERT_TRUE(m->CreateReadout("chat", st).ok());
  std::mt19937_64 rng(3);
  std::normal_distribution<double> noise(0.0, 1.0);
  std::vector<std::vector<float>> xs;
  std::vector<double> ys;
  uint64_t last = 0;
  auto publish = [&](int i) {
    xs.push_back(::leap::testing::RandomFeatures(st, rng));
    ys.push_back(12.0 + noise(rng));
    sidecar::FleetCompletionRecord c;
    c.readout = "chat";
    c.request_id = absl::StrCat("r", i);
    c.instance = "engine-1";
    c.features = absl::string_view(reinterpret_cast<const char*>(xs.back().data()),
                                   kDim * sizeof(float));
    c.target = ys.back();
    c.local_seq = static_cast<uint64_t>(i + 1);
    absl::StatusOr<uint64_t> seq = m->PublishCompletion(c);
    ASSERT_TRUE(seq.ok()) << seq.status();
    last = *seq;
  };
  for (int i = 0; i < 150; ++i) publish(i);
  auto v = recorder->Await([&](const sidecar::PublishedVersion& v) {
    return v.fleet_seq >= last && v.completions_learned == 150;
  });
  ASSERT_NE(v, nullptr) << "the member never served a version with all 150";
  EXPECT_EQ(m->Status().role, "trainer");
  EXPECT_EQ(m->Status().trainer, "m1");

  // Served weights = the trainer's theta = the FP64 closed form.
  absl::StatusOr<FleetState> state = t->ExportState("chat");
  ASSERT_TRUE(state.ok());
  Eigen::MatrixXd p0inv = st.p->ToDouble().inverse();
  Eigen::MatrixXd a = p0inv;
  Eigen::VectorXd b = p0inv * st.theta;
  Eigen::VectorXd u(kN);
  for (size_t i = 0; i < xs.size(); ++i) {
    st.standardizer.Augment(readout::FeatureView::F32(xs[i].data(), kDim), u.data());
    u = u.cast<float>().cast<double>();
    a += u * u.transpose();
    b += u * ys[i];
  }
  const Eigen::VectorXd want = a.llt().solve(b);
  const double err = (state->theta - want).norm() / want.norm();
  std::printf("fleet integration: served theta vs FP64 closed form: %.3g relative\n", err);
  EXPECT_LT(err, 5e-6);
  const readout::FoldedReadout folded =
      readout::FoldedReadout::Fold(st.standardizer, state->theta, st.spec.max_tokens);
  EXPECT_EQ(v->folded.w(), folded.w());
  EXPECT_EQ(v->folded.b(), folded.b());

  // ExportState through the member (what Admin.ExportReadout with
  // from_trainer returns in fleet mode): theta and P of one version, as the
  // trainer holds them — theta bit for bit, P against the FP64 closed form
  // (P0^-1 + sum uu')^-1 — with no version added to the fleet's history and
  // nothing left in its snapshot list.
  // The trainer's own counters may still lag the version the member already
  // serves, so "before" is v itself: the trainer publishes nothing between v
  // and the export (no completion arrives), and the export is answered on
  // the trainer's thread after v's publish was recorded.
  const int64_t last_before = v->version;
  absl::StatusOr<readout::ReadoutState> exported = m->ExportState("chat");
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->p.has_value());
  EXPECT_EQ(std::memcmp(exported->theta.data(), state->theta.data(), kN * 8), 0);
  EXPECT_EQ(exported->completions_learned, 150);
  // The state's own version, and no new one.
  EXPECT_EQ(exported->version, v->version);
  EXPECT_EQ(t->Status("chat")->last_version, last_before);
  EXPECT_EQ((*core->GetReadout("chat"))->current()->version, v->version);
  const Eigen::MatrixXd p_want = a.inverse();
  const double p_err = (exported->p->ToDouble() - p_want).norm() / p_want.norm();
  std::printf("fleet integration: exported P vs FP64 closed form: %.3g relative\n", p_err);
  EXPECT_LT(p_err, 1e-4);
  EXPECT_EQ(exported->spec.dim, kDim);
  absl::StatusOr<std::vector<storage::SnapshotInfo>> listed = m->ListSnapshots("chat");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty()) << listed->front().label;

  // Snapshot and rollback through the member, answered by the trainer.
  absl::StatusOr<storage::SnapshotInfo> snap = m->Snapshot("chat", "s1");
  ASSERT_TRUE(snap.ok()) << snap.status();
  // The snapshot's answer is the next number after the export: the export
  // added none (not even a coalesced "rls" one).
  {
    auto served = (*core->GetReadout("chat"))->current();
    EXPECT_EQ(served->cause, "snapshot:s1");
    EXPECT_EQ(served->version, last_before + 1);
  }
  for (int i = 150; i < 200; ++i) publish(i);
  ASSERT_NE(recorder->Await([&](const sidecar::PublishedVersion& v) {
              return v.fleet_seq >= last;
            }),
            nullptr);
  absl::StatusOr<int64_t> rolled = m->Rollback("chat", "s1");
  ASSERT_TRUE(rolled.ok()) << rolled.status();
  auto rv = recorder->Await(
      [&](const sidecar::PublishedVersion& v) { return v.version == *rolled; });
  ASSERT_NE(rv, nullptr);
  EXPECT_EQ(rv->cause, "rollback:s1");
  absl::StatusOr<FleetState> stored = ReadNewestState(
      m->nats().raw_connection(), m->nats().raw_jetstream(), StateStream("it"), SnapshotSubject("it", "chat", "s1"));
  ASSERT_TRUE(stored.ok()) << stored.status();
  absl::StatusOr<FleetState> now = t->ExportState("chat");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(std::memcmp(now->theta.data(), stored->theta.data(), kN * 8), 0);
  const readout::FoldedReadout snap_folded =
      readout::FoldedReadout::Fold(st.standardizer, stored->theta, st.spec.max_tokens);
  EXPECT_EQ(rv->folded.w(), snap_folded.w());
  EXPECT_EQ(rv->completions_learned, 150);

  m->SetReadoutsListener(nullptr);
  trainer->reset();
  member.Stop();
}


using ::leap::testing::RefSpearman;
using Member = FleetTestMember;

// Issue 12's "online quality per version and arm is computed from all
// members' (prediction, outcome) pairs": two members each serve half of
// the traffic on two arms; every member's Admin API (GetStats,
// ListVersions) reports, as "fleet", the Spearman per readout, version and
// arm of the union of both members' pairs.
TEST_F(FleetIntegration, EveryMemberReportsTheFleetWideQualityPerVersionAndArm) {
  const std::filesystem::path& dir = dir_;
  const std::string& url = url_;
  // Two members as leapd --fleet builds them, each with its Admin service
  // on a real gRPC port.
  // Each member's publishes (its readout created, the versions it
  // installs) are awaited through a Recorder on its Core.
  auto r1 = std::make_shared<Recorder>();
  auto r2 = std::make_shared<Recorder>();
  Member m1, m2;
  ASSERT_NO_FATAL_FAILURE(m1.Start(
      dir, {.url = url, .fleet = "fq", .member = "m1", .listener = r1, .admin = true}));
  ASSERT_NO_FATAL_FAILURE(m2.Start(
      dir, {.url = url, .fleet = "fq", .member = "m2", .listener = r2, .admin = true}));

  TrainerOptions to;
  to.fleet = "fq";
  to.member = "m1";
  to.lease_ms = 1000;
  to.version_interval_ms = 20;
  FleetMember* f1 = m1.fleet.get();
  auto trainer = StartTrainerOn(f1, to);
  ASSERT_TRUE(trainer.ok()) << trainer.status();

  const readout::ReadoutState st = ::leap::testing::RandomState(kDim, 31);
  ASSERT_TRUE(f1->CreateReadout("chat", st).ok());
  sidecar::Route route;
  route.product_line = "";
  route.arms = {{"a", "chat", 50, false}, {"b", "chat", 50, false}};
  // Both members apply the readout and the route from CONFIG. A Core
  // publishes a readout's first version once it serves the readout.
  for (Recorder* r : {r1.get(), r2.get()}) {
    ASSERT_NE(r->Await([](const sidecar::PublishedVersion&) { return true; }), nullptr)
        << "the readout never reached " << (r == r1.get() ? "m1" : "m2");
  }
  ASSERT_TRUE(m1.core->GetReadout("chat").ok());
  ASSERT_TRUE(m2.core->GetReadout("chat").ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  ASSERT_TRUE(f1->SetRoute(route).ok());
  // m1 installed the route in SetRoute; m2's CONFIG watcher installs it with
  // no callback, no publish and no NATS message after it (FleetMember has no
  // hook for an applied route): polled.
  while (m2.core->ListRoutes().empty() || m1.core->ListRoutes().empty()) {
    ASSERT_LT(absl::Now(), deadline) << "the route never reached both members";
    absl::SleepFor(absl::Milliseconds(5));  // poll period (no event, see above)
  }

  // 240 requests, alternately on m1 and m2.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> logt(1.0, 7.0);
  std::normal_distribution<double> noise(0.0, 0.5);
  struct Pair {
    int64_t version;
    std::string arm;
    double predicted, truth;
    bool on_m1;
  };
  std::vector<Pair> pairs;
  uint64_t last = 0;
  for (int i = 0; i < 240; ++i) {
    Member& m = i % 2 == 0 ? m1 : m2;
    const std::vector<float> x = ::leap::testing::RandomFeatures(st, rng);
    const std::string id = absl::StrCat("r", i);
    sidecar::ScoreRequest req;
    req.request_id = id;
    req.instance = i % 2 == 0 ? "e1" : "e2";
    req.features = absl::string_view(reinterpret_cast<const char*>(x.data()),
                                     kDim * sizeof(float));
    absl::StatusOr<sidecar::ScoreResult> r = m.core->Predict(req, 0, nullptr);
    ASSERT_TRUE(r.ok()) << r.status();
    // An outcome that follows the prediction, with noise.
    const int64_t tokens = std::clamp<int64_t>(
        static_cast<int64_t>(std::llround(r->predicted_tokens * std::exp(noise(rng)) +
                                          std::exp(logt(rng)))),
        1, st.spec.max_tokens - 1);
    absl::StatusOr<sidecar::CompletionOutcome> c =
        m.core->Complete(id, tokens, readout::FinishReason::kStop, req.instance);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(c->learned);
    last = std::max(last, c->fleet_seq);
    pairs.push_back({r->version, r->arm, r->predicted_tokens,
                     static_cast<double>(tokens), i % 2 == 0});
    if (i % 80 == 79) {
      // Both members serve a newer version before the next 80: pairs of
      // several versions.
      for (Member* mm : {&m1, &m2}) {
        Recorder* r = mm == &m1 ? r1.get() : r2.get();
        ASSERT_NE(r->Await([&](const sidecar::PublishedVersion& v) {
                    return v.fleet_seq >= last;
                  }),
                  nullptr)
            << "no new version on " << (mm == &m1 ? "m1" : "m2");
        ASSERT_GE((*mm->core->GetReadout("chat"))->current()->fleet_seq, last);
      }
    }
  }
  // Each member's view of the quality reaches the last completion. The
  // member's CONFIG watcher takes the trainer's quality.<readout> entry in
  // with no callback and nothing published after it (FleetMember has no
  // hook for it; a watch of our own on CONFIG would see the entry before
  // the member took it in): polled.
  for (Member* m : {&m1, &m2}) {
    for (;;) {
      std::optional<sidecar::FleetQualityView> q = m->fleet->Quality("chat");
      if (q.has_value() && q->fleet_seq >= last) break;
      ASSERT_LT(absl::Now(), deadline + absl::Seconds(20)) << "quality never published";
      absl::SleepFor(absl::Milliseconds(5));  // poll period (no event, see above)
    }
  }

  std::map<int64_t, std::vector<std::pair<double, double>>> by_version;
  std::map<std::string, std::vector<std::pair<double, double>>> by_arm;
  std::vector<std::pair<double, double>> all, only_m1;
  for (const Pair& p : pairs) {
    by_version[p.version].emplace_back(p.predicted, p.truth);
    by_arm[p.arm].emplace_back(p.predicted, p.truth);
    all.emplace_back(p.predicted, p.truth);
    if (p.on_m1) only_m1.emplace_back(p.predicted, p.truth);
  }
  ASSERT_EQ(by_arm.size(), 2u);
  EXPECT_GE(by_version.size(), 3u);
  const double want = RefSpearman(all);
  std::printf("fleet quality: spearman of the union %.4f over %zu (m1's own %.4f over %zu), "
              "%zu versions\n",
              want, all.size(), RefSpearman(only_m1), only_m1.size(), by_version.size());
  for (Member* m : {&m1, &m2}) {
    SCOPED_TRACE(m == &m1 ? "m1" : "m2");
    grpc::ClientContext ctx;
    leap::v1::GetStatsRequest req;
    leap::v1::StatsResponse stats;
    ASSERT_TRUE(m->stub->GetStats(&ctx, req, &stats).ok());
    ASSERT_EQ(stats.readouts_size(), 1);
    const leap::v1::ReadoutStats& rs = stats.readouts(0);
    EXPECT_EQ(rs.quality_scope(), "fleet");
    EXPECT_GE(rs.quality_fleet_seq(), last);
    EXPECT_EQ(rs.spearman_n(), 240);
    EXPECT_NEAR(rs.spearman(), want, 1e-12);
    int versions_checked = 0;
    for (const leap::v1::VersionInfo& v : rs.versions()) {
      auto it = by_version.find(v.version());
      if (it == by_version.end()) continue;
      EXPECT_EQ(v.spearman_n(), static_cast<int64_t>(it->second.size())) << v.version();
      if (it->second.size() >= 2) {
        EXPECT_NEAR(v.spearman(), RefSpearman(it->second), 1e-12);
      }
      ++versions_checked;
    }
    EXPECT_GT(versions_checked, 0);
    int arms = 0;
    for (const leap::v1::ArmStats& a : stats.arms()) {
      EXPECT_EQ(a.quality_scope(), "fleet");
      EXPECT_EQ(a.completions(), static_cast<int64_t>(by_arm[a.arm()].size())) << a.arm();
      EXPECT_NEAR(a.spearman(), RefSpearman(by_arm[a.arm()]), 1e-12) << a.arm();
      ++arms;
    }
    EXPECT_EQ(arms, 2);
    grpc::ClientContext vctx;
    leap::v1::ListVersionsRequest vreq;
    vreq.set_name("chat");
    leap::v1::ListVersionsResponse list;
    ASSERT_TRUE(m->stub->ListVersions(&vctx, vreq, &list).ok());
    EXPECT_EQ(list.quality_scope(), "fleet");
    for (const leap::v1::VersionInfo& v : list.versions()) {
      auto it = by_version.find(v.version());
      EXPECT_EQ(v.spearman_n(),
                it == by_version.end() ? 0 : static_cast<int64_t>(it->second.size()))
          << v.version();
    }
  }

  f1->SetReadoutsListener(nullptr);
  trainer->reset();
  m2.Stop();
  m1.Stop();
}

}  // namespace
}  // namespace leap::fleet
