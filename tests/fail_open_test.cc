// Fail-open with real processes: an engine process (tests/fail_open_engine:
// the shim's Client + CountdownScheduler in a step loop) keeps serving,
// first-come for what has no prediction, while its leapd is SIGKILLed,
// restarted, hung with SIGSTOP and resumed; it reports degraded while no
// leapd answers and picks predictions up again by itself. Over both data
// planes (gRPC on a unix socket, shared memory).
#include <signal.h>

#include <filesystem>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap {
namespace {

constexpr int64_t kDim = 1024;  // 4 KiB per request: a hung leapd's windows fill
constexpr int kResponseTimeoutMs = 500;

using Status = std::map<std::string, int64_t>;

Status Parse(const std::string& line) {
  Status s;
  for (absl::string_view kv : absl::StrSplit(line, ' ')) {
    std::pair<std::string, std::string> p = absl::StrSplit(kv, '=');
    int64_t v;
    if (absl::SimpleAtoi(p.second, &v)) s[p.first] = v;
  }
  return s;
}

// Reads the engine's status lines until `pred` holds for one; fails the test
// (returns the last one seen) at the deadline.
Status WaitStatus(testing::Process& engine,
                  const std::function<bool(const Status&)>& pred,
                  const std::string& what,
                  absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  Status last;
  while (absl::Now() < deadline) {
    auto line = engine.WaitForLine("status ", deadline - absl::Now());
    if (!line.ok()) break;
    last = Parse(*line);
    if (pred(last)) return last;
  }
  ADD_FAILURE() << "engine never reported: " << what << "; last: "
                << engine.Tail();
  return last;
}

class FailOpen : public ::testing::TestWithParam<std::string> {};

TEST_P(FailOpen, EngineKeepsServingWhileLeapdIsKilledHungAndRestarted) {
  const testing::ScopedTempDir tmp("failopen-" + GetParam());
  const std::string& dir = tmp.path();
  const std::string sock = "unix://" + dir + "/leapd.sock";
  const std::vector<std::string> args = {"--listen=" + sock,
                                         "--data_dir=" + dir + "/db",
                                         "--shm=" + dir + "/leap.shm"};
  const std::string endpoint =
      GetParam() == "shm" ? "shm://" + dir + "/leap.shm" : sock;
  std::string addr;
  auto leapd = testing::StartLeapd(LEAPD_PATH, args, &addr);
  ASSERT_TRUE(leapd.ok()) << leapd.status();
  {
    const grpc::Status s = testing::CreateDefaultReadout(sock, "r", kDim);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  testing::ProcessOptions po;
  po.kept_lines = 2000;
  po.die_with_parent = true;
  auto engine = testing::Process::Start(
      {FAIL_OPEN_ENGINE_PATH, endpoint, std::to_string(kDim), "2000",
       std::to_string(kResponseTimeoutMs)},
      po);
  ASSERT_TRUE(engine.ok()) << engine.status();
  testing::Process& e = **engine;

  // Serving with predictions.
  Status s = WaitStatus(e, [](const Status& s) {
    return s.at("degraded") == 0 && s.at("predicted") >= 50 &&
           s.at("completed") >= 20;
  }, "predictions while leapd is up");

  // 1. leapd is killed: the engine keeps stepping and completing requests
  // (without predictions), and says it is degraded.
  (*leapd)->Signal(SIGKILL);
  (*leapd)->Wait();
  s = WaitStatus(e, [](const Status& s) { return s.at("degraded") == 1; },
                 "degraded after SIGKILL");
  const Status at_kill = s;
  s = WaitStatus(e, [&](const Status& s) {
    return s.at("steps") >= at_kill.at("steps") + 200 &&
           s.at("unpredicted_completed") >= at_kill.at("unpredicted_completed") + 20;
  }, "serving without leapd (unpredicted requests completing)");
  EXPECT_EQ(s.at("degraded"), 1);

  // 2. leapd restarts on the same paths: predictions resume by themselves.
  std::filesystem::remove(dir + "/leapd.sock");
  leapd = testing::StartLeapd(LEAPD_PATH, args, &addr);
  ASSERT_TRUE(leapd.ok()) << leapd.status();
  const int64_t predicted_before_restart = s.at("predicted");
  s = WaitStatus(e, [&](const Status& s) {
    return s.at("degraded") == 0 &&
           s.at("predicted") >= predicted_before_restart + 50;
  }, "predictions again after the restart");

  // 3. leapd hangs (SIGSTOP): nothing answers, the connection is abandoned
  // after the response timeout, the engine keeps serving, degraded.
  const int64_t stalls_before = s.at("stalls");
  ASSERT_EQ(kill((*leapd)->pid(), SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  s = WaitStatus(e, [](const Status& s) { return s.at("degraded") == 1; },
                 "degraded while leapd is stopped");
  const absl::Duration detect = absl::Now() - stopped;
  EXPECT_GE(s.at("stalls"), stalls_before + 1);
  // The response timeout plus the 100 ms status cadence and a loaded
  // machine's scheduling.
  EXPECT_LT(detect, absl::Milliseconds(kResponseTimeoutMs) + absl::Seconds(5));
  const Status at_stop = s;
  s = WaitStatus(e, [&](const Status& s) {
    return s.at("steps") >= at_stop.at("steps") + 200 &&
           s.at("completed") >= at_stop.at("completed") + 20;
  }, "serving while leapd is hung");
  EXPECT_EQ(s.at("degraded"), 1);

  // 4. leapd resumes: predictions come back.
  ASSERT_EQ(kill((*leapd)->pid(), SIGCONT), 0);
  const int64_t predicted_before_cont = s.at("predicted");
  s = WaitStatus(e, [&](const Status& s) {
    return s.at("degraded") == 0 &&
           s.at("predicted") >= predicted_before_cont + 50;
  }, "predictions again after SIGCONT");

  // 5. The engine shuts down while leapd is hung: the Client does not hold
  // it (its destructor closes the stuck connection).
  ASSERT_EQ(kill((*leapd)->pid(), SIGSTOP), 0);
  s = WaitStatus(e, [](const Status& s) { return s.at("degraded") == 1; },
                 "degraded while leapd is stopped again");
  e.Signal(SIGTERM);
  auto exit_line = e.WaitForLine("exit ", absl::Seconds(30));
  ASSERT_TRUE(exit_line.ok()) << e.Tail();
  const int status = e.Wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const int64_t destroy_us = Parse(*exit_line).at("destroy_us");
  // Bounded by one connect_timeout (300 ms) of a reconnect attempt.
  EXPECT_LT(destroy_us, 2'000'000) << *exit_line;
  ASSERT_EQ(kill((*leapd)->pid(), SIGCONT), 0);

  // Over the whole run: no step spent long in the shim's calls, and what
  // had no prediction was served in arrival order.
  EXPECT_EQ(s.at("order_violations"), 0);
  // The Client's calls never wait for leapd (a blocked one would take at
  // least the response timeout, 500 ms); the bound, 0.8 of that, leaves
  // room for a loaded machine and sanitizers (a TSan run on 2 busy cores
  // once measured 272 ms; not established why: the Client's manager no
  // longer copies feature bytes under the lock these calls take, and
  // client_call_benchmark shows ms-scale outliers from the 2 cores'
  // scheduling alone).
  EXPECT_LT(s.at("max_call_us"), kResponseTimeoutMs * 800)
      << "a shim call blocked the step loop";
  std::printf("fail-open (%s): leapd hang detected after %lld ms; max step "
              "call %lld us; engine destroyed in %lld us with leapd hung\n",
              GetParam().c_str(),
              static_cast<long long>(absl::ToInt64Milliseconds(detect)),
              static_cast<long long>(s.at("max_call_us")),
              static_cast<long long>(destroy_us));
}

INSTANTIATE_TEST_SUITE_P(Transports, FailOpen, ::testing::Values("unix", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace leap
