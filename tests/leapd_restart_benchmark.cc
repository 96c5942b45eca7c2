// Restart-to-ready of leapd with one d = 4,096 readout and a non-empty
// feedback log: from fork/exec until grpc.health.v1 reports SERVING. Also
// prints the checkpoint write time and bytes per checkpoint (from /metrics).
//   leapd_restart_benchmark [--restarts=5] [--dim=4096]
// A benchmark program, not a ctest test. Release build.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/bench.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

namespace {

double MetricValue(const std::string& body, const std::string& prefix) {
  size_t at = body.find("\n" + prefix);
  if (at == std::string::npos) return NAN;
  at = body.find(' ', at + 1 + prefix.size());
  return std::stod(body.substr(at + 1));
}

std::string Field(const std::vector<std::string>& lines, const std::string& prefix) {
  for (const auto& l : lines) {
    if (l.rfind(prefix, 0) == 0) return l.substr(prefix.size());
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  int restarts = 5;
  int64_t dim = 4096;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--restarts=", 11) == 0) restarts = std::atoi(argv[i] + 11);
    if (std::strncmp(argv[i], "--dim=", 6) == 0) dim = std::atoll(argv[i] + 6);
  }
  const leap::testing::ScopedTempDir tmp("leapd-restart");
  const std::string dir = tmp.File("data");
  const std::vector<std::string> args = {"--data_dir=" + dir, "--rls_batch=8", "--rls_batch_max=8",
                                         "--checkpoint_every_batches=4"};
  std::string addr;
  auto p = leap::testing::StartLeapd(LEAPD_PATH, args, &addr);
  if (!p.ok()) {
    std::fprintf(stderr, "%s\n", std::string(p.status().message()).c_str());
    return 1;
  }
  auto channel = leap::testing::MakeChannel(addr);
  auto admin = pb::Admin::NewStub(channel);
  {
    grpc::ClientContext ctx;
    pb::CreateReadoutRequest req;
    req.set_name("r");
    req.mutable_cold_start()->set_dim(dim);
    req.mutable_cold_start()->set_lambda(1.0);
    pb::ReadoutInfo info;
    const auto t0 = Clock::now();
    if (!admin->CreateReadout(&ctx, req, &info).ok()) return 1;
    std::printf("create (writes the first %lld MiB checkpoint): %.0f ms\n",
                static_cast<long long>((dim + 1) * (dim + 1) * 4 >> 20),
                std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    grpc::ClientContext rctx;
    pb::SetRouteRequest route;
    route.mutable_route()->add_arms()->set_readout("r");
    route.mutable_route()->mutable_arms(0)->set_percent(100);
    pb::Route out;
    admin->SetRoute(&rctx, route, &out);
  }
  // 8 batches -> 2 checkpoints, then 3 more completions left in the log.
  std::mt19937 rng(1);
  std::normal_distribution<float> n01;
  {
    leap::testing::EngineStream e(channel, dim);
    for (int i = 0; i < 67; ++i) {
      pb::EngineMessage f;
      auto* r = f.mutable_features()->add_records();
      r->set_request_id("c-" + std::to_string(i));
      std::vector<float> x(dim);
      for (auto& v : x) v = n01(rng);
      r->set_features(std::string(reinterpret_cast<const char*>(x.data()), dim * 4));
      e.Call(f);
      pb::EngineMessage c;
      auto* cc = c.mutable_completions()->add_completions();
      cc->set_request_id(r->request_id());
      cc->set_output_tokens(100 + i);
      cc->set_reason(pb::FINISH_REASON_STOP);
      e.Call(c);
    }
  }
  // Let the RLS thread and the checkpoints finish: follow the versions.
  {
    grpc::ClientContext ctx;
    pb::WatchReadoutRequest req;
    req.set_readout("r");
    auto stub = pb::Predictor::NewStub(channel);
    auto w = stub->WatchReadout(&ctx, req);
    pb::ReadoutVersion v;
    while (w->Read(&v) && v.completions_learned() < 67) {
    }
    ctx.TryCancel();
  }
  std::string metrics_addr = Field((*p)->lines(), "metrics on http://");
  metrics_addr = metrics_addr.substr(0, metrics_addr.find("/metrics"));
  // Checkpoints are written on their own thread: wait for the second one.
  std::string body;
  for (int tries = 0; tries < 200; ++tries) {
    body = leap::testing::HttpGet(metrics_addr, "/metrics").value_or("");
    if (MetricValue(body, "leap_checkpoint_seconds_count{readout=\"r\"}") >= 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // poll /metrics
  }
  const double ck_n = MetricValue(body, "leap_checkpoint_seconds_count{readout=\"r\"}");
  const double ck_s = MetricValue(body, "leap_checkpoint_seconds_sum{readout=\"r\"}");
  std::printf("checkpoints: %.0f written, %.0f ms each on average, %.1f MiB payload each\n",
              ck_n, 1e3 * ck_s / ck_n,
              MetricValue(body, "leap_checkpoint_bytes{readout=\"r\"}") / (1 << 20));
  (*p)->Signal(SIGKILL);
  (*p)->Wait();
  p->reset();

  std::vector<double> ready_ms;
  for (int r = 0; r < restarts; ++r) {
    const auto t0 = Clock::now();
    std::vector<std::string> argv = {LEAPD_PATH, "--listen=127.0.0.1:0",
                                     "--metrics_listen=127.0.0.1:0"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto proc = leap::testing::Process::Start(argv);
    auto a = (*proc)->WaitForLine("listening on ", absl::Seconds(60));
    if (!a.ok()) return 1;
    auto health = grpc::health::v1::Health::NewStub(leap::testing::MakeChannel(*a));
    for (;;) {
      grpc::ClientContext ctx;
      grpc::health::v1::HealthCheckResponse resp;
      if (health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
          resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // probe interval
    }
    ready_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (r == 0) {
      std::printf("recovery: %s\n", Field((*proc)->lines(), "recovered ").c_str());
    }
    (*proc)->Signal(SIGKILL);  // keep the log non-empty for the next start
    (*proc)->Wait();
  }
  std::sort(ready_ms.begin(), ready_ms.end());
  std::printf("machine: %s, %u cores\n", leap::client::CpuModel().c_str(),
              std::thread::hardware_concurrency());
  std::printf("restart to ready (SERVING), d=%lld, non-empty log, %d restarts: "
              "median %.0f ms, max %.0f ms\n",
              static_cast<long long>(dim), restarts, ready_ms[ready_ms.size() / 2],
              ready_ms.back());
  uintmax_t bytes = 0;
  for (const auto& f : std::filesystem::recursive_directory_iterator(dir)) {
    if (f.is_regular_file()) bytes += f.file_size();
  }
  std::printf("data dir: %.1f MiB on disk\n", bytes / 1048576.0);
  return 0;
}
