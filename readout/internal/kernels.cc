#include "readout/internal/kernels.h"

#include <algorithm>
#include <cstring>

#include "common/half.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace leap::readout::internal {
namespace {

// Columns of P processed per pass. Measured on the AVX2 machine (d = 4096,
// k = 8): 512 -> 13.7 ms, 2048 -> 10.8 ms, 4096 -> 10.1 ms per panel: long
// contiguous row segments stream better than keeping U in L1 (it stays in
// L2: 8 x 16 KiB).
constexpr int64_t kJBlock = 4096;
// How many rows ahead the panel kernel prefetches.
constexpr int64_t kPrefetchRows = 3;

// ---------------------------------------------------------------- portable
template <typename Load>
float DotPortable(const float* w, int64_t n, Load load) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += w[i + l] * load(i + l);
  }
  for (; i < n; ++i) acc[0] += w[i] * load(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

float DotF32Portable(const float* w, const float* x, int64_t n) {
  return DotPortable(w, n, [x](int64_t i) { return x[i]; });
}
float DotBf16Portable(const float* w, const uint16_t* x, int64_t n) {
  // w is in PermuteForBf16 order.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 8; ++l) {
      acc[l] += w[i + l] * Bf16ToFloat(x[i + 2 * l]) +
                w[i + 8 + l] * Bf16ToFloat(x[i + 2 * l + 1]);
    }
  }
  for (; i < n; ++i) acc[0] += w[i] * Bf16ToFloat(x[i]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
         ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}
float DotF16Portable(const float* w, const uint16_t* x, int64_t n) {
  return DotPortable(w, n, [x](int64_t i) { return Fp16ToFloat(x[i]); });
}

void DotRowsF32Portable(const float* w, const float* const* x, int rows,
                        int64_t n, float* out) {
  for (int r = 0; r < rows; ++r) {
    float a[16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int l = 0; l < 16; ++l) a[l] += w[i + l] * x[r][i + l];
    }
    float s = 0;
    for (int l = 0; l < 16; ++l) s += a[l];
    for (; i < n; ++i) s += w[i] * x[r][i];
    out[r] = s;
  }
}

void DotRowsBf16Portable(const float* w, const uint16_t* const* x, int rows,
                         int64_t n, float* out) {
  for (int r = 0; r < rows; ++r) out[r] = DotBf16Portable(w, x[r], n);
}

void PanelPortable(const float* P, int64_t ldp, int64_t n, const float* U,
                   int64_t ldu, int k, float* V) {
  std::fill(V, V + n * k, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kJBlock) {
    const int64_t jn = std::min(kJBlock, n - j0);
    for (int64_t i = 0; i < n; ++i) {
      const float* p = P + i * ldp + j0;
      for (int c = 0; c < k; ++c) {
        const float* u = U + c * ldu + j0;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = 0;
        for (; j + 8 <= jn; j += 8) {
          for (int l = 0; l < 8; ++l) acc[l] += p[j + l] * u[j + l];
        }
        for (; j < jn; ++j) acc[0] += p[j] * u[j];
        V[i * k + c] += ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                        ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      }
    }
  }
}

constexpr Kernels kPortable = {"portable",         DotF32Portable,
                               DotBf16Portable,    DotF16Portable,
                               DotRowsF32Portable, DotRowsBf16Portable,
                               PanelPortable};

#if defined(__x86_64__)
// ---------------------------------------------------------------- AVX2+FMA
#define LEAP_AVX2 __attribute__((target("avx2,fma,f16c")))

LEAP_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight accumulators (64 floats per iteration) hide the FMA latency.
template <typename Load8, typename Load1>
LEAP_AVX2 inline float DotAvx2(const float* w, int64_t n, Load8 load8,
                               Load1 load1) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0,
         a5 = a0, a6 = a0, a7 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), load8(i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), load8(i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), load8(i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), load8(i + 24), a3);
    a4 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 32), load8(i + 32), a4);
    a5 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 40), load8(i + 40), a5);
    a6 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 48), load8(i + 48), a6);
    a7 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 56), load8(i + 56), a7);
  }
  for (; i + 8 <= n; i += 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), load8(i), a0);
  }
  a0 = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  a4 = _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7));
  float s = HSum(_mm256_add_ps(a0, a4));
  for (; i < n; ++i) s += w[i] * load1(i);
  return s;
}

LEAP_AVX2 float DotF32Avx2(const float* w, const float* x, int64_t n) {
  return DotAvx2(
      w, n, [x](int64_t i) LEAP_AVX2 { return _mm256_loadu_ps(x + i); },
      [x](int64_t i) { return x[i]; });
}

LEAP_AVX2 float DotBf16Avx2(const float* w, const uint16_t* x, int64_t n) {
  // 16 bf16 per 32-byte load: the even elements are the low halves of the
  // 32-bit lanes (shift left 16 makes them floats), the odd ones the high
  // halves (mask the low half off). w is in PermuteForBf16 order.
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i v1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i),
                         _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8),
                         _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask)), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16),
                         _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16)), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24),
                         _mm256_castsi256_ps(_mm256_and_si256(v1, hi_mask)), a3);
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i),
                         _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8),
                         _mm256_castsi256_ps(_mm256_and_si256(v0, hi_mask)), a1);
  }
  float s = HSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += w[i] * Bf16ToFloat(x[i]);
  return s;
}

LEAP_AVX2 float DotF16Avx2(const float* w, const uint16_t* x, int64_t n) {
  return DotAvx2(
      w, n,
      [x](int64_t i) LEAP_AVX2 {
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
      },
      [x](int64_t i) { return Fp16ToFloat(x[i]); });
}

// Sums a[0..3] horizontally into the 4 lanes of the result.
LEAP_AVX2 inline __m128 ReduceFour(const __m256* a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]),
                                  _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Three rows of P against KG (<= 4) vectors over columns [0, jv): 12
// accumulators, 7 loads per 12 FMAs, so the FMA units rather than the load
// ports set the pace. Adds the sums into v[r * k + c].
template <int KG>
LEAP_AVX2 inline void ThreeRowsBlock(const float* p0, int64_t ldp,
                                     const float* u, int64_t ldu, int64_t jv,
                                     float* v, int k) {
  const float* p1 = p0 + ldp;
  const float* p2 = p1 + ldp;
  __m256 acc[3][4];
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < jv; j += 8) {
    const __m256 a = _mm256_loadu_ps(p0 + j);
    const __m256 b = _mm256_loadu_ps(p1 + j);
    const __m256 c = _mm256_loadu_ps(p2 + j);
    for (int q = 0; q < KG; ++q) {
      const __m256 uq = _mm256_loadu_ps(u + q * ldu + j);
      acc[0][q] = _mm256_fmadd_ps(a, uq, acc[0][q]);
      acc[1][q] = _mm256_fmadd_ps(b, uq, acc[1][q]);
      acc[2][q] = _mm256_fmadd_ps(c, uq, acc[2][q]);
    }
  }
  for (int r = 0; r < 3; ++r) {
    alignas(16) float s[4];
    _mm_store_ps(s, ReduceFour(acc[r]));
    for (int q = 0; q < KG; ++q) v[r * k + q] += s[q];
  }
}

template <int K>
LEAP_AVX2 void PanelAvx2K(const float* P, int64_t ldp, int64_t n,
                          const float* U, int64_t ldu, float* V) {
  std::fill(V, V + n * K, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kJBlock) {
    const int64_t jn = std::min(kJBlock, n - j0);
    const int64_t jv = jn & ~int64_t{7};
    const float* u0 = U + j0;
    int64_t i = 0;
    for (; i + 3 <= n; i += 3) {
      const float* p = P + i * ldp + j0;
      // Rows are kJBlock floats of a long stride apart: the hardware
      // prefetcher would restart on every row, so fetch the next rows'
      // segments while these are multiplied.
      if (i + 3 + kPrefetchRows < n) {
        for (int64_t r = 3; r < 3 + kPrefetchRows; ++r) {
          const char* next = reinterpret_cast<const char*>(p + r * ldp);
          for (int64_t b = 0; b < jn * 4; b += 64) {
            _mm_prefetch(next + b, _MM_HINT_T0);
          }
        }
      }
      float* v = V + i * K;
      for (int g = 0; g + 4 <= K; g += 4) {
        ThreeRowsBlock<4>(p, ldp, u0 + g * ldu, ldu, jv, v + g, K);
      }
      constexpr int kRest = K % 4;
      if constexpr (kRest > 0) {
        ThreeRowsBlock<kRest>(p, ldp, u0 + (K - kRest) * ldu, ldu, jv,
                              v + (K - kRest), K);
      }
      for (int64_t r = 0; r < 3; ++r) {
        for (int64_t j = jv; j < jn; ++j) {
          for (int c = 0; c < K; ++c) {
            v[r * K + c] += p[r * ldp + j] * u0[c * ldu + j];
          }
        }
      }
    }
    for (; i < n; ++i) {  // the last n % 3 rows
      const float* p = P + i * ldp + j0;
      for (int c = 0; c < K; ++c) {
        float s = 0;
        for (int64_t j = 0; j < jn; ++j) s += p[j] * u0[c * ldu + j];
        V[i * K + c] += s;
      }
    }
  }
}

LEAP_AVX2 void PanelAvx2(const float* P, int64_t ldp, int64_t n,
                         const float* U, int64_t ldu, int k, float* V) {
  switch (k) {
    case 1: return PanelAvx2K<1>(P, ldp, n, U, ldu, V);
    case 2: return PanelAvx2K<2>(P, ldp, n, U, ldu, V);
    case 3: return PanelAvx2K<3>(P, ldp, n, U, ldu, V);
    case 4: return PanelAvx2K<4>(P, ldp, n, U, ldu, V);
    case 5: return PanelAvx2K<5>(P, ldp, n, U, ldu, V);
    case 6: return PanelAvx2K<6>(P, ldp, n, U, ldu, V);
    case 7: return PanelAvx2K<7>(P, ldp, n, U, ldu, V);
    default: return PanelAvx2K<8>(P, ldp, n, U, ldu, V);
  }
}

// R rows share each load of w: per 16 values, 2 loads of w and 2R of x
// feed 2R FMAs into two accumulators per row.
template <int R>
LEAP_AVX2 void DotRowsF32Avx2R(const float* w, const float* const* x, int64_t n,
                               float* out) {
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + i), a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + i + 8), a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = HSum(_mm256_add_ps(a[r][0], a[r][1]));
    for (int64_t j = i; j < n; ++j) s += w[j] * x[r][j];
    out[r] = s;
  }
}

LEAP_AVX2 void DotRowsF32Avx2(const float* w, const float* const* x, int rows,
                              int64_t n, float* out) {
  switch (rows) {
    case 1: return DotRowsF32Avx2R<1>(w, x, n, out);
    case 2: return DotRowsF32Avx2R<2>(w, x, n, out);
    case 3: return DotRowsF32Avx2R<3>(w, x, n, out);
    default: return DotRowsF32Avx2R<4>(w, x, n, out);
  }
}

template <int R>
LEAP_AVX2 void DotRowsBf16Avx2R(const float* w, const uint16_t* const* x,
                                int64_t n, float* out) {
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + i));
      a[r][0] = _mm256_fmadd_ps(w0, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                                a[r][0]);
      a[r][1] = _mm256_fmadd_ps(
          w1, _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)), a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = HSum(_mm256_add_ps(a[r][0], a[r][1]));
    for (int64_t j = i; j < n; ++j) s += w[j] * Bf16ToFloat(x[r][j]);
    out[r] = s;
  }
}

LEAP_AVX2 void DotRowsBf16Avx2(const float* w, const uint16_t* const* x,
                               int rows, int64_t n, float* out) {
  switch (rows) {
    case 1: return DotRowsBf16Avx2R<1>(w, x, n, out);
    case 2: return DotRowsBf16Avx2R<2>(w, x, n, out);
    case 3: return DotRowsBf16Avx2R<3>(w, x, n, out);
    default: return DotRowsBf16Avx2R<4>(w, x, n, out);
  }
}

constexpr Kernels kAvx2 = {"avx2",         DotF32Avx2,      DotBf16Avx2,
                           DotF16Avx2,     DotRowsF32Avx2,  DotRowsBf16Avx2,
                           PanelAvx2};

bool CpuHasAvx2Fma() {
  __builtin_cpu_init();
  // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}
#endif

}  // namespace

void PermuteForBf16(const float* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 8; ++l) {
      out[i + l] = w[i + 2 * l];
      out[i + 8 + l] = w[i + 2 * l + 1];
    }
  }
  for (; i < n; ++i) out[i] = w[i];
}

const Kernels& PortableKernels() { return kPortable; }

const Kernels& BestKernels() {
#if defined(__x86_64__)
  static const Kernels& best = CpuHasAvx2Fma() ? kAvx2 : kPortable;
  return best;
#else
  return kPortable;
#endif
}

std::vector<const Kernels*> SupportedKernels() {
  std::vector<const Kernels*> out = {&kPortable};
#if defined(__x86_64__)
  if (CpuHasAvx2Fma()) out.push_back(&kAvx2);
#endif
  return out;
}

}  // namespace leap::readout::internal
