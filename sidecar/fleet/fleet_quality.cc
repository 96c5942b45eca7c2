#include "sidecar/fleet/fleet_quality.h"

#include <cmath>
#include <cstdio>
#include <vector>

#include "google/protobuf/io/coded_stream.h"

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

namespace {

// Bytes a length-delimited field of `n` bytes adds (tag, length, data).
int64_t FieldBytes(size_t n) {
  return 1 + static_cast<int64_t>(
                 google::protobuf::io::CodedOutputStream::VarintSize64(n)) +
         static_cast<int64_t>(n);
}

}  // namespace

fpb::FleetQuality FleetQualityTracker::Encode(bool with_pairs,
                                              int64_t max_bytes) const {
  fpb::FleetQuality q;
  q.set_window(window_);
  // Numbers first: overall, versions newest first, arms while they fit.
  Fill(overall_, false, q.mutable_overall());
  std::vector<const Series*> versions;
  for (auto it = versions_.rbegin(); it != versions_.rend(); ++it) {
    fpb::FleetQualitySeries* v = q.add_versions();
    v->set_version(it->first);
    Fill(it->second, false, v);
    versions.push_back(&it->second);
  }
  int64_t bytes = static_cast<int64_t>(q.ByteSizeLong());
  std::vector<const Series*> arms;
  arms_left_out_ = 0;
  for (const auto& [key, s] : arms_) {
    if (arms_left_out_ > 0) {
      ++arms_left_out_;
      continue;
    }
    fpb::FleetQualitySeries a;
    a.set_product_line(key.first);
    a.set_arm(key.second);
    Fill(s, false, &a);
    const int64_t add = FieldBytes(a.ByteSizeLong());
    if (bytes + add > max_bytes) {
      ++arms_left_out_;
      continue;
    }
    bytes += add;
    *q.add_arms() = std::move(a);
    arms.push_back(&s);
  }
  if (arms_left_out_ != arms_left_out_logged_) {
    std::fprintf(stderr,
                 "leapd: fleet quality: %lld of %zu (product line, arm) series "
                 "left out of the checkpoint and the published summary (over "
                 "%lld bytes); they count on in memory\n",
                 static_cast<long long>(arms_left_out_), arms_.size(),
                 static_cast<long long>(max_bytes));
    arms_left_out_logged_ = arms_left_out_;
  }
  if (!with_pairs) return q;
  // Then pairs, while they fit, in the order overall, arms, versions
  // newest first (the versions still predicting). A series' pairs add two
  // packed fields (16 bytes a pair, two tags and lengths) and may lengthen
  // the series' own length prefix: 24 bytes are reserved for that.
  int64_t budget = kQualityCheckpointPairs;
  auto pairs = [&](const Series& s, fpb::FleetQualitySeries* out) {
    const int64_t n = static_cast<int64_t>(s.pairs.size());
    if (n == 0 || s.restored.has_value() || n > budget) return;
    const int64_t add = 16 * n + 24;
    if (bytes + add > max_bytes) return;
    for (const auto& [p, t] : s.pairs) {
      out->add_predicted(p);
      out->add_truth(t);
    }
    budget -= n;
    bytes += add;
  };
  pairs(overall_, q.mutable_overall());
  for (size_t i = 0; i < arms.size(); ++i) pairs(*arms[i], q.mutable_arms(static_cast<int>(i)));
  for (size_t i = 0; i < versions.size(); ++i) {
    pairs(*versions[i], q.mutable_versions(static_cast<int>(i)));
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
