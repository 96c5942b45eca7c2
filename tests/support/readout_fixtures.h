// Readout states and FP64 references for the in-process unit tests of the
// sidecar's core, the shm server and the store: a random readout (its
// standardization, theta and an anchored P0), feature rows, the score a
// prediction must equal (w.x + b computed in double from theta and the
// standardization, not from the folded weights), and the anchored closed
// form RLS must reach. Header-only; needs leap::readout and Eigen.
#ifndef LEAP_TESTS_SUPPORT_READOUT_FIXTURES_H_
#define LEAP_TESTS_SUPPORT_READOUT_FIXTURES_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "Eigen/Cholesky"
#include "Eigen/Core"
#include "Eigen/LU"
#include "readout/artifact.h"
#include "readout/features.h"
#include "readout/readout.h"
#include "readout/rls.h"
#include "readout/target.h"

namespace leap::testing {

// A readout of width `dim` with a non-trivial standardization (means around
// 3, scales in [0.5, 2]) and theta; with `with_p`, P0 = (U0'U0 + lambda D)^-1
// over `anchor_rows` random standardized rows (D leaves the bias out), as an
// offline Ridge fit would leave it.
inline readout::ReadoutState RandomState(int64_t dim, uint64_t seed,
                                         bool with_p = true,
                                         int64_t anchor_rows = 200,
                                         double lambda = 10.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uni(0.5, 2.0);
  readout::ReadoutState s;
  s.spec.dim = dim;
  s.spec.lambda = lambda;
  s.standardizer.mean.resize(dim);
  s.standardizer.scale.resize(dim);
  for (int64_t i = 0; i < dim; ++i) {
    s.standardizer.mean[i] = 3.0 + normal(rng);
    s.standardizer.scale[i] = uni(rng);
  }
  s.theta.resize(dim + 1);
  for (int64_t i = 0; i < dim; ++i) s.theta[i] = 0.5 * normal(rng);
  s.theta[dim] = 15.0;  // sqrt of ~225 tokens
  if (with_p) {
    const int64_t n = dim + 1;
    Eigen::MatrixXd a = Eigen::MatrixXd::Zero(n, n);
    Eigen::VectorXd u(n);
    for (int64_t r = 0; r < anchor_rows; ++r) {
      for (int64_t i = 0; i < dim; ++i) u[i] = normal(rng);
      u[dim] = 1.0;
      a.selfadjointView<Eigen::Lower>().rankUpdate(u);
    }
    a = Eigen::MatrixXd(a.selfadjointView<Eigen::Lower>());
    for (int64_t i = 0; i < dim; ++i) a(i, i) += lambda;
    s.p = readout::SymMatrix::FromDouble(a.inverse());
  }
  s.version = 1;
  return s;
}

// Raw feature rows that standardize to about N(0, 1) under `s`.
inline std::vector<float> RandomFeatures(const readout::ReadoutState& s,
                                         std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> x(s.spec.dim);
  for (int64_t i = 0; i < s.spec.dim; ++i) {
    x[i] = static_cast<float>(s.standardizer.mean[i] +
                              s.standardizer.scale[i] * normal(rng));
  }
  return x;
}

inline std::string Bytes(const std::vector<float>& x) {
  return std::string(reinterpret_cast<const char*>(x.data()),
                     x.size() * sizeof(float));
}

// u = [(x - mean) / scale; 1] in double.
inline Eigen::VectorXd Augmented(const readout::Standardizer& st,
                                 const std::vector<double>& x) {
  const int64_t d = st.dim();
  Eigen::VectorXd u(d + 1);
  for (int64_t i = 0; i < d; ++i) u[i] = (x[i] - st.mean[i]) / st.scale[i];
  u[d] = 1.0;
  return u;
}

// The score of raw features `x` under theta and the standardization, FP64:
// sum_i theta_i (x_i - mean_i) / scale_i + theta_d (= w.x + b).
inline double ReferenceScore(const readout::Standardizer& st,
                             const Eigen::VectorXd& theta,
                             const std::vector<double>& x) {
  return theta.dot(Augmented(st, x));
}
inline double ReferenceScore(const readout::Standardizer& st,
                             const Eigen::VectorXd& theta,
                             const std::vector<float>& x) {
  return ReferenceScore(st, theta, std::vector<double>(x.begin(), x.end()));
}

// The tolerance of a served score against ReferenceScore: the folded weights
// are FP32, so each term may be off by ~2^-24 of its size.
inline double ScoreTolerance(const readout::Standardizer& st,
                             const Eigen::VectorXd& theta,
                             const std::vector<double>& x) {
  double mass = std::abs(theta[st.dim()]);
  for (int64_t i = 0; i < st.dim(); ++i) {
    mass += std::abs(theta[i] / st.scale[i]) *
            (std::abs(x[i]) + std::abs(st.mean[i]));
  }
  return 1e-6 * mass + 1e-9;
}

// The anchored closed form of ridge + RLS over learned completions:
//   theta* = (P0^-1 + sum u u')^-1 (P0^-1 theta0 + sum u y),
// in FP64, with u the FP32 standardized vector the sidecar learns from and
// P0 the FP32 matrix it starts with.
class ClosedForm {
 public:
  explicit ClosedForm(const readout::ReadoutState& s)
      : st_(s.standardizer), a_(s.p->ToDouble().inverse()) {
    rhs_ = a_ * s.theta;
  }
  void Learn(const std::vector<float>& x, double target) {
    const int64_t d = st_.dim();
    Eigen::VectorXd u(d + 1);
    for (int64_t i = 0; i < d; ++i) {
      u[i] = static_cast<float>((static_cast<double>(x[i]) - st_.mean[i]) /
                                st_.scale[i]);
    }
    u[d] = 1.0;
    a_ += u * u.transpose();
    rhs_ += target * u;
  }
  Eigen::VectorXd Theta() const { return a_.ldlt().solve(rhs_); }

 private:
  readout::Standardizer st_;
  Eigen::MatrixXd a_;
  Eigen::VectorXd rhs_;
};

inline double RelErr(const Eigen::VectorXd& got, const Eigen::VectorXd& want) {
  return (got - want).norm() / want.norm();
}

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_READOUT_FIXTURES_H_
