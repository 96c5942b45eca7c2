// The member side of fleet mode, in process (a real Core over a real RocksDB
// store, a real FleetMember) against a real nats-server started by the test
// (-js, file storage in a temp dir, a free loopback port): a completion is
// acknowledged with its FEEDBACK stream sequence and is in the stream under
// the expected message id; a resend is acknowledged as a duplicate and never
// stored twice (also when another member publishes it); with NATS down,
// completions get UNAVAILABLE while predictions go on, and after NATS comes
// back the outbox record is published once; a record left in the outbox by
// a restart is republished at start; a FleetVersion published on the
// subject is installed and served (score checked against FP64), also one
// that arrives while its readout is being created (the order forced); fleet-wide
// operations wait for the trainer's answer. Fails when /usr/sbin/nats-server
// is missing (scripts/install-deps installs it).
#include "sidecar/fleet/member.h"

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/process.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "leap/v1/fleet.pb.h"
#include "storage/rocksdb_store.h"
#include "tests/support/checkpoint_watch_store.h"
#include "tests/support/readout_fixtures.h"

namespace leap::fleet {
namespace {

namespace fpb = ::leap::v1::fleet;
using sidecar::Core;
using sidecar::CoreOptions;
using sidecar::ScoreRequest;
using ::leap::testing::CheckpointWatchStore;
using ::leap::testing::RandomFeatures;
using ::leap::testing::RandomState;
using ::leap::testing::ReferenceScore;
using ::leap::testing::ScoreTolerance;

constexpr char kNatsServer[] = "/usr/sbin/nats-server";
constexpr char kFleet[] = "t1";
constexpr int64_t kDim = 16;

// A trainer's "rls" version `number` of `readout` (theta in the
// standardized space, FP64), from "trainer-x".
fpb::FleetVersion TrainerVersion(const std::string& readout, int64_t number,
                                 const Eigen::VectorXd& theta, int64_t learned,
                                 uint64_t fleet_seq) {
  fpb::FleetVersion v;
  v.set_readout(readout);
  v.set_version(number);
  v.set_theta(std::string(reinterpret_cast<const char*>(theta.data()),
                          theta.size() * sizeof(double)));
  v.set_completions_learned(learned);
  v.set_fleet_seq(fleet_seq);
  v.set_cause("rls");
  v.set_trainer("trainer-x");
  return v;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

int64_t EnvOr(const char* name, int64_t def) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : def;
}

class Recorder : public sidecar::PublishListener {
 public:
  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const sidecar::PublishedVersion>& v) override {
    absl::MutexLock l(&mu_);
    seen_.push_back(v);
  }
  // Waits (up to 20 s) for a publish that satisfies `pred` (the last such
  // one; null at the timeout).
  std::shared_ptr<const sidecar::PublishedVersion> Await(
      const std::function<bool(const sidecar::PublishedVersion&)>& pred) {
    absl::MutexLock l(&mu_);
    std::shared_ptr<const sidecar::PublishedVersion> found;
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& v : seen_) {
        if (pred(*v)) found = v;
      }
      return found != nullptr;
    };
    mu_.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(20));
    return found;
  }
  // Waits for a publish of `version`.
  std::shared_ptr<const sidecar::PublishedVersion> Await(int64_t version) {
    return Await([version](const sidecar::PublishedVersion& v) { return v.version == version; });
  }

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<const sidecar::PublishedVersion>> seen_
      ABSL_GUARDED_BY(mu_);
};

// One member: a Core over its own RocksDB store and a FleetMember.
struct Member {
  std::unique_ptr<CheckpointWatchStore> store;
  sidecar::Metrics metrics;
  std::unique_ptr<Core> core;
  std::unique_ptr<FleetMember> fleet;
  std::shared_ptr<Recorder> recorder = std::make_shared<Recorder>();
  absl::Mutex mu;
  bool degraded ABSL_GUARDED_BY(mu) = true;

  ~Member() {
    if (core != nullptr) core->SetFleet(nullptr);
    if (fleet != nullptr) fleet->Stop();
    fleet.reset();
    if (core != nullptr) core->Shutdown(false);
  }
  bool AwaitDegraded(bool want) {
    absl::MutexLock l(&mu);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return degraded == want; };
    return mu.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(20));
  }
};

class FleetMemberTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(kNatsServer))
        << kNatsServer << " missing (scripts/install-deps installs nats-server)";
    tmp_ = std::make_unique<::leap::testing::ScopedTempDir>(absl::StrCat(
        "fleet_member_test_", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    dir_ = tmp_->path();
    std::filesystem::create_directories(dir_ / "js");
    port_ = FreePort();
    StartNats();
    NatsClientOptions o;
    o.servers = {Url()};
    auto c = NatsClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    observer_ = std::move(*c);
    ASSERT_TRUE(observer_->WaitConnected(20000).ok());
  }
  void TearDown() override {
    observer_.reset();
    nats_.reset();
    tmp_.reset();
  }

  std::string Url() const { return absl::StrCat("nats://127.0.0.1:", port_); }

  void StartNats() {
    client::ProcessOptions po;
    po.merge_stderr = true;
    po.die_with_parent = true;
    auto p = client::Process::Start(
        {kNatsServer, "-js", "-sd", (dir_ / "js").string(), "-a", "127.0.0.1",
         "-p", std::to_string(port_)},
        po);
    ASSERT_TRUE(p.ok()) << p.status();
    nats_ = std::move(*p);
  }
  // SIGSTOP to the nats-server, returning once it is stopped (kill() only
  // queues the signal: a publish sent right after could still be answered).
  void StopNats() {
    nats_->Signal(SIGSTOP);
    int st = 0;
    pid_t r;
    while ((r = waitpid(nats_->pid(), &st, WUNTRACED)) < 0 && errno == EINTR) {
    }
    ASSERT_EQ(r, nats_->pid());
    ASSERT_TRUE(WIFSTOPPED(st)) << st;
  }
  void KillNats() {
    nats_->Signal(SIGKILL);
    nats_->Wait();
    nats_.reset();
  }

  std::unique_ptr<Member> StartMember(const std::string& id,
                                      int64_t op_timeout_ms = 10'000,
                                      int64_t wait_ms = 20'000,
                                      int64_t versions_kept = 10'000,
                                      int64_t nats_timeout_ms = 2000,
                                      std::function<void(FleetMemberOptions*)> tweak = {}) {
    auto m = std::make_unique<Member>();
    storage::RocksStoreOptions so;
    auto st = storage::OpenRocksStore((dir_ / id).string(), so);
    EXPECT_TRUE(st.ok()) << st.status();
    m->store = std::make_unique<CheckpointWatchStore>(std::move(*st));
    auto loaded = m->store->Load();
    EXPECT_TRUE(loaded.ok());
    CoreOptions co;
    co.readout.serving_only = true;
    co.readout.versions_kept = versions_kept;
    co.cache.max_bytes = 64 << 20;
    m->core = std::make_unique<Core>(co, &m->metrics, m->store.get());
    m->core->hub().Subscribe(m->recorder);
    std::map<std::string, std::vector<storage::LogRecord>> outbox;
    for (const auto& r : loaded->readouts) {
      if (!r.log.empty()) outbox[r.meta.name] = r.log;
    }
    EXPECT_TRUE(m->core->Recover(std::move(*loaded)).ok());
    FleetMemberOptions fo;
    fo.nats.servers = {Url()};
    fo.fleet = kFleet;
    fo.member = id;
    fo.op_timeout_ms = op_timeout_ms;
    fo.nats.timeout_ms = nats_timeout_ms;
    Member* raw = m.get();
    fo.on_degraded = [raw](bool d) {
      absl::MutexLock l(&raw->mu);
      raw->degraded = d;
    };
    if (tweak) tweak(&fo);
    auto f = FleetMember::Create(m->core.get(), fo);
    EXPECT_TRUE(f.ok()) << f.status();
    m->fleet = std::move(*f);
    m->core->SetFleet(m->fleet.get());
    EXPECT_TRUE(m->fleet->Start(std::move(outbox), wait_ms).ok());
    return m;
  }

  uint64_t LastFeedbackSeq() {
    auto s = observer_->LastSeq(FeedbackStream(kFleet));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : 0;
  }

  std::unique_ptr<::leap::testing::ScopedTempDir> tmp_;
  std::filesystem::path dir_;
  int port_ = 0;
  std::unique_ptr<client::Process> nats_;
  std::unique_ptr<NatsClient> observer_;
};

ScoreRequest Req(const std::string& id, const std::vector<float>& x) {
  ScoreRequest s;
  s.request_id = id;
  s.features = absl::string_view(reinterpret_cast<const char*>(x.data()),
                                 x.size() * sizeof(float));
  return s;
}

TEST(FleetNaming, NamesAndTokens) {
  EXPECT_EQ(FeedbackStream("prod"), "LEAP_prod_FEEDBACK");
  EXPECT_EQ(VersionsStream("prod"), "LEAP_prod_VERSIONS");
  EXPECT_EQ(StateStream("prod"), "LEAP_prod_STATE");
  EXPECT_EQ(ConfigBucket("prod"), "LEAP_prod_CONFIG");
  EXPECT_EQ(LeaseBucket("prod"), "LEAP_prod_LEASE");
  // A readout's completions and control operations share one prefix, so
  // one consumer filter reads both in stream order.
  EXPECT_EQ(FeedbackSubject("prod", "chat"), "leap.prod.fb.chat.c");
  EXPECT_EQ(ControlSubject("prod", "chat"), "leap.prod.fb.chat.ctl");
  EXPECT_EQ(ReadoutFeedbackSubjects("prod", "chat"), "leap.prod.fb.chat.>");
  EXPECT_EQ(FeedbackSubjects("prod"), "leap.prod.fb.>");
  EXPECT_EQ(ControlSubjects("prod"), "leap.prod.fb.*.ctl");
  EXPECT_EQ(*ReadoutOfSubject("prod", "leap.prod.fb.chat.ctl"), "chat");
  EXPECT_EQ(*ReadoutOfSubject("prod", "leap.prod.fb.chat.c"), "chat");
  EXPECT_FALSE(ReadoutOfSubject("prod", "leap.prod.fb.chat").ok());
  EXPECT_FALSE(ReadoutOfSubject("prod", "leap.prod.fb.chat.x").ok());
  EXPECT_EQ(VersionSubject("prod", "chat"), "leap.prod.ver.chat");
  EXPECT_EQ(CheckpointSubject("prod", "chat"), "leap.prod.ckpt.chat");
  EXPECT_EQ(SnapshotSubject("prod", "chat", "good_1"), "leap.prod.snap.chat.good_1");
  // A dot would split the token: hex-encoded, and back.
  EXPECT_EQ(FeedbackSubject("prod", "chat.v2"), "leap.prod.fb.=636861742e7632.c");
  EXPECT_EQ(*ReadoutOfSubject("prod", "leap.prod.fb.=636861742e7632.c"), "chat.v2");
  EXPECT_EQ(*ReadoutOfSubject("prod", "leap.prod.ver.chat"), "chat");
  EXPECT_FALSE(ReadoutOfSubject("prod", "leap.other.ver.chat").ok());
  EXPECT_EQ(RouteConfigKey(""), "route.=");
  EXPECT_EQ(*NameFromToken("="), "");
  EXPECT_EQ(RouteConfigKey("code"), "route.code");
  EXPECT_FALSE(NameFromToken("=6").ok());
  EXPECT_FALSE(NameFromToken("a.b").ok());
  EXPECT_TRUE(ValidateFleetName("prod-1_a").ok());
  EXPECT_FALSE(ValidateFleetName("").ok());
  EXPECT_FALSE(ValidateFleetName("a.b").ok());
  EXPECT_FALSE(ValidateFleetName(std::string(33, 'a')).ok());
  EXPECT_TRUE(ValidateMemberId("pod-7.ns").ok());
  EXPECT_FALSE(ValidateMemberId("a b").ok());
}

TEST_F(FleetMemberTest, CompletionInStreamOnceAndResendIsDuplicate) {
  auto a = StartMember("a");
  ASSERT_TRUE(a->fleet->ready());
  const readout::ReadoutState st = RandomState(kDim, 7);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  sidecar::Route r;
  r.arms.push_back({"chat", "chat", 100.0, false});
  ASSERT_TRUE(a->fleet->SetRoute(r).ok());
  // A second member picks the readout and the route up from CONFIG.
  auto b = StartMember("b");
  ASSERT_TRUE(b->core->GetReadout("chat").ok());
  ASSERT_EQ(b->core->ListRoutes().size(), 1u);

  std::mt19937_64 rng(1);
  const std::vector<float> x = RandomFeatures(st, rng);
  const uint64_t before = LastFeedbackSeq();
  ASSERT_TRUE(a->core->Predict(Req("r1", x), 0, nullptr).ok());
  auto done = a->core->Complete("r1", 100, readout::FinishReason::kStop);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->learned);
  EXPECT_FALSE(done->duplicate);
  EXPECT_EQ(done->fleet_seq, before + 1);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);

  auto msg = observer_->GetMsg(FeedbackStream(kFleet), done->fleet_seq);
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->subject, "leap.t1.fb.chat.c");
  const double target = std::sqrt(100.0);
  const std::string features(reinterpret_cast<const char*>(x.data()),
                             x.size() * sizeof(float));
  EXPECT_EQ(msg->msg_id, FleetMember::MessageId("chat", "r1", 1, features, target));
  fpb::FleetCompletion c;
  ASSERT_TRUE(c.ParseFromString(msg->data));
  EXPECT_EQ(c.readout(), "chat");
  EXPECT_EQ(c.request_id(), "r1");
  EXPECT_EQ(c.features(), features);
  EXPECT_EQ(c.target(), target);
  EXPECT_EQ(c.member(), "a");
  EXPECT_EQ(c.served_version(), 1);
  EXPECT_EQ(c.true_tokens(), 100.0);

  // The engine resends (its ack was lost): a duplicate, nothing new stored.
  auto again = a->core->Complete("r1", 100, readout::FinishReason::kStop);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(again->fleet_seq, done->fleet_seq);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);

  // The engine moved to member b and resent the request and its completion:
  // b publishes it under the same message id; JetStream stores it once.
  ASSERT_TRUE(b->core->Predict(Req("r1", x), 0, nullptr).ok());
  auto moved = b->core->Complete("r1", 100, readout::FinishReason::kStop);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->fleet_seq, done->fleet_seq);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);

  // A cancelled request is not learnable: nothing is published.
  ASSERT_TRUE(a->core->Predict(Req("r2", x), 0, nullptr).ok());
  auto cancelled = a->core->Complete("r2", 5, readout::FinishReason::kCancelled);
  ASSERT_TRUE(cancelled.ok());
  EXPECT_FALSE(cancelled->learned);
  EXPECT_EQ(cancelled->fleet_seq, 0u);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);
  EXPECT_EQ(a->fleet->Status().last_fleet_seq, before + 1);
  EXPECT_EQ(a->fleet->Status().unconfirmed, 0);
}

TEST_F(FleetMemberTest, NatsDownRefusesCompletionsKeepsPredictingThenPublishesOnce) {
  auto a = StartMember("a");
  const readout::ReadoutState st = RandomState(kDim, 8);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  sidecar::Route r;
  r.arms.push_back({"chat", "chat", 100.0, false});
  ASSERT_TRUE(a->fleet->SetRoute(r).ok());
  ASSERT_TRUE(a->AwaitDegraded(false));
  std::mt19937_64 rng(2);
  const std::vector<float> x1 = RandomFeatures(st, rng);
  const std::vector<float> x2 = RandomFeatures(st, rng);
  const uint64_t before = LastFeedbackSeq();
  ASSERT_TRUE(a->core->Predict(Req("q1", x1), 0, nullptr).ok());

  KillNats();
  ASSERT_TRUE(a->AwaitDegraded(true));
  EXPECT_TRUE(a->fleet->Status().degraded);
  auto refused = a->core->Complete("q1", 64, readout::FinishReason::kStop);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
      << refused.status();
  // Predictions go on with the last weights.
  auto p = a->core->Predict(Req("q2", x2), 0, nullptr);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->version, 1);
  // The engine resends while NATS is still down: still refused.
  auto refused2 = a->core->Complete("q1", 64, readout::FinishReason::kStop);
  ASSERT_FALSE(refused2.ok());
  EXPECT_EQ(refused2.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a->fleet->Status().unconfirmed, 1);

  StartNats();
  // Reconnected: the outbox record is republished, degraded clears. The
  // maintainer clears it only after every outbox record it republished was
  // acknowledged by JetStream: once cleared, nothing is unconfirmed.
  ASSERT_TRUE(a->AwaitDegraded(false));
  ASSERT_TRUE(observer_->WaitConnected(20000).ok());
  EXPECT_EQ(a->fleet->Status().unconfirmed, 0);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);
  auto acked = a->core->Complete("q1", 64, readout::FinishReason::kStop);
  ASSERT_TRUE(acked.ok()) << acked.status();
  EXPECT_TRUE(acked->duplicate);
  EXPECT_EQ(acked->fleet_seq, before + 1);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);
}

TEST_F(FleetMemberTest, OutboxRecordLeftByARestartIsRepublishedAtStart) {
  const readout::ReadoutState st = RandomState(kDim, 9);
  std::mt19937_64 rng(3);
  const std::vector<float> x = RandomFeatures(st, rng);
  uint64_t before = 0;
  {
    auto a = StartMember("a");
    ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
    sidecar::Route r;
    r.arms.push_back({"chat", "chat", 100.0, false});
    ASSERT_TRUE(a->fleet->SetRoute(r).ok());
    before = LastFeedbackSeq();
    ASSERT_TRUE(a->core->Predict(Req("w1", x), 0, nullptr).ok());
    KillNats();
    ASSERT_TRUE(a->AwaitDegraded(true));
    auto refused = a->core->Complete("w1", 64, readout::FinishReason::kStop);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  }  // the member stops with the record only in its outbox
  StartNats();
  ASSERT_TRUE(observer_->WaitConnected(20000).ok());
  auto a = StartMember("a");
  ASSERT_TRUE(a->fleet->ready());
  EXPECT_EQ(a->fleet->Status().unconfirmed, 0);
  ASSERT_EQ(LastFeedbackSeq(), before + 1);
  auto msg = observer_->GetMsg(FeedbackStream(kFleet), before + 1);
  ASSERT_TRUE(msg.ok());
  fpb::FleetCompletion c;
  ASSERT_TRUE(c.ParseFromString(msg->data));
  EXPECT_EQ(c.request_id(), "w1");
  EXPECT_EQ(c.target(), 8.0);
  // The resend after the restart is a duplicate, not stored again.
  auto again = a->core->Complete("w1", 64, readout::FinishReason::kStop);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);
}

TEST_F(FleetMemberTest, PublishedVersionIsInstalledAndServed) {
  auto a = StartMember("a");
  const readout::ReadoutState st = RandomState(kDim, 10);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  sidecar::Route r;
  r.arms.push_back({"chat", "chat", 100.0, false});
  ASSERT_TRUE(a->fleet->SetRoute(r).ok());
  auto b = StartMember("b");
  // A trainer's version 5 (theta in the standardized space, FP64).
  Eigen::VectorXd theta = st.theta;
  for (int64_t i = 0; i <= kDim; ++i) theta[i] += 0.01 * static_cast<double>(i + 1);
  fpb::FleetVersion v = TrainerVersion("chat", 5, theta, 40, 1234);
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"), v.SerializeAsString()).ok());
  for (Member* m : {a.get(), b.get()}) {
    auto got = m->recorder->Await(5);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->fleet_seq, 1234u);
    EXPECT_EQ(got->cause, "rls");
    auto ro = m->core->GetReadout("chat");
    ASSERT_TRUE(ro.ok());
    EXPECT_EQ((*ro)->current()->version, 5);
    EXPECT_EQ((*ro)->completions_learned(), 40);
    // Served with the new weights: the score against FP64.
    std::mt19937_64 rng(4);
    const std::vector<float> x = RandomFeatures(st, rng);
    auto p = m->core->Predict(Req(absl::StrCat("s", m == a.get()), x), 0, nullptr);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->version, 5);
    const std::vector<double> xd(x.begin(), x.end());
    EXPECT_NEAR(p->score, ReferenceScore(st.standardizer, theta, xd),
                ScoreTolerance(st.standardizer, theta, xd));
  }
  // An older version is not installed over a newer one.
  v.set_version(4);
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"), v.SerializeAsString()).ok());
  v.set_version(6);
  v.set_fleet_seq(1300);
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"), v.SerializeAsString()).ok());
  ASSERT_NE(a->recorder->Await(6), nullptr);
  EXPECT_EQ((*a->core->GetReadout("chat"))->current()->fleet_seq, 1300u);
  // A member that starts now catches up from the newest version.
  auto c = StartMember("c");
  auto ro = c->core->GetReadout("chat");
  ASSERT_TRUE(ro.ok());
  ASSERT_NE(c->recorder->Await(6), nullptr) << "the new member never installed version 6";
  EXPECT_EQ((*ro)->current()->version, 6);
}

// A version that arrives while its readout is being created here: the
// versions thread finds no readout, and before it keeps the version for the
// CONFIG watcher, the watcher creates the readout and looks for a kept
// version (none yet). The version must still be installed, not kept until
// the next one (with no traffic, forever). The interleaving is forced: the
// versions thread is held (before_early_version) until the watcher has
// created the readout and reported it to the readouts listener, which it
// does after its look for a kept version.
TEST_F(FleetMemberTest, AVersionArrivingWhileItsReadoutIsCreatedIsInstalled) {
  absl::Notification held, created;
  std::atomic<bool> first{true};
  auto b = StartMember("b", 10'000, 20'000, 10'000, 2000, [&](FleetMemberOptions* o) {
    o->before_early_version = [&](const std::string& readout) {
      if (readout != "chat" || !first.exchange(false)) return;
      held.Notify();
      created.WaitForNotificationWithTimeout(absl::Seconds(30));
    };
  });
  b->fleet->SetReadoutsListener([&](const std::vector<FleetReadoutEntry>& list) {
    for (const FleetReadoutEntry& e : list) {
      if (e.name == "chat" && !created.HasBeenNotified()) created.Notify();
    }
  });
  const readout::ReadoutState st = RandomState(kDim, 10);
  // A trainer's version 5 of "chat", before "chat" is in CONFIG.
  Eigen::VectorXd theta = st.theta;
  for (int64_t i = 0; i <= kDim; ++i) theta[i] += 0.01 * static_cast<double>(i + 1);
  const fpb::FleetVersion v = TrainerVersion("chat", 5, theta, 40, 1234);
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"), v.SerializeAsString()).ok());
  ASSERT_TRUE(held.WaitForNotificationWithTimeout(absl::Seconds(20)));
  // Created through another member: b's CONFIG watcher creates it while b's
  // versions thread is held.
  auto a = StartMember("a");
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  ASSERT_TRUE(created.WaitForNotificationWithTimeout(absl::Seconds(20)));
  auto got = b->recorder->Await(5);
  ASSERT_NE(got, nullptr) << "version 5 never installed on b";
  EXPECT_EQ(got->fleet_seq, 1234u);
  auto ro = b->core->GetReadout("chat");
  ASSERT_TRUE(ro.ok());
  EXPECT_EQ((*ro)->current()->version, 5);
  EXPECT_EQ((*ro)->completions_learned(), 40);
}

// A readout deleted and created again under the same name shares its
// versions subject with its predecessor, which is not purged. A late version
// of the deleted incarnation (a trainer's last publish as it stops, read
// after this member deleted the readout) is kept for the CONFIG watcher like
// any early version; when the name is created again, the watcher must not
// install it into the new incarnation (it would be served under its higher
// number, and the new incarnation's versions ignored until they pass it).
// The order is forced: the old version is known to be kept (a later version
// of another readout, on the same versions thread, is installed first), and
// the versions thread is held on the new incarnation's first version until
// the watcher has created the readout (and looked for a kept version).
TEST_F(FleetMemberTest, AVersionOfADeletedIncarnationIsNotInstalledIntoTheNewOne) {
  absl::Notification held, created;
  std::atomic<bool> armed{false};
  std::atomic<int> early_calls{0};
  auto b = StartMember("b", 10'000, 20'000, 10'000, 2000, [&](FleetMemberOptions* o) {
    o->before_early_version = [&](const std::string& readout) {
      if (readout != "chat" || !armed.load()) return;
      // 1: the deleted incarnation's late version (passes); 2: the new
      // incarnation's first version (held).
      if (++early_calls != 2) return;
      held.Notify();
      created.WaitForNotificationWithTimeout(absl::Seconds(30));
    };
  });
  absl::Mutex lmu;
  std::map<std::string, int64_t> listed;  // name -> created_unix_ms
  b->fleet->SetReadoutsListener([&](const std::vector<FleetReadoutEntry>& list) {
    absl::MutexLock l(&lmu);
    listed.clear();
    for (const FleetReadoutEntry& e : list) listed[e.name] = e.created_unix_ms;
  });
  auto await_listed = [&](const std::string& name, bool present) {
    absl::MutexLock l(&lmu);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(lmu) {
      return listed.contains(name) == present;
    };
    return lmu.AwaitWithTimeout(absl::Condition(&cond), absl::Seconds(20));
  };
  auto version = [](const std::string& readout, int64_t number,
                    const Eigen::VectorXd& theta, int64_t created_unix_ms) {
    fpb::FleetVersion v = TrainerVersion(readout, number, theta, 10 * number,
                                         static_cast<uint64_t>(100 + number));
    v.set_created_unix_ms(created_unix_ms);
    return v.SerializeAsString();
  };
  auto a = StartMember("a");
  const readout::ReadoutState old_st = RandomState(kDim, 20);
  const readout::ReadoutState other_st = RandomState(kDim, 21);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", old_st).ok());
  ASSERT_TRUE(a->fleet->CreateReadout("other", other_st).ok());
  ASSERT_TRUE(await_listed("chat", true));
  ASSERT_TRUE(await_listed("other", true));
  auto old_ro = b->core->GetReadout("chat");
  ASSERT_TRUE(old_ro.ok());
  const int64_t old_created = (*old_ro)->created_unix_ms();
  // The first incarnation learned: its trainer's version 5.
  Eigen::VectorXd old_theta = old_st.theta;
  for (int64_t i = 0; i <= kDim; ++i) old_theta[i] += 0.5;
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"),
                                 version("chat", 5, old_theta, old_created)).ok());
  ASSERT_NE(b->recorder->Await(5), nullptr);
  // Deleted; b deletes it.
  ASSERT_TRUE(a->fleet->DeleteReadout("chat").ok());
  ASSERT_TRUE(await_listed("chat", false));
  ASSERT_FALSE(b->core->GetReadout("chat").ok());
  armed.store(true);
  // The old trainer's last version, read by b after the delete: kept.
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"),
                                 version("chat", 6, old_theta, old_created)).ok());
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "other"),
                                 version("other", 3, other_st.theta, 0)).ok());
  ASSERT_NE(b->recorder->Await(3), nullptr);
  // Created again (a later creation time: a new incarnation).
  const readout::ReadoutState new_st = RandomState(kDim, 22);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", new_st).ok());
  ASSERT_TRUE(await_listed("chat", true));
  int64_t new_created;
  {
    absl::MutexLock l(&lmu);
    new_created = listed["chat"];
  }
  ASSERT_NE(new_created, old_created);
  created.Notify();
  auto ro = b->core->GetReadout("chat");
  ASSERT_TRUE(ro.ok());
  EXPECT_EQ((*ro)->created_unix_ms(), new_created);
  // The new incarnation's trainer: version 2, installed and served.
  Eigen::VectorXd new_theta = new_st.theta;
  for (int64_t i = 0; i <= kDim; ++i) new_theta[i] -= 0.25;
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"),
                                 version("chat", 2, new_theta, new_created)).ok());
  auto got = b->recorder->Await(2);
  ASSERT_NE(got, nullptr) << "the new incarnation's version 2 was not installed on b "
                          << "(serving version " << (*ro)->current()->version << ")";
  EXPECT_EQ((*ro)->current()->version, 2);
  EXPECT_EQ((*ro)->current()->fleet_seq, 102u);
  std::mt19937_64 rng(9);
  const std::vector<float> x = RandomFeatures(new_st, rng);
  // Served with the new incarnation's weights: the score against FP64.
  absl::StatusOr<double> score = (*ro)->current()->folded.Score(
      readout::FeatureView::F32(x.data(), static_cast<int64_t>(x.size())));
  ASSERT_TRUE(score.ok()) << score.status();
  const std::vector<double> xd(x.begin(), x.end());
  EXPECT_NEAR(*score, ReferenceScore(new_st.standardizer, new_theta, xd),
              ScoreTolerance(new_st.standardizer, new_theta, xd));
  // Every version b installed into the new incarnation is its own.
  for (const sidecar::VersionRecord& v : (*ro)->Versions()) {
    EXPECT_LE(v.version, 2) << "a version of the deleted incarnation was installed";
  }
  // A version of the deleted incarnation read now is not installed either.
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "chat"),
                                 version("chat", 7, old_theta, old_created)).ok());
  ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, "other"),
                                 version("other", 4, other_st.theta, 0)).ok());
  ASSERT_NE(b->recorder->Await(4), nullptr);
  EXPECT_EQ((*ro)->current()->version, 2);
}

// A member restarted behind the fleet: its checkpoint (written when its
// outbox was pruned) names version 3, older than the newest it installed and
// stored (6) and newer than the created one (1); at start it catches up from
// the fleet's newest version, one it already lists. Every version is listed
// once, in order, none lost within versions_kept.
TEST_F(FleetMemberTest, RestartedMemberListsEveryVersionOnce) {
  const readout::ReadoutState st = RandomState(kDim, 12);
  auto publish = [&](int64_t version) {
    fpb::FleetVersion v;
    v.set_readout("chat");
    v.set_version(version);
    v.set_theta(std::string(reinterpret_cast<const char*>(st.theta.data()),
                            st.theta.size() * sizeof(double)));
    v.set_completions_learned(8 * version);
    v.set_fleet_seq(static_cast<uint64_t>(100 + version));
    v.set_cause("rls");
    ASSERT_TRUE(
        observer_->Publish(VersionSubject(kFleet, "chat"), v.SerializeAsString()).ok());
  };
  auto listed = [](const Member& m) {
    std::vector<int64_t> out;
    for (const sidecar::VersionRecord& v : (*m.core->GetReadout("chat"))->Versions()) {
      out.push_back(v.version);
    }
    return out;
  };
  const std::vector<int64_t> want = {1, 2, 3, 4, 5, 6};
  {
    auto a = StartMember("a", 10'000, 20'000, /*versions_kept=*/6);
    ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
    sidecar::Route r;
    r.arms.push_back({"chat", "chat", 100.0, false});
    ASSERT_TRUE(a->fleet->SetRoute(r).ok());
    for (int64_t v = 2; v <= 3; ++v) publish(v);
    ASSERT_NE(a->recorder->Await(3), nullptr);
    // A completion in the stream: pruning its outbox record writes a
    // checkpoint at version 3.
    std::mt19937_64 rng(5);
    ASSERT_TRUE(a->core->Predict(Req("w1", RandomFeatures(st, rng)), 0, nullptr).ok());
    ASSERT_TRUE(a->core->Complete("w1", 64, readout::FinishReason::kStop).ok());
    auto ro = a->core->GetReadout("chat");
    ASSERT_TRUE(ro.ok());
    ASSERT_TRUE(a->store->AwaitCheckpoint("chat", [](const storage::ReadoutCheckpoint& c) {
      return c.version == 3 && c.last_seq >= 1;
    })) << "the member never checkpointed version 3 after its outbox record was confirmed";
    for (int64_t v = 4; v <= 6; ++v) publish(v);
    ASSERT_NE(a->recorder->Await(6), nullptr);
    EXPECT_EQ(listed(*a), want);
    // Once the maintainer thread is joined, the checkpoint it wrote shows
    // in the metrics too.
    a->fleet->Stop();
    EXPECT_GT((*ro)->metrics().checkpoint_bytes->Value(), 0);
  }
  auto a = StartMember("a", 10'000, 20'000, /*versions_kept=*/6);
  auto ro = a->core->GetReadout("chat");
  ASSERT_TRUE(ro.ok());
  // The catch-up from the fleet's newest version (6) is done once version 6
  // is served with the fleet sequence it was published with.
  ASSERT_NE(a->recorder->Await([](const sidecar::PublishedVersion& v) {
              return v.version == 6 && v.fleet_seq == 106u;
            }),
            nullptr)
      << "the restarted member never installed version 6 from the fleet";
  EXPECT_EQ((*ro)->current()->fleet_seq, 106u);
  EXPECT_EQ((*ro)->current()->version, 6);
  EXPECT_EQ(listed(*a), want);
  publish(7);
  ASSERT_NE(a->recorder->Await(7), nullptr);
  EXPECT_EQ(listed(*a), (std::vector<int64_t>{2, 3, 4, 5, 6, 7}));
}

// Complete(defer_fleet_ack) returns with the publish in flight: a batch of
// completions is published pipelined and each is acknowledged only once
// JetStream's ack set its FEEDBACK sequence (checked against the stream:
// every one stored once, under its own message id, in order). With NATS
// down the pending ack is UNAVAILABLE, and the resend after NATS is back
// is acknowledged as a duplicate with its stream sequence. Prints
// acknowledged completions/s closed loop, waiting for every ack one by one
// (the pre-pipelining path) and per batch (LEAP_FLEET_MEMBER_BENCH_N
// completions, batches of LEAP_FLEET_MEMBER_BENCH_BATCH; default 400, 32).
TEST_F(FleetMemberTest, PipelinedCompletionsAreAckedOnlyAfterTheStream) {
  auto a = StartMember("a");
  ASSERT_TRUE(a->fleet->ready());
  const readout::ReadoutState st = RandomState(kDim, 21);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  sidecar::Route route;
  route.arms.push_back({"chat", "chat", 100.0, false});
  ASSERT_TRUE(a->fleet->SetRoute(route).ok());
  std::mt19937_64 rng(5);
  const uint64_t before = LastFeedbackSeq();
  constexpr int kBatch = 40;
  std::vector<std::vector<float>> xs;
  for (int i = 0; i < kBatch; ++i) {
    xs.push_back(RandomFeatures(st, rng));
    ASSERT_TRUE(a->core->Predict(Req(absl::StrCat("p", i), xs.back()), 0, nullptr).ok());
  }
  std::vector<sidecar::CompletionOutcome> outs;
  for (int i = 0; i < kBatch; ++i) {
    auto o = a->core->Complete(absl::StrCat("p", i), 10 + i,
                               readout::FinishReason::kStop, "",
                               /*defer_fleet_ack=*/true);
    ASSERT_TRUE(o.ok()) << o.status();
    ASSERT_NE(o->fleet_ack, nullptr) << i;
    outs.push_back(*o);
  }
  for (int i = 0; i < kBatch; ++i) {
    absl::StatusOr<uint64_t> seq = outs[i].fleet_ack->Wait();
    ASSERT_TRUE(seq.ok()) << seq.status();
    // Published in order on one connection: consecutive sequences.
    EXPECT_EQ(*seq, before + 1 + i);
    auto msg = observer_->GetMsg(FeedbackStream(kFleet), *seq);
    ASSERT_TRUE(msg.ok()) << msg.status();
    const std::string features(reinterpret_cast<const char*>(xs[i].data()),
                               xs[i].size() * sizeof(float));
    EXPECT_EQ(msg->msg_id, FleetMember::MessageId("chat", absl::StrCat("p", i), 1,
                                                  features, std::sqrt(10.0 + i)));
  }
  EXPECT_EQ(LastFeedbackSeq(), before + kBatch);
  // Each ack is set after its record was confirmed: none is left.
  EXPECT_EQ(a->fleet->Status().unconfirmed, 0);
  EXPECT_EQ(a->fleet->nats().async_in_flight(), 0);

  // NATS down: the pending ack is an error, nothing is acknowledged.
  const std::vector<float> x = RandomFeatures(st, rng);
  ASSERT_TRUE(a->core->Predict(Req("down", x), 0, nullptr).ok());
  KillNats();
  ASSERT_TRUE(a->AwaitDegraded(true));
  auto down = a->core->Complete("down", 50, readout::FinishReason::kStop, "", true);
  absl::Status down_status =
      !down.ok() ? down.status()
                 : (down->fleet_ack == nullptr ? absl::InternalError("no pending ack")
                                               : down->fleet_ack->Wait().status());
  EXPECT_EQ(down_status.code(), absl::StatusCode::kUnavailable) << down_status;
  StartNats();
  ASSERT_TRUE(a->AwaitDegraded(false));
  // The resend: a duplicate, acknowledged with the sequence of its record.
  auto resent = a->core->Complete("down", 50, readout::FinishReason::kStop, "", true);
  ASSERT_TRUE(resent.ok()) << resent.status();
  EXPECT_TRUE(resent->duplicate);
  EXPECT_EQ(resent->fleet_seq, before + kBatch + 1);

  // Figures: closed loop, one engine thread.
  const int n = std::max(kBatch, static_cast<int>(EnvOr("LEAP_FLEET_MEMBER_BENCH_N", 400)));
  const int batch = std::max(1, static_cast<int>(EnvOr("LEAP_FLEET_MEMBER_BENCH_BATCH", 32)));
  int next_id = 0;
  auto run = [&](bool pipelined) {
    const absl::Time t0 = absl::Now();
    int acked = 0;
    for (int done = 0; done < n; done += batch) {
      const int m = std::min(batch, n - done);
      std::vector<std::string> ids;
      for (int i = 0; i < m; ++i) {
        ids.push_back(absl::StrCat("b", next_id++));
        EXPECT_TRUE(a->core->Predict(Req(ids.back(), xs[i % kBatch]), 0, nullptr).ok());
      }
      std::vector<sidecar::CompletionOutcome> batch_outs;
      for (const std::string& id : ids) {
        auto o = a->core->Complete(id, 20, readout::FinishReason::kStop, "", pipelined);
        EXPECT_TRUE(o.ok()) << o.status();
        if (!o.ok()) continue;
        if (pipelined) {
          batch_outs.push_back(*o);
        } else {
          acked += o->fleet_seq > 0 ? 1 : 0;
        }
      }
      for (auto& o : batch_outs) acked += o.fleet_ack->Wait().ok() ? 1 : 0;
    }
    EXPECT_EQ(acked, n);
    return n / absl::ToDoubleSeconds(absl::Now() - t0);
  };
  const double one_by_one = run(false);
  const double pipelined = run(true);
  std::printf("fleet member, d=%lld, one nats-server on loopback: acknowledged "
              "completions/s closed loop: %.0f waiting per completion, %.0f "
              "pipelined in batches of %d (x%.1f)\n",
              static_cast<long long>(kDim), one_by_one, pipelined, batch,
              pipelined / one_by_one);
}

// A resent completion never waits for NATS in Complete(defer_fleet_ack)
// (the unary Complete's gRPC callback thread, the shm loop): with the
// nats-server stopped (SIGSTOP: the connection stays, nothing is answered)
// a resend while the first publish is in flight shares its ack; once that
// publish failed (JetStream's acknowledgement timeout, 500 ms here) a
// resend publishes the record again, asynchronously. After SIGCONT the
// resend is acknowledged with the record's sequence, the stream holds it
// once, and it counts as one duplicate (the resend answered UNAVAILABLE is
// not counted).
TEST_F(FleetMemberTest, AResendDoesNotWaitForNats) {
  auto a = StartMember("a", 10'000, 20'000, 10'000, /*nats_timeout_ms=*/500);
  ASSERT_TRUE(a->fleet->ready());
  const readout::ReadoutState st = RandomState(kDim, 23);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  sidecar::Route route;
  route.arms.push_back({"chat", "chat", 100.0, false});
  ASSERT_TRUE(a->fleet->SetRoute(route).ok());
  std::mt19937_64 rng(7);
  const std::vector<float> x = RandomFeatures(st, rng);
  ASSERT_TRUE(a->core->Predict(Req("r", x), 0, nullptr).ok());
  const uint64_t before = LastFeedbackSeq();
  auto complete = [&] {
    return a->core->Complete("r", 30, readout::FinishReason::kStop, "",
                             /*defer_fleet_ack=*/true);
  };
  prometheus::Counter& dups = a->metrics.DuplicateCompletions("resent_not_live");
  const double dups_before = dups.Value();

  StopNats();
  auto first = complete();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NE(first->fleet_ack, nullptr);
  EXPECT_FALSE(first->duplicate);
  // A resend while it is in flight: returns at once with the same publish.
  auto shared = complete();
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_TRUE(shared->duplicate);
  EXPECT_EQ(shared->duplicate_reason, "resent_not_live");
  EXPECT_EQ(shared->fleet_ack, first->fleet_ack);
  // No answer within 500 ms: both are UNAVAILABLE (the engine resends).
  absl::Status timed_out = first->fleet_ack->Wait().status();
  EXPECT_EQ(timed_out.code(), absl::StatusCode::kUnavailable) << timed_out;
  // The next resend publishes the record again, without waiting for it.
  const absl::Time t0 = absl::Now();
  auto again = complete();
  const absl::Duration returned_after = absl::Now() - t0;
  nats_->Signal(SIGCONT);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate);
  ASSERT_NE(again->fleet_ack, nullptr);
  EXPECT_NE(again->fleet_ack, first->fleet_ack);
  EXPECT_LT(returned_after, absl::Milliseconds(400));
  absl::StatusOr<uint64_t> seq = again->fleet_ack->Wait();
  // (A machine so loaded that 500 ms passed before SIGCONT took effect: the
  // engine would resend once more, and so does the test.)
  for (int i = 0; i < 20 && !seq.ok(); ++i) {
    auto more = complete();
    ASSERT_TRUE(more.ok()) << more.status();
    seq = more->fleet_ack != nullptr ? more->fleet_ack->Wait()
                                     : absl::StatusOr<uint64_t>(more->fleet_seq);
  }
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ(*seq, before + 1);
  EXPECT_EQ(LastFeedbackSeq(), before + 1);
  // A deferred duplicate is counted by the thread that sets its ack, after
  // it wakes the waiters (PendingFleetAck::Set runs the OnDone callbacks
  // outside its lock), so Wait() can return first: on a loaded machine (CI,
  // a sanitizer build beside the tests) the count was read as 0. Wait for
  // that thread's increment (bounded; it yields, no sleep).
  const absl::Time counted_by = absl::Now() + absl::Seconds(10);
  while (dups.Value() - dups_before < 1.0 && absl::Now() < counted_by) {
    std::this_thread::yield();
  }
  EXPECT_EQ(dups.Value() - dups_before, 1.0);
  // Later resends are answered from the confirmed record, at once.
  auto late = complete();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->fleet_ack, nullptr);
  EXPECT_EQ(late->fleet_seq, before + 1);
  // The ack that carried the sequence was set after the record was
  // confirmed: none is left.
  EXPECT_EQ(a->fleet->Status().unconfirmed, 0);
}

// nats.c registers an asynchronous publish before it writes the message,
// so its answer can come while the publishing thread is still inside
// js_PublishMsgAsync: here the server is stopped, the socket's buffers fill,
// one publish blocks in its write, and its 50 ms acknowledgement timeout
// fires meanwhile. The message must outlive that call (freeing it from the
// answering thread was a use after free that ASan/TSan see). Every publish is
// answered exactly once, UNAVAILABLE while the server is stopped, and such an
// answer is counted.
TEST_F(FleetMemberTest, AnAnswerWhileItsMessageIsStillBeingWrittenIsSafe) {
  StreamSpec spec;
  spec.name = "BLOCKED";
  spec.subjects = {"blocked.>"};
  ASSERT_TRUE(observer_->EnsureStream(spec).ok());
  NatsClientOptions o;
  o.servers = {Url()};
  o.timeout_ms = 50;
  auto c = NatsClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  NatsClient& client = **c;
  ASSERT_TRUE(client.WaitConnected(20000).ok());

  StopNats();
  const std::string payload(64 << 10, 'x');
  constexpr int kMax = 4096;
  absl::Mutex mu;
  int answers = 0;
  int unavailable = 0;
  std::vector<int> answered(kMax, 0);  // answers per publish
  std::atomic<int> published{0};
  std::atomic<bool> stop{false};
  std::thread publisher([&] {
    while (!stop.load() && published.load() < kMax) {
      const int i = published.load();
      client.PublishAsync(absl::StrCat("blocked.", i), payload, {},
                          [&, i](absl::StatusOr<PublishResult> r) {
                            absl::MutexLock l(&mu);
                            ++answers;
                            ++answered[i];
                            if (absl::IsUnavailable(r.status())) ++unavailable;
                          });
      published.fetch_add(1);
    }
  });
  // The client counts such an answer before it calls the publish's
  // callback, which takes `mu`: each answer wakes this wait.
  bool seen;
  {
    absl::MutexLock l(&mu);
    auto blocked = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return client.async_answered_while_publishing() > 0;
    };
    seen = mu.AwaitWithTimeout(absl::Condition(&blocked), absl::Seconds(20));
  }
  stop.store(true);
  nats_->Signal(SIGCONT);
  publisher.join();
  ASSERT_TRUE(seen) << "no publish blocked long enough for its timeout ("
                    << published.load() << " published)";
  {
    absl::MutexLock l(&mu);
    auto all_answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return answers == published.load();
    };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all_answered), absl::Seconds(20)))
        << answers << " answers to " << published.load() << " publishes";
  }
  {
    absl::MutexLock l(&mu);
    EXPECT_GE(unavailable, 1);
  }
  EXPECT_EQ(client.async_in_flight(), 0);
  // Exactly once each: no answer comes later either (the last ones settled).
  client.Close();
  absl::MutexLock l(&mu);
  EXPECT_EQ(answers, published.load());
  for (int i = 0; i < published.load(); ++i) {
    ASSERT_EQ(answered[i], 1) << "publish " << i;
  }
}

TEST_F(FleetMemberTest, ControlOperationsWaitForTheTrainersAnswer) {
  auto a = StartMember("a", /*op_timeout_ms=*/500);
  const readout::ReadoutState st = RandomState(kDim, 11);
  ASSERT_TRUE(a->fleet->CreateReadout("chat", st).ok());
  // No trainer: the snapshot is in the stream, the call ends at its deadline.
  auto none = a->fleet->Snapshot("chat", "s1");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  // A stand-in trainer answers every control with a version carrying its op_id.
  std::atomic<int64_t> next{10};
  auto sub = observer_->Subscribe(
      ControlSubjects(kFleet), {SubscribeOptions::Start::kNew, 0, FeedbackStream(kFleet)},
      [&](const StreamMsg& m) {
        fpb::FleetControl c;
        ASSERT_TRUE(c.ParseFromString(m.data));
        fpb::FleetVersion v;
        v.set_readout(c.readout());
        v.set_version(next.fetch_add(1));
        v.set_theta(std::string(reinterpret_cast<const char*>(st.theta.data()),
                                st.theta.size() * sizeof(double)));
        v.set_fleet_seq(m.stream_seq);
        v.set_op_id(c.op_id());
        v.set_frozen(c.op() == fpb::FleetControl::FREEZE);
        v.set_cause(c.op() == fpb::FleetControl::ROLLBACK
                        ? (c.label() == "nope" ? "error: no snapshot 'nope'"
                                               : "rollback:" + c.label())
                        : fpb::FleetControl::Op_Name(c.op()));
        ASSERT_TRUE(observer_->Publish(VersionSubject(kFleet, c.readout()),
                                       v.SerializeAsString()).ok());
      });
  ASSERT_TRUE(sub.ok()) << sub.status();
  auto snap = a->fleet->Snapshot("chat", "s2");
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->label, "s2");
  // The stand-in writes no STATE: the fleet has no snapshot to list.
  auto listed = a->fleet->ListSnapshots("chat");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
  auto rb = a->fleet->Rollback("chat", "s2");
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ((*a->core->GetReadout("chat"))->current()->version, *rb);
  EXPECT_EQ((*a->core->GetReadout("chat"))->current()->cause, "rollback:s2");
  auto bad = a->fleet->Rollback("chat", "nope");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  ASSERT_TRUE(a->fleet->SetFrozen("chat", true).ok());
  EXPECT_TRUE((*a->core->GetReadout("chat"))->frozen());
  ASSERT_TRUE(a->fleet->SetFrozen("chat", false).ok());
  EXPECT_FALSE((*a->core->GetReadout("chat"))->frozen());
  EXPECT_EQ(a->fleet->Snapshot("nochat", "x").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace leap::fleet
