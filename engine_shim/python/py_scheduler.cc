#include "engine_shim/python/py_scheduler.h"

#include <pybind11/stl.h>

#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine_shim/client.h"
#include "engine_shim/python/py_convert.h"

namespace leap::shim::python {

namespace py = pybind11;

void PyScheduler::Add(const std::string& id) {
  Check(s_.Add(id));
  version_.erase(id);
}

void PyScheduler::SetPrediction(const std::string& id, double tokens) {
  Check(s_.SetPrediction(id, tokens));
}

void PyScheduler::Rescore(const std::string& id, double tokens) {
  Check(s_.Rescore(id, tokens));
}

void PyScheduler::SetPrior(const std::string& id, double tokens) {
  Check(s_.SetPrior(id, tokens));
}

void PyScheduler::Remove(const std::string& id) {
  Check(s_.Remove(id));
  version_.erase(id);
}

std::vector<std::string> PyScheduler::Select(std::optional<int> slots) {
  return slots.has_value() ? s_.Select(*slots) : s_.Select();
}

int PyScheduler::Apply(py::iterable events) {
  int applied = 0;
  for (py::handle h : events) {
    if (!py::isinstance<Event>(h)) {
      throw py::type_error(absl::StrCat(
          "apply() takes leap_shim.Event objects, got ",
          std::string(py::str(py::type::handle_of(h).attr("__name__")))));
    }
    const Event& e = h.cast<const Event&>();
    if (e.kind == Event::Kind::kPrior) {
      // Ignored by the scheduler once the request is predicted.
      if (s_.SetPrior(e.request_id, e.predicted_tokens).ok()) ++applied;
      continue;
    }
    if (e.kind != Event::Kind::kPrediction && e.kind != Event::Kind::kRescore) {
      continue;
    }
    auto v = version_.find(e.request_id);
    if (v != version_.end() && e.version < v->second) continue;  // stale
    // Rescore also takes a first prediction; a prediction after a
    // sidecar restart (same or newer version) replaces the old one.
    if (!s_.Rescore(e.request_id, e.predicted_tokens).ok()) continue;
    version_[e.request_id] = e.version;
    ++applied;
  }
  return applied;
}

py::dict PyScheduler::Request(const std::string& id) const {
  absl::StatusOr<RequestStats> r = s_.GetRequest(id);
  if (!r.ok()) ThrowStatus(r.status());
  py::dict d;
  d["predicted_tokens"] = r->predicted_tokens.has_value()
                              ? py::object(py::float_(*r->predicted_tokens))
                              : py::object(py::none());
  d["generated"] = r->generated;
  d["steps_waited"] = r->steps_waited;
  d["arrival"] = r->arrival;
  d["predictions"] = r->predictions;
  return d;
}

py::dict PyScheduler::Counters() const {
  const SchedulerCounters& c = s_.counters();
  py::dict d;
  d["steps"] = c.steps;
  d["selections"] = c.selections;
  d["cap_promotions"] = c.cap_promotions;
  d["aging_promotions"] = c.aging_promotions;
  d["max_steps_waited"] = c.max_steps_waited;
  d["added"] = c.added;
  d["removed"] = c.removed;
  return d;
}

void PyScheduler::Check(const absl::Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

}  // namespace leap::shim::python
