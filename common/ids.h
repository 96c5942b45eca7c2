// The bounds on the ids of a record (request id, product line) that leapd
// and the engine shim share (docs/WIRE.md, "Sizes"): one limit, the same
// words from both sides.
#ifndef LEAP_COMMON_IDS_H_
#define LEAP_COMMON_IDS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace leap {

// Longest request id, and longest product line, leapd takes. The shim's
// Client refuses a longer one itself, so no record ever outgrows a
// shared-memory frame or a gRPC message.
inline constexpr size_t kMaxIdBytes = 256;

// OK when `value`, the `field` of a record ("request_id", "product_line"),
// holds at most `max` bytes; else INVALID_ARGUMENT naming the field, its
// size, the limit and the value's first 32 bytes (C-escaped), e.g.
// `request_id of 20000 bytes is over the limit of 256 bytes (it starts
// "rrrr...")`.
absl::Status CheckIdBytes(absl::string_view field, absl::string_view value,
                          size_t max = kMaxIdBytes);

}  // namespace leap

#endif  // LEAP_COMMON_IDS_H_
