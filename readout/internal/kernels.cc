#include "readout/internal/kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/half.h"
#include "readout/internal/simd.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

// GCC 12's AVX-512 intrinsics start several results from an undefined
// register (_mm512_undefined_ps), which -Wuninitialized reports at every
// call site once inlined. The values are fully overwritten.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace leap::readout::internal {
namespace {

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

// ------------------------------------------------------------- gemm_acc
// One micro-tile: C[r, 0..width) += alpha * sum_{p<kc} A(r, p) * Bp[p, ..],
// Bp packed as kc rows of `width` floats. Each lane sums p in order from 0.
using MicroFn = void (*)(int rows, int width, int64_t kc, const float* a,
                         int64_t a_rs, int64_t a_cs, const float* bp,
                         float alpha, float* c, int64_t ldc);

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (a copy of
// values: the same bits whichever variant runs).
using TransposeFn = void (*)(const float* src, int64_t lds, int64_t rows,
                             int64_t cols, float* dst, int64_t ldd);

struct MicroSet {
  int mr;  // rows per tile
  int nr;  // floats per packed panel (a multiple of 16)
  MicroFn micro;
  // Packs the part of a symmetric P's panel that is read from its
  // transpose; nullptr: element by element.
  TransposeFn transpose = nullptr;
  // dst[r * w + x] = src[r * lds + x], r < rows, x < w (w a multiple of
  // 16); nullptr: memcpy row by row (a call per panel row costs as much as
  // the copy of its 64-128 bytes).
  void (*copy_rows)(const float* src, int64_t lds, int64_t rows, int64_t w,
                    float* dst) = nullptr;
};

inline void CopyRows(const MicroSet& ms, const float* src, int64_t lds,
                     int64_t rows, int64_t w, float* dst) {
  if (ms.copy_rows != nullptr) return ms.copy_rows(src, lds, rows, w, dst);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * w, src + r * lds, sizeof(float) * w);
  }
}

// Columns of B packed per pass (kGemmKc x kNc floats = 256 KiB: stays in L2
// while every row tile of A runs over it).
constexpr int64_t kNc = 512;

float* PackBuffer() {
  struct Buf {
    float* p = nullptr;
    ~Buf() { std::free(p); }
  };
  thread_local Buf buf;
  if (buf.p == nullptr) {
    buf.p = static_cast<float*>(
        std::aligned_alloc(64, sizeof(float) * kGemmKc * kNc));
  }
  return buf.p;
}

// pack_b(dst, pc, kc, j, w) returns B[pc.., j..] as kc rows of w floats:
// written to dst, or where they already lie packed.
template <typename PackB>
void GemmDriverT(const MicroSet& ms, int64_t m, int64_t N, int64_t K,
                 float alpha, const float* A, int64_t a_rs, int64_t a_cs,
                 const PackB& pack_b, float* C, int64_t ldc) {
  float* buf = PackBuffer();
  // A packed once for the whole call (not once per column block of B): for
  // each block of kGemmKc terms, tile by tile (mr rows, p-major): rows of A
  // a long stride apart would all fall into the same L1 sets.
  thread_local std::vector<float> apack;
  const int64_t tiles = (m + ms.mr - 1) / ms.mr;
  const int64_t kblocks = (K + kGemmKc - 1) / kGemmKc;
  const int64_t ablock = tiles * ms.mr * kGemmKc;
  apack.resize(static_cast<size_t>(kblocks * ablock));
  for (int64_t pc = 0; pc < K; pc += kGemmKc) {
    const int64_t kc = std::min(kGemmKc, K - pc);
    float* blk = apack.data() + (pc / kGemmKc) * ablock;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t ir = t * ms.mr;
      const int rows = static_cast<int>(std::min<int64_t>(ms.mr, m - ir));
      const float* a = A + ir * a_rs + pc * a_cs;
      float* dst = blk + t * ms.mr * kc;
      if (a_cs == 1) {
        for (int r = 0; r < rows; ++r) {
          const float* ar = a + r * a_rs;
          for (int64_t p = 0; p < kc; ++p) dst[p * ms.mr + r] = ar[p];
        }
      } else {
        for (int64_t p = 0; p < kc; ++p) {
          for (int r = 0; r < rows; ++r) dst[p * ms.mr + r] = a[r * a_rs + p * a_cs];
        }
      }
    }
  }
  for (int64_t jc = 0; jc < N; jc += kNc) {
    const int64_t nc = std::min(kNc, N - jc);
    for (int64_t pc = 0; pc < K; pc += kGemmKc) {
      const int64_t kc = std::min(kGemmKc, K - pc);
      const float* blk = apack.data() + (pc / kGemmKc) * ablock;
      // Pack B[pc.., jc..] panel by panel: kc rows of `w` floats each.
      const float* panel[kNc / 16];
      for (int64_t jr = 0; jr < nc; jr += ms.nr) {
        const int64_t w = std::min<int64_t>(ms.nr, nc - jr);
        panel[jr / ms.nr] = pack_b(buf + jr * kc, pc, kc, jc + jr, w);
      }
      // BLIS order: a B micro-panel stays in L1 while the A tiles stream
      // from L2 past it.
      for (int64_t jr = 0; jr < nc; jr += ms.nr) {
        const int w = static_cast<int>(std::min<int64_t>(ms.nr, nc - jr));
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t ir = t * ms.mr;
          const int rows = static_cast<int>(std::min<int64_t>(ms.mr, m - ir));
          // The next tile's C rows (a long stride apart) are fetched while
          // this one computes; here, not in the micro-kernel, whose
          // registers are all taken.
          if (t + 1 < tiles) {
            const float* cn = C + (ir + ms.mr) * ldc + jc + jr;
            const int next = static_cast<int>(std::min<int64_t>(ms.mr, m - ir - ms.mr));
            for (int r = 0; r < next; ++r) {
              for (int x = 0; x < w; x += 16) __builtin_prefetch(cn + r * ldc + x, 1, 3);
            }
          }
          ms.micro(rows, w, kc, blk + t * ms.mr * kc, 1, ms.mr,
                   panel[jr / ms.nr], alpha, C + ir * ldc + jc + jr, ldc);
        }
      }
    }
  }
}

void GemmDriver(const MicroSet& ms, int64_t m, int64_t N, int64_t K,
                float alpha, const float* A, int64_t a_rs, int64_t a_cs,
                const float* B, int64_t ldb, float* C, int64_t ldc) {
  GemmDriverT(
      ms, m, N, K, alpha, A, a_rs, a_cs,
      [&ms, B, ldb](float* dst, int64_t pc, int64_t kc, int64_t j, int64_t w) {
        CopyRows(ms, B + pc * ldb + j, ldb, kc, w, dst);
        return static_cast<const float*>(dst);
      },
      C, ldc);
}

// Panel q of a matrix packed by PackPanels: its K rows of min(nr, N - q nr)
// floats start at q * nr * K; rows pc.. at pc times the panel's width.
void GemmPackedDriver(const MicroSet& ms, int64_t m, int64_t N, int64_t K,
                      float alpha, const float* A, int64_t a_rs, int64_t a_cs,
                      const float* Bp, int64_t n_packed, int64_t j0, float* C,
                      int64_t ldc) {
  LEAP_CHECK_EQ(j0 % ms.nr, 0) << "packed panels start at multiples of " << ms.nr;
  LEAP_CHECK_EQ(reinterpret_cast<uintptr_t>(Bp) % 64, 0u) << "packed B not 64-byte aligned";
  LEAP_CHECK(j0 + N == n_packed || (N % ms.nr == 0 && j0 + N <= n_packed))
      << "columns [" << j0 << ", " << j0 + N << ") of " << n_packed
      << " packed in panels of " << ms.nr;
  GemmDriverT(
      ms, m, N, K, alpha, A, a_rs, a_cs,
      [Bp, j0, K](float*, int64_t pc, int64_t, int64_t jrel, int64_t w) {
        return Bp + (j0 + jrel) * K + pc * w;
      },
      C, ldc);
}

// B = columns j0.. of the K x K symmetric P of which only the blocks on and
// above the diagonal of kSymBlock x kSymBlock blocks are valid: P(p, j) is
// read at [p][j] when p's block is not below j's, else at [j][p]. Rows
// j >= K (padding columns) are zero. The packed panel holds the same values
// as for a fully stored P, so the result is bit for bit gemm_acc's.
void GemmSymDriver(const MicroSet& ms, int64_t m, int64_t N, int64_t K,
                   float alpha, const float* A, int64_t a_rs, int64_t a_cs,
                   const float* P, int64_t ldp, int64_t j0, float* C,
                   int64_t ldc) {
  GemmDriverT(
      ms, m, N, K, alpha, A, a_rs, a_cs,
      [&ms, P, ldp, j0, K](float* dst, int64_t pc, int64_t kc, int64_t jrel,
                           int64_t w) {
        const int64_t j = j0 + jrel;
        // Rows below `e` are read directly; panels never straddle a block
        // boundary when kSymBlock is a multiple of the panel width, but each
        // column is checked anyway.
        const int64_t e_first = (j / kSymBlock + 1) * kSymBlock;
        const int64_t direct_end = std::clamp<int64_t>(e_first, pc, pc + kc);
        CopyRows(ms, P + pc * ldp + j, ldp, direct_end - pc, w, dst);
        if (direct_end == pc + kc) return static_cast<const float*>(dst);
        // A panel within one block column and within P: every row from
        // direct_end on is the transpose of the panel's own rows of P.
        if (ms.transpose != nullptr && j + w <= K &&
            (j + w - 1) / kSymBlock == j / kSymBlock) {
          ms.transpose(P + j * ldp + direct_end, ldp, w, pc + kc - direct_end,
                       dst + (direct_end - pc) * w, w);
          return static_cast<const float*>(dst);
        }
        for (int64_t x = 0; x < w; ++x) {
          const int64_t jj = j + x;
          const int64_t e = (jj / kSymBlock + 1) * kSymBlock;
          float* d = dst + x;
          if (jj >= K) {
            for (int64_t p = direct_end; p < pc + kc; ++p) d[(p - pc) * w] = 0.0f;
            continue;
          }
          const float* row = P + jj * ldp;
          for (int64_t p = direct_end; p < pc + kc; ++p) {
            d[(p - pc) * w] = p < e ? P[p * ldp + jj] : row[p];
          }
        }
        return static_cast<const float*>(dst);
      },
      C, ldc);
}

void MicroPortable(int rows, int width, int64_t kc, const float* a,
                   int64_t a_rs, int64_t a_cs, const float* bp, float alpha,
                   float* c, int64_t ldc) {
  for (int r = 0; r < rows; ++r) {
    float acc[16];
    for (int j0 = 0; j0 < width; j0 += 16) {
      for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
      for (int64_t p = 0; p < kc; ++p) {
        const float ar = a[r * a_rs + p * a_cs];
        const float* b = bp + p * width + j0;
        for (int l = 0; l < 16; ++l) acc[l] += ar * b[l];
      }
      for (int l = 0; l < 16; ++l) c[r * ldc + j0 + l] += alpha * acc[l];
    }
  }
}

void GemmAccPortable(int64_t m, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t a_rs, int64_t a_cs,
                     const float* B, int64_t ldb, float* C, int64_t ldc) {
  GemmDriver({4, 16, MicroPortable}, m, N, K, alpha, A, a_rs, a_cs, B, ldb, C,
             ldc);
}

void GemmAccPackedPortable(int64_t m, int64_t N, int64_t K, float alpha,
                           const float* A, int64_t a_rs, int64_t a_cs,
                           const float* Bp, int64_t n_packed, int64_t j0,
                           float* C, int64_t ldc) {
  GemmPackedDriver({4, 16, MicroPortable}, m, N, K, alpha, A, a_rs, a_cs, Bp,
                   n_packed, j0, C, ldc);
}

void DotF64BlockPortable(const float* X, int64_t ldx, const float* Y,
                         int64_t ldy, int64_t k, int64_t n, double* S,
                         int64_t lds) {
  for (int64_t a = 0; a < k; ++a) {
    for (int64_t b = a; b < k; ++b) {
      double acc[4] = {0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        for (int l = 0; l < 4; ++l) {
          acc[l] += double{X[a * ldx + j + l]} * double{Y[b * ldy + j + l]};
        }
      }
      double s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      for (; j < n; ++j) s += double{X[a * ldx + j]} * double{Y[b * ldy + j]};
      S[a * lds + b] = s;
    }
  }
}

void GemmAccSymPortable(int64_t m, int64_t N, int64_t K, float alpha,
                        const float* A, int64_t a_rs, int64_t a_cs,
                        const float* P, int64_t ldp, int64_t j0, float* C,
                        int64_t ldc) {
  GemmSymDriver({4, 16, MicroPortable}, m, N, K, alpha, A, a_rs, a_cs, P, ldp,
                j0, C, ldc);
}

// The fused sweep in portable C++ (Fma may round twice here).
namespace portable_sweep {
#define LEAP_ISA
using Vec = simd::Portable;
#include "readout/internal/sym_sweep.inc"
#undef LEAP_ISA
}  // namespace portable_sweep

constexpr Kernels kPortable = {"portable",         DotF32Portable,
                               DotBf16Portable,    DotF16Portable,
                               DotRowsF32Portable, DotRowsBf16Portable,
                               portable_sweep::SymSweep, GemmAccPortable,
                               DotF64BlockPortable, GemmAccSymPortable,
                               16, GemmAccPackedPortable};

#if defined(__x86_64__)
// ---------------------------------------------------------------- AVX2+FMA
#define LEAP_AVX2 LEAP_TARGET_AVX2

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

// gemm_acc micro-tile: up to 6 rows x 16 columns, 12 accumulators.
constexpr int kMrAvx2 = 6;
template <int R>
LEAP_AVX2 void MicroAvx2R(int64_t kc, const float* a, int64_t a_rs,
                          int64_t a_cs, const float* bp, float alpha, float* c,
                          int64_t ldc) {
  // A packed tile by tile: a_rs = 1, a_cs = kMrAvx2, as constants.
  (void)a_rs;
  (void)a_cs;
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(bp + p * 16);
    const __m256 b1 = _mm256_load_ps(bp + p * 16 + 8);
    const float* ap = a + p * kMrAvx2;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 ar = _mm256_broadcast_ss(ap + r);
      acc[r][0] = _mm256_fmadd_ps(ar, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(ar, b1, acc[r][1]);
    }
  }
  const __m256 al = _mm256_set1_ps(alpha);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * ldc;
    _mm256_storeu_ps(cr, _mm256_fmadd_ps(al, acc[r][0], _mm256_loadu_ps(cr)));
    _mm256_storeu_ps(cr + 8,
                     _mm256_fmadd_ps(al, acc[r][1], _mm256_loadu_ps(cr + 8)));
  }
}

LEAP_AVX2 void MicroAvx2(int rows, int /*width = 16*/, int64_t kc,
                         const float* a, int64_t a_rs, int64_t a_cs,
                         const float* bp, float alpha, float* c, int64_t ldc) {
  switch (rows) {
    case 1: return MicroAvx2R<1>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 2: return MicroAvx2R<2>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 3: return MicroAvx2R<3>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 4: return MicroAvx2R<4>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 5: return MicroAvx2R<5>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    default: return MicroAvx2R<6>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
  }
}

// An 8 x 8 block: rows of src (stride lds) become columns of dst (stride
// ldd), in three rounds of shuffles (pairs, quads, 128-bit halves).
LEAP_AVX2 inline void Transpose8x8Avx2(const float* src, int64_t lds,
                                       float* dst, int64_t ldd) {
  __m256 r[8], t[8], q[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    q[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    q[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    q[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    q[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(q[i], q[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd,
                     _mm256_permute2f128_ps(q[i], q[i + 4], 0x31));
  }
}

LEAP_AVX2 void TransposeAvx2(const float* src, int64_t lds, int64_t rows,
                             int64_t cols, float* dst, int64_t ldd) {
  const int64_t c8 = cols / 8 * 8, r8 = rows / 8 * 8;
  for (int64_t r = 0; r < r8; r += 8) {
    for (int64_t c = 0; c < c8; c += 8) {
      Transpose8x8Avx2(src + r * lds + c, lds, dst + c * ldd + r, ldd);
    }
  }
  // The ragged edges element by element.
  for (int64_t c = c8; c < cols; ++c) {
    for (int64_t i = 0; i < r8; ++i) dst[c * ldd + i] = src[i * lds + c];
  }
  for (int64_t i = r8; i < rows; ++i) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + i] = src[i * lds + c];
  }
}

LEAP_AVX2 void CopyRowsAvx2(const float* src, int64_t lds, int64_t rows,
                            int64_t w, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t x = 0; x < w; x += 8) {
      _mm256_storeu_ps(dst + r * w + x, _mm256_loadu_ps(src + r * lds + x));
    }
  }
}

void GemmAccAvx2(int64_t m, int64_t N, int64_t K, float alpha, const float* A,
                 int64_t a_rs, int64_t a_cs, const float* B, int64_t ldb,
                 float* C, int64_t ldc) {
  GemmDriver({kMrAvx2, 16, MicroAvx2, nullptr, CopyRowsAvx2}, m, N, K, alpha, A, a_rs, a_cs, B, ldb, C,
             ldc);
}

void GemmAccSymAvx2(int64_t m, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t a_rs, int64_t a_cs, const float* P,
                    int64_t ldp, int64_t j0, float* C, int64_t ldc) {
  GemmSymDriver({kMrAvx2, 16, MicroAvx2, TransposeAvx2, CopyRowsAvx2}, m, N, K, alpha, A, a_rs, a_cs, P, ldp, j0,
                C, ldc);
}

void GemmAccPackedAvx2(int64_t m, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t a_rs, int64_t a_cs,
                       const float* Bp, int64_t n_packed, int64_t j0, float* C,
                       int64_t ldc) {
  GemmPackedDriver({kMrAvx2, 16, MicroAvx2, nullptr, CopyRowsAvx2}, m, N, K,
                   alpha, A, a_rs, a_cs, Bp, n_packed, j0, C, ldc);
}

// FP64 dot products of float rows: RA rows of X against RB rows of Y.
template <int RA, int RB>
LEAP_AVX2 void DotF64TileAvx2(const float* X, int64_t ldx, const float* Y,
                              int64_t ldy, int64_t n, double* S, int64_t lds) {
  __m256d acc[RA][RB];
  for (int a = 0; a < RA; ++a)
    for (int b = 0; b < RB; ++b) acc[a][b] = _mm256_setzero_pd();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256d x[RA], y[RB];
    for (int a = 0; a < RA; ++a) x[a] = _mm256_cvtps_pd(_mm_loadu_ps(X + a * ldx + j));
    for (int b = 0; b < RB; ++b) y[b] = _mm256_cvtps_pd(_mm_loadu_ps(Y + b * ldy + j));
    for (int a = 0; a < RA; ++a)
      for (int b = 0; b < RB; ++b) acc[a][b] = _mm256_fmadd_pd(x[a], y[b], acc[a][b]);
  }
  for (int a = 0; a < RA; ++a) {
    for (int b = 0; b < RB; ++b) {
      alignas(32) double t[4];
      _mm256_store_pd(t, acc[a][b]);
      double s = (t[0] + t[1]) + (t[2] + t[3]);
      for (int64_t jj = j; jj < n; ++jj) {
        s += double{X[a * ldx + jj]} * double{Y[b * ldy + jj]};
      }
      S[a * lds + b] = s;
    }
  }
}

LEAP_AVX2 void DotF64BlockAvx2(const float* X, int64_t ldx, const float* Y,
                               int64_t ldy, int64_t k, int64_t n, double* S,
                               int64_t lds) {
  int64_t a = 0;
  for (; a + 2 <= k; a += 2) {
    int64_t b = a;
    for (; b + 4 <= k; b += 4) {
      DotF64TileAvx2<2, 4>(X + a * ldx, ldx, Y + b * ldy, ldy, n,
                           S + a * lds + b, lds);
    }
    for (; b < k; ++b) {
      DotF64TileAvx2<2, 1>(X + a * ldx, ldx, Y + b * ldy, ldy, n,
                           S + a * lds + b, lds);
    }
  }
  for (; a < k; ++a) {
    for (int64_t b = a; b < k; ++b) {
      DotF64TileAvx2<1, 1>(X + a * ldx, ldx, Y + b * ldy, ldy, n,
                           S + a * lds + b, lds);
    }
  }
}

namespace avx2_sweep {
#define LEAP_ISA LEAP_AVX2
using Vec = simd::Avx2;
#include "readout/internal/sym_sweep.inc"
#undef LEAP_ISA
}  // namespace avx2_sweep

constexpr Kernels kAvx2 = {"avx2",         DotF32Avx2,      DotBf16Avx2,
                           DotF16Avx2,     DotRowsF32Avx2,  DotRowsBf16Avx2,
                           avx2_sweep::SymSweep, GemmAccAvx2, DotF64BlockAvx2,
                           GemmAccSymAvx2,  16,              GemmAccPackedAvx2};

bool CpuHasAvx2Fma() {
  __builtin_cpu_init();
  // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c").
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}
// ---------------------------------------------------------------- AVX-512
#define LEAP_AVX512 LEAP_TARGET_AVX512

// Four 16-float accumulators (64 floats per iteration): measured on an AMD
// EPYC (Zen 5) with features streaming from L2, eight accumulators (128
// floats per iteration) ran 0.9x as fast as four (the loads, not the FMA
// latency, bound a dot product). The tail is one masked load, never a
// scalar loop. The weights are 64-byte aligned (FoldedReadout), so only x's
// loads can span two cache lines. The summation order depends on n only
// (not on where x lies), so fp16 features give the same result as the same
// values in fp32.
template <typename Load16, typename LoadMasked>
LEAP_AVX512 inline float DotAvx512(const float* w, int64_t n, Load16 load16,
                                   LoadMasked load_masked) {
  constexpr int kAcc = 4;
  __m512 a[kAcc];
  for (int q = 0; q < kAcc; ++q) a[q] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 * kAcc <= n; i += 16 * kAcc) {
#pragma GCC unroll 4
    for (int q = 0; q < kAcc; ++q) {
      a[q] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16 * q), load16(i + 16 * q), a[q]);
    }
  }
  for (int q = 0; i + 16 <= n; i += 16, ++q) {
    a[q] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), load16(i), a[q]);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    a[kAcc - 1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i),
                                  load_masked(i, m), a[kAcc - 1]);
  }
  const __m512 s =
      _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  return _mm512_reduce_add_ps(s);
}

LEAP_AVX512 float DotF32Avx512(const float* w, const float* x, int64_t n) {
  return DotAvx512(
      w, n, [x](int64_t i) LEAP_AVX512 { return _mm512_loadu_ps(x + i); },
      [x](int64_t i, __mmask16 m) LEAP_AVX512 {
        return _mm512_maskz_loadu_ps(m, x + i);
      });
}

LEAP_AVX512 float DotF16Avx512(const float* w, const uint16_t* x, int64_t n) {
  return DotAvx512(
      w, n,
      [x](int64_t i) LEAP_AVX512 {
        return _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
      },
      [x](int64_t i, __mmask16 m) LEAP_AVX512 {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x + i));
      });
}

// w in PermuteForBf16 order (blocks of 16: 8 even-index then 8 odd-index
// weights). 32 bf16 per 64-byte load: shifting the 32-bit lanes left by 16
// gives the even elements of both 16-blocks, masking the low half the odd
// ones; two lane shuffles regroup the weights to match.
LEAP_AVX512 float DotBf16Avx512(const float* w, const uint16_t* x, int64_t n) {
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i v0 = _mm512_loadu_si512(x + i);
    const __m512i v1 = _mm512_loadu_si512(x + i + 32);
    const __m512 wa = _mm512_loadu_ps(w + i), wb = _mm512_loadu_ps(w + i + 16);
    const __m512 wc = _mm512_loadu_ps(w + i + 32), wd = _mm512_loadu_ps(w + i + 48);
    a0 = _mm512_fmadd_ps(_mm512_shuffle_f32x4(wa, wb, 0x44),
                         _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), a0);
    a1 = _mm512_fmadd_ps(_mm512_shuffle_f32x4(wa, wb, 0xEE),
                         _mm512_castsi512_ps(_mm512_and_si512(v0, hi_mask)), a1);
    a2 = _mm512_fmadd_ps(_mm512_shuffle_f32x4(wc, wd, 0x44),
                         _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), a2);
    a3 = _mm512_fmadd_ps(_mm512_shuffle_f32x4(wc, wd, 0xEE),
                         _mm512_castsi512_ps(_mm512_and_si512(v1, hi_mask)), a3);
  }
  float s = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  if (i < n) s += DotBf16Avx2(w + i, x + i, n - i);  // blocks of 16, then tail
  return s;
}

// gemm_acc micro-tile: up to 12 rows x 32 columns, 24 accumulators.
constexpr int kMrAvx512 = 12;
template <int R, int NV>
LEAP_AVX512 void MicroAvx512R(int64_t kc, const float* a, int64_t a_rs,
                              int64_t a_cs, const float* bp, float alpha,
                              float* c, int64_t ldc) {
  constexpr int kW = 16 * NV;
  // The driver packs A tile by tile: a_rs = 1, a_cs = kMr, as constants
  // (runtime strides cost an address computation per broadcast).
  (void)a_rs;
  (void)a_cs;
  __m512 acc[R][NV];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p) {
    __m512 b[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(bp + p * kW + 16 * v);
    const float* ap = a + p * kMrAvx512;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(ap[r]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, b[v], acc[r][v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      float* cr = c + r * ldc + 16 * v;
      _mm512_storeu_ps(cr, _mm512_fmadd_ps(al, acc[r][v], _mm512_loadu_ps(cr)));
    }
  }
}

template <int NV>
LEAP_AVX512 void MicroAvx512W(int rows, int64_t kc, const float* a,
                              int64_t a_rs, int64_t a_cs, const float* bp,
                              float alpha, float* c, int64_t ldc) {
  switch (rows) {
    case 1: return MicroAvx512R<1, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 2: return MicroAvx512R<2, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 3: return MicroAvx512R<3, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 4: return MicroAvx512R<4, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 5: return MicroAvx512R<5, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 6: return MicroAvx512R<6, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 7: return MicroAvx512R<7, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 8: return MicroAvx512R<8, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 9: return MicroAvx512R<9, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 10: return MicroAvx512R<10, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    case 11: return MicroAvx512R<11, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
    default: return MicroAvx512R<12, NV>(kc, a, a_rs, a_cs, bp, alpha, c, ldc);
  }
}

LEAP_AVX512 void MicroAvx512(int rows, int width, int64_t kc, const float* a,
                             int64_t a_rs, int64_t a_cs, const float* bp,
                             float alpha, float* c, int64_t ldc) {
  if (width == 32) return MicroAvx512W<2>(rows, kc, a, a_rs, a_cs, bp, alpha, c, ldc);
  return MicroAvx512W<1>(rows, kc, a, a_rs, a_cs, bp, alpha, c, ldc);
}

LEAP_AVX512 void CopyRowsAvx512(const float* src, int64_t lds, int64_t rows,
                                int64_t w, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t x = 0; x < w; x += 16) {
      _mm512_storeu_ps(dst + r * w + x, _mm512_loadu_ps(src + r * lds + x));
    }
  }
}

void GemmAccAvx512(int64_t m, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                   int64_t ldb, float* C, int64_t ldc) {
  GemmDriver({kMrAvx512, 32, MicroAvx512, nullptr, CopyRowsAvx512}, m, N, K, alpha, A, a_rs, a_cs, B, ldb, C,
             ldc);
}

void GemmAccSymAvx512(int64_t m, int64_t N, int64_t K, float alpha,
                      const float* A, int64_t a_rs, int64_t a_cs,
                      const float* P, int64_t ldp, int64_t j0, float* C,
                      int64_t ldc) {
  GemmSymDriver({kMrAvx512, 32, MicroAvx512, TransposeAvx2, CopyRowsAvx512}, m, N, K, alpha, A, a_rs, a_cs, P, ldp,
                j0, C, ldc);
}

void GemmAccPackedAvx512(int64_t m, int64_t N, int64_t K, float alpha,
                         const float* A, int64_t a_rs, int64_t a_cs,
                         const float* Bp, int64_t n_packed, int64_t j0,
                         float* C, int64_t ldc) {
  GemmPackedDriver({kMrAvx512, 32, MicroAvx512, nullptr, CopyRowsAvx512}, m, N,
                   K, alpha, A, a_rs, a_cs, Bp, n_packed, j0, C, ldc);
}

// RA x RB dots of rows already converted to FP64 (stride ld, n a multiple
// of 8), summed per lane then across lanes; S[a * lds + b] = the sum.
template <int RA, int RB>
LEAP_AVX512 void DotF64TileAvx512(const double* X, const double* Y, int64_t ld,
                                  int64_t n, double* S, int64_t lds) {
  __m512d acc[RA][RB];
#pragma GCC unroll 4
  for (int a = 0; a < RA; ++a)
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) acc[a][b] = _mm512_setzero_pd();
  for (int64_t j = 0; j < n; j += 8) {
    __m512d x[RA];
#pragma GCC unroll 4
    for (int a = 0; a < RA; ++a) x[a] = _mm512_load_pd(X + a * ld + j);
#pragma GCC unroll 4
    for (int b = 0; b < RB; ++b) {
      const __m512d y = _mm512_load_pd(Y + b * ld + j);
#pragma GCC unroll 4
      for (int a = 0; a < RA; ++a) acc[a][b] = _mm512_fmadd_pd(x[a], y, acc[a][b]);
    }
  }
#pragma GCC unroll 4
  for (int a = 0; a < RA; ++a) {
    if constexpr (RB == 4) {
      // The four sums of row a at once: pairs within 128-bit lanes, then the
      // lanes (a fixed order, a quarter of the shuffles of four reductions).
      const __m512d t01 = _mm512_add_pd(_mm512_unpacklo_pd(acc[a][0], acc[a][1]),
                                        _mm512_unpackhi_pd(acc[a][0], acc[a][1]));
      const __m512d t23 = _mm512_add_pd(_mm512_unpacklo_pd(acc[a][2], acc[a][3]),
                                        _mm512_unpackhi_pd(acc[a][2], acc[a][3]));
      const __m512d w = _mm512_add_pd(_mm512_shuffle_f64x2(t01, t23, 0x88),
                                      _mm512_shuffle_f64x2(t01, t23, 0xDD));
      const __m512d r = _mm512_shuffle_f64x2(w, w, 0xD8);
      const __m256d sum = _mm256_add_pd(_mm512_castpd512_pd256(r),
                                        _mm512_extractf64x4_pd(r, 1));
      _mm256_storeu_pd(S + a * lds, sum);
    } else {
      for (int b = 0; b < RB; ++b) S[a * lds + b] = _mm512_reduce_add_pd(acc[a][b]);
    }
  }
}

LEAP_AVX512 void DotF64BlockAvx512(const float* X, int64_t ldx,
                                   const float* Y, int64_t ldy, int64_t k,
                                   int64_t n, double* S, int64_t lds) {
  // Columns in blocks of 256, converted to FP64 once per block (k x 256
  // doubles each, zero-padded to a multiple of 8; they stay in L2 while
  // every tile runs over them, and no tile converts); S accumulates the
  // blocks in order. (The 4 x 4 tiles sum their lanes pairwise, the edge
  // tiles with _mm512_reduce_add_pd: deterministic, but an entry's last
  // bit depends on which tile it falls in.)
  constexpr int64_t kJb = 256;
  // Thread-local buffers (a fresh 1.5 MiB allocation per call at k = 256
  // would be mapped and zeroed by the kernel page by page every batch).
  // Kept only up to k = 512 (4 MiB); wider calls allocate their own.
  thread_local std::vector<double> kept;
  std::vector<double> wide;
  const size_t need = static_cast<size_t>(k * k + 2 * k * kJb + 8);
  constexpr size_t kKeepMax = 512 * 512 + 2 * 512 * kJb + 8;
  std::vector<double>& buf = need <= kKeepMax ? kept : wide;
  if (buf.size() < need) buf.resize(need);
  double* xd = buf.data() + (8 - reinterpret_cast<uintptr_t>(buf.data()) / 8 % 8) % 8;
  double* yd = xd + k * kJb;
  double* part = yd + k * kJb;
  for (int64_t a = 0; a < k; ++a) {
    for (int64_t b = a; b < k; ++b) S[a * lds + b] = 0.0;
  }
  for (int64_t j0 = 0; j0 < n; j0 += kJb) {
    const int64_t jn = std::min(kJb, n - j0);
    const int64_t jn8 = (jn + 7) / 8 * 8;
    for (int64_t a = 0; a < k; ++a) {
      for (int64_t j = 0; j < jn; ++j) {
        xd[a * kJb + j] = X[a * ldx + j0 + j];
        yd[a * kJb + j] = Y[a * ldy + j0 + j];
      }
      for (int64_t j = jn; j < jn8; ++j) xd[a * kJb + j] = yd[a * kJb + j] = 0.0;
    }
    int64_t a = 0;
    for (; a + 4 <= k; a += 4) {
      int64_t b = a;
      for (; b + 4 <= k; b += 4) {
        DotF64TileAvx512<4, 4>(xd + a * kJb, yd + b * kJb, kJb, jn8,
                               part + a * k + b, k);
      }
      for (; b < k; ++b) {
        DotF64TileAvx512<4, 1>(xd + a * kJb, yd + b * kJb, kJb, jn8,
                               part + a * k + b, k);
      }
    }
    for (; a < k; ++a) {
      for (int64_t b = a; b < k; ++b) {
        DotF64TileAvx512<1, 1>(xd + a * kJb, yd + b * kJb, kJb, jn8,
                               part + a * k + b, k);
      }
    }
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t c = r; c < k; ++c) S[r * lds + c] += part[r * k + c];
    }
  }
}

namespace avx512_sweep {
#define LEAP_ISA LEAP_AVX512
using Vec = simd::Avx512;
#include "readout/internal/sym_sweep.inc"
#undef LEAP_ISA
}  // namespace avx512_sweep

constexpr Kernels kAvx512 = {"avx512",        DotF32Avx512,      DotBf16Avx512,
                             DotF16Avx512,    DotRowsF32Avx2,    DotRowsBf16Avx2,
                             avx512_sweep::SymSweep, GemmAccAvx512, DotF64BlockAvx512,
                             GemmAccSymAvx512, 32,              GemmAccPackedAvx512};

bool CpuHasAvx512() {
  if (!CpuHasAvx2Fma()) return false;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return false;
  // The OS must save the opmask and the upper zmm state (XCR0 bits 5-7)
  // besides SSE/AVX (bits 1-2).
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0xE6) != 0xE6) return false;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (ebx & bit_AVX512F) && (ebx & bit_AVX512BW) && (ebx & bit_AVX512VL);
}
#endif

}  // namespace

void PackPanels(const Kernels& kernels, const float* B, int64_t ldb, int64_t K,
                int64_t N, float* out) {
  const int64_t nr = kernels.panel_floats;
  for (int64_t j = 0; j < N; j += nr) {
    const int64_t w = std::min(nr, N - j);
    float* dst = out + j * K;
    for (int64_t p = 0; p < K; ++p) {
      std::memcpy(dst + p * w, B + p * ldb + j, sizeof(float) * w);
    }
  }
}

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
  static const Kernels& best = *SupportedKernels().back();
  return best;
}

std::vector<const Kernels*> SupportedKernels() {
  std::vector<const Kernels*> out = {&kPortable};
#if defined(__x86_64__)
  static const bool avx2 = CpuHasAvx2Fma();
  static const bool avx512 = CpuHasAvx512();
  if (avx2) out.push_back(&kAvx2);
  if (avx512) out.push_back(&kAvx512);
#endif
  return out;
}

const Kernels* KernelsByName(const std::string& name) {
  for (const Kernels* k : SupportedKernels()) {
    if (name == k->name) return k;
  }
  return nullptr;
}

bool CpuSupports(const std::string& name) {
  return KernelsByName(name) != nullptr;
}

}  // namespace leap::readout::internal
