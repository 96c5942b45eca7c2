// The NATS test support against real Debian nats-server processes: a single
// JetStream server, and a 3-node cluster that forms on loopback, whose R3
// stream acknowledges every publish while the stream's leader is killed with
// kill -9 (message-id de-duplication keeps the retried ones single), catches
// up after the restart, and whose replicated KV bucket refuses a second
// claimant of a key (create-if-absent: what the fleet's trainer lease uses).
#include "tests/support/nats_cluster.h"

#include <nats/nats.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
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

  ASSERT_TRUE(c.Restart(victim).ok());
  EXPECT_TRUE(c.running(victim));
  publish_some(10);
  cl.StreamLeader("FB", &msgs);
  EXPECT_EQ(msgs, 210u);
}

}  // namespace
}  // namespace leap::testing
