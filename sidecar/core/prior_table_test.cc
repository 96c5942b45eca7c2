// Unit tests of leapd's length priors (prior_table.h), in process: the
// table under concurrent learners equals one LengthPrior fed the same
// completions, the product-line cap, and CompleteWithPrior's rule (which
// completions teach the prior, under which product line and budget; a
// duplicate resent after a restart is not learned twice; bad input is
// refused with the request kept).
#include "sidecar/core/prior_table.h"

#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "sidecar/core/core.h"
#include "storage/rocksdb_store.h"
#include "tests/support/readout_fixtures.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::sidecar {
namespace {

using readout::FinishReason;

constexpr int64_t kDim = 8;

TEST(PriorTableTest, ConcurrentLearnersEqualOneSequentialModel) {
  PriorTable table;
  constexpr int kThreads = 4, kEach = 500;
  auto sample = [](int t, int i) {
    core::PriorRequest q;
    q.prompt_tokens = 1 + (t * 7919 + i * 104729) % 3000;
    q.max_tokens = i % 5 == 0 ? 64 : 0;
    return std::pair{q, (q.prompt_tokens * 3 + i) % 2000};
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        auto [q, out] = sample(t, i);
        ASSERT_TRUE(table.Learn("line", 2048, q, out).ok());
        // Readers run beside the learners.
        (void)table.Predict("line", q);
      }
    });
  }
  for (auto& th : threads) th.join();
  core::LengthPriorOptions o;
  o.budget = 2048;
  core::LengthPrior sequential(o);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kEach; ++i) {
      auto [q, out] = sample(t, i);
      ASSERT_TRUE(sequential.Learn(q, out).ok());
    }
  }
  for (int64_t p : {1, 50, 700, 2999}) {
    for (int64_t cap : {0, 64, 5000}) {
      core::PriorRequest q{p, cap};
      const PriorAnswer a = table.Predict("line", q);
      ASSERT_TRUE(a.available);
      EXPECT_EQ(a.samples, kThreads * kEach);
      const double want = *sequential.Predict(q);
      EXPECT_NEAR(a.predicted_tokens, want, 1e-9 * std::max(want, 1.0));
    }
  }
  EXPECT_FALSE(table.Predict("other", {10, 0}).available);
}

TEST(PriorTableTest, ProductLinesAreCapped) {
  PriorTable table;
  for (size_t i = 0; i < PriorTable::kMaxProductLines + 10; ++i) {
    ASSERT_TRUE(table.Learn(absl::StrCat("l", i), 2048, {10, 0}, 5).ok());
  }
  EXPECT_EQ(table.product_lines(), PriorTable::kMaxProductLines);
  absl::StatusOr<bool> over = table.Learn("one-more", 2048, {10, 0}, 5);
  ASSERT_TRUE(over.ok());
  EXPECT_FALSE(*over);
  EXPECT_TRUE(*table.Learn("l0", 2048, {10, 0}, 5));
  EXPECT_EQ(table.Predict("l0", {10, 0}).samples, 2);
  EXPECT_EQ(table.Predict(absl::StrCat("l", PriorTable::kMaxProductLines),
                          {10, 0}).samples,
            0);
}

class CompleteWithPriorTest : public ::testing::Test {
 protected:
  void Start(storage::StateStore* store) {
    CoreOptions o;
    o.cache.max_bytes = 16 << 20;
    core_ = std::make_unique<Core>(o, &metrics_, store);
    state_ = testing::RandomState(kDim, 3);
    state_.spec.max_tokens = 1000;  // the budget the prior takes
    ASSERT_TRUE(core_->CreateReadout("r", state_).ok());
    Route r;
    r.arms.push_back({"r", "r", 100.0, false});
    ASSERT_TRUE(core_->SetRoute(r).ok());
  }
  void Predict(const std::string& id, const std::string& line,
               int64_t max_tokens = 0) {
    x_.push_back(testing::RandomFeatures(state_, rng_));
    ScoreRequest s;
    s.request_id = id;
    s.product_line = line;
    s.features = absl::string_view(reinterpret_cast<const char*>(x_.back().data()),
                                   x_.back().size() * sizeof(float));
    s.request_max_tokens = max_tokens;
    ASSERT_TRUE(core_->Predict(s, 0, nullptr).ok());
  }
  absl::StatusOr<CompletionOutcome> Complete(const std::string& id,
                                             int64_t out, FinishReason reason,
                                             int64_t prompt) {
    return CompleteWithPrior(core_.get(), id, out, reason, "", false, prompt);
  }
  int64_t Samples(const std::string& line) {
    return core_->priors().Predict(line, {10, 0}).samples;
  }

  Metrics metrics_;
  readout::ReadoutState state_;
  std::unique_ptr<Core> core_;
  std::mt19937_64 rng_{1};
  std::vector<std::vector<float>> x_;
  leap::v1::ArrivalRecord pb_record_;
};

TEST_F(CompleteWithPriorTest, TeachesTheRequestsProductLineByTheRule) {
  const testing::ScopedTempDir tmp("prior_table_test");
  auto store = storage::OpenRocksStore(tmp.File("db"));
  ASSERT_TRUE(store.ok()) << store.status();
  Start(store->get());
  // Served by the default route, learned under the record's own line.
  Predict("a", "chat");
  ASSERT_TRUE(Complete("a", 40, FinishReason::kStop, 12).ok());
  EXPECT_EQ(Samples("chat"), 1);
  EXPECT_EQ(Samples(""), 0);
  // Taught with the serving readout's budget (M = 1000): an output over it
  // is learned at M, exactly as a fresh LengthPrior with budget 1000.
  Predict("long", "chat");
  ASSERT_TRUE(Complete("long", 5000, FinishReason::kLength, 30).ok());
  EXPECT_EQ(Samples("chat"), 2);
  // Not taught: cancelled, aborted, no prompt length, an unknown id.
  Predict("c", "chat");
  ASSERT_TRUE(Complete("c", 3, FinishReason::kCancelled, 12).ok());
  Predict("ab", "chat");
  ASSERT_TRUE(Complete("ab", 3, FinishReason::kAborted, 12).ok());
  Predict("np", "chat");
  ASSERT_TRUE(Complete("np", 3, FinishReason::kStop, 0).ok());
  EXPECT_EQ(Complete("nobody", 3, FinishReason::kStop, 12).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Samples("chat"), 2);
  // A negative prompt length: refused, the request stays live.
  Predict("neg", "chat");
  absl::StatusOr<CompletionOutcome> bad =
      Complete("neg", 3, FinishReason::kStop, -1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("prompt_tokens"), std::string::npos);
  ASSERT_TRUE(Complete("neg", 3, FinishReason::kStop, 7).ok());
  EXPECT_EQ(Samples("chat"), 3);
  // Resent after its ack was lost: a duplicate, not learned again.
  absl::StatusOr<CompletionOutcome> dup =
      Complete("a", 40, FinishReason::kStop, 12);
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_TRUE(dup->duplicate);
  EXPECT_EQ(Samples("chat"), 3);
  // The budget: the line's prior equals a LengthPrior(M = 1000) fed the
  // three learned completions (needs min_samples: feed 29 more alike).
  core::LengthPriorOptions o;
  o.budget = 1000;
  core::LengthPrior ref(o);
  ASSERT_TRUE(ref.Learn({12, 0}, 40).ok());
  ASSERT_TRUE(ref.Learn({30, 0}, 5000).ok());
  ASSERT_TRUE(ref.Learn({7, 0}, 3).ok());
  for (int i = 0; i < 29; ++i) {
    const std::string id = absl::StrCat("m", i);
    Predict(id, "chat");
    ASSERT_TRUE(Complete(id, 10 * i + 1, FinishReason::kStop, 5 + i).ok());
    ASSERT_TRUE(ref.Learn({5 + i, 0}, 10 * i + 1).ok());
  }
  const PriorAnswer a = core_->priors().Predict("chat", {20, 0});
  ASSERT_TRUE(a.available);
  EXPECT_NEAR(a.predicted_tokens, *ref.Predict({20, 0}), 1e-9);
  EXPECT_EQ(metrics_.prior_learned().Value(), 32);
  EXPECT_EQ(metrics_.prior_product_lines().Value(), 1);
  pb_record_.set_request_id("q");
  pb_record_.set_product_line("chat");
  pb_record_.set_prompt_tokens(20);
  ASSERT_TRUE(QueryPrior(*core_, pb_record_).ok());
  pb_record_.set_product_line("none");
  ASSERT_TRUE(QueryPrior(*core_, pb_record_).ok());
  EXPECT_EQ(metrics_.prior_answered().Value(), 1);
  EXPECT_EQ(metrics_.prior_unavailable().Value(), 1);
  core_->Shutdown(/*drain=*/true);
  core_.reset();
}

}  // namespace
}  // namespace leap::sidecar
