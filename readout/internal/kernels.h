// Hot loops of the readout: the prediction dot product, the RLS fused
// sweep for small batches, the RLS block products (gemm_acc, sym_dot_f64). Each has a
// portable version, an AVX2+FMA+F16C version and an AVX-512 (F/BW/VL)
// version, compiled into the same binary with per-function target
// attributes (no -march needed); BestKernels() picks one from CPUID (and the
// OS's XSAVE state) once. Internal to leap::readout.
#ifndef LEAP_READOUT_INTERNAL_KERNELS_H_
#define LEAP_READOUT_INTERNAL_KERNELS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace leap::readout::internal {

// Rows per dot_rows call.
inline constexpr int kMaxRows = 4;

// The widest batch the fused sweep (sym_sweep) handles in one pass over P.
inline constexpr int kPanelMaxVectors = 8;

// gemm_acc sums over p in blocks of this many terms (fixed, so that a
// result never depends on how rows or columns are split).
inline constexpr int64_t kGemmKc = 128;

// RlsState keeps P's lower triangle stale between folds except inside the
// diagonal blocks of this many rows and columns (the fold's row blocks);
// gemm_acc_sym reads the rest from the upper triangle.
inline constexpr int64_t kSymBlock = 96;

struct Kernels {
  const char* name;
  // sum_i w[i] * x[i], fp32 accumulation over many lanes; x contiguous.
  // A NaN or Inf anywhere in x makes the result non-finite.
  float (*dot_f32)(const float* w, const float* x, int64_t n);
  // bf16 takes its weights in the layout of PermuteForBf16 (so each 32-byte
  // load of 16 bf16 values splits into even and odd lanes with one shift and
  // one mask, no widening).
  float (*dot_bf16)(const float* w_bf16, const uint16_t* x, int64_t n);
  float (*dot_f16)(const float* w, const uint16_t* x, int64_t n);
  // out[r] = sum_i w[i] * x[r][i] for r < rows, 1 <= rows <= kMaxRows: one
  // pass over w for several requests (fewer loads per FMA, and several
  // feature streams in flight when they come from L3). Each row's result
  // depends only on that row, whatever `rows` is (two accumulators per row,
  // a different summation order from dot_f32).
  void (*dot_rows_f32)(const float* w, const float* const* x, int rows,
                       int64_t n, float* out);
  // The same for bf16 rows, w in PermuteForBf16 order.
  void (*dot_rows_bf16)(const float* w_bf16, const uint16_t* const* x,
                        int rows, int64_t n, float* out);
  // The fused small-batch sweep over one row block of the symmetric P:
  // rows [r0, r1) (r0 a multiple of kSymBlock, r1 - r0 <= kSymBlock, r1 <=
  // n), columns [r0, ldp); only these blocks on and above the diagonal
  // blocks are read or written. With `fold`, first
  //   P(i, j) += s,  s = -sum_{c<k} W[c][i] * W[c][j]  (c in order)
  // (P rounded once per call; P(i, j) and P(j, i) in the diagonal block get
  // the same bits), then with the updated values
  //   D[(i - r0) * k + c] = sum_{j >= r0} P(i, j) U[c][j]   (overwritten),
  //   T[c * ldt + j] += sum_{r0 <= i < r1} P(i, j) U[c][i]   for j >= r1,
  // so that summing D and the T of every earlier row block gives U P with P
  // read (and written) once, upper triangle only. W and U: k rows of ldu
  // floats, zero from n to ldp (W unused without `fold`); 1 <= k <=
  // kPanelMaxVectors (pad W or U with zero rows to fold and multiply
  // different counts). Each sum runs in an order fixed by r0, r1, n, ldp.
  void (*sym_sweep)(float* P, int64_t ldp, int64_t n, int64_t r0, int64_t r1,
                    int k, bool fold, const float* W, const float* U,
                    int64_t ldu, float* D, float* T, int64_t ldt);
  // C[i*ldc + j] += alpha * sum_{p<K} A[i*a_rs + p*a_cs] * B[p*ldb + j]
  // for i < m, j < N. N must be a multiple of 16 (callers pad their rows).
  // The sum runs over p in blocks of kGemmKc, each block summed in p order
  // from zero and added to C (scaled by alpha): an entry's result does not
  // depend on m, N, or where the entry sits, so splitting rows or columns
  // across threads changes no bit. Packs B itself (thread-local buffer).
  void (*gemm_acc)(int64_t m, int64_t N, int64_t K, float alpha,
                   const float* A, int64_t a_rs, int64_t a_cs, const float* B,
                   int64_t ldb, float* C, int64_t ldc);
  // S[a*lds + b] = sum_{j<n} double(X[a*ldx + j]) * double(Y[b*ldy + j])
  // for a, b < k, accumulated in FP64 (products of floats are exact).
  void (*dot_f64_block)(const float* X, int64_t ldx, const float* Y,
                        int64_t ldy, int64_t k, int64_t n, double* S,
                        int64_t lds);
  // gemm_acc with B = columns j0 .. j0 + N of the K x K symmetric P (row
  // stride ldp) of which only the kSymBlock blocks on and above the block
  // diagonal are read: P(p, j) comes from [p][j] when p / kSymBlock <=
  // j / kSymBlock, else from [j][p]; columns j >= K are zero. Same values,
  // same summation order: the result equals gemm_acc's on the fully stored
  // P bit for bit. j0 a multiple of 16.
  void (*gemm_acc_sym)(int64_t m, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t a_rs, int64_t a_cs,
                       const float* P, int64_t ldp, int64_t j0, float* C,
                       int64_t ldc);
  // Width of the panels gemm_acc packs B into (PackPanels' layout).
  int64_t panel_floats;
  // gemm_acc with B already packed by PackPanels (K rows, n_packed
  // columns), columns j0 .. j0 + N of it: j0 a multiple of panel_floats,
  // and the columns end at n_packed or at a multiple of panel_floats. Same
  // values, same order: bit for bit gemm_acc on the unpacked B. B is packed
  // once for many calls instead of once per call.
  void (*gemm_acc_packed)(int64_t m, int64_t N, int64_t K, float alpha,
                          const float* A, int64_t a_rs, int64_t a_cs,
                          const float* Bp, int64_t n_packed, int64_t j0,
                          float* C, int64_t ldc);
};

// Packs the K x N matrix B (row stride ldb, N a multiple of 16) for
// kernels.gemm_acc_packed into out (K * N floats, 64-byte aligned): panel q (columns q nr ..,
// nr = kernels.panel_floats) at out + q nr K, its K rows of min(nr, N - q nr)
// floats one after another.
void PackPanels(const Kernels& kernels, const float* B, int64_t ldb, int64_t K,
                int64_t N, float* out);

// Reorders w for dot_bf16: every full block of 16 becomes its 8 even-index
// entries then its 8 odd-index entries; the tail (n % 16) keeps its order.
void PermuteForBf16(const float* w, int64_t n, float* out);

// The portable kernels (any x86-64 or other CPU).
const Kernels& PortableKernels();
// The fastest kernels this CPU supports. Thread-safe.
const Kernels& BestKernels();
// The supported kernel set with this name ("portable", "avx2", "avx512"),
// or nullptr when the name is unknown or the CPU lacks it.
const Kernels* KernelsByName(const std::string& name);
// Whether this CPU (and OS) can run the named set.
bool CpuSupports(const std::string& name);
// Every kernel set this CPU can run (for tests that compare them).
std::vector<const Kernels*> SupportedKernels();

}  // namespace leap::readout::internal

#endif  // LEAP_READOUT_INTERNAL_KERNELS_H_
