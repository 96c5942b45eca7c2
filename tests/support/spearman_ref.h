// An FP64 Spearman reference for tests: average ranks for ties, written
// apart from readout/stats.cc so that tests check the product against it.
#ifndef LEAP_TESTS_SUPPORT_SPEARMAN_REF_H_
#define LEAP_TESTS_SUPPORT_SPEARMAN_REF_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace leap::testing {

// Spearman of (a, b) pairs with average ranks, FP64; NAN below 2 pairs or
// when either side is constant.
inline double RefSpearman(const std::vector<std::pair<double, double>>& pairs) {
  const size_t n = pairs.size();
  if (n < 2) return NAN;
  auto ranks = [n](const std::vector<double>& v) {
    std::vector<size_t> idx(n);
    for (size_t i = 0; i < n; ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
    std::vector<double> r(n);
    for (size_t i = 0; i < n;) {
      size_t j = i;
      while (j + 1 < n && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (size_t k = i; k <= j; ++k) r[idx[k]] = (static_cast<double>(i + j) / 2.0) + 1.0;
      i = j + 1;
    }
    return r;
  };
  std::vector<double> a(n), b(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = pairs[i].first;
    b[i] = pairs[i].second;
  }
  const std::vector<double> ra = ranks(a), rb = ranks(b);
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) {
    ma += ra[i];
    mb += rb[i];
  }
  ma /= static_cast<double>(n);
  mb /= static_cast<double>(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (ra[i] - ma) * (rb[i] - mb);
    saa += (ra[i] - ma) * (ra[i] - ma);
    sbb += (rb[i] - mb) * (rb[i] - mb);
  }
  if (saa == 0 || sbb == 0) return NAN;
  return sab / std::sqrt(saa * sbb);
}

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SPEARMAN_REF_H_
