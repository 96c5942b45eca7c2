// Bounded outboxes end to end (leapd --outbox_bytes), a real leapd on port 0:
//  - A WatchReadout client that stops reading while versions are published:
//    its queue is coalesced to the newest version (leap_outbox_coalesced_
//    total rises), no consumer's outbox ever exceeds the bound
//    (leap_outbox_peak_bytes), two other watchers get every version in
//    order, and the stalled one, once it reads again, ends at the newest
//    version (with gaps: the coalesced ones).
//  - An engine that keeps sending on Connect and never reads its answers is
//    dropped (leap_outbox_dropped_total{stream="connect"}); when it reads,
//    it gets RESOURCE_EXHAUSTED "consumer too slow: N bytes queued"; the
//    watchers meanwhile still get every version.
#include <atomic>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/outbox_test_util.h"

#ifndef LEAPD_PATH
#error "LEAPD_PATH must name the leapd binary"
#endif

namespace leap::outbox_test {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kDim = 256;        // a version with weights: ~1.2 KB
constexpr int64_t kBound = 256 << 10;  // --outbox_bytes: ~200 versions

class OutboxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto p = testing::StartLeapd(
        LEAPD_PATH,
        {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
         absl::StrCat("--outbox_bytes=", kBound), "--rls_batch=1", "--rls_batch_max=1",
         "--rls_flush=1ms"},
        &address_);
    ASSERT_TRUE(p.ok()) << p.status();
    leapd_ = std::move(*p);
    metrics_ = MetricsAddress(*leapd_);
    ASSERT_FALSE(metrics_.empty());
    grpc::Status s = testing::CreateDefaultReadout(address_, "r", kDim);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  pb::ReadoutInfo Info() {
    auto admin = pb::Admin::NewStub(testing::MakeChannel(address_));
    grpc::ClientContext ctx;
    pb::GetReadoutRequest req;
    req.set_name("r");
    pb::ReadoutInfo info;
    grpc::Status s = admin->GetReadout(&ctx, req, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return info;
  }

  // The version once `n` completions are learned (RLS runs behind the
  // Complete answers). With --rls_batch=1 --rls_batch_max=1 every
  // completion is published as a version of its own, so that is version
  // n + 1; waiting for the count alone is not enough: leapd counts a
  // completion as learned just before it publishes the version holding it.
  int64_t VersionAfter(int64_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    pb::ReadoutInfo info = Info();
    while ((info.completions_learned() < n || info.version() < n + 1) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      info = Info();
    }
    EXPECT_GE(info.completions_learned(), n);
    EXPECT_EQ(info.version(), n + 1);
    return info.version();
  }

  // Every version from 1 to `last`, in order.
  static void ExpectEveryVersion(Watcher& w, int64_t last) {
    ASSERT_TRUE(w.WaitForVersion(last, absl::Seconds(60)));
    std::vector<int64_t> v = w.versions();
    ASSERT_FALSE(v.empty());
    EXPECT_EQ(v.front(), 1);
    EXPECT_EQ(v.back(), last);
    EXPECT_EQ(w.Gaps(), 0);
    EXPECT_EQ(static_cast<int64_t>(v.size()), last);
  }

  std::string address_, metrics_;
  std::unique_ptr<testing::Process> leapd_;
};

TEST_F(OutboxTest, StalledWatcherIsCoalescedOthersGetEveryVersion) {
  Watcher a(testing::MakeChannel(address_), "r");
  Watcher b(testing::MakeChannel(address_), "r");
  Watcher stalled(StallingChannel(address_), "r");
  a.StartReading();
  b.StartReading();
  stalled.Open();
  ASSERT_TRUE(a.WaitForVersion(1, absl::Seconds(30)));
  ASSERT_TRUE(b.WaitForVersion(1, absl::Seconds(30)));

  // ~1.2 MB of versions at a steady 500/s: far more than any window plus
  // the bound.
  Publisher pub(address_, kDim, absl::Milliseconds(2));
  pub.Start();
  while (pub.published() < 1000 && pub.error().empty()) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  pub.Stop();
  ASSERT_EQ(pub.error(), "");
  const int64_t last = VersionAfter(pub.published());
  ASSERT_GE(last, 1001);
  ExpectEveryVersion(a, last);
  ExpectEveryVersion(b, last);

  const double peak = Metric(metrics_, "leap_outbox_peak_bytes");
  const double coalesced = Metric(metrics_, "leap_outbox_coalesced_total");
  const double queued = Metric(metrics_, "leap_outbox_bytes");
  std::printf("outbox: bound %lld bytes, peak %.0f, queued now %.0f, "
              "coalesced %.0f versions\n",
              static_cast<long long>(kBound), peak, queued, coalesced);
  EXPECT_GT(peak, 0);
  EXPECT_LE(peak, kBound);
  EXPECT_LE(queued, kBound);
  EXPECT_GT(coalesced, 0) << "the stalled watcher never went over the bound";
  EXPECT_LE(Metric(metrics_, "leap_outbox_dropped_total{stream=\"watch\"}"), 0);

  // The stalled watcher reads again: it catches up to the newest version,
  // skipping the coalesced ones, and is not dropped.
  stalled.ResumeReading();
  ASSERT_TRUE(stalled.WaitForVersion(last, absl::Seconds(60)));
  EXPECT_GT(stalled.Gaps(), 0);
  EXPECT_LT(static_cast<int64_t>(stalled.versions().size()), last);
  EXPECT_EQ(stalled.versions().back(), last);
}

TEST_F(OutboxTest, StalledEngineIsDroppedWithStatus) {
  Watcher a(testing::MakeChannel(address_), "r");
  a.StartReading();
  ASSERT_TRUE(a.WaitForVersion(1, absl::Seconds(30)));

  StalledEngine engine(address_, kDim);
  std::atomic<bool> stop{false};
  std::atomic<int64_t> sent{0};
  std::thread sender([&] {
    while (!stop.load() && engine.SendBadBatch(64)) sent.fetch_add(1);
  });
  // Versions keep coming while the engine's answers pile up.
  Publisher pub(address_, kDim, absl::Milliseconds(2));
  pub.Start();
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (Metric(metrics_, "leap_outbox_dropped_total{stream=\"connect\"}") < 1 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_GE(Metric(metrics_, "leap_outbox_dropped_total{stream=\"connect\"}"), 1)
      << "sent " << sent.load() << " batches, never dropped";
  pub.Stop();
  ASSERT_EQ(pub.error(), "");
  const int64_t last = VersionAfter(pub.published());

  int64_t answers = 0;
  grpc::Status s = engine.DrainAndFinish(&answers);
  stop.store(true);
  sender.join();
  std::printf("stalled engine: %lld batches sent, %lld answers read, then %s\n",
              static_cast<long long>(sent.load()),
              static_cast<long long>(answers), s.error_message().c_str());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("consumer too slow: "));
  EXPECT_THAT(s.error_message(), HasSubstr("bytes queued"));
  EXPECT_LE(Metric(metrics_, "leap_outbox_peak_bytes"), kBound);

  // The watcher was never held up: every version, in order.
  ExpectEveryVersion(a, last);
}

}  // namespace
}  // namespace leap::outbox_test
