#include "common/ids.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace leap {

absl::Status CheckIdBytes(absl::string_view field, absl::string_view value,
                          size_t max) {
  if (value.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " of ", value.size(), " bytes is over the limit of ", max,
      " bytes (it starts \"", absl::CHexEscape(value.substr(0, 32)), "\")"));
}

}  // namespace leap
