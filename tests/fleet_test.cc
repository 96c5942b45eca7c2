// Fleet mode end to end (issue 12), every component real and separate:
// a 3-node NATS JetStream cluster (Debian nats-server, file storage in a temp
// dir, random loopback ports), 3 leapd members (--fleet, R3 streams, data
// dirs), and 3 engine processes (fleet_test_engine) sending Predict +
// Complete to different members and writing down every acknowledged
// completion (features and target).
//  - Faults at random moments (seeded; the seed is printed, LEAP_FLEET_SEED
//    replays it), each kind LEAP_FLEET_FAULTS times (default 5): kill -9 of
//    the trainer (the holder of the lease key, read from NATS), of a
//    non-trainer member (its engine moves on and the member is restarted on
//    its port), of one NATS node (restarted after a while). After EVERY
//    fault the engines are paused between requests and every member must
//    serve identical weights (WatchReadout with weights, same version and
//    fleet_seq) equal to the FP64 closed form over exactly the acknowledged
//    completions of all engines, with completions_learned equal to their
//    count: nothing acknowledged lost, nothing learned twice.
//  - Fleet-wide rollback through one member: a snapshot taken through m0,
//    more traffic, rollback through m1: every member serves the snapshot's
//    weights bit for bit (and ExportReadout's theta equals the snapshot's),
//    and each member's live requests are rescored with the rollback version.
#include <nats/nats.h>
#include <signal.h>

#include <algorithm>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "leap/v1/fleet.pb.h"
#include "tests/support/engine_client.h"
#include "tests/support/leapd_fixture.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/process.h"

namespace leap {
namespace {

namespace pb = ::leap::v1;
using testing::Leapd;

constexpr int64_t kDim = 16;
constexpr double kLambda = 1.0;
constexpr int kMembers = 3;
constexpr int kEngines = 3;
const char kFleet[] = "ft";

int EnvInt(const char* name, int def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : def;
}

// Reads the trainer lease (LEAP_<fleet>_LEASE, key "trainer") from NATS.
class LeaseReader {
 public:
  explicit LeaseReader(const testing::NatsCluster& c) {
    natsOptions* opts = nullptr;
    natsOptions_Create(&opts);
    std::vector<std::string> urls;
    std::vector<const char*> ptrs;
    for (int i = 0; i < c.size(); ++i) urls.push_back(c.url(i));
    for (const std::string& u : urls) ptrs.push_back(u.c_str());
    natsOptions_SetServers(opts, ptrs.data(), static_cast<int>(ptrs.size()));
    natsOptions_SetReconnectWait(opts, 50);
    natsOptions_SetMaxReconnect(opts, -1);
    natsOptions_SetTimeout(opts, 2000);
    EXPECT_EQ(natsConnection_Connect(&nc_, opts), NATS_OK);
    natsOptions_Destroy(opts);
    if (nc_ != nullptr) natsConnection_JetStream(&js_, nc_, nullptr);
  }
  ~LeaseReader() {
    kvStore_Destroy(kv_);
    jsCtx_Destroy(js_);
    natsConnection_Destroy(nc_);
  }
  // The current lease (empty member when none / unknown).
  pb::fleet::FleetLease Lease() {
    pb::fleet::FleetLease lease;
    if (js_ == nullptr) return lease;
    if (kv_ == nullptr &&
        js_KeyValue(&kv_, js_, absl::StrCat("LEAP_", kFleet, "_LEASE").c_str()) !=
            NATS_OK) {
      kv_ = nullptr;
      return lease;
    }
    kvEntry* e = nullptr;
    if (kvStore_Get(&e, kv_, "trainer") != NATS_OK) return lease;
    if (kvEntry_Operation(e) != kvOp_Put ||
        !lease.ParseFromArray(kvEntry_Value(e), kvEntry_ValueLen(e))) {
      lease.Clear();
    }
    kvEntry_Destroy(e);
    return lease;
  }
  std::string Holder() { return Lease().member(); }
  // Waits for a lease claimed at or after `since_unix_ms` (a takeover: by
  // another member, or by the restarted one); empty member on timeout.
  // Polled: between the old key's expiry and a claim there is no key to
  // watch, and the bucket may be electing a leader after a NATS kill.
  // The lease once another member than `killed` holds it, or `killed` (its
  // restarted process) claimed it again after `since_unix_ms`. Another
  // member may have claimed it a little before the kill: under load the
  // holder can miss a renewal between the test reading the holder and
  // killing it.
  pb::fleet::FleetLease WaitTakeover(const std::string& killed, int64_t since_unix_ms,
                                     absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      pb::fleet::FleetLease l = Lease();
      if (!l.member().empty() &&
          (l.member() != killed || l.acquired_unix_ms() >= since_unix_ms)) {
        return l;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return pb::fleet::FleetLease();
  }

 private:
  natsConnection* nc_ = nullptr;
  jsCtx* js_ = nullptr;
  kvStore* kv_ = nullptr;
};

struct Member {
  std::string id;
  std::string dir;
  int port = 0;
  Leapd d;
};

struct Weights {
  int64_t version = 0;
  uint64_t fleet_seq = 0;
  int64_t learned = 0;
  std::string w;  // dim float32, as served
  double bias = 0;
  std::string cause;
};

// Follows WatchReadout(include_weights) on `m` until a version with
// fleet_seq >= `seq` (and, when `version` > 0, that version number or a
// later one) is served; false on timeout.
bool WaitServed(Member& m, uint64_t seq, int64_t version, Weights* out,
                absl::Duration timeout = absl::Seconds(60)) {
  pb::WatchReadoutRequest req;
  req.set_readout("r");
  req.set_include_weights(true);
  const absl::Time deadline = absl::Now() + timeout;
  pb::ReadoutVersion v;
  bool ok = false;
  while (!ok && absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    auto watch = m.d.predictor->WatchReadout(&ctx, req);
    while (watch->Read(&v)) {
      if (v.fleet_seq() >= seq && v.version() >= version) {
        ok = true;
        break;
      }
    }
    ctx.TryCancel();
    watch->Finish();
    // The stream ended early (NOT_FOUND while a restarted member has not
    // read the fleet's CONFIG yet, UNAVAILABLE while it starts): again.
    if (!ok) absl::SleepFor(absl::Milliseconds(50));
  }
  if (ok) {
    out->version = v.version();
    out->fleet_seq = v.fleet_seq();
    out->learned = v.completions_learned();
    out->w = v.w();
    out->bias = v.bias();
    out->cause = v.cause();
  }
  return ok;
}

// ExportReadout's FP64 theta, if the member exports the readout.
std::optional<Eigen::VectorXd> ExportTheta(Member& m) {
  grpc::ClientContext ctx;
  pb::ExportReadoutRequest req;
  req.set_name("r");
  pb::ExportReadoutResponse resp;
  if (!m.d.admin->ExportReadout(&ctx, req, &resp).ok()) return std::nullopt;
  auto state = readout::ParseArtifact(resp.artifact(), "export");
  if (!state.ok() || state->theta.size() != kDim + 1) return std::nullopt;
  return state->theta;
}

// theta* = (lambda I + sum u u')^-1 sum u y, u = [x; 1] (cold start),
// accumulated over the acknowledged completions read so far.
class Reference {
 public:
  Reference()
      : a_(kLambda * Eigen::MatrixXd::Identity(kDim + 1, kDim + 1)),
        b_(Eigen::VectorXd::Zero(kDim + 1)) {}
  // Reads the lines engines appended to `path` since the last call.
  void ReadNew(const std::string& path) {
    std::ifstream f(path);
    f.seekg(offsets_[path]);
    std::string line;
    while (std::getline(f, line)) {
      if (f.eof()) break;  // a partial last line: engines are paused, none
      offsets_[path] = f.tellg();
      std::istringstream in(line);
      std::string tag, id, target_s;
      unsigned long long seq = 0;
      int learned = 0, dup = 0;
      in >> tag >> id >> seq >> learned >> dup >> target_s;
      ASSERT_EQ(tag, "A") << line;
      ASSERT_TRUE(ids_.insert(id).second) << "acknowledged twice: " << id;
      if (learned == 0 && dup == 0) continue;  // skipped by rule: none here
      Eigen::VectorXd u(kDim + 1);
      for (int64_t k = 0; k < kDim; ++k) {
        std::string xs;
        in >> xs;
        u[k] = std::strtod(xs.c_str(), nullptr);
      }
      u[kDim] = 1.0;
      const double y = std::strtod(target_s.c_str(), nullptr);
      a_ += u * u.transpose();
      b_ += y * u;
      ++n_;
      duplicates_ += dup;
      max_seq_ = std::max<uint64_t>(max_seq_, seq);
      EXPECT_GT(seq, 0u) << "acknowledged without a fleet_seq: " << line;
    }
  }
  Eigen::VectorXd Theta() const { return a_.llt().solve(b_); }
  int64_t n() const { return n_; }
  int64_t duplicates() const { return duplicates_; }
  uint64_t max_seq() const { return max_seq_; }

 private:
  Eigen::MatrixXd a_;
  Eigen::VectorXd b_;
  std::map<std::string, std::streamoff> offsets_;
  std::set<std::string> ids_;
  int64_t n_ = 0, duplicates_ = 0;
  uint64_t max_seq_ = 0;
};

class FleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path();
    testing::NatsClusterOptions o;
    o.nodes = 3;
    o.dir = dir_ + "/nats";
    auto c = testing::NatsCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    nats_ = std::move(*c);
    std::printf("NATS cluster: %s\n", nats_->urls().c_str());
    for (int i = 0; i < kMembers; ++i) {
      members_[i].id = absl::StrCat("m", i);
      members_[i].dir = absl::StrCat(dir_, "/", members_[i].id);
      auto port = testing::FreeLoopbackPort();
      ASSERT_TRUE(port.ok());
      members_[i].port = *port;
      ASSERT_TRUE(StartMember(i));
    }
    lease_ = std::make_unique<LeaseReader>(*nats_);
  }

  std::vector<std::string> MemberArgs(int i) {
    return {absl::StrCat("--listen=127.0.0.1:", members_[i].port),
            "--data_dir=" + members_[i].dir,
            "--fleet=" + nats_->urls(),
            absl::StrCat("--fleet_name=", kFleet),
            "--fleet_member=" + members_[i].id,
            "--fleet_replicas=3",
            "--fleet_lease_ms=1000",
            "--fleet_version_interval_ms=100"};
  }
  bool StartMember(int i) {
    return members_[i].d.Start(LEAPD_PATH, MemberArgs(i));
  }
  void KillMember(int i) {
    members_[i].d.proc->Signal(SIGKILL);
    members_[i].d.proc->Wait();
    members_[i].d.proc.reset();
  }
  int MemberIndex(const std::string& id) {
    for (int i = 0; i < kMembers; ++i) {
      if (members_[i].id == id) return i;
    }
    return -1;
  }

  void CreateReadout(int via) {
    ASSERT_TRUE(testing::CreateRoutedReadout(*members_[via].d.admin, kDim, kLambda));
    // Every member serves it (CONFIG KV + VERSIONS).
    for (Member& m : members_) {
      Weights w;
      ASSERT_TRUE(WaitServed(m, 0, 1, &w, absl::Seconds(30)))
          << m.id << " never served readout r";
    }
  }

  void StartEngines(double rate) {
    std::vector<std::string> addrs;
    for (const Member& m : members_) {
      addrs.push_back(absl::StrCat("127.0.0.1:", m.port));
    }
    for (int k = 0; k < kEngines; ++k) {
      engine_out_[k] = absl::StrCat(dir_, "/engine", k, ".acks");
      client::ProcessOptions po;
      po.die_with_parent = true;
      po.kept_lines = 100;
      auto p = testing::Process::Start(
          {FLEET_TEST_ENGINE_PATH, "--members=" + absl::StrJoin(addrs, ","),
           absl::StrCat("--start=", k), absl::StrCat("--dim=", kDim),
           absl::StrCat("--seed=", seed_ * 10 + k),
           absl::StrCat("--instance=engine", k), "--out=" + engine_out_[k],
           absl::StrCat("--rate=", rate)},
          po);
      ASSERT_TRUE(p.ok()) << p.status();
      engines_[k] = std::move(*p);
    }
  }
  void Pause() {
    for (auto& e : engines_) e->Signal(SIGUSR1);
    for (auto& e : engines_) {
      auto l = e->WaitForLine("paused", absl::Seconds(120));
      ASSERT_TRUE(l.ok()) << l.status() << " " << e->Tail();
    }
  }
  void Resume() {
    for (auto& e : engines_) e->Signal(SIGUSR2);
    for (auto& e : engines_) {
      ASSERT_TRUE(e->WaitForLine("resumed", absl::Seconds(10)).ok());
    }
  }
  void StopEngines() {
    for (auto& e : engines_) e->Signal(SIGTERM);
    for (auto& e : engines_) {
      auto l = e->WaitForLine("done", absl::Seconds(120));
      ASSERT_TRUE(l.ok()) << l.status();
      std::printf("engine: done%s\n", l->c_str());
      EXPECT_EQ(e->Wait(), 0);
    }
  }

  // With the engines paused: every member serves the same weights, equal to
  // the closed form over every acknowledged completion.
  void CheckExact(const std::string& when) {
    for (const std::string& p : engine_out_) ref_.ReadNew(p);
    const Eigen::VectorXd want = ref_.Theta();
    Weights first;
    for (int i = 0; i < kMembers; ++i) {
      Weights w;
      ASSERT_TRUE(WaitServed(members_[i], ref_.max_seq(), 0, &w))
          << when << ": " << members_[i].id << " never served fleet_seq >= "
          << ref_.max_seq();
      if (i == 0) {
        first = w;
      } else {
        EXPECT_EQ(w.version, first.version) << when << " " << members_[i].id;
        EXPECT_EQ(w.fleet_seq, first.fleet_seq) << when << " " << members_[i].id;
        EXPECT_TRUE(w.w == first.w && w.bias == first.bias)
            << when << ": " << members_[i].id << " serves other weights";
      }
      EXPECT_EQ(w.learned, ref_.n())
          << when << ": " << members_[i].id << " learned " << w.learned
          << " != acknowledged " << ref_.n();
    }
    ASSERT_EQ(first.w.size(), kDim * sizeof(float));
    Eigen::VectorXd got(kDim + 1);
    for (int64_t k = 0; k < kDim; ++k) {
      float f;
      std::memcpy(&f, first.w.data() + 4 * k, 4);
      got[k] = f;
    }
    got[kDim] = first.bias;
    const double err = (got - want).norm() / want.norm();
    // Served weights are FP32: ~1e-7 of their size.
    EXPECT_LT(err, 1e-5) << when;
    // ExportReadout's FP64 theta (each member installs the fleet's theta).
    double export_err = 0;
    int exported = 0;
    for (Member& m : members_) {
      const auto s = ExportTheta(m);
      if (!s.has_value()) continue;
      ++exported;
      export_err = std::max(export_err, (*s - want).norm() / want.norm());
    }
    EXPECT_LT(export_err, 1e-6) << when;
    if (exported < kMembers) {
      std::printf("  (ExportReadout gave theta on %d of %d members)\n", exported,
                  kMembers);
    }
    max_err_ = std::max(max_err_, err);
    max_export_err_ = std::max(max_export_err_, export_err);
    std::printf("[%6.1f s] %s: %lld acknowledged (%lld resent as duplicates), "
                "fleet_seq %llu, version %lld, rel err served %.2e export %.2e\n",
                absl::ToDoubleSeconds(absl::Now() - t0_), when.c_str(),
                static_cast<long long>(ref_.n()),
                static_cast<long long>(ref_.duplicates()),
                static_cast<unsigned long long>(first.fleet_seq),
                static_cast<long long>(first.version), err, export_err);
    std::fflush(stdout);
  }

  // Before nats_ and members_: removed after they are stopped.
  const testing::ScopedTempDir tmp_{"fleet"};
  std::string dir_;
  uint64_t seed_ = 1;
  absl::Time t0_ = absl::Now();
  std::unique_ptr<testing::NatsCluster> nats_;
  Member members_[kMembers];
  std::unique_ptr<LeaseReader> lease_;
  std::unique_ptr<testing::Process> engines_[kEngines];
  std::string engine_out_[kEngines];
  Reference ref_;
  double max_err_ = 0, max_export_err_ = 0;
};

TEST_F(FleetTest, FaultsKeepExactnessAndRollbackHoldsFleetWide) {
  const int faults = EnvInt("LEAP_FLEET_FAULTS", 5);
  seed_ = static_cast<uint64_t>(EnvInt(
      "LEAP_FLEET_SEED", static_cast<int>(absl::ToUnixMicros(absl::Now()) % 100000)));
  std::printf("LEAP_FLEET_SEED=%llu LEAP_FLEET_FAULTS=%d\n",
              static_cast<unsigned long long>(seed_), faults);
  std::mt19937_64 rng(seed_);
  t0_ = absl::Now();
  ASSERT_NO_FATAL_FAILURE(CreateReadout(0));
  ASSERT_NO_FATAL_FAILURE(StartEngines(150));

  enum Kind { kTrainer, kMember, kNats };
  std::vector<Kind> plan;
  for (int i = 0; i < faults; ++i) {
    plan.push_back(kTrainer);
    plan.push_back(kMember);
    plan.push_back(kNats);
  }
  std::shuffle(plan.begin(), plan.end(), rng);
  std::uniform_int_distribution<int> traffic_ms(300, 1500);
  std::vector<double> takeovers;
  int done[3] = {0, 0, 0};
  for (size_t f = 0; f < plan.size(); ++f) {
    // Traffic for a random while: the fault lands at a random moment of
    // the stream (mid-batch, mid-publish, mid-version).
    absl::SleepFor(absl::Milliseconds(traffic_ms(rng)));
    std::string what;
    if (plan[f] == kTrainer) {
      std::string holder;
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      while ((holder = lease_->Holder()).empty() && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(20));
      }
      const int t = MemberIndex(holder);
      ASSERT_GE(t, 0) << "no trainer lease holder: '" << holder << "'";
      KillMember(t);
      const int64_t killed_ms = absl::ToUnixMillis(absl::Now());
      ASSERT_TRUE(StartMember(t)) << "restart of " << holder;
      const pb::fleet::FleetLease next =
          lease_->WaitTakeover(holder, killed_ms, absl::Seconds(30));
      ASSERT_FALSE(next.member().empty()) << "no trainer took over from " << holder;
      takeovers.push_back(
          static_cast<double>(std::max<int64_t>(0, next.acquired_unix_ms() - killed_ms)));
      what = absl::StrCat("kill -9 trainer ", holder, " -> ", next.member(),
                          " (lease claimed ", takeovers.back(), " ms after)");
    } else if (plan[f] == kMember) {
      const std::string holder = lease_->Holder();
      std::vector<int> others;
      for (int i = 0; i < kMembers; ++i) {
        if (members_[i].id != holder) others.push_back(i);
      }
      const int v = others[rng() % others.size()];
      KillMember(v);
      ASSERT_TRUE(StartMember(v)) << "restart of " << members_[v].id;
      what = absl::StrCat("kill -9 member ", members_[v].id,
                          " (trainer ", holder, ")");
    } else {
      const int n = static_cast<int>(rng() % nats_->size());
      ASSERT_TRUE(nats_->Kill(n).ok());
      absl::SleepFor(absl::Milliseconds(traffic_ms(rng)));
      const absl::Status st = nats_->Restart(n);
      ASSERT_TRUE(st.ok()) << st;
      what = absl::StrCat("kill -9 NATS ", nats_->name(n));
    }
    ++done[plan[f]];
    ASSERT_NO_FATAL_FAILURE(Pause());
    ASSERT_NO_FATAL_FAILURE(CheckExact(absl::StrCat("fault ", f + 1, "/",
                                                    plan.size(), " (", what, ")")));
    ASSERT_NO_FATAL_FAILURE(Resume());
  }
  std::sort(takeovers.begin(), takeovers.end());
  std::printf("faults: %d trainer, %d member, %d NATS node; trainer takeover "
              "ms: %s\n",
              done[kTrainer], done[kMember], done[kNats],
              absl::StrJoin(takeovers, " ", [](std::string* o, double v) {
                absl::StrAppend(o, static_cast<int>(v));
              }).c_str());

  // Fleet-wide rollback: snapshot through m0 with the engines paused.
  ASSERT_NO_FATAL_FAILURE(Pause());
  ASSERT_NO_FATAL_FAILURE(CheckExact("before snapshot"));
  {
    grpc::ClientContext ctx;
    pb::CreateSnapshotRequest req;
    req.set_readout("r");
    req.set_label("good");
    pb::SnapshotInfo info;
    grpc::Status st = members_[0].d.admin->CreateSnapshot(&ctx, req, &info);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  Weights snap;
  ASSERT_TRUE(WaitServed(members_[0], ref_.max_seq(), 0, &snap));
  const std::optional<Eigen::VectorXd> snap_theta = ExportTheta(members_[0]);
  ASSERT_NO_FATAL_FAILURE(Resume());
  absl::SleepFor(absl::Milliseconds(1000));  // more learning
  ASSERT_NO_FATAL_FAILURE(Pause());
  ASSERT_NO_FATAL_FAILURE(CheckExact("after snapshot"));
  // A live request on each member, to be rescored by the rollback.
  std::vector<std::unique_ptr<testing::EngineStream>> live;
  for (int i = 0; i < kMembers; ++i) {
    live.push_back(std::make_unique<testing::EngineStream>(
        members_[i].d.channel, kDim, pb::FEATURE_DTYPE_FLOAT32,
        absl::StrCat("live", i)));
    pb::EngineMessage m;
    auto* rec = m.mutable_features()->add_records();
    rec->set_request_id("live");
    std::vector<float> x(kDim, 0.5f);
    rec->set_features(std::string(reinterpret_cast<const char*>(x.data()),
                                  x.size() * 4));
    const pb::SidecarMessage a = live.back()->Call(m);
    ASSERT_EQ(a.predictions().predictions_size(), 1) << a.DebugString();
  }
  int64_t rollback_version = 0;
  {
    grpc::ClientContext ctx;
    pb::RollbackRequest req;
    req.set_readout("r");
    req.set_label("good");
    pb::RollbackResponse resp;
    grpc::Status st = members_[1].d.admin->Rollback(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    rollback_version = resp.version();
  }
  ASSERT_GT(rollback_version, snap.version);
  for (int i = 0; i < kMembers; ++i) {
    Weights w;
    ASSERT_TRUE(WaitServed(members_[i], 0, rollback_version, &w)) << members_[i].id;
    EXPECT_EQ(w.version, rollback_version) << members_[i].id;
    EXPECT_TRUE(w.w == snap.w && w.bias == snap.bias)
        << members_[i].id << " does not serve the snapshot's weights bit for bit";
    EXPECT_EQ(w.learned, snap.learned) << members_[i].id;
    const std::optional<Eigen::VectorXd> theta = ExportTheta(members_[i]);
    if (snap_theta.has_value() && theta.has_value()) {
      EXPECT_EQ(std::memcmp(theta->data(), snap_theta->data(),
                            sizeof(double) * theta->size()),
                0)
          << members_[i].id << ": exported theta is not the snapshot's";
    }
    EXPECT_TRUE(live[i]->WaitUntil(
        [&] { return live[i]->rescores("r").count(rollback_version) > 0; },
        absl::Seconds(30)))
        << members_[i].id << " did not rescore its live request";
  }
  std::printf("rollback through m1 to version %lld: all %d members serve the "
              "snapshot (version %lld) bit for bit and rescored\n",
              static_cast<long long>(rollback_version), kMembers,
              static_cast<long long>(snap.version));
  for (auto& l : live) l->Finish();
  ASSERT_NO_FATAL_FAILURE(Resume());
  ASSERT_NO_FATAL_FAILURE(StopEngines());
  std::printf("max relative error vs FP64 closed form: served %.2e, export %.2e; "
              "wall %.1f s\n",
              max_err_, max_export_err_, absl::ToDoubleSeconds(absl::Now() - t0_));
}

// NATS unreachable: the member keeps predicting with the last weights,
// refuses completions with UNAVAILABLE, says it is degraded (metrics,
// GetStats); once NATS is back, the refused completion's resend is
// acknowledged (the outbox publishes it: as a duplicate when that came
// first) with a stream sequence, and the member is no longer degraded.
TEST(FleetDegraded, NatsDownRefusesCompletionsKeepsPredicting) {
  const testing::ScopedTempDir tmp("fleet-degraded");
  const std::string& dir = tmp.path();
  testing::NatsClusterOptions o;
  o.nodes = 1;
  o.dir = dir + "/nats";
  auto c = testing::NatsCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  testing::NatsCluster& nats = **c;
  Member m;
  m.id = "solo";
  ASSERT_TRUE(m.d.Start(LEAPD_PATH, {"--data_dir=" + dir + "/m",
                                     "--fleet=" + nats.url(0),
                                     absl::StrCat("--fleet_name=", kFleet),
                                     "--fleet_member=solo",
                                     "--fleet_version_interval_ms=50"}));
  ASSERT_TRUE(testing::CreateDefaultReadout(m.d.address, "r", kDim).ok());
  Weights w;
  ASSERT_TRUE(WaitServed(m, 0, 1, &w, absl::Seconds(30)));
  std::vector<float> x(kDim, 0.25f);
  auto predict = [&](const std::string& id, pb::PredictResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::PredictRequest req;
    req.set_instance_id("e");
    req.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    req.mutable_record()->set_request_id(id);
    req.mutable_record()->set_features(
        std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
    return m.d.predictor->Predict(&ctx, req, out);
  };
  auto complete = [&](const std::string& id, pb::CompleteResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    pb::CompleteRequest req;
    req.set_instance_id("e");
    req.mutable_completion()->set_request_id(id);
    req.mutable_completion()->set_output_tokens(300);
    req.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);
    return m.d.predictor->Complete(&ctx, req, out);
  };
  pb::PredictResponse p;
  pb::CompleteResponse cr;
  // The route reaches the member through the CONFIG bucket's watch.
  grpc::Status ps;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       !(ps = predict("a", &p)).ok() &&
       ps.error_code() != grpc::StatusCode::INVALID_ARGUMENT &&
       absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(ps.ok()) << ps.error_message();
  ASSERT_TRUE(complete("a", &cr).ok());
  uint64_t seq_a = cr.fleet_seq();
  EXPECT_GT(seq_a, 0u);
  {
    // Concurrent unary Completes (callback handler, publishes pipelined on
    // the member's connection): each acknowledged with its own sequence.
    constexpr int kN = 16;
    for (int i = 0; i < kN; ++i) ASSERT_TRUE(predict(absl::StrCat("c", i), &p).ok());
    std::vector<uint64_t> seqs(kN, 0);
    std::vector<std::thread> calls;
    for (int i = 0; i < kN; ++i) {
      calls.emplace_back([&, i] {
        pb::CompleteResponse r;
        if (complete(absl::StrCat("c", i), &r).ok()) seqs[i] = r.fleet_seq();
      });
    }
    for (auto& t : calls) t.join();
    std::sort(seqs.begin(), seqs.end());
    for (int i = 0; i < kN; ++i) EXPECT_EQ(seqs[i], seq_a + 1 + i) << i;
    seq_a = seqs.back();
  }
  auto metric = [&](const std::string& name) {
    const std::string text = m.d.MetricsText();
    const size_t at = text.find("\n" + name + " ");
    return at == std::string::npos
               ? -1.0
               : std::stod(text.substr(at + name.size() + 2));
  };
  EXPECT_EQ(metric("leap_fleet_degraded"), 0.0);
  auto fleet_health = [&]() {
    auto stub = grpc::health::v1::Health::NewStub(m.d.channel);
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service("leap.v1.Fleet");
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status hs = stub->Check(&ctx, req, &resp);
    return hs.ok() ? resp.status()
                   : grpc::health::v1::HealthCheckResponse::UNKNOWN;
  };
  EXPECT_EQ(fleet_health(), grpc::health::v1::HealthCheckResponse::SERVING);

  ASSERT_TRUE(nats.Kill(0).ok());
  // Predictions go on with the last weights.
  ASSERT_TRUE(predict("b", &p).ok());
  EXPECT_EQ(p.prediction().readout(), "r");
  // The completion is refused with UNAVAILABLE (the engine keeps it).
  grpc::Status st = complete("b", &cr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_EQ(metric("leap_fleet_degraded"), 1.0);
  EXPECT_EQ(fleet_health(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  {
    grpc::ClientContext ctx;
    pb::StatsResponse stats;
    ASSERT_TRUE(m.d.admin->GetStats(&ctx, pb::GetStatsRequest(), &stats).ok());
    EXPECT_TRUE(stats.fleet().degraded());
    EXPECT_FALSE(stats.fleet().degraded_reason().empty());
  }

  {
    const absl::Status restarted = nats.Restart(0);
    ASSERT_TRUE(restarted.ok()) << restarted;
  }
  // The engine resends until acknowledged (the member reconnects on its own).
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    st = complete("b", &cr);
    if (st.ok() || absl::Now() > deadline) break;
    ASSERT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
    absl::SleepFor(absl::Milliseconds(100));  // the engine's resend pause
  }
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_GT(cr.fleet_seq(), seq_a);
  EXPECT_TRUE(cr.learned() || cr.duplicate());
  // Sent again: the same stream sequence, a duplicate, not a new message.
  pb::CompleteResponse again;
  ASSERT_TRUE(complete("b", &again).ok());
  EXPECT_TRUE(again.duplicate());
  EXPECT_EQ(metric("leap_fleet_degraded"), 0.0);
  EXPECT_EQ(fleet_health(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::printf("NATS down: predictions served, completion refused UNAVAILABLE, "
              "degraded; back: resend acked at fleet_seq %llu (duplicate=%d)\n",
              static_cast<unsigned long long>(cr.fleet_seq()), cr.duplicate() ? 1 : 0);
}

}  // namespace
}  // namespace leap
