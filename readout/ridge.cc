#include "readout/ridge.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "readout/internal/blas.h"

namespace leap::readout {
namespace {

constexpr int64_t kBlockRows = 256;

using RowMajorD =
    Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

void Progress(const RidgeOptions& o, const std::string& line) {
  if (o.progress) o.progress(line);
}

// Accumulates the augmented Gram (upper triangle) and U'y over `rows`.
// g is n x n column-major (n = d + 1).
void AccumulateGram(const FeatureMatrix& x, const Standardizer& st,
                    std::span<const double> y, std::span<const int64_t> rows,
                    Eigen::MatrixXd& g, Eigen::VectorXd& uty,
                    const RidgeOptions& o, const std::string& what) {
  const int64_t d = x.cols;
  const int64_t n = d + 1;
  RowMajorD block(kBlockRows, n);
  int64_t next_report = 0;
  for (size_t r0 = 0; r0 < rows.size(); r0 += kBlockRows) {
    const int64_t br =
        std::min<int64_t>(kBlockRows, static_cast<int64_t>(rows.size() - r0));
    for (int64_t r = 0; r < br; ++r) {
      const int64_t row = rows[r0 + r];
      st.Augment(x.Row(row), block.row(r).data());
      uty.noalias() += y[row] * block.row(r).transpose();
    }
    // Column-major C += A'A with A = block (br x n, row-major) is, in
    // row-major terms, C' += ... ; C symmetric, so fill its upper (col-major)
    // = lower (row-major) triangle.
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, static_cast<int>(n),
                static_cast<int>(br), 1.0, block.data(), static_cast<int>(n),
                1.0, g.data(), static_cast<int>(n));
    if (static_cast<int64_t>(r0 + br) >= next_report) {
      Progress(o, absl::StrFormat("%s: %d/%d rows", what, r0 + br,
                                  rows.size()));
      next_report += std::max<int64_t>(16 * kBlockRows, rows.size() / 10);
    }
  }
}

// Solves (g + lambda D) theta = b using the upper triangle of g. Returns the
// Cholesky factor in `factor` (upper, column-major) for later reuse.
absl::Status SolveRidge(const Eigen::MatrixXd& g, const Eigen::VectorXd& b,
                        double lambda, Eigen::MatrixXd& factor,
                        Eigen::VectorXd& theta) {
  const int n = static_cast<int>(g.rows());
  factor = g;
  for (int i = 0; i < n - 1; ++i) factor(i, i) += lambda;  // bias unpenalized
  int info = 0;
  const char uplo = 'U';
  dpotrf_(&uplo, &n, factor.data(), &n, &info);
  if (info != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gram matrix + lambda D is not positive definite (LAPACK dpotrf "
        "info=", info, ") at lambda=", lambda,
        "; use a positive lambda or more training rows"));
  }
  theta = b;
  const int one = 1;
  dpotrs_(&uplo, &n, &one, factor.data(), &n, theta.data(), &n, &info);
  if (info != 0) {
    return absl::InternalError(absl::StrCat("dpotrs failed: info=", info));
  }
  return absl::OkStatus();
}

double Mse(const FeatureMatrix& x, const Standardizer& st,
           std::span<const double> y, std::span<const int64_t> rows,
           const Eigen::VectorXd& theta) {
  Eigen::VectorXd u(x.cols + 1);
  double sse = 0;
  for (int64_t row : rows) {
    st.Augment(x.Row(row), u.data());
    const double r = u.dot(theta) - y[row];
    sse += r * r;
  }
  return rows.empty() ? 0.0 : sse / static_cast<double>(rows.size());
}

}  // namespace

FeatureView FeatureMatrix::Row(int64_t i) const {
  const int64_t stride = row_stride > 0 ? row_stride : cols;
  return {static_cast<const char*>(data) +
              static_cast<size_t>(i * stride) * DTypeSize(dtype),
          dtype, cols, 1};
}

absl::Status RidgeOptions::Validate() const {
  if (lambda.has_value() && (!(*lambda >= 0.0) || !std::isfinite(*lambda))) {
    return absl::InvalidArgumentError(
        absl::StrCat("lambda must be finite and >= 0, got ", *lambda));
  }
  if (!lambda.has_value()) {
    if (folds < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("folds must be >= 2, got ", folds));
    }
    if (relative_lambda_grid.empty()) {
      return absl::InvalidArgumentError("relative_lambda_grid is empty");
    }
    for (double a : relative_lambda_grid) {
      if (!(a > 0.0) || !std::isfinite(a)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "relative_lambda_grid values must be finite and > 0, got ", a));
      }
    }
  }
  if (max_tokens < 1 || max_tokens > kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens out of range: ", max_tokens));
  }
  if (!(sigma_floor_ratio >= 0.0) || sigma_floor_ratio >= 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sigma_floor_ratio must be in [0, 1), got ", sigma_floor_ratio));
  }
  return absl::OkStatus();
}

absl::StatusOr<Standardizer> FitStandardizer(const FeatureMatrix& x,
                                             double sigma_floor_ratio) {
  const int64_t d = x.cols;
  if (x.rows < 1) return absl::InvalidArgumentError("no feature rows");
  Eigen::VectorXd sum = Eigen::VectorXd::Zero(d);
  for (int64_t r = 0; r < x.rows; ++r) {
    const FeatureView v = x.Row(r);
    for (int64_t i = 0; i < d; ++i) {
      const float f = v.At(i);
      if (!std::isfinite(f)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "feature row ", r, " column ", i, " is not finite (", f, ")"));
      }
      sum[i] += f;
    }
  }
  Standardizer st;
  st.mean = sum / static_cast<double>(x.rows);
  Eigen::VectorXd sq = Eigen::VectorXd::Zero(d);
  for (int64_t r = 0; r < x.rows; ++r) {
    const FeatureView v = x.Row(r);
    for (int64_t i = 0; i < d; ++i) {
      const double c = v.At(i) - st.mean[i];
      sq[i] += c * c;
    }
  }
  st.scale = (sq / static_cast<double>(x.rows)).cwiseSqrt();
  std::vector<double> sorted(st.scale.data(), st.scale.data() + d);
  std::nth_element(sorted.begin(), sorted.begin() + d / 2, sorted.end());
  const double floor = std::max(1e-12, sigma_floor_ratio * sorted[d / 2]);
  st.scale = st.scale.cwiseMax(floor);
  return st;
}

absl::StatusOr<RidgeResult> FitRidge(const FeatureMatrix& x,
                                     std::span<const int64_t> lengths,
                                     const RidgeOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  if (x.cols < kMinDim || x.cols > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature width must be in [", kMinDim, ", ", kMaxDim, "], got ",
        x.cols));
  }
  if (static_cast<int64_t>(lengths.size()) != x.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("features have ", x.rows, " rows but lengths has ",
                     lengths.size(), " entries"));
  }
  const int min_rows = o.lambda.has_value() ? 1 : 2 * o.folds;
  if (x.rows < min_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "need at least ", min_rows, " rows to fit, got ", x.rows));
  }
  std::vector<double> y(x.rows);
  for (int64_t r = 0; r < x.rows; ++r) {
    if (lengths[r] < 0 || lengths[r] > kMaxReportedTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "length ", r, " out of range [0, ", kMaxReportedTokens, "]: ",
          lengths[r]));
    }
    y[r] = TargetFromTokens(lengths[r], o.max_tokens);
  }

  RidgeResult res;
  ASSIGN_OR_RETURN(res.standardizer, FitStandardizer(x, o.sigma_floor_ratio));
  const Standardizer& st = res.standardizer;
  const int64_t n = x.cols + 1;

  std::vector<int64_t> all(x.rows);
  std::iota(all.begin(), all.end(), 0);
  Eigen::MatrixXd g = Eigen::MatrixXd::Zero(n, n);
  Eigen::VectorXd uty = Eigen::VectorXd::Zero(n);
  AccumulateGram(x, st, y, all, g, uty, o, "gram");

  Eigen::MatrixXd factor;
  if (o.lambda.has_value()) {
    res.lambda = *o.lambda;
  } else {
    // Deterministic shuffled fold assignment.
    std::vector<int64_t> perm = all;
    std::mt19937_64 rng(o.seed);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<double> sse(o.relative_lambda_grid.size(), 0.0);
    Eigen::MatrixXd gf(n, n);
    Eigen::VectorXd bf(n);
    Eigen::VectorXd theta;
    for (int f = 0; f < o.folds; ++f) {
      const size_t lo = perm.size() * f / o.folds;
      const size_t hi = perm.size() * (f + 1) / o.folds;
      std::vector<int64_t> held(perm.begin() + lo, perm.begin() + hi);
      std::sort(held.begin(), held.end());
      gf.setZero();
      bf.setZero();
      AccumulateGram(x, st, y, held, gf, bf, o,
                     absl::StrCat("cv fold ", f + 1, "/", o.folds, " gram"));
      gf = g - gf;  // training part of this fold (upper triangle valid)
      bf = uty - bf;
      const double n_train = static_cast<double>(x.rows - held.size());
      for (size_t l = 0; l < o.relative_lambda_grid.size(); ++l) {
        const double lambda = o.relative_lambda_grid[l] * n_train;
        RETURN_IF_ERROR(SolveRidge(gf, bf, lambda, factor, theta));
        sse[l] += Mse(x, st, y, held, theta) * held.size();
      }
      Progress(o, absl::StrFormat("cv fold %d/%d done", f + 1, o.folds));
    }
    size_t best = 0;
    for (size_t l = 0; l < sse.size(); ++l) {
      CvPoint p;
      p.relative_lambda = o.relative_lambda_grid[l];
      p.lambda = p.relative_lambda * static_cast<double>(x.rows);
      p.mse = sse[l] / static_cast<double>(x.rows);
      res.cv.push_back(p);
      if (p.mse < res.cv[best].mse) best = l;
    }
    res.lambda = res.cv[best].lambda;
    Progress(o, absl::StrFormat("cv: chose lambda=%.6g (lambda/n=%.3g, "
                                "held-out mse=%.6g)",
                                res.lambda, res.cv[best].relative_lambda,
                                res.cv[best].mse));
  }

  RETURN_IF_ERROR(SolveRidge(g, uty, res.lambda, factor, res.theta));
  res.train_mse = Mse(x, st, y, all, res.theta);
  if (o.compute_p0) {
    Progress(o, "inverting for P0");
    int info = 0;
    const int ni = static_cast<int>(n);
    const char uplo = 'U';
    dpotri_(&uplo, &ni, factor.data(), &ni, &info);
    if (info != 0) {
      return absl::InternalError(absl::StrCat("dpotri failed: info=", info));
    }
    // Upper triangle (column-major) holds the inverse; mirror it.
    factor.triangularView<Eigen::StrictlyLower>() = factor.transpose();
    res.p0 = SymMatrix::FromDouble(factor);
  }
  return res;
}

}  // namespace leap::readout
