// kill -9 of the trainer leapd of a fleet: another leapd takes the trainer
// lease and trains within about the lease time. Real processes: one
// nats-server -js (file storage in a temp dir, random port) and two leapd
// --fleet members; the trainer is killed three times, each time the other
// member takes over and the killed one is restarted as a member. Prints
// the measured takeover times (kill -> lease won, kill -> training).
// nats-server (installed by scripts/install-deps) is required: without it the
// test fails.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "readout/artifact.h"
#include "tests/support/nats_cluster.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"
#include "tests/support/readout_fixtures.h"

namespace leap {
namespace {

constexpr int64_t kLeaseMs = 1000;

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
      .count();
}

TEST(LeapdFleetTakeover, KilledTrainerIsReplacedWithinTheLease) {
  const testing::ScopedTempDir tmp("leapd_fleet_takeover");
  const std::filesystem::path dir = tmp.path();
  testing::NatsClusterOptions no;
  no.nodes = 1;
  no.dir = (dir / "nats").string();
  auto server = testing::NatsCluster::Start(no);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string url = (*server)->url(0);
  testing::ProcessOptions po;
  po.merge_stderr = true;
  po.die_with_parent = true;
  const std::string artifact = (dir / "chat.leapr").string();
  ASSERT_TRUE(readout::WriteArtifact(artifact, ::leap::testing::RandomState(64, 5)).ok());

  auto start = [&](const std::string& id, bool import) {
    std::vector<std::string> args = {
        absl::StrCat("--data_dir=", (dir / id).string()), absl::StrCat("--fleet=", url),
        "--fleet_name=k", absl::StrCat("--fleet_member=", id),
        absl::StrCat("--fleet_lease_ms=", kLeaseMs)};
    if (import) args.push_back(absl::StrCat("--import=chat=", artifact));
    std::string address;
    auto p = testing::StartLeapd(LEAPD_PATH, args, &address, absl::Seconds(30), po);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  };
  std::unique_ptr<testing::Process> trainer = start("a", /*import=*/true);
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->WaitForLine("leapd: fleet trainer: a holds the trainer lease",
                                   absl::Seconds(20))
                  .ok());
  ASSERT_TRUE(trainer->WaitForLine("leapd: fleet trainer: readout 'chat': training from",
                                   absl::Seconds(20))
                  .ok());
  std::string trainer_id = "a";
  std::string member_id = "b";
  std::unique_ptr<testing::Process> member = start("b", /*import=*/false);
  ASSERT_NE(member, nullptr);
  std::vector<double> lease_ms, training_ms;
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    trainer->Signal(SIGKILL);
    trainer->Wait();
    ASSERT_TRUE(member
                    ->WaitForLine(absl::StrCat("leapd: fleet trainer: ", member_id,
                                               " holds the trainer lease"),
                                  absl::Seconds(20))
                    .ok())
        << member->Tail();
    lease_ms.push_back(MsSince(t0));
    ASSERT_TRUE(member
                    ->WaitForLine("leapd: fleet trainer: readout 'chat': training from",
                                  absl::Seconds(20))
                    .ok())
        << member->Tail();
    training_ms.push_back(MsSince(t0));
    std::printf("takeover %d: lease won %.0f ms, training %.0f ms after kill -9 "
                "(lease %lld ms)\n",
                round, lease_ms.back(), training_ms.back(),
                static_cast<long long>(kLeaseMs));
    // The lease is at most a lease old when the trainer dies, the claim is
    // retried every lease/8.
    EXPECT_LT(lease_ms.back(), kLeaseMs + kLeaseMs / 8 + 1000);
    // The killed one comes back as a member; roles swap.
    trainer = std::move(member);
    member = start(trainer_id, /*import=*/false);
    ASSERT_NE(member, nullptr);
    std::swap(trainer_id, member_id);
  }
  member.reset();
  trainer.reset();
}

}  // namespace
}  // namespace leap
