// Ridge fit against an independent FP64 reference: the penalized least
// squares solved by Householder QR of the stacked system [U; sqrt(lambda) D],
// with the standardization computed here from its definition.
#include "readout/ridge.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "Eigen/Dense"
#include "common/half.h"
#include "gtest/gtest.h"

namespace leap::readout {
namespace {

using Eigen::MatrixXd;
using Eigen::VectorXd;

struct Data {
  int64_t rows, d;
  std::vector<float> x;
  std::vector<int64_t> len;
};

Data MakeData(int64_t rows, int64_t d, double noise, uint64_t seed) {
  Data data{rows, d, std::vector<float>(rows * d), std::vector<int64_t>(rows)};
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01;
  VectorXd w(d);
  for (auto& v : w) v = n01(rng);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t i = 0; i < d; ++i) {
      // Heterogeneous means and scales, one constant column.
      const double v = (i == 3) ? 7.0 : 10.0 * (i % 5) + (1 + i % 7) * n01(rng);
      data.x[r * d + i] = static_cast<float>(v);
      if (i != 3) s += w[i] * (v - 10.0 * (i % 5)) / (1 + i % 7);
    }
    const double root = std::max(0.0, 20 + 2 * s + noise * n01(rng));
    data.len[r] = std::min<int64_t>(4000, std::llround(root * root));
  }
  return data;
}

// Reference: standardize by definition, then QR on the stacked system.
void Reference(const Data& data, double lambda, int64_t m, double floor_ratio,
               VectorXd& theta, MatrixXd& p0) {
  const int64_t n = data.d + 1;
  MatrixXd x(data.rows, data.d);
  for (int64_t r = 0; r < data.rows; ++r)
    for (int64_t i = 0; i < data.d; ++i) x(r, i) = data.x[r * data.d + i];
  const VectorXd mean = x.colwise().mean();
  VectorXd sd = ((x.rowwise() - mean.transpose()).array().square().colwise().sum() /
                 data.rows).sqrt();
  std::vector<double> s(sd.data(), sd.data() + sd.size());
  std::sort(s.begin(), s.end());
  const double median = s[s.size() / 2];
  for (auto& v : sd) v = std::max(v, std::max(1e-12, floor_ratio * median));
  MatrixXd stacked = MatrixXd::Zero(data.rows + data.d, n);
  VectorXd rhs = VectorXd::Zero(data.rows + data.d);
  for (int64_t r = 0; r < data.rows; ++r) {
    for (int64_t i = 0; i < data.d; ++i) stacked(r, i) = (x(r, i) - mean[i]) / sd[i];
    stacked(r, data.d) = 1.0;
    rhs[r] = std::sqrt(static_cast<double>(std::min(data.len[r], m)));
  }
  for (int64_t i = 0; i < data.d; ++i) stacked(data.rows + i, i) = std::sqrt(lambda);
  theta = stacked.colPivHouseholderQr().solve(rhs);
  const MatrixXd a = stacked.transpose() * stacked;
  p0 = a.inverse();
}

TEST(Ridge, MatchesQrReferenceWithUnpenalizedBias) {
  Data data = MakeData(500, 12, 3.0, 1);
  RidgeOptions opt;
  opt.lambda = 25.0;
  opt.max_tokens = 2048;
  auto fit = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  ASSERT_TRUE(fit.ok()) << fit.status();
  VectorXd theta;
  MatrixXd p0;
  Reference(data, 25.0, 2048, opt.sigma_floor_ratio, theta, p0);
  EXPECT_LT((fit->theta - theta).norm() / theta.norm(), 1e-10);
  const MatrixXd p = fit->p0.ToDouble();
  EXPECT_LT((p - p0).norm() / p0.norm(), 1e-6);  // P stored in FP32
  EXPECT_DOUBLE_EQ(fit->lambda, 25.0);
  // The bias is not penalized: with lambda huge the weights vanish and the
  // bias is the mean target, not shrunk towards 0.
  opt.lambda = 1e12;
  auto flat = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  ASSERT_TRUE(flat.ok());
  double mean_y = 0;
  for (int64_t l : data.len) mean_y += std::sqrt(double(std::min<int64_t>(l, 2048)));
  mean_y /= data.rows;
  EXPECT_NEAR(flat->theta[data.d], mean_y, 1e-6);
  EXPECT_LT(flat->theta.head(data.d).norm(), 1e-6);
}

TEST(Ridge, ConstantFeatureGetsFlooredScaleAndZeroWeight) {
  Data data = MakeData(300, 8, 1.0, 2);
  RidgeOptions opt;
  opt.lambda = 1.0;
  auto fit = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  ASSERT_TRUE(fit.ok());
  EXPECT_GT(fit->standardizer.scale[3], 0.0);
  EXPECT_NEAR(fit->theta[3], 0.0, 1e-12);
}

TEST(Ridge, CrossValidationPicksTheGridMinimum) {
  // Clean signal, n >> d: small penalty wins.
  Data clean = MakeData(2000, 10, 0.1, 3);
  RidgeOptions opt;
  auto fit = FitRidge({clean.x.data(), DType::kFloat32, clean.rows, clean.d}, clean.len, opt);
  ASSERT_TRUE(fit.ok()) << fit.status();
  ASSERT_EQ(fit->cv.size(), opt.relative_lambda_grid.size());
  double best = 1e300;
  for (const CvPoint& p : fit->cv) best = std::min(best, p.mse);
  for (const CvPoint& p : fit->cv) {
    if (p.mse == best) {
      EXPECT_DOUBLE_EQ(p.lambda, fit->lambda);
    }
  }
  EXPECT_LE(fit->lambda / clean.rows, 1e-2);
  // Pure noise targets: the largest penalties win.
  Data noise = clean;
  std::mt19937_64 rng(4);
  std::uniform_int_distribution<int64_t> len(1, 2000);
  for (auto& l : noise.len) l = len(rng);
  auto nfit = FitRidge({noise.x.data(), DType::kFloat32, noise.rows, noise.d}, noise.len, opt);
  ASSERT_TRUE(nfit.ok());
  EXPECT_GE(nfit->lambda / noise.rows, 1.0);
}

TEST(Ridge, Float16FeaturesAreReadInPlace) {
  Data data = MakeData(200, 6, 1.0, 5);
  std::vector<uint16_t> h(data.x.size());
  std::vector<float> back(data.x.size());
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = FloatToFp16(data.x[i]);
    back[i] = Fp16ToFloat(h[i]);
  }
  RidgeOptions opt;
  opt.lambda = 3.0;
  auto a = FitRidge({h.data(), DType::kFloat16, data.rows, data.d}, data.len, opt);
  auto b = FitRidge({back.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->theta, b->theta);
}

TEST(Ridge, BadInputIsAPreciseError) {
  Data data = MakeData(50, 4, 1.0, 6);
  RidgeOptions opt;
  opt.lambda = 1.0;
  std::vector<int64_t> short_len(data.len.begin(), data.len.end() - 1);
  auto s = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, short_len, opt);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("50 rows but lengths has 49"),
            absl::string_view::npos) << s.status();
  data.x[7 * 4 + 2] = NAN;
  s = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  EXPECT_NE(s.status().message().find("row 7 column 2"), absl::string_view::npos)
      << s.status();
  data.x[7 * 4 + 2] = 1;
  data.len[3] = -1;
  s = FitRidge({data.x.data(), DType::kFloat32, data.rows, data.d}, data.len, opt);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace leap::readout
