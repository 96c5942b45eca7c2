#include "tools/leapctl/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "readout/features.h"
#include "readout/target.h"

namespace leap::leapctl {
namespace {

absl::Status Invalid(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("(", absl::StrJoin(shape, ", "),
                      shape.size() == 1 ? ",)" : ")");
}

std::string DTypeString(NpyDType dtype) {
  return std::string(NpyDTypeName(dtype));
}

// Reads a 1-D integer array of `expected_rows` elements as int64.
absl::StatusOr<std::vector<int64_t>> LoadIntVector(
    const std::string& path, absl::string_view what, int64_t expected_rows,
    const std::string& features_path) {
  ASSIGN_OR_RETURN(NpyArray a, ReadNpy(path));
  if (a.dtype != NpyDType::kInt32 && a.dtype != NpyDType::kInt64) {
    return Invalid(path, absl::StrCat(what, " must be int32 or int64, got ",
                                      DTypeString(a.dtype)));
  }
  if (a.shape.size() != 1) {
    return Invalid(path,
                   absl::StrCat(what, " must be a 1-D array [n], got shape ",
                                ShapeString(a.shape)));
  }
  if (a.shape[0] != expected_rows) {
    return Invalid(path, absl::StrCat("shape mismatch: has ", a.shape[0], " ",
                                      what, " but ", features_path, " has ",
                                      expected_rows, " feature rows"));
  }
  std::vector<int64_t> out(static_cast<size_t>(a.shape[0]));
  if (a.dtype == NpyDType::kInt32) {
    const int32_t* p = a.as<int32_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    const int64_t* p = a.as<int64_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  }
  return out;
}

}  // namespace

absl::StatusOr<LoadedFeatures> LoadFeatures(const std::string& path) {
  LoadedFeatures f;
  f.path = path;
  ASSIGN_OR_RETURN(f.array, ReadNpy(path));
  const NpyArray& a = f.array;
  readout::DType dtype;
  if (a.dtype == NpyDType::kFloat32) {
    dtype = readout::DType::kFloat32;
  } else if (a.dtype == NpyDType::kFloat16) {
    dtype = readout::DType::kFloat16;
  } else {
    return Invalid(
        path, absl::StrCat("unsupported feature dtype ", DTypeString(a.dtype),
                           " (expected float32 or float16)"));
  }
  if (a.shape.size() != 2) {
    return Invalid(path, absl::StrCat("features must be a 2-D array [n, d], "
                                      "got shape ",
                                      ShapeString(a.shape)));
  }
  if (a.shape[0] < 1) return Invalid(path, "features have no rows");
  if (a.shape[1] < readout::kMinDim || a.shape[1] > readout::kMaxDim) {
    return Invalid(
        path, absl::StrCat("feature width d must be in [", readout::kMinDim,
                           ", ", readout::kMaxDim, "], got ", a.shape[1]));
  }
  f.matrix.data = a.data.data();
  f.matrix.dtype = dtype;
  f.matrix.rows = a.shape[0];
  f.matrix.cols = a.shape[1];
  f.matrix.row_stride = a.shape[1];
  return f;
}

absl::Status CheckFinite(const LoadedFeatures& features) {
  const int64_t n = features.rows();
  const int64_t d = features.cols();
  const auto report = [&](int64_t index, float v) {
    return Invalid(features.path,
                   absl::StrCat("row ", index / d, " column ", index % d,
                                " is not finite (", v, ")"));
  };
  if (features.matrix.dtype == readout::DType::kFloat32) {
    const float* p = features.array.as<float>();
    for (int64_t i = 0; i < n * d; ++i) {
      if (!std::isfinite(p[i])) return report(i, p[i]);
    }
  } else {
    const uint16_t* p = features.array.as<uint16_t>();
    for (int64_t i = 0; i < n * d; ++i) {
      // All-ones exponent: infinity or NaN.
      if ((p[i] & 0x7C00u) == 0x7C00u) return report(i, Fp16ToFloat(p[i]));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> LoadLengths(
    const std::string& path, int64_t expected_rows,
    const std::string& features_path) {
  ASSIGN_OR_RETURN(
      std::vector<int64_t> v,
      LoadIntVector(path, "lengths", expected_rows, features_path));
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] > readout::kMaxReportedTokens) {
      return Invalid(path,
                     absl::StrCat("length ", i, " is ", v[i], ", outside [0, ",
                                  readout::kMaxReportedTokens, "]"));
    }
  }
  return v;
}

absl::StatusOr<std::vector<int32_t>> LoadFinishReasons(
    const std::string& path, int64_t expected_rows,
    const std::string& features_path) {
  ASSIGN_OR_RETURN(
      std::vector<int64_t> v,
      LoadIntVector(path, "finish reasons", expected_rows, features_path));
  std::vector<int32_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 1 || v[i] > 4) {
      return Invalid(path, absl::StrCat("finish reason ", i, " is ", v[i],
                                        "; expected 1 (stop), 2 (length), "
                                        "3 (cancelled) or 4 (aborted)"));
    }
    out[i] = static_cast<int32_t>(v[i]);
  }
  return out;
}

absl::StatusOr<LabeledFeatures> LoadLabeledFeatures(
    const std::string& features_path, const std::string& lengths_path,
    const std::string& reasons_path,
    const std::function<absl::Status(const LoadedFeatures&)>& check_width) {
  LabeledFeatures out;
  ASSIGN_OR_RETURN(out.features, LoadFeatures(features_path));
  if (check_width) RETURN_IF_ERROR(check_width(out.features));
  RETURN_IF_ERROR(CheckFinite(out.features));
  ASSIGN_OR_RETURN(out.lengths, LoadLengths(lengths_path, out.features.rows(),
                                            features_path));
  if (!reasons_path.empty()) {
    ASSIGN_OR_RETURN(out.reasons,
                     LoadFinishReasons(reasons_path, out.features.rows(),
                                       features_path));
  }
  return out;
}

}  // namespace leap::leapctl
