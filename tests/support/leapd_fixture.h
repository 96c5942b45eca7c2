// A real leapd child process for gtest end-to-end tests: a fresh temp
// directory per test (ScopedTempDir), and a started leapd with its channel and stubs. Header
// only (it reports failures to gtest); the leapd binary is LEAPD_PATH, which
// leap_add_process_test(... TOOLS leapd) compiles in.
#ifndef LEAP_TESTS_SUPPORT_LEAPD_FIXTURE_H_
#define LEAP_TESTS_SUPPORT_LEAPD_FIXTURE_H_

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "readout/artifact.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::testing {

// A synthetic request: features x ~ N(0, I) and an output length whose
// square root is linear in the first 16 features (18 + 0.8 * sum), clamped
// to [1, 4000] tokens.
struct SyntheticReq {
  std::string id;
  std::vector<float> x;
  int64_t tokens;
};

inline SyntheticReq MakeSyntheticReq(const std::string& id, int64_t dim,
                                     std::mt19937_64& rng) {
  std::normal_distribution<float> n01;
  SyntheticReq r{id, std::vector<float>(dim), 0};
  double s = 18;
  for (int64_t k = 0; k < dim; ++k) {
    r.x[k] = n01(rng);
    if (k < 16) s += 0.8 * r.x[k];
  }
  r.tokens = std::clamp<int64_t>(std::llround(s * s), 1, 4000);
  return r;
}

// The little-endian float32 bytes of `x` (FeatureRecord.features).
inline std::string FloatBytes(const std::vector<float>& x) {
  return std::string(reinterpret_cast<const char*>(x.data()),
                     x.size() * sizeof(float));
}

// Creates readout `name` from a cold start (dim, lambda) and routes 100% of
// the traffic to it (one arm, no arm name). Failures go to gtest; returns
// whether both calls succeeded, so ASSERT_TRUE(CreateRoutedReadout(...))
// stops the test there.
inline bool CreateRoutedReadout(leap::v1::Admin::Stub& admin, int64_t dim,
                                double lambda, const std::string& name = "r") {
  {
    grpc::ClientContext ctx;
    leap::v1::CreateReadoutRequest req;
    req.set_name(name);
    req.mutable_cold_start()->set_dim(dim);
    req.mutable_cold_start()->set_lambda(lambda);
    leap::v1::ReadoutInfo info;
    const grpc::Status st = admin.CreateReadout(&ctx, req, &info);
    if (!st.ok()) {
      ADD_FAILURE() << "CreateReadout " << name << ": " << st.error_message();
      return false;
    }
  }
  grpc::ClientContext ctx;
  leap::v1::SetRouteRequest route;
  leap::v1::Arm* arm = route.mutable_route()->add_arms();
  arm->set_readout(name);
  arm->set_percent(100);
  leap::v1::Route out;
  const grpc::Status st = admin.SetRoute(&ctx, route, &out);
  if (!st.ok()) {
    ADD_FAILURE() << "SetRoute 100% " << name << ": " << st.error_message();
    return false;
  }
  return true;
}

// One leapd process (see StartLeapd: port 0 listeners, waits for ready).
struct Leapd {
  std::unique_ptr<Process> proc;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<leap::v1::Admin::Stub> admin;
  std::unique_ptr<leap::v1::Predictor::Stub> predictor;

#ifdef LEAPD_PATH
  bool Start(const std::vector<std::string>& args) {
    return Start(LEAPD_PATH, args);
  }
#endif
  bool Start(const std::string& leapd_path,
             const std::vector<std::string>& args) {
    auto p = StartLeapd(leapd_path, args, &address);
    if (!p.ok()) {
      ADD_FAILURE() << p.status();
      return false;
    }
    proc = std::move(*p);
    Connect();
    return true;
  }
  // (Re)makes the channel and stubs for `address`.
  void Connect() {
    channel = MakeChannel(address);
    admin = leap::v1::Admin::NewStub(channel);
    predictor = leap::v1::Predictor::NewStub(channel);
  }
  // SIGTERM; expects a clean exit.
  void Stop() {
    proc->Signal(SIGTERM);
    EXPECT_EQ(proc->Wait(), 0);
  }
  // SIGKILL (no drain, no final flush); reaps it and drops the process.
  void Kill9() {
    proc->Signal(SIGKILL);
    proc->Wait();
    proc.reset();
  }
  // host:port of the metrics listener ("" when not announced).
  std::string MetricsAddress() const {
    const std::string prefix = "metrics on http://";
    for (const std::string& l : proc->lines()) {
      if (l.rfind(prefix, 0) == 0) {
        std::string rest = l.substr(prefix.size());
        return rest.substr(0, rest.find('/'));
      }
    }
    return "";
  }
  // The /metrics page ("" when unavailable).
  std::string MetricsText() const {
    const std::string hp = MetricsAddress();
    if (hp.empty()) return "";
    auto body = HttpGet(hp, "/metrics");
    return body.ok() ? *body : "";
  }
  leap::v1::ReadoutInfo Info(const std::string& name = "r") {
    grpc::ClientContext ctx;
    leap::v1::GetReadoutRequest req;
    req.set_name(name);
    leap::v1::ReadoutInfo info;
    grpc::Status s = admin->GetReadout(&ctx, req, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return info;
  }
  leap::v1::ReadoutStats Stats(const std::string& name = "r") {
    grpc::ClientContext ctx;
    leap::v1::GetStatsRequest req;
    req.set_readout(name);
    leap::v1::StatsResponse resp;
    grpc::Status s = admin->GetStats(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.readouts_size(), 1);
    return resp.readouts_size() == 1 ? resp.readouts(0)
                                     : leap::v1::ReadoutStats();
  }
  // The readout's state as ExportReadout gives it (empty on failure).
  readout::ReadoutState Export(const std::string& name = "r") {
    grpc::ClientContext ctx;
    leap::v1::ExportReadoutRequest req;
    req.set_name(name);
    leap::v1::ExportReadoutResponse resp;
    grpc::Status st = admin->ExportReadout(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    if (!st.ok()) return readout::ReadoutState();
    auto state = readout::ParseArtifact(resp.artifact(), "export");
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? std::move(*state) : readout::ReadoutState();
  }
};

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_LEAPD_FIXTURE_H_
