#include "readout/synth.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "readout/stats.h"

namespace leap::readout {
namespace {

TEST(Synth, DeterministicFiniteAndLengthsInRange) {
  SynthOptions o;
  o.dim = 128;
  o.max_tokens = 1024;
  auto g = SynthGenerator::Create(o);
  ASSERT_TRUE(g.ok());
  auto dom = BuiltinDomain("translation");
  ASSERT_TRUE(dom.ok());
  std::mt19937_64 r1(5), r2(5);
  std::vector<float> a(128), b(128);
  for (int i = 0; i < 200; ++i) {
    const int64_t la = g->Draw(*dom, r1, a.data());
    const int64_t lb = g->Draw(*dom, r2, b.data());
    ASSERT_EQ(la, lb);
    ASSERT_EQ(a, b);
    ASSERT_GE(la, 1);
    ASSERT_LE(la, 1024);
    for (float v : a) ASSERT_TRUE(std::isfinite(v));
  }
  EXPECT_FALSE(BuiltinDomain("klingon").ok());
  o.dim = 0;
  EXPECT_FALSE(SynthGenerator::Create(o).ok());
}

TEST(Synth, SignalDirectionCarriesTheLength) {
  // Projection of (x - mean) on the domain's own direction is monotone in
  // length up to noise: the ideal linear readout ranks well.
  SynthOptions o;
  o.dim = 256;
  auto g = SynthGenerator::Create(o);
  ASSERT_TRUE(g.ok());
  auto chat = BuiltinDomain("chat");
  std::mt19937_64 rng(1);
  std::vector<double> len, proj;
  std::vector<float> x(256), base(256), hi(256), lo(256);
  // Direction estimate: difference of mean features of long vs short.
  std::mt19937_64 r2(2);
  for (int i = 0; i < 400; ++i) {
    g->FeaturesForLength(*chat, 1500, r2, x.data());
    for (int k = 0; k < 256; ++k) hi[k] += x[k];
    g->FeaturesForLength(*chat, 20, r2, x.data());
    for (int k = 0; k < 256; ++k) lo[k] += x[k];
  }
  for (int i = 0; i < 1000; ++i) {
    len.push_back(static_cast<double>(g->Draw(*chat, rng, x.data())));
    double p = 0;
    for (int k = 0; k < 256; ++k) p += (hi[k] - lo[k]) * x[k];
    proj.push_back(p);
  }
  EXPECT_GT(Spearman(len, proj), 0.5);
}

}  // namespace
}  // namespace leap::readout
