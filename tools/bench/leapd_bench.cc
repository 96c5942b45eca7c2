// Load generator for leapd's Connect stream: sustained predictions/s with
// batched messages on S streams, then the latency of single requests on an
// otherwise idle server. Prints the figures and the machine.
//
//   leapd_bench --server=127.0.0.1:7070 [--dim=4096] [--batch=64]
//               [--streams=2] [--seconds=10] [--latency_requests=2000]
//               [--readout=bench] [--dtype=float32|bfloat16]
//
// Creates a cold-start readout named --readout with the default route when
// the server has none (so it can run against a bare `leapd`). Completions
// are not sent: requests are cancelled in bulk to keep the cache small.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"

ABSL_FLAG(std::string, server, "127.0.0.1:7070", "leapd address");
ABSL_FLAG(int64_t, dim, 4096, "feature width");
ABSL_FLAG(int32_t, batch, 64, "records per FeatureBatch message");
ABSL_FLAG(int32_t, streams, 2, "concurrent Connect streams");
ABSL_FLAG(double, seconds, 10, "duration of the throughput phase");
ABSL_FLAG(int32_t, latency_requests, 2000,
          "single-record round trips for the latency phase");
ABSL_FLAG(std::string, readout, "bench", "readout to create if none exists");
ABSL_FLAG(std::string, dtype, "float32", "float32 or bfloat16");

namespace {

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

double CpuSeconds() {
  std::ifstream in("/proc/self/stat");
  std::string s;
  std::getline(in, s);
  // utime and stime are fields 14 and 15 (after the ')' of comm).
  std::string rest = s.substr(s.rfind(')') + 2);
  std::vector<std::string> f;
  size_t p = 0;
  while (p < rest.size()) {
    size_t q = rest.find(' ', p);
    if (q == std::string::npos) q = rest.size();
    f.push_back(rest.substr(p, q - p));
    p = q + 1;
  }
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  return (std::stod(f[11]) + std::stod(f[12])) / hz;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("load generator for leapd's Connect stream");
  absl::ParseCommandLine(argc, argv);
  const int64_t dim = absl::GetFlag(FLAGS_dim);
  const int batch = absl::GetFlag(FLAGS_batch);
  const bool bf16 = absl::GetFlag(FLAGS_dtype) == "bfloat16";
  grpc::ChannelArguments cargs;
  cargs.SetMaxReceiveMessageSize(256 << 20);
  cargs.SetMaxSendMessageSize(256 << 20);
  auto channel = grpc::CreateCustomChannel(
      absl::GetFlag(FLAGS_server), grpc::InsecureChannelCredentials(), cargs);
  auto admin = pb::Admin::NewStub(channel);
  {
    grpc::ClientContext ctx;
    pb::ListRoutesResponse routes;
    grpc::Status s = admin->ListRoutes(&ctx, pb::ListRoutesRequest(), &routes);
    if (!s.ok()) {
      std::fprintf(stderr, "leapd_bench: cannot reach %s: %s\n",
                   absl::GetFlag(FLAGS_server).c_str(), s.error_message().c_str());
      return 1;
    }
    if (routes.routes_size() == 0) {
      grpc::ClientContext c2;
      pb::CreateReadoutRequest req;
      req.set_name(absl::GetFlag(FLAGS_readout));
      req.mutable_cold_start()->set_dim(dim);
      req.mutable_cold_start()->set_lambda(1.0);
      pb::ReadoutInfo info;
      s = admin->CreateReadout(&c2, req, &info);
      if (!s.ok()) {
        std::fprintf(stderr, "leapd_bench: create readout: %s\n",
                     s.error_message().c_str());
        return 1;
      }
      grpc::ClientContext c3;
      pb::SetRouteRequest r;
      auto* arm = r.mutable_route()->add_arms();
      arm->set_readout(absl::GetFlag(FLAGS_readout));
      arm->set_percent(100);
      pb::Route out;
      s = admin->SetRoute(&c3, r, &out);
      if (!s.ok()) {
        std::fprintf(stderr, "leapd_bench: route: %s\n", s.error_message().c_str());
        return 1;
      }
    }
  }

  // One feature payload reused by every record (the sidecar reads it anew).
  std::mt19937 rng(1);
  std::normal_distribution<float> n01;
  std::string payload;
  if (bf16) {
    std::vector<uint16_t> x(dim);
    for (auto& v : x) v = leap::FloatToBf16(n01(rng));
    payload.assign(reinterpret_cast<const char*>(x.data()), dim * 2);
  } else {
    std::vector<float> x(dim);
    for (auto& v : x) v = n01(rng);
    payload.assign(reinterpret_cast<const char*>(x.data()), dim * 4);
  }
  const pb::FeatureDType dtype =
      bf16 ? pb::FEATURE_DTYPE_BFLOAT16 : pb::FEATURE_DTYPE_FLOAT32;

  // Request ids unique to this run (the server may still hold live ids of an
  // earlier run).
  const std::string run = absl::StrCat(std::random_device{}() % 1000000, "-");

  // ---- throughput: S streams, each keeping 2 batches in flight.
  const int streams = absl::GetFlag(FLAGS_streams);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  std::atomic<int64_t> predicted{0}, errors{0};
  const auto t0 = Clock::now();
  const double cpu0 = CpuSeconds();
  std::vector<std::thread> threads;
  for (int si = 0; si < streams; ++si) {
    threads.emplace_back([&, si] {
      auto stub = pb::Predictor::NewStub(channel);
      grpc::ClientContext ctx;
      auto stream = stub->Connect(&ctx);
      pb::EngineMessage hello;
      hello.mutable_hello()->set_dim(dim);
      hello.mutable_hello()->set_dtype(dtype);
      hello.mutable_hello()->set_engine_id(absl::StrCat("bench-", si));
      stream->Write(hello);
      pb::SidecarMessage in;
      stream->Read(&in);  // hello ack
      pb::EngineMessage msg;
      for (int i = 0; i < batch; ++i) {
        auto* r = msg.mutable_features()->add_records();
        r->set_features(payload);
      }
      pb::EngineMessage cancel;
      int64_t next_id = 0;
      auto fill = [&] {
        for (int i = 0; i < batch; ++i) {
          msg.mutable_features()->mutable_records(i)->set_request_id(
              absl::StrCat(run, si, "-", next_id++));
        }
      };
      std::atomic<bool> done{false};
      std::atomic<int64_t> answered{0};
      std::thread reader([&] {
        pb::SidecarMessage m;
        while (stream->Read(&m)) {
          if (m.has_predictions()) {
            predicted.fetch_add(m.predictions().predictions_size());
            errors.fetch_add(m.predictions().errors_size());
            answered.fetch_add(1);
          }
        }
      });
      int64_t sent = 0;
      int64_t ids_live_from = 0;
      while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
        while (sent - answered.load() >= 2) std::this_thread::yield();
        fill();
        stream->Write(msg);
        ++sent;
        if (next_id - ids_live_from >= 8192) {  // keep the live set bounded
          cancel.Clear();
          for (int64_t id = ids_live_from; id < next_id - 4 * batch; ++id) {
            cancel.mutable_cancels()->add_request_ids(absl::StrCat(run, si, "-", id));
          }
          ids_live_from = next_id - 4 * batch;
          stream->Write(cancel);
        }
      }
      while (sent > answered.load()) std::this_thread::yield();
      stream->WritesDone();
      reader.join();
      stream->Finish();
      done = true;
    });
  }
  for (auto& t : threads) t.join();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double cpu = CpuSeconds() - cpu0;

  // ---- latency: one record per message, one at a time, idle server.
  std::vector<double> lat;
  {
    auto stub = pb::Predictor::NewStub(channel);
    grpc::ClientContext ctx;
    auto stream = stub->Connect(&ctx);
    pb::EngineMessage hello;
    hello.mutable_hello()->set_dim(dim);
    hello.mutable_hello()->set_dtype(dtype);
    stream->Write(hello);
    pb::SidecarMessage in;
    stream->Read(&in);
    pb::EngineMessage msg, cancel;
    auto* r = msg.mutable_features()->add_records();
    r->set_features(payload);
    const int n = absl::GetFlag(FLAGS_latency_requests);
    for (int i = 0; i < n; ++i) {
      r->set_request_id(absl::StrCat(run, "lat-", i));
      const auto a = Clock::now();
      stream->Write(msg);
      do {
        if (!stream->Read(&in)) break;
      } while (!in.has_predictions());
      lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - a).count());
      cancel.Clear();
      cancel.mutable_cancels()->add_request_ids(r->request_id());
      stream->Write(cancel);
      stream->Read(&in);  // ack
    }
    stream->WritesDone();
    stream->Finish();
  }
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double q) {
    return lat.empty() ? 0.0 : lat[std::min(lat.size() - 1, static_cast<size_t>(q * lat.size()))];
  };
  std::printf("machine: %s, %u cores\n", CpuModel().c_str(),
              std::thread::hardware_concurrency());
  std::printf("connect stream, d=%lld %s, batch=%d, streams=%d: %.0f predictions/s "
              "(%lld in %.1f s, %lld errors), client CPU %.2f cores\n",
              static_cast<long long>(dim), bf16 ? "bf16" : "fp32", batch, streams,
              predicted.load() / wall, static_cast<long long>(predicted.load()), wall,
              static_cast<long long>(errors.load()), cpu / wall);
  std::printf("single request round trip (idle server, %zu samples): p50 %.0f us, "
              "p99 %.0f us, max %.0f us\n",
              lat.size(), pct(0.50), pct(0.99), lat.empty() ? 0.0 : lat.back());
  return 0;
}
