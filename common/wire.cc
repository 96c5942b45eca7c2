#include "common/wire.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace leap {

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
  }
  return "unknown";
}

size_t DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "float32" || n == "fp32" || n == "f32") return DType::kFloat32;
  if (n == "bfloat16" || n == "bf16") return DType::kBFloat16;
  if (n == "float16" || n == "fp16" || n == "f16" || n == "half") {
    return DType::kFloat16;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown feature dtype '", name, "': expected float32, bfloat16 or float16"));
}

absl::string_view FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

}  // namespace leap
