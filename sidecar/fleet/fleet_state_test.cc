// A trainer's STATE checkpoint with a huge fleet quality (tens of thousands
// of (product line, arm) series for one readout), against a real
// nats-server started by the test (-js, file storage in a temp dir, a free
// loopback port): FleetQualityTracker::Encode stays within its byte budget
// by leaving out the arms after the first that does not fit (quality is
// dropped, never the checkpoint), the checkpoint is written and read back,
// and the quality decoded from it reports exactly the series kept.
// Fails when /usr/sbin/nats-server is missing (scripts/install-deps).
#include "sidecar/fleet/fleet_state.h"

#include <cmath>
#include <filesystem>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/fleet/fleet_quality.h"
#include "sidecar/fleet/nats_client.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::fleet {
namespace {

namespace fpb = ::leap::v1::fleet;

TEST(FleetStateQuality, AHugeSeriesCountDropsQualityNeverTheCheckpoint) {
  ::leap::testing::ScopedTempDir tmp("fleet_state_test");
  ::leap::testing::NatsClusterOptions no;
  no.nodes = 1;
  no.dir = (std::filesystem::path(tmp.path()) / "nats").string();
  auto cluster = ::leap::testing::NatsCluster::Start(no);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  NatsClientOptions o;
  o.servers = {(*cluster)->url(0)};
  auto nats = NatsClient::Connect(o);
  ASSERT_TRUE(nats.ok()) << nats.status();
  ASSERT_TRUE((*nats)->WaitConnected(20'000).ok());
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

}  // namespace
}  // namespace leap::fleet
