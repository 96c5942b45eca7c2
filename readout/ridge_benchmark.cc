// Offline fit time at n = 50,000, d = 4,096 (synthetic features): with a
// given lambda, and with lambda from 5-fold cross-validation. Uses every
// core OpenBLAS sees (an offline job). Needs ~1.7 GB of memory.
//   ridge_benchmark [--benchmark_filter=Given|CV] [--rows=N]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "readout/internal/machine_probe.h"
#include "readout/ridge.h"
#include "readout/synth.h"

namespace leap::readout {
namespace {

int64_t g_rows = 50000;
constexpr int64_t kDim = 4096;

struct Data {
  std::vector<float> x;
  std::vector<int64_t> len;
};

const Data& GetData() {
  static const Data* data = [] {
    auto* d = new Data;
    SynthOptions o;
    o.dim = kDim;
    auto g = SynthGenerator::Create(o);
    auto dom = BuiltinDomain("chat");
    d->x.resize(g_rows * kDim);
    d->len.resize(g_rows);
    std::mt19937_64 rng(1);
    for (int64_t r = 0; r < g_rows; ++r) {
      d->len[r] = g->Draw(*dom, rng, d->x.data() + r * kDim);
    }
    return d;
  }();
  return *data;
}

void Fit(benchmark::State& state, bool cv) {
  const Data& d = GetData();
  RidgeOptions o;
  if (!cv) o.lambda = 0.01 * g_rows;
  o.progress = [](const std::string& s) { std::fprintf(stderr, "  %s\n", s.c_str()); };
  for (auto _ : state) {
    auto fit = FitRidge({d.x.data(), DType::kFloat32, g_rows, kDim}, d.len, o);
    if (!fit.ok()) state.SkipWithError(std::string(fit.status().message()).c_str());
    benchmark::DoNotOptimize(fit);
  }
  state.counters["rows"] = static_cast<double>(g_rows);
}

void BM_FitGivenLambda(benchmark::State& state) { Fit(state, false); }
void BM_FitCrossValidated(benchmark::State& state) { Fit(state, true); }
BENCHMARK(BM_FitGivenLambda)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();
BENCHMARK(BM_FitCrossValidated)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();

}  // namespace
}  // namespace leap::readout

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--rows=", 7) == 0) {
      leap::readout::g_rows = std::stoll(argv[i] + 7);
      for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
      --argc;
      --i;
    }
  }
  benchmark::AddCustomContext("cpu", leap::readout::internal::CpuDescription());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
