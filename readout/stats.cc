#include "readout/stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <utility>

namespace leap::readout {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Mismatched spans are a caller bug, not bad input: crash loudly.
void CheckSameSize(std::span<const double> a, std::span<const double> b,
                   const char* function) {
  if (a.size() != b.size()) {
    std::fprintf(stderr, "leap::readout::%s: sizes differ (%zu vs %zu)\n",
                 function, a.size(), b.size());
    std::abort();
  }
}

bool AnyNaN(std::span<const double> v) {
  return std::any_of(v.begin(), v.end(),
                     [](double x) { return std::isnan(x); });
}

// Number of pairs among `count` tied items.
int64_t Pairs(int64_t count) { return count * (count - 1) / 2; }

// Sum of Pairs(run length) over the runs of equal values of sorted `v`.
int64_t TiedPairs(const std::vector<double>& v) {
  int64_t total = 0;
  size_t start = 0;
  for (size_t i = 1; i <= v.size(); ++i) {
    if (i == v.size() || v[i] != v[start]) {
      total += Pairs(static_cast<int64_t>(i - start));
      start = i;
    }
  }
  return total;
}

// Sorts `v` ascending with a bottom-up merge sort and returns the number of
// pairs i < j with v[i] > v[j] in the input (equal values are not counted).
int64_t SortCountingInversions(std::vector<double>& v) {
  const size_t n = v.size();
  std::vector<double> buf(n);
  int64_t inversions = 0;
  for (size_t width = 1; width < n; width *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * width) {
      const size_t mid = std::min(lo + width, n);
      const size_t hi = std::min(lo + 2 * width, n);
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) {
        if (v[j] < v[i]) {
          // v[j] jumps ahead of every remaining element of the left run.
          inversions += static_cast<int64_t>(mid - i);
          buf[k++] = v[j++];
        } else {
          buf[k++] = v[i++];
        }
      }
      while (i < mid) buf[k++] = v[i++];
      while (j < hi) buf[k++] = v[j++];
    }
    v.swap(buf);
  }
  return inversions;
}

}  // namespace

std::vector<double> AverageRanks(std::span<const double> v) {
  std::vector<size_t> order;
  order.reserve(v.size());
  std::vector<double> ranks(v.size(), kNaN);
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isnan(v[i])) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t x, size_t y) { return v[x] < v[y]; });
  size_t start = 0;
  for (size_t i = 1; i <= order.size(); ++i) {
    if (i == order.size() || v[order[i]] != v[order[start]]) {
      // Positions start..i-1 hold 1-based ranks start+1..i; mean is below.
      const double rank = 0.5 * static_cast<double>(start + 1 + i);
      for (size_t k = start; k < i; ++k) ranks[order[k]] = rank;
      start = i;
    }
  }
  return ranks;
}

double Spearman(std::span<const double> a, std::span<const double> b) {
  CheckSameSize(a, b, "Spearman");
  const size_t n = a.size();
  if (n < 2 || AnyNaN(a) || AnyNaN(b)) return kNaN;
  const std::vector<double> ra = AverageRanks(a);
  const std::vector<double> rb = AverageRanks(b);
  // Average ranks of n values always have mean (n + 1) / 2.
  const double mean = 0.5 * static_cast<double>(n + 1);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    const double da = ra[i] - mean;
    const double db = rb[i] - mean;
    sab += da * db;
    saa += da * da;
    sbb += db * db;
  }
  if (saa == 0 || sbb == 0) return kNaN;
  return std::clamp(sab / std::sqrt(saa * sbb), -1.0, 1.0);
}

double KendallTauB(std::span<const double> a, std::span<const double> b) {
  CheckSameSize(a, b, "KendallTauB");
  const size_t n = a.size();
  if (n < 2 || AnyNaN(a) || AnyNaN(b)) return kNaN;

  std::vector<std::pair<double, double>> pairs(n);
  for (size_t i = 0; i < n; ++i) pairs[i] = {a[i], b[i]};
  std::sort(pairs.begin(), pairs.end());

  // n1: pairs tied in a; n3: pairs tied in both a and b.
  int64_t n1 = 0, n3 = 0;
  size_t a_start = 0, ab_start = 0;
  for (size_t i = 1; i <= n; ++i) {
    if (i == n || pairs[i] != pairs[ab_start]) {
      n3 += Pairs(static_cast<int64_t>(i - ab_start));
      ab_start = i;
    }
    if (i == n || pairs[i].first != pairs[a_start].first) {
      n1 += Pairs(static_cast<int64_t>(i - a_start));
      a_start = i;
    }
  }

  // With a ascending (b ascending within ties of a), every inversion of b is
  // a discordant pair and no pair tied in a or b is an inversion.
  std::vector<double> bs(n);
  for (size_t i = 0; i < n; ++i) bs[i] = pairs[i].second;
  const int64_t discordant = SortCountingInversions(bs);
  const int64_t n2 = TiedPairs(bs);  // pairs tied in b

  const int64_t n0 = Pairs(static_cast<int64_t>(n));
  if (n0 == n1 || n0 == n2) return kNaN;  // a or b constant
  // concordant - discordant = (n0 - n1 - n2 + n3) - 2 * discordant.
  const double numerator =
      static_cast<double>(n0 - n1 - n2 + n3 - 2 * discordant);
  const double denominator = std::sqrt(static_cast<double>(n0 - n1)) *
                             std::sqrt(static_cast<double>(n0 - n2));
  return std::clamp(numerator / denominator, -1.0, 1.0);
}

LengthErrorReport LengthErrors(std::span<const double> predicted_tokens,
                               std::span<const double> true_tokens) {
  CheckSameSize(predicted_tokens, true_tokens, "LengthErrors");
  double sum = 0, sum_short = 0, sum_medium = 0, sum_long = 0;
  LengthErrorReport r;
  r.n = static_cast<int64_t>(true_tokens.size());
  for (size_t i = 0; i < true_tokens.size(); ++i) {
    const double t = true_tokens[i];
    const double err = std::abs(predicted_tokens[i] - t);
    sum += err;
    if (std::isnan(t)) continue;  // in n and mae (now NaN) but no bucket
    if (t <= 256) {
      ++r.n_short;
      sum_short += err;
    } else if (t <= 1024) {
      ++r.n_medium;
      sum_medium += err;
    } else {
      ++r.n_long;
      sum_long += err;
    }
  }
  auto mean = [](double s, int64_t count) {
    return count == 0 ? kNaN : s / static_cast<double>(count);
  };
  r.mae = mean(sum, r.n);
  r.mae_short = mean(sum_short, r.n_short);
  r.mae_medium = mean(sum_medium, r.n_medium);
  r.mae_long = mean(sum_long, r.n_long);
  return r;
}

}  // namespace leap::readout
