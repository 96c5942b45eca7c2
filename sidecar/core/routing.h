// Routing: which readout (or A/B arms) serves a product line.
#ifndef LEAP_SIDECAR_CORE_ROUTING_H_
#define LEAP_SIDECAR_CORE_ROUTING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace leap::sidecar {

struct Arm {
  std::string name;
  std::string readout;
  // Share of traffic in percent; non-shadow arms of a route sum to 100.
  double percent = 100.0;
  // Scored and measured on every request, never returned to the engine.
  bool shadow = false;
};

struct Route {
  // "" is the default route.
  std::string product_line;
  std::vector<Arm> arms;

  // At least one non-shadow arm, percents in (0, 100] summing to 100
  // (within 1e-6), unique non-empty arm names, readout names set.
  absl::Status Validate() const;
};

// Stable 64-bit FNV-1a of a request id: the same id maps to the same arm in
// every process and every version of leapd (never use a seeded hash here).
uint64_t StableRequestHash(absl::string_view request_id);

// The arms that score one request: the serving arm, then the shadows.
struct ArmChoice {
  const Arm* serving = nullptr;
  std::vector<const Arm*> shadows;
};

// An immutable routing table. Replace it as a whole (copy, modify, publish)
// so readers never lock: see RoutingTable::With / Without.
class RoutingTable {
 public:
  // The route for `product_line`, falling back to the default route "".
  // NotFound when neither exists.
  absl::StatusOr<const Route*> Find(absl::string_view product_line) const;
  // Picks the serving arm by the request id's stable hash (basis points of
  // the cumulative percents, in arm order) plus every shadow arm.
  static ArmChoice Choose(const Route& route, absl::string_view request_id);

  std::shared_ptr<const RoutingTable> With(Route route) const;
  std::shared_ptr<const RoutingTable> Without(
      const std::string& product_line) const;
  const std::map<std::string, Route>& routes() const { return routes_; }

 private:
  std::map<std::string, Route> routes_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_ROUTING_H_
