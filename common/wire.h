// The wire vocabulary shared by the engine shim, leapd and the tools: the
// element type of a feature vector and why a request ended. One definition;
// the numeric values are part of the wire (proto/leap/v1) and file formats:
// never renumber.
#ifndef LEAP_COMMON_WIRE_H_
#define LEAP_COMMON_WIRE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace leap {

// Element type of a feature vector.
enum class DType : uint8_t {
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
};

// "float32", "bfloat16", "float16".
absl::string_view DTypeName(DType dtype);
// Bytes per element: 4 or 2.
size_t DTypeSize(DType dtype);
// Parses "float32"/"fp32"/"f32", "bfloat16"/"bf16", "float16"/"fp16"/"f16".
absl::StatusOr<DType> ParseDType(absl::string_view name);

// Why a request ended, as reported by the engine.
enum class FinishReason : uint8_t {
  kStop = 1,       // natural end: EOS token or a stop string
  kLength = 2,     // hit its max_tokens limit
  kCancelled = 3,  // cancelled by the client
  kAborted = 4,    // aborted by the engine (error, preemption without resume)
};

// "stop", "length", "cancelled", "aborted".
absl::string_view FinishReasonName(FinishReason reason);

}  // namespace leap

#endif  // LEAP_COMMON_WIRE_H_
