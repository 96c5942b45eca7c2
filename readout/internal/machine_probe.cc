#include "readout/internal/machine_probe.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "readout/internal/kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

#if defined(__x86_64__)
#define LEAP_PROBE_AVX2 __attribute__((target("avx2,fma")))
#define LEAP_PROBE_AVX512 __attribute__((target("avx512f,avx2,fma")))

// Twelve independent chains (named registers, so nothing spills): enough
// to cover 4-cycle FMA latency at two or three FMAs per cycle.
// A small value the compiler cannot see (so the FMA chains stay distinct).
float ProbeSeed() {
  static volatile float seed = 1e-6f;
  return seed;
}

#define LEAP_FMA12(FMA)                                                       \
  a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c);                 \
  a3 = FMA(a3, m, c); a4 = FMA(a4, m, c); a5 = FMA(a5, m, c);                 \
  a6 = FMA(a6, m, c); a7 = FMA(a7, m, c); a8 = FMA(a8, m, c);                 \
  a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);

LEAP_PROBE_AVX2 double FmaPeakAvx2() {
  const __m256 s = _mm256_set1_ps(1.0f), m = _mm256_set1_ps(0.9999999f),
               c = _mm256_set1_ps(1e-7f);
  // Twelve chains with different starting values: from one common value
  // the compiler merges them into one dependent chain (latency-bound: one
  // FMA per latency counted as twelve, which overstated the peak ~1.6x).
  const __m256 e = _mm256_set1_ps(ProbeSeed());
  __m256 a0 = s, a1 = _mm256_add_ps(a0, e), a2 = _mm256_add_ps(a1, e),
         a3 = _mm256_add_ps(a2, e), a4 = _mm256_add_ps(a3, e),
         a5 = _mm256_add_ps(a4, e), a6 = _mm256_add_ps(a5, e),
         a7 = _mm256_add_ps(a6, e), a8 = _mm256_add_ps(a7, e),
         a9 = _mm256_add_ps(a8, e), a10 = _mm256_add_ps(a9, e),
         a11 = _mm256_add_ps(a10, e);
  const long iters = 20'000'000;
  const double t0 = Now();
  for (long it = 0; it < iters; ++it) {
    LEAP_FMA12(_mm256_fmadd_ps)
  }
  const double t = Now() - t0;
  const __m256 sum = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                    _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))),
      _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  float sink[8];
  _mm256_storeu_ps(sink, sum);
  volatile float keep = sink[0];
  (void)keep;
  return iters * 12.0 * 8 / t;
}

LEAP_PROBE_AVX512 double FmaPeakAvx512() {
  const __m512 s = _mm512_set1_ps(1.0f), m = _mm512_set1_ps(0.9999999f),
               c = _mm512_set1_ps(1e-7f);
  // Twelve distinct chains (see FmaPeakAvx2).
  const __m512 e = _mm512_set1_ps(ProbeSeed());
  __m512 a0 = s, a1 = _mm512_add_ps(a0, e), a2 = _mm512_add_ps(a1, e),
         a3 = _mm512_add_ps(a2, e), a4 = _mm512_add_ps(a3, e),
         a5 = _mm512_add_ps(a4, e), a6 = _mm512_add_ps(a5, e),
         a7 = _mm512_add_ps(a6, e), a8 = _mm512_add_ps(a7, e),
         a9 = _mm512_add_ps(a8, e), a10 = _mm512_add_ps(a9, e),
         a11 = _mm512_add_ps(a10, e);
  const long iters = 10'000'000;
  const double t0 = Now();
  for (long it = 0; it < iters; ++it) {
    LEAP_FMA12(_mm512_fmadd_ps)
  }
  const double t = Now() - t0;
  const __m512 sum = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                    _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),
      _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
  volatile float keep = _mm512_reduce_add_ps(sum);
  (void)keep;
  return iters * 12.0 * 16 / t;
}

LEAP_PROBE_AVX2 float SumAvx2(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  float s[8];
  _mm256_storeu_ps(s, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return s[0];
}

LEAP_PROBE_AVX512 float SumAvx512(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

LEAP_PROBE_AVX2 float PlainDotAvx2(const float* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_load_ps(w + i), _mm256_load_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_load_ps(w + i + 8), _mm256_load_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_load_ps(w + i + 16), _mm256_load_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_load_ps(w + i + 24), _mm256_load_ps(x + i + 24), a3);
  }
  float s[8];
  _mm256_storeu_ps(s, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  float r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += w[i] * x[i];
  return r;
}

LEAP_PROBE_AVX512 float PlainDotAvx512(const float* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_load_ps(w + i), _mm512_load_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_load_ps(w + i + 16), _mm512_load_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_load_ps(w + i + 32), _mm512_load_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_load_ps(w + i + 48), _mm512_load_ps(x + i + 48), a3);
  }
  float r = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) r += w[i] * x[i];
  return r;
}

bool HasAvx512() { return CpuSupports("avx512"); }
bool HasAvx2() { return CpuSupports("avx2"); }
#endif

float PlainDotPortable(const float* w, const float* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += w[i + l] * x[i + l];
  }
  for (; i < n; ++i) acc[0] += w[i] * x[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

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
      best = std::max(best, FmaPeakAvx512());
    } else if (HasAvx2()) {
      best = std::max(best, FmaPeakAvx2());
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
      s = SumAvx512(buf, n);
    } else if (HasAvx2()) {
      s = SumAvx2(buf, n);
    } else
#endif
    {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (size_t i = 0; i < n; i += 8) {
        for (int l = 0; l < 8; ++l) acc[l] += buf[i + l];
      }
      s = acc[0] + acc[7];
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
  if (avx512) return PlainDotAvx512(w, x, n);
  if (avx2) return PlainDotAvx2(w, x, n);
#endif
  return PlainDotPortable(w, x, n);
}

double MeasurePlainDot(int64_t n) {
  constexpr int kVectors = 16;
  const int64_t ld = (n + 15) / 16 * 16;
  float* w = AlignedFloats(ld);
  float* x = AlignedFloats(ld * kVectors);
  float (*dot)(const float*, const float*, int64_t) = PlainDotPortable;
#if defined(__x86_64__)
  if (HasAvx512()) {
    dot = PlainDotAvx512;
  } else if (HasAvx2()) {
    dot = PlainDotAvx2;
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
