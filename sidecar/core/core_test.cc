// Unit tests of Core, in process (no leapd, no gRPC): predictions against
// the FP64 w.x + b of the readout's theta and standardization, learning
// against the FP64 anchored closed form of ridge + RLS, publish numbering
// and listeners, rescoring of live requests, the feedback rules and bad
// input, routes and shadows, snapshots and rollback, and recovery from a
// real RocksDB store.
#include "sidecar/core/core.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"
#include "sidecar/core/engine_messages.h"
#include "storage/rocksdb_store.h"
#include "tests/support/checkpoint_watch_store.h"
#include "tests/support/readout_fixtures.h"

namespace leap::sidecar {
namespace {

using readout::DType;
using readout::FinishReason;
using testing::ClosedForm;
using testing::RandomFeatures;
using testing::RandomState;
using testing::ReferenceScore;
using testing::ScoreTolerance;

constexpr int64_t kDim = 24;
constexpr int64_t kBudget = readout::kDefaultMaxTokens;

// Partial RLS batches are applied after `flush_after_ns` (1 ms by default:
// they go quickly).
CoreOptions Options(int rls_batch = 4, int64_t flush_after_ns = 1'000'000) {
  CoreOptions o;
  o.readout.rls_batch = rls_batch;
  // Fixed batches: the tests count the versions they publish.
  o.readout.rls_batch_max = rls_batch;
  o.readout.flush_after_ns = flush_after_ns;
  o.cache.max_bytes = 64 << 20;
  return o;
}

Route DefaultRoute(const std::string& readout) {
  Route r;
  r.arms.push_back({readout, readout, 100.0, false});
  return r;
}

struct Request {
  std::string id;
  std::vector<float> x;
};

ScoreRequest Score(const Request& r, const std::string& product_line = "") {
  ScoreRequest s;
  s.request_id = r.id;
  s.product_line = product_line;
  s.features = absl::string_view(reinterpret_cast<const char*>(r.x.data()),
                                 r.x.size() * sizeof(float));
  return s;
}

// Records every publish it is told about.
class Recorder : public PublishListener {
 public:
  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const PublishedVersion>& v) override {
    absl::MutexLock lock(&mu_);
    seen_[readout].push_back(v);
  }
  std::vector<int64_t> Versions(const std::string& readout) {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> out;
    for (const auto& v : seen_[readout]) out.push_back(v->version);
    return out;
  }
  std::shared_ptr<const PublishedVersion> Last(const std::string& readout) {
    absl::MutexLock lock(&mu_);
    return seen_[readout].empty() ? nullptr : seen_[readout].back();
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::vector<std::shared_ptr<const PublishedVersion>>>
      seen_ ABSL_GUARDED_BY(mu_);
};

class CoreTest : public ::testing::Test {
 protected:
  void SetUp() override { state_ = RandomState(kDim, /*seed=*/11); }
  void Make(CoreOptions o = Options(), storage::StateStore* store = nullptr) {
    core_ = std::make_unique<Core>(o, &metrics_, store);
  }
  void CreateDefault(const std::string& name = "r") {
    ASSERT_TRUE(core_->CreateReadout(name, state_).ok());
    ASSERT_TRUE(core_->SetRoute(DefaultRoute(name)).ok());
  }
  Request Next() {
    return {absl::StrCat("q", next_id_++), RandomFeatures(state_, rng_)};
  }
  Eigen::VectorXd Theta(const std::string& name = "r") {
    return (*core_->GetReadout(name))->Export().theta;
  }

  Metrics metrics_;
  readout::ReadoutState state_;
  std::unique_ptr<Core> core_;
  std::mt19937_64 rng_{5};
  int next_id_ = 0;
};

// -------------------------------------------------------------- prediction

TEST_F(CoreTest, PredictionsEqualTheFp64ReadoutInEveryDtype) {
  Make();
  CreateDefault();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int i = 0; i < 40; ++i) {
      Request r = Next();
      // The values the engine sends, and those values in double.
      std::string bytes;
      std::vector<double> sent(kDim);
      for (int64_t k = 0; k < kDim; ++k) {
        if (dtype == DType::kFloat32) {
          bytes.append(reinterpret_cast<const char*>(&r.x[k]), 4);
          sent[k] = r.x[k];
        } else {
          const uint16_t h = dtype == DType::kBFloat16 ? FloatToBf16(r.x[k])
                                                       : FloatToFp16(r.x[k]);
          bytes.append(reinterpret_cast<const char*>(&h), 2);
          sent[k] = dtype == DType::kBFloat16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
        }
      }
      ScoreRequest req;
      req.request_id = r.id;
      req.features = bytes;
      req.dtype = dtype;
      std::shared_ptr<LiveRequest> live;
      absl::StatusOr<ScoreResult> got = core_->Predict(req, 0, &live);
      ASSERT_TRUE(got.ok()) << got.status();
      const double want = ReferenceScore(state_.standardizer, state_.theta, sent);
      EXPECT_NEAR(got->score, want,
                  ScoreTolerance(state_.standardizer, state_.theta, sent))
          << readout::DTypeName(dtype) << " request " << i;
      EXPECT_DOUBLE_EQ(got->predicted_tokens,
                       readout::TokensFromScore(got->score, kBudget));
      EXPECT_NEAR(got->predicted_tokens, readout::TokensFromScore(want, kBudget),
                  1e-4 * got->predicted_tokens);
      EXPECT_EQ(got->version, 1);
      EXPECT_EQ(got->readout, "r");
      EXPECT_EQ(got->arm, "r");
      ASSERT_NE(live, nullptr);
      EXPECT_EQ(core_->cache().Find(r.id), live);
    }
  }
  EXPECT_EQ(core_->cache().size(), 120);
}

TEST_F(CoreTest, PredictionsAreClippedToTheBudget) {
  Make();
  CreateDefault();
  // Features far along +theta / -theta: scores far above sqrt(M), below 1.
  for (double sign : {+1.0, -1.0}) {
    Request r{sign > 0 ? "high" : "low", std::vector<float>(kDim)};
    for (int64_t k = 0; k < kDim; ++k) {
      r.x[k] = static_cast<float>(state_.standardizer.mean[k] +
                                  sign * 40.0 * state_.standardizer.scale[k] *
                                      (state_.theta[k] > 0 ? 1 : -1));
    }
    auto got = core_->Predict(Score(r), 0, nullptr);
    ASSERT_TRUE(got.ok()) << got.status();
    const double want = ReferenceScore(state_.standardizer, state_.theta, r.x);
    EXPECT_NEAR(got->score, want, 1e-5 * std::abs(want));
    EXPECT_DOUBLE_EQ(got->predicted_tokens, sign > 0 ? double(kBudget) : 1.0);
  }
}

TEST_F(CoreTest, BatchPredictionEqualsOneByOne) {
  Make();
  CreateDefault();
  std::vector<Request> rs;
  for (int i = 0; i < 13; ++i) rs.push_back(Next());
  std::vector<ScoreRequest> reqs;
  for (const Request& r : rs) reqs.push_back(Score(r));
  // One bad request in the middle fails alone.
  std::string short_features(8, '\0');
  reqs[6].features = short_features;
  std::vector<absl::StatusOr<ScoreResult>> results;
  std::vector<std::shared_ptr<LiveRequest>> lives;
  core_->PredictBatch(reqs, 0, &results, &lives);
  ASSERT_EQ(results.size(), rs.size());
  for (size_t i = 0; i < rs.size(); ++i) {
    if (i == 6) {
      EXPECT_TRUE(absl::IsInvalidArgument(results[i].status())) << results[i].status();
      EXPECT_EQ(lives[i], nullptr);
      EXPECT_EQ(core_->cache().Find(rs[i].id), nullptr);
      continue;
    }
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    const double want = ReferenceScore(state_.standardizer, state_.theta, rs[i].x);
    EXPECT_NEAR(results[i]->score, want,
                ScoreTolerance(state_.standardizer, state_.theta,
                               std::vector<double>(rs[i].x.begin(), rs[i].x.end())));
    EXPECT_EQ(core_->cache().Find(rs[i].id), lives[i]);
  }
  EXPECT_EQ(core_->cache().size(), 12);
}

TEST_F(CoreTest, BadRequestsGetPreciseErrorsAndChangeNothing) {
  Make();
  CreateDefault();
  Request ok = Next();
  ASSERT_TRUE(core_->Predict(Score(ok), 0, nullptr).ok());

  Request dup{ok.id, RandomFeatures(state_, rng_)};
  absl::Status s = core_->Predict(Score(dup), 0, nullptr).status();
  EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;

  Request empty{"", RandomFeatures(state_, rng_)};
  s = core_->Predict(Score(empty), 0, nullptr).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;

  Request long_id{std::string(300, 'a'), RandomFeatures(state_, rng_)};
  s = core_->Predict(Score(long_id), 0, nullptr).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;

  Request wide{"wide", std::vector<float>(kDim + 1, 1.0f)};
  s = core_->Predict(Score(wide), 0, nullptr).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("feature size mismatch"), std::string::npos) << s;

  Request nan = Next();
  nan.x[3] = std::nanf("");
  s = core_->Predict(Score(nan), 0, nullptr).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;

  Request capped = Next();
  ScoreRequest bad_cap = Score(capped);
  bad_cap.request_max_tokens = -1;
  s = core_->Predict(bad_cap, 0, nullptr).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;

  // No route for a product line once the default route is gone.
  ASSERT_TRUE(core_->DeleteRoute("").ok());
  s = core_->Predict(Score(Next(), "chat"), 0, nullptr).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;

  // Only the first request became live; the readout is untouched.
  EXPECT_EQ(core_->cache().size(), 1);
  EXPECT_EQ((*core_->GetReadout("r"))->current()->version, 1);
  EXPECT_EQ(Theta(), state_.theta);
}

// ------------------------------------------------------------- learning

TEST_F(CoreTest, LearnedCompletionsMatchTheAnchoredClosedForm) {
  auto recorder = std::make_shared<Recorder>();
  Make(Options(/*rls_batch=*/4));
  core_->hub().Subscribe(recorder);
  CreateDefault();
  ClosedForm reference(state_);
  std::mt19937_64 rng(17);
  std::lognormal_distribution<double> length(std::log(300.0), 0.9);
  int64_t learned = 0;
  std::map<std::string, int> outcomes;
  for (int i = 0; i < 203; ++i) {
    Request r = Next();
    ScoreRequest req = Score(r);
    const int kind = i % 7;
    req.request_max_tokens = kind == 5 ? 100 : 0;
    ASSERT_TRUE(core_->Predict(req, 0, nullptr).ok());
    int64_t tokens = std::clamp<int64_t>(std::llround(length(rng)), 1, 5000);
    FinishReason reason = FinishReason::kStop;
    if (kind == 3) reason = FinishReason::kCancelled;
    if (kind == 4) reason = FinishReason::kAborted;
    if (kind == 5) {  // stopped by its own cap below M: censored
      reason = FinishReason::kLength;
      tokens = 100;
    }
    if (kind == 6) {  // ran to the budget: learned at sqrt(M)
      reason = FinishReason::kLength;
      tokens = 3000;
    }
    auto out = core_->Complete(r.id, tokens, reason);
    ASSERT_TRUE(out.ok()) << out.status();
    ++outcomes[out->skip_reason];
    EXPECT_FALSE(out->duplicate);
    if (out->learned) {
      reference.Learn(r.x, readout::TargetFromTokens(tokens, kBudget));
      ++learned;
    }
    EXPECT_EQ(core_->cache().Find(r.id), nullptr);
  }
  EXPECT_EQ(outcomes[""], learned);
  EXPECT_EQ(outcomes["cancelled"], 58);  // kinds 3 and 4
  EXPECT_EQ(outcomes["censored"], 29);
  EXPECT_EQ(learned, 203 - 58 - 29);
  core_->WaitIdle();
  auto ro = *core_->GetReadout("r");
  EXPECT_EQ(ro->completions_learned(), learned);
  EXPECT_EQ(ro->current()->completions_learned, learned);
  EXPECT_EQ(ro->backlog(), 0);
  const double err = testing::RelErr(Theta(), reference.Theta());
  EXPECT_LT(err, 1e-6) << "theta vs FP64 closed form over " << learned
                       << " completions";
  // Some learning happened (theta moved well beyond that error).
  EXPECT_GT(testing::RelErr(state_.theta, reference.Theta()), 1e-3);

  // Publishes: 1 (create), then one per RLS batch, consecutive, every one
  // told to the listener in order; the served version is the last.
  const std::vector<int64_t> seen = recorder->Versions("r");
  ASSERT_GE(seen.size(), static_cast<size_t>(1 + (learned + 3) / 4));
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], int64_t(i) + 1);
  EXPECT_EQ(ro->current()->version, seen.back());
  const std::vector<VersionRecord> versions = ro->Versions();
  ASSERT_EQ(versions.size(), seen.size());
  EXPECT_EQ(versions.front().cause, "create");
  for (size_t i = 1; i < versions.size(); ++i) {
    EXPECT_EQ(versions[i].version, int64_t(i) + 1);
    EXPECT_EQ(versions[i].cause, "rls");
    EXPECT_GE(versions[i].completions_learned, versions[i - 1].completions_learned);
  }
  EXPECT_EQ(versions.back().completions_learned, learned);

  // A prediction now uses the learned theta.
  Request after = Next();
  auto got = core_->Predict(Score(after), 0, nullptr);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->version, seen.back());
  EXPECT_NEAR(got->score,
              ReferenceScore(state_.standardizer, reference.Theta(), after.x),
              1e-4);
}

TEST_F(CoreTest, PublishesRescoreLiveRequestsAndSkipEndedOnes) {
  // A listener that rescores the requests it keeps live on every publish,
  // as the Connect stream and the shm server do.
  class Rescorer : public PublishListener {
   public:
    absl::Mutex mu;
    std::vector<std::shared_ptr<LiveRequest>> live ABSL_GUARDED_BY(mu);
    std::map<int64_t, std::vector<leap::v1::Prediction>> rescored
        ABSL_GUARDED_BY(mu);
    void OnPublish(const std::string& readout,
                   const std::shared_ptr<const PublishedVersion>& v) override {
      absl::MutexLock lock(&mu);
      RescorePredictions(readout, *v, live, &rescored[v->version]);
    }
  };
  // Exactly one batch of 8, however slowly they come.
  Make(Options(/*rls_batch=*/8, /*flush_after_ns=*/int64_t{3600} * 1'000'000'000));
  auto rescorer = std::make_shared<Rescorer>();
  core_->hub().Subscribe(rescorer);
  CreateDefault();
  std::vector<Request> staying, ending;
  for (int i = 0; i < 10; ++i) staying.push_back(Next());
  for (int i = 0; i < 8; ++i) ending.push_back(Next());
  for (const auto* group : {&staying, &ending}) {
    for (const Request& r : *group) {
      std::shared_ptr<LiveRequest> live;
      ScoreRequest req = Score(r);
      // The first three staying requests have their own cap of 2 tokens:
      // their rescores are capped too.
      if (group == &staying && &r - staying.data() < 3) {
        req.request_max_tokens = 2;
      }
      ASSERT_TRUE(core_->Predict(req, 0, &live).ok());
      absl::MutexLock lock(&rescorer->mu);
      rescorer->live.push_back(live);
    }
  }
  for (const Request& r : ending) {
    ASSERT_TRUE(core_->Complete(r.id, 500, FinishReason::kStop).ok());
  }
  core_->WaitIdle();
  const Eigen::VectorXd theta = Theta();
  absl::MutexLock lock(&rescorer->mu);
  // One batch of 8: version 2, whose rescores cover exactly the 10 live
  // requests, at the new theta.
  ASSERT_EQ(rescorer->rescored.count(2), 1u);
  EXPECT_EQ(rescorer->rescored.count(3), 0u);
  const auto& preds = rescorer->rescored[2];
  ASSERT_EQ(preds.size(), staying.size());
  for (size_t i = 0; i < preds.size(); ++i) {
    EXPECT_EQ(preds[i].request_id(), staying[i].id);
    EXPECT_EQ(preds[i].version(), 2);
    EXPECT_EQ(preds[i].readout(), "r");
    EXPECT_EQ(preds[i].arm(), "r");
    const double want = ReferenceScore(state_.standardizer, theta, staying[i].x);
    EXPECT_NEAR(preds[i].score(), want,
                ScoreTolerance(state_.standardizer, theta,
                               std::vector<double>(staying[i].x.begin(),
                                                   staying[i].x.end())));
    const double uncapped = readout::TokensFromScore(preds[i].score(), kBudget);
    EXPECT_DOUBLE_EQ(preds[i].predicted_tokens(),
                     i < 3 ? std::min(uncapped, 2.0) : uncapped);
  }
}

TEST_F(CoreTest, ListenersThatAreGoneAreNotCalled) {
  Make(Options(1));
  auto kept = std::make_shared<Recorder>();
  auto dropped = std::make_shared<Recorder>();
  core_->hub().Subscribe(kept);
  core_->hub().Subscribe(dropped);
  std::weak_ptr<Recorder> weak = dropped;
  dropped.reset();
  EXPECT_TRUE(weak.expired());
  CreateDefault();
  EXPECT_EQ(kept->Versions("r"), std::vector<int64_t>{1});
}

TEST_F(CoreTest, CompletionErrorsKeepTheRequestLive) {
  Make();
  CreateDefault();
  absl::Status s = core_->Complete("never", 10, FinishReason::kStop).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_EQ(core_->unknown_completions(), 1);

  Request r = Next();
  ScoreRequest req = Score(r);
  req.request_max_tokens = 50;
  ASSERT_TRUE(core_->Predict(req, 0, nullptr).ok());
  s = core_->Complete(r.id, -1, FinishReason::kStop).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  // A length stop beyond the request's own cap is contradictory.
  s = core_->Complete(r.id, 60, FinishReason::kLength).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(core_->cache().Find(r.id), nullptr);
  auto out = core_->Complete(r.id, 40, FinishReason::kStop);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->learned);

  Request c = Next();
  ASSERT_TRUE(core_->Predict(Score(c), 0, nullptr).ok());
  EXPECT_TRUE(core_->Cancel(c.id).ok());
  EXPECT_TRUE(absl::IsNotFound(core_->Cancel(c.id)));
  EXPECT_TRUE(absl::IsNotFound(
      core_->Complete(c.id, 10, FinishReason::kStop).status()));
  EXPECT_EQ(core_->unknown_completions(), 3);
  core_->WaitIdle();
  EXPECT_EQ((*core_->GetReadout("r"))->completions_learned(), 1);
}

TEST_F(CoreTest, FrozenAndNonAdaptiveReadoutsDoNotLearn) {
  Make(Options(1));
  CreateDefault();
  auto ro = *core_->GetReadout("r");
  ASSERT_TRUE(ro->SetFrozen(true).ok());
  Request r = Next();
  ASSERT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
  auto out = core_->Complete(r.id, 100, FinishReason::kStop);
  ASSERT_TRUE(out.ok());
  EXPECT_FALSE(out->learned);
  EXPECT_EQ(out->skip_reason, "frozen");
  core_->WaitIdle();
  EXPECT_EQ(ro->current()->version, 1);
  EXPECT_EQ(Theta(), state_.theta);
  ASSERT_TRUE(ro->SetFrozen(false).ok());

  // Without P a readout is frozen for good.
  readout::ReadoutState fixed = RandomState(kDim, 3, /*with_p=*/false);
  ASSERT_TRUE(core_->CreateReadout("fixed", fixed).ok());
  auto f = *core_->GetReadout("fixed");
  EXPECT_FALSE(f->adaptive());
  EXPECT_TRUE(f->frozen());
  EXPECT_TRUE(absl::IsFailedPrecondition(f->SetFrozen(false)));
}

// ------------------------------------------------- readouts, routes, arms

TEST_F(CoreTest, ReadoutAndRouteAdministration) {
  Make();
  EXPECT_TRUE(absl::IsInvalidArgument(core_->CreateReadout("bad name", state_)));
  EXPECT_TRUE(absl::IsInvalidArgument(core_->CreateReadout(std::string(65, 'a'), state_)));
  readout::ReadoutState broken = state_;
  broken.theta.resize(kDim);
  EXPECT_TRUE(absl::IsInvalidArgument(core_->CreateReadout("r", broken)));
  CreateDefault("r");
  EXPECT_TRUE(absl::IsAlreadyExists(core_->CreateReadout("r", state_)));
  EXPECT_TRUE(absl::IsNotFound(core_->GetReadout("x").status()));

  // A route to an unknown readout, or across widths, is refused.
  EXPECT_TRUE(absl::IsNotFound(core_->SetRoute(DefaultRoute("x"))));
  ASSERT_TRUE(core_->CreateReadout("narrow", RandomState(8, 2)).ok());
  Route mixed;
  mixed.product_line = "chat";
  mixed.arms = {{"a", "r", 50, false}, {"b", "narrow", 50, false}};
  EXPECT_TRUE(absl::IsInvalidArgument(core_->SetRoute(mixed)));
  Route bad_split;
  bad_split.arms = {{"a", "r", 60, false}, {"b", "r", 60, false}};
  EXPECT_TRUE(absl::IsInvalidArgument(core_->SetRoute(bad_split)));

  // A readout a route uses cannot be deleted.
  EXPECT_TRUE(absl::IsFailedPrecondition(core_->DeleteReadout("r")));
  EXPECT_TRUE(core_->DeleteReadout("narrow").ok());
  EXPECT_TRUE(absl::IsNotFound(core_->DeleteReadout("narrow")));
  ASSERT_EQ(core_->ListRoutes().size(), 1u);
  EXPECT_TRUE(absl::IsNotFound(core_->DeleteRoute("chat")));
  EXPECT_TRUE(core_->DeleteRoute("").ok());
  EXPECT_TRUE(core_->ListRoutes().empty());
  EXPECT_TRUE(core_->DeleteReadout("r").ok());
  EXPECT_TRUE(core_->ListReadouts().empty());
}

TEST_F(CoreTest, ARequestWhoseReadoutWasReplacedIsNotLearned) {
  Make(Options(1));
  CreateDefault();
  Request r = Next();
  ASSERT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
  // Re-create "r" under the same name while the request is live.
  ASSERT_TRUE(core_->CreateReadout("other", state_).ok());
  ASSERT_TRUE(core_->SetRoute(DefaultRoute("other")).ok());
  ASSERT_TRUE(core_->DeleteReadout("r").ok());
  ASSERT_TRUE(core_->CreateReadout("r", state_).ok());
  auto out = core_->Complete(r.id, 100, FinishReason::kStop);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->learned);
  EXPECT_EQ(out->skip_reason, "readout_deleted");
  core_->WaitIdle();
  EXPECT_EQ((*core_->GetReadout("r"))->completions_learned(), 0);
}

TEST_F(CoreTest, SplitsByStableHashAndShadowsAreScoredNeverServed) {
  Make(Options(1));
  ASSERT_TRUE(core_->CreateReadout("a", state_).ok());
  readout::ReadoutState other = RandomState(kDim, 12);
  ASSERT_TRUE(core_->CreateReadout("b", other).ok());
  ASSERT_TRUE(core_->CreateReadout("s", state_).ok());
  Route route;
  route.product_line = "chat";
  route.arms = {{"A", "a", 30, false}, {"B", "b", 70, false},
                {"S", "s", 0, true}};
  ASSERT_TRUE(core_->SetRoute(route).ok());
  std::map<std::string, int> served;
  std::vector<Request> rs;
  for (int i = 0; i < 2000; ++i) {
    rs.push_back(Next());
    auto got = core_->Predict(Score(rs.back(), "chat"), 0, nullptr);
    ASSERT_TRUE(got.ok()) << got.status();
    ++served[got->arm];
    const readout::ReadoutState& st = got->readout == "a" ? state_ : other;
    EXPECT_NEAR(got->score, ReferenceScore(st.standardizer, st.theta, rs.back().x),
                1e-4);
    // The arm is a function of the id alone.
    EXPECT_EQ(got->arm, RoutingTable::Choose(route, rs.back().id).serving->name);
  }
  EXPECT_EQ(served.count("S"), 0u);
  EXPECT_NEAR(served["A"] / 2000.0, 0.30, 0.04);
  EXPECT_NEAR(served["B"] / 2000.0, 0.70, 0.04);
  std::map<std::string, ArmStat> stats;
  for (const ArmStat& a : core_->ArmStats()) stats[a.arm] = a;
  EXPECT_EQ(stats["A"].predictions, served["A"]);
  EXPECT_EQ(stats["B"].predictions, served["B"]);
  EXPECT_EQ(stats["S"].predictions, 2000);
  EXPECT_TRUE(stats["S"].shadow);

  // Completions teach the serving readout and the shadow.
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(core_->Complete(rs[i].id, 200 + i, FinishReason::kStop).ok());
  }
  core_->WaitIdle();
  int64_t a_learned = (*core_->GetReadout("a"))->completions_learned();
  int64_t b_learned = (*core_->GetReadout("b"))->completions_learned();
  EXPECT_EQ(a_learned + b_learned, 10);
  EXPECT_EQ((*core_->GetReadout("s"))->completions_learned(), 10);
}

// ------------------------------------------------- snapshots and rollback

TEST_F(CoreTest, RollbackRestoresTheSnapshotExactlyAsANewVersion) {
  Make(Options(2));
  CreateDefault();
  auto learn = [&](int n) {
    for (int i = 0; i < n; ++i) {
      Request r = Next();
      ASSERT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
      ASSERT_TRUE(core_->Complete(r.id, 100 + 37 * i, FinishReason::kStop).ok());
    }
    core_->WaitIdle();
  };
  learn(6);
  auto ro = *core_->GetReadout("r");
  const Eigen::VectorXd at_snapshot = Theta();
  const int64_t v_snapshot = ro->current()->version;
  auto info = core_->Snapshot("r", "good");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, v_snapshot);
  EXPECT_EQ(info->completions_learned, 6);
  EXPECT_TRUE(absl::IsInvalidArgument(core_->Snapshot("r", "").status()));
  EXPECT_TRUE(absl::IsNotFound(core_->Snapshot("x", "good").status()));

  learn(6);
  ASSERT_NE(Theta(), at_snapshot);
  const int64_t before = ro->current()->version;
  auto v = core_->Rollback("r", "good");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, before + 1);
  EXPECT_EQ(ro->current()->version, before + 1);
  EXPECT_EQ(Theta(), at_snapshot);  // bit for bit
  EXPECT_EQ(ro->completions_learned(), 6);
  EXPECT_EQ(ro->Versions().back().cause, "rollback:good");
  EXPECT_TRUE(absl::IsNotFound(core_->Rollback("r", "nope").status()));

  // Learning continues from the restored state.
  learn(2);
  EXPECT_EQ(ro->completions_learned(), 8);
}

// ------------------------------------------------------------- recovery

TEST_F(CoreTest, RecoversEveryAcknowledgedCompletionFromTheStore) {
  const ::leap::testing::ScopedTempDir tmp("core_test_recover");
  const std::string dir = tmp.File("db");
  ClosedForm reference(state_);
  std::vector<std::string> learned_ids;
  int64_t last_version = 0;
  {
    auto store = storage::OpenRocksStore(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    CoreOptions o = Options(3);
    o.readout.checkpoint_every_batches = 2;
    Make(o, store->get());
    CreateDefault();
    for (int i = 0; i < 37; ++i) {
      Request r = Next();
      ASSERT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
      auto out = core_->Complete(r.id, 50 + 11 * i, FinishReason::kStop);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_TRUE(out->learned);
      reference.Learn(r.x, readout::TargetFromTokens(50 + 11 * i, kBudget));
      learned_ids.push_back(r.id);
    }
    core_->WaitIdle();
    last_version = (*core_->GetReadout("r"))->current()->version;
    // Stopped without draining or a final checkpoint: what is after the
    // last checkpoint is only in the feedback log.
    core_->Shutdown(/*drain=*/false);
    core_.reset();
  }
  auto store = storage::OpenRocksStore(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto state = (*store)->Load();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_TRUE(state->problems.empty());
  Make(Options(3), store->get());
  ASSERT_TRUE(core_->Recover(std::move(*state)).ok());
  core_->WaitIdle();
  auto ro = *core_->GetReadout("r");
  EXPECT_EQ(ro->completions_learned(), 37);
  EXPECT_LT(testing::RelErr(Theta(), reference.Theta()), 1e-6);
  // Everything was applied before the stop: recovery resumes at the same
  // version (same number, same state) and publishes nothing.
  EXPECT_EQ(ro->current()->version, last_version);
  // The route came back: predictions are served.
  Request r = Next();
  auto got = core_->Predict(Score(r), 0, nullptr);
  ASSERT_TRUE(got.ok()) << got.status();
  // A completion resent after the restart is acknowledged, not relearned.
  auto dup = core_->Complete(learned_ids[5], 123, FinishReason::kStop);
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(dup->duplicate);
  EXPECT_EQ(dup->duplicate_reason, "resent_not_live");
  core_->WaitIdle();
  EXPECT_EQ(ro->completions_learned(), 37);
  core_.reset();
  store->reset();
}

// ------------------------------------------------------------ --sync_log

// A real RocksDB store whose log syncs are counted, and fail while `fail`
// (a real store's failed sync fails every later one until it is reopened:
// this checks what the Core does with a failure, then with a success).
class SyncCountingStore : public testing::CheckpointWatchStore {
 public:
  using CheckpointWatchStore::CheckpointWatchStore;
  absl::Status SyncLog() override {
    syncs.fetch_add(1);
    if (fail.load()) return absl::DataLossError("injected: fsync failed");
    return CheckpointWatchStore::SyncLog();
  }
  std::atomic<int> syncs{0};
  std::atomic<bool> fail{false};
};

class NoTracker : public LiveTracker {
 public:
  void Track(std::shared_ptr<LiveRequest>) override {}
  void Untrack(absl::string_view) override {}
};

// The Ack of one completions message of `ids` (each 40 + i tokens, STOP),
// served as a Connect stream or a shared-memory ring serves it.
leap::v1::Ack CompleteMessage(Core* core, const std::vector<std::string>& ids) {
  leap::v1::EngineMessage in;
  in.set_seq(7);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto* c = in.mutable_completions()->add_completions();
    c->set_request_id(ids[i]);
    c->set_output_tokens(40 + static_cast<int64_t>(i));
    c->set_reason(leap::v1::FINISH_REASON_STOP);
  }
  leap::v1::Hello hello;
  hello.set_dim(kDim);
  leap::v1::SidecarMessage out;
  NoTracker tracker;
  HandleEngineMessage(core, 1, hello, DType::kFloat32, &in, &out, &tracker);
  return out.ack();
}

TEST_F(CoreTest, SyncLogSyncsOncePerMessageBeforeAnyAcknowledgement) {
  const ::leap::testing::ScopedTempDir tmp("core_test_sync");
  auto opened = storage::OpenRocksStore(tmp.File("db"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  SyncCountingStore store(*std::move(opened));
  // The Core goes before the store, also when an assertion returns early.
  const absl::Cleanup core_first = [this] { core_.reset(); };
  CoreOptions o = Options();
  o.sync_feedback_log = true;
  Make(o, &store);
  CreateDefault();
  auto predict = [&](int n) {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) {
      Request r = Next();
      EXPECT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
      ids.push_back(r.id);
    }
    return ids;
  };
  const double syncs_metric_before = metrics_.feedback_log_syncs().Value();

  // A unary completion: synced before it returns.
  std::vector<std::string> one = predict(1);
  ASSERT_TRUE(core_->Complete(one[0], 50, FinishReason::kStop).ok());
  EXPECT_EQ(store.syncs.load(), 1);

  // A message of 8 (and one unknown id, refused alone): one sync.
  std::vector<std::string> ids = predict(8);
  std::vector<std::string> with_unknown = ids;
  with_unknown.push_back("never-predicted");
  leap::v1::Ack ack = CompleteMessage(core_.get(), with_unknown);
  EXPECT_EQ(store.syncs.load(), 2);
  EXPECT_EQ(ack.accepted(), 8);
  ASSERT_EQ(ack.errors_size(), 1);
  EXPECT_EQ(ack.errors(0).request_id(), "never-predicted");
  EXPECT_EQ(ack.errors(0).code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(metrics_.feedback_log_syncs().Value() - syncs_metric_before, 2);

  // A message whose sync fails: nothing of it is acknowledged (each
  // completion UNAVAILABLE), although it is in the log and learned.
  std::vector<std::string> failing = predict(4);
  store.fail.store(true);
  ack = CompleteMessage(core_.get(), failing);
  EXPECT_EQ(store.syncs.load(), 3);
  ASSERT_EQ(ack.errors_size(), 4);
  for (const auto& e : ack.errors()) {
    EXPECT_EQ(e.code(), static_cast<int>(absl::StatusCode::kUnavailable))
        << e.request_id();
    EXPECT_NE(e.message().find("not synced"), std::string::npos) << e.message();
  }
  // The resends, still failing: not acknowledged either, nor counted as
  // acknowledged duplicates.
  ack = CompleteMessage(core_.get(), failing);
  EXPECT_EQ(ack.errors_size(), 4);
  EXPECT_EQ(metrics_.DuplicateCompletions("resent_not_live").Value(), 0);
  // A unary resend, failing the same way.
  EXPECT_EQ(core_->Complete(failing[0], 40, FinishReason::kStop).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(metrics_.DuplicateCompletions("resent_not_live").Value(), 0);
  // Once a sync succeeds the resends are acknowledged as duplicates.
  store.fail.store(false);
  ack = CompleteMessage(core_.get(), failing);
  EXPECT_EQ(ack.errors_size(), 0);
  EXPECT_EQ(ack.accepted(), 4);
  EXPECT_EQ(ack.duplicates(), 4);
  EXPECT_EQ(metrics_.DuplicateCompletions("resent_not_live").Value(), 4);
  // A message with nothing to acknowledge is not synced.
  const int before = store.syncs.load();
  ack = CompleteMessage(core_.get(), {"unknown-a", "unknown-b"});
  EXPECT_EQ(ack.errors_size(), 2);
  EXPECT_EQ(store.syncs.load(), before);
  core_->WaitIdle();
  EXPECT_EQ((*core_->GetReadout("r"))->completions_learned(), 1 + 8 + 4);
  core_.reset();
}

TEST_F(CoreTest, WithoutSyncLogNothingIsSynced) {
  const ::leap::testing::ScopedTempDir tmp("core_test_nosync");
  auto opened = storage::OpenRocksStore(tmp.File("db"));
  ASSERT_TRUE(opened.ok()) << opened.status();
  SyncCountingStore store(*std::move(opened));
  const absl::Cleanup core_first = [this] { core_.reset(); };
  Make(Options(), &store);
  CreateDefault();
  Request r = Next();
  ASSERT_TRUE(core_->Predict(Score(r), 0, nullptr).ok());
  ASSERT_TRUE(core_->Complete(r.id, 50, FinishReason::kStop).ok());
  Request q = Next();
  ASSERT_TRUE(core_->Predict(Score(q), 0, nullptr).ok());
  EXPECT_EQ(CompleteMessage(core_.get(), {q.id}).errors_size(), 0);
  EXPECT_EQ(store.syncs.load(), 0);
  core_.reset();
}

}  // namespace
}  // namespace leap::sidecar
