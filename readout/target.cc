#include "readout/target.h"

#include "absl/strings/str_cat.h"

namespace leap::readout {

absl::StatusOr<FeedbackAction> ClassifyFeedback(int64_t output_tokens,
                                                FinishReason reason,
                                                int64_t request_max_tokens,
                                                int64_t max_tokens) {
  if (output_tokens < 0 || output_tokens > kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("output_tokens must be in [0, ", kMaxReportedTokens,
                     "], got ", output_tokens));
  }
  if (request_max_tokens < 0 || request_max_tokens > kMaxReportedTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("request max_tokens must be in [0, ", kMaxReportedTokens,
                     "] (0 = none), got ", request_max_tokens));
  }
  switch (reason) {
    case FinishReason::kCancelled:
    case FinishReason::kAborted:
      return FeedbackAction::kSkipCancelled;
    case FinishReason::kStop:
      return FeedbackAction::kLearn;
    case FinishReason::kLength:
      if (request_max_tokens > 0 && output_tokens > request_max_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "finish reason 'length' with output_tokens ", output_tokens,
            " above the request's max_tokens ", request_max_tokens));
      }
      // The true length is >= output_tokens. Only when that reaches M is the
      // clipped target sqrt(M) exact.
      return output_tokens >= max_tokens ? FeedbackAction::kLearn
                                         : FeedbackAction::kSkipCensored;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown finish reason ", static_cast<int>(reason)));
}

}  // namespace leap::readout
