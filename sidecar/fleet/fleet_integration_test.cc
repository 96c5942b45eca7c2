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
#include <unistd.h>

#include <filesystem>
#include <random>

#include "Eigen/Dense"
#include "absl/strings/str_cat.h"
#include "client/process.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "sidecar/core/core.h"
#include "sidecar/fleet/member.h"
#include "sidecar/fleet/trainer.h"
#include "storage/rocksdb_store.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/readout_fixtures.h"

namespace leap::fleet {
namespace {

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

TEST(FleetIntegration, MemberAndTrainerLearnServeSnapshotAndRollBack) {
  const ::leap::testing::ScopedTempDir tmp("fleet_integration");
  const std::filesystem::path dir = tmp.path();
  testing::NatsClusterOptions no;
  no.nodes = 1;
  no.dir = (dir / "nats").string();
  auto server = testing::NatsCluster::Start(no);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string url = (*server)->url(0);

  // The member (serving only), as leapd --fleet builds it.
  auto store = storage::OpenRocksStore((dir / "member").string());
  ASSERT_TRUE(store.ok());
  sidecar::Metrics metrics;
  sidecar::CoreOptions co;
  co.readout.serving_only = true;
  auto core = std::make_unique<sidecar::Core>(co, &metrics, store->get());
  auto recorder = std::make_shared<Recorder>();
  core->hub().Subscribe(recorder);
  auto loaded = (*store)->Load();
  ASSERT_TRUE(loaded.ok());
  ASSERT_TRUE(core->Recover(std::move(*loaded)).ok());
  FleetMemberOptions fo;
  fo.nats.servers = {url};
  fo.fleet = "it";
  fo.member = "m1";
  fo.lease_ms = 1000;
  auto member = FleetMember::Create(core.get(), fo);
  ASSERT_TRUE(member.ok()) << member.status();
  (*member)->SetCreateStateWriter([](NatsClient& nats, const std::string& readout,
                                     const readout::ReadoutState& state,
                                     uint64_t fleet_seq) {
    return WriteCreateState(nats.raw_jetstream(), "it", readout, state, fleet_seq);
  });
  core->SetFleet(member->get());
  ASSERT_TRUE((*member)->Start({}, 20000).ok());

  // The trainer on the member's connection.
  auto tstore = storage::OpenRocksStore((dir / "trainer").string());
  ASSERT_TRUE(tstore.ok());
  TrainerOptions to;
  to.fleet = "it";
  to.member = "m1";
  to.lease_ms = 1000;
  to.version_interval_ms = 20;
  to.local_store = tstore->get();
  to.registry = metrics.registry();
  FleetMember* m = member->get();
  to.on_role = [m](bool lead) { m->SetRole(lead); };
  auto trainer = Trainer::Start(m->nats().raw_connection(), to);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Trainer* t = trainer->get();
  m->SetReadoutsListener([t](const std::vector<FleetReadoutEntry>& entries) {
    std::vector<TrainerReadout> rs;
    for (const auto& e : entries) {
      rs.push_back({e.name, e.spec, e.standardizer, e.created_unix_ms});
    }
    t->SetReadouts(std::move(rs));
  });

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

  // ExportState through the member (what Admin.ExportReadout returns in
  // fleet mode): theta and P of one version, as the trainer holds them —
  // theta bit for bit, P against the FP64 closed form (P0^-1 + sum uu')^-1 —
  // and its one-off snapshot label is not left in the fleet's list.
  absl::StatusOr<readout::ReadoutState> exported = m->ExportState("chat");
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_TRUE(exported->p.has_value());
  EXPECT_EQ(std::memcmp(exported->theta.data(), state->theta.data(), kN * 8), 0);
  EXPECT_EQ(exported->completions_learned, 150);
  // The state's own version (the snapshot's answer is a new number with
  // the same theta).
  EXPECT_EQ(exported->version, v->version);
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
      m->nats().raw_jetstream(), StateStream("it"), SnapshotSubject("it", "chat", "s1"));
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
  core->SetFleet(nullptr);
  m->Stop();
}

}  // namespace
}  // namespace leap::fleet
