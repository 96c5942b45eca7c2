// gRPC front of the sidecar: leap.v1.Predictor and leap.v1.Admin over Core.
// Handlers convert between protos and Core types and map absl::Status codes
// one to one onto grpc::Status codes.
#ifndef LEAP_SIDECAR_GRPC_GRPC_SERVICE_H_
#define LEAP_SIDECAR_GRPC_GRPC_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "sidecar/grpc/admin_auth.h"
#include "sidecar/core/core.h"

namespace leap::sidecar {

grpc::Status ToGrpc(const absl::Status& s);

// ListVersions' answer: the newest `limit` versions (0 = all) with their
// quality, the quality windows and the per-label quality
// (sidecar/grpc/admin_data.cc).
void FillQualityHistory(LiveReadout& r, int64_t limit, int64_t window,
                        leap::v1::ListVersionsResponse* resp);

// Byte bound of each consumer's outbox (leapd --outbox_bytes) and the
// process-wide accounting behind the leap_outbox_* metrics. Policy, for a
// consumer (a WatchReadout or Connect stream) whose queued messages exceed
// `bound` bytes: first the queued versions are coalesced to the newest one
// (a WatchReadout queue keeps only its newest version, a Connect outbox only
// the newest publish notice per readout; Connect rescores always carry only
// the newest version); if that is still over the bound, the consumer is
// dropped with RESOURCE_EXHAUSTED "consumer too slow: N bytes queued". The
// message being written counts as queued until its Write returns. Publishing
// and the other consumers never wait on a slow one.
class OutboxLimits {
 public:
  OutboxLimits(Metrics* metrics, int64_t bound)
      : metrics_(metrics), bound_(bound) {}
  int64_t bound() const { return bound_; }
  Metrics& metrics() { return *metrics_; }
  // A consumer's outbox changed by `delta` bytes to `consumer_total`.
  void Account(int64_t delta, int64_t consumer_total);

 private:
  Metrics* const metrics_;
  const int64_t bound_;
  std::atomic<int64_t> peak_{0};
};

class PredictorService final : public leap::v1::Predictor::Service {
 public:
  // `sidecar_id` identifies this process (engines resubmit on change).
  // `outbox_bytes` bounds each consumer's outbox (see OutboxLimits).
  PredictorService(Core* core, std::string sidecar_id,
                   int64_t outbox_bytes = int64_t{64} << 20)
      : core_(core),
        sidecar_id_(std::move(sidecar_id)),
        outbox_(&core->metrics(), outbox_bytes) {}

  // Ends open streams and watches promptly (call before Server::Shutdown):
  // each Connect stream gets a message-level UNAVAILABLE "leapd is shutting
  // down" error and is then cancelled, idle or not.
  void BeginShutdown();

  grpc::Status Connect(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<leap::v1::SidecarMessage,
                               leap::v1::EngineMessage>* stream) override;
  grpc::Status Predict(grpc::ServerContext* ctx,
                       const leap::v1::PredictRequest* req,
                       leap::v1::PredictResponse* resp) override;
  grpc::Status Complete(grpc::ServerContext* ctx,
                        const leap::v1::CompleteRequest* req,
                        leap::v1::CompleteResponse* resp) override;
  grpc::Status WatchReadout(
      grpc::ServerContext* ctx, const leap::v1::WatchReadoutRequest* req,
      grpc::ServerWriter<leap::v1::ReadoutVersion>* writer) override;

 private:
  Core* const core_;
  const std::string sidecar_id_;
  std::atomic<uint64_t> next_session_{1};
  std::atomic<bool> shutting_down_{false};
  absl::Mutex sessions_mu_;
  // Open Connect streams (the session is a ConnectSession).
  std::map<grpc::ServerContext*, std::shared_ptr<PublishListener>> sessions_
      ABSL_GUARDED_BY(sessions_mu_);
  OutboxLimits outbox_;
};

// Every handler first runs the AdminAuth check (a refused call gets
// UNAUTHENTICATED and counts in leap_request_errors_total{code=
// "UNAUTHENTICATED"}).
class AdminService final : public leap::v1::Admin::Service {
 public:
  explicit AdminService(Core* core, AdminAuth auth = AdminAuth())
      : core_(core), auth_(std::move(auth)) {}

  grpc::Status ListReadouts(grpc::ServerContext*,
                            const leap::v1::ListReadoutsRequest*,
                            leap::v1::ListReadoutsResponse*) override;
  grpc::Status GetReadout(grpc::ServerContext*,
                          const leap::v1::GetReadoutRequest*,
                          leap::v1::ReadoutInfo*) override;
  grpc::Status CreateReadout(grpc::ServerContext*,
                             const leap::v1::CreateReadoutRequest*,
                             leap::v1::ReadoutInfo*) override;
  grpc::Status DeleteReadout(grpc::ServerContext*,
                             const leap::v1::DeleteReadoutRequest*,
                             leap::v1::DeleteReadoutResponse*) override;
  grpc::Status ListVersions(grpc::ServerContext*,
                            const leap::v1::ListVersionsRequest*,
                            leap::v1::ListVersionsResponse*) override;
  grpc::Status ExportReadout(grpc::ServerContext*,
                             const leap::v1::ExportReadoutRequest*,
                             leap::v1::ExportReadoutResponse*) override;
  grpc::Status SetAdaptation(grpc::ServerContext*,
                             const leap::v1::SetAdaptationRequest*,
                             leap::v1::ReadoutInfo*) override;
  grpc::Status SetRoute(grpc::ServerContext*, const leap::v1::SetRouteRequest*,
                        leap::v1::Route*) override;
  grpc::Status ListRoutes(grpc::ServerContext*,
                          const leap::v1::ListRoutesRequest*,
                          leap::v1::ListRoutesResponse*) override;
  grpc::Status DeleteRoute(grpc::ServerContext*,
                           const leap::v1::DeleteRouteRequest*,
                           leap::v1::DeleteRouteResponse*) override;
  grpc::Status GetStats(grpc::ServerContext*, const leap::v1::GetStatsRequest*,
                        leap::v1::StatsResponse*) override;
  grpc::Status CreateSnapshot(grpc::ServerContext*,
                              const leap::v1::CreateSnapshotRequest*,
                              leap::v1::SnapshotInfo*) override;
  grpc::Status ListSnapshots(grpc::ServerContext*,
                             const leap::v1::ListSnapshotsRequest*,
                             leap::v1::ListSnapshotsResponse*) override;
  grpc::Status Rollback(grpc::ServerContext*, const leap::v1::RollbackRequest*,
                        leap::v1::RollbackResponse*) override;
  // sidecar/grpc/admin_data.cc
  grpc::Status ExportDataset(
      grpc::ServerContext*, const leap::v1::ExportDatasetRequest*,
      grpc::ServerWriter<leap::v1::DatasetChunk>* writer) override;

 private:
  grpc::Status CheckAdmin(grpc::ServerContext* ctx);
  // CheckAdmin, then UNAVAILABLE while leapd is recovering (for mutations).
  grpc::Status CheckAdminWrite(grpc::ServerContext* ctx);

  Core* const core_;
  const AdminAuth auth_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_GRPC_GRPC_SERVICE_H_
