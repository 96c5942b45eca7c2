// Hot loops of the readout: the prediction dot product and the RLS panel
// product. Each has a portable version and an AVX2+FMA+F16C version; Best()
// picks one from CPUID once. Internal to leap::readout.
#ifndef LEAP_READOUT_INTERNAL_KERNELS_H_
#define LEAP_READOUT_INTERNAL_KERNELS_H_

#include <cstdint>
#include <vector>

namespace leap::readout::internal {

// Rows per dot_rows call.
inline constexpr int kMaxRows = 4;

// The widest batch the panel kernel handles in one pass over P.
inline constexpr int kPanelMaxVectors = 8;

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
  // V[i * k + c] = sum_{j<n} P[i * ldp + j] * U[c * ldu + j] for i < n,
  // c < k, 1 <= k <= kPanelMaxVectors. P is read once. V is overwritten.
  void (*panel)(const float* P, int64_t ldp, int64_t n, const float* U,
                int64_t ldu, int k, float* V);
};

// Reorders w for dot_bf16: every full block of 16 becomes its 8 even-index
// entries then its 8 odd-index entries; the tail (n % 16) keeps its order.
void PermuteForBf16(const float* w, int64_t n, float* out);

// The portable kernels (any x86-64 or other CPU).
const Kernels& PortableKernels();
// The fastest kernels this CPU supports. Thread-safe.
const Kernels& BestKernels();
// Every kernel set this CPU can run (for tests that compare them).
std::vector<const Kernels*> SupportedKernels();

}  // namespace leap::readout::internal

#endif  // LEAP_READOUT_INTERNAL_KERNELS_H_
