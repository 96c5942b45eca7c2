// RLS throughput at d = 4096, batches of 8, one core: this library's
// deferred-fold RLS beside a straightforward Eigen implementation of the
// same update, and the bound the core's FMA peak sets (exact RLS costs about
// 1.5 (d+1)^2 multiply-adds per completion).
//   rls_benchmark [--benchmark_filter=...]
#include <cblas.h>

#include <random>
#include <vector>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "benchmark/benchmark.h"
#include "readout/internal/machine_probe.h"
#include "readout/rls.h"

namespace leap::readout {
namespace {

constexpr int64_t kDim = 4096;
constexpr int64_t kN = kDim + 1;
constexpr int kBatch = 8;
// A multiple of fold_columns / kBatch (= 32), so folds are fully amortized.
constexpr int kIterations = 128;

std::vector<float> MakeRows(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n01;
  std::vector<float> u(rows * kN);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < kDim; ++i) u[r * kN + i] = n01(rng);
    u[r * kN + kDim] = 1.0f;
  }
  return u;
}

void BM_RlsDeferredFold(benchmark::State& state) {
  // P0 = I / lambda (cold start) is as costly to update as any SPD P.
  RlsState rls(Eigen::VectorXd::Zero(kN),
               SymMatrix::ScaledIdentity(kN, 1.0f / 4096));
  const std::vector<float> u = MakeRows(kBatch * kIterations, 3);
  std::vector<double> y(kBatch, 20.0);
  int64_t b = 0;
  for (auto _ : state) {
    const float* rows = u.data() + (b % kIterations) * kBatch * kN;
    if (!rls.Update(rows, kN, y).ok()) state.SkipWithError("update failed");
    ++b;
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
  state.counters["pending_at_end"] = static_cast<double>(rls.pending_columns());
}
BENCHMARK(BM_RlsDeferredFold)->Iterations(kIterations)->Unit(benchmark::kMillisecond);

// The update as written in the paper, with Eigen products: streams P three
// times per batch (V = P U', and the P -= G V' rank-k update on all of P).
void BM_RlsNaiveEigen(benchmark::State& state) {
  Eigen::MatrixXf p = Eigen::MatrixXf::Identity(kN, kN) / 4096.0f;
  Eigen::VectorXf theta = Eigen::VectorXf::Zero(kN);
  const std::vector<float> u = MakeRows(kBatch * 16, 4);
  Eigen::VectorXf y = Eigen::VectorXf::Constant(kBatch, 20.0f);
  int64_t b = 0;
  for (auto _ : state) {
    Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic,
                                   Eigen::RowMajor>>
        um(u.data() + (b % 16) * kBatch * kN, kBatch, kN);
    const Eigen::MatrixXf v = p * um.transpose();
    Eigen::MatrixXf s = um * v;
    s.diagonal().array() += 1.0f;
    const Eigen::MatrixXf g = s.llt().solve(v.transpose()).transpose();
    theta += g * (y - um * theta);
    p.noalias() -= g * v.transpose();
    benchmark::DoNotOptimize(p.data());
    ++b;
  }
  state.SetItemsProcessed(state.iterations() * kBatch);
}
BENCHMARK(BM_RlsNaiveEigen)->Iterations(16)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace leap::readout

int main(int argc, char** argv) {
  using namespace leap::readout::internal;
  openblas_set_num_threads(1);  // one core, like the sidecar's RLS thread
  benchmark::AddCustomContext("cpu", CpuDescription());
  const double peak = MeasureFmaPeak();
  const double flops_per_completion = 1.5 * 4097.0 * 4097.0;
  benchmark::AddCustomContext(
      "fma_peak", std::to_string(peak / 1e9) + " GFMA/s fp32 -> exact-RLS bound " +
                      std::to_string(peak / flops_per_completion) +
                      " completions/s at d=4096");
  benchmark::AddCustomContext(
      "read_bandwidth", std::to_string(MeasureReadBandwidth() / 1e9) + " GB/s");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
