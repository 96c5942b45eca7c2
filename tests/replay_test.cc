// `leapctl replay`: the metrics and the engine model's arithmetic on
// hand-built traces (expected values computed by hand in the comments), the
// waiting-cap bound of the scheduler on an overloaded replay, the three
// trace parsers with malformed input, the learned-predictor copula, and the
// LEAP path through a real leapd: a readout that predicts exactly gives the
// oracle's decode order, and a small replay end to end through the CLI.
#include "replay/replay.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "readout/stats.h"
#include "replay/engine_model.h"
#include "replay/leap_driver.h"
#include "replay/trace.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace leap::replay {
namespace {

// The `leapctl replay` command line (tools/leapctl), run as a process: its
// exit code, stdout into `out`, stderr into `err`.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
int RunLeapctl(std::vector<std::string> args, std::ostream& out,
               std::ostream& err) {
  std::vector<std::string> argv;
  argv.reserve(args.size() + 1);
  argv.emplace_back(LEAPCTL_PATH);
  for (std::string& a : args) argv.push_back(std::move(a));
  absl::StatusOr<client::ProcessResult> r = client::RunProcess(argv);
  if (!r.ok()) {
    err << r.status();
    return -1;
  }
  out << r->out;
  err << r->err;
  return WIFEXITED(r->status) ? WEXITSTATUS(r->status) : -1;
}

// ---- metrics ----------------------------------------------------------------

TEST(ReplayMetricsTest, PercentileInterpolatesBetweenOrderStatistics) {
  const std::vector<double> x = {10, 1, 9, 2, 8, 3, 7, 4, 6, 5};
  // Sorted 1..10; rank = p/100 * 9.
  EXPECT_DOUBLE_EQ(Percentile(x, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(x, 50), 5.5);   // rank 4.5: 5 + 0.5
  EXPECT_DOUBLE_EQ(Percentile(x, 90), 9.1);   // rank 8.1: 9 + 0.1
  EXPECT_DOUBLE_EQ(Percentile(x, 95), 9.55);  // rank 8.55: 9 + 0.55
  EXPECT_DOUBLE_EQ(Percentile(x, 100), 10);
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7);
  EXPECT_TRUE(std::isnan(Percentile({}, 50)));
}

// Against a brute force: Percentile of every window, by hand-made windows.
TEST(ReplayMetricsTest, WorstWindowPercentileMatchesEveryWindow) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(0, 100);
  // 256: the Fenwick descent's top step is n itself; 100 with 99: one slide.
  for (const size_t n : {1u, 7u, 50u, 100u, 256u, 333u, 1000u}) {
    std::vector<double> x(n);
    for (double& v : x) v = u(rng);
    // Ties: every fourth value repeats the one before.
    for (size_t i = 3; i < n; i += 4) x[i] = x[i - 1];
    for (const size_t w : {1u, 2u, 10u, 99u, 100u, 255u, 256u, 2000u}) {
      for (const double p : {0.0, 50.0, 95.0, 99.0, 100.0}) {
        double want = -1;
        if (n <= w) {
          want = Percentile(x, p);
        } else {
          for (size_t b = 0; b + w <= n; ++b) {
            const std::vector<double> window(x.begin() + b, x.begin() + b + w);
            want = std::max(want, Percentile(window, p));
          }
        }
        EXPECT_DOUBLE_EQ(WorstWindowPercentile(x, w, p), want)
            << "n " << n << " window " << w << " p " << p;
      }
    }
  }
  // A burst: the whole set's P99 hides it, the worst window does not.
  std::vector<double> burst(1000, 1.0);
  for (size_t i = 500; i < 505; ++i) burst[i] = 50;  // 0.5% of all, 5% of 100
  EXPECT_DOUBLE_EQ(Percentile(burst, 99), 1);
  EXPECT_DOUBLE_EQ(WorstWindowPercentile(burst, 100, 99), 50);
  std::vector<double> spread(1000, 1.0);
  for (size_t i = 0; i < 1000; i += 200) spread[i] = 50;  // 0.5%, apart
  EXPECT_DOUBLE_EQ(Percentile(spread, 99), 1);
  // Windows of 100 hold at most one of them: rank 98.01 of 99 ones and a 50.
  EXPECT_NEAR(WorstWindowPercentile(spread, 100, 99), 1 + 0.01 * 49, 1e-9);
  EXPECT_TRUE(std::isnan(WorstWindowPercentile({}, 10, 99)));
  EXPECT_TRUE(std::isnan(WorstWindowPercentile(burst, 0, 99)));
}

RequestResult Result(int64_t id, double arrival, double first, double done,
                     int64_t out, double predicted, int segment = 0) {
  RequestResult r;
  r.id = id;
  r.arrival_s = arrival;
  r.first_token_s = first;
  r.completion_s = done;
  r.output_tokens = out;
  r.predicted_tokens = predicted;
  r.segment = segment;
  return r;
}

// window_p99_latency takes its windows in arrival order, whatever the order
// of the results: 150 slow requests arriving together are 0.75% of 20,000
// (the P99 does not see them) but 1.5% of the kP99Window around them.
TEST(ReplayMetricsTest, WindowP99FollowsArrivalOrder) {
  std::vector<RequestResult> rs;
  for (int64_t i = 0; i < 20000; ++i) {
    const double arrival = static_cast<double>(i);
    const double latency = (i >= 5000 && i < 5150) ? 90 : 1;
    rs.push_back(Result(i, arrival, arrival + 0.5, arrival + latency, 10,
                        std::nan("")));
  }
  std::mt19937_64 rng(3);
  std::shuffle(rs.begin(), rs.end(), rng);
  const Metrics m = ComputeMetrics(rs);
  EXPECT_DOUBLE_EQ(m.p99_latency, 1);
  EXPECT_DOUBLE_EQ(m.window_p99_latency, 90);
}

TEST(ReplayMetricsTest, HandBuiltResults) {
  const double nan = std::nan("");
  const std::vector<RequestResult> rs = {
      Result(0, 0, 1, 5, 5, 4),         // latency 5, PTL 1
      Result(1, 1, 2, 7, 2, 3),         // latency 6, PTL 3
      Result(2, 2, 4, 10, 2000, 1000),  // latency 8, PTL 0.004, long
      Result(3, 3, 4, 4, 1, nan, 1),    // latency 1, PTL 1, no prediction
  };
  const Metrics m = ComputeMetrics(rs);
  EXPECT_EQ(m.n, 4);
  EXPECT_DOUBLE_EQ(m.mean_ptl, (1 + 3 + 0.004 + 1) / 4.0);
  EXPECT_DOUBLE_EQ(m.mean_latency, 5);
  // Latencies sorted 1, 5, 6, 8; rank = p/100 * 3.
  EXPECT_DOUBLE_EQ(m.p90_latency, 7.4);   // rank 2.7: 6 + 0.7 * 2
  EXPECT_DOUBLE_EQ(m.p95_latency, 7.7);   // rank 2.85
  EXPECT_DOUBLE_EQ(m.p99_latency, 7.94);  // rank 2.97
  // Fewer requests than kP99Window: the one window is all of them.
  EXPECT_DOUBLE_EQ(m.window_p99_latency, 7.94);
  EXPECT_DOUBLE_EQ(m.mean_ttft, (1 + 1 + 2 + 1) / 4.0);
  // 2008 output tokens from the first arrival (0) to the last completion (10).
  EXPECT_DOUBLE_EQ(m.throughput, 200.8);
  ASSERT_TRUE(m.long_p95_latency.has_value());
  EXPECT_DOUBLE_EQ(*m.long_p95_latency, 8);
  EXPECT_EQ(m.n_long, 1);
  // Predictions 4, 3, 1000 rank like the lengths 5, 2, 2000.
  EXPECT_DOUBLE_EQ(m.spearman, 1.0);

  const Metrics late =
      ComputeMetrics(rs, [](const RequestResult& r) { return r.segment == 1; });
  EXPECT_EQ(late.n, 1);
  EXPECT_DOUBLE_EQ(late.mean_ptl, 1);
  EXPECT_FALSE(late.long_p95_latency.has_value());
  EXPECT_TRUE(std::isnan(late.spearman));
}

// ---- the engine model
// ---------------------------------------------------------

SimOptions OneSlot() {
  SimOptions o;
  o.engine.resident = 3;
  o.engine.slots = 1;
  o.engine.step_base_ms = 1000;
  o.engine.step_per_seq_ms = 0;
  o.engine.prefill_per_token_ms = 0;
  o.scheduler.slots = 1;
  o.record_order = true;
  return o;
}

std::vector<SimRequest> ThreeAtZero() {
  // A (id 0) 5 tokens, B 2, C 3: all arrive at 0 with empty prompts.
  return {{0, 0, 0, 5, 0}, {1, 0, 0, 2, 0}, {2, 0, 0, 3, 0}};
}

TEST(ReplaySimTest, FcfsAndOracleOnAHandBuiltTrace) {
  // Step 1 [0, 1] prefills all three (first tokens at 1); each later step
  // takes 1 s and decodes one request; a request of L tokens needs L - 1.
  // FCFS: A in steps 2-5 (done 5), B step 6 (6), C steps 7-8 (8).
  SimOptions fcfs = OneSlot();
  fcfs.scheduler.waiting_cap = 0;
  fcfs.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
  NoPredictor none;
  absl::StatusOr<SimResult> f = Simulate(ThreeAtZero(), fcfs, none);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_DOUBLE_EQ(f->requests[0].completion_s, 5);
  EXPECT_DOUBLE_EQ(f->requests[1].completion_s, 6);
  EXPECT_DOUBLE_EQ(f->requests[2].completion_s, 8);
  for (const RequestResult& r : f->requests)
    EXPECT_DOUBLE_EQ(r.first_token_s, 1);
  // PTL 5/5, 6/2, 8/3.
  EXPECT_NEAR(ComputeMetrics(f->requests).mean_ptl, (1 + 3 + 8.0 / 3) / 3,
              1e-12);

  // Oracle: B (remaining 2) in step 2 (done 2), C in steps 3-4 (4), A 5-8.
  TablePredictor oracle({5, 2, 3}, 0, false, 0);
  absl::StatusOr<SimResult> o = Simulate(ThreeAtZero(), OneSlot(), oracle);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_DOUBLE_EQ(o->requests[0].completion_s, 8);
  EXPECT_DOUBLE_EQ(o->requests[1].completion_s, 2);
  EXPECT_DOUBLE_EQ(o->requests[2].completion_s, 4);
  EXPECT_NEAR(ComputeMetrics(o->requests).mean_ptl, (8.0 / 5 + 1 + 4.0 / 3) / 3,
              1e-12);
  const std::vector<std::vector<int64_t>> order = {{},  {1}, {2}, {2},
                                                   {0}, {0}, {0}, {0}};
  EXPECT_EQ(o->decode_order, order);
  EXPECT_EQ(o->late_predictions, 0);

  // Capacity: 3 requests in 8 s under FCFS.
  absl::StatusOr<double> cap = MeasureCapacity(ThreeAtZero(), OneSlot().engine);
  ASSERT_TRUE(cap.ok());
  EXPECT_DOUBLE_EQ(*cap, 3.0 / 8);
}

TEST(ReplaySimTest, StepTimeModelArithmetic) {
  // base 10 ms, 5 ms per decoded request, 0.5 ms per prompt token.
  SimOptions o;
  o.engine.resident = 4;
  o.engine.slots = 2;
  o.engine.step_base_ms = 10;
  o.engine.step_per_seq_ms = 5;
  o.engine.prefill_per_token_ms = 0.5;
  o.scheduler.slots = 2;
  // R0: t=0, prompt 100, 3 tokens. R1: t=0.07, prompt 20, 2 tokens.
  const std::vector<SimRequest> reqs = {{0, 0, 100, 3, 0}, {1, 0.07, 20, 2, 0}};
  NoPredictor none;
  absl::StatusOr<SimResult> r = Simulate(reqs, o, none);
  ASSERT_TRUE(r.ok()) << r.status();
  // Step 1 [0, 0.060]: prefill R0 (10 + 50 ms).
  EXPECT_NEAR(r->requests[0].first_token_s, 0.060, 1e-12);
  // Step 2 [0.060, 0.075]: decode R0 (10 + 5). Step 3 [0.075, 0.100]:
  // decode R0 and prefill R1, arrived at 0.07 (10 + 5 + 10): R0 done.
  EXPECT_NEAR(r->requests[0].completion_s, 0.100, 1e-12);
  EXPECT_NEAR(r->requests[1].first_token_s, 0.100, 1e-12);
  // Step 4 [0.100, 0.115]: decode R1, done.
  EXPECT_NEAR(r->requests[1].completion_s, 0.115, 1e-12);
  EXPECT_EQ(r->steps, 4);
  // A learned predictor's GPU cost lands on the prefill step: +2 ms each.
  TablePredictor gpu({3, 2}, 0, true, 2.0);
  absl::StatusOr<SimResult> g = Simulate(reqs, o, gpu);
  ASSERT_TRUE(g.ok());
  EXPECT_NEAR(g->requests[0].first_token_s, 0.062, 1e-12);
  EXPECT_NEAR(g->requests[1].completion_s, 0.119, 1e-12);
}

TEST(ReplaySimTest, MaxPrefillTokensSplitsAdmission) {
  SimOptions o = OneSlot();
  o.engine.max_prefill_tokens = 100;
  o.engine.prefill_per_token_ms = 1;
  // Two prompts of 60 tokens: one prefill per step (60 ms each); a prompt
  // over the limit still goes alone (150 ms).
  const std::vector<SimRequest> reqs = {
      {0, 0, 60, 1, 0}, {1, 0, 60, 1, 0}, {2, 0, 150, 1, 0}};
  NoPredictor none;
  absl::StatusOr<SimResult> r = Simulate(reqs, o, none);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->requests[0].completion_s, 1.060, 1e-12);
  EXPECT_NEAR(r->requests[1].completion_s, 2.120, 1e-12);
  EXPECT_NEAR(r->requests[2].completion_s, 3.270, 1e-12);
}

// An overloaded replay: many requests, few slots, continuous arrivals.
std::vector<SimRequest> Overloaded(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> len(std::log(40), 1.0);
  std::vector<SimRequest> reqs;
  for (int i = 0; i < n; ++i) {
    const int64_t l = std::clamp<int64_t>(std::llround(len(rng)), 2, 2000);
    reqs.push_back({i, 0.004 * i, 50, l, 0});
  }
  reqs[3].output_tokens = 2000;  // one very long request early on
  return reqs;
}

SimOptions Small(int cap) {
  SimOptions o;
  o.engine.resident = 24;
  o.engine.slots = 4;
  o.engine.step_base_ms = 10;
  o.engine.step_per_seq_ms = 0;
  o.engine.prefill_per_token_ms = 0.01;
  o.scheduler.slots = 4;
  o.scheduler.waiting_cap = cap;
  return o;
}

std::vector<double> Lengths(const std::vector<SimRequest>& reqs) {
  std::vector<double> v;
  for (const SimRequest& r : reqs)
    v.push_back(static_cast<double>(r.output_tokens));
  return v;
}

TEST(ReplaySimTest, WaitingCapBoundsEveryWait) {
  const std::vector<SimRequest> reqs = Overloaded(1500, 5);
  const int cap = 20;
  // The scheduler's proven bound: cap + floor((live - 1) / slots), with
  // live at most the largest number of requests it held.
  for (const bool learned : {false, true}) {
    std::vector<double> pred = Lengths(reqs);
    if (learned) {
      std::vector<int64_t> l;
      for (const SimRequest& r : reqs) l.push_back(r.output_tokens);
      pred = CopulaPredictions(l, 0.3, 9);
    }
    TablePredictor with_cap(pred, 0, false, 0);
    absl::StatusOr<SimResult> r = Simulate(reqs, Small(cap), with_cap);
    ASSERT_TRUE(r.ok()) << r.status();
    const int64_t bound = cap + (r->max_live - 1) / 4;
    int64_t worst = 0;
    for (const RequestResult& q : r->requests) {
      worst = std::max(worst, q.max_wait_steps);
      EXPECT_LE(q.max_wait_steps, bound) << "request " << q.id;
    }
    EXPECT_EQ(worst, r->counters.max_steps_waited);
    EXPECT_GT(r->counters.cap_promotions, 0);

    // Without the cap the long request starves far past that bound.
    TablePredictor no_cap(pred, 0, false, 0);
    absl::StatusOr<SimResult> u = Simulate(reqs, Small(0), no_cap);
    ASSERT_TRUE(u.ok());
    EXPECT_GT(u->requests[3].max_wait_steps, 10 * bound)
        << (learned ? "learned" : "oracle");
  }
}

TEST(ReplaySimTest, PredictionLatencyIsChargedOnTheTimeline) {
  // Prefill of 1000 tokens at 0.1 ms = 100 ms per step; the capture point is
  // 30/36 into it, so a prediction with latency under 100 * 6/36 = 16.7 ms
  // is known at the next step, and a slower one is not.
  std::vector<SimRequest> reqs = Overloaded(300, 7);
  for (SimRequest& r : reqs) r.prompt_tokens = 1000;
  SimOptions o = Small(20);
  o.engine.prefill_per_token_ms = 0.1;
  o.record_order = true;
  const std::vector<double> truth = Lengths(reqs);
  TablePredictor oracle(truth, 0, false, 0);
  TablePredictor fast(truth, 0.016, false, 0);
  TablePredictor slow(truth, 0.017, false, 0);
  absl::StatusOr<SimResult> a = Simulate(reqs, o, oracle);
  absl::StatusOr<SimResult> b = Simulate(reqs, o, fast);
  absl::StatusOr<SimResult> c = Simulate(reqs, o, slow);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->decode_order, b->decode_order);
  EXPECT_EQ(b->late_predictions, 0);
  EXPECT_GT(c->late_predictions, 0);
  EXPECT_NE(a->decode_order, c->decode_order);
}

// The tail bound at engine level: on the overloaded replay the countdown
// starves the long request; +bounded serves it within a small multiple of
// what FCFS gives it, and keeps most of the mean-latency gain.
TEST(ReplaySimTest, BoundedPolicyCutsTheTail) {
  const std::vector<SimRequest> reqs = Overloaded(1500, 5);
  const std::vector<double> truth = Lengths(reqs);
  const auto run = [&](shim::SchedulingPolicy policy, bool fcfs) {
    SimOptions o = Small(0);
    o.scheduler.policy = policy;
    o.scheduler.max_slowdown = 1.5;
    if (fcfs) o.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
    NoPredictor none;
    TablePredictor oracle(truth, 0, false, 0);
    absl::StatusOr<SimResult> r =
        Simulate(reqs, o, fcfs ? static_cast<Predictor&>(none) : oracle);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  };
  const SimResult f = run(shim::SchedulingPolicy::kCountdown, true);
  const SimResult c = run(shim::SchedulingPolicy::kCountdown, false);
  const SimResult b = run(shim::SchedulingPolicy::kBounded, false);
  const auto latency = [](const SimResult& r, int64_t id) {
    return r.requests[id].completion_s - r.requests[id].arrival_s;
  };
  const Metrics fm = ComputeMetrics(f.requests), cm = ComputeMetrics(c.requests),
                bm = ComputeMetrics(b.requests);
  std::printf(
      "mean PTL fcfs %.4f countdown %.4f bounded %.4f; long request's "
      "latency %.1f %.1f %.1f s; urgent selections %lld\n",
      fm.mean_ptl, cm.mean_ptl, bm.mean_ptl, latency(f, 3), latency(c, 3),
      latency(b, 3), static_cast<long long>(b.counters.urgent_selections));
  // The countdown starves the 2,000-token request; the bound serves it
  // within S = 1.5 of its FCFS latency (steps are ~10 ms here, so seconds
  // follow steps up to prefill time), and most of the mean gain stays.
  EXPECT_GT(latency(c, 3), 2 * latency(f, 3));
  EXPECT_LT(latency(b, 3), 1.5 * 1.05 * latency(f, 3));
  EXPECT_GT(b.counters.urgent_selections, 0);
  EXPECT_LT(bm.mean_ptl, fm.mean_ptl);
  EXPECT_LT(cm.mean_ptl, bm.mean_ptl);
}

// A prior from a table (by request id), for length-aware admission.
class TablePrior : public AdmissionPrior {
 public:
  explicit TablePrior(std::vector<double> values) : values_(std::move(values)) {}
  std::optional<double> At(const SimRequest& r) override {
    return values_[static_cast<size_t>(r.id)];
  }
  absl::Status Learn(const SimRequest&) override { return absl::OkStatus(); }

 private:
  std::vector<double> values_;
};

// Bursts of 30 requests every 6 s (lengths log-normal around 40, two very
// long ones): the admission queue fills in each burst and drains between.
std::vector<SimRequest> Bursts(int bursts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> len(std::log(40), 1.0);
  std::vector<SimRequest> reqs;
  for (int b = 0; b < bursts; ++b) {
    for (int i = 0; i < 30; ++i) {
      const int64_t id = static_cast<int64_t>(reqs.size());
      const int64_t l = std::clamp<int64_t>(std::llround(len(rng)), 2, 1500);
      reqs.push_back({id, 6.0 * b + 0.001 * i, 50, l, 0});
    }
  }
  reqs[5].output_tokens = 1500;
  reqs[200].output_tokens = 1500;
  return reqs;
}

// Length-aware admission under the tail bound, end to end through the slots
// engine: the admission queue is a bounded scheduler, each admitted request
// carries its deadline into decode (one deadline from arrival), and with
// exact priors and predictions every request finishes within a few percent
// of its deadline, counted in engine steps from its arrival (the EDF
// overflow on k slots; docs/SCHEDULING.md), while the countdown with the
// same prior lets the worst request wait much longer. Exact estimates teach
// the calibration nothing (every error 0): the run is the same with it on or
// off. A weak prior fitted on sqrt(length) misses deadlines placed on it:
// the bound is on estimated work.
TEST(ReplaySimTest, BoundedAdmissionHoldsTheDeadlineFromArrival) {
  const std::vector<SimRequest> reqs = Bursts(12, 21);
  const std::vector<double> truth = Lengths(reqs);
  // The weak prior knows only whether a request is short (< 40 tokens) and
  // predicts the square of that class's mean sqrt(length).
  double sum_sqrt[2] = {0, 0}, count[2] = {0, 0};
  for (double l : truth) {
    sum_sqrt[l >= 40] += std::sqrt(l);
    ++count[l >= 40];
  }
  std::vector<double> weak;
  for (double l : truth) {
    const double m = sum_sqrt[l >= 40] / count[l >= 40];
    weak.push_back(m * m);
  }
  const auto run = [&](shim::SchedulingPolicy policy,
                       const std::vector<double>& prior_values, int window,
                       shim::BoundCalibration calibration =
                           shim::BoundCalibration::kAdditive) {
    SimOptions o = Small(0);
    o.engine.resident = 8;
    o.scheduler.policy = policy;
    o.scheduler.max_slowdown = 2;
    o.scheduler.tail_window = 0;
    o.scheduler.calibration_window = window;
    o.scheduler.calibration = calibration;
    o.record_order = true;
    TablePredictor oracle(truth, 0, false, 0);
    TablePrior prior(prior_values);
    o.prior = &prior;
    absl::StatusOr<SimResult> r = Simulate(reqs, o, oracle);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  };
  // Worst (latency in steps from arrival) / (deadline - origin) over the
  // requests that reached decode, the worst latency in seconds, and how
  // many requests had a deadline.
  const auto worst = [](const SimResult& r) {
    double ratio = 0, seconds = 0;
    int checked = 0;
    for (const RequestResult& q : r.requests) {
      seconds = std::max(seconds, q.completion_s - q.arrival_s);
      if (std::isnan(q.deadline_step)) continue;
      ++checked;
      ratio = std::max(ratio, (q.completion_step - q.deadline_origin_step) /
                                  (q.deadline_step - q.deadline_origin_step));
    }
    return std::make_tuple(ratio, seconds, checked);
  };
  const SimResult countdown =
      run(shim::SchedulingPolicy::kCountdown, truth, 1000);
  const SimResult exact = run(shim::SchedulingPolicy::kBounded, truth, 1000);
  const SimResult uncalibrated =
      run(shim::SchedulingPolicy::kBounded, truth, 0);
  const SimResult weak_run = run(shim::SchedulingPolicy::kBounded, weak, 1000);
  const SimResult exact_ratio = run(shim::SchedulingPolicy::kBounded, truth,
                                    1000, shim::BoundCalibration::kRatio);
  const SimResult weak_ratio = run(shim::SchedulingPolicy::kBounded, weak,
                                   1000, shim::BoundCalibration::kRatio);
  const auto [c_ratio, c_worst, c_checked] = worst(countdown);
  const auto [e_ratio, e_worst, e_checked] = worst(exact);
  const auto [w_ratio, w_worst, w_checked] = worst(weak_run);
  const auto [wr_ratio, wr_worst, wr_checked] = worst(weak_ratio);
  std::printf(
      "worst latency / deadline: exact %.3f, weak prior %.3f (ratio "
      "correction %.3f); worst latency (s): countdown %.1f, bounded %.1f, "
      "weak prior %.1f (ratio %.1f); mean PTL weak prior %.4f, ratio %.4f; "
      "urgent selections %lld\n",
      e_ratio, w_ratio, wr_ratio, c_worst, e_worst, w_worst, wr_worst,
      ComputeMetrics(weak_run.requests).mean_ptl,
      ComputeMetrics(weak_ratio.requests).mean_ptl,
      static_cast<long long>(exact.counters.urgent_selections));
  EXPECT_EQ(c_checked, 0);  // no deadlines under the countdown
  EXPECT_GT(e_checked, 300);
  EXPECT_EQ(w_checked, e_checked);
  EXPECT_GT(exact.counters.urgent_selections, 0);
  EXPECT_LE(e_ratio, 1.1);
  EXPECT_GT(c_worst, 1.2 * e_worst);
  EXPECT_GT(w_ratio, 1.1);
  EXPECT_EQ(exact.decode_order, uncalibrated.decode_order);
  // Exact estimates teach the ratio correction a ratio of 1 too.
  EXPECT_EQ(exact.decode_order, exact_ratio.decode_order);
  EXPECT_EQ(wr_checked, e_checked);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(exact.requests[i].completion_s,
              uncalibrated.requests[i].completion_s);
    EXPECT_EQ(exact.requests[i].deadline_step,
              uncalibrated.requests[i].deadline_step);
    EXPECT_EQ(exact.requests[i].deadline_step,
              exact_ratio.requests[i].deadline_step);
  }
}

// The latency target end to end through the slots engine: the same bursts,
// exact priors and predictions, admission ordered by a bounded scheduler
// that carries each deadline (arrival + T seconds, T = 1.3 x FCFS's P99 on
// this traffic) into decode, both stages on the engine's clock
// (SetTime). Every request finishes within a few percent of its deadline,
// in seconds from its arrival (or of its own service time, for the two
// 1,500-token requests, whose 15 s of decode exceed the target), where the
// countdown lets its worst request wait far longer; the gain over FCFS's
// mean PTL stays. A tail budget of 5% gives up some deadlines of long
// requests, at most floor(0.05 x 360) = 18 in both stages together (decode
// counts the ones carried in given up).
TEST(ReplaySimTest, LatencyTargetHoldsInSecondsFromArrival) {
  const std::vector<SimRequest> reqs = Bursts(12, 21);
  const std::vector<double> truth = Lengths(reqs);
  const auto run = [&](shim::SchedulingPolicy policy, bool fcfs,
                       double target_s, double budget) {
    SimOptions o = Small(0);
    o.engine.resident = 8;
    o.scheduler.policy = policy;
    o.scheduler.latency_target_s = target_s;
    o.scheduler.tail_budget = budget;
    // Only the budget gives deadlines up here (none against credits), so
    // `held` gives up none and `budget` at most its share.
    o.scheduler.give_up_reserve = 1;
    NoPredictor none;
    TablePredictor oracle(truth, 0, false, 0);
    TablePrior prior(truth);
    if (fcfs) {
      o.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
    } else {
      o.prior = &prior;
    }
    absl::StatusOr<SimResult> r =
        Simulate(reqs, o, fcfs ? static_cast<Predictor&>(none) : oracle);
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  };
  const SimResult fcfs =
      run(shim::SchedulingPolicy::kCountdown, true, 0, 0);
  const Metrics fm = ComputeMetrics(fcfs.requests);
  const double target = 1.3 * fm.p99_latency;
  const SimResult countdown =
      run(shim::SchedulingPolicy::kCountdown, false, 0, 0);
  const SimResult held =
      run(shim::SchedulingPolicy::kBounded, false, target, 0);
  const SimResult budget =
      run(shim::SchedulingPolicy::kBounded, false, target, 0.05);
  double worst_ratio = 0, countdown_worst = 0, held_worst = 0;
  int checked = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const RequestResult& q = held.requests[i];
    countdown_worst =
        std::max(countdown_worst, countdown.requests[i].completion_s -
                                      countdown.requests[i].arrival_s);
    held_worst = std::max(held_worst, q.completion_s - q.arrival_s);
    if (std::isnan(q.deadline_step)) continue;
    ++checked;
    // Recorded on the deadlines' clock, seconds here: the origin is the
    // arrival itself (carried as an age: rounding only) and the deadline
    // the origin plus the target.
    EXPECT_NEAR(q.deadline_origin_step, q.arrival_s, 1e-9) << i;
    EXPECT_NEAR(q.deadline_step, q.arrival_s + target, 1e-9) << i;
    EXPECT_DOUBLE_EQ(q.completion_step, q.completion_s) << i;
    // A request whose own decode (10 ms a token here) takes longer than the
    // target cannot meet it: it is held to its service time instead.
    const double service = 0.01 * static_cast<double>(q.output_tokens);
    worst_ratio = std::max(worst_ratio, (q.completion_s - q.arrival_s) /
                                            std::max(target, service));
  }
  const Metrics hm = ComputeMetrics(held.requests),
                cm = ComputeMetrics(countdown.requests);
  std::printf(
      "target %.2f s: worst latency / max(target, service) %.3f; worst "
      "latency (s): "
      "countdown %.1f, target %.1f; mean PTL fcfs %.4f countdown %.4f target "
      "%.4f; urgent selections %lld; deadlines given up with the budget "
      "%lld\n",
      target, worst_ratio, countdown_worst, held_worst, fm.mean_ptl,
      cm.mean_ptl, hm.mean_ptl,
      static_cast<long long>(held.counters.urgent_selections),
      static_cast<long long>(budget.counters.deadlines_given_up +
                             budget.queue_deadlines_given_up));
  EXPECT_GT(checked, 300);
  EXPECT_GT(held.counters.urgent_selections, 0);
  EXPECT_LE(worst_ratio, 1.05);
  EXPECT_GT(countdown_worst, 1.2 * target);
  EXPECT_LT(hm.mean_ptl, fm.mean_ptl);
  EXPECT_EQ(held.counters.deadlines_given_up +
                held.queue_deadlines_given_up,
            0);
  // Every request that reached decode reported its latency there once
  // (target_quantile's controller).
  EXPECT_EQ(held.counters.latencies_observed, checked);
  const int64_t given_up =
      budget.counters.deadlines_given_up + budget.queue_deadlines_given_up;
  EXPECT_GT(given_up, 0);
  EXPECT_LE(given_up, 18);
}

// vLLM-shaped engine: a hand-computed request, then invariants under KV
// pressure (every request finishes, preemptions happen and are recomputed).
TEST(ReplayVllmTest, HandComputedChunkedPrefillAndDecode) {
  SimOptions o;
  o.engine.kind = EngineKind::kVllm;
  o.engine.max_num_batched_tokens = 64;
  o.engine.step_base_ms = 12;
  o.engine.step_per_seq_ms = 0.12;
  o.engine.prefill_per_token_ms = 0.05;
  std::vector<SimRequest> reqs = {{0, 0.0, 100, 5, 0}};
  NoPredictor none;
  absl::StatusOr<SimResult> r = Simulate(reqs, o, none);
  ASSERT_TRUE(r.ok()) << r.status();
  // Prefill in chunks of 64 and 36 (first token), then 4 decode steps.
  EXPECT_EQ(r->steps, 6);
  EXPECT_NEAR(r->requests[0].first_token_s, 0.0152 + 0.0138, 1e-12);
  EXPECT_NEAR(r->requests[0].completion_s, 0.0152 + 0.0138 + 4 * 0.01212,
              1e-12);
  EXPECT_EQ(r->preemptions, 0);
}

TEST(ReplayVllmTest, KvPressurePreemptsAndEveryRequestFinishes) {
  std::vector<SimRequest> reqs = Overloaded(600, 11);
  SimOptions o;
  o.engine.kind = EngineKind::kVllm;
  o.engine.max_num_seqs = 32;
  o.engine.max_num_batched_tokens = 512;
  o.engine.block_size = 16;
  o.engine.kv_blocks = 300;  // 4,800 tokens: less than 32 requests need
  o.scheduler.waiting_cap = 0;
  // Both victim rules: the latest admitted (vLLM's FCFS, the default) and
  // the lowest-ranked (its priority policy given the rank).
  for (const bool latest : {true, false})
  for (const bool oracle : {false, true}) {
    SCOPED_TRACE(latest ? "preempt latest" : "preempt rank");
    const std::vector<double> truth = Lengths(reqs);
    NoPredictor none;
    TablePredictor table(truth, 0, false, 0);
    SimOptions so = o;
    so.engine.preempt_latest_admitted = latest;
    if (!oracle) so.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
    absl::StatusOr<SimResult> r =
        Simulate(reqs, so, oracle ? static_cast<Predictor&>(table) : none);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GT(r->preemptions, 0);
    EXPECT_GT(r->recomputed_tokens, 0);
    for (const RequestResult& q : r->requests) {
      EXPECT_GT(q.completion_s, 0) << q.id;
      EXPECT_GE(q.first_token_s, q.arrival_s) << q.id;
      // output - 1 decode steps of at least step_base_ms each.
      EXPECT_GE(q.completion_s - q.first_token_s + 1e-9,
                static_cast<double>(q.output_tokens - 1) * 0.012)
          << q.id;
    }
  }
  // A request larger than the whole cache is refused.
  std::vector<SimRequest> big = {{0, 0.0, 100000, 5, 0}};
  NoPredictor none;
  EXPECT_EQ(Simulate(big, o, none).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- learned-predictor copula and policies
// ---------------------------------------

TEST(ReplayLearnedTest, CopulaHitsTheRequestedSpearman) {
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> len(std::log(300), 0.9);
  std::vector<int64_t> l;
  std::vector<double> truth;
  for (int i = 0; i < 6000; ++i) {
    l.push_back(std::clamp<int64_t>(std::llround(len(rng)), 1, 2048));
    truth.push_back(static_cast<double>(l.back()));
  }
  for (double rho : {0.3, 0.6, 0.9}) {
    const std::vector<double> p = CopulaPredictions(l, rho, 11);
    EXPECT_NEAR(readout::Spearman(p, truth), rho, 0.03) << rho;
    // Same marginal: every prediction is one of the true lengths, and the
    // medians agree.
    EXPECT_NEAR(Percentile(p, 50), Percentile(truth, 50),
                0.1 * Percentile(truth, 50));
  }
}

TEST(ReplayPolicyTest, ParsesNamesPresetsAndLearnedSpecs) {
  absl::StatusOr<std::vector<PolicySpec>> p =
      ParsePolicies("fcfs, oracle,learned:rho=0.6,cost=2ms,shift_rho=0.4,ltr");
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->size(), 4u);
  EXPECT_EQ((*p)[2].name, "learned:rho=0.6,cost=2ms,shift_rho=0.4");
  EXPECT_DOUBLE_EQ((*p)[2].cost_ms, 2);
  EXPECT_DOUBLE_EQ(*(*p)[2].shift_rho, 0.4);
  EXPECT_EQ((*p)[3].name, "ltr");
  EXPECT_EQ((*p)[3].kind, PolicySpec::Kind::kLearned);
  absl::StatusOr<std::vector<PolicySpec>> all = ParsePolicies("baselines");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), LearnedPresets().size());
  EXPECT_FALSE(ParsePolicies("fcfs,fifo").ok());
  EXPECT_FALSE(ParsePolicies("fcfs,fcfs").ok());
  EXPECT_FALSE(ParsePolicies("learned:cost=2ms").ok());
  EXPECT_FALSE(ParsePolicies("learned:rho=1.5").ok());
  EXPECT_FALSE(ParsePolicies("learned:rho=0.5,speed=3").ok());

  // Disciplines after '+'.
  absl::StatusOr<std::vector<PolicySpec>> d = ParsePolicies(
      "leap+bounded=1.5,oracle+hrrn,leap+aging=0.5,ltr+bounded,"
      "learned:rho=0.6,cost=2ms+hrrn");
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_EQ(d->size(), 5u);
  EXPECT_EQ((*d)[0].name, "leap+bounded=1.5");
  EXPECT_EQ((*d)[0].discipline, shim::SchedulingPolicy::kBounded);
  EXPECT_DOUBLE_EQ((*d)[0].knob, 1.5);
  EXPECT_EQ((*d)[0].predictor, "leap");
  EXPECT_EQ((*d)[1].name, "oracle+hrrn");
  EXPECT_EQ((*d)[2].discipline, shim::SchedulingPolicy::kLinearAging);
  EXPECT_EQ((*d)[3].name, "ltr+bounded=2.5");
  EXPECT_EQ((*d)[3].kind, PolicySpec::Kind::kLearned);
  EXPECT_EQ((*d)[4].name, "learned:rho=0.6,cost=2ms+hrrn");
  // A discipline after a learned spec is a new policy, not its parameter.
  absl::StatusOr<std::vector<PolicySpec>> after =
      ParsePolicies("learned:rho=0.5,cost=1ms,leap+bounded=2");
  ASSERT_TRUE(after.ok()) << after.status();
  ASSERT_EQ(after->size(), 2u);
  EXPECT_EQ((*after)[1].name, "leap+bounded=2");
  EXPECT_FALSE(ParsePolicies("fcfs+bounded").ok());
  EXPECT_FALSE(ParsePolicies("leap+bounded=0.5").ok());
  EXPECT_FALSE(ParsePolicies("leap+hrrn=2").ok());
  EXPECT_FALSE(ParsePolicies("leap+fifo").ok());
  EXPECT_FALSE(ParsePolicies("leap+aging=-1").ok());
  // The bound with the ratio correction (BoundCalibration::kRatio).
  absl::StatusOr<std::vector<PolicySpec>> ratio =
      ParsePolicies("leap+bounded-ratio=1.5+prior,oracle+bounded-ratio");
  ASSERT_TRUE(ratio.ok()) << ratio.status();
  EXPECT_EQ((*ratio)[0].name, "leap+bounded-ratio=1.5+prior");
  EXPECT_EQ((*ratio)[0].discipline, shim::SchedulingPolicy::kBounded);
  EXPECT_TRUE((*ratio)[0].ratio_calibration);
  EXPECT_TRUE((*ratio)[0].prior_admission);
  EXPECT_EQ((*ratio)[1].name, "oracle+bounded-ratio=2.5");
  EXPECT_FALSE((*d)[0].ratio_calibration);
  EXPECT_FALSE(ParsePolicies("leap+bounded-ratio=0.5").ok());
  EXPECT_FALSE((*d)[0].bounded_aging.has_value());
  // The bound with its own linear aging: ",aging=A" continues the policy.
  absl::StatusOr<std::vector<PolicySpec>> hybrid = ParsePolicies(
      "leap+bounded=2,aging=0.03,leap+bounded=2,oracle+bounded,aging=0.1+prior,"
      "leap+bounded-ratio=1.5,aging=0,ltr+bounded=4,aging=1e-2,leap+aging=0.03");
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  ASSERT_EQ(hybrid->size(), 6u);
  EXPECT_EQ((*hybrid)[0].name, "leap+bounded=2,aging=0.03");
  EXPECT_EQ((*hybrid)[0].discipline, shim::SchedulingPolicy::kBounded);
  EXPECT_DOUBLE_EQ((*hybrid)[0].knob, 2);
  ASSERT_TRUE((*hybrid)[0].bounded_aging.has_value());
  EXPECT_DOUBLE_EQ(*(*hybrid)[0].bounded_aging, 0.03);
  EXPECT_EQ((*hybrid)[0].predictor, "leap");
  EXPECT_EQ((*hybrid)[1].name, "leap+bounded=2");
  EXPECT_FALSE((*hybrid)[1].bounded_aging.has_value());
  EXPECT_EQ((*hybrid)[2].name, "oracle+bounded=2.5,aging=0.1+prior");
  EXPECT_TRUE((*hybrid)[2].prior_admission);
  EXPECT_DOUBLE_EQ(*(*hybrid)[2].bounded_aging, 0.1);
  EXPECT_EQ((*hybrid)[3].name, "leap+bounded-ratio=1.5,aging=0");
  EXPECT_TRUE((*hybrid)[3].ratio_calibration);
  ASSERT_TRUE((*hybrid)[3].bounded_aging.has_value());
  EXPECT_DOUBLE_EQ(*(*hybrid)[3].bounded_aging, 0);
  EXPECT_EQ((*hybrid)[4].name, "ltr+bounded=4,aging=0.01");
  EXPECT_EQ((*hybrid)[4].kind, PolicySpec::Kind::kLearned);
  EXPECT_DOUBLE_EQ(*(*hybrid)[4].bounded_aging, 0.01);
  EXPECT_EQ((*hybrid)[5].name, "leap+aging=0.03");
  EXPECT_EQ((*hybrid)[5].discipline, shim::SchedulingPolicy::kLinearAging);
  EXPECT_FALSE((*hybrid)[5].bounded_aging.has_value());
  // ",aging=A" follows only a bound, once, before +prior, with A >= 0.
  EXPECT_FALSE(ParsePolicies("leap+hrrn,aging=0.03").ok());
  EXPECT_FALSE(ParsePolicies("leap,aging=0.03").ok());
  EXPECT_FALSE(ParsePolicies("leap+bounded=2,aging=-0.1").ok());
  EXPECT_FALSE(ParsePolicies("leap+bounded=2,aging=x").ok());
  EXPECT_FALSE(ParsePolicies("leap+bounded=2,aging=0.1,aging=0.2").ok());
  EXPECT_FALSE(ParsePolicies("leap+bounded=2+prior,aging=0.1").ok());
  // The latency target: X x FCFS's P99, fcfs listed before it.
  absl::StatusOr<std::vector<PolicySpec>> target = ParsePolicies(
      "fcfs,leap+target=1.3,oracle+target,leap+target=1.2+prior");
  ASSERT_TRUE(target.ok()) << target.status();
  ASSERT_EQ(target->size(), 4u);
  EXPECT_EQ((*target)[1].name, "leap+target=1.3");
  EXPECT_EQ((*target)[1].discipline, shim::SchedulingPolicy::kBounded);
  EXPECT_TRUE((*target)[1].latency_target);
  EXPECT_DOUBLE_EQ((*target)[1].knob, 1.3);
  EXPECT_EQ((*target)[2].name, "oracle+target=1.45");  // kDefaultTarget
  EXPECT_EQ((*target)[3].name, "leap+target=1.2+prior");
  EXPECT_TRUE((*target)[3].prior_admission);
  EXPECT_FALSE((*hybrid)[1].latency_target);
  EXPECT_FALSE(ParsePolicies("leap+target=1.2,fcfs").ok());  // fcfs first
  EXPECT_FALSE(ParsePolicies("fcfs,leap+target=0").ok());
  EXPECT_FALSE(ParsePolicies("fcfs,leap+target=-1").ok());
  EXPECT_FALSE(ParsePolicies("fcfs,leap+target=1.2,aging=0.1").ok());
  EXPECT_TRUE(ParsePolicies("fcfs,leap+target=0.9").ok());
}

// ---- trace parsers
// ------------------------------------------------------------

TEST(ReplayTraceTest, Azure) {
  absl::StatusOr<Trace> t = ParseTrace(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n"
      "2023-11-16 18:15:50.9951690,396,109\r\n"
      "2023-11-16 18:15:46.6805900,374,44\n"
      "\n"
      "2023-11-16 18:16:46.6805900,10,0\n",
      TraceFormat::kAuto, "a.csv");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->format, TraceFormat::kAzure);
  EXPECT_TRUE(t->has_timestamps);
  ASSERT_EQ(t->rows.size(), 3u);
  // Sorted by time, relative to the first.
  EXPECT_EQ(t->rows[0].prompt_tokens, 374);
  EXPECT_EQ(t->rows[0].output_tokens, 44);
  EXPECT_DOUBLE_EQ(t->rows[0].arrival_s, 0);
  EXPECT_NEAR(t->rows[1].arrival_s, 4.314579, 1e-6);
  EXPECT_NEAR(t->rows[2].arrival_s, 60, 1e-6);
  EXPECT_EQ(t->rows[2].output_tokens, 0);
  EXPECT_NEAR(TraceRate(*t), 2 / 60.0, 1e-9);
  // Other column orders, extra columns, numeric timestamps, max_rows.
  absl::StatusOr<Trace> u = ParseTrace(
      "GeneratedTokens,x,ContextTokens,TIMESTAMP\n5,a,6,1.5\n7,b,8,3\n9,c,1,"
      "4\n",
      TraceFormat::kAzure, "b.csv", 2);
  ASSERT_TRUE(u.ok()) << u.status();
  ASSERT_EQ(u->rows.size(), 2u);
  EXPECT_EQ(u->rows[1].output_tokens, 7);
  EXPECT_EQ(u->rows[1].prompt_tokens, 8);
  EXPECT_DOUBLE_EQ(u->rows[1].arrival_s, 1.5);
}

void ExpectError(absl::string_view text, TraceFormat format,
                 absl::string_view want) {
  absl::StatusOr<Trace> t = ParseTrace(text, format, "t.x");
  ASSERT_FALSE(t.ok()) << "accepted: " << text;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find(want), absl::string_view::npos)
      << t.status().message() << " (wanted '" << want << "')";
}

TEST(ReplayTraceTest, AzureMalformed) {
  const TraceFormat az = TraceFormat::kAzure;
  ExpectError("", az, "t.x: empty file");
  ExpectError("TIMESTAMP,ContextTokens\n1,2\n", az, "missing GeneratedTokens");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\n", az, "no data rows");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\n", az,
              "t.x:2: expected 3 comma-separated fields");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n1,x,3\n", az,
              "t.x:3: ContextTokens must be a non-negative integer, got 'x'");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,-3\n", az,
              "t.x:2: GeneratedTokens must be a non-negative integer");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3.5\n", az,
              "GeneratedTokens must be a non-negative integer");
  ExpectError(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.1,1,2\n",
      az, "t.x:2: TIMESTAMP must be");
  ExpectError(
      "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 18:15:46,1,2\n", az,
      "TIMESTAMP must be");
  ExpectError("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", az,
              "TIMESTAMP must be");
}

TEST(ReplayTraceTest, Lengths) {
  absl::StatusOr<Trace> t = ParseTrace(
      "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
      "74,918,992,0.08\n290,905,1195,0.32\n",
      TraceFormat::kAuto, "l.csv");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->format, TraceFormat::kLengths);
  EXPECT_FALSE(t->has_timestamps);
  ASSERT_EQ(t->rows.size(), 2u);
  EXPECT_EQ(t->rows[1].prompt_tokens, 290);
  EXPECT_EQ(t->rows[1].output_tokens, 905);
  const TraceFormat lf = TraceFormat::kLengths;
  ExpectError("num_prefill_tokens,total\n1,2\n", lf,
              "missing num_decode_tokens");
  ExpectError(
      "num_prefill_tokens,num_decode_tokens\n1,2\n3,\n", lf,
      "t.x:3: num_decode_tokens must be a non-negative integer, got ''");
  ExpectError("num_prefill_tokens,num_decode_tokens\n1,2,3\n", lf,
              "t.x:2: expected 2 comma-separated fields");
  ExpectError("hello,world\n1,2\n", TraceFormat::kAuto,
              "cannot tell the trace format");
}

TEST(ReplayTraceTest, Jsonl) {
  absl::StatusOr<Trace> t = ParseTrace(
      "{\"timestamp\": 2500, \"input_length\": 10, \"output_length\": 20}\n"
      "\n"
      "{\"timestamp\": 1000.5, \"input_length\": 30, \"output_length\": 40, "
      "\"extra\": \"x\"}\n",
      TraceFormat::kAuto, "j.jsonl");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->format, TraceFormat::kJsonl);
  ASSERT_EQ(t->rows.size(), 2u);
  EXPECT_EQ(t->rows[0].prompt_tokens, 30);
  EXPECT_DOUBLE_EQ(t->rows[1].arrival_s, 1.4995);
  const TraceFormat jf = TraceFormat::kJsonl;
  ExpectError(
      "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 2}\n"
      "{\"timestamp\": 2, \"input_length\": 1,\n",
      jf, "t.x:2: not a JSON object");
  ExpectError("[1, 2, 3]\n", jf, "t.x:1: not a JSON object");
  ExpectError("{\"input_length\": 1, \"output_length\": 2}\n", jf,
              "t.x:1: missing or non-numeric \"timestamp\"");
  ExpectError(
      "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": -2}\n", jf,
      "\"output_length\" or not a non-negative integer");
  ExpectError(
      "{\"timestamp\": 1, \"input_length\": \"1\", \"output_length\": 2}\n", jf,
      "\"input_length\" or not a non-negative integer");
  ExpectError(
      "{\"timestamp\": 1, \"input_length\": 1.5, \"output_length\": 2}\n", jf,
      "\"input_length\" or not a non-negative integer");
  ExpectError("\n\n", jf, "no JSON lines");
}

TEST(ReplayTraceTest, SyntheticTraceAndPoissonArrivals) {
  const readout::SynthDomain chat = *readout::BuiltinDomain("chat");
  const readout::SynthDomain tr = *readout::BuiltinDomain("translation");
  const Trace t = SyntheticTrace(4000, chat, tr, 2000, 2048, 1);
  ASSERT_EQ(t.rows.size(), 4000u);
  std::vector<double> a, b;
  for (size_t i = 0; i < t.rows.size(); ++i) {
    ASSERT_GE(t.rows[i].output_tokens, 1);
    ASSERT_LE(t.rows[i].output_tokens, 2048);
    (i < 2000 ? a : b).push_back(static_cast<double>(t.rows[i].output_tokens));
  }
  EXPECT_NEAR(Percentile(a, 50), 300, 30);
  EXPECT_NEAR(Percentile(b, 50), 900, 90);
  // Rates 2/s then 8/s: the mean gaps are 0.5 s and 0.125 s.
  const std::vector<double> at = PoissonArrivals(20000, 10000, 2, 8, 3);
  EXPECT_NEAR(at[9999] / 9999, 0.5, 0.02);
  EXPECT_NEAR((at[19999] - at[9999]) / 10000, 0.125, 0.005);
}

// ---- LEAP through a real leapd
// --------------------------------------------------

class ReplayLeapdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto p = testing::StartLeapd(LEAPD_PATH, {}, &address_);
    ASSERT_TRUE(p.ok()) << p.status();
    leapd_ = p->release();
  }
  static void TearDownTestSuite() {
    delete leapd_;
    leapd_ = nullptr;
  }
  static client::ServerOptions Server() {
    client::ServerOptions s;
    s.address = address_;
    return s;
  }
  // The readout of these tests: kDim features, sqrt(length) read off
  // feature 0 (theta = [1, 0, 0, 0; 0], identity standardization), budget
  // 2,048 tokens; serialized.
  static constexpr int64_t kDim = 4;
  static absl::StatusOr<std::string> SqrtReadout() {
    readout::ReadoutState state;
    state.spec.dim = kDim;
    state.spec.max_tokens = 2048;
    state.spec.lambda = 1;
    state.standardizer = readout::Standardizer::Identity(kDim);
    state.theta = Eigen::VectorXd::Zero(kDim + 1);
    state.theta[0] = 1;
    state.version = 1;
    return readout::SerializeArtifact(state);
  }
  // A frozen arm of `artifact` on product line `line` in the shared leapd,
  // and a LeapPredictor on it with `lo` (its endpoint, line and dim set
  // here). Fatal failure when either cannot be had.
  static void StartLeap(const std::string& line, const std::string& artifact,
                        LeapPredictorOptions lo,
                        absl::StatusOr<std::unique_ptr<LeapArm>>& arm,
                        absl::StatusOr<std::unique_ptr<LeapPredictor>>& leap) {
    arm = LeapArm::Create(Server(), line, artifact, /*frozen=*/true);
    ASSERT_TRUE(arm.ok()) << arm.status();
    lo.endpoint = address_;
    lo.product_line = line;
    lo.dim = kDim;
    leap = LeapPredictor::Create(std::move(lo));
    ASSERT_TRUE(leap.ok()) << leap.status();
  }
  static std::string address_;
  static testing::Process* leapd_;
};
std::string ReplayLeapdTest::address_;
testing::Process* ReplayLeapdTest::leapd_ = nullptr;

TEST_F(ReplayLeapdTest, ExactReadoutGivesTheOracleDecodeOrder) {
  // Lengths are perfect squares, so leapd's clip(score, 1, sqrt(M))^2 of
  // SqrtReadout is exact in floating point and equals the oracle's value;
  // features 1-3 are noise with weight 0.
  absl::StatusOr<std::string> artifact = SqrtReadout();
  ASSERT_TRUE(artifact.ok()) << artifact.status();

  std::vector<SimRequest> reqs = Overloaded(400, 13);
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> k(2, 45);
  std::normal_distribution<float> noise;
  std::vector<float> x(reqs.size() * kDim);
  std::vector<double> truth;
  for (SimRequest& r : reqs) {
    const int root = k(rng);
    r.output_tokens = root * root;
    r.prompt_tokens = 1000;
    x[r.id * kDim] = static_cast<float>(root);
    for (int j = 1; j < kDim; ++j) x[r.id * kDim + j] = noise(rng);
    truth.push_back(r.output_tokens);
  }
  // Prefill 1000 tokens at 1 ms: a prediction has 1 s * 6/36 = 167 ms of
  // slack, far above leapd's latency, so none is late.
  SimOptions o = Small(20);
  o.engine.prefill_per_token_ms = 1;
  o.record_order = true;

  LeapPredictorOptions lo;
  lo.features = x;
  absl::StatusOr<std::unique_ptr<LeapArm>> arm;
  absl::StatusOr<std::unique_ptr<LeapPredictor>> leap;
  StartLeap("exact", *artifact, std::move(lo), arm, leap);
  if (HasFatalFailure()) return;
  absl::StatusOr<SimResult> via_leapd = Simulate(reqs, o, **leap);
  ASSERT_TRUE(via_leapd.ok()) << via_leapd.status();
  EXPECT_EQ((*leap)->errors(), 0) << (*leap)->first_error();
  EXPECT_EQ((*leap)->latencies().size(), reqs.size());
  leap->reset();
  EXPECT_TRUE((*arm)->Remove().ok());

  TablePredictor oracle(truth, 0, false, 0);
  absl::StatusOr<SimResult> exact = Simulate(reqs, o, oracle);
  ASSERT_TRUE(exact.ok());
  for (const RequestResult& r : via_leapd->requests) {
    ASSERT_EQ(r.predicted_tokens, truth[r.id]) << "request " << r.id;
  }
  EXPECT_EQ(via_leapd->late_predictions, 0);
  EXPECT_EQ(via_leapd->decode_order, exact->decode_order);

  // And that order is not FCFS's (the comparison can fail).
  SimOptions f = o;
  f.scheduler.waiting_cap = 0;
  f.scheduler.unpredicted = shim::UnpredictedPolicy::kFixed;
  NoPredictor none;
  absl::StatusOr<SimResult> fcfs = Simulate(reqs, f, none);
  ASSERT_TRUE(fcfs.ok());
  EXPECT_NE(fcfs->decode_order, exact->decode_order);
}

// A request's decoding max_tokens caps its prediction, end to end: features
// with a cap go through the shim Client to leapd, and the prediction that
// comes back is min(readout's prediction, cap). Without a cap it is not.
TEST_F(ReplayLeapdTest, RequestMaxTokensCapsThePrediction) {
  absl::StatusOr<std::string> artifact = SqrtReadout();
  ASSERT_TRUE(artifact.ok()) << artifact.status();

  std::vector<SimRequest> reqs = Overloaded(120, 29);
  std::vector<float> x(reqs.size() * kDim, 0.0f);
  std::vector<int64_t> caps(reqs.size(), 0);
  std::vector<double> want(reqs.size());
  for (SimRequest& r : reqs) {
    const int root = 10 + static_cast<int>(r.id % 30);  // 100..1521 tokens
    r.output_tokens = 5;
    r.prompt_tokens = 1000;
    x[r.id * kDim] = static_cast<float>(root);
    const double readout_tokens = static_cast<double>(root * root);
    // Every third request: a cap below the readout's prediction; every
    // third: a cap above it (no effect); the rest: none.
    if (r.id % 3 == 0) caps[r.id] = 50 + r.id;
    if (r.id % 3 == 1) caps[r.id] = 2000;
    want[r.id] = caps[r.id] > 0
                     ? std::min(readout_tokens, static_cast<double>(caps[r.id]))
                     : readout_tokens;
  }
  LeapPredictorOptions lo;
  lo.features = x;
  lo.max_tokens = caps;
  absl::StatusOr<std::unique_ptr<LeapArm>> arm;
  absl::StatusOr<std::unique_ptr<LeapPredictor>> leap;
  StartLeap("capped", *artifact, std::move(lo), arm, leap);
  if (HasFatalFailure()) return;
  SimOptions o = Small(20);
  o.engine.prefill_per_token_ms = 1;
  absl::StatusOr<SimResult> sim = Simulate(reqs, o, **leap);
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ((*leap)->errors(), 0) << (*leap)->first_error();
  int capped = 0;
  for (const RequestResult& r : sim->requests) {
    ASSERT_EQ(r.predicted_tokens, want[r.id]) << "request " << r.id;
    capped += caps[r.id] > 0 && want[r.id] < 100;
  }
  EXPECT_GT(capped, 10);
  leap->reset();
  EXPECT_TRUE((*arm)->Remove().ok());
}

// With a charged latency (LeapPredictorOptions::charged_latency_s) a LEAP
// run no longer depends on wall time: it equals, step for step, a table of
// the same predictions charged the same latency (TablePredictor), and so
// repeats exactly. The latency (0.6 s) exceeds what is left of a one-prompt
// prefill after the capture point (0.5 s), so when a prediction becomes
// known matters.
TEST_F(ReplayLeapdTest, ChargedLatencyMakesTheRunRepeatable) {
  constexpr double kCharged = 0.6;
  absl::StatusOr<std::string> artifact = SqrtReadout();
  ASSERT_TRUE(artifact.ok()) << artifact.status();

  std::vector<SimRequest> reqs = Overloaded(300, 41);
  std::mt19937_64 rng(43);
  std::uniform_int_distribution<int> k(2, 40);
  std::vector<float> x(reqs.size() * kDim, 0.0f);
  std::vector<double> values;
  for (SimRequest& r : reqs) {
    const int root = k(rng);
    r.output_tokens = root * root;
    r.prompt_tokens = 600;
    x[r.id * kDim] = static_cast<float>(root);
    values.push_back(r.output_tokens);
  }
  SimOptions o = Small(20);
  o.engine.prefill_per_token_ms = 1;  // 0.6 s prefill, capture at 1/6
  o.engine.capture_fraction = 1.0 / 6.0;
  o.record_order = true;

  std::vector<SimResult> runs;
  for (int run = 0; run < 2; ++run) {
    const std::string line = absl::StrCat("charged", run);
    LeapPredictorOptions lo;
    lo.features = x;
    lo.charged_latency_s = kCharged;
    // The comparison is exact only if every due prediction arrives within
    // the wait: generous for a loaded sanitizer build.
    lo.max_wait = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<LeapArm>> arm;
    absl::StatusOr<std::unique_ptr<LeapPredictor>> leap;
    StartLeap(line, *artifact, std::move(lo), arm, leap);
    if (HasFatalFailure()) return;
    absl::StatusOr<SimResult> sim = Simulate(reqs, o, **leap);
    ASSERT_TRUE(sim.ok()) << sim.status();
    EXPECT_EQ((*leap)->errors(), 0) << (*leap)->first_error();
    EXPECT_EQ((*leap)->wait_timeouts(), 0);
    // Every request's prediction is recorded, also of those that finished
    // before it was due.
    EXPECT_EQ((*leap)->recorded().size(), reqs.size());
    for (const auto& [id, v] : (*leap)->recorded()) {
      EXPECT_EQ(v.first, values[id]) << "request " << id;
      EXPECT_EQ(v.second, kCharged) << "request " << id;
    }
    runs.push_back(*std::move(sim));
    leap->reset();
    EXPECT_TRUE((*arm)->Remove().ok());
  }
  TablePredictor table(values, kCharged, /*on_gpu=*/false, 0);
  absl::StatusOr<SimResult> reference = Simulate(reqs, o, table);
  ASSERT_TRUE(reference.ok()) << reference.status();
  // Predictions arriving after their prefill ended (late) exist.
  EXPECT_GT(reference->late_predictions, 0);
  for (const SimResult& run : runs) {
    EXPECT_EQ(run.decode_order, reference->decode_order);
    EXPECT_EQ(run.late_predictions, reference->late_predictions);
    ASSERT_EQ(run.requests.size(), reference->requests.size());
    for (size_t i = 0; i < run.requests.size(); ++i) {
      EXPECT_EQ(run.requests[i].completion_s,
                reference->requests[i].completion_s)
          << "request " << run.requests[i].id;
    }
  }
  // And the charged latency matters: charged nothing, the order differs.
  TablePredictor instant(values, 0, /*on_gpu=*/false, 0);
  absl::StatusOr<SimResult> at_once = Simulate(reqs, o, instant);
  ASSERT_TRUE(at_once.ok());
  EXPECT_NE(at_once->decode_order, reference->decode_order);
}

// A file in this process's temp dir (removed at exit).
std::string TempPath(const std::string& name) {
  static const testing::ScopedTempDir* const dir = [] {
    static const testing::ScopedTempDir d("replay");
    return &d;
  }();
  return dir->File(name);
}

TEST_F(ReplayLeapdTest, SmallReplayThroughTheCli) {
  const std::string json = TempPath("out.json");
  const std::string plot = TempPath("plot.svg");
  std::ostringstream out, err;
  const int rc =
      RunLeapctl({"replay",
                  "--requests",
                  "600",
                  "--policies",
                  "fcfs,oracle,leap,leap-rls,learned:rho=0.5,cost=1ms,"
                  "leap+bounded=2",
                  "--sweep",
                  "0.8,1.3",
                  "--server",
                  address_,
                  "--dim",
                  "32",
                  "--train-rows",
                  "800",
                  "--slots",
                  "16",
                  "--resident",
                  "96",
                  "--json",
                  json,
                  "--plot",
                  plot},
                 out, err);
  ASSERT_EQ(rc, 0) << err.str();
  EXPECT_NE(out.str().find("leap-rls"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("plot: " + plot), std::string::npos) << out.str();

  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 12u);
  // leap+bounded reused the frozen LEAP run's predictions (no leapd run).
  EXPECT_NE(out.str().find("leap+bounded=2 @ 1.30: predictions of the frozen "
                           "LEAP run"),
            std::string::npos)
      << out.str();
  const std::vector<std::string> keys = {
      "load",        "long_p95_latency", "mean_ptl",
      "mean_ttft",   "p90_latency",      "p95_latency",
      "p99_latency", "policy",           "throughput",
      "window_p99_latency"};
  std::map<std::pair<std::string, double>, double> ptl;
  for (const nlohmann::json& row : j) {
    std::vector<std::string> got;
    for (auto it = row.begin(); it != row.end(); ++it) got.push_back(it.key());
    EXPECT_EQ(got, keys);
    ptl[{row["policy"], row["load"]}] = row["mean_ptl"];
    EXPECT_GT(row["throughput"].get<double>(), 0);
    EXPECT_LE(row["p90_latency"].get<double>(),
              row["p99_latency"].get<double>());
  }
  // Overloaded, length-aware ordering beats arrival order.
  const auto at = [&](const std::string& policy) {
    return ptl.at(std::make_pair(policy, 1.3));
  };
  EXPECT_LT(at("oracle"), at("fcfs"));
  EXPECT_LT(at("leap"), at("fcfs"));
  EXPECT_LT(at("leap-rls"), at("fcfs"));
  EXPECT_LT(at("leap+bounded=2"), at("fcfs"));

  std::ifstream svg(plot);
  std::string head(4, '\0');
  svg.read(head.data(), 4);
  EXPECT_EQ(head, "<svg");
  // The arms are gone from leapd.
  client::AdminClient admin(Server());
  absl::StatusOr<v1::ListReadoutsResponse> list = admin.ListReadouts();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->readouts_size(), 0);
}

TEST(ReplayCliTest, VllmEngineDisciplinesAndTradeoff) {
  const std::string plot = TempPath("tradeoff.svg");
  const std::string csv = TempPath("requests.csv");
  std::ostringstream out, err;
  const int rc = RunLeapctl(
      {"replay", "--requests", "500", "--policies",
       "fcfs,oracle,oracle+bounded=1.5,oracle+bounded=3,oracle+hrrn,"
       "oracle+aging=0.5,oracle+target=0.9,oracle+target=1.3",
       "--sweep", "1.2", "--engine", "vllm", "--max-num-seqs", "16",
       "--max-num-batched-tokens", "1024", "--kv-blocks", "800",
       "--tradeoff-plot", plot, "--requests-csv", csv},
      out, err);
  ASSERT_EQ(rc, 0) << err.str();
  // The per-request CSV: every request of every run, its columns
  // consistent (latency = completion - arrival; the oracle's predictions
  // are the true lengths; deadlines only under the bound and the target).
  {
    std::ifstream in(csv);
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    EXPECT_EQ(line,
              "policy,load,id,segment,arrival_s,prompt_tokens,output_tokens,"
              "predicted_tokens,first_token_s,completion_s,latency_s,"
              "max_wait_steps,deadline_origin,deadline,completion,urgent,"
              "gave_up");
    std::map<std::string, int> rows, with_deadline;
    int urgent = 0;
    while (std::getline(in, line)) {
      const std::vector<std::string> f = absl::StrSplit(line, ',');
      ASSERT_EQ(f.size(), 17u) << line;
      ++rows[f[0]];
      EXPECT_EQ(f[1], "1.2") << line;  // (15 significant digits)
      double arrival = 0, completion = 0, latency = 0;
      ASSERT_TRUE(absl::SimpleAtod(f[4], &arrival)) << line;
      ASSERT_TRUE(absl::SimpleAtod(f[9], &completion)) << line;
      ASSERT_TRUE(absl::SimpleAtod(f[10], &latency)) << line;
      EXPECT_NEAR(latency, completion - arrival, 1e-9) << line;
      if (f[0] == "oracle") {
        EXPECT_EQ(f[7], f[6]) << line;
      }
      if (f[0] == "fcfs") {
        EXPECT_EQ(f[7], "") << line;
      }
      if (!f[13].empty()) ++with_deadline[f[0]];
      EXPECT_TRUE(f[15] == "0" || f[15] == "1") << line;
      urgent += f[15] == "1";
    }
    EXPECT_EQ(rows.size(), 8u);
    for (const auto& [policy, n] : rows) EXPECT_EQ(n, 500) << policy;
    EXPECT_EQ(with_deadline["fcfs"], 0);
    EXPECT_EQ(with_deadline["oracle+hrrn"], 0);
    EXPECT_GT(with_deadline["oracle+target=1.3"], 400);
    EXPECT_GT(with_deadline["oracle+bounded=1.5"], 400);
    EXPECT_GT(urgent, 0);
  }
  const std::string o = out.str();
  // The default victim: vLLM's FCFS one, the wiring the docs recommend.
  EXPECT_NE(o.find("engine: vllm-shaped (continuous batching, KV blocks, "
                   "preemption of the latest admitted: --preempt latest)"),
            std::string::npos)
      << o;
  EXPECT_NE(o.find("trade-off:"), std::string::npos) << o;
  EXPECT_NE(o.find("oracle+bounded=1.5"), std::string::npos) << o;
  EXPECT_NE(o.find("oracle+aging=0.5"), std::string::npos) << o;
  // A target below FCFS's P99 (X < 1) runs too (S is not its knob).
  EXPECT_NE(o.find("oracle+target=0.9"), std::string::npos) << o;
  EXPECT_NE(o.find("oracle+target=1.3"), std::string::npos) << o;
  EXPECT_NE(o.find("preemptions"), std::string::npos) << o;
  EXPECT_NE(o.find("trade-off plot: " + plot), std::string::npos) << o;
  std::ifstream svg(plot);
  std::string head(4, '\0');
  svg.read(head.data(), 4);
  EXPECT_EQ(head, "<svg");
}

// The admission table and plot (vLLM-shaped engine, where the prior moves
// the tail): oracle+prior beside oracle, each pair's
// gain shares and P99 ratios equal to the trade-off table's entries for the
// two policies (oracle's own share is 1 by definition).
TEST(ReplayCliTest, AdmissionTableAndPlot) {
  const std::string plot = TempPath("admission.svg");
  std::ostringstream out, err;
  const int rc = RunLeapctl(
      {"replay", "--requests", "600", "--policies",
       "fcfs,oracle,oracle+prior,oracle+hrrn,oracle+hrrn+prior", "--sweep",
       "1.2", "--engine", "vllm", "--max-num-seqs", "16",
       "--max-num-batched-tokens", "1024", "--kv-blocks", "800",
       // The rank victim: there the prior moves the oracle's P99 on this
       // small run (with the latest admitted preempted it happens not to).
       "--preempt", "rank", "--admission-plot", plot},
      out, err);
  ASSERT_EQ(rc, 0) << err.str();
  const std::string o = out.str();
  EXPECT_NE(o.find("preemption of the lowest-ranked: --preempt rank)"),
            std::string::npos)
      << o;
  ASSERT_NE(o.find("admission: "), std::string::npos) << o;
  EXPECT_NE(o.find("admission plot: " + plot), std::string::npos) << o;
  // The trade-off rows of the four policies, then the admission rows.
  auto field = [&](const std::string& section, const std::string& policy) {
    const size_t at = o.find(section);
    EXPECT_NE(at, std::string::npos) << section;
    const size_t line = o.find("\n" + policy + " ", at);
    EXPECT_NE(line, std::string::npos) << policy << " in " << section;
    return std::vector<std::string>(absl::StrSplit(
        o.substr(line + 1, o.find('\n', line + 1) - line - 1), ' ',
        absl::SkipEmpty()));
  };
  const auto plain = field("trade-off:", "oracle");
  const auto prior = field("trade-off:", "oracle+prior");
  const auto bplain = field("trade-off:", "oracle+hrrn");
  const auto bprior = field("trade-off:", "oracle+hrrn+prior");
  EXPECT_EQ(plain[2], "1.000");
  const auto a = field("admission:", "oracle");
  // policy load gain_without -> gain_with p99_without -> p99_with
  ASSERT_EQ(a.size(), 8u);
  EXPECT_EQ(a[2], plain[2]);
  EXPECT_EQ(a[4], prior[2]);
  EXPECT_EQ(a[5], plain[3]);
  EXPECT_EQ(a[7], prior[3]);
  // The prior changes this run (so a swapped pair would show).
  EXPECT_NE(a[5], a[7]);
  const auto b = field("admission:", "oracle+hrrn");
  ASSERT_EQ(b.size(), 8u);
  EXPECT_EQ(b[2], bplain[2]);
  EXPECT_EQ(b[4], bprior[2]);
  std::ifstream svg(plot);
  const std::string text((std::istreambuf_iterator<char>(svg)),
                         std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  size_t bars = 0;
  for (size_t at = text.find("class=\"bar\""); at != std::string::npos;
       at = text.find("class=\"bar\"", at + 1)) {
    ++bars;
  }
  EXPECT_EQ(bars, 4u);  // two pairs
}

// --give-up-reserve reaches every +target policy: with R = 0 (down to the
// last credit) some deadlines are given up against credits, with R = 1
// none, and the replay says how many.
TEST(ReplayCliTest, GiveUpReserveReachesTheTargetPolicy) {
  const auto credit_give_ups = [](const char* reserve) -> int64_t {
    std::ostringstream out, err;
    EXPECT_EQ(RunLeapctl({"replay", "--requests", "2000", "--load", "0.9",
                          "--policies", "fcfs,oracle+target=1.2",
                          "--give-up-reserve", reserve},
                         out, err),
              kExitOk)
        << err.str();
    const std::string text = out.str();
    const size_t end = text.find(" of them against credits)");
    if (end == std::string::npos) {
      // No deadline given up at all (the line is printed only then).
      EXPECT_NE(text.find("oracle+target=1.2"), std::string::npos) << text;
      return 0;
    }
    const size_t begin = text.rfind('(', end);
    int64_t n = -1;
    EXPECT_TRUE(absl::SimpleAtoi(text.substr(begin + 1, end - begin - 1), &n))
        << text;
    return n;
  };
  EXPECT_GT(credit_give_ups("0"), 0);
  EXPECT_EQ(credit_give_ups("1"), 0);
}

TEST(ReplayCliTest, UsageErrors) {
  std::ostringstream out, err;
  EXPECT_EQ(RunLeapctl({"replay", "--engine", "sglang"}, out, err), kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--tradeoff-plot", "x.png"}, out, err),
            kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--policies", "fcfs+hrrn"}, out, err),
            kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--policies", "fifo"}, out, err), kExitUsage);
  EXPECT_NE(err.str().find("unknown policy 'fifo'"), std::string::npos);
  EXPECT_EQ(RunLeapctl({"replay", "--load", "1", "--sweep", "1,2"}, out, err),
            kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--shift-at", "1.5"}, out, err), kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--plot", "x.pdf"}, out, err), kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--format", "csv"}, out, err), kExitUsage);
  EXPECT_EQ(RunLeapctl({"replay", "--target-quantile", "1"}, out, err),
            kExitUsage);
  EXPECT_NE(err.str().find("--target-quantile must be in [0, 1)"),
            std::string::npos);
  for (const char* bad : {"-0.1", "1.5", "nan"}) {
    EXPECT_EQ(RunLeapctl({"replay", "--give-up-reserve", bad}, out, err),
              kExitUsage)
        << bad;
    EXPECT_NE(err.str().find("--give-up-reserve must be in [0, 1]"),
              std::string::npos)
        << bad;
  }
  EXPECT_EQ(RunLeapctl({"replay", "--prediction-latency-ms", "-1"}, out, err),
            kExitUsage);
  EXPECT_NE(err.str().find("--prediction-latency-ms must be in [0, 60000]"),
            std::string::npos);
  for (const char* bad : {"nan", "60001", "inf"}) {
    EXPECT_EQ(RunLeapctl({"replay", "--prediction-latency-ms", bad}, out, err),
              kExitUsage)
        << bad;
  }
  // A missing trace file is a failure, not a usage error.
  EXPECT_EQ(RunLeapctl({"replay", "--trace", "/nonexistent/t.csv", "--policies",
                        "fcfs"},
                       out, err),
            kExitFailure);
  std::ostringstream help;
  EXPECT_EQ(RunLeapctl({"replay", "--help"}, help, err), kExitOk);
  EXPECT_NE(help.str().find("--prefill-per-token-ms"), std::string::npos);
}

}  // namespace
}  // namespace leap::replay
