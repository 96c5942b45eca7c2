// Predictor.Prior: the length prior of one request at arrival, before its
// prefill (docs/WIRE.md, "Length prior"). Kept apart from
// predictor_service.cc: the Connect stream answers the same queries through
// HandleEngineMessage (PriorQueryBatch).
#include "sidecar/core/prior_table.h"
#include "sidecar/grpc/predictor_service.h"
#include "sidecar/grpc/status.h"

namespace leap::sidecar {

grpc::Status PredictorService::Prior(grpc::ServerContext*,
                                     const leap::v1::PriorRequest* req,
                                     leap::v1::PriorResponse* resp) {
  absl::StatusOr<PriorAnswer> a = QueryPrior(*core_, req->record());
  if (!a.ok()) {
    core_->metrics()
        .RequestErrors(absl::StatusCodeToString(a.status().code()))
        .Increment();
    return ToGrpc(a.status());
  }
  leap::v1::LengthPrior* p = resp->mutable_prior();
  p->set_request_id(req->record().request_id());
  p->set_available(a->available);
  p->set_predicted_tokens(a->predicted_tokens);
  p->set_samples(a->samples);
  return grpc::Status::OK;
}

}  // namespace leap::sidecar
