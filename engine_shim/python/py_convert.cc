#include "engine_shim/python/py_convert.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace leap::shim::python {

namespace py = pybind11;

[[noreturn]] void ThrowStatus(const absl::Status& s) {
  std::string msg(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
      throw py::value_error(msg);
    case absl::StatusCode::kNotFound:
      throw py::key_error(msg);
    default:
      throw std::runtime_error(
          absl::StrCat(absl::StatusCodeToString(s.code()), ": ", msg));
  }
}

DType ParseDType(std::string name) {
  // Also takes str(torch.float16) etc.
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  if (name == "float32" || name == "float") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16" || name == "half") return DType::kFloat16;
  throw py::value_error(absl::StrCat(
      "dtype must be 'float32', 'bfloat16' or 'float16', got '", name, "'"));
}

FinishReason ParseReason(const std::string& reason) {
  if (reason == "stop") return FinishReason::kStop;
  if (reason == "length") return FinishReason::kLength;
  if (reason == "cancelled") return FinishReason::kCancelled;
  if (reason == "aborted") return FinishReason::kAborted;
  throw py::value_error(absl::StrCat(
      "reason must be 'stop', 'length', 'cancelled' or 'aborted', got '",
      reason, "'"));
}

const char* KindName(Event::Kind k) {
  switch (k) {
    case Event::Kind::kPrediction:
      return "prediction";
    case Event::Kind::kRescore:
      return "rescore";
    case Event::Kind::kError:
      return "error";
    case Event::Kind::kConnected:
      return "connected";
    case Event::Kind::kDisconnected:
      return "disconnected";
    case Event::Kind::kPrior:
      return "prior";
  }
  return "unknown";
}

Event::Kind ParseKind(const std::string& kind) {
  for (Event::Kind k :
       {Event::Kind::kPrediction, Event::Kind::kRescore, Event::Kind::kError,
        Event::Kind::kConnected, Event::Kind::kDisconnected,
        Event::Kind::kPrior}) {
    if (kind == KindName(k)) return k;
  }
  throw py::value_error(absl::StrCat(
      "kind must be 'prediction', 'rescore', 'error', 'connected', "
      "'disconnected' or 'prior', got '",
      kind, "'"));
}

absl::Duration Seconds(double s, const char* what) {
  if (std::isnan(s) || s < 0) {
    throw py::value_error(absl::StrCat(what, " must be >= 0 seconds, got ", s));
  }
  return std::isinf(s) ? absl::InfiniteDuration() : absl::Seconds(s);
}

UnpredictedPolicy ParsePolicy(const std::string& p) {
  if (p == "median") return UnpredictedPolicy::kMedian;
  if (p == "fixed") return UnpredictedPolicy::kFixed;
  if (p == "first") return UnpredictedPolicy::kFirst;
  if (p == "last") return UnpredictedPolicy::kLast;
  throw py::value_error(absl::StrCat(
      "unpredicted must be 'median', 'fixed', 'first' or 'last', got '", p,
      "'"));
}

SchedulingPolicy ParseSchedulingPolicy(const std::string& p) {
  if (p == "countdown") return SchedulingPolicy::kCountdown;
  if (p == "bounded") return SchedulingPolicy::kBounded;
  if (p == "hrrn") return SchedulingPolicy::kHrrn;
  if (p == "linear-aging") return SchedulingPolicy::kLinearAging;
  throw py::value_error(absl::StrCat(
      "policy must be 'countdown', 'bounded', 'hrrn' or 'linear-aging', got '",
      p, "'"));
}

std::string EventRepr(const Event& e) {
  std::string s = absl::StrCat("Event(kind='", KindName(e.kind), "'");
  if (!e.request_id.empty())
    absl::StrAppend(&s, ", request_id='", e.request_id, "'");
  if (e.kind == Event::Kind::kPrediction || e.kind == Event::Kind::kRescore) {
    absl::StrAppend(&s, ", predicted_tokens=", e.predicted_tokens,
                    ", score=", e.score, ", readout='", e.readout,
                    "', version=", e.version);
  }
  if (e.kind == Event::Kind::kPrior) {
    absl::StrAppend(&s, ", predicted_tokens=", e.predicted_tokens);
  }
  if (e.code != 0) absl::StrAppend(&s, ", code=", e.code);
  if (!e.message.empty()) absl::StrAppend(&s, ", message='", e.message, "'");
  return s + ")";
}

}  // namespace leap::shim::python
