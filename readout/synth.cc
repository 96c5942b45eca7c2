#include "readout/synth.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace leap::readout {
namespace {

std::vector<float> RandomUnit(int64_t d, std::mt19937_64& rng) {
  std::normal_distribution<double> n01;
  std::vector<double> v(d);
  double norm = 0;
  for (auto& x : v) {
    x = n01(rng);
    norm += x * x;
  }
  norm = std::sqrt(norm);
  std::vector<float> out(d);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<float>(v[i] / norm);
  return out;
}

// Removes the component along unit vector `u` from v and renormalizes.
void OrthonormalizeAgainst(std::vector<float>& v, const std::vector<float>& u) {
  double dot = 0;
  for (size_t i = 0; i < v.size(); ++i) dot += double{v[i]} * u[i];
  double norm = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<float>(v[i] - dot * u[i]);
    norm += double{v[i]} * v[i];
  }
  norm = std::sqrt(norm);
  for (auto& x : v) x = static_cast<float>(x / norm);
}

}  // namespace

absl::StatusOr<SynthDomain> BuiltinDomain(const std::string& name) {
  if (name == "chat") return SynthDomain{"chat", 300, 0.9, 0, 0};
  if (name == "translation") return SynthDomain{"translation", 900, 0.8, 64, 0.5};
  if (name == "summarization") {
    return SynthDomain{"summarization", 170, 0.7, 45, 0.3};
  }
  if (name == "code") return SynthDomain{"code", 450, 1.0, 30, 0.3};
  return absl::NotFoundError(absl::StrCat("unknown synthetic domain '", name,
                                          "'; built-in: ",
                                          absl::StrJoin(BuiltinDomainNames(), ", ")));
}

std::vector<std::string> BuiltinDomainNames() {
  return {"chat", "translation", "summarization", "code"};
}

absl::Status SynthOptions::Validate() const {
  if (dim < 1 || dim > 16384) {
    return absl::InvalidArgumentError(
        absl::StrCat("dim must be in [1, 16384], got ", dim));
  }
  if (max_tokens < 1) {
    return absl::InvalidArgumentError("max_tokens must be >= 1");
  }
  if (nuisance_rank < 0 || nuisance_rank > 1024) {
    return absl::InvalidArgumentError("nuisance_rank must be in [0, 1024]");
  }
  if (!(signal >= 0) || !(nuisance >= 0) || !(noise >= 0)) {
    return absl::InvalidArgumentError("signal, nuisance, noise must be >= 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<SynthGenerator> SynthGenerator::Create(const SynthOptions& o) {
  absl::Status s = o.Validate();
  if (!s.ok()) return s;
  SynthGenerator g(o);
  std::mt19937_64 rng(o.model_seed);
  std::normal_distribution<double> n01;
  const int64_t d = o.dim;
  g.mu0_.resize(d);
  g.scale_.resize(d);
  for (int64_t i = 0; i < d; ++i) {
    g.mu0_[i] = static_cast<float>(0.5 * n01(rng));
    g.scale_[i] = static_cast<float>(std::exp(0.4 * n01(rng)));
  }
  // A few massive activations: large means, ordinary spread.
  for (int64_t k = 0; k < std::min<int64_t>(4, d); ++k) {
    g.mu0_[(k * 977) % d] = static_cast<float>(40.0 + 20.0 * k);
  }
  g.v0_ = RandomUnit(d, rng);
  for (int j = 0; j < o.nuisance_rank; ++j) {
    g.nuisance_.push_back(RandomUnit(d, rng));
  }
  return g;
}

void SynthGenerator::DomainVectors(const SynthDomain& domain,
                                   std::vector<float>& v,
                                   std::vector<float>& o) const {
  std::mt19937_64 rng(options_.model_seed * 0x9E3779B97F4A7C15ull ^
                      std::hash<std::string>{}(domain.name));
  std::vector<float> perp = RandomUnit(options_.dim, rng);
  if (options_.dim > 1) OrthonormalizeAgainst(perp, v0_);
  o = RandomUnit(options_.dim, rng);
  const double a = domain.angle_deg * std::numbers::pi / 180.0;
  v.resize(options_.dim);
  for (int64_t i = 0; i < options_.dim; ++i) {
    v[i] = static_cast<float>(std::cos(a) * v0_[i] + std::sin(a) * perp[i]);
  }
}

void SynthGenerator::FeaturesForLength(const SynthDomain& domain,
                                       int64_t length, std::mt19937_64& rng,
                                       float* x) const {
  // Directions are cheap to rebuild relative to generating a large batch,
  // but not per request: cache the last domain per thread.
  thread_local std::string cached_key;
  thread_local std::vector<float> v, o;
  const std::string key = absl::StrCat(
      reinterpret_cast<uintptr_t>(this), "/", domain.name, "/",
      domain.angle_deg, "/", options_.model_seed, "/", options_.dim);
  if (key != cached_key) {
    DomainVectors(domain, v, o);
    cached_key = key;
  }
  const double t =
      (std::log(static_cast<double>(std::max<int64_t>(length, 1))) -
       std::log(domain.median_tokens)) /
      domain.log_sigma;
  std::normal_distribution<double> n01;
  const int64_t d = options_.dim;
  std::vector<double> acc(d);
  const double sig = options_.signal * t;
  const double root_d = std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < d; ++i) acc[i] = sig * v[i] + options_.noise * n01(rng);
  for (const auto& f : nuisance_) {
    const double gj = options_.nuisance * n01(rng);
    for (int64_t i = 0; i < d; ++i) acc[i] += gj * f[i];
  }
  for (int64_t i = 0; i < d; ++i) {
    x[i] = static_cast<float>(mu0_[i] + domain.offset * scale_[i] * o[i] * root_d +
                              scale_[i] * acc[i]);
  }
}

int64_t SynthGenerator::Draw(const SynthDomain& domain, std::mt19937_64& rng,
                             float* x) const {
  std::lognormal_distribution<double> len(std::log(domain.median_tokens),
                                          domain.log_sigma);
  const int64_t l = std::clamp<int64_t>(
      static_cast<int64_t>(std::llround(len(rng))), 1, options_.max_tokens);
  FeaturesForLength(domain, l, rng, x);
  return l;
}

}  // namespace leap::readout
