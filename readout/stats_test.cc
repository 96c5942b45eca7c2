#include "readout/stats.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace leap::readout {
namespace {

using ::testing::ElementsAre;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- Independent O(n^2) references -------------------------------------

// Rank of v[i] = 1 + (# smaller) + (# equal others) / 2.
std::vector<double> BruteRanks(const std::vector<double>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t less = 0, equal = 0;
    for (size_t j = 0; j < v.size(); ++j) {
      if (v[j] < v[i]) ++less;
      if (j != i && v[j] == v[i]) ++equal;
    }
    r[i] = 1.0 + static_cast<double>(less) + 0.5 * static_cast<double>(equal);
  }
  return r;
}

// Pearson correlation in long double with two-pass means.
double BrutePearson(const std::vector<double>& x,
                    const std::vector<double>& y) {
  const size_t n = x.size();
  long double mx = 0, my = 0;
  for (size_t i = 0; i < n; ++i) {
    mx += x[i];
    my += y[i];
  }
  mx /= n;
  my /= n;
  long double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < n; ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return static_cast<double>(sxy / std::sqrt(sxx * syy));
}

double BruteSpearman(const std::vector<double>& a,
                     const std::vector<double>& b) {
  return BrutePearson(BruteRanks(a), BruteRanks(b));
}

// tau-b = (C - D) / sqrt((C + D + T_b) (C + D + T_a)), where T_a counts pairs
// tied in a only and T_b pairs tied in b only (pairs tied in both count in
// neither factor).
double BruteTauB(const std::vector<double>& a, const std::vector<double>& b) {
  int64_t c = 0, d = 0, ta = 0, tb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = i + 1; j < a.size(); ++j) {
      const double da = a[i] - a[j];
      const double db = b[i] - b[j];
      if (da == 0 && db == 0) continue;
      if (da == 0) {
        ++ta;
      } else if (db == 0) {
        ++tb;
      } else if ((da > 0) == (db > 0)) {
        ++c;
      } else {
        ++d;
      }
    }
  }
  return static_cast<double>(c - d) /
         std::sqrt(static_cast<double>(c + d + tb) *
                   static_cast<double>(c + d + ta));
}

// ---- Hand-computed cases -------------------------------------------------

TEST(AverageRanksTest, TiesGetMeanRank) {
  const std::vector<double> v = {10, 20, 20, 5, 20};
  EXPECT_THAT(AverageRanks(v), ElementsAre(2, 4, 4, 1, 4));
  EXPECT_TRUE(AverageRanks(std::vector<double>{}).empty());
  EXPECT_THAT(AverageRanks(std::vector<double>{7, 7}), ElementsAre(1.5, 1.5));
}

TEST(AverageRanksTest, NaNGetsNaNRank) {
  const std::vector<double> r = AverageRanks(std::vector<double>{3, kNaN, 1});
  EXPECT_EQ(r[0], 2);
  EXPECT_TRUE(std::isnan(r[1]));
  EXPECT_EQ(r[2], 1);
}

// Wikipedia's "Spearman's rank correlation coefficient" example (IQ vs. hours
// of TV per week): rho = -29/165.
TEST(SpearmanTest, TextbookExample) {
  const std::vector<double> iq = {106, 100, 86,  101, 99,
                                  103, 97,  113, 112, 110};
  const std::vector<double> tv = {7, 27, 2, 50, 28, 29, 20, 12, 6, 17};
  EXPECT_NEAR(Spearman(iq, tv), -29.0 / 165.0, 1e-15);
}

// a = (1, 2, 2, 3), b = (1, 3, 2, 3): ranks (1, 2.5, 2.5, 4) and
// (1, 3.5, 2, 3.5); centred products sum to 3.75 and both sums of squares are
// 4.5, so rho = 5/6. Pairs: 4 concordant, 0 discordant, one tied in a only,
// one tied in b only, so tau-b = 4 / sqrt(5 * 5) = 0.8.
TEST(RankCorrelationTest, SmallCaseWithTies) {
  const std::vector<double> a = {1, 2, 2, 3};
  const std::vector<double> b = {1, 3, 2, 3};
  EXPECT_NEAR(Spearman(a, b), 5.0 / 6.0, 1e-15);
  EXPECT_NEAR(KendallTauB(a, b), 0.8, 1e-15);
}

// SciPy's kendalltau documentation example: tau-b = -0.47140452079103173
// (C = 2, D = 6, one pair tied in x1 only, one joint tie: -4 / sqrt(9 * 8)).
TEST(KendallTauBTest, SciPyExample) {
  const std::vector<double> x1 = {12, 2, 1, 12, 2};
  const std::vector<double> x2 = {1, 4, 7, 1, 0};
  EXPECT_NEAR(KendallTauB(x1, x2), -4.0 / std::sqrt(72.0), 1e-15);
  EXPECT_NEAR(KendallTauB(x1, x2), -0.47140452079103173, 1e-15);
}

TEST(RankCorrelationTest, PerfectAgreementAndReversal) {
  const std::vector<double> a = {0.1, 0.5, 2, 3, 10};
  const std::vector<double> up = {1, 2, 3, 4, 5};
  const std::vector<double> down = {50, 40, 30, 20, 10};
  EXPECT_DOUBLE_EQ(Spearman(a, up), 1.0);
  EXPECT_DOUBLE_EQ(Spearman(a, down), -1.0);
  EXPECT_DOUBLE_EQ(KendallTauB(a, up), 1.0);
  EXPECT_DOUBLE_EQ(KendallTauB(a, down), -1.0);
}

TEST(RankCorrelationTest, UndefinedCasesAreNaN) {
  const std::vector<double> empty;
  const std::vector<double> one = {1};
  const std::vector<double> constant = {2, 2, 2, 2};
  const std::vector<double> varied = {1, 2, 3, 4};
  const std::vector<double> with_nan = {1, kNaN, 3, 4};
  for (auto f : {&Spearman, &KendallTauB}) {
    EXPECT_TRUE(std::isnan(f(empty, empty)));
    EXPECT_TRUE(std::isnan(f(one, one)));
    EXPECT_TRUE(std::isnan(f(constant, varied)));
    EXPECT_TRUE(std::isnan(f(varied, constant)));
    EXPECT_TRUE(std::isnan(f(constant, constant)));
    EXPECT_TRUE(std::isnan(f(with_nan, varied)));
    EXPECT_TRUE(std::isnan(f(varied, with_nan)));
  }
  // Two distinct points are enough.
  EXPECT_DOUBLE_EQ(
      Spearman(std::vector<double>{1, 2}, std::vector<double>{3, 1}), -1.0);
  EXPECT_DOUBLE_EQ(
      KendallTauB(std::vector<double>{1, 2}, std::vector<double>{3, 1}), -1.0);
}

TEST(RankCorrelationDeathTest, SizeMismatchAborts) {
  const std::vector<double> a = {1, 2, 3};
  const std::vector<double> b = {1, 2};
  EXPECT_DEATH(Spearman(a, b), "sizes differ");
  EXPECT_DEATH(KendallTauB(a, b), "sizes differ");
  EXPECT_DEATH(LengthErrors(a, b), "sizes differ");
}

// ---- Random data against the brute-force references -----------------------

enum class Kind { kNoTies, kManyTies, kTiesInAOnly };

std::vector<double> Draw(std::mt19937_64& rng, size_t n, bool ties) {
  std::vector<double> v(n);
  std::uniform_real_distribution<double> uni(-1e3, 1e3);
  std::uniform_int_distribution<int> few(0, 4);
  for (double& x : v) x = ties ? few(rng) : uni(rng);
  return v;
}

TEST(RankCorrelationTest, MatchesBruteForceOnRandomData) {
  std::mt19937_64 rng(20240611);
  for (size_t n : {2, 3, 4, 5, 7, 10, 31, 100, 257, 1000, 2000}) {
    for (Kind kind : {Kind::kNoTies, Kind::kManyTies, Kind::kTiesInAOnly}) {
      for (int rep = 0; rep < (n <= 100 ? 20 : 2); ++rep) {
        std::vector<double> a = Draw(rng, n, kind != Kind::kNoTies);
        std::vector<double> b = Draw(rng, n, kind == Kind::kManyTies);
        // Correlate half of the cases so values are not all near zero.
        if (rep % 2 == 1) {
          for (size_t i = 0; i < n; ++i) b[i] += 300 * a[i];
        }
        SCOPED_TRACE(testing::Message()
                     << "n=" << n << " kind=" << static_cast<int>(kind)
                     << " rep=" << rep);
        const double want_rho = BruteSpearman(a, b);
        const double want_tau = BruteTauB(a, b);
        if (std::isnan(want_rho)) {  // a constant draw, possible for tiny n
          EXPECT_TRUE(std::isnan(Spearman(a, b)));
          EXPECT_TRUE(std::isnan(KendallTauB(a, b)));
          continue;
        }
        EXPECT_NEAR(Spearman(a, b), want_rho, 1e-12);
        EXPECT_NEAR(KendallTauB(a, b), want_tau, 1e-12);
        const std::vector<double> ranks = AverageRanks(a);
        EXPECT_EQ(ranks, BruteRanks(a));
      }
    }
  }
}

TEST(RankCorrelationTest, SymmetricInArguments) {
  std::mt19937_64 rng(7);
  const std::vector<double> a = Draw(rng, 500, true);
  std::vector<double> b = Draw(rng, 500, false);
  for (size_t i = 0; i < b.size(); ++i) b[i] -= 200 * a[i];
  EXPECT_NEAR(KendallTauB(a, b), KendallTauB(b, a), 1e-15);
  EXPECT_NEAR(Spearman(a, b), Spearman(b, a), 1e-15);
}

TEST(RankCorrelationTest, LargeInputRuns) {
  constexpr size_t kN = 200'000;
  std::mt19937_64 rng(99);
  std::normal_distribution<double> normal;
  std::vector<double> a(kN), b(kN);
  for (size_t i = 0; i < kN; ++i) {
    a[i] = std::round(normal(rng) * 50);  // ties, as token counts have
    b[i] = -0.6 * a[i] + 40 * normal(rng);
  }
  const double tau = KendallTauB(a, b);
  const double rho = Spearman(a, b);
  EXPECT_GE(tau, -1.0);
  EXPECT_LE(tau, 1.0);
  EXPECT_LT(rho, -0.1);
  EXPECT_EQ(std::signbit(tau), std::signbit(rho));
  // For roughly bivariate normal data |tau| < |rho|.
  EXPECT_LT(std::abs(tau), std::abs(rho));
}

// ---- Length errors ---------------------------------------------------------

TEST(LengthErrorsTest, BucketsByTrueLength) {
  // True lengths on the bucket boundaries: 256 is short, 257 and 1024
  // medium, 1025 long.
  const std::vector<double> predicted = {100, 300, 2000, 500, 0};
  const std::vector<double> truth = {200, 256, 1025, 1024, 257};
  const LengthErrorReport r = LengthErrors(predicted, truth);
  EXPECT_EQ(r.n, 5);
  EXPECT_DOUBLE_EQ(r.mae, (100 + 44 + 975 + 524 + 257) / 5.0);
  EXPECT_EQ(r.n_short, 2);
  EXPECT_EQ(r.n_medium, 2);
  EXPECT_EQ(r.n_long, 1);
  EXPECT_DOUBLE_EQ(r.mae_short, (100 + 44) / 2.0);
  EXPECT_DOUBLE_EQ(r.mae_medium, (524 + 257) / 2.0);
  EXPECT_DOUBLE_EQ(r.mae_long, 975.0);
}

TEST(LengthErrorsTest, EmptyBucketsAreNaN) {
  const std::vector<double> predicted = {10, 20};
  const std::vector<double> truth = {12, 17};
  const LengthErrorReport r = LengthErrors(predicted, truth);
  EXPECT_EQ(r.n_short, 2);
  EXPECT_DOUBLE_EQ(r.mae_short, 2.5);
  EXPECT_EQ(r.n_medium, 0);
  EXPECT_EQ(r.n_long, 0);
  EXPECT_TRUE(std::isnan(r.mae_medium));
  EXPECT_TRUE(std::isnan(r.mae_long));

  const LengthErrorReport e = LengthErrors({}, {});
  EXPECT_EQ(e.n, 0);
  EXPECT_TRUE(std::isnan(e.mae));
  EXPECT_TRUE(std::isnan(e.mae_short));
}

}  // namespace
}  // namespace leap::readout
