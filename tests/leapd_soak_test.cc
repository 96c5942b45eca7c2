// Soak (label "soak", ~90 s; LEAP_SOAK_SECONDS overrides): a real leapd
// publishing ~100 versions/s (d = 256, --rls_batch=1) to two watchers that
// read at full speed, one slow watcher (20 messages/s), one stalled watcher
// (never reads) and, every few seconds, a new engine that stops reading its
// Connect answers (dropped, then closed). Asserted at the end:
//  - leapd's VmRSS is at most kRssGrowthKiB over its value after warm-up;
//  - no consumer's outbox ever held more than --outbox_bytes
//    (leap_outbox_peak_bytes) and every stalled engine was dropped;
//  - the full-speed watchers got every version;
//  - once every client is gone, leapd holds no more file descriptors than
//    before the first client connected.
#include <cstdlib>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/outbox_test_util.h"

#ifndef LEAPD_PATH
#error "LEAPD_PATH must name the leapd binary"
#endif

namespace leap::outbox_test {
namespace {

constexpr int64_t kDim = 256;
constexpr int64_t kBound = 256 << 10;        // --outbox_bytes
constexpr int64_t kRssGrowthKiB = 32 << 10;  // 32 MiB over the run

TEST(Soak, SteadyRateWithSlowAndStalledConsumers) {
  int seconds = 90;
  if (const char* env = std::getenv("LEAP_SOAK_SECONDS")) seconds = std::atoi(env);
  std::string address;
  auto p = testing::StartLeapd(
      LEAPD_PATH,
      {"--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
       absl::StrCat("--outbox_bytes=", kBound), "--rls_batch=1", "--rls_batch_max=1",
       "--rls_flush=1ms"},
      &address);
  ASSERT_TRUE(p.ok()) << p.status();
  std::unique_ptr<testing::Process> leapd = std::move(*p);
  const std::string metrics = MetricsAddress(*leapd);
  ASSERT_FALSE(metrics.empty());
  const int fds_before = FdCount(leapd->pid());
  ASSERT_GT(fds_before, 0);
  ASSERT_TRUE(testing::CreateDefaultReadout(address, "r", kDim).ok());

  int64_t rss_start = 0, rss_end = 0, last = 0, dropped_engines = 0;
  {
    Watcher a(testing::MakeChannel(address), "r");
    Watcher b(testing::MakeChannel(address), "r");
    Watcher slow(StallingChannel(address), "r", absl::Milliseconds(50));
    Watcher stalled(StallingChannel(address), "r");
    a.StartReading();
    b.StartReading();
    slow.StartReading();
    stalled.Open();
    ASSERT_TRUE(a.WaitForVersion(1, absl::Seconds(30)));
    ASSERT_TRUE(b.WaitForVersion(1, absl::Seconds(30)));

    Publisher pub(address, kDim, absl::Milliseconds(10));
    pub.Start();
    const absl::Time start = absl::Now();
    const absl::Time end = start + absl::Seconds(seconds);
    bool warmed = false;
    while (absl::Now() < end) {
      // A new engine that stops reading: dropped within the bound.
      StalledEngine engine(address, kDim);
      const double before =
          std::max(0.0, Metric(metrics, "leap_outbox_dropped_total{stream=\"connect\"}"));
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      while (Metric(metrics, "leap_outbox_dropped_total{stream=\"connect\"}") <
                 before + 1 &&
             absl::Now() < deadline) {
        for (int i = 0; i < 8; ++i) engine.SendBadBatch(64);
      }
      int64_t answers = 0;
      grpc::Status s = engine.DrainAndFinish(&answers);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << s.error_message();
      ++dropped_engines;
      if (!warmed && absl::Now() - start > absl::Seconds(seconds) / 6) {
        rss_start = RssKiB(leapd->pid());
        warmed = true;
      }
      absl::SleepFor(absl::Seconds(2));  // pacing of the engines
      ASSERT_EQ(pub.error(), "");
    }
    pub.Stop();
    ASSERT_EQ(pub.error(), "");
    rss_end = RssKiB(leapd->pid());
    auto admin = pb::Admin::NewStub(testing::MakeChannel(address));
    pb::ReadoutInfo info;
    for (absl::Time d = absl::Now() + absl::Seconds(30); absl::Now() < d;
         absl::SleepFor(absl::Milliseconds(20))) {
      grpc::ClientContext ctx;
      pb::GetReadoutRequest req;
      req.set_name("r");
      ASSERT_TRUE(admin->GetReadout(&ctx, req, &info).ok());
      if (info.completions_learned() >= pub.published()) break;
    }
    last = info.version();
    ASSERT_TRUE(a.WaitForVersion(last, absl::Seconds(60)));
    ASSERT_TRUE(b.WaitForVersion(last, absl::Seconds(60)));
    EXPECT_EQ(a.Gaps(), 0);
    EXPECT_EQ(b.Gaps(), 0);
    EXPECT_EQ(static_cast<int64_t>(a.versions().size()), last);
    EXPECT_EQ(static_cast<int64_t>(b.versions().size()), last);
    std::printf("soak: %d s, %lld versions, %lld stalled engines dropped, slow "
                "watcher got %zu versions\n",
                seconds, static_cast<long long>(last),
                static_cast<long long>(dropped_engines), slow.versions().size());
  }
  const double peak = Metric(metrics, "leap_outbox_peak_bytes");
  const double coalesced = Metric(metrics, "leap_outbox_coalesced_total");
  std::printf("soak: VmRSS %lld KiB after warm-up, %lld KiB at the end "
              "(bound +%lld KiB); outbox peak %.0f of %lld bytes, %.0f "
              "versions coalesced\n",
              static_cast<long long>(rss_start), static_cast<long long>(rss_end),
              static_cast<long long>(kRssGrowthKiB), peak,
              static_cast<long long>(kBound), coalesced);
  EXPECT_GT(rss_start, 0);
  EXPECT_LE(rss_end, rss_start + kRssGrowthKiB);
  EXPECT_LE(peak, kBound);
  EXPECT_GT(coalesced, 0);
  EXPECT_GE(dropped_engines, 1);

  // Every client is gone: leapd closes their connections.
  int fds = FdCount(leapd->pid());
  for (absl::Time d = absl::Now() + absl::Seconds(30);
       fds > fds_before && absl::Now() < d;
       absl::SleepFor(absl::Milliseconds(50))) {
    fds = FdCount(leapd->pid());
  }
  std::printf("soak: %d fds before the first client, %d at the end\n",
              fds_before, fds);
  EXPECT_LE(fds, fds_before);
  EXPECT_LE(Metric(metrics, "leap_outbox_bytes"), 0);
}

}  // namespace
}  // namespace leap::outbox_test
