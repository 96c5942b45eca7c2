#include "readout/internal/openblas.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "readout/internal/blas.h"
#include "readout/internal/kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace leap::readout::internal {

std::string OpenBlasCore() {
  const char* name = openblas_get_corename();
  return name != nullptr ? std::string(name) : std::string();
}

bool OpenBlasRunsAvx512() {
  std::string core = OpenBlasCore();
  for (char& c : core) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return core == "skylakex" || core == "cooperlake" || core == "sapphirerapids";
}

bool CpuRunsOpenBlasSkylakeX() {
#if defined(__x86_64__)
  if (!CpuSupports("avx512")) return false;  // F, BW, VL and the OS state
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (ebx & bit_AVX512DQ) && (ebx & bit_AVX512CD);
#else
  return false;
#endif
}

bool OpenBlasPreferredFor(const std::string& kernels) {
  return kernels == "avx512" && OpenBlasRunsAvx512();
}

void OpenBlasSingleThreaded() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

void OpenBlasProductBlock(int64_t k, int64_t n, const float* U, int64_t ldu,
                          const float* P, int64_t ldp, int64_t j0, int64_t j1,
                          float* Vt, int64_t ldv) {
  const int m = static_cast<int>(k), w = static_cast<int>(j1 - j0);
  float* c = Vt + j0;
  // Rows p < j0: P[p][j0..j1) (upper blocks).
  if (j0 > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, w,
                static_cast<int>(j0), 1.0f, U, static_cast<int>(ldu), P + j0,
                static_cast<int>(ldp), 1.0f, c, static_cast<int>(ldv));
  }
  // The diagonal square: its upper triangle (element by element, within the
  // valid blocks).
  cblas_ssymm(CblasRowMajor, CblasRight, CblasUpper, m, w, 1.0f,
              P + j0 * ldp + j0, static_cast<int>(ldp), U + j0,
              static_cast<int>(ldu), 1.0f, c, static_cast<int>(ldv));
  // Rows p >= j1: P[p][j] = P[j][p], the block's own rows to the right.
  if (j1 < n) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, w,
                static_cast<int>(n - j1), 1.0f, U + j1, static_cast<int>(ldu),
                P + j0 * ldp + j1, static_cast<int>(ldp), 1.0f, c,
                static_cast<int>(ldv));
  }
}

void OpenBlasFoldRows(int64_t k, int64_t n, const float* W, int64_t ldw,
                      float* P, int64_t ldp, int64_t i0, int64_t i1) {
  const int kk = static_cast<int>(k), w = static_cast<int>(i1 - i0);
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, w, kk, -1.0f, W + i0,
              static_cast<int>(ldw), 1.0f, P + i0 * ldp + i0,
              static_cast<int>(ldp));
  if (i1 < n) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w,
                static_cast<int>(n - i1), kk, -1.0f, W + i0,
                static_cast<int>(ldw), W + i1, static_cast<int>(ldw), 1.0f,
                P + i0 * ldp + i1, static_cast<int>(ldp));
  }
  for (int64_t b0 = i0; b0 < i1; b0 += kSymBlock) {
    const int64_t b1 = std::min(i1, b0 + kSymBlock);
    for (int64_t i = b0 + 1; i < b1; ++i) {
      for (int64_t j = b0; j < i; ++j) P[i * ldp + j] = P[j * ldp + i];
    }
  }
}

void ReexecForOpenBlasAvx512(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  if (OpenBlasRunsAvx512() || !CpuRunsOpenBlasSkylakeX()) return;
  std::fprintf(stderr,
               "OpenBLAS picked %s kernels on a CPU with AVX-512: re-running "
               "with OPENBLAS_CORETYPE=SkylakeX\n",
               OpenBlasCore().c_str());
  std::fflush(nullptr);
  ::setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  ::execv("/proc/self/exe", argv);
  std::perror("execv /proc/self/exe (continuing with OpenBLAS's choice)");
}

}  // namespace leap::readout::internal
