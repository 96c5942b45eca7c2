// OpenBLAS for RLS batches wider than the fused sweep (the product U P and
// the fold P -= W W'), where its GEMM/SYMM/SYRK kernels beat the hand
// kernels: OpenBLAS picks its kernels for the CPU when it loads
// (DYNAMIC_ARCH), so which ones run is its choice, reported here. Internal
// to leap::readout.
#ifndef LEAP_READOUT_INTERNAL_OPENBLAS_H_
#define LEAP_READOUT_INTERNAL_OPENBLAS_H_

#include <cstdint>
#include <string>

namespace leap::readout::internal {

// The kernel family OpenBLAS picked at load ("SkylakeX", "Haswell", ...).
std::string OpenBlasCore();
// Whether that family runs AVX-512 kernels (SkylakeX, Cooperlake,
// SapphireRapids).
bool OpenBlasRunsAvx512();
// Whether this CPU and OS support every AVX-512 subset OpenBLAS's SkylakeX
// kernels use (F, CD, BW, DQ, VL, and the opmask/zmm state).
bool CpuRunsOpenBlasSkylakeX();
// The large-batch variant RlsState picks by default with kernel set
// `kernels`: OpenBLAS when its kernels are AVX-512 and ours are too (the
// only case measured faster: docs/MATH.md), else the hand kernels.
bool OpenBlasPreferredFor(const std::string& kernels);
// OpenBLAS's own thread count set to 1 if it is not (RlsState splits the
// work into fixed pieces on its own threads; OpenBLAS threads on top would
// oversubscribe the cores, and its splits depend on its thread count).
// Process-wide.
void OpenBlasSingleThreaded();

// Fixed pieces of the RLS large-batch work (the same pieces whatever the
// thread count, so every entry is computed by the same OpenBLAS calls).
inline constexpr int kBlasPieces = 8;

// Vt[:, j0:j1] (+)= U[:, 0:n] P[0:n, j0:j1] for the column block
// [j0, j1) (j0, j1 multiples of kSymBlock or j1 = n), P symmetric n x n
// with row stride ldp of which only the kSymBlock blocks on and above the
// diagonal are valid: three calls (rows of P above the block, the diagonal
// block with SYMM, the transposed rows to its right), added to Vt in that
// order. Vt rows of ldv floats, U rows of ldu floats, k rows each.
void OpenBlasProductBlock(int64_t k, int64_t n, const float* U, int64_t ldu,
                          const float* P, int64_t ldp, int64_t j0, int64_t j1,
                          float* Vt, int64_t ldv);
// P[i, j] -= sum_c W[c][i] W[c][j] for rows [i0, i1) (multiples of
// kSymBlock, or i1 = n) and columns j >= i in upper-triangle order (SYRK on
// the diagonal square, GEMM to its right), then each kSymBlock diagonal
// block of the rows copied from its upper triangle onto its lower one
// (diagonal blocks stay whole). W: k rows of ldw floats.
void OpenBlasFoldRows(int64_t k, int64_t n, const float* W, int64_t ldw,
                      float* P, int64_t ldp, int64_t i0, int64_t i1);

// For benchmarks: when OPENBLAS_CORETYPE is unset, this CPU runs
// OpenBLAS's SkylakeX kernels but OpenBLAS picked a family without AVX-512
// (its 0.3.21, Debian 12's, predates AMD Zen 5 and picks Haswell there),
// sets OPENBLAS_CORETYPE=SkylakeX and re-executes the program with the same
// arguments (OpenBLAS reads it only when it loads). Returns when it does
// not re-execute.
void ReexecForOpenBlasAvx512(char** argv);

}  // namespace leap::readout::internal

#endif  // LEAP_READOUT_INTERNAL_OPENBLAS_H_
