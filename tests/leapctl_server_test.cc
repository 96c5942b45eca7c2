// End-to-end tests of leapctl's commands for a running leapd: a real leapd
// process (port 0) driven only through the real `leapctl` binary.
//  - The operator workflow: readouts from an artifact (synth + train) and
//    cold start, list/get, an A/B route with a shadow arm, a chat-trained
//    readout fed shifted-domain (translation) traffic whose windowed
//    Spearman rises as RLS learns, versions, freeze (more traffic, version
//    unchanged), resume, export (the file's version is the served one), and
//    stats --json with the arm entries.
//  - The error contract: NOT_FOUND from leapd -> exit 1 with the code name;
//    an unreachable server -> exit 1 with a clear message; bad --arm syntax
//    and other usage errors -> exit 2 and nothing changed on the server.
//  - A short `leapctl bench --json`.
#include <cstring>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "tests/leapctl_test_util.h"
#include "tests/support/process.h"

#ifndef LEAPD_PATH
#error "LEAPD_PATH must name the leapd binary"
#endif

namespace leap::leapctl_test {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int kDim = 64;
// The data model and domains, spelled out so the test does not depend on
// synth's defaults: a readout trained on "chat" ranks "translation" poorly
// (64 degrees between the length directions) until RLS learns it.
const std::vector<std::string> kModel = {"--dim", "64",           "--signal",
                                         "1.6",   "--model-seed", "7"};
const std::vector<std::string> kChat = {
    "--domain", "chat",    "--median", "300",      "--log-sigma",
    "0.9",      "--angle", "0",        "--offset", "0"};
const std::vector<std::string> kTranslation = {
    "--domain", "translation", "--median", "900",      "--log-sigma",
    "0.8",      "--angle",     "64",       "--offset", "0.5"};

class LeapctlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto p = testing::StartLeapd(LEAPD_PATH, {}, &address_);
    ASSERT_TRUE(p.ok()) << p.status();
    leapd_ = std::move(*p);
  }

  void TearDown() override {
    if (leapd_ == nullptr) return;
    leapd_->Signal(SIGTERM);
    const int status = leapd_->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "leapd did not exit cleanly: " << status;
  }

  // `leapctl args... --server ADDR`.
  RunResult Ctl(std::vector<std::string> args) {
    args.push_back("--server");
    args.push_back(address_);
    return RunLeapctl(dir_, args);
  }
  // Same, expecting exit 0.
  RunResult Ok(const std::vector<std::string>& args) {
    RunResult r = Ctl(args);
    EXPECT_EQ(r.exit_code, 0) << args[0] << ":\n" << Describe(r);
    return r;
  }
  nlohmann::json Json(const std::vector<std::string>& args) {
    RunResult r = Ok(args);
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "stdout is not one JSON value:\n"
                                   << r.out;
    return j;
  }

  void Synth(const std::string& name, int n, int seed,
             const std::vector<std::string>& domain) {
    std::vector<std::string> extra = kModel;
    extra.insert(extra.end(), domain.begin(), domain.end());
    const std::vector<std::string> args = SynthArgs(dir_, name, n, seed, extra);
    RunResult r = RunLeapctl(dir_, args);
    ASSERT_EQ(r.exit_code, 0) << Describe(r);
  }

  std::vector<std::string> FeedArgs(const std::string& data,
                                    const std::string& product_line) {
    return {"feed",
            "--features",
            dir_.File(data + ".npy"),
            "--lengths",
            dir_.File(data + "_len.npy"),
            "--product-line",
            product_line};
  }

  ScratchDir dir_;
  std::string address_;
  std::unique_ptr<testing::Process> leapd_;
};

// The "rows A-B: spearman S" lines of a text feed report.
std::vector<double> WindowSpearmans(const std::string& out) {
  std::vector<double> v;
  const std::regex line(R"(^rows (\d+)-(\d+): spearman ([0-9.-]+) )");
  std::smatch m;
  size_t pos = 0;
  while (pos < out.size()) {
    size_t end = out.find('\n', pos);
    if (end == std::string::npos) end = out.size();
    const std::string l = out.substr(pos, end - pos);
    if (std::regex_search(l, m, line)) v.push_back(std::stod(m[3].str()));
    pos = end + 1;
  }
  return v;
}

const nlohmann::json* FindArm(const nlohmann::json& stats,
                              const std::string& product_line,
                              const std::string& arm) {
  for (const nlohmann::json& a : stats["arms"]) {
    if (a["product_line"] == product_line && a["arm"] == arm) return &a;
  }
  return nullptr;
}

TEST_F(LeapctlServerTest, OperatorWorkflow) {
  Synth("chat", 4000, 1, kChat);
  Synth("shift", 4000, 3, kTranslation);
  Synth("shift_more", 500, 5, kTranslation);
  ASSERT_FALSE(HasFailure());
  RunResult train = RunLeapctl(
      dir_, {"train", "--features", dir_.File("chat.npy"), "--lengths",
             dir_.File("chat_len.npy"), "--out", dir_.File("chat.leapr")});
  ASSERT_EQ(train.exit_code, 0) << Describe(train);

  // Readouts: two from the artifact, one cold start.
  RunResult created =
      Ok({"readouts", "create", "chat", "--artifact", dir_.File("chat.leapr")});
  EXPECT_THAT(created.out, StartsWith("created readout chat version 1"));
  Ok({"readouts", "create", "chat2", "--artifact", dir_.File("chat.leapr")});
  RunResult cold = Ok({"readouts", "create", "cold", "--cold-start", "--dim",
                       "64", "--lambda", "1"});
  EXPECT_THAT(cold.out, HasSubstr("dim: 64\n"));
  ASSERT_FALSE(HasFailure());

  nlohmann::json list = Json({"readouts", "list", "--json"});
  std::vector<std::string> names;
  for (const auto& r : list["readouts"]) {
    names.push_back(r["name"]);
    EXPECT_EQ(r["dim"], kDim);
    EXPECT_EQ(r["version"], 1);
  }
  EXPECT_THAT(names, ::testing::UnorderedElementsAre("chat", "chat2", "cold"));
  RunResult get = Ok({"readouts", "get", "cold"});
  EXPECT_THAT(get.out, HasSubstr("name: cold\nversion: 1\n"));

  // An A/B route with a shadow arm, and the route the shift traffic uses.
  Ok({"route", "set", "ab", "--arm", "a=chat:30", "--arm", "b=chat2:70",
      "--shadow", "s=cold"});
  Ok({"route", "set", "shift", "--arm", "chat"});
  nlohmann::json routes = Json({"route", "list", "--json"});
  std::map<std::string, nlohmann::json> by_line;
  for (const auto& r : routes["routes"]) by_line[r["product_line"]] = r;
  ASSERT_EQ(by_line.count("ab"), 1u) << routes.dump();
  const nlohmann::json& ab = by_line["ab"]["arms"];
  ASSERT_EQ(ab.size(), 3u) << ab.dump();
  EXPECT_EQ(ab[0], nlohmann::json({{"name", "a"},
                                   {"readout", "chat"},
                                   {"percent", 30.0},
                                   {"shadow", false}}));
  EXPECT_EQ(ab[1], nlohmann::json({{"name", "b"},
                                   {"readout", "chat2"},
                                   {"percent", 70.0},
                                   {"shadow", false}}));
  EXPECT_EQ(ab[2], nlohmann::json({{"name", "s"},
                                   {"readout", "cold"},
                                   {"percent", nullptr},
                                   {"shadow", true}}));
  RunResult route_text = Ok({"route", "list"});
  EXPECT_THAT(route_text.out, HasSubstr("shadow"));
  EXPECT_THAT(route_text.out, HasSubstr("30%"));

  // Shifted-domain traffic into the chat-trained readout: Spearman rises.
  std::vector<std::string> feed = FeedArgs("shift", "shift");
  feed.insert(feed.end(), {"--report-every", "500"});
  RunResult fed = Ok(feed);
  std::cout << fed.out;
  const std::vector<double> windows = WindowSpearmans(fed.out);
  ASSERT_EQ(windows.size(), 8u) << fed.out;
  const double best_later =
      *std::max_element(windows.begin() + 1, windows.end());
  EXPECT_GT(best_later, windows.front() + 0.05) << fed.out;
  EXPECT_THAT(fed.out, HasSubstr("rows 0-499: "));
  EXPECT_THAT(fed.out, HasSubstr("predicted by chat v1"));
  EXPECT_THAT(fed.out, HasSubstr("completions: learned 4000, skipped 0"));
  EXPECT_THAT(fed.out, HasSubstr("final: readout chat version "));

  nlohmann::json versions = Json({"versions", "chat", "--json", "--limit", "0"});
  ASSERT_GT(versions["versions"].size(), 1u);
  EXPECT_EQ(versions["versions"][0]["cause"], "create");
  EXPECT_EQ(versions["versions"].back()["cause"], "rls");
  RunResult versions_text = Ok({"versions", "chat", "--limit", "0"});
  EXPECT_THAT(versions_text.out, HasSubstr("VERSION"));
  EXPECT_THAT(versions_text.out, HasSubstr(" create "));
  // --limit: only the newest versions.
  nlohmann::json newest = Json({"versions", "chat", "--json", "--limit", "1"});
  ASSERT_EQ(newest["versions"].size(), 1u);
  // The RLS thread may still publish between the calls: the newest version
  // lies between the newest of the listing before and of one after.
  nlohmann::json listed_after = Json({"versions", "chat", "--json", "--limit", "0"});
  const int64_t v_newest = newest["versions"][0]["version"].get<int64_t>();
  EXPECT_GE(v_newest, versions["versions"].back()["version"].get<int64_t>());
  EXPECT_LE(v_newest, listed_after["versions"].back()["version"].get<int64_t>());
  EXPECT_GE(newest["total_versions"].get<size_t>(), versions["versions"].size());
  EXPECT_LE(newest["total_versions"].get<size_t>(), listed_after["versions"].size());

  // Freeze: more traffic is measured, not learned; the version stays.
  RunResult frozen = Ok({"freeze", "chat", "--wait"});
  EXPECT_THAT(frozen.out, StartsWith("froze readout chat at version "));
  nlohmann::json before = Json({"readouts", "get", "chat", "--json"});
  EXPECT_EQ(before["frozen"], true);
  EXPECT_EQ(before["rls_backlog"], 0);
  EXPECT_GT(before["version"].get<int64_t>(), 1);
  EXPECT_EQ(before["completions_learned"], 4000);
  std::vector<std::string> more = FeedArgs("shift_more", "shift");
  more.push_back("--json");
  nlohmann::json fed_frozen = Json(more);
  EXPECT_EQ(fed_frozen["predicted"], 500);
  EXPECT_EQ(fed_frozen["learned"], 0);
  EXPECT_EQ(fed_frozen["skipped"], 500);
  nlohmann::json after = Json({"readouts", "get", "chat", "--json"});
  EXPECT_EQ(after["version"], before["version"]);
  EXPECT_EQ(after["completions_learned"], before["completions_learned"]);

  RunResult resumed = Ok({"resume", "chat"});
  EXPECT_THAT(resumed.out, HasSubstr("frozen: no\n"));

  // Export: the file holds the served version.
  RunResult exported = Ok({"export", "chat", "--out", dir_.File("exp.leapr")});
  EXPECT_THAT(exported.out, HasSubstr("exported readout chat version "));
  nlohmann::json served = Json({"readouts", "get", "chat", "--json"});
  auto artifact = readout::ReadArtifact(dir_.File("exp.leapr"));
  ASSERT_TRUE(artifact.ok()) << artifact.status();
  EXPECT_EQ(artifact->version, served["version"].get<int64_t>());
  EXPECT_EQ(artifact->completions_learned,
            served["completions_learned"].get<int64_t>());
  EXPECT_TRUE(artifact->p.has_value());

  // A/B traffic, then stats with every arm.
  std::vector<std::string> ab_feed = FeedArgs("shift_more", "ab");
  ab_feed.push_back("--json");
  nlohmann::json fed_ab = Json(ab_feed);
  EXPECT_EQ(fed_ab["predicted"], 500);
  nlohmann::json stats = Json({"stats", "--json"});
  const nlohmann::json* arm_a = FindArm(stats, "ab", "a");
  const nlohmann::json* arm_b = FindArm(stats, "ab", "b");
  const nlohmann::json* arm_s = FindArm(stats, "ab", "s");
  const nlohmann::json* arm_shift = FindArm(stats, "shift", "chat");
  ASSERT_TRUE(arm_a && arm_b && arm_s && arm_shift) << stats.dump();
  EXPECT_EQ((*arm_a)["readout"], "chat");
  EXPECT_EQ((*arm_b)["readout"], "chat2");
  EXPECT_EQ((*arm_s)["shadow"], true);
  EXPECT_EQ((*arm_a)["predictions"].get<int64_t>() +
                (*arm_b)["predictions"].get<int64_t>(),
            500);
  EXPECT_GT((*arm_a)["predictions"].get<int64_t>(), 0);
  EXPECT_GT((*arm_b)["predictions"].get<int64_t>(), 0);
  EXPECT_EQ((*arm_s)["predictions"], 500);  // a shadow scores every request
  EXPECT_EQ((*arm_shift)["predictions"], 4500);
  EXPECT_EQ((*arm_shift)["completions"], 4500);
  bool saw_chat = false;
  for (const auto& r : stats["readouts"]) {
    if (r["name"] != "chat") continue;
    saw_chat = true;
    EXPECT_EQ(r["skipped"]["frozen"], 500);
    EXPECT_TRUE(r["spearman"].is_number());
  }
  EXPECT_TRUE(saw_chat) << stats.dump();
  EXPECT_EQ(stats["unknown_completions"], 0);
  EXPECT_EQ(stats["live_requests"], 0);
  RunResult stats_text = Ok({"stats", "chat"});
  EXPECT_THAT(stats_text.out, HasSubstr("readout chat: version "));
  EXPECT_THAT(stats_text.out, ::testing::Not(HasSubstr("readout cold:")));

  // Clean-up through the CLI: a readout in use cannot go.
  RunResult in_use = Ctl({"readouts", "delete", "cold"});
  EXPECT_EQ(in_use.exit_code, 1) << Describe(in_use);
  EXPECT_THAT(in_use.err, HasSubstr("FAILED_PRECONDITION: "));
  Ok({"route", "delete", "ab"});
  Ok({"readouts", "delete", "cold"});
  nlohmann::json left = Json({"readouts", "list", "--json"});
  EXPECT_EQ(left["readouts"].size(), 2u) << left.dump();
}

TEST_F(LeapctlServerTest, ErrorsExitWithCodesAndChangeNothing) {
  // leapd's errors: exit 1, "leapctl CMD: error: CODE: message".
  RunResult r = Ctl({"readouts", "get", "nope"});
  EXPECT_EQ(r.exit_code, 1) << Describe(r);
  EXPECT_EQ(r.err,
            "leapctl readouts get: error: NOT_FOUND: unknown readout "
            "'nope'\n");
  EXPECT_EQ(r.out, "");
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{
           {"versions", "nope"},
           {"export", "nope", "--out", dir_.File("x.leapr")},
           {"freeze", "nope"},
           {"stats", "nope"},
           {"route", "delete", "nope"}}) {
    RunResult e = Ctl(args);
    EXPECT_EQ(e.exit_code, 1) << Describe(e);
    EXPECT_THAT(e.err, HasSubstr("error: NOT_FOUND: ")) << args[0];
  }
  EXPECT_FALSE(std::filesystem::exists(dir_.File("x.leapr")));

  // An unreachable server.
  const std::string nowhere = "unix://" + dir_.File("no-leapd.sock");
  RunResult down = RunLeapctl(dir_, {"readouts", "list", "--server", nowhere});
  EXPECT_EQ(down.exit_code, 1) << Describe(down);
  EXPECT_THAT(down.err, StartsWith("leapctl readouts list: error: UNAVAILABLE: "
                                   "cannot reach leapd at " +
                                   nowhere));

  // $LEAP_SERVER stands in for --server (the runbook exports it); --server
  // wins over it.
  setenv("LEAP_SERVER", address_.c_str(), 1);
  RunResult by_env = RunLeapctl(dir_, {"readouts", "list"});
  EXPECT_EQ(by_env.exit_code, 0) << Describe(by_env);
  setenv("LEAP_SERVER", nowhere.c_str(), 1);
  RunResult flag_wins =
      RunLeapctl(dir_, {"readouts", "list", "--server", address_});
  EXPECT_EQ(flag_wins.exit_code, 0) << Describe(flag_wins);
  RunResult env_down = RunLeapctl(dir_, {"readouts", "list"});
  EXPECT_EQ(env_down.exit_code, 1) << Describe(env_down);
  EXPECT_THAT(env_down.err, HasSubstr("cannot reach leapd at " + nowhere));
  unsetenv("LEAP_SERVER");

  // Usage errors: exit 2, nothing sent.
  Ok({"readouts", "create", "cold", "--cold-start", "--dim", "64", "--lambda",
      "1"});
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{
           {"route", "set", "p", "--arm", "a=cold", "--arm", "b=cold:50"},
           {"route", "set", "p", "--arm", "a=cold:x"},
           {"route", "set", "p", "--arm", "a=cold:150"},
           {"route", "set", "p", "--arm", "=cold:100"},
           {"route", "set", "p", "--arm", "a=cold:100", "--shadow", "s"},
           {"route", "set", "p"},
           {"route", "set", "--arm", "a=cold:100"},
           {"route", "set", "p", "--default", "--arm", "a=cold:100"},
           {"readouts", "create", "x", "--cold-start", "--artifact", "a"},
           {"readouts", "create", "x", "--cold-start", "--dim", "64"},
           {"readouts", "create", "x", "--artifact", "a", "--dim", "64"},
           {"readouts", "get"},
           {"readouts", "bogus"},
           {"export", "cold"},
           {"feed", "--features", "f.npy"},
           {"bench", "--dtype", "int8"}}) {
    RunResult u = Ctl(args);
    EXPECT_EQ(u.exit_code, 2) << Describe(u);
    EXPECT_THAT(u.err, HasSubstr("error: ")) << Describe(u);
  }
  RunResult bad_arm = Ctl({"route", "set", "p", "--arm", "a=cold:x"});
  EXPECT_EQ(bad_arm.err,
            "leapctl route set: error: --arm 'a=cold:x': percent 'x' is not a "
            "number (expected NAME=READOUT:PERCENT) (see 'leapctl route set "
            "--help')\n");
  nlohmann::json routes = Json({"route", "list", "--json"});
  EXPECT_TRUE(routes["routes"].empty()) << routes.dump();
  nlohmann::json list = Json({"readouts", "list", "--json"});
  EXPECT_EQ(list["readouts"].size(), 1u) << list.dump();

  // A semantic error found by leapd is a failure (exit 1), not usage.
  RunResult sum =
      Ctl({"route", "set", "p", "--arm", "a=cold:40", "--arm", "b=cold:40"});
  EXPECT_EQ(sum.exit_code, 1) << Describe(sum);
  EXPECT_THAT(sum.err, HasSubstr("INVALID_ARGUMENT: "));

  // --help documents every flag of a command and exits 0.
  RunResult help = RunLeapctl(dir_, {"route", "set", "--help"});
  EXPECT_EQ(help.exit_code, 0);
  for (const char* flag :
       {"PRODUCT_LINE", "--arm NAME=READOUT:PERCENT", "--shadow NAME=READOUT",
        "--default", "--server ADDR", "--timeout SECONDS"}) {
    EXPECT_THAT(help.out, HasSubstr(flag));
  }
  RunResult top = RunLeapctl(dir_, {"--help"});
  for (const char* cmd : {"readouts", "versions", "export", "freeze", "resume",
                          "route", "stats", "bench", "feed"}) {
    EXPECT_THAT(top.out, HasSubstr(std::string("  ") + cmd));
  }
}

TEST_F(LeapctlServerTest, BenchReportsThroughputAndLatency) {
  RunResult r = Ok({"bench", "--seconds", "1", "--dim", "256",
                    "--latency-requests", "200", "--json"});
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << Describe(r);
  EXPECT_GT(j["predictions_per_s"].get<double>(), 0);
  EXPECT_GT(j["predictions"].get<int64_t>(), 0);
  EXPECT_EQ(j["errors"], 0);
  EXPECT_EQ(j["dim"], 256);
  EXPECT_EQ(j["latency_samples"], 200);
  const double p50 = j["latency_p50_us"], p99 = j["latency_p99_us"],
               max = j["latency_max_us"];
  EXPECT_GT(p50, 0);
  EXPECT_LE(p50, p99);
  EXPECT_LE(p99, max);
  EXPECT_GE(j["machine"]["cores"].get<int64_t>(), 1);
  EXPECT_TRUE(j["machine"]["cpu_model"].is_string());
  EXPECT_GE(j["client_cpu_cores"].get<double>(), 0);
  // What the bench created is gone again.
  nlohmann::json list = Json({"readouts", "list", "--json"});
  EXPECT_TRUE(list["readouts"].empty()) << list.dump();
  nlohmann::json routes = Json({"route", "list", "--json"});
  EXPECT_TRUE(routes["routes"].empty()) << routes.dump();
}

// Snapshot before a rollout, learn, roll back: the storage commands of the
// runbook, each printing what it did and failing with the gRPC code.
TEST_F(LeapctlServerTest, SnapshotRollbackImport) {
  Synth("src", 2000, 11, kChat);
  Synth("more", 600, 12, kTranslation);
  ASSERT_FALSE(HasFailure());
  RunResult train = RunLeapctl(
      dir_, {"train", "--features", dir_.File("src.npy"), "--lengths",
             dir_.File("src_len.npy"), "--out", dir_.File("r.leapr"),
             "--lambda", "20"});
  ASSERT_EQ(train.exit_code, 0) << Describe(train);
  RunResult imported = Ok({"import", "r", "--artifact", dir_.File("r.leapr")});
  EXPECT_THAT(imported.out, HasSubstr("created readout r version 1"));
  Ok({"route", "set", "--default", "--arm", "r"});
  RunResult snap = Ok({"snapshot", "create", "r", "before-rollout"});
  EXPECT_THAT(snap.out, HasSubstr("before-rollout"));
  EXPECT_THAT(snap.out, HasSubstr("version 1"));
  Ok({"export", "r", "--out", dir_.File("at_snapshot.leapr")});
  Ok({"feed", "--features", dir_.File("more.npy"), "--lengths",
      dir_.File("more_len.npy")});
  const nlohmann::json moved = Json({"readouts", "get", "r", "--json"});
  ASSERT_GT(moved["version"].get<int64_t>(), 1);
  RunResult list = Ok({"snapshot", "list", "r"});
  EXPECT_THAT(list.out, HasSubstr("1 snapshot(s) of readout r"));
  EXPECT_THAT(list.out, HasSubstr("before-rollout"));
  RunResult rb = Ok({"rollback", "r", "before-rollout"});
  EXPECT_THAT(rb.out, HasSubstr("rolled readout r back to snapshot before-rollout as version"));
  const nlohmann::json after = Json({"readouts", "get", "r", "--json"});
  EXPECT_GT(after["version"].get<int64_t>(), moved["version"].get<int64_t>());
  // theta and P are the snapshot's, bit for bit.
  Ok({"export", "r", "--out", dir_.File("after_rollback.leapr")});
  auto a = readout::ReadArtifact(dir_.File("at_snapshot.leapr"));
  auto b = readout::ReadArtifact(dir_.File("after_rollback.leapr"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->theta, b->theta);
  ASSERT_TRUE(a->p.has_value() && b->p.has_value());
  EXPECT_EQ(std::memcmp(a->p->data(), b->p->data(),
                        a->p->n() * a->p->ld() * sizeof(float)), 0);
  // Failures carry the code and exit 1; usage errors exit 2.
  RunResult missing = Ctl({"rollback", "r", "no-such-label"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("NOT_FOUND"));
  EXPECT_EQ(Ctl({"snapshot", "create", "r"}).exit_code, 2);
  EXPECT_EQ(Ctl({"snapshot", "list", "nope"}).exit_code, 1);
}

}  // namespace
}  // namespace leap::leapctl_test
