// End-to-end tests of the `leapctl` binary: synth -> train -> eval -> adapt
// -> eval through the real command line, the metrics checked against an
// independent FP64 reference, and the error contract (exit codes 1 and 2,
// one-line messages naming the file and the problem).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/half.h"
#include "common/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "tests/leapctl_test_util.h"

namespace leap::leapctl_test {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// Small but learnable data: d = 64, signal strong enough that a readout
// trained on 4000 rows ranks held-out lengths well.
constexpr int kDim = 64;
const std::vector<std::string> kModel = {"--signal", "1.6", "--model-seed",
                                         "7"};

std::vector<std::string> Cat(std::vector<std::string> a,
                             const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Runs synth (d = kDim unless `extra` sets --dim) and expects success.
void Synth(const ScratchDir& dir, const std::string& name, int n, int seed,
           const std::vector<std::string>& extra = {}) {
  std::vector<std::string> args = SynthArgs(dir, name, n, seed, {});
  if (std::find(extra.begin(), extra.end(), "--dim") == extra.end()) {
    args = Cat(args, {"--dim", std::to_string(kDim)});
  }
  RunResult r = RunLeapctl(dir, Cat(Cat(args, kModel), extra));
  ASSERT_EQ(r.exit_code, 0) << Describe(r);
}

nlohmann::json EvalJson(const ScratchDir& dir, const std::string& readout,
                        const std::string& name) {
  RunResult r = RunLeapctl(
      dir, {"eval", "--readout", readout, "--features", dir.File(name + ".npy"),
            "--lengths", dir.File(name + "_len.npy"), "--json"});
  EXPECT_EQ(r.exit_code, 0) << Describe(r);
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "stdout is not one JSON value:\n" << r.out;
  return j;
}

// A shifted domain, spelled out so the test does not depend on synth's
// built-in values.
const std::vector<std::string> kShifted = {
    "--domain", "translation", "--median", "900",      "--log-sigma",
    "0.8",      "--angle",     "64",       "--offset", "0.5"};

// ---- Independent FP64 reference of eval's metrics -------------------------

std::vector<double> Ranks(const std::vector<double>& v) {
  std::vector<size_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(),
            [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
    for (size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * (i + j) + 1;
    i = j + 1;
  }
  return r;
}

double Pearson(const std::vector<double>& a, const std::vector<double>& b) {
  const double n = static_cast<double>(a.size());
  const double ma = std::accumulate(a.begin(), a.end(), 0.0) / n;
  const double mb = std::accumulate(b.begin(), b.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

// O(n^2) tau-b straight from the definition.
double KendallBrute(const std::vector<double>& a,
                    const std::vector<double>& b) {
  double conc = 0, disc = 0, ties_a = 0, ties_b = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = i + 1; j < a.size(); ++j) {
      const double da = a[i] - a[j];
      const double db = b[i] - b[j];
      if (da == 0 && db == 0) continue;
      if (da == 0) {
        ++ties_a;
      } else if (db == 0) {
        ++ties_b;
      } else if ((da > 0) == (db > 0)) {
        ++conc;
      } else {
        ++disc;
      }
    }
  }
  return (conc - disc) /
         std::sqrt((conc + disc + ties_a) * (conc + disc + ties_b));
}

struct Reference {
  double spearman, kendall, mae, mae_short, mae_medium, mae_long;
  int n_short, n_medium, n_long;
};

// Predicts with the unfolded math of docs/MATH.md in FP64 (z = (x - mu) /
// sigma, score = [z; 1] . theta, clip to [1, sqrt(M)], square) and scores it.
Reference ReferenceEval(const std::string& readout, const std::string& features,
                        const std::string& lengths) {
  absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(readout);
  EXPECT_TRUE(st.ok()) << st.status();
  absl::StatusOr<NpyArray> x = ReadNpy(features);
  absl::StatusOr<NpyArray> len = ReadNpy(lengths);
  EXPECT_TRUE(x.ok() && len.ok());
  const int64_t n = x->shape[0], d = x->shape[1];
  const double hi = std::sqrt(static_cast<double>(st->spec.max_tokens));
  std::vector<double> pred(n), truth(n);
  for (int64_t i = 0; i < n; ++i) {
    double s = st->theta[d];
    for (int64_t c = 0; c < d; ++c) {
      const double v = x->dtype == NpyDType::kFloat32
                           ? x->as<float>()[i * d + c]
                           : Fp16ToFloat(x->as<uint16_t>()[i * d + c]);
      s += (v - st->standardizer.mean[c]) / st->standardizer.scale[c] *
           st->theta[c];
    }
    s = std::clamp(s, 1.0, hi);
    pred[i] = s * s;
    truth[i] = static_cast<double>(len->as<int64_t>()[i]);
  }
  Reference ref{};
  ref.spearman = Pearson(Ranks(pred), Ranks(truth));
  ref.kendall = KendallBrute(pred, truth);
  double sum = 0, ss = 0, sm = 0, sl = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = std::abs(pred[i] - truth[i]);
    sum += e;
    if (truth[i] <= 256) {
      ss += e;
      ++ref.n_short;
    } else if (truth[i] <= 1024) {
      sm += e;
      ++ref.n_medium;
    } else {
      sl += e;
      ++ref.n_long;
    }
  }
  ref.mae = sum / n;
  ref.mae_short = ss / ref.n_short;
  ref.mae_medium = sm / ref.n_medium;
  ref.mae_long = ref.n_long > 0 ? sl / ref.n_long : NAN;
  return ref;
}

// ---- The workflow
// ------------------------------------------------------------

TEST(LeapctlTest, SynthTrainEvalAdaptEval) {
  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  Synth(dir, "src", 4000, 1);
  Synth(dir, "src_held", 1000, 2);
  Synth(dir, "shift", 2000, 3, kShifted);
  Synth(dir, "shift_held", 1000, 4, kShifted);

  // train (lambda by CV)
  const std::string r1 = dir.File("r1.leapr");
  RunResult t = RunLeapctl(dir, {"train", "--features", dir.File("src.npy"),
                                 "--lengths", dir.File("src_len.npy"), "--out",
                                 r1, "--layer", "18", "--model", "test/model"});
  ASSERT_EQ(t.exit_code, 0) << Describe(t);
  EXPECT_THAT(t.out, HasSubstr("n: 4000\n"));
  EXPECT_THAT(t.out, HasSubstr("d: 64\n"));
  EXPECT_THAT(t.out, HasSubstr("chosen by 5-fold CV"));
  EXPECT_THAT(t.out, HasSubstr("held-out mse"));
  EXPECT_THAT(t.out, HasSubstr("train_mse: "));
  EXPECT_THAT(t.out, HasSubstr("out: " + r1));
  EXPECT_THAT(t.err, HasSubstr("leapctl train: "));  // progress on stderr
  {
    absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(r1);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->spec.dim, kDim);
    EXPECT_EQ(st->spec.layer, 18);
    EXPECT_EQ(st->spec.model_id, "test/model");
    EXPECT_EQ(st->spec.max_tokens, 2048);
    EXPECT_GT(st->spec.lambda, 0.0);
    EXPECT_EQ(st->version, 1);
    EXPECT_EQ(st->train_rows, 4000);
    EXPECT_EQ(st->completions_learned, 0);
    EXPECT_TRUE(st->p.has_value());
    EXPECT_THAT(st->note, StartsWith("leapctl train --features "));
    EXPECT_GT(st->created_unix_ms, 1'600'000'000'000);
  }

  // eval --json: exactly the documented keys, values equal to the FP64
  // reference.
  nlohmann::json j = EvalJson(dir, r1, "src_held");
  ASSERT_TRUE(j.is_object());
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  EXPECT_THAT(keys,
              ::testing::UnorderedElementsAre("n", "spearman", "kendall_tau",
                                              "mae", "mae_by_bucket"));
  ASSERT_TRUE(j["mae_by_bucket"].is_object());
  EXPECT_EQ(j["mae_by_bucket"].size(), 3u);
  for (const char* k : {"le_256", "257_1024", "gt_1024"}) {
    EXPECT_TRUE(j["mae_by_bucket"].contains(k)) << k;
  }
  EXPECT_EQ(j["n"].get<int>(), 1000);
  const double source_spearman = j["spearman"].get<double>();
  EXPECT_GT(source_spearman, 0.5);
  const Reference ref =
      ReferenceEval(r1, dir.File("src_held.npy"), dir.File("src_held_len.npy"));
  EXPECT_NEAR(source_spearman, ref.spearman, 1e-3);
  EXPECT_NEAR(j["kendall_tau"].get<double>(), ref.kendall, 1e-3);
  EXPECT_NEAR(j["mae"].get<double>(), ref.mae, 1e-3 * ref.mae);
  EXPECT_NEAR(j["mae_by_bucket"]["le_256"].get<double>(), ref.mae_short,
              1e-3 * ref.mae_short);
  EXPECT_NEAR(j["mae_by_bucket"]["257_1024"].get<double>(), ref.mae_medium,
              1e-3 * ref.mae_medium);
  if (ref.n_long == 0) {
    EXPECT_TRUE(j["mae_by_bucket"]["gt_1024"].is_null());
  } else {
    EXPECT_NEAR(j["mae_by_bucket"]["gt_1024"].get<double>(), ref.mae_long,
                1e-3 * ref.mae_long);
  }

  // Text eval prints the same figures.
  RunResult te = RunLeapctl(
      dir, {"eval", "--readout", r1, "--features", dir.File("src_held.npy"),
            "--lengths", dir.File("src_held_len.npy")});
  ASSERT_EQ(te.exit_code, 0) << Describe(te);
  EXPECT_THAT(te.out,
              AllOf(HasSubstr("n: 1000\n"), HasSubstr("spearman: "),
                    HasSubstr("kendall_tau: "), HasSubstr("mae <=256")));

  // adapt on the shifted domain.
  const double frozen =
      EvalJson(dir, r1, "shift_held")["spearman"].get<double>();
  const std::string r2 = dir.File("r2.leapr");
  RunResult a = RunLeapctl(
      dir,
      {"adapt", "--readout", r1, "--features", dir.File("shift.npy"),
       "--lengths", dir.File("shift_len.npy"), "--out", r2, "--batch", "16"});
  ASSERT_EQ(a.exit_code, 0) << Describe(a);
  EXPECT_THAT(a.out, HasSubstr("rows: 2000\n"));
  EXPECT_THAT(a.out, HasSubstr("learned: 2000\n"));
  EXPECT_THAT(a.out, HasSubstr("batches: 125\n"));
  EXPECT_THAT(a.out, HasSubstr("completions/s"));
  {
    absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(r2);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->version, 2);
    EXPECT_EQ(st->completions_learned, 2000);
    EXPECT_EQ(st->train_rows, 4000);
    EXPECT_TRUE(st->p.has_value());
    EXPECT_THAT(st->note, HasSubstr("leapctl adapt "));
  }
  const double adapted =
      EvalJson(dir, r2, "shift_held")["spearman"].get<double>();
  EXPECT_GT(adapted, frozen + 0.02) << "frozen " << frozen;
  // The adapted readout's eval matches the reference too.
  EXPECT_NEAR(adapted,
              ReferenceEval(r2, dir.File("shift_held.npy"),
                            dir.File("shift_held_len.npy"))
                  .spearman,
              1e-3);

  // Adapting the adapted artifact again bumps the version once more.
  const std::string r3 = dir.File("r3.leapr");
  RunResult a2 = RunLeapctl(
      dir, {"adapt", "--readout", r2, "--features", dir.File("shift.npy"),
            "--lengths", dir.File("shift_len.npy"), "--out", r3});
  ASSERT_EQ(a2.exit_code, 0) << Describe(a2);
  absl::StatusOr<readout::ReadoutState> st3 = readout::ReadArtifact(r3);
  ASSERT_TRUE(st3.ok()) << st3.status();
  EXPECT_EQ(st3->version, 3);
  EXPECT_EQ(st3->completions_learned, 4000);
}

// An --out that cannot be written is reported before the fit (which can take
// minutes at d = 4096), not after it: no "fitting" progress line, nothing
// left behind.
TEST(LeapctlTest, TrainChecksOutBeforeFitting) {
  ScratchDir dir;
  Synth(dir, "src", 300, 1);
  for (const std::string& out :
       {dir.File("no-such-dir/r.leapr"), dir.path()}) {
    RunResult t = RunLeapctl(dir, {"train", "--features", dir.File("src.npy"),
                                   "--lengths", dir.File("src_len.npy"),
                                   "--out", out});
    EXPECT_EQ(t.exit_code, 1) << Describe(t);
    EXPECT_NE(t.err.find("cannot write " + out), std::string::npos) << t.err;
    EXPECT_EQ(t.err.find("fitting ridge readout"), std::string::npos) << t.err;
    EXPECT_EQ(t.out.find("lambda"), std::string::npos) << t.out;
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    if (e.path().filename().string().find("probe") != std::string::npos) {
      left.push_back(e.path());
    }
  }
  EXPECT_TRUE(left.empty());
}

TEST(LeapctlTest, BatchSizeDoesNotChangeTheAdaptedReadout) {
  ScratchDir dir;
  Synth(dir, "src", 1500, 1);
  Synth(dir, "shift", 300, 3, {"--domain", "code"});
  const std::string r1 = dir.File("r1.leapr");
  ASSERT_EQ(
      RunLeapctl(dir, {"train", "--features", dir.File("src.npy"), "--lengths",
                       dir.File("src_len.npy"), "--out", r1, "--lambda", "100"})
          .exit_code,
      0);
  std::vector<readout::ReadoutState> states;
  for (const char* batch : {"1", "7", "300"}) {
    const std::string out = dir.File(std::string("b") + batch + ".leapr");
    RunResult a = RunLeapctl(
        dir, {"adapt", "--readout", r1, "--features", dir.File("shift.npy"),
              "--lengths", dir.File("shift_len.npy"), "--out", out, "--batch",
              batch});
    ASSERT_EQ(a.exit_code, 0) << Describe(a);
    absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(out);
    ASSERT_TRUE(st.ok()) << st.status();
    states.push_back(*std::move(st));
  }
  for (size_t k = 1; k < states.size(); ++k) {
    const double diff =
        (states[k].theta - states[0].theta).cwiseAbs().maxCoeff();
    EXPECT_LT(diff, 1e-3 * (1.0 + states[0].theta.cwiseAbs().maxCoeff()));
  }
}

TEST(LeapctlTest, AdaptAppliesFinishReasons) {
  ScratchDir dir;
  Synth(dir, "src", 1000, 1);
  const std::string r1 = dir.File("r1.leapr");
  ASSERT_EQ(RunLeapctl(dir, {"train", "--features", dir.File("src.npy"),
                             "--lengths", dir.File("src_len.npy"), "--out", r1,
                             "--lambda", "50", "--max-tokens", "1000"})
                .exit_code,
            0);
  // 20 rows with hand-made lengths and reasons.
  Synth(dir, "fb", 20, 9);
  std::vector<int64_t> lengths(20, 100);
  std::vector<int32_t> reasons(20, 1);  // stop: learned
  reasons[0] = reasons[1] = 3;          // cancelled
  reasons[2] = 4;                       // aborted
  reasons[3] = 2;                       // length below M = 1000: censored
  reasons[4] = 2;
  lengths[4] = 1000;  // length at M: learned
  const int64_t shape[1] = {20};
  ASSERT_TRUE(
      WriteNpy(dir.File("fb_len.npy"), NpyDType::kInt64, shape, lengths.data())
          .ok());
  ASSERT_TRUE(
      WriteNpy(dir.File("reasons.npy"), NpyDType::kInt32, shape, reasons.data())
          .ok());
  const std::string r2 = dir.File("r2.leapr");
  RunResult a = RunLeapctl(
      dir, {"adapt", "--readout", r1, "--features", dir.File("fb.npy"),
            "--lengths", dir.File("fb_len.npy"), "--out", r2,
            "--finish-reasons", dir.File("reasons.npy"), "--batch", "4"});
  ASSERT_EQ(a.exit_code, 0) << Describe(a);
  EXPECT_THAT(a.out, HasSubstr("learned: 16\n"));
  EXPECT_THAT(
      a.out, HasSubstr("skipped: 4 (cancelled=2 aborted=1 censored_length=1)"));
  EXPECT_THAT(a.out, HasSubstr("batches: 4\n"));
  absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(r2);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->completions_learned, 16);

  // An unknown reason code is an error naming the file and row.
  reasons[7] = 9;
  ASSERT_TRUE(WriteNpy(dir.File("bad_reasons.npy"), NpyDType::kInt32, shape,
                       reasons.data())
                  .ok());
  RunResult b = RunLeapctl(
      dir, {"adapt", "--readout", r1, "--features", dir.File("fb.npy"),
            "--lengths", dir.File("fb_len.npy"), "--out", dir.File("x.leapr"),
            "--finish-reasons", dir.File("bad_reasons.npy")});
  EXPECT_EQ(b.exit_code, 1) << Describe(b);
  EXPECT_THAT(b.err, AllOf(HasSubstr(dir.File("bad_reasons.npy")),
                           HasSubstr("finish reason 7 is 9")));
}

TEST(LeapctlTest, Float16FeaturesMatchFloat32) {
  ScratchDir dir;
  Synth(dir, "src", 2000, 1);
  Synth(dir, "h32", 500, 5);
  Synth(dir, "h16", 500, 5, {"--dtype", "float16"});
  absl::StatusOr<NpyArray> h16 = ReadNpy(dir.File("h16.npy"));
  ASSERT_TRUE(h16.ok()) << h16.status();
  EXPECT_EQ(h16->dtype, NpyDType::kFloat16);
  EXPECT_EQ(h16->shape, (std::vector<int64_t>{500, kDim}));
  EXPECT_EQ(ReadFile(dir.File("h32_len.npy")),
            ReadFile(dir.File("h16_len.npy")));

  const std::string r = dir.File("r.leapr");
  ASSERT_EQ(RunLeapctl(dir, {"train", "--features", dir.File("src.npy"),
                             "--lengths", dir.File("src_len.npy"), "--out", r,
                             "--lambda", "200", "--no-p"})
                .exit_code,
            0);
  const double s32 = EvalJson(dir, r, "h32")["spearman"].get<double>();
  const double s16 = EvalJson(dir, r, "h16")["spearman"].get<double>();
  EXPECT_GT(s32, 0.5);
  EXPECT_NEAR(s16, s32, 0.01);
  // Training on float16 features works as well.
  RunResult t16 =
      RunLeapctl(dir, {"train", "--features", dir.File("h16.npy"), "--lengths",
                       dir.File("h16_len.npy"), "--out", dir.File("r16.leapr"),
                       "--lambda", "50"});
  EXPECT_EQ(t16.exit_code, 0) << Describe(t16);
}

// ---- Errors
// ------------------------------------------------------------------

class LeapctlErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Synth(dir_, "src", 200, 1);
    readout_ = dir_.File("r.leapr");
    ASSERT_EQ(RunLeapctl(dir_, {"train", "--features", dir_.File("src.npy"),
                                "--lengths", dir_.File("src_len.npy"), "--out",
                                readout_, "--lambda", "10"})
                  .exit_code,
              0);
  }

  // Expects exit 1 and one line "leapctl <cmd>: error: ..." naming `file`
  // and containing `problem`.
  void ExpectFailure(const RunResult& r, const std::string& cmd,
                     const std::string& file, const std::string& problem) {
    EXPECT_EQ(r.exit_code, 1) << Describe(r);
    const std::string prefix = "leapctl " + cmd + ": error: ";
    const size_t at = r.err.find(prefix);
    ASSERT_NE(at, std::string::npos) << Describe(r);
    const std::string line = r.err.substr(at, r.err.find('\n', at) - at);
    EXPECT_THAT(line, HasSubstr(file));
    EXPECT_THAT(line, HasSubstr(problem));
    EXPECT_EQ(r.err.back(), '\n');
    EXPECT_EQ(r.err.find('\n', at), r.err.size() - 1) << "not one line";
  }

  RunResult Train(const std::string& features, const std::string& lengths) {
    return RunLeapctl(
        dir_, {"train", "--features", features, "--lengths", lengths, "--out",
               dir_.File("out.leapr"), "--lambda", "1"});
  }
  RunResult Eval(const std::string& features, const std::string& lengths) {
    return RunLeapctl(dir_, {"eval", "--readout", readout_, "--features",
                             features, "--lengths", lengths});
  }

  ScratchDir dir_;
  std::string readout_;
};

TEST_F(LeapctlErrorTest, BadMagic) {
  const std::string bad = dir_.File("bad.npy");
  WriteFile(bad, "this is not a numpy file at all");
  ExpectFailure(Train(bad, dir_.File("src_len.npy")), "train", bad, "magic");
  ExpectFailure(Eval(bad, dir_.File("src_len.npy")), "eval", bad, "magic");
  ExpectFailure(Train(dir_.File("src.npy"), bad), "train", bad, "magic");
}

TEST_F(LeapctlErrorTest, MissingFile) {
  const std::string missing = dir_.File("nope.npy");
  ExpectFailure(Train(missing, dir_.File("src_len.npy")), "train", missing, "");
  RunResult r = RunLeapctl(
      dir_, {"eval", "--readout", dir_.File("nope.leapr"), "--features",
             dir_.File("src.npy"), "--lengths", dir_.File("src_len.npy")});
  ExpectFailure(r, "eval", dir_.File("nope.leapr"), "");
}

TEST_F(LeapctlErrorTest, Float64FeaturesAreUnsupported) {
  std::vector<double> x(10 * kDim, 0.5);
  const int64_t shape[2] = {10, kDim};
  const std::string f = dir_.File("f64.npy");
  ASSERT_TRUE(WriteNpy(f, NpyDType::kFloat64, shape, x.data()).ok());
  std::vector<int64_t> len(10, 100);
  const int64_t lshape[1] = {10};
  ASSERT_TRUE(
      WriteNpy(dir_.File("l10.npy"), NpyDType::kInt64, lshape, len.data())
          .ok());
  ExpectFailure(Train(f, dir_.File("l10.npy")), "train", f,
                "unsupported feature dtype float64");
  ExpectFailure(Eval(f, dir_.File("l10.npy")), "eval", f,
                "unsupported feature dtype float64");
}

TEST_F(LeapctlErrorTest, WrongShapes) {
  // Lengths with the wrong count.
  std::vector<int64_t> len(199, 100);
  const int64_t lshape[1] = {199};
  const std::string l = dir_.File("l199.npy");
  ASSERT_TRUE(WriteNpy(l, NpyDType::kInt64, lshape, len.data()).ok());
  ExpectFailure(Train(dir_.File("src.npy"), l), "train", l, "shape mismatch");
  ExpectFailure(Eval(dir_.File("src.npy"), l), "eval", l, "shape mismatch");
  // Float lengths.
  std::vector<float> flen(200, 1.0f);
  const int64_t fshape[1] = {200};
  const std::string fl = dir_.File("flen.npy");
  ASSERT_TRUE(WriteNpy(fl, NpyDType::kFloat32, fshape, flen.data()).ok());
  ExpectFailure(Train(dir_.File("src.npy"), fl), "train", fl,
                "lengths must be int32 or int64");
  // 1-D features.
  const std::string f1 = dir_.File("f1d.npy");
  ASSERT_TRUE(WriteNpy(f1, NpyDType::kFloat32, fshape, flen.data()).ok());
  ExpectFailure(Train(f1, dir_.File("src_len.npy")), "train", f1, "2-D");
  // Features of another width than the readout.
  Synth(dir_, "d32", 200, 2, {"--dim", "32"});
  ExpectFailure(Eval(dir_.File("d32.npy"), dir_.File("d32_len.npy")), "eval",
                dir_.File("d32.npy"), "does not match the readout");
  // Negative length.
  std::vector<int32_t> neg(200, 10);
  neg[17] = -3;
  const std::string ln = dir_.File("neg.npy");
  ASSERT_TRUE(WriteNpy(ln, NpyDType::kInt32, fshape, neg.data()).ok());
  ExpectFailure(Train(dir_.File("src.npy"), ln), "train", ln, "length 17");
}

TEST_F(LeapctlErrorTest, NonFiniteFeaturesNameRowAndColumn) {
  absl::StatusOr<NpyArray> src = ReadNpy(dir_.File("src.npy"));
  ASSERT_TRUE(src.ok());
  std::vector<float> x(src->as<float>(), src->as<float>() + 200 * kDim);
  x[37 * kDim + 5] = std::numeric_limits<float>::quiet_NaN();
  const int64_t shape[2] = {200, kDim};
  const std::string f = dir_.File("nan.npy");
  ASSERT_TRUE(WriteNpy(f, NpyDType::kFloat32, shape, x.data()).ok());
  ExpectFailure(Train(f, dir_.File("src_len.npy")), "train", f,
                "row 37 column 5 is not finite");
  ExpectFailure(Eval(f, dir_.File("src_len.npy")), "eval", f,
                "row 37 column 5 is not finite");
  ExpectFailure(RunLeapctl(dir_, {"adapt", "--readout", readout_, "--features",
                                  f, "--lengths", dir_.File("src_len.npy"),
                                  "--out", dir_.File("o.leapr")}),
                "adapt", f, "row 37 column 5 is not finite");

  // +Inf in a float16 file.
  std::vector<uint16_t> h(200 * kDim);
  for (size_t i = 0; i < h.size(); ++i) h[i] = FloatToFp16(src->as<float>()[i]);
  h[199 * kDim + 63] = 0x7C00;
  const std::string f16 = dir_.File("inf16.npy");
  ASSERT_TRUE(WriteNpy(f16, NpyDType::kFloat16, shape, h.data()).ok());
  ExpectFailure(Eval(f16, dir_.File("src_len.npy")), "eval", f16,
                "row 199 column 63 is not finite (inf)");
}

TEST_F(LeapctlErrorTest, AdaptNeedsP) {
  const std::string nop = dir_.File("nop.leapr");
  ASSERT_EQ(RunLeapctl(dir_, {"train", "--features", dir_.File("src.npy"),
                              "--lengths", dir_.File("src_len.npy"), "--out",
                              nop, "--lambda", "10", "--no-p"})
                .exit_code,
            0);
  absl::StatusOr<readout::ReadoutState> st = readout::ReadArtifact(nop);
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->p.has_value());
  ExpectFailure(RunLeapctl(dir_, {"adapt", "--readout", nop, "--features",
                                  dir_.File("src.npy"), "--lengths",
                                  dir_.File("src_len.npy"), "--out",
                                  dir_.File("o.leapr")}),
                "adapt", nop, "no RLS matrix P");
}

TEST_F(LeapctlErrorTest, CorruptedArtifact) {
  std::string bytes = ReadFile(readout_);
  ASSERT_GT(bytes.size(), 200u);
  bytes[bytes.size() / 2] ^= 0x40;
  const std::string bad = dir_.File("corrupt.leapr");
  WriteFile(bad, bytes);
  ExpectFailure(RunLeapctl(dir_, {"eval", "--readout", bad, "--features",
                                  dir_.File("src.npy"), "--lengths",
                                  dir_.File("src_len.npy")}),
                "eval", bad, "corrupted");
}

TEST_F(LeapctlErrorTest, UsageErrorsExitTwo) {
  const auto expect_usage = [&](const std::vector<std::string>& args,
                                const std::string& cmd,
                                const std::string& problem) {
    RunResult r = RunLeapctl(dir_, args);
    EXPECT_EQ(r.exit_code, 2) << Describe(r);
    EXPECT_THAT(r.err, HasSubstr(cmd.empty() ? std::string("leapctl: error: ")
                                             : "leapctl " + cmd + ": error: "));
    EXPECT_THAT(r.err, HasSubstr(problem));
    EXPECT_EQ(r.out, "");
  };
  expect_usage({"train", "--features", dir_.File("src.npy"), "--lengths",
                dir_.File("src_len.npy")},
               "train", "missing required flag --out");
  expect_usage(
      {"eval", "--readout", readout_, "--features", dir_.File("src.npy")},
      "eval", "missing required flag --lengths");
  expect_usage({"adapt", "--readout", readout_}, "adapt",
               "missing required flag");
  expect_usage({"synth", "--out-features", dir_.File("a.npy"), "--out-lengths",
                dir_.File("b.npy")},
               "synth", "missing required flag --n");
  expect_usage({"train", "--bogus", "1"}, "train", "unknown flag --bogus");
  expect_usage({"adapt", "--readout", readout_, "--features", "f", "--lengths",
                "l", "--out", "o", "--batch", "abc"},
               "adapt", "invalid value 'abc' for --batch");
  expect_usage({"adapt", "--readout", readout_, "--features", "f", "--lengths",
                "l", "--out", "o", "--batch", "0"},
               "adapt", "--batch must be in");
  expect_usage({"synth", "--out-features", "a", "--out-lengths", "b", "--n",
                "10", "--domain", "poetry"},
               "synth", "unknown synthetic domain 'poetry'");
  expect_usage({"synth", "--out-features", "a", "--out-lengths", "b", "--n",
                "10", "--dtype", "float64"},
               "synth", "--dtype must be float32 or float16");
  expect_usage({"eval", "stray"}, "eval", "unexpected argument 'stray'");
  expect_usage({"frobnicate"}, "", "unknown command 'frobnicate'");
  RunResult none = RunLeapctl(dir_, {});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.err, HasSubstr("Usage: leapctl <command>"));
}

TEST(LeapctlHelpTest, EveryCommandDocumentsEveryFlag) {
  ScratchDir dir;
  const std::vector<std::pair<std::string, std::vector<std::string>>> cmds = {
      {"train",
       {"--features", "--lengths", "--out", "--lambda", "--max-tokens",
        "--layer", "--model", "--folds", "--no-p", "--help"}},
      {"eval", {"--readout", "--features", "--lengths", "--json", "--help"}},
      {"adapt",
       {"--readout", "--features", "--lengths", "--out", "--batch",
        "--finish-reasons", "--help"}},
      {"synth",
       {"--out-features", "--out-lengths", "--n", "--dim", "--domain",
        "--median", "--log-sigma", "--angle", "--offset", "--signal", "--noise",
        "--nuisance", "--nuisance-rank", "--model-seed", "--seed", "--dtype",
        "--max-tokens", "--help"}},
  };
  for (const auto& [cmd, flags] : cmds) {
    RunResult r = RunLeapctl(dir, {cmd, "--help"});
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << Describe(r);
    EXPECT_THAT(r.out, StartsWith("Usage: leapctl " + cmd));
    for (const std::string& f : flags) {
      EXPECT_THAT(r.out, ::testing::AnyOf(HasSubstr("\n  " + f + " "),
                                          HasSubstr("\n  " + f + "\n")))
          << cmd << " " << f;
    }
  }
  RunResult top = RunLeapctl(dir, {"--help"});
  EXPECT_EQ(top.exit_code, 0);
  for (const char* cmd : {"train", "eval", "adapt", "synth"}) {
    EXPECT_THAT(top.out, HasSubstr(std::string("  ") + cmd + " "));
  }
  // The synth help documents the data model.
  RunResult synth = RunLeapctl(dir, {"synth", "--help"});
  EXPECT_THAT(synth.out, AllOf(HasSubstr("cos(angle)"), HasSubstr("log_sigma"),
                               HasSubstr("translation")));
}

}  // namespace
}  // namespace leap::leapctl_test
