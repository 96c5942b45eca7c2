#include "sidecar/core/length_prior.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace leap::core {
namespace {

struct Row {
  PriorRequest request;
  int64_t output;
};

// Independent FP64 reference: the ridge normal equations built from the raw
// rows, their residual at the model's weights (recovered from predictions).
TEST(LengthPriorTest, FitsTheRidgeNormalEquations) {
  LengthPriorOptions o;
  o.budget = 2048;
  o.ridge = 0.5;
  o.min_samples = 10;
  LengthPrior prior(o);
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<int64_t> prompt(1, 4000);
  std::normal_distribution<double> noise(0, 2);
  std::vector<Row> rows;
  for (int i = 0; i < 400; ++i) {
    Row r;
    r.request.prompt_tokens = prompt(rng);
    r.request.max_tokens = i % 3 == 0 ? 300 : 0;
    const double s = 2 + 3 * std::log1p(static_cast<double>(
                                 r.request.prompt_tokens)) + noise(rng);
    r.output = static_cast<int64_t>(std::max(0.0, s * s));
    rows.push_back(r);
    ASSERT_TRUE(prior.Learn(r.request, r.output).ok());
  }
  // Reference: A = sum x x' + ridge on the non-intercept diagonal, b = X'y.
  double a[4][4] = {}, b[4] = {};
  for (const Row& r : rows) {
    const bool capped = r.request.max_tokens > 0;
    const double cap = capped ? 300 : 2048;
    const double x[4] = {1, std::log1p(double(r.request.prompt_tokens)),
                         std::log1p(cap), capped ? 1.0 : 0.0};
    const double y = std::sqrt(std::min(double(r.output), cap));
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 4; ++j) a[i][j] += x[i] * x[j];
      b[i] += x[i] * y;
    }
  }
  for (int i = 1; i < 4; ++i) a[i][i] += o.ridge;
  // Solve A w = b by Gauss-Jordan in long double (independent of the
  // model's elimination).
  long double m[4][5];
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) m[i][j] = a[i][j];
    m[i][4] = b[i];
  }
  for (int c = 0; c < 4; ++c) {
    int p = c;
    for (int r = c + 1; r < 4; ++r) {
      if (std::fabs(m[r][c]) > std::fabs(m[p][c])) p = r;
    }
    for (int j = 0; j < 5; ++j) std::swap(m[c][j], m[p][j]);
    for (int r = 0; r < 4; ++r) {
      if (r == c) continue;
      const long double f = m[r][c] / m[c][c];
      for (int j = 0; j < 5; ++j) m[r][j] -= f * m[c][j];
    }
  }
  double w[4];
  for (int i = 0; i < 4; ++i) w[i] = static_cast<double>(m[i][4] / m[i][i]);
  for (int64_t p : {5, 100, 1000, 3000}) {
    for (int64_t mt : {0, 300}) {
      const double cap = mt > 0 ? 300 : 2048;
      const double x[4] = {1, std::log1p(double(p)), std::log1p(cap),
                           mt > 0 ? 1.0 : 0.0};
      double s = 0;
      for (int i = 0; i < 4; ++i) s += w[i] * x[i];
      const double want = std::min(std::max(s, 0.0) * std::max(s, 0.0), cap);
      std::optional<double> got = prior.Predict({p, mt});
      ASSERT_TRUE(got.has_value());
      EXPECT_NEAR(*got, want, 1e-6 * std::max(1.0, want))
          << "prompt " << p << " max_tokens " << mt;
    }
  }
}

TEST(LengthPriorTest, LearnsTheTrendAndCaps) {
  LengthPriorOptions o;
  o.min_samples = 32;
  LengthPrior prior(o);
  EXPECT_FALSE(prior.Predict({100, 0}).has_value());
  for (int i = 0; i < 31; ++i) {
    ASSERT_TRUE(prior.Learn({10 + i, 0}, 10 + i).ok());
  }
  EXPECT_FALSE(prior.Predict({100, 0}).has_value());
  for (int i = 0; i < 200; ++i) {
    const int64_t p = 10 + 20 * i;
    ASSERT_TRUE(prior.Learn({p, 0}, p / 2).ok());  // output grows with prompt
  }
  ASSERT_TRUE(prior.Predict({100, 0}).has_value());
  EXPECT_LT(*prior.Predict({100, 0}), *prior.Predict({3000, 0}));
  // Capped at max_tokens and at the budget.
  EXPECT_LE(*prior.Predict({3000, 20}), 20);
  EXPECT_LE(*prior.Predict({1 << 30, 0}), 2048);
  EXPECT_EQ(prior.Learn({-1, 0}, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(prior.Learn({1, 0}, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(prior.samples(), 231);
}

TEST(LengthPriorTest, ProductLinesAreSeparate) {
  LengthPriorOptions o;
  o.min_samples = 5;
  LengthPriors priors(o);
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(priors.Learn("chat", {100 + i, 0}, 20).ok());
    ASSERT_TRUE(priors.Learn("translate", {100 + i, 0}, 900).ok());
  }
  EXPECT_EQ(priors.product_lines(), 2u);
  EXPECT_NEAR(*priors.Predict("chat", {120, 0}), 20, 2);
  EXPECT_NEAR(*priors.Predict("translate", {120, 0}), 900, 30);
  EXPECT_FALSE(priors.Predict("unknown", {120, 0}).has_value());
  LengthPriorOptions bad;
  bad.budget = 0;
  EXPECT_FALSE(bad.Validate().ok());
  bad = {};
  bad.ridge = -1;
  EXPECT_FALSE(bad.Validate().ok());
  bad = {};
  bad.min_samples = 0;
  EXPECT_FALSE(bad.Validate().ok());
  EXPECT_TRUE(LengthPriorOptions{}.Validate().ok());
}

}  // namespace
}  // namespace leap::core
