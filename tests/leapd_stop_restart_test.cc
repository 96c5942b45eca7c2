// "leapd: stopped" means the data directory is free (real leapd processes):
// it is printed once every object of leapd, the RocksDB store and its lock
// included, is gone, so a leapd started the moment it appears opens the same
// --data_dir (before, the lock was released ~1.6 s after the line and an
// immediate restart failed). Five stop/start rounds, each start waited for
// only by the line.
#include <signal.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap {
namespace {

TEST(LeapdStop, RestartAtOnceAfterStoppedOpensTheSameDataDir) {
  const testing::ScopedTempDir tmp("stop-restart");
  const std::string& dir = tmp.path();
  const std::string sock = "unix://" + dir + "/leapd.sock";
  const std::vector<std::string> args = {"--listen=" + sock,
                                         "--data_dir=" + dir + "/db"};
  testing::ProcessOptions po;
  po.merge_stderr = true;
  std::string addr;
  auto leapd = testing::StartLeapd(LEAPD_PATH, args, &addr,
                                   absl::Seconds(30), po);
  ASSERT_TRUE(leapd.ok()) << leapd.status();
  {
    // Some state, so that the store has something to close.
    const grpc::Status s = testing::CreateDefaultReadout(sock, "r", 64);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  for (int round = 0; round < 5; ++round) {
    (*leapd)->Signal(SIGTERM);
    auto stopped = (*leapd)->WaitForLine("leapd: stopped", absl::Seconds(60));
    ASSERT_TRUE(stopped.ok()) << (*leapd)->Tail();
    // Started before the old process is reaped: only the line is waited for.
    std::filesystem::remove(dir + "/leapd.sock");
    auto next = testing::StartLeapd(LEAPD_PATH, args, &addr,
                                    absl::Seconds(30), po);
    ASSERT_TRUE(next.ok()) << "round " << round << ": " << next.status();
    const int status = (*leapd)->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    leapd = std::move(next);
    // The readout survived each round.
    auto admin = leap::v1::Admin::NewStub(testing::MakeChannel(sock));
    grpc::ClientContext ctx;
    leap::v1::GetReadoutRequest req;
    req.set_name("r");
    leap::v1::ReadoutInfo resp;
    ASSERT_TRUE(admin->GetReadout(&ctx, req, &resp).ok()) << round;
  }
}

}  // namespace
}  // namespace leap
