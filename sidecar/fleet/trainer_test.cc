// The fleet trainer against a real nats-server (JetStream, file storage in a
// temp dir, a random loopback port) started by the test: exactness against
// an FP64 closed form, restart from the fleet checkpoint without doubling,
// bit-identical rollback, lease takeover with fencing, and the fleet-wide
// online quality against an FP64 Spearman of both members' pairs.
#include "sidecar/fleet/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "Eigen/Dense"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/process.h"
#include "gtest/gtest.h"
#include "tests/support/checkpoint_watch_store.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/spearman_ref.h"
#include "leap/v1/fleet.pb.h"
#include "prometheus/text_serializer.h"
#include "sidecar/fleet/fleet_quality.h"
#include "storage/rocksdb_store.h"

namespace leap::fleet {
namespace {

using ::leap::testing::CheckpointWatchStore;
using leap::v1::fleet::FleetCompletion;
using leap::v1::fleet::FleetControl;
using leap::v1::fleet::FleetQuality;
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
  // kill -9 (NATS down for good).
  void Kill() {
    proc_->Signal(SIGKILL);
    proc_->Wait();
  }

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
  void CreateReadout(const Fixture& f, int64_t lease_ms,
                     std::optional<readout::SymMatrix> p0 = std::nullopt) {
    ASSERT_TRUE(EnsureFleetStreams(conn_->js, fleet_, 1, lease_ms).ok());
    FleetState s;
    s.theta = f.theta0;
    s.p = p0.has_value() ? *p0 : f.p0;
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
    if (versions_ != nullptr) CloseSubscription(conn_->nc, versions_);
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
                          const std::string& op_id, int64_t deadline_unix_ms = 0) {
    FleetControl c;
    c.set_readout(kReadout);
    c.set_op(op);
    c.set_label(label);
    c.set_op_id(op_id);
    c.set_member("test");
    c.set_deadline_unix_ms(deadline_unix_ms);
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

  // A plain subscriber of a STATE subject (by default the readout's fleet
  // checkpoints): it sees every chunk a trainer writes there.
  natsSubscription* SubscribeState(const std::string& subject = "") {
    natsSubscription* sub = nullptr;
    EXPECT_EQ(natsConnection_SubscribeSync(
                  &sub, conn_->nc,
                  (subject.empty() ? CheckpointSubject(fleet_, kReadout) : subject).c_str()),
              NATS_OK);
    if (sub != nullptr) natsSubscription_SetPendingLimits(sub, -1, -1);
    EXPECT_EQ(natsConnection_FlushTimeout(conn_->nc, 5000), NATS_OK);
    return sub;
  }
  // Waits until the newest complete state on the subject of `sub` (from
  // SubscribeState with the same `subject`) satisfies `pred`: it is read
  // back from STATE at first and after each write `sub` sees there;
  // DEADLINE_EXCEEDED when none comes within `timeout`.
  absl::StatusOr<FleetState> AwaitState(natsSubscription* sub,
                                        const std::function<bool(const FleetState&)>& pred,
                                        const std::string& subject = "",
                                        absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      absl::StatusOr<FleetState> s = ReadNewestState(
          conn_->nc, conn_->js, StateStream(fleet_),
          subject.empty() ? CheckpointSubject(fleet_, kReadout) : subject);
      if (s.ok() && pred(*s)) return s;
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      natsMsg* m = nullptr;
      const natsStatus st = natsSubscription_NextMsg(&m, sub, std::max<int64_t>(left, 1));
      if (st != NATS_OK) {
        return absl::DeadlineExceededError(absl::StrCat(
            "no such state on ", subject.empty() ? "the checkpoint subject" : subject,
            " within ", absl::FormatDuration(timeout), " (newest: ",
            s.ok() ? absl::StrCat("fleet_seq ", s->fleet_seq) : s.status().ToString(), ")"));
      }
      natsMsg_Destroy(m);
      // The other chunks already here are read back with it.
      uint64_t queued = 0;
      while (natsSubscription_QueuedMsgs(sub, &queued) == NATS_OK && queued > 0 &&
             natsSubscription_NextMsg(&m, sub, 1) == NATS_OK) {
        natsMsg_Destroy(m);
      }
    }
  }

  // After t.Abandon() (which joins its threads, so a checkpoint seen
  // written has been recorded): what its Status says was checkpointed.
  static void ExpectCheckpointed(Trainer& t, uint64_t fleet_seq, uint64_t local_seq = 0) {
    std::optional<TrainerReadoutStatus> st = t.Status(kReadout);
    ASSERT_TRUE(st.has_value());
    EXPECT_GE(st->fleet_checkpoint_seq, fleet_seq);
    EXPECT_GE(st->local_checkpoint_seq, local_seq);
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
  CloseSubscription(conn_->nc, ckpt);

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
      ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
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

// An EXPORT read after its asker's deadline is not answered (the asker
// purged the subject and left: an answer would stay in STATE for good); one
// within it, or without one, is.
TEST_F(FleetTrainerTest, AnExportPastItsAskersDeadlineIsNotAnswered) {
  Fixture f = MakeFixture(3);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> t = *Trainer::Start(conn_->nc, Options("a", 1000));
  t->SetReadouts({f.readout});
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20; ++i) PublishCompletion(MakeRow(rng, f), absl::StrCat("c", i));
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  PublishControl(FleetControl::EXPORT, "", "late", now_ms - 1);
  PublishControl(FleetControl::EXPORT, "", "on-time", now_ms + 60'000);
  PublishControl(FleetControl::EXPORT, "", "no-deadline");
  // Operations are handled in stream order: once this one is answered, the
  // exports before it were handled too.
  PublishControl(FleetControl::SNAPSHOT, "after", "op-after");
  FleetVersion snap = WaitVersion([](const FleetVersion& v) { return v.op_id() == "op-after"; });
  EXPECT_EQ(snap.completions_learned(), 20);
  for (const char* op : {"on-time", "no-deadline"}) {
    absl::StatusOr<FleetState> answered = ReadNewestState(
        conn_->nc, conn_->js, StateStream(fleet_), ExportSubject(fleet_, kReadout, op));
    ASSERT_TRUE(answered.ok()) << op << ": " << answered.status();
    EXPECT_EQ(answered->completions_learned, 20) << op;
  }
  absl::StatusOr<FleetState> late = ReadNewestState(
      conn_->nc, conn_->js, StateStream(fleet_), ExportSubject(fleet_, kReadout, "late"));
  EXPECT_TRUE(absl::IsNotFound(late.status())) << late.status();
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

// The creation state of `r` (created again: another incarnation, theta
// shifted from the fixture's) as FleetMember::CreateReadout writes it, at
// FEEDBACK position `fleet_seq`; returns that theta.
Eigen::VectorXd WriteNewIncarnation(jsCtx* js, const std::string& fleet, const Fixture& f,
                                    const TrainerReadout& r, uint64_t fleet_seq) {
  readout::ReadoutState st;
  st.spec = r.spec;
  st.standardizer = r.standardizer;
  st.theta = f.theta0;
  for (int64_t i = 0; i < kN; ++i) st.theta[i] -= 0.25 * static_cast<double>(i + 1);
  st.p = f.p0;
  st.version = 1;
  st.created_unix_ms = r.created_unix_ms;
  EXPECT_TRUE(WriteCreateState(js, fleet, kReadout, st, fleet_seq).ok());
  return st.theta;
}

// A readout deleted and created again shares its versions subject with its
// predecessor. The new incarnation's creation version goes on the subject
// (unfenced, as a member creating it writes it) while the old incarnation's
// worker still runs (its member has not read the CONFIG change yet); a
// control operation then makes that worker publish at once. Its publish is
// fenced (the subject moved on), and it must stop instead of publishing the
// old weights on top of the new incarnation: every version after the new
// creation names the new incarnation, and the operation is answered by the
// new incarnation's worker, with its own state.
TEST_F(FleetTrainerTest, AWorkerOfADeletedIncarnationNeverPublishesOverTheNewOne) {
  Fixture f = MakeFixture(6);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", 1000));
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(11);
  std::vector<Row> rows;
  uint64_t last = 0;
  for (int i = 0; i < 20; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  FleetVersion v1 = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(v1.created_unix_ms(), f.readout.created_unix_ms);
  // The name created again: creation state and version 1 of the new
  // incarnation (another theta), starting after the stream's last message.
  TrainerReadout again = f.readout;
  again.created_unix_ms = f.readout.created_unix_ms + 1000;
  const Eigen::VectorXd theta2 = WriteNewIncarnation(conn_->js, fleet_, f, again, last);
  FleetVersion c2;
  c2.set_readout(kReadout);
  c2.set_version(1);
  c2.set_theta(std::string(reinterpret_cast<const char*>(theta2.data()), kN * 8));
  c2.set_cause("create");
  c2.set_fleet_seq(last);
  c2.set_created_unix_ms(again.created_unix_ms);
  const std::string c2_bytes = c2.SerializeAsString();
  jsPubAck* ack = nullptr;
  ASSERT_EQ(js_Publish(&ack, conn_->js, VersionSubject(fleet_, kReadout).c_str(),
                       c2_bytes.data(), static_cast<int>(c2_bytes.size()), nullptr, nullptr),
            NATS_OK);
  jsPubAck_Destroy(ack);
  WaitVersion([&](const FleetVersion& v) { return v.cause() == "create"; });
  seen_.clear();
  // The old worker reads a FREEZE and answers at once: fenced. Its answer
  // is seen by a plain subscriber of the versions subject (which also sees
  // publishes the stream refuses): then the old worker has dealt with it.
  natsSubscription* attempts = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&attempts, conn_->nc,
                                         VersionSubject(fleet_, kReadout).c_str()),
            NATS_OK);
  ASSERT_EQ(natsConnection_FlushTimeout(conn_->nc, 5000), NATS_OK);
  const uint64_t freeze_seq = PublishControl(FleetControl::FREEZE, "", "f1");
  ASSERT_GT(freeze_seq, last);
  for (;;) {
    natsMsg* m = nullptr;
    ASSERT_EQ(natsSubscription_NextMsg(&m, attempts, 20'000), NATS_OK)
        << "the old worker never answered the FREEZE";
    FleetVersion v;
    v.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
    if (v.op_id() == "f1" && v.created_unix_ms() == f.readout.created_unix_ms) break;
  }
  CloseSubscription(conn_->nc, attempts);
  // Its member reads the CONFIG change: the new incarnation's worker.
  a->SetReadouts({again});
  FleetVersion answer = WaitVersion([](const FleetVersion& v) { return v.op_id() == "f1"; });
  EXPECT_EQ(answer.created_unix_ms(), again.created_unix_ms);
  EXPECT_EQ(answer.cause(), "freeze");
  EXPECT_EQ(answer.version(), 2);
  EXPECT_EQ(answer.fleet_seq(), freeze_seq);
  // The new incarnation's state, bit for bit (nothing learned in it).
  EXPECT_EQ(Theta(answer), theta2);
  for (const FleetVersion& v : seen_) {
    EXPECT_EQ(v.created_unix_ms(), again.created_unix_ms)
        << "version " << v.version() << " (" << v.cause() << ") of the deleted incarnation";
  }
  a->Abandon();
}

// A readout deleted and created again shares its STATE checkpoint subject
// with its predecessor. The old incarnation's worker (its member has not
// applied the CONFIG change yet) learns the new incarnation's completions
// and is asked for a checkpoint after the new creation state was written:
// the write is fenced on the subject's last sequence the worker saw, so
// JetStream refuses it, and the worker stops. The creation state stays the
// newest state on the subject (before: the old worker's checkpoint, the
// newest by stream order and fleet_seq), the new incarnation's worker
// starts from it (theta = the FP64 closed form from the creation state over
// the new completions only; before, it started from the old incarnation's
// theta and P and published nothing), and its own checkpoint is written,
// with the creation state kept as the one before it.
TEST_F(FleetTrainerTest, AnOldIncarnationsCheckpointAfterTheNewCreationIsRefused) {
  Fixture f = MakeFixture(8);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", 1000));
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(13);
  uint64_t last = 0;
  for (int i = 0; i < 20; ++i) {
    last = PublishCompletion(MakeRow(rng, f), absl::StrCat("a", i));
  }
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  TrainerReadout again = f.readout;
  again.created_unix_ms = f.readout.created_unix_ms + 1000;
  const Eigen::VectorXd theta_b = WriteNewIncarnation(conn_->js, fleet_, f, again, last);
  // The new incarnation's completions: the old worker learns them too.
  std::vector<Row> rows_b;
  uint64_t last_b = 0;
  for (int i = 0; i < 30; ++i) {
    rows_b.push_back(MakeRow(rng, f));
    last_b = PublishCompletion(rows_b.back(), absl::StrCat("b", i));
  }
  WaitVersion([&](const FleetVersion& v) {
    return v.created_unix_ms() == f.readout.created_unix_ms && v.fleet_seq() >= last_b;
  });
  // Its checkpoint attempt, seen by a plain subscriber (which also sees
  // publishes the stream refuses).
  natsSubscription* ckpt = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&ckpt, conn_->nc,
                                         CheckpointSubject(fleet_, kReadout).c_str()),
            NATS_OK);
  a->RequestCheckpoint();
  for (;;) {
    natsMsg* m = nullptr;
    ASSERT_EQ(natsSubscription_NextMsg(&m, ckpt, 20000), NATS_OK)
        << "the old worker never tried its checkpoint";
    FleetStateChunk c;
    c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
    if (c.last() && c.fleet_seq() == last_b) break;
  }
  // Its member applies the CONFIG change: the old worker (and its
  // checkpoint thread, done with that write) stops, the new one starts.
  a->SetReadouts({again});
  {
    // Nothing of the old worker stored after the creation state.
    absl::StatusOr<FleetState> newest =
        ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
                        CheckpointSubject(fleet_, kReadout));
    ASSERT_TRUE(newest.ok()) << newest.status();
    EXPECT_EQ(newest->state_id, absl::StrCat("create-", kReadout, "-", again.created_unix_ms));
    EXPECT_EQ(newest->created_unix_ms, again.created_unix_ms);
    EXPECT_EQ(newest->fleet_seq, last);
  }
  FleetVersion vb = WaitVersion([&](const FleetVersion& v) {
    return v.created_unix_ms() == again.created_unix_ms && v.fleet_seq() >= last_b;
  });
  EXPECT_EQ(vb.fleet_seq(), last_b);
  EXPECT_EQ(vb.completions_learned(), 30);
  const double err = RelErr(Theta(vb), ClosedForm(f, theta_b, f.p0.ToDouble(), rows_b));
  std::printf("fleet trainer: new incarnation after a refused old checkpoint, theta vs "
              "FP64 closed form from its creation state: %.3g relative\n",
              err);
  EXPECT_LT(err, 5e-6);
  // The new worker's own checkpoint is not fenced away; then it stops
  // (the readout deleted: no last checkpoint), so everything is written.
  a->RequestCheckpoint();
  for (;;) {
    natsMsg* m = nullptr;
    ASSERT_EQ(natsSubscription_NextMsg(&m, ckpt, 20000), NATS_OK)
        << "the new worker never wrote its checkpoint";
    FleetStateChunk c;
    c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
    if (c.last() && c.created_unix_ms() == again.created_unix_ms &&
        c.fleet_seq() == last_b) {
      break;
    }
  }
  CloseSubscription(conn_->nc, ckpt);
  a->SetReadouts({});
  EXPECT_EQ(a->Status(kReadout), std::nullopt);
  absl::StatusOr<FleetState> own =
      ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
                      CheckpointSubject(fleet_, kReadout), std::nullopt, again.created_unix_ms);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->fleet_seq, last_b);
  EXPECT_EQ(own->theta, Theta(vb));
  absl::StatusOr<FleetState> before =
      ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
                      CheckpointSubject(fleet_, kReadout), last, again.created_unix_ms);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->state_id, absl::StrCat("create-", kReadout, "-", again.created_unix_ms));
  EXPECT_EQ(before->theta, theta_b);
  a->Abandon();
}

// A SNAPSHOT after the name was created again is answered by both
// incarnations' workers: the old one (its member has not applied the CONFIG
// change yet) and the new one (replaying from its creation state). Both
// snapshots are stored, under ids that name the incarnation, and the new
// incarnation's ROLLBACK restores its own, bit for bit. Before the ids named
// the incarnation JetStream dropped the new worker's chunks as duplicates of
// the old one's, and the ROLLBACK found only the old incarnation's snapshot.
TEST_F(FleetTrainerTest, EachIncarnationRollsBackToItsOwnSnapshot) {
  Fixture f = MakeFixture(12);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", 1000));
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(19);
  uint64_t last = 0;
  for (int i = 0; i < 20; ++i) {
    last = PublishCompletion(MakeRow(rng, f), absl::StrCat("a", i));
  }
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  TrainerReadout again = f.readout;
  again.created_unix_ms = f.readout.created_unix_ms + 1000;
  const Eigen::VectorXd theta_b = WriteNewIncarnation(conn_->js, fleet_, f, again, last);
  natsSubscription* snaps = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&snaps, conn_->nc,
                                         SnapshotSubject(fleet_, kReadout, "s").c_str()),
            NATS_OK);
  PublishControl(FleetControl::SNAPSHOT, "s", "s1");
  for (;;) {  // the old worker's snapshot
    natsMsg* m = nullptr;
    ASSERT_EQ(natsSubscription_NextMsg(&m, snaps, 20000), NATS_OK)
        << "the old worker never wrote its snapshot";
    FleetStateChunk c;
    c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
    natsMsg_Destroy(m);
    if (c.last() && c.created_unix_ms() == f.readout.created_unix_ms) break;
  }
  CloseSubscription(conn_->nc, snaps);
  a->SetReadouts({again});
  FleetVersion vs = WaitVersion([&](const FleetVersion& v) {
    return v.created_unix_ms() == again.created_unix_ms && v.op_id() == "s1";
  });
  EXPECT_EQ(vs.cause(), "snapshot:s");
  uint64_t last_b = 0;
  for (int i = 0; i < 5; ++i) {
    last_b = PublishCompletion(MakeRow(rng, f), absl::StrCat("b", i));
  }
  FleetVersion moved = WaitVersion([&](const FleetVersion& v) {
    return v.created_unix_ms() == again.created_unix_ms && v.fleet_seq() >= last_b;
  });
  EXPECT_NE(Theta(moved), theta_b);
  PublishControl(FleetControl::ROLLBACK, "s", "r1");
  FleetVersion vr = WaitVersion([](const FleetVersion& v) { return v.op_id() == "r1"; });
  EXPECT_EQ(vr.created_unix_ms(), again.created_unix_ms);
  EXPECT_EQ(vr.cause(), "rollback:s");
  EXPECT_EQ(Theta(vr), theta_b);  // the new incarnation's snapshot: its creation state
  a->Abandon();
}

// After each STATE checkpoint the subject keeps the last two states: the
// first checkpoint of a term purges by count, the next ones by sequence
// (below the first sequence of the worker's previous checkpoint). Snapshots
// (another subject of the same stream) written in between leave gaps in the
// stream sequences of the checkpoint subject's messages.
TEST_F(FleetTrainerTest, CheckpointsKeepTheLastTwoStates) {
  Fixture f = MakeFixture(14);
  CreateReadout(f, 1000);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, Options("a", 1000));
  a->SetReadouts({f.readout});
  natsSubscription* ckpt = nullptr;
  ASSERT_EQ(natsConnection_SubscribeSync(&ckpt, conn_->nc,
                                         CheckpointSubject(fleet_, kReadout).c_str()),
            NATS_OK);
  auto checkpoint = [&](uint64_t seq) {
    a->RequestCheckpoint();
    for (;;) {
      natsMsg* m = nullptr;
      ASSERT_EQ(natsSubscription_NextMsg(&m, ckpt, 20000), NATS_OK)
          << "no checkpoint at " << seq;
      FleetStateChunk c;
      c.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
      natsMsg_Destroy(m);
      if (c.last() && c.fleet_seq() == seq) return;
    }
  };
  const std::string stream = StateStream(fleet_);
  const std::string subject = CheckpointSubject(fleet_, kReadout);
  // Term 1: a snapshot, then the first checkpoint: the creation state stays.
  PublishControl(FleetControl::SNAPSHOT, "x", "x0");
  WaitVersion([&](const FleetVersion& v) { return v.op_id() == "x0"; });
  std::mt19937_64 rng(23);
  uint64_t s1 = 0;
  for (int i = 0; i < 10; ++i) s1 = PublishCompletion(MakeRow(rng, f), absl::StrCat("a", i));
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= s1; });
  ASSERT_NO_FATAL_FAILURE(checkpoint(s1));
  a->SetReadouts({});  // its checkpoint thread is done (joined)
  {
    absl::StatusOr<FleetState> create =
        ReadNewestState(conn_->nc, conn_->js, stream, subject, s1 - 1);
    ASSERT_TRUE(create.ok()) << create.status();
    EXPECT_EQ(create->state_id, "create");
  }
  // Term 2 (a new worker, from that checkpoint): a snapshot, a checkpoint,
  // more completions, a checkpoint.
  a->SetReadouts({f.readout});
  const uint64_t s2 = PublishControl(FleetControl::SNAPSHOT, "x", "x1");
  WaitVersion([&](const FleetVersion& v) { return v.op_id() == "x1"; });
  ASSERT_NO_FATAL_FAILURE(checkpoint(s2));
  uint64_t s3 = 0;
  for (int i = 10; i < 13; ++i) s3 = PublishCompletion(MakeRow(rng, f), absl::StrCat("a", i));
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= s3; });
  ASSERT_NO_FATAL_FAILURE(checkpoint(s3));
  CloseSubscription(conn_->nc, ckpt);
  a->SetReadouts({});
  absl::StatusOr<FleetState> newest = ReadNewestState(conn_->nc, conn_->js, stream, subject);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->fleet_seq, s3);
  absl::StatusOr<FleetState> before =
      ReadNewestState(conn_->nc, conn_->js, stream, subject, s3 - 1);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->fleet_seq, s2);
  absl::StatusOr<FleetState> purged =
      ReadNewestState(conn_->nc, conn_->js, stream, subject, s2 - 1);
  EXPECT_TRUE(absl::IsNotFound(purged.status()))
      << (purged.ok() ? purged->state_id : std::string());
  a->Abandon();
}

// A trainer whose term begins after the name was created again, with the
// old incarnation still in its readout set (its member has not applied the
// CONFIG change): nothing was stored on the checkpoint subject since it
// read it, so the sequence fence alone would let it write, but the
// subject's newest message names a later incarnation, and its checkpoint
// (here the final one of a clean stop) is not written. The new
// incarnation's trainer then starts from the creation state (before: from
// the old worker's final checkpoint, publishing nothing).
TEST_F(FleetTrainerTest, ATermBegunAfterTheNameWasCreatedAgainWritesNoCheckpoint) {
  Fixture f = MakeFixture(10);
  CreateReadout(f, 1000);
  std::mt19937_64 rng(17);
  uint64_t last = 0;
  for (int i = 0; i < 20; ++i) {
    last = PublishCompletion(MakeRow(rng, f), absl::StrCat("a", i));
  }
  TrainerReadout again = f.readout;
  again.created_unix_ms = f.readout.created_unix_ms + 1000;
  const Eigen::VectorXd theta_b = WriteNewIncarnation(conn_->js, fleet_, f, again, last);
  std::vector<Row> rows_b;
  uint64_t last_b = 0;
  for (int i = 0; i < 10; ++i) {
    rows_b.push_back(MakeRow(rng, f));
    last_b = PublishCompletion(rows_b.back(), absl::StrCat("b", i));
  }
  {
    std::unique_ptr<Trainer> c = *Trainer::Start(conn_->nc, Options("c", 1000));
    c->SetReadouts({f.readout});
    FleetVersion va = WaitVersion([&](const FleetVersion& v) {
      return v.created_unix_ms() == f.readout.created_unix_ms && v.fleet_seq() >= last_b;
    });
    // From its own incarnation's creation state (the new one's is skipped;
    // before, it started from that one): both sets of completions.
    EXPECT_EQ(va.completions_learned(), 30);
  }  // clean stop: the final checkpoint is refused
  absl::StatusOr<FleetState> newest =
      ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
                      CheckpointSubject(fleet_, kReadout));
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->state_id, absl::StrCat("create-", kReadout, "-", again.created_unix_ms));
  std::unique_ptr<Trainer> d = *Trainer::Start(conn_->nc, Options("d", 1000));
  d->SetReadouts({again});
  FleetVersion vb = WaitVersion([&](const FleetVersion& v) {
    return v.created_unix_ms() == again.created_unix_ms && v.fleet_seq() >= last_b;
  });
  EXPECT_EQ(vb.completions_learned(), 10);
  EXPECT_LT(RelErr(Theta(vb), ClosedForm(f, theta_b, f.p0.ToDouble(), rows_b)), 5e-6);
  d->Abandon();
}

}  // namespace
}  // namespace leap::fleet

namespace leap::fleet {
namespace {

// Counter/gauge value of `name` with the label {readout="chat"} (and
// `extra` in its label text) in the registry's text form; -1 when absent.
double MetricValue(prometheus::Registry& r, const std::string& name,
                   const std::string& extra = "") {
  const std::string text = prometheus::TextSerializer().Serialize(r.Collect());
  size_t at = 0;
  while ((at = text.find(name + "{", at)) != std::string::npos) {
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    at = end;
    if (line.find("readout=\"chat\"") == std::string::npos) continue;
    if (!extra.empty() && line.find(extra) == std::string::npos) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) return v;
  }
  return -1;
}

// An RLS batch the trainer rejects is kept, not dropped: learning freezes
// (cause "frozen: rls: ...", leap_fleet_trainer_kept, Status().kept), the
// kept completions survive a trainer restart through the fleet checkpoint,
// and after a rollback to a healthy snapshot and a resume they are learned
// on top of it, once; completions that arrived while frozen are not.
TEST_F(FleetTrainerTest, ARejectedBatchIsKeptAcrossARestartAndLearnedOnResume) {
  Fixture f = MakeFixture(6);
  // P0 = -I: S = I + U P Uᵀ has pivots far below 1/2, so every batch fails
  // the definiteness check.
  CreateReadout(f, 600, readout::SymMatrix::ScaledIdentity(kN, -1.0f));
  auto registry = std::make_shared<prometheus::Registry>();
  TrainerOptions oa = Options("a", 600);
  oa.registry = registry;
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, oa);
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(21);
  std::vector<Row> rows;
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 3; ++i) {
    rows.push_back(MakeRow(rng, f));
    seqs.push_back(PublishCompletion(rows.back(), absl::StrCat("c", i)));
  }
  FleetVersion frozen = WaitVersion(
      [](const FleetVersion& v) { return v.cause().rfind("frozen: rls:", 0) == 0; });
  EXPECT_TRUE(frozen.frozen());
  EXPECT_EQ(frozen.completions_learned(), 0);
  EXPECT_EQ(frozen.theta(), std::string(reinterpret_cast<const char*>(f.theta0.data()),
                                        kN * 8));  // nothing of it applied
  // Completions published now are skipped (frozen), not kept.
  for (int i = 3; i < 6; ++i) {
    rows.push_back(MakeRow(rng, f));
    seqs.push_back(PublishCompletion(rows.back(), absl::StrCat("c", i)));
  }
  // Which rows the rejected batch(es) held: the batch that failed, and
  // nothing after it (the trainer may have split the first three). Once
  // the trainer answered an EXPORT published after the last completion (it
  // reads completions and operations in stream order; a frozen trainer
  // publishes no version), it has dealt with every one of them.
  const std::string answer = ExportSubject(fleet_, kReadout, "x-frozen");
  natsSubscription* exported = SubscribeState(answer);
  ASSERT_NE(exported, nullptr);
  const uint64_t export_seq = PublishControl(FleetControl::EXPORT, "", "x-frozen");
  ASSERT_GT(export_seq, seqs.back());
  absl::StatusOr<FleetState> answered =
      AwaitState(exported, [](const FleetState&) { return true; }, answer);
  CloseSubscription(conn_->nc, exported);
  ASSERT_TRUE(answered.ok()) << "trainer never answered the EXPORT after seq " << seqs.back()
                             << ": " << answered.status();
  EXPECT_EQ(answered->fleet_seq, export_seq);
  {
    // The answer is removed once read, as a member does.
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Stream.Purge.Subject = answer.c_str();
    ASSERT_EQ(js_PurgeStream(conn_->js, StateStream(fleet_).c_str(), &jo, nullptr), NATS_OK);
  }
  absl::StatusOr<FleetState> held = a->ExportState(kReadout);
  ASSERT_TRUE(held.ok()) << held.status();
  std::optional<TrainerReadoutStatus> st = a->Status(kReadout);
  ASSERT_TRUE(st.has_value());
  ASSERT_GE(st->fleet_seq, seqs.back());
  ASSERT_FALSE(held->kept_seqs.empty());
  EXPECT_EQ(held->kept_seqs.front(), seqs.front());
  EXPECT_EQ(st->kept, static_cast<int64_t>(held->kept_seqs.size()));
  EXPECT_TRUE(st->frozen);
  EXPECT_EQ(st->frozen_reason.rfind("rls:", 0), 0u) << st->frozen_reason;
  EXPECT_EQ(MetricValue(*registry, "leap_fleet_trainer_kept"),
            static_cast<double>(held->kept_seqs.size()));
  EXPECT_GE(MetricValue(*registry, "leap_fleet_trainer_rls_errors_total"), 1);
  EXPECT_EQ(MetricValue(*registry, "leap_fleet_trainer_frozen"), 1);
  for (uint64_t k : held->kept_seqs) EXPECT_LE(k, seqs[2]);

  // The fleet checkpoint carries them; a dies; b restarts from it.
  natsSubscription* ckpts = SubscribeState();
  ASSERT_NE(ckpts, nullptr);
  a->RequestCheckpoint();
  absl::StatusOr<FleetState> ck = AwaitState(
      ckpts, [&](const FleetState& s) { return s.fleet_seq >= seqs.back(); });
  CloseSubscription(conn_->nc, ckpts);
  ASSERT_TRUE(ck.ok()) << "no fleet checkpoint: " << ck.status();
  EXPECT_EQ(ck->kept_seqs, held->kept_seqs);
  a->Abandon();
  ExpectCheckpointed(*a, seqs.back());
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, Options("b", 600));
  b->SetReadouts({f.readout});

  // A healthy snapshot "good" (theta0, P0 of the fixture), then rollback to
  // it and resume: the kept rows are learned on top of it.
  FleetState good;
  good.theta = f.theta0;
  good.p = f.p0;
  good.label = "good";
  ASSERT_TRUE(PublishState(conn_->js, StateStream(fleet_),
                           SnapshotSubject(fleet_, kReadout, "good"), kReadout,
                           "good-1", good)
                  .ok());
  PublishControl(FleetControl::ROLLBACK, "good", "rb");
  FleetVersion rb = WaitVersion([](const FleetVersion& v) { return v.op_id() == "rb"; });
  EXPECT_EQ(rb.cause(), "rollback:good");
  EXPECT_EQ(rb.trainer(), "b");
  EXPECT_TRUE(rb.frozen());
  EXPECT_EQ(b->Status(kReadout)->kept, static_cast<int64_t>(held->kept_seqs.size()));
  PublishControl(FleetControl::RESUME, "", "go");
  FleetVersion go = WaitVersion([](const FleetVersion& v) { return v.op_id() == "go"; });
  EXPECT_EQ(go.cause(), "resume");
  EXPECT_FALSE(go.frozen());
  EXPECT_EQ(go.completions_learned(), static_cast<int64_t>(held->kept_seqs.size()));
  EXPECT_EQ(b->Status(kReadout)->kept, 0);
  std::vector<Row> kept_rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (std::find(held->kept_seqs.begin(), held->kept_seqs.end(), seqs[i]) !=
        held->kept_seqs.end()) {
      kept_rows.push_back(rows[i]);
    }
  }
  const double err =
      RelErr(Theta(go), ClosedForm(f, f.theta0, f.p0.ToDouble(), kept_rows));
  std::printf("fleet trainer: %zu kept completions learned after resume: %.3g relative\n",
              kept_rows.size(), err);
  EXPECT_LT(err, 5e-6);
  // Learning goes on.
  rows.push_back(MakeRow(rng, f));
  kept_rows.push_back(rows.back());
  const uint64_t last = PublishCompletion(rows.back(), "c6");
  FleetVersion v = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(v.completions_learned(), static_cast<int64_t>(kept_rows.size()));
  EXPECT_LT(RelErr(Theta(v), ClosedForm(f, f.theta0, f.p0.ToDouble(), kept_rows)), 5e-6);
}

// The duplicate index survives a restart: a completion the stream stored
// twice (resent after JetStream's de-duplication window; the window is
// shortened here) is learned once by a trainer that started after the
// first copy was applied and checkpointed. Checkpoints are written all the
// time meanwhile (every step, local and fleet, on the checkpoint thread):
// the restarted trainer is still exact.
TEST_F(FleetTrainerTest, TheDuplicateIndexSurvivesARestart) {
  Fixture f = MakeFixture(7);
  CreateReadout(f, 600);
  {
    // A 300 ms de-duplication window on FEEDBACK.
    jsStreamInfo* si = nullptr;
    ASSERT_EQ(js_GetStreamInfo(&si, conn_->js, FeedbackStream(fleet_).c_str(), nullptr,
                               nullptr),
              NATS_OK);
    si->Config->Duplicates = int64_t{300} * 1'000'000;
    jsStreamInfo* updated = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    ASSERT_EQ(js_UpdateStream(&updated, conn_->js, si->Config, nullptr, &code), NATS_OK)
        << code;
    jsStreamInfo_Destroy(updated);
    jsStreamInfo_Destroy(si);
  }
  TempDir store_dir;
  auto opened = storage::OpenRocksStore(store_dir.path());
  ASSERT_TRUE(opened.ok()) << opened.status();
  // Every local checkpoint written into it is seen.
  CheckpointWatchStore store(std::move(*opened));
  TrainerOptions oa = Options("a", 600);
  oa.checkpoint_every_ms = 0;
  oa.local_checkpoint_every_ms = 0;
  oa.local_store = &store;
  natsSubscription* ckpts = SubscribeState();
  ASSERT_NE(ckpts, nullptr);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, oa);
  a->SetReadouts({f.readout});
  std::mt19937_64 rng(31);
  std::vector<Row> rows;
  uint64_t last = 0;
  for (int i = 0; i < 200; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("c", i));
  }
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  // The periodic checkpoints (written by the checkpoint thread while the
  // worker went on) reach the end; then a dies without a final one.
  // (A local checkpoint's last_seq is the fleet_seq it holds.)
  absl::StatusOr<FleetState> fleet_ck =
      AwaitState(ckpts, [&](const FleetState& s) { return s.fleet_seq >= last; });
  CloseSubscription(conn_->nc, ckpts);
  ASSERT_TRUE(fleet_ck.ok()) << "the fleet checkpoints never reached " << last << ": "
                             << fleet_ck.status();
  ASSERT_TRUE(store.AwaitCheckpoint(
      kReadout, [&](const storage::ReadoutCheckpoint& c) { return c.last_seq >= last; }))
      << "the local checkpoints never reached " << last;
  a->Abandon();
  ExpectCheckpointed(*a, last, last);
  // c7 again, after the window: stored a second time.
  bool dup = true;
  uint64_t resent = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (dup) {
    ASSERT_LT(absl::Now(), deadline) << "the stream kept de-duplicating";
    // Paces the resends while the stream's duplicate window runs out (a
    // time window, no event announces its end).
    absl::SleepFor(absl::Milliseconds(100));
    resent = PublishCompletion(rows[7], "c7", &dup);
  }
  EXPECT_GT(resent, last);

  auto registry = std::make_shared<prometheus::Registry>();
  TrainerOptions ob = Options("b", 600);
  ob.registry = registry;
  ob.local_store = &store;
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, ob);
  b->SetReadouts({f.readout});
  rows.push_back(MakeRow(rng, f));
  last = PublishCompletion(rows.back(), "c200");
  FleetVersion v = WaitVersion(
      [&](const FleetVersion& v) { return v.trainer() == "b" && v.fleet_seq() >= last; });
  EXPECT_EQ(v.completions_learned(), 201);
  EXPECT_EQ(MetricValue(*registry, "leap_fleet_trainer_completions_skipped_total",
                        "reason=\"duplicate\""),
            1);
  EXPECT_EQ(b->Status(kReadout)->remembered_ids, 200);
  const double err = RelErr(Theta(v), ClosedForm(f, f.theta0, f.p0.ToDouble(), rows));
  std::printf("fleet trainer: restart from a periodic checkpoint with a stored resend: "
              "%.3g relative\n",
              err);
  EXPECT_LT(err, 5e-6);
  b.reset();
}

// A clean stop with NATS gone is bounded (no NATS call waits longer than
// the lease; nothing is written to NATS once the connection is down) and
// still writes the local checkpoint.
TEST_F(FleetTrainerTest, AStopWithNatsDownIsBoundedAndCheckpointsLocally) {
  Fixture f = MakeFixture(8);
  const int64_t lease_ms = 1000;
  CreateReadout(f, lease_ms);
  TempDir store_dir;
  auto store = storage::OpenRocksStore(store_dir.path());
  ASSERT_TRUE(store.ok()) << store.status();
  TrainerOptions o = Options("a", lease_ms);
  o.local_store = store->get();
  std::unique_ptr<Trainer> t = *Trainer::Start(conn_->nc, o);
  t->SetReadouts({f.readout});
  std::mt19937_64 rng(41);
  uint64_t last = 0;
  for (int i = 0; i < 50; ++i) last = PublishCompletion(MakeRow(rng, f), absl::StrCat("c", i));
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  CloseSubscription(conn_->nc, versions_);
  versions_ = nullptr;
  server_.Kill();
  const absl::Time t0 = absl::Now();
  t.reset();
  const int64_t stop_ms = absl::ToInt64Milliseconds(absl::Now() - t0);
  std::printf("fleet trainer: clean stop with NATS down took %lld ms (lease %lld ms)\n",
              static_cast<long long>(stop_ms), static_cast<long long>(lease_ms));
  EXPECT_LT(stop_ms, 4 * lease_ms);  // each call waits <= 2 leases
  absl::StatusOr<storage::RecoveredState> local = (*store)->Load();
  ASSERT_TRUE(local.ok()) << local.status();
  ASSERT_EQ(local->readouts.size(), 1u);
  EXPECT_EQ(local->readouts[0].checkpoint.last_seq, last);
  EXPECT_EQ(local->readouts[0].checkpoint.completions_learned, 50);
}

// A checkpoint captured while taken rows wait to be applied (they are not
// in theta and P, and fleet_seq excludes them, but the quality has counted
// them), then a crash (Abandon: no final checkpoint) and a restart from
// that checkpoint: the waiting rows are replayed from the stream and
// learned once, and counted in the quality once.
TEST_F(FleetTrainerTest, ACheckpointTakenWhileRowsWaitRestartsExactlyOnce) {
  Fixture f = MakeFixture(12);
  CreateReadout(f, 600);
  std::mt19937_64 rng(51);
  std::vector<Row> rows;
  // All in the stream before the trainer starts, so its first read takes
  // them together: 10 rows, an EXPORT whose deadline has passed (a control
  // operation: it applies the rows before it and moves fleet_seq, and is
  // not answered), 20 rows that then wait (fewer than 64, no version due).
  for (int i = 0; i < 10; ++i) {
    rows.push_back(MakeRow(rng, f));
    PublishCompletion(rows.back(), absl::StrCat("w", i));
  }
  const uint64_t split = PublishControl(FleetControl::EXPORT, "", "old", 1);
  uint64_t last = 0;
  for (int i = 10; i < 30; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("w", i));
  }
  TrainerOptions oa = Options("a", 600);
  oa.version_interval_ms = int64_t{1} << 50;  // never due: rows wait for 64
  oa.checkpoint_every_ms = 0;  // a fleet checkpoint whenever fleet_seq moved
  natsSubscription* ckpts = SubscribeState();
  ASSERT_NE(ckpts, nullptr);
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, oa);
  a->SetReadouts({f.readout});
  // a applies the waiting rows once the stream is idle, and checkpoints.
  absl::StatusOr<FleetState> ck = AwaitState(ckpts, [&](const FleetState& s) {
    return s.completions_learned == 30 && s.fleet_seq >= last;
  });
  CloseSubscription(conn_->nc, ckpts);
  ASSERT_TRUE(ck.ok()) << "trainer a never checkpointed seq " << last << ": " << ck.status();
  {
    std::optional<TrainerReadoutStatus> st = a->Status(kReadout);
    ASSERT_TRUE(st.has_value());
    EXPECT_EQ(st->completions_learned, 30);
    EXPECT_GE(st->fleet_seq, last);
  }
  a->Abandon();
  ExpectCheckpointed(*a, last);
  // The checkpoint captured at the EXPORT: the 10 rows before it learned,
  // the 20 after it taken (counted in the quality) and not applied.
  absl::StatusOr<FleetState> mid =
      ReadNewestState(conn_->nc, conn_->js, StateStream(fleet_),
                      CheckpointSubject(fleet_, kReadout), last - 1);
  ASSERT_TRUE(mid.ok()) << mid.status();
  EXPECT_EQ(mid->fleet_seq, split);
  EXPECT_EQ(mid->completions_learned, 10);
  FleetQuality q;
  ASSERT_TRUE(q.ParseFromString(mid->quality));
  EXPECT_EQ(q.fleet_seq(), last);
  EXPECT_EQ(q.overall().completions(), 30);
  // The trainer died right after it: it is the fleet's newest checkpoint.
  ASSERT_TRUE(PublishState(conn_->js, StateStream(fleet_), CheckpointSubject(fleet_, kReadout),
                           kReadout, "a-mid-again", *mid)
                  .ok());
  auto registry = std::make_shared<prometheus::Registry>();
  TrainerOptions ob = Options("b", 600);
  ob.registry = registry;
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, ob);
  b->SetReadouts({f.readout});
  rows.push_back(MakeRow(rng, f));
  last = PublishCompletion(rows.back(), "w30");
  FleetVersion v = WaitVersion(
      [&](const FleetVersion& v) { return v.trainer() == "b" && v.fleet_seq() >= last; });
  EXPECT_EQ(v.completions_learned(), 31);
  const double err = RelErr(Theta(v), ClosedForm(f, f.theta0, f.p0.ToDouble(), rows));
  std::printf("fleet trainer: restart from a checkpoint taken while 20 rows waited: %.3g "
              "relative\n",
              err);
  EXPECT_LT(err, 5e-6);
  std::optional<TrainerReadoutStatus> sb = b->Status(kReadout);
  ASSERT_TRUE(sb.has_value());
  EXPECT_EQ(sb->quality_completions, 31);
  // None skipped as a duplicate (-1: the series was never created).
  EXPECT_LE(MetricValue(*registry, "leap_fleet_trainer_completions_skipped_total",
                        "reason=\"duplicate\""),
            0);
  b.reset();
}


using ::leap::testing::RefSpearman;

// One completion as a member publishes it, with what quality needs.
struct Served {
  std::string member, product_line, arm;
  int64_t version = 0;
  double predicted = 0, truth = 0;
};

// Fleet-wide quality (docs/FLEET.md "Online quality"): two members' pairs,
// counted once per (version, arm) by the trainer, equal to the union's
// Spearman; the same after a crash restarted from a newer local checkpoint
// than the fleet's (the quality is then behind theta and P and catches up)
// and after a takeover from the fleet checkpoint; published in CONFIG.
TEST_F(FleetTrainerTest, FleetWideQualityCountsEveryMembersPairsOnce) {
  Fixture f = MakeFixture(9);
  const int64_t lease_ms = 600;
  CreateReadout(f, lease_ms);
  {
    kvConfig kc;
    kvConfig_Init(&kc);
    const std::string bucket = ConfigBucket(fleet_);
    kc.Bucket = bucket.c_str();
    kc.History = 1;
    kvStore* kv = nullptr;
    ASSERT_EQ(js_CreateKeyValue(&kv, conn_->js, &kc), NATS_OK);
    kvStore_Destroy(kv);
  }
  TempDir store_dir;
  auto opened = storage::OpenRocksStore(store_dir.path());
  ASSERT_TRUE(opened.ok()) << opened.status();
  // Every local checkpoint written into it is seen.
  CheckpointWatchStore store(std::move(*opened));
  constexpr int64_t kWindow = 64;  // small: the windows roll
  TrainerOptions oa = Options("a", lease_ms);
  oa.local_store = &store;
  oa.local_checkpoint_every_ms = 0;  // local checkpoints follow the stream
  oa.quality_window = kWindow;
  std::unique_ptr<Trainer> a = *Trainer::Start(conn_->nc, oa);
  a->SetReadouts({f.readout});

  std::unique_ptr<Conn> m2 = Connect(server_.url());
  std::mt19937_64 rng(51);
  std::uniform_real_distribution<double> logt(1.0, 7.0);
  std::normal_distribution<double> noise(0.0, 0.6);
  std::vector<Served> served;
  int next = 0;
  // Member m1 serves product line chat arm "a"; m2 chat arms "a" and "b"
  // and code arm "a"; versions move on every 40 completions.
  auto publish = [&](int count) {
    uint64_t seq = 0;
    for (int i = 0; i < count; ++i, ++next) {
      static const std::string kNames[] = {"m1", "m2", "chat", "code", "a", "b"};
      const bool m1 = next % 2 == 0;
      const double truth = std::floor(std::exp(logt(rng)));
      const Served s{kNames[m1 ? 0 : 1], kNames[m1 || next % 3 != 0 ? 2 : 3],
                     kNames[m1 || next % 5 != 1 ? 4 : 5], 1 + next / 40,
                     truth * std::exp(noise(rng)), truth};
      const Row r = MakeRow(rng, f);
      FleetCompletion c;
      c.set_readout(kReadout);
      c.set_request_id(absl::StrCat("q", next));
      c.set_dtype(1);
      c.set_features(std::string(reinterpret_cast<const char*>(r.x.data()), kDim * 4));
      c.set_target(r.y);
      c.set_member(s.member);
      c.set_product_line(s.product_line);
      c.set_arm(s.arm);
      c.set_served_version(s.version);
      c.set_predicted_tokens(s.predicted);
      c.set_true_tokens(s.truth);
      const std::string bytes = c.SerializeAsString();
      const std::string id = absl::StrCat("q", next);
      jsPubOptions po;
      jsPubOptions_Init(&po);
      po.MsgId = id.c_str();
      jsPubAck* ack = nullptr;
      jsCtx* js = s.member == "m1" ? conn_->js : m2->js;
      EXPECT_EQ(js_Publish(&ack, js, FeedbackSubject(fleet_, kReadout).c_str(), bytes.data(),
                           static_cast<int>(bytes.size()), &po, nullptr),
                NATS_OK);
      if (ack != nullptr) {
        seq = ack->Sequence;
        jsPubAck_Destroy(ack);
      }
      served.push_back(s);
    }
    return seq;
  };
  // The union of both members' pairs, series by series, in stream order.
  auto check = [&](const FleetQuality& q, const char* when) {
    SCOPED_TRACE(when);
    std::map<int64_t, std::vector<std::pair<double, double>>> by_version;
    std::map<std::pair<std::string, std::string>, std::vector<std::pair<double, double>>>
        by_arm;
    std::vector<std::pair<double, double>> all;
    for (const Served& s : served) {
      by_version[s.version].emplace_back(s.predicted, s.truth);
      by_arm[{s.product_line, s.arm}].emplace_back(s.predicted, s.truth);
      all.emplace_back(s.predicted, s.truth);
    }
    auto expect_series = [&](const leap::v1::fleet::FleetQualitySeries& got,
                             const std::vector<std::pair<double, double>>& pairs) {
      EXPECT_EQ(got.completions(), static_cast<int64_t>(pairs.size()));
      const size_t from = pairs.size() > kWindow ? pairs.size() - kWindow : 0;
      const std::vector<std::pair<double, double>> newest(pairs.begin() + from, pairs.end());
      EXPECT_EQ(got.spearman_n(), static_cast<int64_t>(newest.size()));
      EXPECT_NEAR(got.spearman(), RefSpearman(newest), 1e-12);
    };
    EXPECT_EQ(q.window(), kWindow);
    expect_series(q.overall(), all);
    ASSERT_EQ(q.versions_size(), static_cast<int>(by_version.size()));
    for (const auto& v : q.versions()) expect_series(v, by_version[v.version()]);
    ASSERT_EQ(q.arms_size(), static_cast<int>(by_arm.size()));
    for (const auto& a : q.arms()) expect_series(a, by_arm[{a.product_line(), a.arm()}]);
  };
  // What a trainer reached is awaited on what it writes. A version: it is
  // published after the completions up to its fleet_seq were applied and
  // counted in the quality (one pass over the stream).
  auto await_version = [&](Trainer& t, const std::string& trainer, uint64_t seq) {
    const FleetVersion v = WaitVersion(
        [&](const FleetVersion& v) { return v.trainer() == trainer && v.fleet_seq() >= seq; });
    ASSERT_GE(v.fleet_seq(), seq) << "trainer " << trainer << " never reached seq " << seq;
    std::optional<TrainerReadoutStatus> st = t.Status(kReadout);
    ASSERT_TRUE(st.has_value());
    EXPECT_TRUE(st->running);
    EXPECT_GE(st->fleet_seq, seq);
    EXPECT_GE(st->quality_seq, seq);
  };
  // A fleet checkpoint (STATE), asked for now.
  auto checkpoint = [&](Trainer& t, uint64_t seq) {
    natsSubscription* ckpts = SubscribeState();
    ASSERT_NE(ckpts, nullptr);
    t.RequestCheckpoint();
    absl::StatusOr<FleetState> ck =
        AwaitState(ckpts, [&](const FleetState& s) { return s.fleet_seq >= seq; });
    CloseSubscription(conn_->nc, ckpts);
    ASSERT_TRUE(ck.ok()) << "no fleet checkpoint reached seq " << seq << ": " << ck.status();
  };

  // 1. 150 completions (20 of them while learning is frozen: still counted),
  // then a fleet checkpoint.
  uint64_t last = publish(100);
  PublishControl(FleetControl::FREEZE, "", "op-freeze");
  publish(20);
  PublishControl(FleetControl::RESUME, "", "op-resume");
  last = publish(30);
  ASSERT_NO_FATAL_FAILURE(await_version(*a, "a", last));
  ASSERT_NO_FATAL_FAILURE(checkpoint(*a, last));
  const uint64_t fleet_checkpointed = last;
  check(*a->Quality(kReadout), "first trainer");
  // 2. 100 more, in the local checkpoints only; then a crash.
  last = publish(100);
  ASSERT_NO_FATAL_FAILURE(await_version(*a, "a", last));
  // (A local checkpoint's last_seq is the fleet_seq it holds.)
  ASSERT_TRUE(store.AwaitCheckpoint(
      kReadout, [&](const storage::ReadoutCheckpoint& c) { return c.last_seq >= last; }))
      << "no local checkpoint reached seq " << last;
  check(*a->Quality(kReadout), "first trainer, more");
  a->Abandon();
  ExpectCheckpointed(*a, fleet_checkpointed, last);
  a.reset();
  // 3. Restarted: theta and P from the local checkpoint (newer), the
  // quality from the fleet checkpoint, counted on from there.
  std::unique_ptr<Conn> conn_a2 = Connect(server_.url());
  std::unique_ptr<Trainer> a2 = *Trainer::Start(conn_a2->nc, oa);
  a2->SetReadouts({f.readout});
  last = publish(30);
  ASSERT_NO_FATAL_FAILURE(await_version(*a2, "a", last));
  EXPECT_EQ(a2->Status(kReadout)->completions_learned, 280 - 20);
  check(*a2->Quality(kReadout), "restarted from the local checkpoint");
  ASSERT_NO_FATAL_FAILURE(checkpoint(*a2, last));
  const uint64_t fleet_checkpointed2 = last;
  // 4. Another member takes over from the fleet checkpoint after a crash.
  last = publish(20);
  ASSERT_NO_FATAL_FAILURE(await_version(*a2, "a", last));
  a2->Abandon();
  ExpectCheckpointed(*a2, fleet_checkpointed2);
  a2.reset();
  std::unique_ptr<Conn> conn_b = Connect(server_.url());
  TrainerOptions ob = Options("b", lease_ms);
  ob.quality_window = kWindow;
  std::unique_ptr<Trainer> b = *Trainer::Start(conn_b->nc, ob);
  b->SetReadouts({f.readout});
  ASSERT_NO_FATAL_FAILURE(await_version(*b, "b", last));
  const FleetQuality qb = *b->Quality(kReadout);
  check(qb, "taken over from the fleet checkpoint");
  EXPECT_EQ(qb.overall().completions(), 300);
  // 5. What members read: CONFIG quality.<readout>, without pairs.
  kvStore* kv = nullptr;
  ASSERT_EQ(js_KeyValue(&kv, conn_->js, ConfigBucket(fleet_).c_str()), NATS_OK);
  kvWatcher* w = nullptr;
  ASSERT_EQ(kvStore_Watch(&w, kv, QualityConfigKey(kReadout).c_str(), nullptr), NATS_OK);
  FleetQuality published;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!(published.trainer() == "b" && published.fleet_seq() >= last)) {
    kvEntry* e = nullptr;
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    ASSERT_EQ(kvWatcher_Next(&e, w, std::max<int64_t>(left, 1)), NATS_OK)
        << "no quality published by b";
    if (e == nullptr) continue;  // end of the initial values
    published.ParseFromArray(kvEntry_Value(e), kvEntry_ValueLen(e));
    kvEntry_Destroy(e);
  }
  kvWatcher_Destroy(w);
  kvStore_Destroy(kv);
  check(published, "published in CONFIG");
  EXPECT_EQ(published.overall().predicted_size(), 0);
  EXPECT_EQ(published.created_unix_ms(), f.readout.created_unix_ms);
  std::printf("fleet trainer: fleet-wide quality of 300 completions from 2 members: "
              "spearman %.4f over the newest %lld, %d versions, %d arms\n",
              published.overall().spearman(),
              static_cast<long long>(published.overall().spearman_n()),
              published.versions_size(), published.arms_size());
}


// A checkpoint's quality fits under the chunk room however much there is:
// series keep their pairs while they fit (overall, arms, newest versions),
// the others their numbers, and decoding gives back the same report.
TEST(FleetQualityTracker, ACheckpointKeepsPairsWithinItsBudgetAndRestoresTheReport) {
  FleetQualityTracker t(1000);
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> u(1, 1000);
  for (int64_t v = 1; v <= 40; ++v) {
    for (int i = 0; i < 1200; ++i) {
      const double truth = std::floor(u(rng));
      t.Add(v, "chat", i % 3 == 0 ? "b" : "a", truth * std::exp(u(rng) / 2000), truth);
    }
  }
  const FleetQuality full = t.Encode(/*with_pairs=*/true);
  int64_t pairs = full.overall().predicted_size();
  for (const auto& a : full.arms()) pairs += a.predicted_size();
  int versions_with_pairs = 0;
  for (const auto& v : full.versions()) {
    pairs += v.predicted_size();
    if (v.predicted_size() > 0) ++versions_with_pairs;
  }
  EXPECT_LE(pairs, kQualityCheckpointPairs);
  EXPECT_LT(full.ByteSizeLong(), static_cast<size_t>(kStateChunkBytes / 2));
  EXPECT_EQ(full.versions(0).version(), 40);  // newest first, with pairs
  EXPECT_GT(full.versions(0).predicted_size(), 0);
  EXPECT_EQ(versions_with_pairs, (kQualityCheckpointPairs - 3000) / 1000);
  FleetQualityTracker back(1000);
  back.Decode(full);
  EXPECT_EQ(back.Encode(false).SerializeAsString(), t.Encode(false).SerializeAsString());
  // A version restored without pairs reports its numbers until its next
  // pair, then counts on from a fresh window.
  back.Add(1, "chat", "a", 1, 1);
  back.Add(1, "chat", "a", 2, 2);
  const FleetQuality after = back.Encode(false);
  bool found = false;
  for (const auto& v : after.versions()) {
    if (v.version() != 1) continue;
    found = true;
    EXPECT_EQ(v.completions(), 1202);
    EXPECT_EQ(v.spearman_n(), 2);
    EXPECT_DOUBLE_EQ(v.spearman(), 1.0);
  }
  EXPECT_TRUE(found);
}


// Completions that arrive one at a time wait for a batch (64 rows, a due
// version or an idle stream) instead of being applied one by one: with a
// version interval of 2 s and 40 completions published back to back, the
// trainer applies them in a few RLS batches, and the result is still the
// closed form over all of them.
TEST_F(FleetTrainerTest, RowsArrivingOneByOneAreAppliedInAFewBatches) {
  Fixture f = MakeFixture(11);
  CreateReadout(f, 1000);
  auto registry = std::make_shared<prometheus::Registry>();
  TrainerOptions o = Options("a", 1000);
  o.version_interval_ms = 2000;
  o.registry = registry;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Start(conn_->nc, o);
  ASSERT_TRUE(t.ok()) << t.status();
  (*t)->SetReadouts({f.readout});
  std::mt19937_64 rng(3);
  std::vector<Row> rows;
  // A first completion and its version: the trainer runs and waits on the
  // stream, a version was just published (the next is due in 2 s).
  rows.push_back(MakeRow(rng, f));
  uint64_t last = PublishCompletion(rows.back(), "one");
  WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  const double before = MetricValue(*registry, "leap_fleet_trainer_batches_total");
  EXPECT_GE(before, 1);
  for (int i = 0; i < 40; ++i) {
    rows.push_back(MakeRow(rng, f));
    last = PublishCompletion(rows.back(), absl::StrCat("one", i));
  }
  FleetVersion v = WaitVersion([&](const FleetVersion& v) { return v.fleet_seq() >= last; });
  EXPECT_EQ(v.completions_learned(), 41);
  EXPECT_LT(RelErr(Theta(v), ClosedForm(f, f.theta0, f.p0.ToDouble(), rows)), 5e-6);
  // Applied as they arrive this would be about 40 batches. (A publish that
  // stalls past the idle wait on a busy machine splits the batch.)
  const double batches = MetricValue(*registry, "leap_fleet_trainer_batches_total") - before;
  std::printf("fleet trainer: 40 completions one by one applied in %.0f RLS batch(es)\n",
              batches);
  EXPECT_GE(batches, 1);
  EXPECT_LE(batches, 5);
}

}  // namespace
}  // namespace leap::fleet
