// RLS against an independent FP64 reference: the anchored closed form
//   theta* = (A0 + sum U_i'U_i)^-1 (A0 theta0 + sum U_i'y_i),  P* = (...)^-1
// computed here from first principles with Eigen's FP64 LDLT, never through
// the code under test.
#include "readout/rls.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "Eigen/Cholesky"
#include "gtest/gtest.h"
#include "common/half.h"
#include "readout/internal/kernels.h"

namespace leap::readout {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

// Rows like standardized hidden states: a few strong shared factors plus
// isotropic noise, bias 1 last. Values are rounded to float so the
// reference sees exactly what RLS sees.
class DataGen {
 public:
  DataGen(int64_t d, uint64_t seed) : d_(d), rng_(seed) {
    std::normal_distribution<double> n01;
    factors_ = MatrixXd(d, 4);
    for (int64_t i = 0; i < d; ++i)
      for (int j = 0; j < 4; ++j) factors_(i, j) = n01(rng_) / std::sqrt(d) * 3;
    truth_ = VectorXd(d + 1);
    for (int64_t i = 0; i <= d; ++i) truth_[i] = n01(rng_) / std::sqrt(d);
    truth_[d] = 15.0;
  }
  // Fills k rows of u (n = d+1 floats each, stride ldu) and targets y.
  void Rows(int64_t k, std::vector<float>& u, int64_t ldu,
            std::vector<double>& y, double shift = 0.0) {
    std::normal_distribution<double> n01;
    u.assign(k * ldu, 0.0f);
    y.resize(k);
    for (int64_t a = 0; a < k; ++a) {
      VectorXd g(4);
      for (int j = 0; j < 4; ++j) g[j] = n01(rng_);
      const VectorXd f = factors_ * g;
      for (int64_t i = 0; i < d_; ++i) {
        u[a * ldu + i] = static_cast<float>(f[i] + n01(rng_));
      }
      u[a * ldu + d_] = 1.0f;
      double s = 0;
      for (int64_t i = 0; i <= d_; ++i) s += truth_[i] * u[a * ldu + i];
      // The shifted domain moves the target: RLS must follow.
      s += shift * u[a * ldu];
      y[a] = s + 0.5 * n01(rng_);
    }
  }

 private:
  int64_t d_;
  std::mt19937_64 rng_;
  MatrixXd factors_;
  VectorXd truth_;
};

// Accumulates A += U'U and b += U'y in FP64.
void Accumulate(const std::vector<float>& u, int64_t ldu, int64_t k,
                int64_t n, const std::vector<double>& y, MatrixXd& a,
                VectorXd& b) {
  for (int64_t r = 0; r < k; ++r) {
    VectorXd row(n);
    for (int64_t i = 0; i < n; ++i) row[i] = u[r * ldu + i];
    a.selfadjointView<Eigen::Lower>().rankUpdate(row);
    b += y[r] * row;
  }
}

struct Anchor {
  MatrixXd a0;  // full symmetric
  VectorXd b0;  // A0 theta0
  VectorXd theta0;
  MatrixXd p0;
};

// The offline fit the RLS anchors to, in FP64: A0 = U0'U0 + lambda D.
Anchor MakeAnchor(DataGen& gen, int64_t d, int64_t rows, double lambda) {
  const int64_t n = d + 1;
  std::vector<float> u;
  std::vector<double> y;
  gen.Rows(rows, u, n, y);
  MatrixXd a = MatrixXd::Zero(n, n);
  VectorXd b = VectorXd::Zero(n);
  Accumulate(u, n, rows, n, y, a, b);
  a = a.selfadjointView<Eigen::Lower>();
  for (int64_t i = 0; i < d; ++i) a(i, i) += lambda;
  Anchor an;
  an.a0 = a;
  Eigen::LDLT<MatrixXd> ldlt(a);
  an.theta0 = ldlt.solve(b);
  an.b0 = b;
  an.p0 = ldlt.solve(MatrixXd::Identity(n, n));
  return an;
}

double RelErr(const VectorXd& got, const VectorXd& want) {
  return (got - want).norm() / want.norm();
}

// Batches of the given sizes after the anchor, and the FP64 closed form
// (theta*, P*) over the anchor and all of them.
struct BatchesAndClosedForm {
  std::vector<std::vector<float>> us;
  std::vector<std::vector<double>> ys;
  VectorXd theta_star;
  MatrixXd p_star;
};

BatchesAndClosedForm MakeBatches(DataGen& gen, int64_t n, const Anchor& an,
                                 const std::vector<int>& sizes) {
  BatchesAndClosedForm out;
  MatrixXd a = an.a0;
  VectorXd b = an.b0;
  for (int k : sizes) {
    out.us.emplace_back();
    out.ys.emplace_back();
    gen.Rows(k, out.us.back(), n, out.ys.back(), 0.7);
    MatrixXd da = MatrixXd::Zero(n, n);
    Accumulate(out.us.back(), n, k, n, out.ys.back(), da, b);
    a += MatrixXd(da.selfadjointView<Eigen::Lower>());
  }
  Eigen::LDLT<MatrixXd> ldlt(a);
  out.theta_star = ldlt.solve(b);
  out.p_star = ldlt.solve(MatrixXd::Identity(n, n));
  return out;
}

// The fused sweep, against FP64, for every kernel set: P's upper blocks
// folded with W (the rest of P poisoned with NaN: never read, never
// written), D + the earlier blocks' T equal U P on the folded P, and the
// diagonal blocks stay exactly symmetric.
TEST(SymSweepKernel, FoldsAndMultipliesLikeFp64ForEveryKernelAndShape) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> unif(-1, 1);
  constexpr int64_t kB = internal::kSymBlock;
  for (const internal::Kernels* kern : internal::SupportedKernels()) {
    for (int64_t n : {1, 7, 96, 97, 300, 613}) {
      const int64_t ld = (n + 15) / 16 * 16;
      const int64_t blocks = (n + kB - 1) / kB;
      std::vector<float> sym(n * ld, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = i; j < n; ++j) sym[i * ld + j] = sym[j * ld + i] = unif(rng);
      }
      for (int k = 1; k <= internal::kPanelMaxVectors; ++k) {
        for (bool fold : {false, true}) {
          std::vector<float> p = sym;
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = 0; j < ld; ++j) {
              if (i / kB > j / kB) p[i * ld + j] = std::nanf("");
            }
          }
          std::vector<float> w(k * ld, 0.0f), u(k * ld, 0.0f);
          for (int c = 0; c < k; ++c) {
            for (int64_t j = 0; j < n; ++j) {
              w[c * ld + j] = 0.3f * unif(rng);
              u[c * ld + j] = unif(rng);
            }
          }
          std::vector<float> d(n * k, -99.0f), t(k * ld, 0.0f), v(k * n, 0.0f);
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t r0 = b * kB, r1 = std::min(n, r0 + kB);
            // D + T of the blocks above: row i's full dot.
            for (int c = 0; c < k; ++c) {
              for (int64_t i = r0; i < r1; ++i) v[c * n + i] = t[c * ld + i];
            }
            kern->sym_sweep(p.data(), ld, n, r0, r1, k, fold, w.data(), u.data(),
                            ld, d.data() + r0 * k, t.data(), ld);
            for (int c = 0; c < k; ++c) {
              for (int64_t i = r0; i < r1; ++i) v[c * n + i] += d[i * k + c];
            }
          }
          // The folded P in FP64 (from the FP32 input), then U P from the
          // kernel's own folded FP32 values.
          std::vector<double> pf(n * n);
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              double x = sym[i * ld + j], mag = std::abs(x);
              if (fold) {
                for (int c = 0; c < k; ++c) {
                  const double t2 = double{w[c * ld + i]} * w[c * ld + j];
                  x -= t2;
                  mag += std::abs(t2);
                }
              }
              const bool stored = i / kB <= j / kB;
              const float got = stored ? p[i * ld + j] : p[j * ld + i];
              ASSERT_NEAR(got, x, 4e-7 * mag + 1e-30)
                  << kern->name << " n=" << n << " k=" << k << " P(" << i << "," << j << ")";
              if (i / kB == j / kB) {
                ASSERT_EQ(p[i * ld + j], p[j * ld + i])
                    << kern->name << " diagonal block not symmetric at " << i << "," << j;
              }
              pf[i * n + j] = got;
            }
            for (int64_t j = n; j < ld; ++j) {
              if (i / kB <= j / kB) {
                ASSERT_EQ(p[i * ld + j], 0.0f) << "padding written";
              }
            }
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t j = 0; j < ld; ++j) {
              if (i / kB > j / kB) {
                ASSERT_TRUE(std::isnan(p[i * ld + j])) << "lower block written";
              }
            }
          }
          for (int c = 0; c < k; ++c) {
            for (int64_t i = 0; i < n; ++i) {
              double ref = 0, mag = 0;
              for (int64_t j = 0; j < n; ++j) {
                ref += pf[i * n + j] * u[c * ld + j];
                mag += std::abs(pf[i * n + j] * u[c * ld + j]);
              }
              ASSERT_NEAR(v[c * n + i], ref, 1e-6 * mag + 1e-7)
                  << kern->name << " n=" << n << " k=" << k << " fold=" << fold
                  << " (U P)[" << c << "," << i << "]";
            }
          }
        }
      }
    }
  }
}

// A row's dots and folded values do not depend on whether the sweep runs
// it in a pair of rows or alone (kernels.h: each sum's order is fixed by
// r0, r1, n, ldp; AVX-512 pairs rows and adds a pair's 16 sums together):
// rows r0 .. r0 + 2 swept with r1 = r0 + 3 (a pair, then one alone) equal,
// bit for bit, the same rows swept with the whole block (pairs only).
TEST(SymSweepKernel, RowsInPairsEqualRowsAloneBitForBit) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> unif(-1, 1);
  constexpr int64_t kB = internal::kSymBlock;
  const int64_t n = 613, ld = (n + 15) / 16 * 16;
  std::vector<float> sym(n * ld, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = i; j < n; ++j) sym[i * ld + j] = sym[j * ld + i] = unif(rng);
  }
  for (const internal::Kernels* kern : internal::SupportedKernels()) {
    for (int k = 1; k <= internal::kPanelMaxVectors; ++k) {
      for (bool fold : {false, true}) {
        std::vector<float> w(k * ld, 0.0f), u(k * ld, 0.0f);
        for (int c = 0; c < k; ++c) {
          for (int64_t j = 0; j < n; ++j) {
            w[c * ld + j] = 0.3f * unif(rng);
            u[c * ld + j] = unif(rng);
          }
        }
        for (int64_t r0 : {int64_t{0}, 2 * kB}) {
          std::vector<float> p_all = sym, p_three = sym;
          std::vector<float> d_all(kB * k, 0.0f), d_three(3 * k, 0.0f);
          std::vector<float> t_all(k * ld, 0.0f), t_three(k * ld, 0.0f);
          kern->sym_sweep(p_all.data(), ld, n, r0, r0 + kB, k, fold, w.data(), u.data(),
                          ld, d_all.data(), t_all.data(), ld);
          kern->sym_sweep(p_three.data(), ld, n, r0, r0 + 3, k, fold, w.data(),
                          u.data(), ld, d_three.data(), t_three.data(), ld);
          for (int64_t r = 0; r < 3; ++r) {
            for (int c = 0; c < k; ++c) {
              ASSERT_EQ(d_three[r * k + c], d_all[r * k + c])
                  << kern->name << " k=" << k << " fold=" << fold << " row " << r0 + r
                  << " dot " << c;
            }
            for (int64_t j = r0; j < ld; ++j) {
              ASSERT_EQ(p_three[(r0 + r) * ld + j], p_all[(r0 + r) * ld + j])
                  << kern->name << " k=" << k << " P(" << r0 + r << "," << j << ")";
            }
          }
        }
      }
    }
  }
}

// The acceptance: >= 1,000 batches of random sizes 1..64 equal the
// anchored closed form over all data.
TEST(Rls, ThousandRandomBatchesEqualAnchoredClosedForm) {
  const int64_t d = 48, n = d + 1;
  DataGen gen(d, 11);
  const double lambda = 5.0;
  Anchor an = MakeAnchor(gen, d, 400, lambda);
  RlsOptions opt;
  opt.fold_columns = 96;  // exercise many folds and pending corrections
  RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0), opt);

  MatrixXd a = an.a0;
  VectorXd b = an.b0;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<int> size(1, 64);
  int64_t total = 0;
  for (int batch = 0; batch < 1000; ++batch) {
    const int k = size(rng);
    std::vector<float> u;
    std::vector<double> y;
    const int64_t ldu = n + (batch % 3);  // also odd row strides
    gen.Rows(k, u, ldu, y, /*shift=*/batch < 500 ? 0.0 : 0.8);
    ASSERT_TRUE(rls.Update(u.data(), ldu, y).ok());
    MatrixXd da = MatrixXd::Zero(n, n);
    Accumulate(u, ldu, k, n, y, da, b);
    a += MatrixXd(da.selfadjointView<Eigen::Lower>());
    total += k;
  }
  ASSERT_GE(total, 30000);
  Eigen::LDLT<MatrixXd> ldlt(a);
  const VectorXd theta_star = ldlt.solve(b);
  const MatrixXd p_star = ldlt.solve(MatrixXd::Identity(n, n));

  const double theta_err = RelErr(rls.theta(), theta_star);
  const MatrixXd p = rls.P().ToDouble();
  const double p_err = (p - p_star).norm() / p_star.norm();
  std::printf("RLS vs closed form after 1000 batches (%lld rows): "
              "theta rel err %.3g, P rel err %.3g\n",
              static_cast<long long>(total), theta_err, p_err);
  // Tolerance: FP32 P, FP64 theta. Measured 8.6e-9 and 3.0e-7 (AVX2).
  EXPECT_LT(theta_err, 1e-6);
  EXPECT_LT(p_err, 1e-5);
  // Without RLS (frozen) theta0 is far from theta*: the test can fail.
  EXPECT_GT(RelErr(an.theta0, theta_star), 1e-2);
}

TEST(Rls, BatchSizeOnlyChangesTiming) {
  const int64_t d = 20, n = d + 1;
  DataGen gen(d, 2);
  Anchor an = MakeAnchor(gen, d, 100, 1.0);
  std::vector<float> u;
  std::vector<double> y;
  gen.Rows(960, u, n, y, 0.5);
  RlsState one(an.theta0, SymMatrix::FromDouble(an.p0));
  RlsState eights(an.theta0, SymMatrix::FromDouble(an.p0));
  RlsState all(an.theta0, SymMatrix::FromDouble(an.p0));
  for (int64_t r = 0; r < 960; ++r) {
    ASSERT_TRUE(one.Update(u.data() + r * n, n, {y.data() + r, 1}).ok());
  }
  for (int64_t r = 0; r < 960; r += 8) {
    ASSERT_TRUE(eights.Update(u.data() + r * n, n, {y.data() + r, 8}).ok());
  }
  ASSERT_TRUE(all.Update(u.data(), n, y).ok());
  EXPECT_LT(RelErr(one.theta(), eights.theta()), 1e-5);
  EXPECT_LT(RelErr(all.theta(), eights.theta()), 1e-5);
  EXPECT_EQ(one.updates(), 960);
}

TEST(Rls, PStaysExactlySymmetric) {
  const int64_t d = 40, n = d + 1;
  DataGen gen(d, 9);
  Anchor an = MakeAnchor(gen, d, 200, 2.0);
  RlsOptions opt;
  opt.fold_columns = 16;
  RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0), opt);
  for (int b = 0; b < 50; ++b) {
    std::vector<float> u;
    std::vector<double> y;
    gen.Rows(8, u, n, y);
    ASSERT_TRUE(rls.Update(u.data(), n, y).ok());
  }
  const SymMatrix& p = rls.P();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) ASSERT_EQ(p(i, j), p(j, i));
  EXPECT_TRUE(rls.CheckHealth().ok());
}

// A shared P (a checkpoint's, copied off the updating thread) is the state
// at that moment bit for bit, stays so while later batches fold (they copy P
// first), and sharing changes nothing in the learning.
TEST(Rls, SharedPIsTheStateAndSurvivesLaterFolds) {
  const int64_t d = 230, n = d + 1;  // three 96-row blocks
  DataGen gen(d, 31);
  Anchor an = MakeAnchor(gen, d, 400, 2.0);
  RlsOptions opt;
  opt.fold_columns = 32;
  opt.threads = 2;
  RlsState shared(an.theta0, SymMatrix::FromDouble(an.p0), opt);
  RlsState plain(an.theta0, SymMatrix::FromDouble(an.p0), opt);
  std::shared_ptr<const SymMatrix> held;
  MatrixXd held_value;
  for (int b = 0; b < 24; ++b) {
    std::vector<float> u;
    std::vector<double> y;
    const int64_t k = b % 3 == 0 ? 4 : 16;  // the panel and the blocked path
    gen.Rows(k, u, n, y);
    ASSERT_TRUE(shared.Update(u.data(), n, y).ok());
    ASSERT_TRUE(plain.Update(u.data(), n, y).ok());
    if (b % 5 == 2) {
      if (held != nullptr) {
        ASSERT_EQ(CopySymmetric(*held).ToDouble(), held_value) << "batch " << b;
      }
      held = shared.SharedP();
      held_value = CopySymmetric(*held).ToDouble();
      plain.Flush();  // the same fold points as `shared`
      ASSERT_EQ(held_value, plain.P().ToDouble()) << "batch " << b;
    }
  }
  ASSERT_EQ(CopySymmetric(*held).ToDouble(), held_value);
  EXPECT_EQ(shared.theta(), plain.theta());
  EXPECT_EQ(shared.P().ToDouble(), plain.P().ToDouble());
}

TEST(Rls, LossOfDefinitenessIsDetectedAndStateUnchanged) {
  const int64_t n = 9;
  VectorXd theta = VectorXd::LinSpaced(n, -1, 1);
  // An indefinite "P": S = I + U P U' goes below 1/2.
  SymMatrix p = SymMatrix::ScaledIdentity(n, -1.0f);
  RlsState rls(theta, p);
  std::vector<float> u(n, 1.0f);
  std::vector<double> y = {3.0};
  absl::Status s = rls.Update(u.data(), n, y);
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("positive definiteness"), absl::string_view::npos);
  EXPECT_EQ(rls.theta(), theta);
  EXPECT_EQ(rls.updates(), 0);
  EXPECT_FALSE(rls.CheckHealth().ok());
}

TEST(Rls, NonFiniteInputRejectedWithoutChange) {
  const int64_t n = 5;
  RlsState rls(VectorXd::Zero(n), SymMatrix::ScaledIdentity(n, 1.0f));
  std::vector<float> u = {1, 2, NAN, 4, 1};
  std::vector<double> y = {1.0};
  EXPECT_EQ(rls.Update(u.data(), n, y).code(),
            absl::StatusCode::kInvalidArgument);
  u[2] = 3;
  y[0] = INFINITY;
  EXPECT_EQ(rls.Update(u.data(), n, y).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rls.theta(), VectorXd::Zero(n));
  EXPECT_EQ(rls.updates(), 0);
}

// Drift of the FP32 P after 10,000 updates at d = 1024 against the FP64
// closed form. The bound below is the documented guarantee.
TEST(Rls, Fp32DriftAfterTenThousandUpdatesAtD1024IsBounded) {
  const int64_t d = 1024, n = d + 1;
  DataGen gen(d, 21);
  Anchor an = MakeAnchor(gen, d, 3000, 0.01 * 3000);
  RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0));
  MatrixXd a = an.a0;
  VectorXd b = an.b0;
  MatrixXd da = MatrixXd::Zero(n, n);
  for (int batch = 0; batch < 1250; ++batch) {
    std::vector<float> u;
    std::vector<double> y;
    gen.Rows(8, u, n, y, 0.5);
    ASSERT_TRUE(rls.Update(u.data(), n, y).ok()) << "batch " << batch;
    Accumulate(u, n, 8, n, y, da, b);
  }
  a += MatrixXd(da.selfadjointView<Eigen::Lower>());
  ASSERT_EQ(rls.updates(), 10000);
  Eigen::LLT<MatrixXd> llt(a);
  const VectorXd theta_star = llt.solve(b);
  const MatrixXd p_star = llt.solve(MatrixXd::Identity(n, n));
  const MatrixXd p = rls.P().ToDouble();
  const double p_err = (p - p_star).norm() / p_star.norm();
  const double p_max = (p - p_star).cwiseAbs().maxCoeff() /
                       p_star.diagonal().cwiseAbs().maxCoeff();
  const double theta_err = RelErr(rls.theta(), theta_star);
  std::printf("FP32 P drift at d=1024 after 10000 updates: ||P-P*||/||P*|| = "
              "%.3g, max|P-P*|/max diag = %.3g, theta rel err = %.3g\n",
              p_err, p_max, theta_err);
  // Measured 6.3e-7, 1.7e-6 and 7.4e-9 (AVX-512, P rounded once per batch
  // of 8 by the fused sweep; 1.8e-7, 3.9e-7, 3.8e-9 when it was rounded
  // once per 256 columns): the bounds leave a 6-13x margin.
  EXPECT_LT(p_err, 5e-6);
  EXPECT_LT(p_max, 1e-5);
  EXPECT_LT(theta_err, 1e-7);
  EXPECT_TRUE(rls.CheckHealth().ok());
}

// ---------------------------------------------------------------------------
// Every kernel set (issue 13): each variant against FP64, skipped with a
// message on a CPU that lacks it.
class KernelVariant : public ::testing::TestWithParam<const char*> {
 protected:
  const internal::Kernels* Kern() { return internal::KernelsByName(GetParam()); }
};

#define LEAP_REQUIRE_VARIANT()                                              \
  if (Kern() == nullptr) {                                                  \
    GTEST_SKIP() << "kernel set '" << GetParam()                            \
                 << "' not supported by this CPU: its test is skipped";     \
  }

TEST_P(KernelVariant, GemmAccMatchesFp64AndIgnoresSplits) {
  LEAP_REQUIRE_VARIANT();
  const internal::Kernels& kern = *Kern();
  std::mt19937_64 rng(17);
  std::uniform_real_distribution<float> unif(-1, 1);
  for (int64_t m : {1, 5, 12, 13, 30}) {
    for (int64_t N : {16, 48, 80, 1040}) {
      for (int64_t K : {1, 7, 128, 129, 300}) {
        for (bool trans : {false, true}) {
          // A is m x K, stored row-major (a_rs = K + 1) or transposed.
          const int64_t lda = (trans ? m : K) + 1;
          std::vector<float> a((trans ? K : m) * lda), b(K * (N + 16)),
              c(m * (N + 32));
          for (auto& x : a) x = unif(rng);
          for (auto& x : b) x = unif(rng);
          for (auto& x : c) x = unif(rng);
          const int64_t a_rs = trans ? 1 : lda, a_cs = trans ? lda : 1;
          const int64_t ldb = N + 16, ldc = N + 32;
          const float alpha = trans ? -1.0f : 1.0f;
          std::vector<float> got = c;
          kern.gemm_acc(m, N, K, alpha, a.data(), a_rs, a_cs, b.data(), ldb,
                        got.data(), ldc);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < N; ++j) {
              double ref = c[i * ldc + j], mag = std::abs(ref);
              for (int64_t p = 0; p < K; ++p) {
                const double t = double{a[i * a_rs + p * a_cs]} * b[p * ldb + j];
                ref += alpha * t;
                mag += std::abs(t);
              }
              ASSERT_NEAR(got[i * ldc + j], ref, 2e-6 * mag + 1e-6)
                  << kern.name << " m=" << m << " N=" << N << " K=" << K;
            }
          }
          // The same product split in rows and in 16-column pieces: every
          // entry bit-identical.
          std::vector<float> split = c;
          for (int64_t i0 = 0; i0 < m; i0 += 5) {
            for (int64_t j0 = 0; j0 < N; j0 += 16 * (1 + i0 % 3)) {
              const int64_t nn = std::min<int64_t>(N - j0, 16 * (1 + i0 % 3));
              kern.gemm_acc(std::min<int64_t>(5, m - i0), nn, K, alpha,
                            a.data() + i0 * a_rs, a_rs, a_cs, b.data() + j0, ldb,
                            split.data() + i0 * ldc + j0, ldc);
            }
          }
          ASSERT_EQ(split, got) << kern.name;
        }
      }
    }
  }
}

// gemm_acc_sym reads only the upper kSymBlock blocks of a symmetric P (the
// rest is poisoned with NaN here) and gives gemm_acc's result on the fully
// stored P bit for bit, for any column range.
TEST_P(KernelVariant, GemmAccSymReadsUpperBlocksOnlyAndMatchesGemmAcc) {
  LEAP_REQUIRE_VARIANT();
  const internal::Kernels& kern = *Kern();
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<float> unif(-1, 1);
  constexpr int64_t kB = internal::kSymBlock;
  for (int64_t K : {5, 97, 300, 600}) {
    const int64_t ld = (K + 15) / 16 * 16;
    std::vector<float> full(K * ld, 0.0f);
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = i; j < K; ++j) full[i * ld + j] = full[j * ld + i] = unif(rng);
    }
    std::vector<float> upper = full;
    for (int64_t i = 0; i < K; ++i) {
      for (int64_t j = 0; j < K; ++j) {
        if (i / kB > j / kB) upper[i * ld + j] = std::nanf("");
      }
    }
    for (int64_t m : {1, 13, 40}) {
      std::vector<float> a(m * (K + 3)), c(m * ld);
      for (auto& x : a) x = unif(rng);
      for (auto& x : c) x = unif(rng);
      std::vector<float> want = c;
      kern.gemm_acc(m, ld, K, 1.0f, a.data(), K + 3, 1, full.data(), ld,
                    want.data(), ld);
      for (int64_t step : {int64_t{16}, int64_t{64}, ld}) {
        std::vector<float> got = c;
        for (int64_t j0 = 0; j0 < ld; j0 += step) {
          kern.gemm_acc_sym(m, std::min(step, ld - j0), K, 1.0f, a.data(),
                            K + 3, 1, upper.data(), ld, j0, got.data() + j0, ld);
        }
        ASSERT_EQ(got, want) << kern.name << " K=" << K << " m=" << m
                             << " step=" << step;
      }
    }
  }
}

// gemm_acc_packed on a matrix packed once by PackPanels gives gemm_acc's
// result on the unpacked matrix bit for bit, for every column range that
// starts on a panel (to the end, or a whole number of panels).
TEST_P(KernelVariant, GemmAccPackedMatchesGemmAccBitForBit) {
  LEAP_REQUIRE_VARIANT();
  const internal::Kernels& kern = *Kern();
  const int64_t nr = kern.panel_floats;
  ASSERT_TRUE(nr == 16 || nr == 32) << kern.name << " panel " << nr;
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<float> unif(-1, 1);
  for (int64_t K : {1, 9, 256, 300}) {
    for (int64_t n : {16, 48, 304, 1040}) {
      const int64_t ldb = n + 32;
      std::vector<float> b(K * ldb);
      for (auto& x : b) x = unif(rng);
      // 64-byte aligned, as PackPanels requires.
      std::unique_ptr<float[], void (*)(void*)> packed(
          static_cast<float*>(std::aligned_alloc(64, sizeof(float) * K * n)),
          std::free);
      std::fill(packed.get(), packed.get() + K * n, std::nanf(""));
      internal::PackPanels(kern, b.data(), ldb, K, n, packed.get());
      for (int64_t m : {1, 13, 96}) {
        // A = W' as the fold passes it (a_rs = 1, a_cs = its row stride).
        const int64_t lda = m + 5;
        std::vector<float> a(K * lda), c(m * (n + 8));
        for (auto& x : a) x = unif(rng);
        for (auto& x : c) x = unif(rng);
        for (int64_t j0 = 0; j0 < n; j0 += nr) {
          for (int64_t N : {n - j0, nr}) {
            if (j0 + N > n) continue;
            std::vector<float> want = c, got = c;
            kern.gemm_acc(m, N, K, -1.0f, a.data(), 1, lda, b.data() + j0, ldb,
                          want.data(), n + 8);
            kern.gemm_acc_packed(m, N, K, -1.0f, a.data(), 1, lda,
                                 packed.get(), n, j0, got.data(), n + 8);
            ASSERT_EQ(got, want) << kern.name << " K=" << K << " n=" << n
                                 << " m=" << m << " j0=" << j0 << " N=" << N;
          }
          if (j0 > 3 * nr) j0 += 5 * nr;  // a sample of the later columns
        }
      }
    }
  }
}

TEST_P(KernelVariant, DotF64BlockIsExactOnFloatInputs) {
  LEAP_REQUIRE_VARIANT();
  const internal::Kernels& kern = *Kern();
  std::mt19937_64 rng(19);
  std::uniform_real_distribution<float> unif(-1, 1);
  for (int64_t k : {1, 3, 4, 9, 33}) {
    for (int64_t n : {1, 7, 8, 61, 1027}) {
      const int64_t ldx = n + 3, ldy = n + 16;
      std::vector<float> x(k * ldx), y(k * ldy);
      for (auto& v : x) v = unif(rng);
      for (auto& v : y) v = unif(rng);
      std::vector<double> s(k * k, -7.0);
      kern.dot_f64_block(x.data(), ldx, y.data(), ldy, k, n, s.data(), k);
      for (int64_t a = 0; a < k; ++a) {
        for (int64_t b = a; b < k; ++b) {
          long double ref = 0;
          for (int64_t j = 0; j < n; ++j) {
            ref += static_cast<long double>(x[a * ldx + j]) * y[b * ldy + j];
          }
          ASSERT_NEAR(s[a * k + b], static_cast<double>(ref), 1e-13 * n)
              << kern.name << " k=" << k << " n=" << n;
        }
      }
    }
  }
}

TEST_P(KernelVariant, PredictionDotsMatchFp64AtAnyAlignment) {
  LEAP_REQUIRE_VARIANT();
  const internal::Kernels& kern = *Kern();
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<float> unif(-1, 1);
  for (int64_t n : {1, 15, 16, 17, 127, 128, 129, 4096, 4097}) {
    std::vector<float> w(n), wp(n), x(n + 16);
    for (auto& v : w) v = unif(rng);
    for (auto& v : x) v = unif(rng);
    internal::PermuteForBf16(w.data(), n, wp.data());
    std::vector<uint16_t> xb(n + 32), xh(n + 32);
    for (size_t i = 0; i < xb.size(); ++i) {
      xb[i] = FloatToBf16(unif(rng));
      xh[i] = FloatToFp16(unif(rng));
    }
    for (int off = 0; off < 16; ++off) {  // every alignment of x
      double r32 = 0, rb = 0, rh = 0, mag = 0;
      for (int64_t i = 0; i < n; ++i) {
        r32 += double{w[i]} * x[off + i];
        rb += double{w[i]} * Bf16ToFloat(xb[off + i]);
        rh += double{w[i]} * Fp16ToFloat(xh[off + i]);
        mag += std::abs(w[i]);
      }
      const double tol = 1e-6 * mag + 1e-6;
      ASSERT_NEAR(kern.dot_f32(w.data(), x.data() + off, n), r32, tol)
          << kern.name << " n=" << n << " off=" << off;
      ASSERT_NEAR(kern.dot_bf16(wp.data(), xb.data() + off, n), rb, tol)
          << kern.name << " n=" << n << " off=" << off;
      ASSERT_NEAR(kern.dot_f16(w.data(), xh.data() + off, n), rh, tol)
          << kern.name << " n=" << n << " off=" << off;
    }
  }
}

// Batch sizes 1..256 in one run (fold_columns 256), against the FP64
// anchored closed form; thread counts 1..4 give bit-identical theta and P.
TEST_P(KernelVariant, BatchSizesUpTo256AndThreadCountsEqualClosedForm) {
  LEAP_REQUIRE_VARIANT();
  const int64_t d = 200, n = d + 1;
  DataGen gen(d, 31);
  Anchor an = MakeAnchor(gen, d, 600, 3.0);
  const std::vector<int> sizes = {1,  2,  3,  5,  7,   8,   9,   12,  13,
                                  16, 17, 31, 32, 33,  47,  48,  49,  64,
                                  95, 96, 97, 127, 128, 129, 200, 255, 256};
  const BatchesAndClosedForm batches = MakeBatches(gen, n, an, sizes);
  const auto& us = batches.us;
  const auto& ys = batches.ys;
  const VectorXd& theta_star = batches.theta_star;
  const MatrixXd& p_star = batches.p_star;
  VectorXd theta_1;
  MatrixXd p_1;
  for (int threads = 1; threads <= 4; ++threads) {
    RlsOptions opt;
    opt.kernels = GetParam();
    opt.large_batches = "kernels";  // the hand kernels of this set
    opt.threads = threads;
    RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0), opt);
    ASSERT_EQ(rls.threads(), threads);
    ASSERT_STREQ(rls.kernel_name(), GetParam());
    for (size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE(rls.Update(us[i].data(), n, ys[i]).ok());
    }
    const double theta_err = RelErr(rls.theta(), theta_star);
    const MatrixXd p = rls.P().ToDouble();
    const double p_err = (p - p_star).norm() / p_star.norm();
    std::printf("%s, %d threads, batch sizes 1..256 at d=%lld: theta rel err "
                "%.3g, P rel err %.3g\n",
                GetParam(), threads, static_cast<long long>(d), theta_err, p_err);
    EXPECT_LT(theta_err, 1e-6);
    EXPECT_LT(p_err, 1e-5);
    if (threads == 1) {
      theta_1 = rls.theta();
      p_1 = p;
    } else {
      EXPECT_EQ((rls.theta() - theta_1).cwiseAbs().maxCoeff(), 0.0)
          << threads << " threads";
      EXPECT_EQ((p - p_1).cwiseAbs().maxCoeff(), 0.0) << threads << " threads";
    }
  }
  EXPECT_GT(RelErr(an.theta0, theta_star), 1e-2);
}

// The OpenBLAS large-batch path (product and fold through OpenBLAS, in
// fixed pieces), whatever kernels OpenBLAS picked for this CPU: batch sizes
// 1..256 against the FP64 closed form, thread counts 1..4 bit-identical, P
// exactly symmetric.
TEST(Rls, OpenBlasLargeBatchesEqualClosedFormAndIgnoreThreads) {
  const int64_t d = 300, n = d + 1;  // four row blocks of 96
  DataGen gen(d, 41);
  Anchor an = MakeAnchor(gen, d, 700, 3.0);
  const std::vector<int> sizes = {1,  8,  9,  13, 33, 96, 97, 128,
                                  5,  200, 255, 256, 2, 64, 17};
  const BatchesAndClosedForm batches = MakeBatches(gen, n, an, sizes);
  const auto& us = batches.us;
  const auto& ys = batches.ys;
  const VectorXd& theta_star = batches.theta_star;
  const MatrixXd& p_star = batches.p_star;
  VectorXd theta_1;
  MatrixXd p_1;
  for (int threads = 1; threads <= 4; ++threads) {
    RlsOptions opt;
    opt.threads = threads;
    opt.large_batches = "openblas";
    RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0), opt);
    ASSERT_EQ(rls.large_batch_variant().rfind("openblas ", 0), 0u)
        << rls.large_batch_variant();
    for (size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_TRUE(rls.Update(us[i].data(), n, ys[i]).ok());
    }
    const double theta_err = RelErr(rls.theta(), theta_star);
    const SymMatrix& ps = rls.P();
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) ASSERT_EQ(ps(i, j), ps(j, i)) << i << "," << j;
    }
    const MatrixXd p = ps.ToDouble();
    const double p_err = (p - p_star).norm() / p_star.norm();
    std::printf("%s, %d threads, batch sizes 1..256 at d=%lld: theta rel err "
                "%.3g, P rel err %.3g\n",
                rls.large_batch_variant().c_str(), threads,
                static_cast<long long>(d), theta_err, p_err);
    EXPECT_LT(theta_err, 1e-6);
    EXPECT_LT(p_err, 1e-5);
    if (threads == 1) {
      theta_1 = rls.theta();
      p_1 = p;
    } else {
      EXPECT_EQ((rls.theta() - theta_1).cwiseAbs().maxCoeff(), 0.0)
          << threads << " threads";
      EXPECT_EQ((p - p_1).cwiseAbs().maxCoeff(), 0.0) << threads << " threads";
    }
  }
  EXPECT_GT(RelErr(an.theta0, theta_star), 1e-2);
}

// Every batch size from 1 to 256 (32,896 rows) with the best kernels and
// the default thread count, against the FP64 closed form.
TEST(Rls, EveryBatchSizeFrom1To256EqualsClosedForm) {
  const int64_t d = 40, n = d + 1;
  DataGen gen(d, 37);
  Anchor an = MakeAnchor(gen, d, 300, 2.0);
  RlsState rls(an.theta0, SymMatrix::FromDouble(an.p0));
  MatrixXd a = an.a0;
  VectorXd b = an.b0;
  for (int k = 1; k <= 256; ++k) {
    std::vector<float> u;
    std::vector<double> y;
    gen.Rows(k, u, n + 1, y, k < 128 ? 0.0 : 0.6);
    ASSERT_TRUE(rls.Update(u.data(), n + 1, y).ok()) << k;
    MatrixXd da = MatrixXd::Zero(n, n);
    Accumulate(u, n + 1, k, n, y, da, b);
    a += MatrixXd(da.selfadjointView<Eigen::Lower>());
  }
  Eigen::LDLT<MatrixXd> ldlt(a);
  const double theta_err = RelErr(rls.theta(), ldlt.solve(b));
  const MatrixXd p_star = ldlt.solve(MatrixXd::Identity(n, n));
  const double p_err = (rls.P().ToDouble() - p_star).norm() / p_star.norm();
  std::printf("%s, %d threads, every batch size 1..256: theta rel err %.3g, "
              "P rel err %.3g\n",
              rls.kernel_name(), rls.threads(), theta_err, p_err);
  EXPECT_EQ(rls.updates(), 256 * 257 / 2);
  EXPECT_LT(theta_err, 1e-6);
  EXPECT_LT(p_err, 1e-5);
}

// A feature so large that P u overflows FP32 in any row of a batch makes S
// non-finite: the batch is rejected and nothing changes, for every kernel.
TEST_P(KernelVariant, OverflowInAnyRowRejectsTheBatch) {
  LEAP_REQUIRE_VARIANT();
  const int64_t n = 40;
  for (const char* large : {"kernels", "openblas"})
  for (int k : {1, 8, 9, 40}) {
    for (int bad = 0; bad < k; bad += std::max(1, k / 3)) {
      RlsOptions opt;
      opt.kernels = GetParam();
      opt.large_batches = large;
      RlsState rls(VectorXd::Zero(n), SymMatrix::ScaledIdentity(n, 10.0f), opt);
      std::vector<float> u(k * n, 0.5f);
      std::vector<double> y(k, 3.0);
      u[bad * n + 2] = 3e38f;
      const absl::Status s = rls.Update(u.data(), n, y);
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition)
          << GetParam() << " " << large << " k=" << k << " bad row " << bad
          << ": " << s;
      EXPECT_EQ(rls.updates(), 0);
      EXPECT_EQ(rls.theta(), VectorXd::Zero(n));
      EXPECT_EQ(rls.pending_columns(), 0);
    }
  }
}

TEST(Rls, OptionsRejectUnknownKernelsAndBadThreads) {
  RlsOptions o;
  o.kernels = "sse9";
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o.kernels = "";
  o.threads = -1;
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  o.threads = 0;
  EXPECT_TRUE(o.Validate().ok());
  o.large_batches = "mkl";
  EXPECT_EQ(o.Validate().code(), absl::StatusCode::kInvalidArgument);
  for (const char* v : {"openblas", "kernels", ""}) {
    o.large_batches = v;
    EXPECT_TRUE(o.Validate().ok()) << v;
  }
  EXPECT_GE(AvailableCores(), 1);
}

INSTANTIATE_TEST_SUITE_P(AllVariants, KernelVariant,
                         ::testing::Values("portable", "avx2", "avx512"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace leap::readout
