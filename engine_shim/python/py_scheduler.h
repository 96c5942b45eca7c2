// leap_shim.Scheduler: a CountdownScheduler (engine_shim/scheduler.h) for
// Python engines. Internal to the leap_shim module (module.cc registers it).
//
// Threads: not thread-safe, like the scheduler; every method runs with the
// GIL, called from the engine's step loop.
#ifndef LEAP_ENGINE_SHIM_PYTHON_PY_SCHEDULER_H_
#define LEAP_ENGINE_SHIM_PYTHON_PY_SCHEDULER_H_

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "engine_shim/scheduler.h"

namespace leap::shim::python {

// The Python Scheduler: a CountdownScheduler plus the version of the
// prediction applied last per request, so apply() keeps the newest one.
class PyScheduler {
 public:
  explicit PyScheduler(CountdownScheduler s) : s_(std::move(s)) {}

  // `carried`: None, or a dict from Carry() (age, virtual_left,
  // virtual_estimate, tail_reference, and optionally the bools was_urgent,
  // gave_up and holds_credit) of another stage's scheduler.
  void Add(const std::string& id, const pybind11::object& carried);
  pybind11::dict Carry(const std::string& id) const;
  void SetTime(double now_s, double step_s);
  void ObserveCompletion(double estimate_tokens, double actual_tokens);
  void ObserveLatency(double latency_s);
  double TargetScale() const { return s_.target_scale(); }
  double TargetCredits() const { return s_.target_credits(); }
  int64_t CreditsSetAside() const { return s_.credits_set_aside(); }
  double ServiceCorrection() { return s_.service_correction(); }
  double ServiceRatio(double estimate_tokens) {
    return s_.service_ratio(estimate_tokens);
  }
  std::vector<std::string> Order(size_t k) { return s_.Order(k); }
  void Commit(const std::vector<std::string>& ran);
  void CommitIdle(int64_t steps) { Check(s_.CommitIdle(steps)); }
  void SetPrediction(const std::string& id, double tokens);
  void Rescore(const std::string& id, double tokens);
  void SetPrior(const std::string& id, double tokens);
  void Remove(const std::string& id);
  std::vector<std::string> Select(std::optional<int> slots);
  int Apply(pybind11::iterable events);
  pybind11::dict Request(const std::string& id) const;
  pybind11::dict Counters() const;
  size_t size() const { return s_.size(); }
  bool Contains(const std::string& id) const { return s_.GetRequest(id).ok(); }

 private:
  static void Check(const absl::Status& s);

  CountdownScheduler s_;
  absl::flat_hash_map<std::string, int64_t> version_;
};

}  // namespace leap::shim::python

#endif  // LEAP_ENGINE_SHIM_PYTHON_PY_SCHEDULER_H_
