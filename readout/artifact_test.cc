#include "readout/artifact.h"

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "gtest/gtest.h"

namespace leap::readout {
namespace {

ReadoutState MakeState(int64_t d, bool with_p) {
  std::mt19937_64 rng(d);
  std::normal_distribution<double> n01;
  ReadoutState s;
  s.spec.dim = d;
  s.spec.layer = 30;
  s.spec.model_id = "Qwen/Qwen3-8B";
  s.spec.lambda = 12.5;
  s.spec.max_tokens = 2048;
  s.standardizer = Standardizer::Identity(d);
  s.theta = Eigen::VectorXd(d + 1);
  for (int64_t i = 0; i < d; ++i) {
    s.standardizer.mean[i] = n01(rng);
    s.standardizer.scale[i] = std::exp(n01(rng));
  }
  for (auto& v : s.theta) v = n01(rng);
  if (with_p) {
    SymMatrix p(d + 1);
    for (int64_t i = 0; i <= d; ++i)
      for (int64_t j = i; j <= d; ++j) p(i, j) = p(j, i) = (i == j) ? 2.0f : 0.01f * n01(rng);
    s.p = std::move(p);
  }
  s.version = 7;
  s.completions_learned = 1234;
  s.train_rows = 50000;
  s.note = "test";
  s.created_unix_ms = 1700000000000;
  return s;
}

std::string Path(const std::string& name) { return ::testing::TempDir() + "/" + name; }

TEST(Artifact, RoundTripIsBitExact) {
  for (bool with_p : {false, true}) {
    ReadoutState s = MakeState(33, with_p);
    ASSERT_TRUE(WriteArtifact(Path("a.leapr"), s).ok());
    auto r = ReadArtifact(Path("a.leapr"));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->spec.dim, 33);
    EXPECT_EQ(r->spec.layer, 30);
    EXPECT_EQ(r->spec.model_id, "Qwen/Qwen3-8B");
    EXPECT_EQ(r->spec.lambda, 12.5);
    EXPECT_EQ(r->version, 7);
    EXPECT_EQ(r->completions_learned, 1234);
    EXPECT_EQ(r->train_rows, 50000);
    EXPECT_EQ(r->theta, s.theta);
    EXPECT_EQ(r->standardizer.mean, s.standardizer.mean);
    EXPECT_EQ(r->standardizer.scale, s.standardizer.scale);
    ASSERT_EQ(r->p.has_value(), with_p);
    if (with_p) {
      for (int64_t i = 0; i < 34; ++i)
        for (int64_t j = 0; j < 34; ++j) ASSERT_EQ((*r->p)(i, j), (*s.p)(i, j));
    }
  }
}

TEST(Artifact, TruncatedFileIsRefusedEverywhere) {
  auto bytes = SerializeArtifact(MakeState(20, true));
  ASSERT_TRUE(bytes.ok());
  for (size_t cut : {size_t{0}, size_t{5}, size_t{15}, size_t{40}, bytes->size() / 2,
                     bytes->size() - 21, bytes->size() - 1}) {
    auto r = ParseArtifact(absl::string_view(*bytes).substr(0, cut), "x.leapr");
    ASSERT_FALSE(r.ok()) << "cut at " << cut;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("x.leapr"), absl::string_view::npos);
  }
  auto r = ParseArtifact(absl::string_view(*bytes).substr(0, bytes->size() - 100), "x.leapr");
  EXPECT_NE(r.status().message().find("truncated"), absl::string_view::npos) << r.status();
  std::string longer = *bytes + "junk";
  EXPECT_NE(ParseArtifact(longer, "x").status().message().find("trailing"),
            absl::string_view::npos);
}

TEST(Artifact, EveryFlippedByteIsDetected) {
  auto bytes = SerializeArtifact(MakeState(10, true));
  ASSERT_TRUE(bytes.ok());
  // Flip each byte in turn (stride 3 to keep it quick): never accepted.
  for (size_t i = 0; i < bytes->size(); i += 3) {
    std::string b = *bytes;
    b[i] ^= 0x20;
    ASSERT_FALSE(ParseArtifact(b, "f").ok()) << "byte " << i;
  }
}

TEST(Artifact, CorruptArrayIsNamed) {
  ReadoutState s = MakeState(64, true);
  auto bytes = SerializeArtifact(s);
  ASSERT_TRUE(bytes.ok());
  std::string b = *bytes;
  b[b.size() - 20 - 1000] ^= 1;  // inside P (the last array)
  auto r = ParseArtifact(b, "f");
  EXPECT_NE(r.status().message().find("'p' failed its CRC-32C"), absl::string_view::npos)
      << r.status();
  b = *bytes;
  b[0] = 'X';
  EXPECT_NE(ParseArtifact(b, "f").status().message().find("bad magic"),
            absl::string_view::npos);
  b = *bytes;
  b[20] ^= 1;  // header JSON
  EXPECT_NE(ParseArtifact(b, "f").status().message().find("header checksum"),
            absl::string_view::npos);
}

TEST(Artifact, MissingFileAndInvalidStateAreErrors) {
  EXPECT_EQ(ReadArtifact(Path("nope.leapr")).status().code(), absl::StatusCode::kNotFound);
  ReadoutState s = MakeState(8, false);
  s.theta.resize(3);
  EXPECT_EQ(WriteArtifact(Path("bad.leapr"), s).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace leap::readout
