// The NATS test support against real Debian nats-server processes: a single
// JetStream server, and a 3-node cluster that forms on loopback, whose R3
// stream acknowledges every publish while the stream's leader is killed with
// kill -9 (message-id de-duplication keeps the retried ones single), catches
// up after the restart, and whose replicated KV bucket refuses a second
// claimant of a key (create-if-absent: what the fleet's trainer lease uses).
#include "tests/support/nats_cluster.h"

#include <nats/nats.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::testing {
namespace {

// One client connection with JetStream, to every node of `c`.
struct Client {
  natsConnection* nc = nullptr;
  jsCtx* js = nullptr;

  explicit Client(const NatsCluster& c) {
    natsOptions* opts = nullptr;
    EXPECT_EQ(natsOptions_Create(&opts), NATS_OK);
    std::vector<std::string> urls;
    std::vector<const char*> ptrs;
    for (int i = 0; i < c.size(); ++i) urls.push_back(c.url(i));
    for (const std::string& u : urls) ptrs.push_back(u.c_str());
    EXPECT_EQ(natsOptions_SetServers(opts, ptrs.data(), static_cast<int>(ptrs.size())),
              NATS_OK);
    natsOptions_SetReconnectWait(opts, 50);
    natsOptions_SetMaxReconnect(opts, -1);
    natsOptions_SetTimeout(opts, 2000);
    const natsStatus s = natsConnection_Connect(&nc, opts);
    natsOptions_Destroy(opts);
    EXPECT_EQ(s, NATS_OK) << natsStatus_GetText(s) << " " << nats_GetLastError(nullptr);
    if (nc != nullptr) {
      EXPECT_EQ(natsConnection_JetStream(&js, nc, nullptr), NATS_OK);
    }
  }
  ~Client() {
    jsCtx_Destroy(js);
    natsConnection_Destroy(nc);
  }

  natsStatus AddStream(const std::string& name, const std::string& subject,
                       int replicas) {
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    cfg.Name = name.c_str();
    const char* subjects[] = {subject.c_str()};
    cfg.Subjects = subjects;
    cfg.SubjectsLen = 1;
    cfg.Storage = js_FileStorage;
    cfg.Replicas = replicas;
    cfg.Duplicates = int64_t{600} * 1000 * 1000 * 1000;  // 10 min, ns
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    const natsStatus s = js_AddStream(&si, js, &cfg, nullptr, &jerr);
    jsStreamInfo_Destroy(si);
    return s;
  }

  // Publishes with message id `id` until acknowledged or `timeout`; the ack.
  bool Publish(const std::string& subject, const std::string& id,
               const std::string& data, absl::Duration timeout,
               uint64_t* seq, bool* duplicate, int* retries) {
    const absl::Time deadline = absl::Now() + timeout;
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MsgId = id.c_str();
    po.MaxWait = 2000;
    while (absl::Now() < deadline) {
      jsPubAck* pa = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      const natsStatus s = js_Publish(&pa, js, subject.c_str(), data.data(),
                                      static_cast<int>(data.size()), &po, &jerr);
      if (s == NATS_OK) {
        *seq = pa->Sequence;
        *duplicate = pa->Duplicate;
        jsPubAck_Destroy(pa);
        return true;
      }
      ++*retries;
      // The client reconnects to another node / a stream leader is elected:
      // no event to wait on from here, retry within the deadline.
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  std::string StreamLeader(const std::string& name, uint64_t* msgs) {
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    if (js_GetStreamInfo(&si, js, name.c_str(), nullptr, &jerr) != NATS_OK) {
      return "";
    }
    std::string leader = (si->Cluster != nullptr && si->Cluster->Leader != nullptr)
                             ? si->Cluster->Leader
                             : "";
    *msgs = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return leader;
  }
};

TEST(NatsCluster, SingleNodeJetStream) {
  const ScopedTempDir tmp("nats-single");
  NatsClusterOptions o;
  o.nodes = 1;
  o.dir = tmp.path();
  auto c = NatsCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->urls(), (*c)->url(0));
  Client cl(**c);
  ASSERT_NE(cl.js, nullptr);
  ASSERT_EQ(cl.AddStream("ONE", "one.>", 1), NATS_OK);
  uint64_t seq = 0;
  bool dup = false;
  int retries = 0;
  ASSERT_TRUE(cl.Publish("one.a", "m1", "hello", absl::Seconds(10), &seq, &dup, &retries));
  EXPECT_EQ(seq, 1u);
  EXPECT_FALSE(dup);
  ASSERT_TRUE(cl.Publish("one.a", "m1", "hello", absl::Seconds(10), &seq, &dup, &retries));
  EXPECT_EQ(seq, 1u);
  EXPECT_TRUE(dup) << "message-id de-duplication";
  // File storage under the cluster's dir.
  EXPECT_TRUE(std::filesystem::exists(o.dir + "/n0-store/jetstream"));
}

TEST(NatsCluster, ThreeNodesR3SurvivesKillNine) {
  const ScopedTempDir tmp("nats-three");
  NatsClusterOptions o;
  o.nodes = 3;
  o.dir = tmp.path();
  const absl::Time t0 = absl::Now();
  auto started = NatsCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  NatsCluster& c = **started;
  std::printf("3-node cluster ready in %.0f ms: %s\n",
              absl::ToDoubleMilliseconds(absl::Now() - t0), c.urls().c_str());
  Client cl(c);
  ASSERT_NE(cl.js, nullptr);
  ASSERT_EQ(cl.AddStream("FB", "fb.>", 3), NATS_OK);
  const std::string payload(16 * 1024, 'x');
  int retries = 0;
  int n = 0;
  auto publish_some = [&](int count) {
    for (int k = 0; k < count; ++k, ++n) {
      uint64_t seq = 0;
      bool dup = false;
      ASSERT_TRUE(cl.Publish("fb.r", absl::StrCat("id-", n), payload,
                             absl::Seconds(30), &seq, &dup, &retries))
          << "message " << n << " not acknowledged";
      // A retried publish whose first try was stored comes back as a
      // duplicate with the first sequence: either way stream seq n + 1.
      EXPECT_EQ(seq, static_cast<uint64_t>(n + 1));
    }
  };
  publish_some(100);
  uint64_t msgs = 0;
  const std::string leader = cl.StreamLeader("FB", &msgs);
  ASSERT_FALSE(leader.empty());
  EXPECT_EQ(msgs, 100u);
  int victim = -1;
  for (int i = 0; i < c.size(); ++i) {
    if (c.name(i) == leader) victim = i;
  }
  ASSERT_GE(victim, 0) << leader;
  ASSERT_TRUE(c.Kill(victim).ok());
  EXPECT_FALSE(c.running(victim));
  const absl::Time killed = absl::Now();
  publish_some(100);
  std::printf("stream leader %s killed: 100 publishes acknowledged in %.0f ms "
              "(%d retries)\n",
              leader.c_str(), absl::ToDoubleMilliseconds(absl::Now() - killed),
              retries);
  const std::string new_leader = cl.StreamLeader("FB", &msgs);
  EXPECT_NE(new_leader, leader);
  EXPECT_EQ(msgs, 200u);

  // A replicated KV bucket's create-if-absent refuses a second claimant
  // (with a node down: 2 of 3 make the quorum).
  kvConfig kc;
  kvConfig_Init(&kc);
  kc.Bucket = "LEASE";
  kc.Replicas = 3;
  kc.TTL = int64_t{5} * 1000 * 1000 * 1000;  // ns
  kvStore* kv = nullptr;
  // The JetStream meta leader may itself be re-elected after the kill (the
  // bucket's creation times out meanwhile): retried within a deadline.
  natsStatus ks = NATS_TIMEOUT;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       (ks = js_CreateKeyValue(&kv, cl.js, &kc)) != NATS_OK && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(ks, NATS_OK) << nats_GetLastError(nullptr);
  uint64_t rev = 0;
  EXPECT_EQ(kvStore_Create(&rev, kv, "trainer", "a", 1), NATS_OK);
  EXPECT_GT(rev, 0u);
  uint64_t rev2 = 0;
  EXPECT_NE(kvStore_Create(&rev2, kv, "trainer", "b", 1), NATS_OK)
      << "second claimant accepted";
  kvStore_Destroy(kv);

  {
    const absl::Status restarted = c.Restart(victim);
    ASSERT_TRUE(restarted.ok()) << restarted;
  }
  EXPECT_TRUE(c.running(victim));
  publish_some(10);
  cl.StreamLeader("FB", &msgs);
  EXPECT_EQ(msgs, 210u);
}

// What fleet mode sees when one NATS node is killed and restarted soon
// after (the fleet test's NATS fault): a publisher with the member's
// settings (one try per publish, 2 s ack wait, message ids) publishes
// without pause while the node holding the R3 stream's leadership is
// killed with kill -9 and restarted 300-1500 ms later. Prints, per round,
// how long publishes failed (kill -> first ack after it) and why; asserts
// that publishing resumes and that every acknowledged publish is in the
// stream. Rounds: LEAP_NATS_RESTART_ROUNDS (default 2).
TEST(NatsCluster, QuickRestartOfTheStreamLeader) {
  const char* env = std::getenv("LEAP_NATS_RESTART_ROUNDS");
  const int rounds = env != nullptr && *env != '\0' ? std::atoi(env) : 2;
  const ScopedTempDir tmp("nats-restart");
  NatsClusterOptions o;
  o.nodes = 3;
  o.dir = tmp.path();
  auto started = NatsCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status();
  NatsCluster& c = **started;
  Client cl(c);
  ASSERT_NE(cl.js, nullptr);
  ASSERT_EQ(cl.AddStream("FB", "fb.>", 3), NATS_OK);
  Client pub(c);
  ASSERT_NE(pub.js, nullptr);
  const std::string payload(16 * 1024, 'x');

  absl::Mutex mu;
  std::vector<absl::Time> acks;              // guarded by mu
  std::map<std::string, int> failures;       // reason -> count, guarded by mu
  int64_t acked = 0;                         // guarded by mu
  std::atomic<bool> stop{false};
  std::thread publisher([&] {
    jsPubOptions po;
    for (int n = 0; !stop.load(); ++n) {
      const std::string id = absl::StrCat("q-", n);
      jsPubOptions_Init(&po);
      po.MsgId = id.c_str();
      po.MaxWait = 2000;
      jsPubAck* pa = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      const natsStatus s = js_Publish(&pa, pub.js, "fb.r", payload.data(),
                                      static_cast<int>(payload.size()), &po, &jerr);
      {
        absl::MutexLock l(&mu);
        if (s == NATS_OK) {
          if (!pa->Duplicate) ++acked;
          jsPubAck_Destroy(pa);
          acks.push_back(absl::Now());
          continue;
        }
        ++failures[absl::StrCat(natsStatus_GetText(s),
                                jerr != 0 ? absl::StrCat(" (js ", jerr, ")") : "")];
      }
      // A publish that fails at once (no responders, disconnected): paced,
      // not a busy loop.
      absl::SleepFor(absl::Milliseconds(5));
    }
  });
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> down_ms(300, 1500);
  std::vector<std::string> outages;
  double worst = 0;
  for (int r = 0; r < rounds; ++r) {
    // Some traffic first: wait for 50 more acknowledgements.
    size_t have;
    {
      absl::MutexLock l(&mu);
      have = acks.size();
      auto more = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return acks.size() >= have + 50; };
      ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&more), absl::Seconds(60)));
    }
    uint64_t msgs = 0;
    const std::string leader = cl.StreamLeader("FB", &msgs);
    int victim = -1;
    for (int i = 0; i < c.size(); ++i) {
      if (c.name(i) == leader) victim = i;
    }
    ASSERT_GE(victim, 0) << "stream leader '" << leader << "'";
    {
      absl::MutexLock l(&mu);
      failures.clear();
    }
    ASSERT_TRUE(c.Kill(victim).ok());
    const absl::Time killed = absl::Now();
    absl::SleepFor(absl::Milliseconds(down_ms(rng)));  // the node stays down a while
    {
      const absl::Status restarted = c.Restart(victim);
      ASSERT_TRUE(restarted.ok()) << restarted;
    }
    const double restarted_ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
    // The outage: kill -> first acknowledgement after it, once publishing
    // runs again (an ack after the kill that came from a publish sent
    // before it would end it early: the first ack after 3 more).
    absl::Time resumed;
    {
      absl::MutexLock l(&mu);
      auto back = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        int after = 0;
        for (auto it = acks.rbegin(); it != acks.rend() && *it > killed; ++it) ++after;
        return after >= 3;
      };
      ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&back), absl::Seconds(60)))
          << "publishes did not resume within 60 s of the kill";
      resumed = *std::find_if(acks.begin(), acks.end(),
                              [&](absl::Time t) { return t > killed; });
      // Gaps between successive acks after the kill: the longest is the outage.
      absl::Time prev = killed;
      double gap = 0;
      for (absl::Time t : acks) {
        if (t <= killed) continue;
        gap = std::max(gap, absl::ToDoubleMilliseconds(t - prev));
        prev = t;
      }
      worst = std::max(worst, gap);
      outages.push_back(absl::StrCat(
          "round ", r + 1, ": leader ", leader, " killed, restarted after ",
          static_cast<int>(restarted_ms), " ms; first ack ",
          static_cast<int>(absl::ToDoubleMilliseconds(resumed - killed)),
          " ms after the kill, longest gap ", static_cast<int>(gap), " ms; failures: ",
          absl::StrJoin(failures, ", ", absl::PairFormatter(" x"))));
    }
    std::printf("%s\n", outages.back().c_str());
    std::fflush(stdout);
  }
  stop.store(true);
  publisher.join();
  uint64_t msgs = 0;
  for (const absl::Time until = absl::Now() + absl::Seconds(30);
       cl.StreamLeader("FB", &msgs).empty() && absl::Now() < until;) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  absl::MutexLock l(&mu);
  // (A publish that timed out may be stored all the same: at least.)
  EXPECT_GE(msgs, static_cast<uint64_t>(acked)) << "acknowledged publishes lost";
  std::printf("quick restarts of the stream leader: longest outage %.0f ms over %d rounds\n",
              worst, rounds);
}

}  // namespace
}  // namespace leap::testing
