// Synthetic hidden-state-like features with a controllable output-length
// signal and domain shift, for tests, demos and replay.
//
// Model of the data. A fixed "serving model" is drawn once from
// `model_seed`: a base mean mu0 (a few "massive activation" features with
// large means, as real hidden states have), per-feature scales s, r nuisance
// directions f_1..f_r, a base length direction v0, and for every domain a
// unit direction orthogonal to v0 and an offset direction. A request of
// domain D with true output length L gets
//   t = (ln L - ln median_D) / log_sigma_D          (standardized log length)
//   x = mu0 + offset_D * o_D + s * (signal * t * v_D + sum_j g_j f_j + eps)
// with v_D = cos(angle_D) v0 + sin(angle_D) v_perp_D, g_j ~ N(0, nuisance^2),
// eps ~ N(0, noise^2 I). Lengths are log-normal per domain, clipped to
// [1, max_tokens]. A readout fitted on one domain sees the length signal of
// another through cos(angle): the angle controls how badly a frozen readout
// transfers, and RLS can learn the new direction from feedback.
#ifndef LEAP_READOUT_SYNTH_H_
#define LEAP_READOUT_SYNTH_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace leap::readout {

// One traffic domain.
struct SynthDomain {
  std::string name;
  // Median output length (tokens) and sigma of ln(length).
  double median_tokens = 300;
  double log_sigma = 0.9;
  // Angle (degrees) between this domain's length direction and the base one.
  double angle_deg = 0;
  // Mean shift of the features, in units of the per-feature scale.
  double offset = 0;
};

// Built-in domains: "chat" (the source: median 300, angle 0), "translation"
// (long outputs: median 900, angle 64), "summarization" (short outputs, angle 45),
// "code" (angle 30). NotFound for other names.
absl::StatusOr<SynthDomain> BuiltinDomain(const std::string& name);
std::vector<std::string> BuiltinDomainNames();

struct SynthOptions {
  // Feature width d. Default: 4096
  int64_t dim = 4096;
  // Output budget M; lengths are clipped to [1, M]. Default: 2048
  int64_t max_tokens = 2048;
  // Seed of the fixed model (directions, means, scales). Files meant to be
  // used together (train / shifted / held-out) must share it. Default: 7
  uint64_t model_seed = 7;
  // Amplitude of the length signal along v_D. With the other defaults a
  // Ridge readout reaches Spearman ~0.8 in domain and ~0.45-0.5 frozen on
  // "translation" (the paper's Aya-like shift). Default: 1.6
  double signal = 1.6;
  // Rank and amplitude of the nuisance factors. Default: 16, 2.0
  int nuisance_rank = 16;
  double nuisance = 2.0;
  // Isotropic noise amplitude. Default: 1.0
  double noise = 1.0;

  absl::Status Validate() const;
};

// Draws features. Thread-compatible: const methods may run concurrently,
// each with its own rng.
class SynthGenerator {
 public:
  static absl::StatusOr<SynthGenerator> Create(const SynthOptions& options);

  // Draws a length of `domain` and its features into x[0..dim). Returns the
  // length.
  int64_t Draw(const SynthDomain& domain, std::mt19937_64& rng,
               float* x) const;
  // Features of a request of `domain` whose true output length is `length`.
  void FeaturesForLength(const SynthDomain& domain, int64_t length,
                         std::mt19937_64& rng, float* x) const;

  const SynthOptions& options() const { return options_; }

 private:
  explicit SynthGenerator(const SynthOptions& options) : options_(options) {}
  // Unit vector for a domain name, orthogonal to v0 (cached by name hash).
  void DomainVectors(const SynthDomain& domain, std::vector<float>& v,
                     std::vector<float>& o) const;

  SynthOptions options_;
  std::vector<float> mu0_, scale_, v0_;
  std::vector<std::vector<float>> nuisance_;
};

}  // namespace leap::readout

#endif  // LEAP_READOUT_SYNTH_H_
