// The LEAP target and its inverse, and which finished requests may be learned.
//
// The readout predicts y = sqrt(output tokens). Predictions are clipped to
// [1, sqrt(M)] before squaring (M = the output budget, default 2048), so a
// very negative or very large score cannot become an absurd length. Targets
// are clipped to sqrt(M) from above for the same reason: a request that ran to
// the budget or beyond is "at least M", and sqrt(M) is exactly what the
// clipped prediction can express.
#ifndef LEAP_READOUT_TARGET_H_
#define LEAP_READOUT_TARGET_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "common/wire.h"

namespace leap::readout {

// Default output-token budget M (the paper's 2048).
inline constexpr int64_t kDefaultMaxTokens = 2048;
// Largest output length accepted from a client (anything above is absurd).
inline constexpr int64_t kMaxReportedTokens = int64_t{1} << 24;

// The training/learning target for a request that produced `tokens` output
// tokens under budget `max_tokens`: sqrt(min(tokens, max_tokens)).
inline double TargetFromTokens(int64_t tokens, int64_t max_tokens) {
  return std::sqrt(static_cast<double>(std::min(tokens, max_tokens)));
}

// clip(score, 1, sqrt(M))^2: the predicted number of output tokens.
inline double TokensFromScore(double score, int64_t max_tokens) {
  const double hi = std::sqrt(static_cast<double>(max_tokens));
  const double s = std::isnan(score) ? 1.0 : std::clamp(score, 1.0, hi);
  return s * s;
}

// The prediction served for a request: TokensFromScore capped by the
// request's own output cap (its decoding max_tokens; 0 = none), since it
// cannot produce more than that.
inline double RequestTokensFromScore(double score, int64_t max_tokens,
                                     int64_t request_max_tokens) {
  const double tokens = TokensFromScore(score, max_tokens);
  return request_max_tokens > 0 && tokens > static_cast<double>(request_max_tokens)
             ? static_cast<double>(request_max_tokens)
             : tokens;
}

// Why a request ended, as reported by the engine (common/wire.h).
using ::leap::FinishReason;
using ::leap::FinishReasonName;

// What to do with one finished request's feedback.
enum class FeedbackAction : uint8_t {
  kLearn = 1,          // learn target sqrt(min(tokens, M))
  kSkipCancelled = 2,  // cancelled or aborted: length says nothing
  kSkipCensored = 3,   // stopped by a per-request cap below M: length >= cap
};

// The feedback rule (docs/MATH.md). `output_tokens` is the number generated;
// `request_max_tokens` is the request's own cap (0 = none, i.e. M applies);
// `max_tokens` is the readout's M. Natural stops are learned. A length stop
// (true length >= output_tokens) is learned only when output_tokens >= M,
// where the clipped target sqrt(M) is exact; below M it is censored and
// skipped, whatever cap caused it. Cancelled/aborted requests
// are never learned. Returns InvalidArgument for negative or absurd counts
// (> kMaxReportedTokens) or a length stop that exceeds its own cap.
absl::StatusOr<FeedbackAction> ClassifyFeedback(int64_t output_tokens,
                                                FinishReason reason,
                                                int64_t request_max_tokens,
                                                int64_t max_tokens);

}  // namespace leap::readout

#endif  // LEAP_READOUT_TARGET_H_
