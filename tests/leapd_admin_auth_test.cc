// Admin security end to end: a real leapd (TCP port 0 and a unix socket)
// started with --admin_token_file.
//  - Every Admin RPC over TCP without the bearer token, with another
//    scheme, or with a wrong token gets UNAUTHENTICATED with a clear
//    message (and counts in leap_request_errors_total); the right token
//    passes.
//  - Over the unix socket Admin needs no token.
//  - Predictor and the health service over TCP are not affected.
//  - leapctl: without a token -> exit 1 naming UNAUTHENTICATED; with
//    --token-file or $LEAP_ADMIN_TOKEN_FILE -> exit 0; an unreadable token
//    file -> exit 1 naming it; over the unix socket no token is needed.
//  - leapd refuses to start with a missing or empty token file.
//  - leapctl route apply --file: the routes of a file, all or nothing.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/leapctl_test_util.h"
#include "tests/support/process.h"

#ifndef LEAPD_PATH
#error "LEAPD_PATH must name the leapd binary"
#endif

namespace leap::leapctl_test {
namespace {

namespace pb = ::leap::v1;
using ::testing::HasSubstr;

constexpr char kToken[] = "0123456789abcdef-admin-token";
constexpr int kDim = 8;

class AdminAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.File("admin.token"), std::string(kToken) + "\n");
    WriteFile(dir_.File("wrong.token"), "not-the-token\n");
    unix_address_ = "unix://" + dir_.File("leapd.sock");
    auto p = testing::StartLeapd(
        LEAPD_PATH,
        {"--listen=127.0.0.1:0", "--listen=" + unix_address_,
         "--metrics_listen=127.0.0.1:0",
         "--admin_token_file=" + dir_.File("admin.token")},
        &tcp_address_);
    ASSERT_TRUE(p.ok()) << p.status();
    leapd_ = std::move(*p);
    for (const std::string& l : leapd_->lines()) {
      const std::string prefix = "metrics on http://";
      if (l.rfind(prefix, 0) == 0) {
        metrics_address_ =
            l.substr(prefix.size(), l.rfind("/metrics") - prefix.size());
      }
    }
    ASSERT_FALSE(metrics_address_.empty());
    ASSERT_THAT(tcp_address_, ::testing::StartsWith("127.0.0.1:"));

    // A readout serving the default route, made over the unix socket.
    auto admin = AdminStub(unix_address_);
    grpc::ClientContext ctx;
    pb::CreateReadoutRequest req;
    req.set_name("r");
    req.mutable_cold_start()->set_dim(kDim);
    req.mutable_cold_start()->set_lambda(1.0);
    pb::ReadoutInfo info;
    grpc::Status s = admin->CreateReadout(&ctx, req, &info);
    ASSERT_TRUE(s.ok()) << s.error_message();
    grpc::ClientContext ctx2;
    pb::SetRouteRequest route;
    pb::Arm* arm = route.mutable_route()->add_arms();
    arm->set_name("r");
    arm->set_readout("r");
    arm->set_percent(100);
    pb::Route stored;
    s = admin->SetRoute(&ctx2, route, &stored);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  void TearDown() override {
    if (leapd_ == nullptr) return;
    leapd_->Signal(SIGTERM);
    const int status = leapd_->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }

  static std::unique_ptr<pb::Admin::Stub> AdminStub(const std::string& addr) {
    return pb::Admin::NewStub(
        grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  }

  // A client context with a deadline and, when non-empty, this
  // authorization metadata.
  static void Prepare(grpc::ClientContext* ctx, const std::string& auth) {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(10));
    if (!auth.empty()) ctx->AddMetadata("authorization", auth);
  }

  // Every Admin method, called with an empty request and `auth`; returns
  // the statuses by method name.
  std::vector<std::pair<std::string, grpc::Status>> CallEveryAdminMethod(
      pb::Admin::Stub& stub, const std::string& auth) {
    std::vector<std::pair<std::string, grpc::Status>> out;
    auto call = [&](const std::string& name, auto method, auto request,
                    auto response) {
      grpc::ClientContext ctx;
      Prepare(&ctx, auth);
      out.emplace_back(name, (stub.*method)(&ctx, request, &response));
    };
    call("ListReadouts", &pb::Admin::Stub::ListReadouts,
         pb::ListReadoutsRequest(), pb::ListReadoutsResponse());
    call("GetReadout", &pb::Admin::Stub::GetReadout, pb::GetReadoutRequest(),
         pb::ReadoutInfo());
    call("CreateReadout", &pb::Admin::Stub::CreateReadout,
         pb::CreateReadoutRequest(), pb::ReadoutInfo());
    call("DeleteReadout", &pb::Admin::Stub::DeleteReadout,
         pb::DeleteReadoutRequest(), pb::DeleteReadoutResponse());
    call("ListVersions", &pb::Admin::Stub::ListVersions,
         pb::ListVersionsRequest(), pb::ListVersionsResponse());
    call("ExportReadout", &pb::Admin::Stub::ExportReadout,
         pb::ExportReadoutRequest(), pb::ExportReadoutResponse());
    call("SetAdaptation", &pb::Admin::Stub::SetAdaptation,
         pb::SetAdaptationRequest(), pb::ReadoutInfo());
    call("SetRoute", &pb::Admin::Stub::SetRoute, pb::SetRouteRequest(),
         pb::Route());
    call("ListRoutes", &pb::Admin::Stub::ListRoutes, pb::ListRoutesRequest(),
         pb::ListRoutesResponse());
    call("DeleteRoute", &pb::Admin::Stub::DeleteRoute, pb::DeleteRouteRequest(),
         pb::DeleteRouteResponse());
    call("GetStats", &pb::Admin::Stub::GetStats, pb::GetStatsRequest(),
         pb::StatsResponse());
    call("CreateSnapshot", &pb::Admin::Stub::CreateSnapshot,
         pb::CreateSnapshotRequest(), pb::SnapshotInfo());
    call("ListSnapshots", &pb::Admin::Stub::ListSnapshots,
         pb::ListSnapshotsRequest(), pb::ListSnapshotsResponse());
    call("Rollback", &pb::Admin::Stub::Rollback, pb::RollbackRequest(),
         pb::RollbackResponse());
    return out;
  }

  RunResult Ctl(std::vector<std::string> args, const std::string& server) {
    args.push_back("--server");
    args.push_back(server);
    return RunLeapctl(dir_, args);
  }

  ScratchDir dir_;
  std::string tcp_address_, unix_address_, metrics_address_;
  std::unique_ptr<testing::Process> leapd_;
};

TEST_F(AdminAuthTest, EveryAdminRpcOverTcpNeedsTheToken) {
  auto stub = AdminStub(tcp_address_);
  struct Case {
    std::string auth, message;
  };
  const std::vector<Case> refused = {
      {"", "need the metadata 'authorization: Bearer <token>'"},
      {std::string("Basic ") + kToken, "is not 'Bearer <token>'"},
      {"Bearer not-the-token", "does not match"},
      {std::string("Bearer ") + kToken + "x", "does not match"},
  };
  for (const Case& c : refused) {
    for (const auto& [name, s] : CallEveryAdminMethod(*stub, c.auth)) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << name << " with '" << c.auth << "': " << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << name;
    }
  }
  // The right token: no call is refused for authentication (the empty
  // requests are refused for what they are, e.g. NOT_FOUND).
  for (const auto& [name, s] :
       CallEveryAdminMethod(*stub, std::string("Bearer ") + kToken)) {
    EXPECT_NE(s.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << name << ": " << s.error_message();
  }
  grpc::ClientContext ctx;
  Prepare(&ctx, std::string("bearer ") + kToken);
  pb::ListReadoutsResponse list;
  grpc::Status s = stub->ListReadouts(&ctx, pb::ListReadoutsRequest(), &list);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(list.readouts_size(), 1);
  EXPECT_EQ(list.readouts(0).name(), "r");

  // The refusals are counted: 4 cases x 14 methods.
  auto metrics = testing::HttpGet(metrics_address_, "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_THAT(
      *metrics,
      HasSubstr("leap_request_errors_total{code=\"UNAUTHENTICATED\"} 56"));
}

TEST_F(AdminAuthTest, UnixSocketIsTrusted) {
  auto stub = AdminStub(unix_address_);
  grpc::ClientContext ctx;
  Prepare(&ctx, "");
  pb::ListRoutesResponse routes;
  grpc::Status s = stub->ListRoutes(&ctx, pb::ListRoutesRequest(), &routes);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(routes.routes_size(), 1);
  // (The empty DeleteRoute request deletes the default route: it ran.)
  for (const auto& [name, st] : CallEveryAdminMethod(*stub, "")) {
    EXPECT_NE(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << name << ": " << st.error_message();
  }
}

TEST_F(AdminAuthTest, PredictorAndHealthOverTcpNeedNoToken) {
  auto channel =
      grpc::CreateChannel(tcp_address_, grpc::InsecureChannelCredentials());
  auto predictor = pb::Predictor::NewStub(channel);
  pb::PredictRequest req;
  req.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
  req.mutable_record()->set_request_id("req-1");
  std::vector<float> x(kDim, 0.5f);
  req.mutable_record()->set_features(
      std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  pb::PredictResponse resp;
  grpc::ClientContext ctx;
  Prepare(&ctx, "");
  grpc::Status s = predictor->Predict(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.prediction().readout(), "r");
  EXPECT_GE(resp.prediction().predicted_tokens(), 1.0);

  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext hctx;
  Prepare(&hctx, "");
  grpc::health::v1::HealthCheckResponse h;
  s = health->Check(&hctx, grpc::health::v1::HealthCheckRequest(), &h);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(h.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(AdminAuthTest, LeapctlTokenFile) {
  RunResult none = Ctl({"readouts", "list"}, tcp_address_);
  EXPECT_EQ(none.exit_code, 1) << Describe(none);
  EXPECT_THAT(none.err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(none.err, HasSubstr("--token-file"));

  RunResult wrong =
      Ctl({"readouts", "list", "--token-file", dir_.File("wrong.token")},
          tcp_address_);
  EXPECT_EQ(wrong.exit_code, 1) << Describe(wrong);
  EXPECT_THAT(wrong.err, HasSubstr("UNAUTHENTICATED"));

  RunResult missing =
      Ctl({"readouts", "list", "--token-file", dir_.File("absent.token")},
          tcp_address_);
  EXPECT_EQ(missing.exit_code, 1) << Describe(missing);
  EXPECT_THAT(missing.err, HasSubstr("absent.token"));

  RunResult right =
      Ctl({"readouts", "list", "--token-file", dir_.File("admin.token")},
          tcp_address_);
  EXPECT_EQ(right.exit_code, 0) << Describe(right);
  EXPECT_THAT(right.out, HasSubstr("\nr "));

  // Every command that talks to Admin takes the flag.
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{
           {"readouts", "get", "r"},
           {"versions", "r"},
           {"stats", "r"},
           {"route", "list"},
           {"snapshot", "create", "r", "before"},
           {"snapshot", "list", "r"},
           {"rollback", "r", "before"},
           {"freeze", "r"},
           {"resume", "r"},
           {"export", "r", "--out", dir_.File("r.leapr")},
           {"readouts", "create", "r2", "--artifact", dir_.File("r.leapr")},
           {"readouts", "delete", "r2"}}) {
    std::vector<std::string> with = args;
    with.push_back("--token-file");
    with.push_back(dir_.File("admin.token"));
    RunResult ok = Ctl(with, tcp_address_);
    EXPECT_EQ(ok.exit_code, 0) << args[0] << ":\n" << Describe(ok);
    RunResult refused = Ctl(args, tcp_address_);
    EXPECT_EQ(refused.exit_code, 1) << args[0] << ":\n" << Describe(refused);
    EXPECT_THAT(refused.err, HasSubstr("UNAUTHENTICATED")) << args[0];
  }

  // $LEAP_ADMIN_TOKEN_FILE stands for --token-file.
  ::setenv("LEAP_ADMIN_TOKEN_FILE", dir_.File("admin.token").c_str(), 1);
  RunResult env = Ctl({"route", "list", "--json"}, tcp_address_);
  ::unsetenv("LEAP_ADMIN_TOKEN_FILE");
  EXPECT_EQ(env.exit_code, 0) << Describe(env);

  // The unix socket needs none.
  RunResult local = Ctl({"readouts", "list"}, unix_address_);
  EXPECT_EQ(local.exit_code, 0) << Describe(local);
}

TEST_F(AdminAuthTest, RouteApplyFile) {
  const std::string token = dir_.File("admin.token");
  ASSERT_EQ(Ctl({"readouts", "create", "r2", "--cold-start", "--dim", "8",
                 "--lambda", "1", "--token-file", token},
                tcp_address_)
                .exit_code,
            0);
  const nlohmann::json routes = {
      {"routes",
       {{{"product_line", "chat"},
         {"arms",
          {{{"name", "a"}, {"readout", "r"}, {"percent", 90.0}},
           {{"name", "b"}, {"readout", "r2"}, {"percent", 10.0}},
           {{"name", "s"}, {"readout", "r2"}, {"shadow", true}}}}},
        {{"product_line", ""},
         {"arms", {{{"name", "r"}, {"readout", "r"}, {"percent", 100}}}}}}}};
  WriteFile(dir_.File("routes.json"), routes.dump(2));
  RunResult applied = Ctl({"route", "apply", "--file", dir_.File("routes.json"),
                           "--token-file", token},
                          tcp_address_);
  ASSERT_EQ(applied.exit_code, 0) << Describe(applied);
  EXPECT_THAT(applied.out, HasSubstr("applied 2 route(s)"));

  // What `route list --json` prints applies back unchanged.
  RunResult listed = Ctl({"route", "list", "--json"}, unix_address_);
  ASSERT_EQ(listed.exit_code, 0) << Describe(listed);
  nlohmann::json got = nlohmann::json::parse(listed.out);
  ASSERT_EQ(got["routes"].size(), 2u) << got.dump();
  WriteFile(dir_.File("listed.json"), listed.out);
  RunResult again = Ctl({"route", "apply", "--file", dir_.File("listed.json")},
                        unix_address_);
  EXPECT_EQ(again.exit_code, 0) << Describe(again);
  RunResult relisted = Ctl({"route", "list", "--json"}, unix_address_);
  EXPECT_EQ(nlohmann::json::parse(relisted.out), got);

  // A route naming an unknown readout: nothing changes.
  nlohmann::json bad = routes;
  bad["routes"][1]["arms"][0]["readout"] = "nope";
  WriteFile(dir_.File("bad.json"), bad.dump());
  RunResult refused =
      Ctl({"route", "apply", "--file", dir_.File("bad.json")}, unix_address_);
  EXPECT_EQ(refused.exit_code, 1) << Describe(refused);
  EXPECT_THAT(refused.err, HasSubstr("'nope'"));
  EXPECT_EQ(nlohmann::json::parse(
                Ctl({"route", "list", "--json"}, unix_address_).out),
            got);

  // Not JSON / no routes: usage errors.
  WriteFile(dir_.File("junk.json"), "{\"routes\": [{\"arms\": []}]}");
  RunResult junk =
      Ctl({"route", "apply", "--file", dir_.File("junk.json")}, unix_address_);
  EXPECT_EQ(junk.exit_code, 2) << Describe(junk);
  EXPECT_THAT(junk.err, HasSubstr("routes[0]"));
}

TEST(AdminAuthStartTest, RefusesMissingOrEmptyTokenFile) {
  ScratchDir dir;
  WriteFile(dir.File("empty.token"), "\n");
  for (const std::string& file :
       {dir.File("absent.token"), dir.File("empty.token")}) {
    auto p = testing::Process::Start(
        {LEAPD_PATH, "--listen=127.0.0.1:0",
         "--metrics_listen=", "--admin_token_file=" + file});
    ASSERT_TRUE(p.ok()) << p.status();
    // leapd exits before it listens: stdout ends without the line.
    EXPECT_EQ(
        (*p)->WaitForLine("listening on ", absl::Seconds(30)).status().code(),
        absl::StatusCode::kNotFound)
        << file;
    const int status = (*p)->Wait();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1)
        << file << ": " << status;
  }
}

}  // namespace
}  // namespace leap::leapctl_test
