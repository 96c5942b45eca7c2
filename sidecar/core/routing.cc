#include "sidecar/core/routing.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"

namespace leap::sidecar {

absl::Status Route::Validate() const {
  if (arms.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("route '", product_line, "' has no arms"));
  }
  double total = 0;
  int serving = 0;
  std::set<std::string> names;
  for (const Arm& a : arms) {
    if (a.readout.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("arm '", a.name, "' names no readout"));
    }
    if (arms.size() > 1 && a.name.empty()) {
      return absl::InvalidArgumentError(
          "every arm of a multi-arm route needs a name");
    }
    if (!names.insert(a.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate arm name '", a.name, "'"));
    }
    if (a.shadow) continue;
    ++serving;
    if (!(a.percent > 0.0) || a.percent > 100.0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "arm '", a.name, "' percent must be in (0, 100], got ", a.percent));
    }
    total += a.percent;
  }
  if (serving == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("route '", product_line, "' has only shadow arms"));
  }
  if (std::abs(total - 100.0) > 1e-6) {
    return absl::InvalidArgumentError(absl::StrCat(
        "serving arms' percents must sum to 100, got ", total));
  }
  return absl::OkStatus();
}

uint64_t StableRequestHash(absl::string_view request_id) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : request_id) {
    h ^= c;
    h *= 1099511628211ull;
  }
  // FNV's low bits mix poorly for short keys: finalize (splitmix64 step).
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h;
}

absl::StatusOr<const Route*> RoutingTable::Find(
    absl::string_view product_line) const {
  auto it = routes_.find(std::string(product_line));
  if (it == routes_.end()) it = routes_.find("");
  if (it == routes_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no route for product line '", product_line,
        "' and no default route"));
  }
  return &it->second;
}

ArmChoice RoutingTable::Choose(const Route& route,
                               absl::string_view request_id) {
  ArmChoice choice;
  if (route.arms.size() == 1 && !route.arms[0].shadow) {
    choice.serving = &route.arms[0];  // one arm takes everything: no hash
    return choice;
  }
  // Position in [0, 100) with 1e-4 resolution.
  const double pos =
      static_cast<double>(StableRequestHash(request_id) % 1000000) / 1e4;
  double acc = 0;
  for (const Arm& a : route.arms) {
    if (a.shadow) {
      choice.shadows.push_back(&a);
      continue;
    }
    acc += a.percent;
    if (choice.serving == nullptr && pos < acc) choice.serving = &a;
  }
  if (choice.serving == nullptr) {  // rounding at the top end
    for (auto it = route.arms.rbegin(); it != route.arms.rend(); ++it) {
      if (!it->shadow) {
        choice.serving = &*it;
        break;
      }
    }
  }
  return choice;
}

std::shared_ptr<const RoutingTable> RoutingTable::With(Route route) const {
  auto t = std::make_shared<RoutingTable>(*this);
  t->routes_[route.product_line] = std::move(route);
  return t;
}

std::shared_ptr<const RoutingTable> RoutingTable::Without(
    const std::string& product_line) const {
  auto t = std::make_shared<RoutingTable>(*this);
  t->routes_.erase(product_line);
  return t;
}

}  // namespace leap::sidecar
