// leapd's learning through the real service beside the RLS kernel figure
// (issue 13's acceptance), one leapd (no fleet), one cold readout of width
// d = 4096, clients in this process sending Predict + Complete over gRPC:
//   1. the kernel: this core's exact-RLS FMA bound (FMA peak over
//      1.5 (d+1)^2 multiply-adds per completion, readout/rls_benchmark's
//      definition) and RlsState::Update in this process, batches of 8 and of
//      256 (what leapd's adaptive worker applies under a backlog), one thread
//      and --rls_threads threads;
//   2. sustained learning under a backlog: --clients closed-loop engine
//      streams (Connect; FeatureBatch then CompletionBatch of --batch
//      requests, as an engine sends them) for --seconds; acknowledged
//      completions/s, and learned completions/s from
//      the first request to the version that includes the last completion
//      (WatchReadout's completions_learned); the largest backlog seen
//      (acknowledged minus learned) says whether learning, not the clients,
//      was the bound;
//   3. completion -> version latency at a steady --rate completions/s (one
//      paced client): for the k-th completion acknowledged, from its
//      acknowledgement to the first version with completions_learned >= k;
//      p50, p99, max.
// Prints the CPU, the kernels and `uptime` before and after (other load
// changes figures).
//   leapd_learning_benchmark [--dim=4096] [--seconds=10] [--rate=100]
//                            [--clients=2] [--batch=64] [--rls_threads=0]
// A benchmark program, not a ctest test. Release build.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "Eigen/Core"
#include "absl/strings/str_cat.h"
#include "readout/internal/machine_probe.h"
#include "readout/rls.h"
#include "tests/support/bench_load.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

extern "C" void openblas_set_num_threads(int);

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

namespace {

using leap::testing::IntFlag;
using leap::testing::Ms;
using leap::testing::Pct;
using leap::testing::Sh;
using Seen = leap::testing::SeenVersion;
using Watcher = leap::testing::VersionWatcher;
using Acked = leap::testing::AckedCompletion;

// RlsState::Update in this process: completions/s with batches of `k` on
// `threads` threads over about `seconds` (after one warm-up fold cycle).
double KernelRate(int64_t dim, int64_t k, int threads, double seconds,
                  const char** kernels) {
  const int64_t n = dim + 1;
  leap::readout::RlsOptions opt;
  opt.threads = threads;
  leap::readout::RlsState rls(Eigen::VectorXd::Zero(n),
                              leap::readout::SymMatrix::ScaledIdentity(n, 1.0f),
                              opt);
  *kernels = rls.kernel_name();
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n01;
  std::vector<float> u(n * k);
  for (float& v : u) v = n01(rng);
  for (int64_t j = 0; j < k; ++j) u[j * n + dim] = 1.0f;
  std::vector<double> y(k, 15.0);
  for (int64_t done = 0; done < 256; done += k) {
    if (!rls.Update(u.data(), n, y).ok()) return 0;
  }
  rls.Flush();
  int64_t done = 0;
  const auto t0 = Clock::now();
  while (Clock::now() - t0 < std::chrono::duration<double>(seconds)) {
    if (!rls.Update(u.data(), n, y).ok()) return 0;
    done += k;
  }
  rls.Flush();
  return done / (Ms(Clock::now() - t0) / 1000);
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t dim = IntFlag(argc, argv, "dim", 4096);
  const int64_t seconds = IntFlag(argc, argv, "seconds", 10);
  const int64_t rate = IntFlag(argc, argv, "rate", 100);
  const int64_t clients = IntFlag(argc, argv, "clients", 2);
  const int64_t batch = IntFlag(argc, argv, "batch", 64);
  const int rls_threads = static_cast<int>(IntFlag(argc, argv, "rls_threads", 0));
  const int cores = leap::readout::AvailableCores();
  const int threads = rls_threads > 0 ? rls_threads : cores;
  std::printf("cpu: %s; %d cores available\nuptime: %s\n",
              leap::readout::internal::CpuDescription().c_str(), cores,
              Sh("uptime").c_str());

  // 1. The kernel.
  openblas_set_num_threads(1);
  const double fma_peak = leap::readout::internal::MeasureFmaPeak();
  const double bound1 = fma_peak / (1.5 * double(dim + 1) * double(dim + 1));
  const char* kernels = "";
  const double k8 = KernelRate(dim, 8, 1, 2.0, &kernels);
  const double k256 = KernelRate(dim, 256, 1, 3.0, &kernels);
  const double k256t = threads > 1 ? KernelRate(dim, 256, threads, 3.0, &kernels) : k256;
  std::printf("kernel (RlsState::Update in this process, %s, d = %lld): exact-RLS "
              "FMA bound %.0f completions/s on one core (FMA peak %s %.1f GFMA/s); "
              "batches of 8: %.0f/s (%.2f of it); batches of 256: %.0f/s (%.2f), "
              "on %d threads %.0f/s (wall time)\n",
              kernels, static_cast<long long>(dim), bound1,
              leap::readout::internal::FmaPeakIsa(), fma_peak / 1e9, k8,
              k8 / bound1, k256, k256 / bound1, threads, k256t);

  const leap::testing::ScopedTempDir tmp("leap-learning-bench");
  const std::string dir = tmp.File("data");
  std::string addr;
  auto leapd = leap::testing::StartLeapd(
      LEAPD_PATH,
      {absl::StrCat("--data_dir=", dir), absl::StrCat("--rls_threads=", rls_threads)},
      &addr);
  if (!leapd.ok()) {
    std::fprintf(stderr, "leapd: %s\n", std::string(leapd.status().message()).c_str());
    return 1;
  }
  {
    grpc::Status st = leap::testing::CreateDefaultReadout(addr, "r", dim);
    if (!st.ok()) {
      std::fprintf(stderr, "create: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  Watcher watcher(addr);

  // Clients: paced at per_thread_rate when > 0 (request i due at
  // start + i / rate), closed loop otherwise.
  std::atomic<int64_t> next_id{0};
  auto run_clients = [&](int64_t nclients, double per_thread_rate,
                         std::vector<Acked>* acked, int64_t* failures) {
    leap::testing::PacedClientsOptions o;
    o.addresses = {addr};
    o.clients = nclients;
    o.per_client_rate = per_thread_rate;
    o.seconds = static_cast<double>(seconds);
    o.dim = dim;
    return leap::testing::RunPacedClients(o, &next_id, acked, failures);
  };
  // Engine streams, closed loop: predict a batch, complete it, repeat.
  auto run_streams = [&](int64_t nstreams, std::vector<Acked>* acked,
                         int64_t* failures) {
    std::mutex mu;
    std::vector<std::thread> ts;
    const auto start = Clock::now();
    const auto end = start + std::chrono::seconds(seconds);
    std::atomic<int64_t> failed{0};
    for (int64_t c = 0; c < nstreams; ++c) {
      ts.emplace_back([&, c] {
        leap::testing::EngineStream stream(leap::testing::MakeChannel(addr), dim);
        std::mt19937_64 rng(c + 100);
        std::normal_distribution<float> n01;
        std::vector<float> x(dim);
        std::vector<Acked> mine;
        while (Clock::now() < end) {
          pb::EngineMessage fm;
          pb::EngineMessage cm;
          for (int64_t i = 0; i < batch; ++i) {
            double s = 18;
            for (int64_t k = 0; k < dim; ++k) {
              x[k] = n01(rng);
              if (k < 16) s += 0.5 * x[k];
            }
            const std::string id = absl::StrCat("s", next_id.fetch_add(1));
            pb::FeatureRecord* r = fm.mutable_features()->add_records();
            r->set_request_id(id);
            r->set_features(
                std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
            pb::Completion* comp = cm.mutable_completions()->add_completions();
            comp->set_request_id(id);
            comp->set_output_tokens(std::clamp<int64_t>(std::llround(s * s), 1, 4000));
            comp->set_reason(pb::FINISH_REASON_STOP);
          }
          pb::SidecarMessage answer = stream.Call(std::move(fm));
          if (answer.predictions().predictions_size() != batch) {
            failed += batch;
            continue;
          }
          answer = stream.Call(std::move(cm));
          const auto now = Clock::now();
          failed += batch - answer.ack().accepted();
          for (int64_t i = 0; i < answer.ack().accepted(); ++i) mine.push_back({now, 0, 0});
        }
        stream.Finish();
        std::lock_guard<std::mutex> l(mu);
        acked->insert(acked->end(), mine.begin(), mine.end());
      });
    }
    for (auto& t : ts) t.join();
    *failures = failed.load();
    std::sort(acked->begin(), acked->end(),
              [](const Acked& a, const Acked& b) { return a.t < b.t; });
    return Ms(Clock::now() - start) / 1000;
  };
  auto wait_learned = [&](int64_t target) {
    const auto deadline = Clock::now() + std::chrono::seconds(300);
    while (Clock::now() < deadline) {
      if (watcher.learned() >= target) return true;
      // Benchmark bookkeeping, not a test: a short poll of in-process state.
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  };
  // First time a version with completions_learned >= target was seen.
  auto seen_at = [](const std::vector<Seen>& log, int64_t target) {
    auto it = std::find_if(log.begin(), log.end(),
                           [&](const Seen& s) { return s.learned >= target; });
    return it == log.end() ? Clock::time_point::max() : it->t;
  };

  // 2. Sustained learning under a backlog.
  {
    const int64_t base = watcher.learned();
    std::vector<Acked> acked;
    int64_t failures = 0;
    const auto start = Clock::now();
    const double secs = run_streams(clients, &acked, &failures);
    const int64_t total = base + static_cast<int64_t>(acked.size());
    if (!wait_learned(total)) {
      std::fprintf(stderr, "leapd never learned %lld completions\n",
                   static_cast<long long>(total));
      return 1;
    }
    const std::vector<Seen> log = watcher.seen();
    const double learn_secs = Ms(seen_at(log, total) - start) / 1000;
    // Backlog at each version: acknowledged before it minus learned.
    int64_t max_backlog = 0;
    for (const Seen& s : log) {
      if (s.t < start) continue;
      const int64_t before = std::lower_bound(acked.begin(), acked.end(), s.t,
                                              [](const Acked& a, Clock::time_point t) {
                                                return a.t < t;
                                              }) -
                             acked.begin();
      max_backlog = std::max(max_backlog, before - (s.learned - base));
    }
    const double learn_rate = acked.size() / learn_secs;
    std::printf("leapd sustained (%lld closed-loop engine streams, batches of %lld, "
                "%.1f s): %zu acknowledged "
                "(%.0f/s, %lld failed); learned %.0f/s through the service (last "
                "version %.2f s after start) = %.2f of the one-core exact-RLS bound, "
                "%.2f of the kernel's batches-of-256 rate on %d threads; largest "
                "backlog seen %lld\n",
                static_cast<long long>(clients), static_cast<long long>(batch), secs,
                acked.size(), acked.size() / secs, static_cast<long long>(failures), learn_rate,
                learn_secs, learn_rate / bound1, learn_rate / k256t, threads,
                static_cast<long long>(max_backlog));
  }

  // 3. Completion -> version latency at a steady rate.
  {
    const int64_t base = watcher.learned();
    std::vector<Acked> acked;
    int64_t failures = 0;
    const double secs =
        run_clients(1, static_cast<double>(rate), &acked, &failures);
    const int64_t total = base + static_cast<int64_t>(acked.size());
    if (!wait_learned(total)) {
      std::fprintf(stderr, "leapd never learned %lld completions\n",
                   static_cast<long long>(total));
      return 1;
    }
    const std::vector<Seen> log = watcher.seen();
    std::vector<double> lat;
    for (size_t k = 0; k < acked.size(); ++k) {
      lat.push_back(Ms(seen_at(log, base + static_cast<int64_t>(k) + 1) - acked[k].t));
    }
    std::printf("leapd steady %lld/s target: %zu acknowledged in %.1f s (%.0f/s, %lld "
                "failed); completion -> version: p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
                static_cast<long long>(rate), acked.size(), secs, acked.size() / secs,
                static_cast<long long>(failures), Pct(lat, 0.5), Pct(lat, 0.99),
                Pct(lat, 1.0));
  }
  std::printf("uptime after: %s\n", Sh("uptime").c_str());
  leapd->reset();  // stops leapd
  return 0;
}
