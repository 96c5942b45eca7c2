#include "engine_shim/python/py_scheduler.h"

#include <pybind11/stl.h>

#include <iterator>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "engine_shim/client.h"
#include "engine_shim/python/py_convert.h"

namespace leap::shim::python {

namespace py = pybind11;

void PyScheduler::Add(const std::string& id, const py::object& carried) {
  if (carried.is_none()) {
    Check(s_.Add(id));
  } else {
    if (!py::isinstance<py::dict>(carried)) {
      throw py::type_error(absl::StrCat(
          "carried must be None or a dict from carry(), got ",
          std::string(py::str(py::type::handle_of(carried).attr("__name__")))));
    }
    const py::dict d = carried.cast<py::dict>();
    CarriedDeadline c;
    const std::pair<const char*, double*> fields[] = {
        {"age", &c.age},
        {"virtual_left", &c.virtual_left},
        {"virtual_estimate", &c.virtual_estimate},
        {"tail_reference", &c.tail_reference}};
    for (const auto& [name, field] : fields) {
      if (!d.contains(name)) {
        throw py::value_error(
            absl::StrCat("carried deadline of ", id, " lacks '", name, "'"));
      }
      try {
        *field = d[name].cast<double>();
      } catch (const py::cast_error&) {
        throw py::value_error(absl::StrCat("carried deadline of ", id, ": '",
                                           name, "' is not a number"));
      }
    }
    // Optional (absent in dicts from before they existed): the flags.
    size_t flags = 0;
    const std::pair<const char*, bool*> flag_fields[] = {
        {"was_urgent", &c.was_urgent},
        {"gave_up", &c.gave_up},
        {"holds_credit", &c.holds_credit}};
    for (const auto& [name, field] : flag_fields) {
      if (!d.contains(name)) continue;
      ++flags;
      if (!py::isinstance<py::bool_>(d[name])) {
        throw py::value_error(absl::StrCat("carried deadline of ", id, ": '",
                                           name, "' is not a bool"));
      }
      *field = d[name].cast<bool>();
    }
    if (d.size() != std::size(fields) + flags) {
      throw py::value_error(absl::StrCat(
          "carried deadline of ", id,
          " takes age, virtual_left, virtual_estimate, tail_reference and "
          "optionally was_urgent, gave_up and holds_credit, got ",
          d.size(), " keys"));
    }
    Check(s_.Add(id, c));
  }
  version_.erase(id);
}

py::dict PyScheduler::Carry(const std::string& id) const {
  absl::StatusOr<CarriedDeadline> c = s_.Carry(id);
  if (!c.ok()) ThrowStatus(c.status());
  py::dict d;
  d["age"] = c->age;
  d["virtual_left"] = c->virtual_left;
  d["virtual_estimate"] = c->virtual_estimate;
  d["tail_reference"] = c->tail_reference;
  d["was_urgent"] = c->was_urgent;
  d["gave_up"] = c->gave_up;
  d["holds_credit"] = c->holds_credit;
  return d;
}

void PyScheduler::SetTime(double now_s, double step_s) {
  Check(s_.SetTime(now_s, step_s));
}

void PyScheduler::ObserveCompletion(double estimate_tokens,
                                    double actual_tokens) {
  Check(s_.ObserveCompletion(estimate_tokens, actual_tokens));
}

void PyScheduler::ObserveLatency(double latency_s) {
  Check(s_.ObserveLatency(latency_s));
}

void PyScheduler::Commit(const std::vector<std::string>& ran) {
  Check(s_.Commit(ran));
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
  d["prior_tokens"] = r->prior_tokens.has_value()
                          ? py::object(py::float_(*r->prior_tokens))
                          : py::object(py::none());
  d["added_step"] = r->added_step;
  d["waited_total"] = r->waited_total;
  d["deadline"] = r->deadline.has_value()
                      ? py::object(py::float_(*r->deadline))
                      : py::object(py::none());
  d["deadline_origin"] = r->deadline_origin;
  d["was_urgent"] = r->was_urgent;
  d["gave_up"] = r->gave_up;
  d["holds_credit"] = r->holds_credit;
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
  d["urgent_selections"] = c.urgent_selections;
  d["deadlines_given_up"] = c.deadlines_given_up;
  d["credit_give_ups"] = c.credit_give_ups;
  d["latencies_observed"] = c.latencies_observed;
  d["latencies_beyond_target"] = c.latencies_beyond_target;
  d["added"] = c.added;
  d["removed"] = c.removed;
  return d;
}

void PyScheduler::Check(const absl::Status& s) {
  if (!s.ok()) ThrowStatus(s);
}

}  // namespace leap::shim::python
