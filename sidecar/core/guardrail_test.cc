// The guardrail's trip logic, judged against an independent FP64 Spearman
// (average ranks for ties, then Pearson) over the same window.
#include "sidecar/core/guardrail.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace leap::sidecar {
namespace {

std::vector<double> Ranks(const std::vector<double>& v) {
  std::vector<size_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
    const double avg = (static_cast<double>(i) + static_cast<double>(j)) / 2 + 1;
    for (size_t k = i; k <= j; ++k) r[idx[k]] = avg;
    i = j + 1;
  }
  return r;
}

double ReferenceSpearman(const std::deque<std::pair<double, double>>& w) {
  std::vector<double> a, b;
  for (const auto& [p, t] : w) {
    a.push_back(p);
    b.push_back(t);
  }
  const std::vector<double> ra = Ranks(a), rb = Ranks(b);
  const double n = static_cast<double>(ra.size());
  const double ma = std::accumulate(ra.begin(), ra.end(), 0.0) / n;
  const double mb = std::accumulate(rb.begin(), rb.end(), 0.0) / n;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < ra.size(); ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  if (saa == 0 || sbb == 0) return NAN;
  return sab / std::sqrt(saa * sbb);
}

GuardrailOptions Floor(double floor, int64_t min_samples) {
  GuardrailOptions o;
  o.floor = floor;
  o.min_samples = min_samples;
  o.hysteresis = 0;  // armed by the first passing window (see Hysteresis)
  return o;
}

// A good stream (truth follows the prediction up to noise) that turns
// adversarial (truth independent of the prediction): the monitor is armed
// by the first window (of at least min_samples pairs) whose reference
// Spearman passes the floor, then trips at exactly the first pair where the
// reference falls below it, and only once.
TEST(GuardrailMonitor, TripsExactlyWhereTheReferenceFallsBelowTheFloor) {
  constexpr int64_t kWindow = 200, kMin = 100;
  constexpr double kFloor = 0.3;
  GuardrailMonitor m(Floor(kFloor, kMin), kWindow);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n01;
  std::deque<std::pair<double, double>> window;
  int64_t tripped_at = -1, trips = 0, armed_at = -1;
  for (int64_t i = 0; i < 3000; ++i) {
    const bool adversarial = i >= 2000;
    const double pred = 100 + 30 * n01(rng);
    const double truth = adversarial ? 100 + 30 * n01(rng) : pred + 10 * n01(rng);
    window.emplace_back(pred, truth);
    if (static_cast<int64_t>(window.size()) > kWindow) window.pop_front();
    const double ref = ReferenceSpearman(window);
    const bool judged = static_cast<int64_t>(window.size()) >= kMin;
    const bool should = tripped_at < 0 && armed_at >= 0 && judged && ref < kFloor;
    if (armed_at < 0 && judged && ref >= kFloor) armed_at = i;
    std::optional<GuardrailTrip> trip = m.Observe(pred, truth);
    ASSERT_EQ(m.armed(), armed_at >= 0 && tripped_at < 0 && !should) << i;
    ASSERT_EQ(trip.has_value(), should) << "pair " << i << " reference " << ref;
    if (trip.has_value()) {
      ++trips;
      tripped_at = i;
      EXPECT_NEAR(trip->spearman, ref, 1e-12);
      EXPECT_EQ(trip->n, kWindow);
      EXPECT_EQ(trip->reason.rfind("guardrail: spearman 0.", 0), 0u) << trip->reason;
      EXPECT_NE(trip->reason.find("< floor 0.3 over 200 completions"),
                std::string::npos)
          << trip->reason;
      EXPECT_FALSE(m.armed());
    }
  }
  ASSERT_EQ(trips, 1);
  EXPECT_EQ(armed_at, kMin - 1);  // the good stream passes at once
  EXPECT_GE(tripped_at, 2000);    // no false trip on the good stream
  EXPECT_LT(tripped_at - 2000, kWindow);
  // Rearmed: judged afresh only after min_samples new pairs.
  m.Restart(GuardrailMonitor::Phase::kArmed);
  int64_t n = -1;
  m.spearman(&n);
  EXPECT_EQ(n, 0);
  for (int64_t i = 0; i < kMin - 1; ++i) {
    ASSERT_FALSE(m.Observe(100 + 30 * n01(rng), 100 + 30 * n01(rng)).has_value());
  }
}

// A cold start predicts badly until it has learned: no trip until the
// quality has once passed, then a fall trips it.
TEST(GuardrailMonitor, ColdStartWarmsUpBeforeItIsArmed) {
  GuardrailMonitor m(Floor(0.5, 20), 50);
  for (int i = 0; i < 200; ++i) {
    ASSERT_FALSE(m.Observe(i, -i).has_value()) << i;  // Spearman -1
  }
  EXPECT_EQ(m.phase(), GuardrailMonitor::Phase::kWarming);
  // Ordered pairs replace the anti-ordered ones: armed on the first
  // window that passes the floor.
  int armed_after = -1;
  for (int i = 0; i < 50 && armed_after < 0; ++i) {
    ASSERT_FALSE(m.Observe(1000 + i, 1000 + i).has_value());
    if (m.armed()) armed_after = i + 1;
  }
  ASSERT_GT(armed_after, 0);
  std::printf("armed after %d ordered pairs\n", armed_after);
  int tripped_after = -1;
  for (int i = 0; i < 50 && tripped_after < 0; ++i) {
    if (m.Observe(-i, i).has_value()) tripped_after = i + 1;
  }
  EXPECT_GT(tripped_after, 0);
  EXPECT_EQ(m.phase(), GuardrailMonitor::Phase::kDisarmed);
}

TEST(GuardrailMonitor, NotJudgedBeforeMinSamplesNorWhenUndefined) {
  GuardrailMonitor m(Floor(0.5, 20), 50);
  m.Restart(GuardrailMonitor::Phase::kArmed);
  // Perfectly anti-ordered pairs: Spearman -1, but only after 20 pairs.
  for (int i = 0; i < 19; ++i) ASSERT_FALSE(m.Observe(i, -i).has_value()) << i;
  std::optional<GuardrailTrip> trip = m.Observe(19, -19);
  ASSERT_TRUE(trip.has_value());
  EXPECT_DOUBLE_EQ(trip->spearman, -1.0);
  EXPECT_EQ(trip->n, 20);
  // Constant predictions: Spearman undefined, never a trip.
  GuardrailMonitor c(Floor(0.5, 20), 50);
  c.Restart(GuardrailMonitor::Phase::kArmed);
  for (int i = 0; i < 200; ++i) ASSERT_FALSE(c.Observe(7, i % 13).has_value());
  int64_t n = 0;
  EXPECT_TRUE(std::isnan(c.spearman(&n)));
  EXPECT_EQ(n, 50);
}

TEST(GuardrailMonitor, MarginAgainstTheLastGoodSnapshot) {
  GuardrailOptions o;
  o.margin = 0.2;
  o.min_samples = 100;
  std::mt19937_64 rng(9);
  std::normal_distribution<double> n01;
  // Spearman about 0.6 throughout (s.d. under 0.08 over 100 pairs): below
  // 0.95 - 0.2, well above 0.45 - 0.2.
  auto stream = [&](GuardrailMonitor& m, int count) -> std::optional<GuardrailTrip> {
    for (int i = 0; i < count; ++i) {
      const double p = n01(rng);
      auto t = m.Observe(p, p + 1.2 * n01(rng));
      if (t.has_value()) return t;
    }
    return std::nullopt;
  };
  GuardrailMonitor none(o, 200);
  none.Restart(GuardrailMonitor::Phase::kArmed);
  EXPECT_FALSE(stream(none, 2000).has_value()) << "no reference, no margin trip";
  GuardrailMonitor low(o, 200);
  low.Restart(GuardrailMonitor::Phase::kArmed);
  low.SetLastGood(GoodSnapshot{"meh", 0.45, 500, 3, 1});
  EXPECT_FALSE(stream(low, 2000).has_value());
  GuardrailMonitor high(o, 200);
  high.Restart(GuardrailMonitor::Phase::kArmed);
  high.SetLastGood(GoodSnapshot{"good", 0.95, 500, 7, 1});
  std::optional<GuardrailTrip> trip = stream(high, 2000);
  ASSERT_TRUE(trip.has_value());
  EXPECT_LT(trip->spearman, 0.75);
  EXPECT_EQ(trip->n, 100);  // judged from min_samples on
  ASSERT_TRUE(trip->last_good.has_value());
  EXPECT_EQ(trip->last_good->label, "good");
  EXPECT_NE(trip->reason.find("below 0.950 of snapshot 'good' (margin 0.2) over "
                              "100 completions"),
            std::string::npos)
      << trip->reason;
}

TEST(GuardrailSnapshots, LastGoodIsTheNewestThatPassed) {
  GuardrailOptions o = Floor(0.3, 100);
  auto snap = [](std::string label, double rho, int64_t n, int64_t version,
                 int64_t ms) {
    storage::SnapshotInfo s;
    s.label = std::move(label);
    s.spearman = rho;
    s.spearman_n = n;
    s.version = version;
    s.unix_ms = ms;
    return s;
  };
  std::vector<storage::SnapshotInfo> snaps = {
      snap("old-good", 0.8, 500, 10, 1000),
      snap("newer-good", 0.7, 100, 20, 2000),
      snap("too-few", 0.9, 99, 30, 3000),
      snap("below-floor", 0.29, 500, 40, 4000),
      snap("unknown", NAN, 500, 50, 5000),
      snap("legacy", 0.9, 0, 60, 6000),
  };
  std::optional<GoodSnapshot> g = LastGoodSnapshot(snaps, o);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->label, "newer-good");
  EXPECT_EQ(g->spearman_n, 100);
  // Same time: the later version.
  snaps.push_back(snap("same-time-later", 0.5, 200, 21, 2000));
  EXPECT_EQ(LastGoodSnapshot(snaps, o)->label, "same-time-later");
  // Without a floor any defined quality over min_samples is good.
  GuardrailOptions margin_only;
  margin_only.margin = 0.1;
  margin_only.min_samples = 100;
  EXPECT_EQ(LastGoodSnapshot(snaps, margin_only)->label, "below-floor");
  EXPECT_FALSE(LastGoodSnapshot({}, o).has_value());
}

// A quality that hovers at the floor (rolling Spearman ~0.5 +- noise over
// a 50-pair window, floor 0.5): without hysteresis a warming guardrail is
// armed at 0.50x and tripped at 0.49x a few pairs later, again and again
// (re-warmed after each trip here, as after an operator's resume of a
// warming readout). With hysteresis h it is armed only by a window at or
// above floor + h: exactly where the FP64 reference says, and it flaps far
// less. Both runs follow the reference state machine pair by pair.
TEST(GuardrailMonitor, HysteresisStopsFlappingAtTheFloor) {
  constexpr int64_t kWindow = 50, kMin = 20;
  constexpr double kFloor = 0.5;
  auto run = [&](double h) {
    GuardrailOptions o = Floor(kFloor, kMin);
    o.hysteresis = h;
    GuardrailMonitor m(o, kWindow);
    std::mt19937_64 rng(11);
    std::normal_distribution<double> n01;
    std::deque<std::pair<double, double>> window;
    bool armed = false;
    int trips = 0;
    for (int64_t i = 0; i < 4000; ++i) {
      const double pred = n01(rng);
      const double truth = pred + 1.5 * n01(rng);  // Spearman ~0.5
      window.emplace_back(pred, truth);
      if (static_cast<int64_t>(window.size()) > kWindow) window.pop_front();
      const double ref = ReferenceSpearman(window);
      const bool judged = static_cast<int64_t>(window.size()) >= kMin;
      const bool should = armed && judged && ref < kFloor;
      if (!armed && judged && ref >= kFloor + h) armed = true;
      std::optional<GuardrailTrip> trip = m.Observe(pred, truth);
      EXPECT_EQ(trip.has_value(), should) << "h " << h << " pair " << i
                                          << " reference " << ref;
      if (trip.has_value() != should) return -1;
      if (should) {
        ++trips;
        armed = false;
        window.clear();
        m.Restart(GuardrailMonitor::Phase::kWarming);
      } else {
        EXPECT_EQ(m.armed(), armed) << "h " << h << " pair " << i;
      }
    }
    return trips;
  };
  const int flaps = run(0);
  const int damped = run(0.15);
  std::printf("trips over 4000 pairs at the floor: hysteresis 0: %d, 0.15: %d\n",
              flaps, damped);
  EXPECT_GT(flaps, 0);
  EXPECT_GE(damped, 0);
  EXPECT_LT(damped, flaps);
  GuardrailOptions bad = Floor(0.3, 10);
  bad.hysteresis = -0.1;
  EXPECT_FALSE(bad.Validate(100).ok());
  bad.hysteresis = 1.5;
  EXPECT_FALSE(bad.Validate(100).ok());
}

TEST(GuardrailOptions, Validate) {
  EXPECT_TRUE(GuardrailOptions{}.Validate(10).ok());  // off
  EXPECT_FALSE(GuardrailOptions{}.enabled());
  EXPECT_TRUE(Floor(0.3, 500).Validate(1000).ok());
  EXPECT_TRUE(Floor(0.3, 500).enabled());
  EXPECT_FALSE(Floor(1.5, 500).Validate(1000).ok());
  EXPECT_FALSE(Floor(0.3, 1001).Validate(1000).ok());
  EXPECT_FALSE(Floor(0.3, 1).Validate(1000).ok());
  GuardrailOptions m;
  m.margin = 0;
  EXPECT_FALSE(m.Validate(1000).ok());
  m.margin = 0.2;
  EXPECT_TRUE(m.Validate(1000).ok());
  EXPECT_EQ(*ParseGuardrailAction("rollback"), GuardrailAction::kRollback);
  EXPECT_EQ(*ParseGuardrailAction("freeze"), GuardrailAction::kFreeze);
  EXPECT_FALSE(ParseGuardrailAction("panic").ok());
}

}  // namespace
}  // namespace leap::sidecar
