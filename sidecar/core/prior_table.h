// leapd's length priors (docs/WIRE.md, "Length prior"): one LengthPrior per
// product line, learned from the completions that carry their prompt length
// (Completion.prompt_tokens) and served at arrival, before prefill, to the
// engines that ask (PriorQueryBatch on Connect, over gRPC or shm; the unary
// Prior RPC). Memory only: a restarted leapd rebuilds them from the
// completions that follow (priors are absent until a line has learned
// LengthPriorOptions::min_samples of them, and the engine keeps first-come
// admission meanwhile).
#ifndef LEAP_SIDECAR_CORE_PRIOR_TABLE_H_
#define LEAP_SIDECAR_CORE_PRIOR_TABLE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "leap/v1/predictor.pb.h"
#include "readout/target.h"
#include "sidecar/core/length_prior.h"

namespace leap::sidecar {

class Core;
struct CompletionOutcome;

// The answer of a product line's prior for one request.
struct PriorAnswer {
  bool available = false;
  double predicted_tokens = 0;
  int64_t samples = 0;
};

// Thread-safe (one mutex; a learn or a predict costs microseconds).
class PriorTable {
 public:
  // Product lines beyond this many are not learned (their priors stay
  // absent): the table cannot grow without bound. Default: 4096
  static constexpr size_t kMaxProductLines = 4096;

  PriorTable() = default;

  // Learns one completion of `product_line` (its prior is created with
  // budget `budget` on the first one): true when learned, false for a new
  // line beyond kMaxProductLines. Callers apply the feedback rule
  // (CompleteWithPrior below); INVALID_ARGUMENT for negative counts.
  absl::StatusOr<bool> Learn(absl::string_view product_line, int64_t budget,
                     const core::PriorRequest& request, int64_t output_tokens)
      ABSL_LOCKS_EXCLUDED(mu_);
  PriorAnswer Predict(absl::string_view product_line,
                      const core::PriorRequest& request) const
      ABSL_LOCKS_EXCLUDED(mu_);
  size_t product_lines() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  // Predict solves lazily, which mutates the model: hence mutable.
  mutable absl::flat_hash_map<std::string, core::LengthPrior> lines_
      ABSL_GUARDED_BY(mu_);
};

// Checks an arrival record: a non-empty request id without NUL, ids and
// product line within CoreOptions::max_id_bytes, prompt_tokens in
// [1, kMaxReportedTokens], max_tokens in [0, kMaxReportedTokens].
// INVALID_ARGUMENT naming the field otherwise.
absl::Status CheckArrival(const Core& core, const leap::v1::ArrivalRecord& r);

// The prior of one arrival record (checked first).
absl::StatusOr<PriorAnswer> QueryPrior(Core& core,
                                       const leap::v1::ArrivalRecord& r);

// Answers a PriorQueryBatch: one LengthPrior or one RequestError per
// record, in record order.
void AnswerPriorQueries(Core* core, const leap::v1::PriorQueryBatch& in,
                        leap::v1::PriorBatch* out);

// Core::Complete plus the length prior: with prompt_tokens > 0 a completion
// that the readouts' rule learns (STOP, or LENGTH: learned at its cap, a
// lower bound, as the readouts do at M) and that is not a duplicate also
// teaches its product line's prior; CANCELLED and ABORTED never do.
// prompt_tokens < 0 is INVALID_ARGUMENT (the request stays live). The rest
// is exactly Core::Complete (defer_fleet_ack and defer_log_sync as there).
absl::StatusOr<CompletionOutcome> CompleteWithPrior(
    Core* core, absl::string_view request_id, int64_t output_tokens,
    readout::FinishReason reason, absl::string_view instance,
    bool defer_fleet_ack, int64_t prompt_tokens, bool defer_log_sync = false);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_PRIOR_TABLE_H_
