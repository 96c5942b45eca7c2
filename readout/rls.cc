#include "readout/rls.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sched.h>
#include <sys/mman.h>
#include <thread>
#include <utility>
#include <vector>

#include "Eigen/Cholesky"
#include "common/check.h"
#include "absl/strings/str_cat.h"
#include "readout/internal/blas.h"
#include "readout/internal/kernels.h"
#include "readout/internal/openblas.h"

namespace leap::readout {
namespace {

int64_t PaddedLd(int64_t n) { return (n + 15) / 16 * 16; }

// Zeroed, 64-byte aligned floats. Large buffers (P is 64 MiB at d = 4096)
// are 2 MiB aligned and backed by transparent huge pages where the kernel
// allows it: the panel kernel walks P in row segments 16 KiB apart, and with
// 4 KiB pages every segment would miss the TLB.
float* AllocFloats(int64_t count) {
  constexpr size_t kHuge = size_t{2} << 20;
  size_t bytes = std::max<size_t>(64, (static_cast<size_t>(count) * 4 + 63) / 64 * 64);
  const bool huge = bytes >= 2 * kHuge;
  if (huge) bytes = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(huge ? kHuge : 64, bytes);
  LEAP_CHECK(p != nullptr) << "out of memory allocating " << bytes << " bytes";
  if (huge) ::madvise(p, bytes, MADV_HUGEPAGE);  // best effort
  std::memset(p, 0, bytes);
  return static_cast<float*>(p);
}

void FreeFloats(float* p) { std::free(p); }

// Phase clock: this thread's CPU time on one thread (time spent preempted
// on a shared machine is not the phase's), wall time on several.
double Seconds(int threads) {
  if (threads <= 1) {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

using RowMajorF =
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowsF = Eigen::Map<const RowMajorF, 0, Eigen::OuterStride<>>;

}  // namespace

void SymMatrix::Free::operator()(float* p) const { std::free(p); }

SymMatrix::SymMatrix(int64_t n)
    : n_(n), ld_(PaddedLd(n)), data_(AllocFloats(n * PaddedLd(n))) {}

SymMatrix::SymMatrix(const SymMatrix& other) : SymMatrix(other.n_) {
  std::memcpy(data_.get(), other.data_.get(),
              static_cast<size_t>(n_ * ld_) * 4);
}

SymMatrix& SymMatrix::operator=(const SymMatrix& other) {
  if (this != &other) *this = SymMatrix(other);
  return *this;
}

SymMatrix SymMatrix::ScaledIdentity(int64_t n, float s) {
  SymMatrix m(n);
  for (int64_t i = 0; i < n; ++i) m(i, i) = s;
  return m;
}

SymMatrix SymMatrix::FromDouble(const Eigen::MatrixXd& a) {
  LEAP_CHECK_EQ(a.rows(), a.cols());
  SymMatrix m(a.rows());
  for (int64_t i = 0; i < m.n_; ++i) {
    for (int64_t j = i; j < m.n_; ++j) {
      const float v = static_cast<float>(0.5 * (a(i, j) + a(j, i)));
      m(i, j) = v;
      m(j, i) = v;
    }
  }
  return m;
}

Eigen::MatrixXd SymMatrix::ToDouble() const {
  Eigen::MatrixXd a(n_, n_);
  for (int64_t i = 0; i < n_; ++i) {
    for (int64_t j = 0; j < n_; ++j) a(i, j) = (*this)(i, j);
  }
  return a;
}

void SymMatrix::MirrorUpper() {
  constexpr int64_t kTile = 64;
  float* d = data_.get();
  for (int64_t i0 = 0; i0 < n_; i0 += kTile) {
    const int64_t i1 = std::min(n_, i0 + kTile);
    for (int64_t j0 = i0; j0 < n_; j0 += kTile) {
      const int64_t j1 = std::min(n_, j0 + kTile);
      // Tile rows i, columns j > i (upper) -> rows j, column i.
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = std::max(j0, i + 1); j < j1; ++j) {
          d[j * ld_ + i] = d[i * ld_ + j];
        }
      }
    }
  }
}

absl::Status RlsOptions::Validate() const {
  if (fold_columns < internal::kPanelMaxVectors || fold_columns > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("fold_columns must be in [", internal::kPanelMaxVectors,
                     ", 4096], got ", fold_columns));
  }
  if (threads < 0 || threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "threads must be in [0, 1024] (0: the available cores), got ", threads));
  }
  if (!kernels.empty() && internal::KernelsByName(kernels) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kernels '", kernels,
        "' is unknown or not supported by this CPU (portable, avx2, avx512)"));
  }
  if (!large_batches.empty() && large_batches != "openblas" &&
      large_batches != "kernels") {
    return absl::InvalidArgumentError(absl::StrCat(
        "large_batches '", large_batches,
        "' is unknown (openblas, kernels, or empty for the default)"));
  }
  return absl::OkStatus();
}

int AvailableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace {

// Runs f(0) ... f(parts - 1), f(0) on this thread, the others on their own.
template <typename F>
void RunParts(int parts, const F& f) {
  if (parts <= 1) {
    f(0);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(parts - 1);
  for (int t = 1; t < parts; ++t) helpers.emplace_back([&f, t] { f(t); });
  f(0);
  for (std::thread& h : helpers) h.join();
}

// [begin, end) of part t of `total` split into `parts` pieces, boundaries
// multiples of `grain`.
std::pair<int64_t, int64_t> Slice(int64_t total, int parts, int t,
                                  int64_t grain) {
  const int64_t units = (total + grain - 1) / grain;
  const int64_t b = units * t / parts * grain;
  const int64_t e = units * (t + 1) / parts * grain;
  return {std::min(b, total), std::min(e, total)};
}

// [first[t], first[t + 1]) of `blocks` row blocks of `rows` rows whose
// columns run from the block's first row to `ld`, t < parts, balanced by
// area.
std::vector<int64_t> SplitBlocksByArea(int64_t blocks, int64_t rows,
                                       int64_t ld, int parts) {
  std::vector<int64_t> first(parts + 1, blocks);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) total += double(ld - b * rows);
  double acc = 0;
  int t = 0;
  first[0] = 0;
  for (int64_t b = 0; b < blocks && t + 1 < parts; ++b) {
    acc += double(ld - b * rows);
    if (acc >= total * (t + 1) / parts) first[++t] = b + 1;
  }
  return first;
}

}  // namespace

RlsState::RlsState(Eigen::VectorXd theta, SymMatrix p, RlsOptions options)
    : theta_(std::move(theta)),
      p_(std::make_shared<SymMatrix>(std::move(p))),
      options_(options),
      w_(AllocFloats(int64_t{options.fold_columns} * p_->ld()), FreeFloats),
      vt_(AllocFloats(int64_t{options.fold_columns} * p_->ld()), FreeFloats),
      sweep_u_(nullptr, FreeFloats),
      sweep_d_(nullptr, FreeFloats),
      sweep_t_(nullptr, FreeFloats) {
  LEAP_CHECK_EQ(theta_.size(), p_->n());
  LEAP_CHECK(options_.Validate().ok()) << options_.Validate();
  kernels_ = options_.kernels.empty() ? &internal::BestKernels()
                                      : internal::KernelsByName(options_.kernels);
  threads_ = options_.threads > 0 ? options_.threads : AvailableCores();
  blas_large_ = options_.large_batches == "openblas" ||
                (options_.large_batches.empty() &&
                 internal::OpenBlasPreferredFor(kernels_->name));
}

bool PrepareOpenBlasForRls() {
  internal::OpenBlasSingleThreaded();
  return internal::OpenBlasPreferredFor(internal::BestKernels().name);
}

const char* RlsState::kernel_name() const { return kernels_->name; }

std::string RlsState::large_batch_variant() const {
  if (blas_large_) return "openblas " + internal::OpenBlasCore();
  return kernels_->name;
}

absl::Status RlsState::Update(const float* u, int64_t ldu,
                              std::span<const double> y) {
  const int64_t k = static_cast<int64_t>(y.size());
  // A batch wider than the pending buffer is applied in pieces (the result
  // is the same: batch size only changes timing).
  for (int64_t a = 0; a < k; a += options_.fold_columns) {
    const int64_t kk = std::min<int64_t>(options_.fold_columns, k - a);
    absl::Status s = UpdateChunk(u + a * ldu, ldu, y.subspan(a, kk));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

void RlsState::ComputeVt(const float* u, int64_t ldu, int64_t k) {
  const internal::Kernels& kern = *kernels_;
  const int64_t n = theta_.size();
  const int64_t ld = p_->ld();
  float* vt = vt_.get();
  const double t0 = Seconds(threads_);
  std::memset(vt, 0, sizeof(float) * k * ld);
  if (blas_large_) {
    // OpenBLAS in fixed column blocks of P (whole kSymBlock blocks), each
    // with the same three single-threaded calls whatever the thread count.
    internal::OpenBlasSingleThreaded();
    constexpr int64_t kB = internal::kSymBlock;
    const int64_t blocks = (n + kB - 1) / kB;
    const int pieces = static_cast<int>(
        std::min<int64_t>(internal::kBlasPieces, blocks));
    const int parts = std::min(threads_, pieces);
    RunParts(parts, [&](int t) {
      for (int c = pieces * t / parts; c < pieces * (t + 1) / parts; ++c) {
        const int64_t j0 = blocks * c / pieces * kB;
        const int64_t j1 = std::min(n, blocks * (c + 1) / pieces * kB);
        internal::OpenBlasProductBlock(k, n, u, ldu, p_->data(), ld, j0, j1,
                                       vt, ld);
      }
    });
  } else {
    // Compute-bound: Vt = U P (P symmetric) as a blocked product, columns
    // split across threads. Only P's upper blocks are read (the packing
    // takes the lower ones from their transposes), so the lower triangle
    // may be stale: no mirror after a fold.
    const int parts = static_cast<int>(
        std::min<int64_t>(threads_, std::max<int64_t>(1, ld / 64)));
    RunParts(parts, [&](int t) {
      const auto [j0, j1] = Slice(ld, parts, t, 64);
      if (j1 > j0) {
        kern.gemm_acc_sym(k, j1 - j0, n, 1.0f, u, ldu, 1, p_->data(), ld, j0,
                          vt + j0, ld);
      }
    });
  }
  const double t1 = Seconds(threads_);
  phases_.product += t1 - t0;
  if (pending_ > 0) {
    // Minus the pending part: Vt -= (U W_all') W_all. C' = W_all U' with U'
    // copied to kp (k rounded up to 16) zero-padded columns, so both
    // products run in the blocked kernel.
    const int64_t kp = (k + 15) / 16 * 16;
    std::vector<float> ut(static_cast<size_t>(n * kp), 0.0f);
    for (int64_t a = 0; a < k; ++a) {
      for (int64_t j = 0; j < n; ++j) ut[j * kp + a] = u[a * ldu + j];
    }
    std::vector<float> ct(static_cast<size_t>(pending_ * kp), 0.0f);
    const int64_t pending = pending_;
    const int cparts = static_cast<int>(
        std::min<int64_t>(threads_, std::max<int64_t>(1, pending / 24)));
    RunParts(cparts, [&](int t) {
      const auto [q0, q1] = Slice(pending, cparts, t, 12);
      if (q1 > q0) {
        kern.gemm_acc(q1 - q0, kp, n, 1.0f, w_.get() + q0 * ld, ld, 1,
                      ut.data(), kp, ct.data() + q0 * kp, kp);
      }
    });
    const int parts = static_cast<int>(
        std::min<int64_t>(threads_, std::max<int64_t>(1, ld / 64)));
    RunParts(parts, [&](int t) {
      const auto [j0, j1] = Slice(ld, parts, t, 64);
      if (j1 > j0) {
        kern.gemm_acc(k, j1 - j0, pending, -1.0f, ct.data(), 1, kp,
                      w_.get() + j0, ld, vt + j0, ld);
      }
    });
    phases_.pending += Seconds(threads_) - t1;
  }
}

void RlsState::SweepVt(const float* u, int64_t ldu, int64_t k) {
  const int64_t n = theta_.size();
  const int64_t ld = p_->ld();
  constexpr int64_t kMax = internal::kPanelMaxVectors;
  const double t0 = Seconds(threads_);
  if (sweep_u_ == nullptr) {
    sweep_u_.reset(AllocFloats(kMax * ld + kSweepUSlack));
    sweep_d_.reset(AllocFloats(kMax * n));
    sweep_t_.reset(AllocFloats(kSweepGroups * kMax * ld));
  }
  // The pending columns (at most kMax) are folded by the same pass; rows
  // of W and U are zero-padded to kk (zero rows change no bit).
  const int64_t kk = std::max(k, pending_);
  const bool fold = pending_ > 0;
  float* w = w_.get();
  if (fold) {
    UnshareP();
    std::memset(w + pending_ * ld, 0, sizeof(float) * (kk - pending_) * ld);
  }
  // U's rows copied to 64-byte aligned rows of ld floats, zero beyond n,
  // starting 2 KiB (mod 4 KiB) after W: the sweep keeps the rows of both
  // for one tile of columns in L1, and rows at the same offset modulo
  // 4 KiB share L1 sets (8 rows of W and 8 of U over 12 ways): at equal
  // offsets the sweep took ~4.1 ms per batch at d = 4096, at 2 KiB apart
  // ~3.0 (this machine, AVX-512); before, the distance was wherever the
  // allocator put the buffer.
  const auto addr = [](const float* x) { return reinterpret_cast<uintptr_t>(x); };
  float* ua = sweep_u_.get() +
              (4096 + 2048 - (addr(sweep_u_.get()) - addr(w)) % 4096) % 4096 / 4;
  std::memset(ua, 0, sizeof(float) * kk * ld);
  for (int64_t a = 0; a < k; ++a) {
    std::memcpy(ua + a * ld, u + a * ldu, sizeof(float) * n);
  }
  // Fixed groups of row blocks, each with its own T: every entry of V is
  // summed in the same order whatever the thread count.
  constexpr int64_t kB = internal::kSymBlock;
  const int64_t blocks = (n + kB - 1) / kB;
  const int groups = static_cast<int>(std::min<int64_t>(kSweepGroups, blocks));
  const std::vector<int64_t> first = SplitBlocksByArea(blocks, kB, ld, groups);
  const int parts = std::min(threads_, groups);
  float* p = p_->data();
  float* d = sweep_d_.get();
  float* tb = sweep_t_.get();
  const internal::Kernels& kern = *kernels_;
  RunParts(parts, [&](int t) {
    for (int g = groups * t / parts; g < groups * (t + 1) / parts; ++g) {
      float* tg = tb + g * kk * ld;
      std::memset(tg, 0, sizeof(float) * kk * ld);
      for (int64_t b = first[g]; b < first[g + 1]; ++b) {
        const int64_t r0 = b * kB, r1 = std::min(n, r0 + kB);
        kern.sym_sweep(p, ld, n, r0, r1, static_cast<int>(kk), fold, w, ua, ld,
                       d + r0 * kk, tg, ld);
      }
    }
  });
  // V' = D + T_0 + ... + T_(groups-1), in that order.
  float* vt = vt_.get();
  for (int64_t c = 0; c < k; ++c) {
    float* vc = vt + c * ld;
    for (int64_t j = 0; j < n; ++j) vc[j] = d[j * kk + c];
    std::fill(vc + n, vc + ld, 0.0f);
    for (int g = 0; g < groups; ++g) {
      const float* tc = tb + (g * kk + c) * ld;
      for (int64_t j = 0; j < n; ++j) vc[j] += tc[j];
    }
  }
  if (fold) {
    lower_stale_ = true;
    pending_ = 0;
  }
  phases_.sweep += Seconds(threads_) - t0;
}

absl::Status RlsState::UpdateChunk(const float* u, int64_t ldu,
                                   std::span<const double> y) {
  const int64_t k = static_cast<int64_t>(y.size());
  const int64_t n = theta_.size();
  const int64_t ld = p_->ld();
  if (k == 0) return absl::OkStatus();
  LEAP_CHECK_GE(ldu, n);
  for (int64_t a = 0; a < k; ++a) {
    if (!std::isfinite(y[a])) {
      return absl::InvalidArgumentError(
          absl::StrCat("RLS target ", a, " is not finite"));
    }
    const float* ua = u + a * ldu;
    for (int64_t j = 0; j < n; ++j) {
      if (!std::isfinite(ua[j])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RLS feature row ", a, " element ", j, " is not finite"));
      }
    }
  }
  if (pending_ + k > options_.fold_columns) Flush();

  // V' = U P (k rows of ld floats). Batches of up to kPanelMaxVectors:
  // one pass over P's upper triangle that also folds the pending columns
  // (at most as many, else the blocked fold first); wider ones: the
  // blocked product on P_base minus the pending part.
  if (k <= internal::kPanelMaxVectors) {
    if (pending_ > internal::kPanelMaxVectors) Flush();
    SweepVt(u, ldu, k);
  } else {
    ComputeVt(u, ldu, k);
  }
  const float* vt = vt_.get();
  const double t_solve = Seconds(threads_);

  // S = I + U V in FP64 (products of floats are exact in double). The
  // kernel fills the upper triangle (row-major), which is the lower one of
  // the column-major matrix LAPACK factors.
  const int kk = static_cast<int>(k);
  std::vector<double> s(static_cast<size_t>(k * k), 0.0);
  kernels_->dot_f64_block(u, ldu, vt, ld, k, n, s.data(), k);
  for (int64_t a = 0; a < k; ++a) s[a * k + a] += 1.0;
  int info = 0;
  dpotrf_("L", &kk, s.data(), &kk, &info);
  // The smallest pivot, NaN as soon as any pivot is not finite (a
  // non-finite P u, e.g. an overflowing feature, must reject the batch
  // whichever row it is in).
  double min_pivot = info == 0 ? s[0] : 0.0;
  for (int64_t a = 0; info == 0 && a < k && !std::isnan(min_pivot); ++a) {
    const double d = s[a * k + a];
    if (!std::isfinite(d)) {
      min_pivot = std::nan("");
    } else if (d < min_pivot) {
      min_pivot = d;
    }
  }
  if (!(min_pivot * min_pivot >= 0.5)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "RLS batch rejected: P has lost positive definiteness (smallest "
        "Cholesky pivot^2 of S = I + U P U' is ",
        min_pivot * min_pivot,
        "; exact arithmetic guarantees >= 1). State unchanged; restore P "
        "from a checkpoint or snapshot."));
  }
  // L^-1 in place (column-major lower: Linv(r, c) = s[c * k + r], r >= c).
  dtrtri_("L", "N", &kk, s.data(), &kk, &info);
  LEAP_CHECK_EQ(info, 0) << "dtrtri on a factor with pivots >= 0.7";

  // theta += V S^-1 (y - U theta) = V' h, h = L^-T L^-1 e, in FP64.
  // U theta: each row's sum in eight independent partial sums (entry j in
  // sum j % 8, added in a fixed order at the end), which the compiler
  // vectorizes; one chain of n dependent additions cost ~4 us per row.
  std::vector<double> e(k), g(k, 0.0), h(k, 0.0);
  const double* th = theta_.data();
  const int64_t n8 = n / 8 * 8;
  for (int64_t a = 0; a < k; ++a) {
    const float* ua = u + a * ldu;
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < n8; j += 8) {
      for (int l = 0; l < 8; ++l) part[l] += double{ua[j + l]} * th[j + l];
    }
    for (int64_t j = n8; j < n; ++j) part[j - n8] += double{ua[j]} * th[j];
    const double dot = ((part[0] + part[1]) + (part[2] + part[3])) +
                       ((part[4] + part[5]) + (part[6] + part[7]));
    e[a] = y[a] - dot;
  }
  for (int64_t c = 0; c < k; ++c) {
    for (int64_t r = c; r < k; ++r) g[r] += s[c * k + r] * e[c];
  }
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t c = 0; c <= r; ++c) h[c] += s[c * k + r] * g[r];
  }
  double* thw = theta_.data();
  for (int64_t a = 0; a < k; ++a) {
    const float* va = vt + a * ld;
    const double ha = h[a];
    for (int64_t j = 0; j < n; ++j) thw[j] += double{va[j]} * ha;
  }

  // The pending columns W' = L^-1 V' (k rows of ld floats, padding zero).
  std::vector<float> linv(static_cast<size_t>(k * k), 0.0f);
  for (int64_t c = 0; c < k; ++c) {
    for (int64_t r = c; r < k; ++r) {
      linv[r * k + c] = static_cast<float>(s[c * k + r]);
    }
  }
  const double t_w = Seconds(threads_);
  phases_.solve += t_w - t_solve;
  float* wdst = w_.get() + pending_ * ld;
  std::memset(wdst, 0, sizeof(float) * k * ld);
  const int parts = static_cast<int>(
      std::min<int64_t>(threads_, std::max<int64_t>(1, ld / 64)));
  RunParts(parts, [&](int t) {
    const auto [j0, j1] = Slice(ld, parts, t, 64);
    if (j1 <= j0) return;
    // Row blocks use only the nonzero (lower-triangular) part of L^-1; the
    // skipped terms are exact zeros.
    for (int64_t r0 = 0; r0 < k; r0 += 48) {
      const int64_t r1 = std::min<int64_t>(k, r0 + 48);
      kernels_->gemm_acc(r1 - r0, j1 - j0, r1, 1.0f, linv.data() + r0 * k, k,
                         1, vt + j0, ld, wdst + r0 * ld + j0, ld);
    }
  });
  phases_.w += Seconds(threads_) - t_w;
  pending_ += k;
  updates_ += k;
  return absl::OkStatus();
}

void RlsState::Flush() {
  if (pending_ == 0) return;
  const int64_t n = p_->n();
  const int64_t ld = p_->ld();
  // Upper triangle of P_base -= W_all W_all', in row blocks of 96 whose
  // columns start at the block's diagonal (rounded down to 16), balanced by
  // area across the threads.
  constexpr int64_t kRows = internal::kSymBlock;
  static_assert(kRows % 16 == 0, "diagonal blocks folded whole");
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int parts = static_cast<int>(std::min<int64_t>(threads_, blocks));
  const std::vector<int64_t> first = SplitBlocksByArea(blocks, kRows, ld, parts);
  float* w = w_.get();
  UnshareP();
  float* p = p_->data();
  const int64_t pending = pending_;
  const internal::Kernels& kern = *kernels_;
  const double t0 = Seconds(threads_);
  if (blas_large_) {
    // OpenBLAS in fixed pieces of row blocks (balanced by area), each with
    // the same single-threaded calls whatever the thread count.
    internal::OpenBlasSingleThreaded();
    const int pieces =
        static_cast<int>(std::min<int64_t>(internal::kBlasPieces, blocks));
    const std::vector<int64_t> rows =
        SplitBlocksByArea(blocks, kRows, ld, pieces);
    const int bparts = std::min(threads_, pieces);
    RunParts(bparts, [&](int t) {
      for (int c = pieces * t / bparts; c < pieces * (t + 1) / bparts; ++c) {
        const int64_t i0 = rows[c] * kRows;
        const int64_t i1 = std::min(n, rows[c + 1] * kRows);
        if (i1 > i0) {
          internal::OpenBlasFoldRows(pending, n, w, ld, p, ld, i0, i1);
        }
      }
    });
  } else {
    // W packed once for every row block (each reads columns from its
    // diagonal on; kSymBlock is a multiple of the panel width), the panels
    // split across the threads.
    static_assert(kRows % 32 == 0, "row blocks start on panel boundaries");
    if (w_packed_ == nullptr) {
      w_packed_ = {AllocFloats(int64_t{options_.fold_columns} * ld), FreeFloats};
    }
    float* wp = w_packed_.get();
    const int64_t nr = kern.panel_floats;
    const int64_t panels = (ld + nr - 1) / nr;
    const int pparts = static_cast<int>(std::min<int64_t>(threads_, panels));
    RunParts(pparts, [&](int t) {
      const int64_t c0 = panels * t / pparts * nr;
      const int64_t c1 = std::min(ld, panels * (t + 1) / pparts * nr);
      if (c1 > c0) {
        internal::PackPanels(kern, w + c0, ld, pending, c1 - c0,
                             wp + c0 * pending);
      }
    });
    RunParts(parts, [&](int t) {
      for (int64_t b = first[t]; b < first[t + 1]; ++b) {
        const int64_t i0 = b * kRows, i1 = std::min(n, i0 + kRows);
        const int64_t j0 = i0 & ~int64_t{15};
        kern.gemm_acc_packed(i1 - i0, ld - j0, pending, -1.0f, w + i0, 1, ld,
                             wp, ld, j0, p + i0 * ld + j0, ld);
      }
    });
  }
  const double t1 = Seconds(threads_);
  phases_.fold += t1 - t0;
  // The lower triangle outside the diagonal blocks is stale now: the
  // blocked product reads the upper one only; the panel and P() mirror
  // when they need it.
  lower_stale_ = true;
  pending_ = 0;
}

void RlsState::UnshareP() {
  // A checkpoint may still be reading the upper blocks: write a copy.
  if (p_leases_->load(std::memory_order_acquire) > 0) {
    p_ = std::make_shared<SymMatrix>(*p_);
    p_leases_ = std::make_shared<std::atomic<int64_t>>(0);
  }
}

void RlsState::MirrorLower() {
  if (!lower_stale_) return;
  // Only the blocks strictly below the diagonal blocks are written (the
  // diagonal blocks are folded whole), so a checkpoint reading the upper
  // blocks of a shared P (SharedP) is never raced. Row blocks split across
  // threads by area; each writes its own columns.
  const int64_t n = p_->n();
  const int64_t ld = p_->ld();
  float* p = p_->data();
  constexpr int64_t kB = internal::kSymBlock;
  const int64_t blocks = (n + kB - 1) / kB;
  const int parts = static_cast<int>(std::min<int64_t>(threads_, blocks));
  std::vector<int64_t> first(parts + 1, blocks);
  {
    double total = 0;
    for (int64_t b = 0; b < blocks; ++b) total += double(n - b * kB);
    double acc = 0;
    int t = 0;
    first[0] = 0;
    for (int64_t b = 0; b < blocks && t + 1 < parts; ++b) {
      acc += double(n - b * kB);
      if (acc >= total * (t + 1) / parts) first[++t] = b + 1;
    }
  }
  RunParts(parts, [&](int t) {
    for (int64_t b = first[t]; b < first[t + 1]; ++b) {
      const int64_t r0 = b * kB, r1 = std::min(n, r0 + kB);
      constexpr int64_t kTile = 32;
      for (int64_t i0 = r0; i0 < r1; i0 += kTile) {
        const int64_t i1 = std::min(r1, i0 + kTile);
        for (int64_t j0 = r1; j0 < n; j0 += kTile) {
          const int64_t j1 = std::min(n, j0 + kTile);
          for (int64_t i = i0; i < i1; ++i) {
            for (int64_t j = j0; j < j1; ++j) p[j * ld + i] = p[i * ld + j];
          }
        }
      }
    }
  });
  lower_stale_ = false;
}

const SymMatrix& RlsState::P() {
  Flush();
  if (lower_stale_) {
    const double t0 = Seconds(threads_);
    MirrorLower();
    phases_.mirror += Seconds(threads_) - t0;
  }
  return *p_;
}

std::shared_ptr<const SymMatrix> RlsState::SharedP() {
  Flush();
  p_leases_->fetch_add(1, std::memory_order_relaxed);
  // Aliases p_ (kept alive by the deleter); dropping the last copy of the
  // returned pointer ends the lease (UnshareP).
  return std::shared_ptr<const SymMatrix>(
      p_.get(), [keep = p_, leases = p_leases_](const SymMatrix*) {
        leases->fetch_sub(1, std::memory_order_release);
      });
}

SymMatrix CopySymmetric(const SymMatrix& p) {
  SymMatrix out(p.n());
  const int64_t n = p.n();
  constexpr int64_t kB = internal::kSymBlock;
  for (int64_t r0 = 0; r0 < n; r0 += kB) {
    const int64_t r1 = std::min(n, r0 + kB);
    // The block row's upper part (diagonal block included) as it is.
    for (int64_t i = r0; i < r1; ++i) {
      std::memcpy(out.row(i) + r0, p.row(i) + r0, sizeof(float) * (n - r0));
    }
    // Its transpose below the diagonal block.
    constexpr int64_t kTile = 32;
    for (int64_t i0 = r0; i0 < r1; i0 += kTile) {
      const int64_t i1 = std::min(r1, i0 + kTile);
      for (int64_t j0 = r1; j0 < n; j0 += kTile) {
        const int64_t j1 = std::min(n, j0 + kTile);
        for (int64_t i = i0; i < i1; ++i) {
          for (int64_t j = j0; j < j1; ++j) out(j, i) = p(i, j);
        }
      }
    }
  }
  return out;
}

absl::Status RlsState::CheckHealth() {
  Flush();
  for (int64_t i = 0; i < p_->n(); ++i) {
    const float v = (*p_)(i, i);
    if (!std::isfinite(v) || !(v > 0.0f)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RLS P lost positive definiteness: P[", i, ",", i, "] = ", v));
    }
  }
  return absl::OkStatus();
}

}  // namespace leap::readout
