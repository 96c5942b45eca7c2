// leapd assembled: the state store, Core, the gRPC services, the
// shared-memory data plane, /metrics, fleet mode and the bootstrap, started
// from LeapdOptions in a fixed order and run until SIGTERM/SIGINT, then
// drained (docs/ARCHITECTURE.md, "leapd's start and stop").
//
// Threads: a LeapdServer is driven by one thread, leapd's main thread:
// Start blocks SIGTERM and SIGINT in it before any other thread exists (so
// every thread leapd starts inherits the mask) and RunUntilSignal waits for
// them there. The components it starts run their own threads (gRPC's,
// Core's RLS workers, the shm loop, the fleet member's and trainer's).
#ifndef LEAP_SIDECAR_APP_LEAPD_SERVER_H_
#define LEAP_SIDECAR_APP_LEAPD_SERVER_H_

#include <signal.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#include "sidecar/app/leapd_options.h"
#include "sidecar/core/bootstrap.h"
#include "sidecar/core/core.h"
#include "sidecar/core/metrics.h"
#include "sidecar/fleet/member.h"
#include "sidecar/grpc/admin_service.h"
#include "sidecar/grpc/predictor_service.h"
#include "sidecar/shm/shm_server.h"
#include "storage/state_store.h"

namespace leap::sidecar {

class TrainerRunner;

class LeapdServer {
 public:
  explicit LeapdServer(LeapdOptions options);
  // Tears down whatever Start started (after a failed start, or after
  // RunUntilSignal's drain), in reverse order, the state store last.
  ~LeapdServer();
  LeapdServer(const LeapdServer&) = delete;
  LeapdServer& operator=(const LeapdServer&) = delete;

  // Opens and recovers the state, starts /metrics, gRPC, shm, fleet mode,
  // imports readouts, sets the default route, starts the bootstrap and
  // reports ready, printing the documented stdout lines ("listening on",
  // "recovered", "imported readout", "leapd ID ready", ...). The first
  // error stops the start; it names what failed.
  absl::Status Start();

  // After a successful Start: waits for SIGTERM/SIGINT (refreshing the
  // storage gauges every 10 s), then drains: streams ended, in-flight calls
  // given --drain_timeout, the trainer and the fleet member stopped, queued
  // completions applied and final checkpoints written.
  void RunUntilSignal();

 private:
  absl::Status OpenState();
  absl::Status StartMetrics();
  absl::Status StartGrpc();
  absl::Status StartShm();
  absl::Status RecoverState();
  absl::Status StartFleet();
  absl::Status ImportReadouts();
  void RefreshStorageGauges();

  const LeapdOptions options_;
  sigset_t signals_;
  std::string sidecar_id_;
  // Declared in start order: destroyed in reverse, the store last.
  std::unique_ptr<storage::StateStore> store_;
  storage::RecoveredState recovered_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<Core> core_;
  std::unique_ptr<PredictorService> predictor_;
  std::unique_ptr<AdminService> admin_;
  std::shared_ptr<AdminAuthProcessor> auth_processor_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ShmServer> shm_server_;
  // Fleet mode: the outbox (log records of the data dir not yet confirmed
  // in the fleet's stream), the member, the trainer's store and runner.
  std::map<std::string, std::vector<storage::LogRecord>> outbox_;
  std::unique_ptr<fleet::FleetMember> fleet_;
  std::unique_ptr<storage::StateStore> trainer_store_;
  std::unique_ptr<TrainerRunner> trainer_;
  std::unique_ptr<Bootstrap> bootstrap_;
};

// Start, then RunUntilSignal; returns once everything is destroyed (the
// RocksDB store and its lock included), so a new leapd may start at once.
// OK after a drain; else the start's error.
absl::Status RunLeapd(LeapdOptions options);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_APP_LEAPD_SERVER_H_
