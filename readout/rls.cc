#include "readout/rls.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <vector>

#include "Eigen/Cholesky"
#include "common/check.h"
#include "absl/strings/str_cat.h"
#include "readout/internal/blas.h"
#include "readout/internal/kernels.h"

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
  return absl::OkStatus();
}

RlsState::RlsState(Eigen::VectorXd theta, SymMatrix p, RlsOptions options)
    : theta_(std::move(theta)),
      p_(std::move(p)),
      options_(options),
      w_(AllocFloats(int64_t{options.fold_columns} * p_.ld()), FreeFloats) {
  LEAP_CHECK_EQ(theta_.size(), p_.n());
  LEAP_CHECK(options_.Validate().ok()) << options_.Validate();
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

absl::Status RlsState::UpdateChunk(const float* u, int64_t ldu,
                                   std::span<const double> y) {
  const int64_t k = static_cast<int64_t>(y.size());
  const int64_t n = theta_.size();
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

  // V = P U' (n x k): P_base streamed once per group of up to 8 vectors,
  // minus the pending part W (W' U').
  const internal::Kernels& kern = internal::BestKernels();
  Eigen::MatrixXf v(n, k);
  std::vector<float> panel(static_cast<size_t>(n) * internal::kPanelMaxVectors);
  for (int64_t g = 0; g < k; g += internal::kPanelMaxVectors) {
    const int kg =
        static_cast<int>(std::min<int64_t>(internal::kPanelMaxVectors, k - g));
    kern.panel(p_.data(), p_.ld(), n, u + g * ldu, ldu, kg, panel.data());
    for (int64_t i = 0; i < n; ++i) {
      for (int c = 0; c < kg; ++c) v(i, g + c) = panel[i * kg + c];
    }
  }
  const ConstRowsF um(u, k, n, Eigen::OuterStride<>(ldu));
  if (pending_ > 0) {
    const ConstRowsF wt(w_.get(), pending_, n, Eigen::OuterStride<>(p_.ld()));
    const Eigen::MatrixXf c = wt * um.transpose();  // pending x k
    v.noalias() -= wt.transpose() * c;
  }

  // S = I + U V in double, symmetrized.
  const Eigen::MatrixXd ud = um.cast<double>();
  const Eigen::MatrixXd vd = v.cast<double>();
  Eigen::MatrixXd s = ud * vd;
  s = 0.5 * (s + s.transpose()).eval();
  s.diagonal().array() += 1.0;
  Eigen::LLT<Eigen::MatrixXd> llt(s);
  const Eigen::MatrixXd l = llt.matrixL();
  double min_pivot = llt.info() == Eigen::Success ? l.diagonal().minCoeff() : 0;
  if (!(min_pivot * min_pivot >= 0.5)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "RLS batch rejected: P has lost positive definiteness (smallest "
        "Cholesky pivot^2 of S = I + U P U' is ",
        min_pivot * min_pivot,
        "; exact arithmetic guarantees >= 1). State unchanged; restore P "
        "from a checkpoint or snapshot."));
  }

  // W = V L^-T (rows of wdt are its columns); theta += W L^-1 (y - U theta).
  const Eigen::MatrixXd wdt =
      llt.matrixL().solve(vd.transpose());  // k x n
  Eigen::VectorXd e(k);
  for (int64_t a = 0; a < k; ++a) e[a] = y[a] - ud.row(a).dot(theta_);
  const Eigen::VectorXd g = llt.matrixL().solve(e);
  theta_.noalias() += wdt.transpose() * g;

  for (int64_t a = 0; a < k; ++a) {
    float* dst = w_.get() + (pending_ + a) * p_.ld();
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<float>(wdt(a, j));
  }
  pending_ += k;
  updates_ += k;
  return absl::OkStatus();
}

void RlsState::Flush() {
  if (pending_ == 0) return;
  const int n = static_cast<int>(p_.n());
  const int ld = static_cast<int>(p_.ld());
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, n,
              static_cast<int>(pending_), -1.0f, w_.get(), ld, 1.0f,
              p_.data(), ld);
  p_.MirrorUpper();
  pending_ = 0;
}

const SymMatrix& RlsState::P() {
  Flush();
  return p_;
}

absl::Status RlsState::CheckHealth() {
  Flush();
  for (int64_t i = 0; i < p_.n(); ++i) {
    const float v = p_(i, i);
    if (!std::isfinite(v) || !(v > 0.0f)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RLS P lost positive definiteness: P[", i, ",", i, "] = ", v));
    }
  }
  return absl::OkStatus();
}

}  // namespace leap::readout
