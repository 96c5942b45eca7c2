// Prediction throughput at d = 4096 on one core: the folded readout (one dot
// product + bias, validation included) for fp32, bf16 and fp16 features,
// beside a plain 4096-float dot product measured in the same run.
//   readout_benchmark [--benchmark_filter=...]
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "common/half.h"
#include "readout/internal/kernels.h"
#include "readout/internal/machine_probe.h"
#include "readout/readout.h"

namespace leap::readout {
namespace {

constexpr int64_t kDim = 4096;
// Feature vectors cycled through: 16 x 16 KiB = 256 KiB (fp32), i.e. fresh
// per prediction but resident in L2, as features just written by the engine.
constexpr int kVectors = 16;

FoldedReadout MakeReadout() {
  std::mt19937_64 rng(1);
  std::normal_distribution<double> n01;
  Standardizer st = Standardizer::Identity(kDim);
  Eigen::VectorXd theta(kDim + 1);
  for (int64_t i = 0; i < kDim; ++i) {
    st.mean[i] = 0.1 * n01(rng);
    st.scale[i] = 1.0 + 0.1 * std::abs(n01(rng));
    theta[i] = 0.01 * n01(rng);
  }
  theta[kDim] = 20;
  return FoldedReadout::Fold(st, theta, 2048);
}

std::vector<float> MakeFeatures() {
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n01;
  std::vector<float> x(kVectors * kDim);
  for (auto& v : x) v = n01(rng);
  return x;
}

void BM_PlainDot4096(benchmark::State& state) {
  const std::vector<float> x = MakeFeatures();
  const std::vector<float> w(x.begin(), x.begin() + kDim);
  const auto& k = internal::BestKernels();
  int i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(k.dot_f32(w.data(), x.data() + i * kDim, kDim));
    i = (i + 1) % kVectors;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PlainDot4096);

void BM_PredictFp32(benchmark::State& state) {
  const FoldedReadout r = MakeReadout();
  const std::vector<float> x = MakeFeatures();
  int i = 0;
  for (auto _ : state) {
    auto t = r.PredictTokens(FeatureView::F32(x.data() + i * kDim, kDim));
    benchmark::DoNotOptimize(t);
    i = (i + 1) % kVectors;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PredictFp32);

template <uint16_t (*Convert)(float), DType kType>
void BM_PredictHalf(benchmark::State& state) {
  const FoldedReadout r = MakeReadout();
  const std::vector<float> xf = MakeFeatures();
  std::vector<uint16_t> x(xf.size());
  for (size_t j = 0; j < x.size(); ++j) x[j] = Convert(xf[j]);
  int i = 0;
  for (auto _ : state) {
    auto t = r.PredictTokens({x.data() + i * kDim, kType, kDim, 1});
    benchmark::DoNotOptimize(t);
    i = (i + 1) % kVectors;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PredictHalf<FloatToBf16, DType::kBFloat16>)->Name("BM_PredictBf16");
BENCHMARK(BM_PredictHalf<FloatToFp16, DType::kFloat16>)->Name("BM_PredictFp16");

void BM_PredictFp32Portable(benchmark::State& state) {
  const FoldedReadout r = MakeReadout();
  const std::vector<float> x = MakeFeatures();
  const auto& k = internal::PortableKernels();
  int i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(k.dot_f32(r.w().data(), x.data() + i * kDim, kDim));
    i = (i + 1) % kVectors;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PredictFp32Portable);

}  // namespace
}  // namespace leap::readout

int main(int argc, char** argv) {
  using namespace leap::readout::internal;
  benchmark::AddCustomContext("cpu", CpuDescription());
  const double peak = MeasureFmaPeak();
  benchmark::AddCustomContext(
      "fma_peak_gflops_fp32",
      std::to_string(peak / 1e9) + " GFMA/s -> dot-product bound " +
          std::to_string(peak / 4096 / 1e6) + " M predictions/s at d=4096");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
