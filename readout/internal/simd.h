// The vector operations the readout's kernels and machine probes are written
// with once (sym_sweep.inc, probe_kernels.inc), one struct per instruction
// set, each function compiled for its set with a target attribute (no
// -march needed). Internal to leap::readout.
//
// A struct has: kLanes floats per vector V; Load/Store (unaligned), Set1,
// Zero, Add, Mul, Fma(a, b, c) = a * b + c (rounded once where the set has
// FMA; the portable one may round twice), Sum (the lanes in a fixed order),
// Pin (v must be in a register here: a loaded value used twice is then
// loaded once, not folded into both uses as a memory operand);
// kStrip and kInterleave: how many vectors of columns the sweep's passes
// keep in registers at once (what the register file allows); kPairRows:
// whether its first pass runs two rows at once (kPairInterleave vectors of
// columns each), which needs 2K sums in registers.
#ifndef LEAP_READOUT_INTERNAL_SIMD_H_
#define LEAP_READOUT_INTERNAL_SIMD_H_

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LEAP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LEAP_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace leap::readout::internal::simd {

struct Portable {
  static constexpr int64_t kLanes = 1;
  static constexpr int kStrip = 1;
  static constexpr int kInterleave = 1;
  static constexpr bool kPairRows = false;
  static constexpr int kPairInterleave = 1;
  using V = float;
  static V Load(const float* p) { return *p; }
  static void Store(float* p, V v) { *p = v; }
  static V Set1(float x) { return x; }
  static V Zero() { return 0.0f; }
  static V Add(V a, V b) { return a + b; }
  static V Mul(V a, V b) { return a * b; }
  static V Fma(V a, V b, V c) { return a * b + c; }
  static float Sum(V v) { return v; }
  static void Pin(V&) {}
};

#if defined(__x86_64__)
struct Avx2 {
  static constexpr int64_t kLanes = 8;
  static constexpr int kStrip = 1;  // 16 registers: 8 sums of 1 vector
  static constexpr int kInterleave = 2;
  static constexpr bool kPairRows = false;  // 2K sums would fill the 16 registers
  static constexpr int kPairInterleave = 1;
  using V = __m256;
  LEAP_TARGET_AVX2 static V Load(const float* p) { return _mm256_loadu_ps(p); }
  LEAP_TARGET_AVX2 static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  LEAP_TARGET_AVX2 static V Set1(float x) { return _mm256_set1_ps(x); }
  LEAP_TARGET_AVX2 static V Zero() { return _mm256_setzero_ps(); }
  LEAP_TARGET_AVX2 static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  LEAP_TARGET_AVX2 static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  LEAP_TARGET_AVX2 static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  LEAP_TARGET_AVX2 static float Sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  LEAP_TARGET_AVX2 static void Pin(V& v) { __asm__("" : "+v"(v)); }
};

struct Avx512 {
  static constexpr int64_t kLanes = 16;
  static constexpr int kStrip = 2;  // 16 sums of 32 registers
  static constexpr int kInterleave = 4;
  static constexpr bool kPairRows = true;  // 2K = 16 sums, 2 x 2 rows of P, 4 fold sums
  static constexpr int kPairInterleave = 2;
  using V = __m512;
  LEAP_TARGET_AVX512 static V Load(const float* p) { return _mm512_loadu_ps(p); }
  LEAP_TARGET_AVX512 static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  LEAP_TARGET_AVX512 static V Set1(float x) { return _mm512_set1_ps(x); }
  LEAP_TARGET_AVX512 static V Zero() { return _mm512_setzero_ps(); }
  LEAP_TARGET_AVX512 static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  LEAP_TARGET_AVX512 static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  LEAP_TARGET_AVX512 static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  LEAP_TARGET_AVX512 static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  // out[c] += Sum(a[c]) and out[8 + c] += Sum(b[c]) for c < 8, with the
  // same bits as Sum (each of its four halving steps adds the same pairs of
  // lanes, here for several vectors per instruction): 15 additions and 31
  // shuffles for the 16 sums instead of 16 x 8 operations.
  LEAP_TARGET_AVX512 static void AddSums8x2(const V* a, const V* b, float* out) {
    V x[16];
    for (int c = 0; c < 8; ++c) {
      x[c] = a[c];
      x[8 + c] = b[c];
    }
    // Sum's steps: 256-bit halves, 128-bit halves, then lanes {0,1} +
    // {2,3}, then lane 0 + lane 1.
    V h[8], q[4], r[2];
    for (int m = 0; m < 8; ++m) {
      h[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x44),
                           _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xEE));
    }
    for (int m = 0; m < 4; ++m) {
      q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], 0x88),
                           _mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], 0xDD));
    }
    for (int m = 0; m < 2; ++m) {
      r[m] = _mm512_add_ps(_mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0x44),
                           _mm512_shuffle_ps(q[2 * m], q[2 * m + 1], 0xEE));
    }
    const V s = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88),
                              _mm512_shuffle_ps(r[0], r[1], 0xDD));
    // Lane 4j + g of s holds the sum of x[4g + j]: put it in lane 4g + j.
    const __m512i to = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1,
                                        12, 8, 4, 0);
    const V sums = _mm512_permutexvar_ps(to, s);
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), sums));
  }
  LEAP_TARGET_AVX512 static void Pin(V& v) { __asm__("" : "+v"(v)); }
};
#endif

}  // namespace leap::readout::internal::simd

#endif  // LEAP_READOUT_INTERNAL_SIMD_H_
