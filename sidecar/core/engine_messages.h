// What one engine's data-plane session does with each message, whatever the
// transport: the gRPC Connect stream and the shared-memory server both hand
// their EngineMessages here, so predictions, acks and errors are the same
// on both (the shm server's slot path calls the same Core::Predict and
// ToPrediction for the records whose features sit in slots).
#ifndef LEAP_SIDECAR_CORE_ENGINE_MESSAGES_H_
#define LEAP_SIDECAR_CORE_ENGINE_MESSAGES_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "leap/v1/predictor.pb.h"
#include "sidecar/core/core.h"

namespace leap::sidecar {

// Where a session keeps the live requests it must rescore on a publish.
// Called on the session's handler thread.
class LiveTracker {
 public:
  virtual ~LiveTracker() = default;
  virtual void Track(std::shared_ptr<LiveRequest> r) = 0;
  virtual void Untrack(absl::string_view request_id) = 0;
};

// leap.v1 <-> Core conversions.
absl::StatusOr<readout::DType> DTypeFromProto(leap::v1::FeatureDType d);
absl::StatusOr<readout::FinishReason> ReasonFromProto(leap::v1::FinishReason r);
void ToPrediction(const ScoreResult& s, const std::string& id,
                  leap::v1::Prediction* p);
// Appends a RequestError and counts it in leap_request_errors_total.
void AddRequestError(const std::string& id, const absl::Status& s,
                     google::protobuf::RepeatedPtrField<leap::v1::RequestError>* out,
                     Metrics& metrics);

// Checks a Hello: the dtype and dim ranges, the instance id (at most 128
// bytes, no NUL), and engine_id and model_id (at most kMaxIdBytes each;
// CheckIdBytes' words, naming the field). INVALID_ARGUMENT otherwise.
absl::StatusOr<readout::DType> CheckHello(const leap::v1::Hello& hello);

// Checks a Hello's identity against the readouts that take its width:
// FAILED_PRECONDITION naming both when the hello declares a model_id (or a
// layer > 0: 0 is proto3's unset value) and such a readout declares a
// different one (readouts and hellos that declare none are not compared). Logged on stdout either way;
// OK with CoreOptions::allow_hello_mismatch.
absl::Status CheckHelloIdentity(const Core& core, const leap::v1::Hello& hello);

// The answer to one Completions message, in the making. In fleet mode each
// learnable completion is acknowledged only after JetStream's publish
// acknowledgement: StartCompletions runs every completion through the Core
// with its publish in flight (pipelined: one round trip for the message),
// and the answer is ready once every acknowledgement is in. A transport may
// wait (Finish blocks), or go on serving other engines and emit the answer
// when OnReady fires (the shm server's loop). Thread-safe.
class CompletionsAnswer {
 public:
  // True once every publish of the message was acknowledged or failed (at
  // once outside fleet mode).
  bool ready() const;
  // Runs `f` once ready: at once, here, when it is; else on the thread that
  // receives the last acknowledgement (it must not block).
  void OnReady(std::function<void()> f);
  // Fills `ack` (accepted, skipped, duplicates, per-request errors:
  // UNAVAILABLE for a completion whose publish failed) and untracks the
  // acknowledged requests. Blocks until ready.
  void Finish(leap::v1::Ack* ack, LiveTracker* tracker);

 private:
  friend std::shared_ptr<CompletionsAnswer> StartCompletions(
      Core*, const leap::v1::Hello&, const leap::v1::CompletionBatch&);
  struct Entry {
    std::string request_id;
    absl::StatusOr<CompletionOutcome> outcome;
  };
  Core* core_ = nullptr;
  std::vector<Entry> entries_;
  mutable absl::Mutex mu_;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::function<void()>> on_ready_ ABSL_GUARDED_BY(mu_);
  void AckArrived();
};
std::shared_ptr<CompletionsAnswer> StartCompletions(
    Core* core, const leap::v1::Hello& hello,
    const leap::v1::CompletionBatch& completions);

// Answers one EngineMessage after the hello (features carried inline,
// completions, cancels, length prior queries (prior_table.h; completions
// that carry prompt_tokens teach the priors); a second hello or an empty
// message is a
// message-level error). `in` may be consumed (feature bytes are moved).
// Completions are answered once the fleet acknowledged them (fleet mode):
// this call waits for it (StartCompletions does not).
void HandleEngineMessage(Core* core, uint64_t session,
                         const leap::v1::Hello& hello, readout::DType dtype,
                         leap::v1::EngineMessage* in,
                         leap::v1::SidecarMessage* out, LiveTracker* tracker);

// Cancels each id (answering into `ack` as a CancelBatch would be).
void CancelRequests(Core* core, absl::Span<const absl::string_view> ids,
                    leap::v1::Ack* ack, LiveTracker* tracker,
                    absl::string_view instance = "");

// The rescored predictions of `live` requests served by readout `name`
// under version `v` (requests that are gone or served by another readout
// are skipped; their entries are left to the caller).
void RescorePredictions(const std::string& name, const PublishedVersion& v,
                        const std::vector<std::shared_ptr<LiveRequest>>& live,
                        std::vector<leap::v1::Prediction>* out);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_ENGINE_MESSAGES_H_
