// Loading and checking leapctl's input files: feature matrices, output
// lengths and finish reasons as .npy arrays. Every error message starts with
// the path of the offending file and says what is wrong with it.
#ifndef LEAP_TOOLS_LEAPCTL_DATA_H_
#define LEAP_TOOLS_LEAPCTL_DATA_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file.h"
#include "common/npy.h"
#include "readout/ridge.h"

namespace leap::leapctl {

// A feature file held in memory: float32 or float16, shape [n, d] with
// n >= 1 and d in [kMinDim, kMaxDim]. `matrix` views `array.data` in place,
// so a LoadedFeatures must not be copied; it is move-only.
struct LoadedFeatures {
  std::string path;
  NpyArray array;
  readout::FeatureMatrix matrix;

  LoadedFeatures() = default;
  LoadedFeatures(const LoadedFeatures&) = delete;
  LoadedFeatures& operator=(const LoadedFeatures&) = delete;
  LoadedFeatures(LoadedFeatures&&) = default;
  LoadedFeatures& operator=(LoadedFeatures&&) = default;

  int64_t rows() const { return matrix.rows; }
  int64_t cols() const { return matrix.cols; }
};

// Reads a feature file. InvalidArgument (message starting with `path`) for a
// malformed .npy, an unsupported dtype (only float32 and float16 are
// accepted), a shape that is not [n, d] with n >= 1 and d in [1, 16384].
// Does not scan the values: see CheckFinite.
absl::StatusOr<LoadedFeatures> LoadFeatures(const std::string& path);

// InvalidArgument naming the file, row and column of the first NaN or
// infinite element, e.g. "f.npy: row 12 column 3 is not finite (nan)".
absl::Status CheckFinite(const LoadedFeatures& features);

// Reads output lengths: int32 or int64, shape [n] with n == expected_rows,
// every value in [0, kMaxReportedTokens]. `features_path` names the feature
// file in the row-count mismatch message.
absl::StatusOr<std::vector<int64_t>> LoadLengths(
    const std::string& path, int64_t expected_rows,
    const std::string& features_path);

// Reads finish-reason codes (int32 or int64, shape [expected_rows], values 1
// stop, 2 length, 3 cancelled, 4 aborted).
absl::StatusOr<std::vector<int32_t>> LoadFinishReasons(
    const std::string& path, int64_t expected_rows,
    const std::string& features_path);

// A labelled feature file: the features, one output length per row and,
// when a finish-reasons file was given, one finish reason per row.
struct LabeledFeatures {
  LoadedFeatures features;
  std::vector<int64_t> lengths;
  std::vector<int32_t> reasons;  // empty without a finish-reasons file
};

// LoadFeatures(features_path), then `check_width` when given (e.g. against a
// readout's dim), CheckFinite, LoadLengths and, when `reasons_path` is not
// empty, LoadFinishReasons: the first error, in that order.
absl::StatusOr<LabeledFeatures> LoadLabeledFeatures(
    const std::string& features_path, const std::string& lengths_path,
    const std::string& reasons_path,
    const std::function<absl::Status(const LoadedFeatures&)>& check_width =
        nullptr);

// Whole-file reads and atomic writes (common/file.h).
using ::leap::ReadFileBytes;
using ::leap::WriteFileAtomically;

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_DATA_H_
