#include "readout/internal/machine_probe.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "readout/internal/kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace leap::readout::internal {
namespace {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) double FmaPeakAvx2() {
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(1.0f + i * 1e-7f);
  const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  const long iters = 50'000'000;
  const double t0 = Now();
  for (long it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  }
  const double t = Now() - t0;
  float sink[8];
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  _mm256_storeu_ps(sink, s);
  volatile float keep = sink[0];
  (void)keep;
  return iters * 12.0 * 8 / t;
}
#endif

}  // namespace

double MeasureFmaPeak() {
#if defined(__x86_64__)
  if (std::string(BestKernels().name) == "avx2") {
    double best = 0;
    for (int r = 0; r < 3; ++r) best = std::max(best, FmaPeakAvx2());
    return best;
  }
#endif
  return 0.0;
}

double MeasureReadBandwidth() {
  const size_t n = size_t{64} << 20;  // floats = 256 MiB
  std::vector<float> buf(n, 1.0f);
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const double t0 = Now();
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t i = 0; i < n; i += 8) {
      for (int l = 0; l < 8; ++l) acc[l] += buf[i + l];
    }
    const double t = Now() - t0;
    volatile float keep = acc[0] + acc[7];
    (void)keep;
    best = std::max(best, n * 4.0 / t);
  }
  return best;
}

std::string CpuDescription() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  return model + ", kernels: " + BestKernels().name;
}

}  // namespace leap::readout::internal
