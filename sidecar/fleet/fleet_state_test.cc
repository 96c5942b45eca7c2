// A trainer's STATE checkpoint with a huge fleet quality (tens of thousands
// of (product line, arm) series for one readout), against a real
// nats-server started by the test (-js, file storage in a temp dir, a free
// loopback port): FleetQualityTracker::Encode stays within its byte budget
// by leaving out the arms after the first that does not fit (quality is
// dropped, never the checkpoint), the checkpoint is written and read back,
// and the quality decoded from it reports exactly the series kept.
// Fails when /usr/sbin/nats-server is missing (scripts/install-deps).
// Also the state payload's layouts: P written as its upper triangle, read
// back bit for bit in both triangles, and the full n x n layout of states
// written before still read. And CloseSubscription leaves a JetStream
// consumer for the server to remove instead of deleting it, and
// KvBucket::Watch delivers current values, then changes, in order.
#include "sidecar/fleet/fleet_state.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nats/nats.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/fleet/fleet_quality.h"
#include "sidecar/fleet/nats_client.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::fleet {
namespace {

namespace fpb = ::leap::v1::fleet;

// A one-node nats-server (-js, file storage in a temp dir) started by the
// test, and a connected client.
struct OneNodeNats {
  ::leap::testing::ScopedTempDir tmp{"fleet_state_test"};
  std::unique_ptr<::leap::testing::NatsCluster> cluster;
  absl::StatusOr<std::unique_ptr<NatsClient>> client;

  void Start() {
    ::leap::testing::NatsClusterOptions no;
    no.nodes = 1;
    no.dir = (std::filesystem::path(tmp.path()) / "nats").string();
    auto c = ::leap::testing::NatsCluster::Start(no);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster = std::move(*c);
    NatsClientOptions o;
    o.servers = {cluster->url(0)};
    client = NatsClient::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->WaitConnected(20'000).ok());
  }
};

// A random symmetric P (both triangles equal bit for bit, as CopySymmetric
// leaves it) and theta of width n.
FleetState RandomState(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g;
  FleetState s;
  s.theta = Eigen::VectorXd::Zero(n);
  for (int64_t i = 0; i < n; ++i) s.theta[i] = g(rng);
  readout::SymMatrix p(n);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) p(i, j) = g(rng);
  }
  p.MirrorUpper();
  s.p = std::move(p);
  return s;
}

void ExpectSameP(const readout::SymMatrix& a, const readout::SymMatrix& b) {
  ASSERT_EQ(a.n(), b.n());
  for (int64_t i = 0; i < a.n(); ++i) {
    ASSERT_EQ(std::memcmp(a.row(i), b.row(i), a.n() * 4), 0) << "row " << i;
  }
}

TEST(FleetStatePayload, PGoesAsItsUpperTriangleAndComesBackWhole) {
  for (int64_t n : {2, 17, 130}) {
    FleetState s = RandomState(n, static_cast<uint64_t>(n));
    s.frozen = (n == 17);
    const std::string data = EncodeStatePayload(s);
    // 12 header bytes, theta in FP64, n (n + 1) / 2 FP32 values of P.
    EXPECT_EQ(static_cast<int64_t>(data.size()), 12 + n * 8 + n * (n + 1) / 2 * 4);
    FleetState back;
    ASSERT_TRUE(DecodeStatePayload(data, &back).ok());
    EXPECT_EQ(back.theta, s.theta);
    EXPECT_EQ(back.frozen, s.frozen);
    ASSERT_TRUE(back.p.has_value());
    ExpectSameP(*back.p, *s.p);
  }
  // Without P: the header and theta only.
  FleetState np = RandomState(9, 3);
  np.p.reset();
  FleetState back;
  ASSERT_TRUE(DecodeStatePayload(EncodeStatePayload(np), &back).ok());
  EXPECT_FALSE(back.p.has_value());
  EXPECT_EQ(back.theta, np.theta);
}

TEST(FleetStatePayload, TheFullLayoutOfOlderStatesIsStillRead) {
  const int64_t n = 33;
  const FleetState s = RandomState(n, 7);
  // The layout written before: P's layout byte 1, all n x n entries by row.
  std::string old(12 + n * 8 + n * n * 4, '\0');
  std::memcpy(old.data(), "LFS1", 4);
  const uint32_t n32 = static_cast<uint32_t>(n);
  std::memcpy(old.data() + 4, &n32, 4);
  old[8] = 1;
  std::memcpy(old.data() + 12, s.theta.data(), n * 8);
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(old.data() + 12 + n * 8 + i * n * 4, s.p->row(i), n * 4);
  }
  FleetState back;
  ASSERT_TRUE(DecodeStatePayload(old, &back).ok());
  EXPECT_EQ(back.theta, s.theta);
  ASSERT_TRUE(back.p.has_value());
  ExpectSameP(*back.p, *s.p);
  // The new layout's P is half the old one's, plus half the diagonal.
  const size_t head = 12 + n * 8;
  EXPECT_EQ((EncodeStatePayload(s).size() - head) * 2, old.size() - head + n * 4);

  // A layout byte of neither kind, or a size that fits neither layout.
  std::string bad = old;
  bad[8] = 3;
  absl::Status st = DecodeStatePayload(bad, &back);
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_NE(st.message().find("unknown P layout 3"), std::string::npos) << st;
  bad = old;
  bad[8] = 2;  // upper-triangle layout, full-size data
  st = DecodeStatePayload(bad, &back);
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_NE(st.message().find("expected"), std::string::npos) << st;
}

// The subject's last stream sequence now (0: empty).
uint64_t LastSubjectSeq(jsCtx* js, const std::string& stream, const std::string& subject) {
  natsMsg* m = nullptr;
  if (js_GetLastMsg(&m, js, stream.c_str(), subject.c_str(), nullptr, nullptr) != NATS_OK) {
    return 0;
  }
  const uint64_t seq = natsMsg_GetSequence(m);
  natsMsg_Destroy(m);
  return seq;
}

// A fenced PublishState carries the subject's expected last sequence on
// every chunk: stored when nothing else was written since, refused
// (FailedPrecondition, nothing stored) when something was, such as a new
// incarnation's creation state. ReadNewestState with an incarnation skips
// the states that name another one and takes those that name none.
TEST(FleetStateFence, AStaleWriteIsRefusedAndReadersSkipOtherIncarnations) {
  OneNodeNats one;
  ASSERT_NO_FATAL_FAILURE(one.Start());
  natsConnection* nc = (*one.client)->raw_connection();
  jsCtx* js = (*one.client)->raw_jetstream();
  ASSERT_TRUE(EnsureFleetStreams(js, "fence", 1, 2000).ok());
  const std::string stream = StateStream("fence");
  const std::string subject = CheckpointSubject("fence", "r");

  // Incarnation 111's checkpoint, 3 chunks (P of n = 1000: 2 MB), on an
  // empty subject.
  FleetState a = RandomState(1000, 1);
  a.created_unix_ms = 111;
  a.fleet_seq = 5;
  StateFence fa;
  absl::StatusOr<int32_t> n = PublishState(js, stream, subject, "r", "a", a, &fa);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 3);
  EXPECT_GT(fa.first_seq, 0u);
  EXPECT_EQ(fa.last_subject_seq, fa.first_seq + 2);
  EXPECT_EQ(LastSubjectSeq(js, stream, subject), fa.last_subject_seq);
  // Fenced on "empty" now: refused.
  StateFence empty;
  EXPECT_TRUE(absl::IsFailedPrecondition(
      PublishState(js, stream, subject, "r", "e", a, &empty).status()));

  // Incarnation 222's creation state, unfenced (as a member writes it).
  FleetState b = RandomState(8, 2);
  b.created_unix_ms = 222;
  b.fleet_seq = 6;
  ASSERT_TRUE(PublishState(js, stream, subject, "r", "create-222", b).ok());
  const uint64_t after_b = LastSubjectSeq(js, stream, subject);
  ASSERT_EQ(after_b, fa.last_subject_seq + 1);

  // Incarnation 111's next checkpoint, fenced on what it saw: refused at
  // its first chunk; nothing of it is stored.
  FleetState a2 = a;
  a2.fleet_seq = 9;
  StateFence stale = fa;
  absl::StatusOr<int32_t> r = PublishState(js, stream, subject, "r", "a2", a2, &stale);
  EXPECT_TRUE(absl::IsFailedPrecondition(r.status())) << r.status();
  EXPECT_EQ(stale.first_seq, 0u);
  EXPECT_EQ(LastSubjectSeq(js, stream, subject), after_b);

  absl::StatusOr<FleetState> newest = ReadNewestState(nc, js, stream, subject);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->state_id, "create-222");
  EXPECT_EQ(newest->created_unix_ms, 222);
  absl::StatusOr<FleetState> own =
      ReadNewestState(nc, js, stream, subject, std::nullopt, int64_t{111});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->state_id, "a");
  EXPECT_EQ(own->fleet_seq, 5u);
  EXPECT_EQ(own->created_unix_ms, 111);
  EXPECT_EQ(own->theta, a.theta);
  absl::StatusOr<FleetState> other =
      ReadNewestState(nc, js, stream, subject, std::nullopt, int64_t{333});
  EXPECT_TRUE(absl::IsNotFound(other.status())) << other.status();

  // Fenced on the sequence it now reads: stored, and newest for 111.
  StateFence fresh;
  fresh.last_subject_seq = after_b;
  ASSERT_TRUE(PublishState(js, stream, subject, "r", "a3", a2, &fresh).ok());
  EXPECT_EQ(fresh.first_seq, after_b + 1);
  own = ReadNewestState(nc, js, stream, subject, std::nullopt, int64_t{111});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->state_id, "a3");
  // ...and skipped by incarnation 222, whose newest is still its creation.
  absl::StatusOr<FleetState> b_start =
      ReadNewestState(nc, js, stream, subject, std::nullopt, int64_t{222});
  ASSERT_TRUE(b_start.ok()) << b_start.status();
  EXPECT_EQ(b_start->state_id, "create-222");

  // A state naming no incarnation (written before the field) is taken by
  // every reader.
  FleetState old = RandomState(8, 3);
  old.fleet_seq = 10;
  ASSERT_TRUE(PublishState(js, stream, subject, "r", "old", old).ok());
  b_start = ReadNewestState(nc, js, stream, subject, std::nullopt, int64_t{222});
  ASSERT_TRUE(b_start.ok()) << b_start.status();
  EXPECT_EQ(b_start->state_id, "old");
  EXPECT_EQ(b_start->created_unix_ms, 0);
}

TEST(FleetStateQuality, AHugeSeriesCountDropsQualityNeverTheCheckpoint) {
  OneNodeNats one;
  ASSERT_NO_FATAL_FAILURE(one.Start());
  auto& nats = one.client;
  jsCtx* js = (*nats)->raw_jetstream();
  ASSERT_TRUE(EnsureFleetStreams(js, "q", 1, 2000).ok());

  // 40,000 arms over 400 product lines, 8 versions, a window of 8: the
  // series' numbers alone take far more than half a chunk.
  constexpr int kLines = 400, kArmsPerLine = 100, kVersions = 8;
  FleetQualityTracker t(8);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(1, 1000);
  int64_t added = 0;
  for (int l = 0; l < kLines; ++l) {
    for (int a = 0; a < kArmsPerLine; ++a) {
      for (int i = 0; i < 3; ++i) {
        const double truth = std::floor(u(rng));
        t.Add(1 + (added++ % kVersions), absl::StrFormat("line-%04d", l),
              absl::StrFormat("arm-%03d", a), truth * std::exp(u(rng) / 2000), truth);
      }
    }
  }
  const fpb::FleetQuality full = t.Encode(/*with_pairs=*/true);
  const int64_t total_arms = int64_t{kLines} * kArmsPerLine;
  EXPECT_LE(static_cast<int64_t>(full.ByteSizeLong()), kQualityEncodeBytes);
  EXPECT_GT(t.arms_left_out(), 0);
  EXPECT_EQ(full.arms_size() + t.arms_left_out(), total_arms);
  // Overall and every version keep their numbers; the arms kept are the
  // first ones in (product line, arm) order.
  EXPECT_EQ(full.overall().completions(), added);
  EXPECT_EQ(full.versions_size(), kVersions);
  for (int i = 0; i < full.arms_size(); ++i) {
    ASSERT_EQ(full.arms(i).product_line(), absl::StrFormat("line-%04d", i / kArmsPerLine));
    ASSERT_EQ(full.arms(i).arm(), absl::StrFormat("arm-%03d", i % kArmsPerLine));
    ASSERT_EQ(full.arms(i).completions(), 3);
  }
  // The summary members read leaves out the same arms.
  const fpb::FleetQuality summary = t.Encode(/*with_pairs=*/false);
  EXPECT_EQ(summary.arms_size(), full.arms_size());

  // The checkpoint is written and read back, quality included.
  fpb::FleetQuality q = full;
  q.set_readout(std::string(128, 'r'));
  q.set_fleet_seq(123456789);
  q.set_trainer(std::string(64, 'm'));
  q.set_unix_ms(1'700'000'000'000);
  q.set_created_unix_ms(1'700'000'000'000);
  FleetState s;
  s.theta = Eigen::VectorXd::LinSpaced(17, -1, 1);
  s.version = 9;
  s.completions_learned = added;
  s.fleet_seq = 42;
  s.quality = q.SerializeAsString();
  const std::string subject = CheckpointSubject("q", "chat");
  absl::StatusOr<int32_t> chunks =
      PublishState(js, StateStream("q"), subject, "chat", "ckpt-1", s);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  absl::StatusOr<FleetState> back =
      ReadNewestState((*nats)->raw_connection(), js, StateStream("q"), subject);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->fleet_seq, 42u);
  EXPECT_EQ(back->theta, s.theta);
  fpb::FleetQuality read;
  ASSERT_TRUE(read.ParseFromString(back->quality));
  FleetQualityTracker restored(8);
  restored.Decode(read);
  EXPECT_EQ(restored.Encode(false).SerializeAsString(), summary.SerializeAsString());
  EXPECT_EQ(restored.arms_left_out(), 0);

  // Within the budget nothing is left out, and pairs ride along as before.
  FleetQualityTracker small(8);
  for (int i = 0; i < 100; ++i) small.Add(1, "chat", i % 2 ? "a" : "b", i, 100 - i);
  const fpb::FleetQuality few = small.Encode(true);
  EXPECT_EQ(small.arms_left_out(), 0);
  EXPECT_EQ(few.arms_size(), 2);
  EXPECT_EQ(few.overall().predicted_size(), 8);
  EXPECT_EQ(few.arms(0).predicted_size(), 8);
}

// CloseSubscription never deletes a JetStream consumer (libnats 3.4.1's
// delete on unsubscribe reads the consumer's name while its own
// ordered-consumer recreation may free it): the consumer outlives the close,
// and the server removes it by itself once nobody listens, which its
// deletion advisory says. A subscription that read nothing and a core NATS
// subscription close too.
TEST(CloseSubscription, LeavesAJetStreamConsumerForTheServerToRemove) {
  OneNodeNats one;
  ASSERT_NO_FATAL_FAILURE(one.Start());
  auto& nats = one.client;
  natsConnection* nc = (*nats)->raw_connection();
  jsCtx* js = (*nats)->raw_jetstream();

  jsStreamConfig sc;
  jsStreamConfig_Init(&sc);
  sc.Name = "close";
  const char* subjects[] = {"close.x"};
  sc.Subjects = subjects;
  sc.SubjectsLen = 1;
  sc.Storage = js_MemoryStorage;
  jsStreamInfo* si = nullptr;
  ASSERT_EQ(js_AddStream(&si, js, &sc, nullptr, nullptr), NATS_OK);
  jsStreamInfo_Destroy(si);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(js_Publish(nullptr, js, "close.x", "m", 1, nullptr, nullptr), NATS_OK);
  }

  for (const bool read_one : {true, false}) {
    SCOPED_TRACE(read_one ? "read one message" : "read nothing");
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = "close";
    so.Ordered = true;
    natsSubscription* sub = nullptr;
    ASSERT_EQ(js_SubscribeSync(&sub, js, "close.x", nullptr, &so, nullptr), NATS_OK);
    if (read_one) {
      natsMsg* m = nullptr;
      ASSERT_EQ(natsSubscription_NextMsg(&m, sub, 10'000), NATS_OK);
      natsMsg_Destroy(m);
    }
    jsConsumerInfo* ci = nullptr;
    ASSERT_EQ(natsSubscription_GetConsumerInfo(&ci, sub, nullptr, nullptr), NATS_OK);
    const std::string name = ci->Name;
    jsConsumerInfo_Destroy(ci);
    natsSubscription* gone = nullptr;
    ASSERT_EQ(natsConnection_SubscribeSync(
                  &gone, nc,
                  absl::StrCat("$JS.EVENT.ADVISORY.CONSUMER.DELETED.close.", name).c_str()),
              NATS_OK);
    ASSERT_EQ(natsConnection_FlushTimeout(nc, 5000), NATS_OK);

    CloseSubscription(nc, sub);
    // One that handed out a message left the connection and was freed; one
    // that handed out none is still in the connection's table (its UNSUB
    // has a limit of one) and waits, parked, for the connection's close.
    EXPECT_EQ(ParkedSubscriptions(nc), read_one ? 0 : 1);
    ci = nullptr;
    EXPECT_EQ(js_GetConsumerInfo(&ci, js, "close", name.c_str(), nullptr, nullptr), NATS_OK)
        << "the consumer was deleted by the close";
    jsConsumerInfo_Destroy(ci);
    // The server's own removal (5 s without interest; 30 s allowed).
    natsMsg* advisory = nullptr;
    EXPECT_EQ(natsSubscription_NextMsg(&advisory, gone, 30'000), NATS_OK)
        << "the server kept consumer " << name;
    natsMsg_Destroy(advisory);
    CloseSubscription(nc, gone);  // a core NATS subscription
    // The server sends the advisory before it drops the consumer from the
    // stream, so a lookup right after it may still find the consumer; each
    // lookup is one request to the server (no sleep), for at most 10 s.
    const absl::Time until = absl::Now() + absl::Seconds(10);
    natsStatus st = NATS_OK;
    do {
      ci = nullptr;
      st = js_GetConsumerInfo(&ci, js, "close", name.c_str(), nullptr, nullptr);
      jsConsumerInfo_Destroy(ci);
    } while (st == NATS_OK && absl::Now() < until);
    EXPECT_EQ(st, NATS_NOT_FOUND) << "consumer " << name << " outlived its deletion advisory";
  }
  EXPECT_EQ(ParkedSubscriptions(nc), 1);
  (*nats)->Close();  // frees the parked one (AddressSanitizer's leak check sees it)
  EXPECT_EQ(ParkedSubscriptions(nc), 0);
}

// What a KvBucket::Watch delivered: "key=value" or "key deleted" per
// entry, and how many entries had come when the initial values ended.
struct WatchRecorder {
  absl::Mutex mu;
  std::vector<std::string> entries ABSL_GUARDED_BY(mu);
  int done_at ABSL_GUARDED_BY(mu) = -1;
  int done_calls ABSL_GUARDED_BY(mu) = 0;

  absl::StatusOr<std::unique_ptr<KvWatcher>> Watch(KvBucket& kv, const std::string& keys) {
    return kv.Watch(
        keys,
        [this](const KvEntry& e) {
          absl::MutexLock l(&mu);
          entries.push_back(
              absl::StrCat(e.key, e.deleted ? " deleted" : absl::StrCat("=", e.value)));
        },
        [this] {
          absl::MutexLock l(&mu);
          done_at = static_cast<int>(entries.size());
          ++done_calls;
        });
  }
  bool Done() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done_at >= 0; }
  bool SixEntries() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return entries.size() >= 6; }
  bool OneEntry() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !entries.empty(); }
  // With mu held: waits (20 s at most) until `ready`.
  bool AwaitLocked(bool (WatchRecorder::*ready)() const) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return mu.AwaitWithTimeout(absl::Condition(this, ready), absl::Seconds(20));
  }
};

// KvBucket::Watch (an ordered consumer of its own on the bucket's stream):
// the current value of each watched key first, then on_initial_done once,
// then every change in order, deletes as markers; keys outside the filter
// never; an empty selection is done at once. Checked against what was
// written, entry by entry.
TEST(KvWatch, CurrentValuesThenChangesInOrder) {
  OneNodeNats one;
  ASSERT_NO_FATAL_FAILURE(one.Start());
  auto& nats = one.client;
  KvSpec spec;
  spec.bucket = "watch";
  spec.history = 4;
  auto kv = (*nats)->EnsureKv(spec);
  ASSERT_TRUE(kv.ok()) << kv.status();
  ASSERT_TRUE((*kv)->Put("a.x", "1").ok());
  ASSERT_TRUE((*kv)->Put("a.x", "2").ok());  // only the last value comes first
  ASSERT_TRUE((*kv)->Put("a.y", "3").ok());
  ASSERT_TRUE((*kv)->Put("b.z", "4").ok());  // outside "a.>"
  ASSERT_TRUE((*kv)->Put("a.v", "0").ok());
  ASSERT_TRUE((*kv)->Delete("a.v").ok());  // a delete marker is a current value too

  WatchRecorder seen;
  auto w = seen.Watch(**kv, "a.>");
  ASSERT_TRUE(w.ok()) << w.status();
  {
    absl::MutexLock l(&seen.mu);
    ASSERT_TRUE(seen.AwaitLocked(&WatchRecorder::Done));
    EXPECT_EQ(seen.done_at, 3);
  }
  ASSERT_TRUE((*kv)->Put("a.y", "5").ok());
  ASSERT_TRUE((*kv)->Put("b.z", "6").ok());
  ASSERT_TRUE((*kv)->Delete("a.x").ok());
  ASSERT_TRUE((*kv)->Put("a.w", "7").ok());
  {
    absl::MutexLock l(&seen.mu);
    ASSERT_TRUE(seen.AwaitLocked(&WatchRecorder::SixEntries));
    EXPECT_EQ(seen.entries, (std::vector<std::string>{"a.x=2", "a.y=3", "a.v deleted", "a.y=5",
                                                      "a.x deleted", "a.w=7"}));
    EXPECT_EQ(seen.done_calls, 1);
  }
  w->reset();  // stops, joins, frees

  // Nothing under "c.>": done at once, with no entry.
  WatchRecorder empty;
  auto w2 = empty.Watch(**kv, "c.>");
  ASSERT_TRUE(w2.ok()) << w2.status();
  {
    absl::MutexLock l(&empty.mu);
    ASSERT_TRUE(empty.AwaitLocked(&WatchRecorder::Done));
    EXPECT_EQ(empty.done_at, 0);
    EXPECT_TRUE(empty.entries.empty());
  }
  // A value written afterwards comes as a change, and done is not called again.
  ASSERT_TRUE((*kv)->Put("c.q", "8").ok());
  absl::MutexLock l(&empty.mu);
  ASSERT_TRUE(empty.AwaitLocked(&WatchRecorder::OneEntry));
  EXPECT_EQ(empty.entries, std::vector<std::string>{"c.q=8"});
  EXPECT_EQ(empty.done_calls, 1);
  EXPECT_EQ(empty.done_at, 0);
}

}  // namespace
}  // namespace leap::fleet
