// One fleet member in process, as leapd --fleet wires it
// (sidecar/app/leapd_server.cc): a serving-only Core over a real RocksDB store
// and recovered from it, its FleetMember started on NATS (with the creation
// state writer), optionally its Admin service on a real gRPC port; and a
// Trainer on a member's NATS connection that reports its role to the member
// and gets the readouts from the member's CONFIG watcher; and such a member
// alone on a nats-server of its own (OneNodeFleet). Header only
// (it reports failures to gtest); test-only: the test links leap::fleet_trainer
// and, for the Admin service, leap::service.
#ifndef LEAP_TESTS_SUPPORT_FLEET_MEMBER_H_
#define LEAP_TESTS_SUPPORT_FLEET_MEMBER_H_

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "leap/v1/admin.grpc.pb.h"
#include "sidecar/core/core.h"
#include "sidecar/fleet/member.h"
#include "sidecar/fleet/trainer.h"
#include "sidecar/grpc/admin_service.h"
#include "storage/rocksdb_store.h"
#include "tests/support/nats_cluster.h"

namespace leap::testing {

struct FleetTestMemberOptions {
  std::string url;         // a NATS server
  std::string fleet;       // --fleet_name
  std::string member;      // --fleet_member; also the store's folder name
  int64_t lease_ms = 1000;
  // Subscribed to the Core's publishes before recovery (nullptr: none).
  std::shared_ptr<sidecar::PublishListener> listener = nullptr;
  // Serve the Admin service on 127.0.0.1, port 0 (`stub` talks to it).
  bool admin = false;
  // FleetMemberOptions::on_degraded (e.g. DegradedWatch::Callback()).
  std::function<void(bool degraded)> on_degraded = nullptr;
  // JetStream's acknowledgement timeout (NatsClientOptions::timeout_ms;
  // 0: its default).
  int64_t nats_timeout_ms = 0;
};

// A member's degraded flag as on_degraded reports it, so that a test waits
// for a change instead of sleeping. Outlive the member it watches.
class DegradedWatch {
 public:
  std::function<void(bool)> Callback() {
    return [this](bool d) {
      absl::MutexLock l(&mu_);
      degraded_ = d;
    };
  }
  // Waits until the flag equals `want` (it starts degraded); false at the
  // timeout.
  bool Await(bool want, absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock l(&mu_);
    auto cond = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return degraded_ == want; };
    return mu_.AwaitWithTimeout(absl::Condition(&cond), timeout);
  }

 private:
  absl::Mutex mu_;
  bool degraded_ ABSL_GUARDED_BY(mu_) = true;
};

// Use from the test thread: Start once (under ASSERT_NO_FATAL_FAILURE),
// Stop before destruction.
struct FleetTestMember {
  std::unique_ptr<storage::StateStore> store;
  sidecar::Metrics metrics;
  std::unique_ptr<sidecar::Core> core;
  std::unique_ptr<fleet::FleetMember> fleet;
  std::unique_ptr<sidecar::AdminService> admin;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<leap::v1::Admin::Stub> stub;

  // The store lives in dir / o.member.
  void Start(const std::filesystem::path& dir, const FleetTestMemberOptions& o) {
    auto opened = storage::OpenRocksStore((dir / o.member).string());
    ASSERT_TRUE(opened.ok()) << opened.status();
    store = std::move(*opened);
    sidecar::CoreOptions co;
    co.readout.serving_only = true;
    core = std::make_unique<sidecar::Core>(co, &metrics, store.get());
    if (o.listener != nullptr) core->hub().Subscribe(o.listener);
    auto loaded = store->Load();
    ASSERT_TRUE(loaded.ok());
    ASSERT_TRUE(core->Recover(std::move(*loaded)).ok());
    fleet::FleetMemberOptions fo;
    fo.nats.servers = {o.url};
    fo.fleet = o.fleet;
    fo.member = o.member;
    fo.lease_ms = o.lease_ms;
    fo.on_degraded = o.on_degraded;
    if (o.nats_timeout_ms > 0) fo.nats.timeout_ms = o.nats_timeout_ms;
    auto m = fleet::FleetMember::Create(core.get(), fo);
    ASSERT_TRUE(m.ok()) << m.status();
    fleet = std::move(*m);
    fleet->SetCreateStateWriter([name = o.fleet](fleet::NatsClient& nats,
                                                 const std::string& readout,
                                                 const readout::ReadoutState& state,
                                                 uint64_t fleet_seq) {
      return fleet::WriteCreateState(nats.raw_jetstream(), name, readout, state, fleet_seq);
    });
    core->SetFleet(fleet.get());
    ASSERT_TRUE(fleet->Start({}, 20000).ok());
    if (!o.admin) return;
    admin = std::make_unique<sidecar::AdminService>(core.get());
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(admin.get());
    server = b.BuildAndStart();
    ASSERT_NE(server, nullptr);
    ASSERT_GT(port, 0);
    stub = leap::v1::Admin::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }
  void Stop() {
    if (server != nullptr) server->Shutdown();
    if (core != nullptr) core->SetFleet(nullptr);
    if (fleet != nullptr) fleet->Stop();
  }
};

// A nats-server of one node (nats_cluster.h, in dir / "nats") and one
// FleetTestMember on it whose degraded flag `degraded` watches, serving
// readout `name` (created from `state` through the fleet) routed 100% on
// the default product line. The test links leap_test_nats too. Use from
// the test thread: Start once (under ASSERT_NO_FATAL_FAILURE), Stop before
// destruction.
struct OneNodeFleet {
  std::unique_ptr<NatsCluster> nats;
  DegradedWatch degraded;
  std::unique_ptr<FleetTestMember> member;

  // `o.url` and `o.on_degraded` are set here.
  void Start(const std::filesystem::path& dir, FleetTestMemberOptions o,
             const std::string& name, const readout::ReadoutState& state) {
    NatsClusterOptions no;
    no.nodes = 1;
    no.dir = (dir / "nats").string();
    auto started = NatsCluster::Start(no);
    ASSERT_TRUE(started.ok()) << started.status();
    nats = std::move(*started);
    o.url = nats->url(0);
    o.on_degraded = degraded.Callback();
    member = std::make_unique<FleetTestMember>();
    ASSERT_NO_FATAL_FAILURE(member->Start(dir, o));
    ASSERT_TRUE(member->fleet->CreateReadout(name, state).ok());
    sidecar::Route route;
    route.arms.push_back({name, name, 100.0, false});
    ASSERT_TRUE(member->fleet->SetRoute(route).ok());
  }
  // The member first, then NATS.
  void Stop() {
    if (member != nullptr) member->Stop();
    member.reset();
    nats.reset();
  }
};

// A Trainer on `m`'s NATS connection: its role goes to m->SetRole and m's
// CONFIG watcher gives it the readouts. Before destroying it, call
// m->SetReadoutsListener(nullptr).
inline absl::StatusOr<std::unique_ptr<fleet::Trainer>> StartTrainerOn(
    fleet::FleetMember* m, fleet::TrainerOptions to) {
  to.on_role = [m](bool lead) { m->SetRole(lead); };
  auto trainer = fleet::Trainer::Start(m->nats().raw_connection(), std::move(to));
  if (!trainer.ok()) return trainer;
  fleet::Trainer* t = trainer->get();
  m->SetReadoutsListener([t](const std::vector<fleet::FleetReadoutEntry>& entries) {
    std::vector<fleet::TrainerReadout> rs;
    for (const auto& e : entries) {
      rs.push_back({e.name, e.spec, e.standardizer, e.created_unix_ms});
    }
    t->SetReadouts(std::move(rs));
  });
  return trainer;
}

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_FLEET_MEMBER_H_
