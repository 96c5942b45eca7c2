// The fleet trainer against a real nats-server (JetStream, file storage in a
// temp dir, a random loopback port) started by the test: exactness against
// an FP64 closed form, restart from the fleet checkpoint without doubling,
// bit-identical rollback, and lease takeover with fencing.
#include "sidecar/fleet/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "Eigen/Dense"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/process.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "leap/v1/fleet.pb.h"

namespace leap::fleet {
namespace {

using leap::v1::fleet::FleetCompletion;
using leap::v1::fleet::FleetControl;
using leap::v1::fleet::FleetStateChunk;
using leap::v1::fleet::FleetVersion;

constexpr char kServer[] = "/usr/sbin/nats-server";
constexpr int64_t kDim = 12;
constexpr int64_t kN = kDim + 1;
constexpr char kReadout[] = "chat";

class TempDir : public ::leap::testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("leap_fleet_trainer") {}
};

// One nats-server -js on 127.0.0.1, port chosen by the server.
class NatsServer {
 public:
  absl::Status Start() {
    client::ProcessOptions po;
    po.merge_stderr = true;
    po.die_with_parent = true;
    absl::StatusOr<std::unique_ptr<client::Process>> p = client::Process::Start(
        {kServer, "-js", "-a", "127.0.0.1", "-p", "-1", "-sd", dir_.path()}, po);
    if (!p.ok()) return p.status();
    proc_ = std::move(*p);
    const std::string marker = "Listening for client connections on ";
    const auto deadline = absl::Now() + absl::Seconds(20);
    while (url_.empty()) {
      absl::StatusOr<std::string> line =
          proc_->WaitForLine("", deadline - absl::Now());
      if (!line.ok()) return line.status();
      if (size_t at = line->find(marker); at != std::string::npos) {
        url_ = "nats://" + line->substr(at + marker.size());
      }
    }
    return proc_->WaitForLine("", deadline - absl::Now()).status();
  }
  const std::string& url() const { return url_; }

 private:
  TempDir dir_;
  std::unique_ptr<client::Process> proc_;
  std::string url_;
};

struct Conn {
  natsConnection* nc = nullptr;
  jsCtx* js = nullptr;
  ~Conn() {
    if (js != nullptr) jsCtx_Destroy(js);
    if (nc != nullptr) natsConnection_Destroy(nc);
  }
};

std::unique_ptr<Conn> Connect(const std::string& url) {
  auto c = std::make_unique<Conn>();
  natsOptions* o = nullptr;
  natsOptions_Create(&o);
  natsOptions_SetURL(o, url.c_str());
  natsStatus s = natsConnection_Connect(&c->nc, o);
  natsOptions_Destroy(o);
  EXPECT_EQ(s, NATS_OK) << natsStatus_GetText(s);
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = 10000;
  EXPECT_EQ(natsConnection_JetStream(&c->js, c->nc, &jo), NATS_OK);
  return c;
}

// A readout with a random standardizer, theta0 and a well-conditioned P0.
struct Fixture {
  TrainerReadout readout;
  Eigen::VectorXd theta0;
  readout::SymMatrix p0;
};

Fixture MakeFixture(uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> g;
  Fixture f;
  f.readout.name = kReadout;
  f.readout.spec.dim = kDim;
  f.readout.spec.max_tokens = 2048;
  f.readout.created_unix_ms = 1000 + seed;
  f.readout.standardizer.mean.resize(kDim);
  f.readout.standardizer.scale.resize(kDim);
  for (int64_t i = 0; i < kDim; ++i) {
    f.readout.standardizer.mean[i] = g(rng);
    f.readout.standardizer.scale[i] = 0.5 + std::abs(g(rng));
  }
  f.theta0.resize(kN);
  for (int64_t i = 0; i < kN; ++i) f.theta0[i] = g(rng);
  Eigen::MatrixXd a(40, kN);
  for (int64_t i = 0; i < a.size(); ++i) a.data()[i] = g(rng);
  Eigen::MatrixXd gram = a.transpose() * a + Eigen::MatrixXd::Identity(kN, kN);
  f.p0 = readout::SymMatrix::FromDouble(gram.inverse());
  return f;
}

struct Row {
  std::vector<float> x;
  double y;
};

Row MakeRow(std::mt19937_64& rng, const Fixture& f) {
  std::normal_distribution<double> g;
  Row r;
  r.x.resize(kDim);
  double y = 3;
  for (int64_t i = 0; i < kDim; ++i) {
    r.x[i] = static_cast<float>(f.readout.standardizer.mean[i] +
                                f.readout.standardizer.scale[i] * g(rng));
    y += 0.3 * r.x[i];
  }
  r.y = y + 0.1 * g(rng);
  return r;
}

// (P0^-1 + sum uu')^-1 (P0^-1 theta0 + sum u y), FP64, u from the
// standardizer's double path.
Eigen::VectorXd ClosedForm(const Fixture& f, const Eigen::VectorXd& theta0,
                           const Eigen::MatrixXd& p0, const std::vector<Row>& rows) {
  Eigen::MatrixXd p0inv = p0.inverse();
  Eigen::MatrixXd a = p0inv;
  Eigen::VectorXd b = p0inv * theta0;
  Eigen::VectorXd u(kN);
  for (const Row& r : rows) {
    // Standardized in FP64, then rounded to the FP32 the trainer queues.
    f.readout.standardizer.Augment(readout::FeatureView::F32(r.x.data(), kDim),
                                   u.data());
    u = u.cast<float>().cast<double>();
    a += u * u.transpose();
    b += u * r.y;
  }
  return a.llt().solve(b);
}

double RelErr(const Eigen::VectorXd& got, const Eigen::VectorXd& want) {
  return (got - want).norm() / want.norm();
}

Eigen::VectorXd Theta(const FleetVersion& v) {
  Eigen::VectorXd t(kN);
  EXPECT_EQ(v.theta().size(), static_cast<size_t>(kN * 8));
  std::memcpy(t.data(), v.theta().data(), kN * 8);
  return t;
}

class FleetTrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(kServer, X_OK) != 0) GTEST_SKIP() << kServer << " not installed";
    ASSERT_TRUE(server_.Start().ok());
    conn_ = Connect(server_.url());
    fleet_ = "t" + std::to_string(getpid());
  }

  // Streams, the creation state and version 1, as a member creating the
  // readout writes them.
  void CreateReadout(const Fixture& f, int64_t lease_ms) {
    ASSERT_TRUE(EnsureFleetStreams(conn_->js, fleet_, 1, lease_ms).ok());
    FleetState s;
    s.theta = f.theta0;
    s.p = f.p0;
    s.version = 1;
    ASSERT_TRUE(PublishState(conn_->js, StateStream(fleet_),
                             CheckpointSubject(fleet_, kReadout), kReadout, "create", s)
                    .ok());
    FleetVersion v;
    v.set_readout(kReadout);
    v.set_version(1);
    v.set_theta(std::string(reinterpret_cast<const char*>(f.theta0.data()), kN * 8));
    v.set_cause("create");
    const std::string bytes = v.SerializeAsString();
    jsPubAck* ack = nullptr;
    ASSERT_EQ(js_Publish(&ack, conn_->js, VersionSubject(fleet_, kReadout).c_str(),
                         bytes.data(), static_cast<int>(bytes.size()), nullptr, nullptr),
              NATS_OK);
    jsPubAck_Destroy(ack);
    // Every version the stream stored (a plain subscription would also see
    // publishes the stream refused: the fenced ones). The first is "create".
    jsSubOptions so;
    jsSubOptions_Init(&so);
    const std::string stream = VersionsStream(fleet_);
    so.Stream = stream.c_str();
    so.Ordered = true;
    ASSERT_EQ(js_SubscribeSync(&versions_, conn_->js, VersionSubject(fleet_, kReadout).c_str(),
                               nullptr, &so, nullptr),
              NATS_OK);
    natsSubscription_SetPendingLimits(versions_, -1, -1);
    FleetVersion first = WaitVersion([](const FleetVersion&) { return true; });
    ASSERT_EQ(first.cause(), "create");
    seen_.clear();
  }
  void TearDown() override {
    if (versions_ != nullptr) natsSubscription_Destroy(versions_);
  }

  // Publishes a completion; returns its stream sequence (0 when it was a
  // duplicate the stream dropped).
  uint64_t PublishCompletion(const Row& r, const std::string& id, bool* dup = nullptr) {
    FleetCompletion c;
    c.set_readout(kReadout);
    c.set_request_id(id);
    c.set_dtype(1);
    c.set_features(std::string(reinterpret_cast<const char*>(r.x.data()), kDim * 4));
    c.set_target(r.y);
    c.set_member("test");
    const std::string bytes = c.SerializeAsString();
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MsgId = id.c_str();
    jsPubAck* ack = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus s = js_Publish(&ack, conn_->js, FeedbackSubject(fleet_, kReadout).c_str(),
                              bytes.data(), static_cast<int>(bytes.size()), &po, &code);
    EXPECT_EQ(s, NATS_OK) << natsStatus_GetText(s) << " " << code;
    if (s != NATS_OK) return 0;
    const uint64_t seq = ack->Sequence;
    if (dup != nullptr) *dup = ack->Duplicate;
    jsPubAck_Destroy(ack);
    return seq;
  }

  uint64_t PublishControl(FleetControl::Op op, const std::string& label,
                          const std::string& op_id) {
    FleetControl c;
    c.set_readout(kReadout);
    c.set_op(op);
    c.set_label(label);
    c.set_op_id(op_id);
    c.set_member("test");
    const std::string bytes = c.SerializeAsString();
    jsPubAck* ack = nullptr;
    EXPECT_EQ(js_Publish(&ack, conn_->js, ControlSubject(fleet_, kReadout).c_str(),
                         bytes.data(), static_cast<int>(bytes.size()), nullptr, nullptr),
              NATS_OK);
    const uint64_t seq = ack != nullptr ? ack->Sequence : 0;
    if (ack != nullptr) jsPubAck_Destroy(ack);
    return seq;
  }

  // Reads published versions until one satisfies `pred` (kept in seen_).
  FleetVersion WaitVersion(const std::function<bool(const FleetVersion&)>& pred,
                           absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      natsMsg* m = nullptr;
      natsStatus s = natsSubscription_NextMsg(&m, versions_, std::max<int64_t>(left, 1));
      if (s != NATS_OK) {
        ADD_FAILURE() << "no such version before the deadline: " << natsStatus_GetText(s);
        return {};
      }
      FleetVersion v;
      v.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
      natsMsg_Destroy(m);
      seen_.push_back(v);
      if (pred(v)) return v;
    }
  }

  TrainerOptions Options(const std::string& member, int64_t lease_ms) {
    TrainerOptions o;
    o.fleet = fleet_;
    o.member = member;
    o.lease_ms = lease_ms;
    o.version_interval_ms = 50;
    o.checkpoint_every_ms = 3'600'000;  // only when asked
    o.local_checkpoint_every_ms = 3'600'000;
    return o;
  }

  NatsServer server_;
  std::unique_ptr<Conn> conn_;
  std::string fleet_;
  natsSubscription* versions_ = nullptr;
  std::vector<FleetVersion> seen_;
};

TEST_F(FleetTrainerTest, AppliesTheStreamExactlyOnceAndMatchesTheClosedForm) {
  Fixture f = MakeFixture(1);
  CreateReadout(f, 1000);
  auto registry = std::make_shared<prometheus::Registry>();
  TrainerOptions o = Options("a", 1000);
  o.registry = registry;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Start(conn_->nc, o);
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->SetReadouts({f.readout});

  std::mt19937_64 rng(7);
  std::vector<Row> rows;
  uint64_t last = 0;
  for (int i = 0; i < 600; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
    // A resend of an acknowledged completion (the engine retried): the
    // stream's de-duplication window drops it.
    if (i % 40 == 0) {
      bool dup = false;
      const uint64_t again = PublishCompletion(rows.back(), absl::StrCat("c", i), &dup);
      EXPECT_TRUE(dup);
      EXPECT_EQ(again, last);
    }
  }
  FleetVersion v = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(v.fleet_seq(), last);
  EXPECT_EQ(v.completions_learned(), 600);
  EXPECT_EQ(v.trainer(), "a");
  const Eigen::VectorXd want = ClosedForm(f, f.theta0, f.p0.ToDouble(), rows);
  const double err = RelErr(Theta(v), want);
  std::printf("fleet trainer: 600 completions, theta vs FP64 closed form: %.3g relative\n",
              err);
  EXPECT_LT(err, 5e-6);
  // Versions are numbered on from the creation version, one by one, and at
  // least the version interval apart (batches coalesced).
  int64_t expect_version = 2;
  int64_t prev_ms = 0;
  for (const FleetVersion& s : seen_) {
    EXPECT_EQ(s.version(), expect_version++);
    if (prev_ms > 0) {
      EXPECT_GE(s.published_unix_ms() - prev_ms, 45);
    }
    prev_ms = s.published_unix_ms();
  }
  EXPECT_LT(seen_.size(), 600u);
}

TEST_F(FleetTrainerTest, RestartsFromTheFleetCheckpointWithoutDoubling) {
  Fixture f = MakeFixture(2);
  const int64_t lease_ms = 600;
  CreateReadout(f, lease_ms);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", lease_ms));
  a->SetReadouts({f.readout});
  // b waits for the lease.
  absl::Notification b_leads;
  std::atomic<int64_t> b_leads_ms{0};
  TrainerOptions ob = Options("b", lease_ms);
  ob.on_role = [&](bool lead) {
    if (lead && !b_leads.HasBeenNotified()) {
      b_leads_ms.store(absl::ToUnixMillis(absl::Now()));
      b_leads.Notify();
    }
  };
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  std::mt19937_64 rng(11);
  std::vector<Row> rows;
  uint64_t last = 0;
  for (int i = 0; i < 300; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  ASSERT_TRUE(a->leader());
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, ob);
  b->SetReadouts({f.readout});

  // A fleet checkpoint at 300, seen on the STATE stream.
  natsSubscription* ckpt = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&ckpt, conn_->nc,
                                         CheckpointSubject(fleet_, kReadout).c_str()),
            NATS_OK);
  a->RequestCheckpoint();
  for (;;) {
    natsMsg* m = nullptr;
    ASSERT_EQ(natsSubscription_NextMsg(&m, ckpt, 20000), NATS_OK);
    FleetStateChunk c;
    c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
    if (c.last() && c.fleet_seq() == last) break;
  }
  natsSubscription_Destroy(ckpt);

  // 200 more, applied and published by a, never checkpointed.
  for (int i = 300; i < 500; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  FleetVersion va = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(va.trainer(), "a");
  EXPECT_FALSE(b->leader());

  // a dies (no checkpoint, no lease release): b takes over when the lease
  // expires, restarts from the checkpoint at 300 and replays 301..500.
  const int64_t died_ms = absl::ToUnixMillis(absl::Now());
  a->Abandon();
  ASSERT_TRUE(b_leads.WaitForNotificationWithTimeout(absl::Seconds(20)));
  const int64_t takeover_ms = b_leads_ms.load() - died_ms;
  std::printf("fleet trainer: takeover %lld ms after the trainer died (lease %lld ms)\n",
              static_cast<long long>(takeover_ms), static_cast<long long>(lease_ms));
  EXPECT_LT(takeover_ms, 2 * lease_ms + 500);
  for (int i = 500; i < 560; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  FleetVersion vb = WaitVersion(
      [&](const FleetVersion& v) { return v.trainer() == "b" && v.fleet_seq() >= last; });
  EXPECT_EQ(vb.completions_learned(), 560);
  const double err = RelErr(Theta(vb), ClosedForm(f, f.theta0, f.p0.ToDouble(), rows));
  std::printf("fleet trainer: after takeover, theta vs FP64 closed form: %.3g relative\n",
              err);
  EXPECT_LT(err, 5e-6);
  // One history: b numbered on from a's last version.
  int64_t prev = 0;
  for (const FleetVersion& s : seen_) {
    if (prev > 0) {
      EXPECT_EQ(s.version(), prev + 1);
    }
    prev = s.version();
  }
}

TEST_F(FleetTrainerTest, RollbackRestoresTheSnapshotBitIdentically) {
  Fixture f = MakeFixture(3);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> t = *Trainer::Start(conn_->nc, Options("a", 1000));
  t->SetReadouts({f.readout});
  std::mt19937_64 rng(5);
  std::vector<Row> rows;
  for (int i = 0; i < 100; ++i) {
    rows.push_back(MakeRow(rng, f));
    PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  PublishControl(FleetControl::SNAPSHOT, "before launch", "op1");
  for (int i = 100; i < 200; ++i) {
    rows.push_back(MakeRow(rng, f));
    PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  const uint64_t rb_seq = PublishControl(FleetControl::ROLLBACK, "before launch", "op2");
  FleetVersion snap = WaitVersion([](const FleetVersion& v) { return v.op_id() == "op1"; });
  EXPECT_EQ(snap.cause(), "snapshot:before launch");
  EXPECT_EQ(snap.completions_learned(), 100);
  FleetVersion rb = WaitVersion([](const FleetVersion& v) { return v.op_id() == "op2"; });
  EXPECT_EQ(rb.cause(), "rollback:before launch");
  EXPECT_EQ(rb.fleet_seq(), rb_seq);
  EXPECT_EQ(rb.theta(), snap.theta());  // bit-identical
  EXPECT_EQ(rb.completions_learned(), 100);

  absl::StatusOr<FleetState> stored =
      ReadNewestState(conn_->js, StateStream(fleet_),
                      SnapshotSubject(fleet_, kReadout, "before launch"));
  ASSERT_TRUE(stored.ok()) << stored.status();
  absl::StatusOr<FleetState> now = t->ExportState(kReadout);
  ASSERT_TRUE(now.ok());
  ASSERT_TRUE(now->p.has_value() && stored->p.has_value());
  for (int64_t i = 0; i < kN; ++i) {
    ASSERT_EQ(std::memcmp(now->p->row(i), stored->p->row(i), kN * 4), 0) << "row " << i;
  }
  ASSERT_EQ(std::memcmp(now->theta.data(), stored->theta.data(), kN * 8), 0);

  // Learning goes on from the snapshot: the closed form anchored there.
  std::vector<Row> after;
  uint64_t last = 0;
  for (int i = 200; i < 250; ++i) {
    after.push_back(MakeRow(rng, f));
    last = PublishCompletion(after.back(), absl::StrCat("c", i));
  }
  FleetVersion v = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(v.completions_learned(), 150);
  const double err =
      RelErr(Theta(v), ClosedForm(f, stored->theta, stored->p->ToDouble(), after));
  EXPECT_LT(err, 5e-6);

  // A trainer that replays the whole stream from the creation state (no
  // checkpoint) reaches the same weights: the rollback is in the stream.
  t.reset();  // clean stop: releases the lease (and checkpoints)
  // Drop the checkpoint the clean stop wrote, so the replay starts at "create".
  jsOptions jo;
  jsOptions_Init(&jo);
  const std::string subject = CheckpointSubject(fleet_, kReadout);
  jo.Stream.Purge.Subject = subject.c_str();
  ASSERT_EQ(js_PurgeStream(conn_->js, StateStream(fleet_).c_str(), &jo, nullptr), NATS_OK);
  FleetState create;
  create.theta = f.theta0;
  create.p = f.p0;
  ASSERT_TRUE(PublishState(conn_->js, StateStream(fleet_), subject, kReadout, "create2",
                           create)
                  .ok());
  std::unique_ptr<Trainer> r = *Trainer::Start(conn_->nc, Options("c", 1000));
  r->SetReadouts({f.readout});
  rows.push_back(MakeRow(rng, f));
  after.push_back(rows.back());
  last = PublishCompletion(rows.back(), "c250");
  FleetVersion vr = WaitVersion(
      [&](const FleetVersion& v) { return v.trainer() == "c" && v.fleet_seq() >= last; });
  EXPECT_EQ(vr.completions_learned(), 151);
  EXPECT_LT(RelErr(Theta(vr), ClosedForm(f, stored->theta, stored->p->ToDouble(), after)),
            5e-6);
}

TEST_F(FleetTrainerTest, ADeposedTrainerCannotPublishOverItsSuccessor) {
  Fixture f = MakeFixture(4);
  const int64_t lease_ms = 500;
  CreateReadout(f, lease_ms);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", lease_ms));
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(9);
  std::vector<Row> rows;
  uint64_t last = 0;
  for (int i = 0; i < 50; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  // a stops renewing but its worker goes on and, with the time fence off,
  // believes it still trains (a paused process that woke up).
  a->TestDisableTimeFence();
  a->TestPauseRenewals(true);
  absl::Notification b_leads;
  TrainerOptions ob = Options("b", lease_ms);
  ob.on_role = [&](bool lead) {
    if (lead && !b_leads.HasBeenNotified()) b_leads.Notify();
  };
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, ob);
  b->SetReadouts({f.readout});
  ASSERT_TRUE(b_leads.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_TRUE(a->leader());  // it does not know
  for (int i = 50; i < 150; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  FleetVersion vb = WaitVersion(
      [&](const FleetVersion& v) { return v.trainer() == "b" && v.fleet_seq() >= last; });
  // After b's first version nothing of a's: its publishes hit the
  // sequence fence.
  bool b_started = false;
  for (const FleetVersion& s : seen_) {
    if (s.trainer() == "b") b_started = true;
    if (b_started) {
      EXPECT_EQ(s.trainer(), "b") << "version " << s.version();
    }
  }
  for (int i = 150; i < 170; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  FleetVersion vb2 = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(vb2.trainer(), "b");
  EXPECT_EQ(vb2.completions_learned(), 170);
  for (const FleetVersion& s : seen_) {
    if (s.version() > vb.version()) {
      EXPECT_EQ(s.trainer(), "b");
    }
  }
  EXPECT_LT(RelErr(Theta(vb2), ClosedForm(f, f.theta0, f.p0.ToDouble(), rows)), 5e-6);
  a->Abandon();
}

}  // namespace
}  // namespace leap::fleet
