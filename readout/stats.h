// Rank statistics used to score a readout's predicted lengths against the
// true ones: Spearman's rho, Kendall's tau-b, average ranks, and the mean
// absolute length error by length bucket (LEAP paper, Table 6).
//
// All functions are pure and thread-safe. Passing spans of different sizes
// is a programming error and aborts.
#ifndef LEAP_READOUT_STATS_H_
#define LEAP_READOUT_STATS_H_

#include <cstdint>
#include <span>
#include <vector>

namespace leap::readout {

// Spearman's rho with average ranks for ties (the Pearson correlation of the
// ranks). Returns NaN when n < 2, either input is constant, or any input is
// NaN. O(n log n).
double Spearman(std::span<const double> a, std::span<const double> b);

// Kendall's tau-b (tie-corrected), computed in O(n log n) with Knight's
// algorithm: sort by a then b, count discordant pairs as the swaps of a
// merge sort of b, and correct for ties in a, in b, and joint ties. Returns
// NaN when n < 2, either input is constant, or any input is NaN.
double KendallTauB(std::span<const double> a, std::span<const double> b);

// Average ranks, 1-based: the smallest value gets rank 1 and tied values all
// get the mean of the ranks they span. NaN values get rank NaN and the other
// values are ranked among themselves. O(n log n).
std::vector<double> AverageRanks(std::span<const double> v);

// Mean absolute error of predicted vs. true token counts, overall and per
// true-length bucket as in the LEAP paper's Table 6.
struct LengthErrorReport {
  // Number of (predicted, true) pairs.
  int64_t n = 0;
  // Mean |predicted - true| over all pairs; NaN when n == 0.
  double mae = 0;
  // Pairs whose true length is <= 256, in (256, 1024], and > 1024 tokens.
  int64_t n_short = 0;
  int64_t n_medium = 0;
  int64_t n_long = 0;
  // Mean absolute error within each bucket; NaN for an empty bucket.
  double mae_short = 0;
  double mae_medium = 0;
  double mae_long = 0;
};

// Computes the LengthErrorReport of `predicted_tokens` against `true_tokens`
// (same size; element i of each describes request i). Values are expected to
// be finite: a NaN makes `mae` NaN, and a NaN true length is counted in `n`
// but in no bucket.
LengthErrorReport LengthErrors(std::span<const double> predicted_tokens,
                               std::span<const double> true_tokens);

}  // namespace leap::readout

#endif  // LEAP_READOUT_STATS_H_
