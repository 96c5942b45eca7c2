// leap_shim's conversions between Python values and the shim's C++ types:
// absl::Status to Python exceptions, option strings to enums, seconds to
// absl::Duration, an Event's repr. Internal to the leap_shim module.
//
// absl::Status becomes a Python exception here and nowhere else:
// InvalidArgument/OutOfRange/AlreadyExists -> ValueError, NotFound ->
// KeyError, anything else -> RuntimeError naming the status code.
//
// Threads: stateless; the functions that throw pybind11 exceptions are
// called with the GIL held.
#ifndef LEAP_ENGINE_SHIM_PYTHON_PY_CONVERT_H_
#define LEAP_ENGINE_SHIM_PYTHON_PY_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine_shim/client.h"
#include "engine_shim/scheduler.h"

namespace leap::shim::python {

[[noreturn]] void ThrowStatus(const absl::Status& s);

// "float32"/"float", "bfloat16", "float16"/"half" (also str(torch.float16)
// etc.); anything else is a ValueError.
DType ParseDType(std::string name);
// "stop", "length", "cancelled", "aborted".
FinishReason ParseReason(const std::string& reason);
// An event kind's Python name ('prediction', ...), and back.
const char* KindName(Event::Kind k);
Event::Kind ParseKind(const std::string& kind);
// Seconds >= 0 (inf: forever) as a Duration; `what` names the argument in
// the ValueError.
absl::Duration Seconds(double s, const char* what);
// The Scheduler's "unpredicted" and "policy" options.
UnpredictedPolicy ParsePolicy(const std::string& p);
SchedulingPolicy ParseSchedulingPolicy(const std::string& p);
// Event.__repr__.
std::string EventRepr(const Event& e);

}  // namespace leap::shim::python

#endif  // LEAP_ENGINE_SHIM_PYTHON_PY_CONVERT_H_
