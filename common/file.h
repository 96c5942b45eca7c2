// Whole files: read one into memory, replace one atomically. Every error
// message starts with the path.
#ifndef LEAP_COMMON_FILE_H_
#define LEAP_COMMON_FILE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace leap {

// Reads a whole file. NotFound or another errno-derived code, the message
// starting with `path`.
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);

// Writes `bytes` to `path` atomically: a temporary file in the same
// directory, fsync, rename over `path`. Readers see the old file or the whole
// new one; the temporary file is removed on failure.
absl::Status WriteFileAtomically(const std::string& path,
                                 absl::string_view bytes);

}  // namespace leap

#endif  // LEAP_COMMON_FILE_H_
