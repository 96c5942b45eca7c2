#include "readout/internal/machine_probe.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "readout/internal/kernels.h"
#include "readout/internal/simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace leap::readout::internal {
namespace {

// This thread's CPU time: the cores are shared with other work, and time
// spent preempted would count against whichever side of a ratio it fell on.
double Now() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// A small value the compiler cannot see (so the FMA chains stay distinct).
float ProbeSeed() {
  static volatile float seed = 1e-6f;
  return seed;
}

// The portable loops (its FMA peak is never measured: no FMA unit to time).
namespace portable_probe {
#define LEAP_ISA
using Vec = simd::Portable;
#include "readout/internal/probe_kernels.inc"
#undef LEAP_ISA
}  // namespace portable_probe

#if defined(__x86_64__)
namespace avx2_probe {
#define LEAP_ISA LEAP_TARGET_AVX2
using Vec = simd::Avx2;
#include "readout/internal/probe_kernels.inc"
#undef LEAP_ISA
}  // namespace avx2_probe

namespace avx512_probe {
#define LEAP_ISA LEAP_TARGET_AVX512
using Vec = simd::Avx512;
#include "readout/internal/probe_kernels.inc"
#undef LEAP_ISA
}  // namespace avx512_probe

bool HasAvx512() { return CpuSupports("avx512"); }
bool HasAvx2() { return CpuSupports("avx2"); }
#endif

float* AlignedFloats(size_t n) {
  auto* p = static_cast<float*>(std::aligned_alloc(64, (n * 4 + 63) / 64 * 64));
  for (size_t i = 0; i < n; ++i) p[i] = 1.0f + static_cast<float>(i % 7) * 1e-3f;
  return p;
}

}  // namespace

const char* FmaPeakIsa() {
#if defined(__x86_64__)
  if (HasAvx512()) return "avx512";
  if (HasAvx2()) return "avx2";
#endif
  return "none";
}

double MeasureFmaPeak() {
  double best = 0;
#if defined(__x86_64__)
  for (int r = 0; r < 3; ++r) {
    if (HasAvx512()) {
      best = std::max(best, avx512_probe::FmaPeak());
    } else if (HasAvx2()) {
      best = std::max(best, avx2_probe::FmaPeak());
    }
  }
#endif
  return best;
}

double MeasureReadBandwidth() {
  const size_t n = size_t{64} << 20;  // floats = 256 MiB
  float* buf = AlignedFloats(n);
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const double t0 = Now();
    float s = 0;
#if defined(__x86_64__)
    if (HasAvx512()) {
      s = avx512_probe::StreamSum(buf, n);
    } else if (HasAvx2()) {
      s = avx2_probe::StreamSum(buf, n);
    } else
#endif
    {
      s = portable_probe::StreamSum(buf, n);
    }
    const double t = Now() - t0;
    volatile float keep = s;
    (void)keep;
    best = std::max(best, n * 4.0 / t);
  }
  std::free(buf);
  return best;
}

float PlainDot(const float* w, const float* x, int64_t n) {
#if defined(__x86_64__)
  static const bool avx512 = HasAvx512(), avx2 = HasAvx2();
  if (avx512) return avx512_probe::PlainDotT(w, x, n);
  if (avx2) return avx2_probe::PlainDotT(w, x, n);
#endif
  return portable_probe::PlainDotT(w, x, n);
}

double MeasurePlainDot(int64_t n) {
  constexpr int kVectors = 16;
  const int64_t ld = (n + 15) / 16 * 16;
  float* w = AlignedFloats(ld);
  float* x = AlignedFloats(ld * kVectors);
  float (*dot)(const float*, const float*, int64_t) = portable_probe::PlainDotT;
#if defined(__x86_64__)
  if (HasAvx512()) {
    dot = avx512_probe::PlainDotT;
  } else if (HasAvx2()) {
    dot = avx2_probe::PlainDotT;
  }
#endif
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const long iters = 200'000;
    float sink = 0;
    const double t0 = Now();
    for (long it = 0; it < iters; ++it) {
      sink += dot(w, x + (it % kVectors) * ld, n);
    }
    const double t = Now() - t0;
    volatile float keep = sink;
    (void)keep;
    best = std::max(best, iters / t);
  }
  std::free(w);
  std::free(x);
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
