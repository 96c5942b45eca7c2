#include "readout/readout.h"

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "readout/internal/kernels.h"

namespace leap::readout {
namespace {

struct Fixture {
  Standardizer st;
  Eigen::VectorXd theta;
};

Fixture Make(int64_t d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01;
  Fixture f{Standardizer::Identity(d), Eigen::VectorXd(d + 1)};
  for (int64_t i = 0; i < d; ++i) {
    // Some "massive activation" features with large means.
    f.st.mean[i] = (i % 97 == 0) ? 80.0 : 0.3 * n01(rng);
    f.st.scale[i] = std::exp(0.5 * n01(rng));
    f.theta[i] = 0.05 * n01(rng);
  }
  f.theta[d] = 20.0;
  return f;
}

TEST(FoldedReadout, OneDotProductEqualsStandardizedFp64Score) {
  for (int64_t d : {1, 16, 63, 4096}) {
    Fixture f = Make(d, d);
    const FoldedReadout r = FoldedReadout::Fold(f.st, f.theta, 2048);
    std::mt19937_64 rng(1);
    std::normal_distribution<double> n01;
    for (int t = 0; t < 20; ++t) {
      std::vector<float> x(d);
      for (int64_t i = 0; i < d; ++i) {
        x[i] = static_cast<float>(f.st.mean[i] + f.st.scale[i] * n01(rng));
      }
      // Reference: u = [(x - mu) / sigma; 1], score = u . theta, in FP64.
      double ref = f.theta[d], mag = std::abs(f.theta[d]);
      for (int64_t i = 0; i < d; ++i) {
        const double term = (x[i] - f.st.mean[i]) / f.st.scale[i] * f.theta[i];
        ref += term;
        mag += std::abs(f.theta[i] / f.st.scale[i] * x[i]);
      }
      auto got = r.Score(FeatureView::F32(x.data(), d));
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_NEAR(*got, ref, 2e-6 * mag + 1e-9) << "d=" << d;
    }
  }
}

TEST(FoldedReadout, Bf16AndFp16ReadInPlaceMatchFloat32BitForBit) {
  const int64_t d = 4096 + 13;
  Fixture f = Make(d, 3);
  const FoldedReadout r = FoldedReadout::Fold(f.st, f.theta, 2048);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n01;
  std::vector<uint16_t> bf(d), hf(d);
  std::vector<float> xb(d), xh(d);
  for (int64_t i = 0; i < d; ++i) {
    const float v = static_cast<float>(f.st.mean[i]) + n01(rng);
    bf[i] = FloatToBf16(v);
    hf[i] = FloatToFp16(v);
    xb[i] = Bf16ToFloat(bf[i]);
    xh[i] = Fp16ToFloat(hf[i]);
  }
  // Every kernel this CPU runs agrees with the FP64 dot of the converted
  // values: fp16 through the float32 path's exact order, bf16 to rounding
  // (it sums in even/odd order).
  std::vector<float> wp(d);
  internal::PermuteForBf16(r.w().data(), d, wp.data());
  double ref_b = 0, ref_h = 0, mag_b = 0, mag_h = 0;
  for (int64_t i = 0; i < d; ++i) {
    ref_b += double{r.w()[i]} * xb[i];
    ref_h += double{r.w()[i]} * xh[i];
    mag_b += std::abs(double{r.w()[i]} * xb[i]);
    mag_h += std::abs(double{r.w()[i]} * xh[i]);
  }
  for (const internal::Kernels* k : internal::SupportedKernels()) {
    EXPECT_NEAR(k->dot_bf16(wp.data(), bf.data(), d), ref_b, 1e-6 * mag_b) << k->name;
    EXPECT_NEAR(k->dot_f32(r.w().data(), xb.data(), d), ref_b, 1e-6 * mag_b) << k->name;
    EXPECT_EQ(k->dot_f16(r.w().data(), hf.data(), d),
              k->dot_f32(r.w().data(), xh.data(), d)) << k->name;
    EXPECT_NEAR(k->dot_f16(r.w().data(), hf.data(), d), ref_h, 1e-6 * mag_h);
  }
  auto sb = r.Score({bf.data(), DType::kBFloat16, d, 1});
  auto sf = r.Score(FeatureView::F32(xb.data(), d));
  ASSERT_TRUE(sb.ok() && sf.ok());
  EXPECT_NEAR(*sb, *sf, 1e-6 * mag_b);
  auto sh = r.Score({hf.data(), DType::kFloat16, d, 1});
  ASSERT_TRUE(sh.ok());
}

// Several rows per pass over w (the shm and Connect prediction path): each
// row against an FP64 reference, the same value whatever its neighbours
// (batch of 1 vs 4, other rows NaN), per-row errors for bad rows.
TEST(FoldedReadout, ScoreRowsMatchFp64AndDoNotDependOnNeighbours) {
  for (int64_t d : {1, 15, 16, 17, 100, 4096}) {
    Fixture f = Make(d, d + 7);
    const FoldedReadout r = FoldedReadout::Fold(f.st, f.theta, 2048);
    std::mt19937_64 rng(d);
    std::normal_distribution<double> n01;
    const int n = 11;  // runs of 4, 4 and 3
    std::vector<std::vector<float>> xf(n, std::vector<float>(d));
    std::vector<std::vector<uint16_t>> xb(n, std::vector<uint16_t>(d));
    std::vector<FeatureView> views;
    for (int k = 0; k < n; ++k) {
      for (int64_t i = 0; i < d; ++i) {
        xf[k][i] = static_cast<float>(f.st.mean[i] + f.st.scale[i] * n01(rng));
        xb[k][i] = FloatToBf16(xf[k][i]);
      }
      // Mixed dtypes break the runs: the kernel must group only like rows.
      if (k % 5 == 3) {
        views.push_back({xb[k].data(), DType::kBFloat16, d, 1});
      } else {
        views.push_back(FeatureView::F32(xf[k].data(), d));
      }
    }
    xf[6][d / 2] = std::nanf("");  // row 6 is bad
    std::vector<double> scores(n);
    std::vector<absl::Status> status(n);
    r.ScoreRows(views.data(), n, scores.data(), status.data());
    for (int k = 0; k < n; ++k) {
      const bool bf = views[k].dtype == DType::kBFloat16;
      double ref = f.theta[d], mag = std::abs(f.theta[d]);
      for (int64_t i = 0; i < d; ++i) {
        const double x = bf ? Bf16ToFloat(xb[k][i]) : xf[k][i];
        ref += (x - f.st.mean[i]) / f.st.scale[i] * f.theta[i];
        mag += std::abs(f.theta[i] / f.st.scale[i] * x);
      }
      if (k == 6) {
        EXPECT_TRUE(absl::IsInvalidArgument(status[k])) << status[k];
        EXPECT_NE(status[k].message().find(absl::StrCat("element ", d / 2, " ")),
                  absl::string_view::npos)
            << status[k];
        continue;
      }
      ASSERT_TRUE(status[k].ok()) << "row " << k << ": " << status[k];
      EXPECT_NEAR(scores[k], ref, 2e-6 * mag + 1e-9) << "d=" << d << " row " << k;
      // Alone, the row gets the very same value.
      double alone = 0;
      absl::Status st;
      r.ScoreRows(&views[k], 1, &alone, &st);
      ASSERT_TRUE(st.ok());
      EXPECT_EQ(alone, scores[k]) << "d=" << d << " row " << k;
    }
  }
  // Every kernel set: rows 1..4 against FP64.
  const int64_t d = 333;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> w(d);
  for (auto& v : w) v = g(rng);
  std::vector<float> wp(d);
  internal::PermuteForBf16(w.data(), d, wp.data());
  std::vector<std::vector<float>> x(4, std::vector<float>(d));
  std::vector<std::vector<uint16_t>> xb(4, std::vector<uint16_t>(d));
  for (int k = 0; k < 4; ++k) {
    for (int64_t i = 0; i < d; ++i) {
      x[k][i] = g(rng);
      xb[k][i] = FloatToBf16(x[k][i]);
    }
  }
  for (const internal::Kernels* k : internal::SupportedKernels()) {
    for (int rows = 1; rows <= internal::kMaxRows; ++rows) {
      const float* xp[4] = {x[0].data(), x[1].data(), x[2].data(), x[3].data()};
      const uint16_t* bp[4] = {xb[0].data(), xb[1].data(), xb[2].data(), xb[3].data()};
      float out[4], outb[4];
      k->dot_rows_f32(w.data(), xp, rows, d, out);
      k->dot_rows_bf16(wp.data(), bp, rows, d, outb);
      for (int rr = 0; rr < rows; ++rr) {
        double ref = 0, refb = 0, mag = 0;
        for (int64_t i = 0; i < d; ++i) {
          ref += static_cast<double>(w[i]) * x[rr][i];
          refb += static_cast<double>(w[i]) * Bf16ToFloat(xb[rr][i]);
          mag += std::abs(static_cast<double>(w[i]) * x[rr][i]);
        }
        EXPECT_NEAR(out[rr], ref, 1e-6 * mag) << k->name << " rows " << rows;
        EXPECT_NEAR(outb[rr], refb, 1e-6 * mag) << k->name << " bf16 rows " << rows;
      }
    }
  }
}

TEST(FoldedReadout, StridedViewIsReadInPlace) {
  const int64_t d = 100;
  Fixture f = Make(d, 4);
  const FoldedReadout r = FoldedReadout::Fold(f.st, f.theta, 2048);
  std::vector<float> wide(3 * d), x(d);
  for (int64_t i = 0; i < d; ++i) x[i] = wide[3 * i] = 0.01f * i;
  auto a = r.Score({wide.data(), DType::kFloat32, d, 3});
  auto b = r.Score(FeatureView::F32(x.data(), d));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NEAR(*a, *b, 1e-5);
}

TEST(FoldedReadout, BadFeaturesArePreciseErrors) {
  const int64_t d = 64;
  Fixture f = Make(d, 5);
  const FoldedReadout r = FoldedReadout::Fold(f.st, f.theta, 2048);
  std::vector<float> x(d, 0.5f);
  auto s = r.Score(FeatureView::F32(x.data(), d - 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("expected 64, got 63"), absl::string_view::npos);
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    x[17] = bad;
    s = r.Score(FeatureView::F32(x.data(), d));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("element 17"), absl::string_view::npos)
        << s.status();
  }
  std::vector<uint16_t> h(d, FloatToBf16(1.0f));
  h[60] = 0x7FC0;  // bf16 NaN
  s = r.Score({h.data(), DType::kBFloat16, d, 1});
  EXPECT_NE(s.status().message().find("element 60"), absl::string_view::npos);
}

TEST(Clipping, PredictionsClipToOneAndBudgetBeforeSquaring) {
  EXPECT_DOUBLE_EQ(TokensFromScore(-30.0, 2048), 1.0);
  EXPECT_DOUBLE_EQ(TokensFromScore(0.5, 2048), 1.0);
  EXPECT_DOUBLE_EQ(TokensFromScore(1.0, 2048), 1.0);
  EXPECT_DOUBLE_EQ(TokensFromScore(10.0, 2048), 100.0);
  EXPECT_NEAR(TokensFromScore(std::sqrt(2048.0), 2048), 2048.0, 1e-9);
  EXPECT_NEAR(TokensFromScore(1e9, 2048), 2048.0, 1e-9);
  EXPECT_NEAR(TokensFromScore(INFINITY, 2048), 2048.0, 1e-9);
  EXPECT_DOUBLE_EQ(TokensFromScore(NAN, 2048), 1.0);
  EXPECT_NEAR(TokensFromScore(100.0, 4096), 4096.0, 1e-9);
  // Through a readout: bias alone decides.
  const int64_t d = 4;
  Eigen::VectorXd theta = Eigen::VectorXd::Zero(d + 1);
  std::vector<float> x(d, 1.0f);
  for (double bias : {-7.0, 0.2, 30.0, 45.0, 46.0, 1000.0}) {
    theta[d] = bias;
    auto r = FoldedReadout::Fold(Standardizer::Identity(d), theta, 2048);
    auto t = r.PredictTokens(FeatureView::F32(x.data(), d));
    ASSERT_TRUE(t.ok());
    const double want = std::pow(std::clamp(bias, 1.0, std::sqrt(2048.0)), 2);
    EXPECT_NEAR(*t, want, 1e-9 * want) << bias;
  }
}

TEST(Targets, SqrtOfLengthClippedAtBudget) {
  EXPECT_DOUBLE_EQ(TargetFromTokens(0, 2048), 0.0);
  EXPECT_DOUBLE_EQ(TargetFromTokens(400, 2048), 20.0);
  EXPECT_DOUBLE_EQ(TargetFromTokens(5000, 2048), std::sqrt(2048.0));
}

TEST(Feedback, CancelledAndCensoredAreNotLearned) {
  const int64_t m = 2048;
  auto a = ClassifyFeedback(100, FinishReason::kStop, 0, m);
  EXPECT_EQ(*a, FeedbackAction::kLearn);
  EXPECT_EQ(*ClassifyFeedback(5000, FinishReason::kStop, 0, m), FeedbackAction::kLearn);
  EXPECT_EQ(*ClassifyFeedback(30, FinishReason::kCancelled, 0, m),
            FeedbackAction::kSkipCancelled);
  EXPECT_EQ(*ClassifyFeedback(30, FinishReason::kAborted, 0, m),
            FeedbackAction::kSkipCancelled);
  // Stopped by its own cap below M: length >= 256 is all we know.
  EXPECT_EQ(*ClassifyFeedback(256, FinishReason::kLength, 256, m),
            FeedbackAction::kSkipCensored);
  // Cap >= M and reached: the clipped target sqrt(M) is exact.
  EXPECT_EQ(*ClassifyFeedback(2048, FinishReason::kLength, 2048, m),
            FeedbackAction::kLearn);
  EXPECT_EQ(*ClassifyFeedback(4096, FinishReason::kLength, 4096, m),
            FeedbackAction::kLearn);
  // An engine-side cap below M that we were not told about.
  EXPECT_EQ(*ClassifyFeedback(1000, FinishReason::kLength, 0, m),
            FeedbackAction::kSkipCensored);
  EXPECT_EQ(ClassifyFeedback(-1, FinishReason::kStop, 0, m).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClassifyFeedback(int64_t{1} << 40, FinishReason::kStop, 0, m)
                .status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClassifyFeedback(300, FinishReason::kLength, 256, m).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ClassifyFeedback(3, static_cast<FinishReason>(9), 0, m).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DTypes, NamesParseAndHalfConversionsRoundTrip) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("float16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("FP32"), DType::kFloat32);
  EXPECT_FALSE(ParseDType("int8").ok());
  // Every fp16 bit pattern (but NaNs) survives float and back.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), h) << h;
  }
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7C00);  // rounds to inf
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f / 3)), 0.333251953125f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);  // ties to even
}

}  // namespace
}  // namespace leap::readout
