// Prediction throughput at d = 4096 on one core: the folded readout (one dot
// product + bias, validation included) for fp32, bf16 and fp16 features,
// beside a plain 4096-float dot product measured in the same run. main()
// first prints the ratios (issue 13's acceptance: each >= 0.9), then runs
// the Google benchmarks.
//   readout_benchmark [--benchmark_filter=...]
#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
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

// Features as an engine hands them over (gRPC buffers and shared-memory
// slots are 64-byte aligned): 64-byte aligned vectors.
std::vector<float, CacheAlignedAllocator<float>> MakeFeatures() {
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n01;
  std::vector<float, CacheAlignedAllocator<float>> x(kVectors * kDim);
  for (auto& v : x) v = n01(rng);
  return x;
}

void BM_PlainDot4096(benchmark::State& state) {
  const auto x = MakeFeatures();
  const std::vector<float, CacheAlignedAllocator<float>> w(x.begin(),
                                                           x.begin() + kDim);
  int i = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(internal::PlainDot(w.data(), x.data() + i * kDim, kDim));
    i = (i + 1) % kVectors;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_PlainDot4096);

void BM_PredictFp32(benchmark::State& state) {
  const FoldedReadout r = MakeReadout();
  const auto x = MakeFeatures();
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
  const auto xf = MakeFeatures();
  std::vector<uint16_t, CacheAlignedAllocator<uint16_t>> x(xf.size());
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
  const auto x = MakeFeatures();
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

namespace leap::readout {
namespace {

// This thread's CPU time: the cores are shared with other work, and time
// spent preempted would count against whichever side of a ratio it fell on.
double Now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Predictions per second through PredictTokens (best of three), features
// cycling through kVectors vectors starting `offset` bytes past alignment.
template <typename T>
double PredictRate(const FoldedReadout& r, const T* x, DType type,
                   int64_t stride) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const long iters = 200'000;
    double sink = 0;
    const double t0 = Now();
    for (long it = 0; it < iters; ++it) {
      auto t = r.PredictTokens({x + (it % kVectors) * stride, type, kDim, 1});
      sink += *t;
    }
    const double t = Now() - t0;
    volatile double keep = sink;
    (void)keep;
    best = std::max(best, iters / t);
  }
  return best;
}

void PrintRatios() {
  const FoldedReadout r = MakeReadout();
  const auto xf = MakeFeatures();
  std::vector<uint16_t, CacheAlignedAllocator<uint16_t>> xb(xf.size()), xh(xf.size());
  for (size_t j = 0; j < xf.size(); ++j) {
    xb[j] = FloatToBf16(xf[j]);
    xh[j] = FloatToFp16(xf[j]);
  }
  // The same features 16 bytes past a cache line (a misaligned buffer).
  std::vector<float, CacheAlignedAllocator<float>> xm(xf.size() + 16);
  std::copy(xf.begin(), xf.end(), xm.begin() + 4);
  const double plain = internal::MeasurePlainDot(kDim);
  const double f32 = PredictRate(r, xf.data(), DType::kFloat32, kDim);
  const double bf16 = PredictRate(r, xb.data(), DType::kBFloat16, kDim);
  const double f16 = PredictRate(r, xh.data(), DType::kFloat16, kDim);
  const double f32m = PredictRate(r, xm.data() + 4, DType::kFloat32, kDim);
  const double plain2 = internal::MeasurePlainDot(kDim);
  std::printf("plain 4096-float dot (%s, aligned): %.2f M/s (%.2f M/s after)\n",
              internal::FmaPeakIsa(), plain / 1e6, plain2 / 1e6);
  const double ref = std::max(plain, plain2);
  std::printf("prediction at d = 4096, kernels %s, vs the plain dot [target >= 0.9]:\n",
              internal::BestKernels().name);
  std::printf("  fp32 %.2f M/s = %.2f x | bf16 %.2f M/s = %.2f x | fp16 %.2f M/s = %.2f x\n",
              f32 / 1e6, f32 / ref, bf16 / 1e6, bf16 / ref, f16 / 1e6, f16 / ref);
  std::printf("  fp32 features 16 bytes off a cache line: %.2f M/s = %.2f x\n",
              f32m / 1e6, f32m / ref);
}

}  // namespace
}  // namespace leap::readout

int main(int argc, char** argv) {
  using namespace leap::readout::internal;
  std::printf("cpu: %s\n", CpuDescription().c_str());
  {
    std::ifstream in("/proc/loadavg");
    std::string a, b, c;
    in >> a >> b >> c;
    std::printf("load average: %s %s %s\n", a.c_str(), b.c_str(), c.c_str());
  }
  const double peak = MeasureFmaPeak();
  std::printf("FMA peak (%s): %.1f GFMA/s -> dot-product bound %.2f M/s at d=4096\n",
              FmaPeakIsa(), peak / 1e9, peak / 4096 / 1e6);
  leap::readout::PrintRatios();
  benchmark::AddCustomContext("cpu", CpuDescription());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
