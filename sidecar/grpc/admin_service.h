// leap.v1.Admin over Core: readouts, versions, routes, stats, snapshots,
// rollback, the dataset export. Handlers convert between protos and Core
// types and map absl::Status codes one to one onto grpc::Status codes
// (sidecar/grpc/status.h).
//
// Threads: gRPC's synchronous server calls every handler on one of its
// threads, any number at once; the service keeps no state of its own beyond
// construction (Core and AdminAuth are thread-safe), so no lock is held here.
#ifndef LEAP_SIDECAR_GRPC_ADMIN_SERVICE_H_
#define LEAP_SIDECAR_GRPC_ADMIN_SERVICE_H_

#include <cstdint>

#include "leap/v1/admin.grpc.pb.h"
#include "sidecar/core/core.h"
#include "sidecar/grpc/admin_auth.h"

namespace leap::sidecar {

// One published version's record as its proto (GetStats, ListVersions).
void FillVersion(const VersionRecord& v, leap::v1::VersionInfo* out);

// ListVersions' answer: the newest `limit` versions (0 = all) with their
// quality, the quality windows and the per-label quality
// (sidecar/grpc/admin_data.cc).
void FillQualityHistory(LiveReadout& r, int64_t limit, int64_t window,
                        leap::v1::ListVersionsResponse* resp);

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

#endif  // LEAP_SIDECAR_GRPC_ADMIN_SERVICE_H_
