// Unit tests of the live-request feature cache, in process: insert, find
// and take; duplicate and oversized requests; eviction of the oldest
// requests by bytes and by TTL (time is the caller's now_ns: no clock is
// read); exact takes; slots of external features released exactly once.
#include "sidecar/core/feature_cache.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace leap::sidecar {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

std::shared_ptr<LiveRequest> Request(const std::string& id,
                                     size_t feature_bytes = 64) {
  auto r = std::make_shared<LiveRequest>();
  r->request_id = id;
  r->key = id;  // an engine without an instance id: keyed by the id
  r->product_line = "pl";
  r->dim = static_cast<int64_t>(feature_bytes / 4);
  r->features.assign(feature_bytes, 'x');
  return r;
}

FeatureCacheOptions Options(int64_t max_bytes = kMiB, int64_t ttl_ns = 1000) {
  FeatureCacheOptions o;
  o.max_bytes = max_bytes;
  o.ttl_ns = ttl_ns;
  return o;
}

TEST(FeatureCache, InsertFindTake) {
  FeatureCache cache(Options());
  auto a = Request("a");
  auto b = Request("b", 128);
  ASSERT_TRUE(cache.Insert(a, 10).ok());
  ASSERT_TRUE(cache.Insert(b, 11).ok());
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.bytes(), a->bytes() + b->bytes());
  EXPECT_EQ(cache.Find("a"), a);
  EXPECT_EQ(cache.Find("zz"), nullptr);
  EXPECT_FALSE(a->gone.load());

  auto taken = cache.Take("a");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(*taken, a);
  EXPECT_TRUE(a->gone.load());
  EXPECT_EQ(cache.Find("a"), nullptr);
  EXPECT_EQ(cache.size(), 1);
  EXPECT_EQ(cache.bytes(), b->bytes());
  EXPECT_TRUE(absl::IsNotFound(cache.Take("a").status()));
  // A taken id may become live again.
  EXPECT_TRUE(cache.Insert(Request("a"), 12).ok());
  EXPECT_EQ(cache.size(), 2);
}

TEST(FeatureCache, RefusesDuplicateAndOversizedRequests) {
  int evictions = 0;
  FeatureCache cache(Options(), [&](bool) { ++evictions; });
  auto first = Request("dup");
  ASSERT_TRUE(cache.Insert(first, 1).ok());
  absl::Status again = cache.Insert(Request("dup"), 2);
  EXPECT_TRUE(absl::IsAlreadyExists(again)) << again;
  EXPECT_EQ(cache.Find("dup"), first);  // the live one is kept

  absl::Status big = cache.Insert(Request("big", kMiB), 3);
  EXPECT_TRUE(absl::IsResourceExhausted(big)) << big;
  EXPECT_EQ(cache.Find("big"), nullptr);
  EXPECT_EQ(cache.Find("dup"), first);  // nothing evicted for it
  EXPECT_EQ(evictions, 0);
  EXPECT_EQ(cache.size(), 1);
}

TEST(FeatureCache, EvictsOldestFirstWhenFull) {
  std::vector<bool> evictions;
  FeatureCache cache(Options(kMiB, int64_t{1} << 40),
                     [&](bool ttl) { evictions.push_back(ttl); });
  const size_t each = 100 * 1024;
  const int64_t per = Request("r00", each)->bytes();
  const int64_t fit = kMiB / per;  // requests that fit at once
  ASSERT_GE(fit, 5);
  std::vector<std::shared_ptr<LiveRequest>> all;
  for (int i = 0; i < fit + 3; ++i) {
    char id[16];
    std::snprintf(id, sizeof(id), "r%02d", i);
    all.push_back(Request(id, each));
    ASSERT_TRUE(cache.Insert(all.back(), i).ok());
    EXPECT_LE(cache.bytes(), kMiB);
  }
  // The three oldest went, in age order; every newer one stays.
  EXPECT_EQ(cache.evicted_capacity(), 3);
  EXPECT_EQ(cache.evicted_ttl(), 0);
  EXPECT_EQ(evictions, std::vector<bool>(3, false));
  for (int i = 0; i < fit + 3; ++i) {
    EXPECT_EQ(all[i]->gone.load(), i < 3) << i;
    EXPECT_EQ(cache.Find(all[i]->request_id) != nullptr, i >= 3) << i;
  }
  EXPECT_EQ(cache.size(), fit);
  EXPECT_EQ(cache.bytes(), fit * per);

  // Taking one from the middle frees its room: the next insert evicts
  // nothing; the one after evicts the oldest left (r03), not the newest.
  ASSERT_TRUE(cache.Take(all[5]->request_id).ok());
  ASSERT_TRUE(cache.Insert(Request("n1", each), 100).ok());
  EXPECT_EQ(cache.evicted_capacity(), 3);
  ASSERT_TRUE(cache.Insert(Request("n2", each), 101).ok());
  EXPECT_EQ(cache.evicted_capacity(), 4);
  EXPECT_TRUE(all[3]->gone.load());
  EXPECT_NE(cache.Find("r04"), nullptr);
  EXPECT_NE(cache.Find("n1"), nullptr);
}

TEST(FeatureCache, ExpiresByTtlOnTheCallersClock) {
  std::vector<bool> evictions;
  FeatureCache cache(Options(kMiB, /*ttl_ns=*/1000),
                     [&](bool ttl) { evictions.push_back(ttl); });
  auto a = Request("a"), b = Request("b"), c = Request("c");
  ASSERT_TRUE(cache.Insert(a, 0).ok());
  ASSERT_TRUE(cache.Insert(b, 500).ok());
  ASSERT_TRUE(cache.Insert(c, 900).ok());
  // Exactly the TTL old is still live.
  cache.Expire(1000);
  EXPECT_EQ(cache.size(), 3);
  cache.Expire(1001);
  EXPECT_TRUE(a->gone.load());
  EXPECT_EQ(cache.Find("a"), nullptr);
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.evicted_ttl(), 1);
  // An insert expires too (b is 1,001 ns old at 1,501; c is not).
  ASSERT_TRUE(cache.Insert(Request("d"), 1501).ok());
  EXPECT_TRUE(b->gone.load());
  EXPECT_FALSE(c->gone.load());
  EXPECT_EQ(cache.evicted_ttl(), 2);
  EXPECT_EQ(cache.evicted_capacity(), 0);
  EXPECT_EQ(evictions, std::vector<bool>(2, true));
  EXPECT_EQ(cache.bytes(), c->bytes() + Request("d")->bytes());
}

TEST(FeatureCache, AnExpiredIdIsNoLongerLive) {
  FeatureCache cache(Options(kMiB, /*ttl_ns=*/1000));
  auto old = Request("id");
  ASSERT_TRUE(cache.Insert(old, 0).ok());
  // Past its TTL the old entry is gone: the id may be used again.
  auto again = Request("id");
  absl::Status s = cache.Insert(again, 2000);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(old->gone.load());
  EXPECT_EQ(cache.Find("id"), again);
  EXPECT_EQ(cache.evicted_ttl(), 1);
  EXPECT_EQ(cache.size(), 1);
}

TEST(FeatureCache, OneIdOfTwoEngineInstancesIsTwoEntries) {
  FeatureCache cache(Options());
  auto mine = Request("id"), theirs = Request("id");
  mine->key = LiveRequestKey("engine-a", "id");
  theirs->key = LiveRequestKey("engine-b", "id");
  ASSERT_TRUE(cache.Insert(mine, 1).ok());
  ASSERT_TRUE(cache.Insert(theirs, 2).ok());
  auto shared = Request("id");  // no instance: the id itself
  ASSERT_TRUE(cache.Insert(shared, 3).ok());
  EXPECT_EQ(cache.size(), 3);
  EXPECT_EQ(cache.Find(LiveRequestKey("engine-a", "id")), mine);
  EXPECT_EQ(cache.Find(LiveRequestKey("engine-b", "id")), theirs);
  EXPECT_EQ(cache.Find(LiveRequestKey("", "id")), shared);
  auto dup = Request("id");
  dup->key = LiveRequestKey("engine-a", "id");
  EXPECT_TRUE(absl::IsAlreadyExists(cache.Insert(dup, 4)));
  ASSERT_TRUE(cache.Take(LiveRequestKey("engine-b", "id")).ok());
  EXPECT_FALSE(mine->gone.load());
  EXPECT_TRUE(theirs->gone.load());
}

TEST(FeatureCache, TakeIfTakesOnlyTheExpectedObject) {
  FeatureCache cache(Options());
  auto old = Request("id");
  ASSERT_TRUE(cache.Insert(old, 1).ok());
  ASSERT_TRUE(cache.Take("id").ok());
  auto successor = Request("id");
  ASSERT_TRUE(cache.Insert(successor, 2).ok());
  // The old request's owner cancels: the successor under its id stays.
  EXPECT_EQ(cache.TakeIf("id", old.get()), nullptr);
  EXPECT_EQ(cache.Find("id"), successor);
  EXPECT_EQ(cache.TakeIf("id", successor.get()), successor);
  EXPECT_EQ(cache.size(), 0);
}

TEST(FeatureCache, BatchesAnswerPerItem) {
  FeatureCache cache(Options());
  std::vector<std::shared_ptr<LiveRequest>> rs = {Request("a"), Request("b"),
                                                  nullptr, Request("a")};
  std::vector<absl::Status> status;
  cache.InsertBatch(rs, 5, &status);
  ASSERT_EQ(status.size(), 4u);
  EXPECT_TRUE(status[0].ok());
  EXPECT_TRUE(status[1].ok());
  EXPECT_TRUE(absl::IsAlreadyExists(status[3])) << status[3];
  EXPECT_EQ(cache.size(), 2);

  std::vector<absl::string_view> ids = {"b", "nope", "a"};
  std::vector<std::shared_ptr<LiveRequest>> taken;
  cache.TakeBatch(ids, &taken, &status);
  ASSERT_EQ(taken.size(), 3u);
  EXPECT_EQ(taken[0], rs[1]);
  EXPECT_EQ(taken[1], nullptr);
  EXPECT_TRUE(absl::IsNotFound(status[1])) << status[1];
  EXPECT_EQ(taken[2], rs[0]);
  EXPECT_EQ(cache.size(), 0);
  EXPECT_EQ(cache.bytes(), 0);
}

// Counts releases per slot.
class CountingArena : public ExternalFeatures {
 public:
  void Release(uint32_t slot) override { ++released[slot]; }
  std::map<uint32_t, int> released;
};

TEST(FeatureCache, ExternalSlotsAreReleasedOnceWhenTheLastHolderGoes) {
  auto arena = std::make_shared<CountingArena>();
  const std::string slot_memory(64, 'f');
  {
    FeatureCache cache(Options(kMiB, 1000));
    for (uint32_t slot = 0; slot < 3; ++slot) {
      auto r = Request("s" + std::to_string(slot), 0);
      r->external = slot_memory.data();
      r->dim = 16;
      r->owner = arena;
      r->slot = slot;
      ASSERT_TRUE(cache.Insert(std::move(r), 0).ok());
    }
    // Taken and dropped: released at once.
    ASSERT_TRUE(cache.Take("s0").ok());
    EXPECT_EQ(arena->released[0], 1);
    // Taken but still held by a reader: released when it lets go.
    std::shared_ptr<LiveRequest> held = *cache.Take("s1");
    EXPECT_EQ(arena->released.count(1), 0u);
    EXPECT_EQ(held->view().data, slot_memory.data());
    held.reset();
    EXPECT_EQ(arena->released[1], 1);
    // Expired: released.
    cache.Expire(2000);
    EXPECT_EQ(arena->released[2], 1);
  }
  EXPECT_EQ(arena->released, (std::map<uint32_t, int>{{0, 1}, {1, 1}, {2, 1}}));
}

TEST(FeatureCache, OptionsValidate) {
  EXPECT_TRUE(Options().Validate().ok());
  EXPECT_FALSE(Options(kMiB - 1).Validate().ok());
  EXPECT_FALSE(Options(kMiB, 0).Validate().ok());
}

}  // namespace
}  // namespace leap::sidecar
