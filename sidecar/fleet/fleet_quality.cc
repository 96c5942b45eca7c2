#include "sidecar/fleet/fleet_quality.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "readout/stats.h"
#include "sidecar/fleet/nats_client.h"

namespace leap::fleet {
namespace {

namespace fpb = ::leap::v1::fleet;

}  // namespace

void FleetQualityTracker::AddTo(Series* s, double predicted, double truth) const {
  ++s->completions;
  s->restored.reset();
  s->pairs.emplace_back(predicted, truth);
  while (static_cast<int64_t>(s->pairs.size()) > window_) s->pairs.pop_front();
}

void FleetQualityTracker::Add(int64_t version, const std::string& product_line,
                              const std::string& arm, double predicted,
                              double truth) {
  AddTo(&overall_, predicted, truth);
  AddTo(&versions_[version], predicted, truth);
  while (versions_.size() > kQualityVersions) versions_.erase(versions_.begin());
  AddTo(&arms_[{product_line, arm}], predicted, truth);
}

void FleetQualityTracker::Fill(const Series& s, bool with_pairs,
                               fpb::FleetQualitySeries* out) {
  out->set_completions(s.completions);
  if (s.restored.has_value()) {
    out->set_spearman(s.restored->first);
    out->set_spearman_n(s.restored->second);
    return;
  }
  std::vector<double> pred, truth;
  pred.reserve(s.pairs.size());
  truth.reserve(s.pairs.size());
  for (const auto& [p, t] : s.pairs) {
    pred.push_back(p);
    truth.push_back(t);
  }
  out->set_spearman(readout::Spearman(pred, truth));
  out->set_spearman_n(static_cast<int64_t>(pred.size()));
  if (with_pairs) {
    out->mutable_predicted()->Add(pred.begin(), pred.end());
    out->mutable_truth()->Add(truth.begin(), truth.end());
  }
}

fpb::FleetQuality FleetQualityTracker::Encode(bool with_pairs) const {
  fpb::FleetQuality q;
  q.set_window(window_);
  // Series keep their pairs while they fit, in this order: overall, arms,
  // versions newest first (the versions still predicting).
  int64_t budget = kQualityCheckpointPairs;
  auto fill = [&](const Series& s, fpb::FleetQualitySeries* out) {
    const int64_t n = static_cast<int64_t>(s.pairs.size());
    const bool fits = with_pairs && n <= budget;
    Fill(s, fits, out);
    if (fits) budget -= n;
  };
  fill(overall_, q.mutable_overall());
  for (const auto& [key, s] : arms_) {
    fpb::FleetQualitySeries* a = q.add_arms();
    a->set_product_line(key.first);
    a->set_arm(key.second);
    fill(s, a);
  }
  for (auto it = versions_.rbegin(); it != versions_.rend(); ++it) {
    fpb::FleetQualitySeries* v = q.add_versions();
    v->set_version(it->first);
    fill(it->second, v);
  }
  return q;
}

void FleetQualityTracker::Load(const fpb::FleetQualitySeries& in, Series* s) const {
  s->completions = in.completions();
  s->pairs.clear();
  s->restored.reset();
  const int n = std::min(in.predicted_size(), in.truth_size());
  if (n == 0 && in.spearman_n() > 0) {
    s->restored = std::make_pair(in.spearman(), in.spearman_n());
    return;
  }
  for (int i = std::max(0, n - static_cast<int>(window_)); i < n; ++i) {
    s->pairs.emplace_back(in.predicted(i), in.truth(i));
  }
}

void FleetQualityTracker::Decode(const fpb::FleetQuality& q) {
  overall_ = Series{};
  versions_.clear();
  arms_.clear();
  Load(q.overall(), &overall_);
  for (const fpb::FleetQualitySeries& v : q.versions()) Load(v, &versions_[v.version()]);
  while (versions_.size() > kQualityVersions) versions_.erase(versions_.begin());
  for (const fpb::FleetQualitySeries& a : q.arms()) {
    Load(a, &arms_[{a.product_line(), a.arm()}]);
  }
}

std::string QualityConfigKey(absl::string_view readout) {
  return absl::StrCat("quality.", NameToken(readout));
}

sidecar::FleetQualityView QualityView(const fpb::FleetQuality& q) {
  auto series = [](const fpb::FleetQualitySeries& s) {
    sidecar::FleetQualitySeriesView v;
    v.version = s.version();
    v.product_line = s.product_line();
    v.arm = s.arm();
    v.completions = s.completions();
    v.spearman = s.spearman_n() > 0 ? s.spearman() : NAN;
    v.spearman_n = s.spearman_n();
    return v;
  };
  sidecar::FleetQualityView out;
  out.fleet_seq = q.fleet_seq();
  out.window = q.window();
  out.trainer = q.trainer();
  out.unix_ms = q.unix_ms();
  out.overall = series(q.overall());
  for (const auto& v : q.versions()) out.versions.push_back(series(v));
  for (const auto& a : q.arms()) out.arms.push_back(series(a));
  return out;
}

}  // namespace leap::fleet
