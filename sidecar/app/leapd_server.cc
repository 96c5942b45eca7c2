#include "sidecar/app/leapd_server.h"

#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "common/thread.h"
#include "leap_build_info.h"
#include "readout/artifact.h"
#include "sidecar/fleet/trainer.h"
#include "storage/rocksdb_store.h"

namespace leap::sidecar {
namespace {

std::string RandomId() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8),
                      absl::Hex(rd(), absl::kZeroPad8));
}

// Whether a --listen address is only reachable from this host: a unix
// socket or a loopback TCP address.
bool IsLocalAddress(const std::string& listen) {
  if (listen.rfind("unix:", 0) == 0 || listen.rfind("unix-abstract:", 0) == 0) {
    return true;
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  return host == "localhost" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

// Credentials of the TCP listeners: TLS (mutual with a client CA) from
// files a watcher re-reads, else plaintext; with an admin token, the
// processor that checks it before a call's body is read. The files were
// checked by LeapdOptionsFromFlags.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TcpCredentials(
    const LeapdTlsOptions& tls, std::shared_ptr<AdminAuthProcessor> processor) {
  if (!tls.enabled()) {
    if (processor != nullptr) {
      return InsecureServerCredentialsWithAuth(processor);
    }
    return grpc::InsecureServerCredentials();
  }
  auto provider =
      std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
          tls.key, tls.cert, tls.client_ca,
          static_cast<unsigned int>(tls.reload_interval_s));
  grpc::experimental::TlsServerCredentialsOptions o(provider);
  o.watch_identity_key_cert_pairs();
  if (!tls.client_ca.empty()) {
    o.watch_root_certs();
    o.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    o.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::experimental::TlsServerCredentials(o);
  if (creds == nullptr) {
    return absl::InvalidArgumentError("cannot make TLS server credentials");
  }
  if (processor != nullptr) creds->SetAuthMetadataProcessor(processor);
  return creds;
}

}  // namespace

// Fleet mode, --fleet_trainer=auto: the trainer (it competes for the lease
// and trains while it holds it), started once NATS answers (retried every
// second until then), fed with the fleet's readouts by the member.
// Threads: constructed and destroyed by leapd's main thread; its own thread
// starts the trainer; the member's thread calls the readouts listener.
class TrainerRunner {
 public:
  TrainerRunner(leap::fleet::FleetMember* member, leap::fleet::TrainerOptions o)
      : member_(member), options_(std::move(o)) {
    thread_ = std::thread([this] { Loop(); });
    NameThread(thread_, "leap-train-run");
  }
  ~TrainerRunner() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
    {
      // The member's listener (it may outlive this object) sees null from
      // here.
      absl::MutexLock lock(&holder_->mu);
      holder_->trainer = nullptr;
    }
    absl::MutexLock lock(&mu_);
    trainer_.reset();
  }

 private:
  void Loop() {
    bool logged = false;
    for (;;) {
      absl::StatusOr<std::unique_ptr<leap::fleet::Trainer>> t =
          leap::fleet::Trainer::Start(member_->nats().raw_connection(), options_);
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        if (t.ok()) {
          trainer_ = std::move(*t);
          break;
        }
      }
      if (!logged) {
        std::fprintf(stderr, "leapd: fleet trainer not started yet (retried): %s\n",
                     std::string(t.status().message()).c_str());
        logged = true;
      }
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Seconds(1));
      if (stop_) return;
    }
    {
      absl::MutexLock lock(&mu_);
      absl::MutexLock hold(&holder_->mu);
      holder_->trainer = trainer_.get();
    }
    member_->SetReadoutsListener(
        [holder = holder_](const std::vector<leap::fleet::FleetReadoutEntry>& entries) {
          std::vector<leap::fleet::TrainerReadout> rs;
          for (const auto& e : entries) {
            rs.push_back({e.name, e.spec, e.standardizer, e.created_unix_ms});
          }
          absl::MutexLock lock(&holder->mu);
          if (holder->trainer != nullptr) holder->trainer->SetReadouts(std::move(rs));
        });
  }

  struct Holder {
    absl::Mutex mu;
    leap::fleet::Trainer* trainer ABSL_GUARDED_BY(mu) = nullptr;
  };

  leap::fleet::FleetMember* const member_;
  const leap::fleet::TrainerOptions options_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::unique_ptr<leap::fleet::Trainer> trainer_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Holder> holder_ = std::make_shared<Holder>();
  std::thread thread_;
};

LeapdServer::LeapdServer(LeapdOptions options)
    : options_(std::move(options)) {
  sigemptyset(&signals_);
}

LeapdServer::~LeapdServer() = default;

absl::Status LeapdServer::Start() {
  // Feature batches are ~1 MiB messages: keep glibc from mmap/munmap-ing (and
  // page-faulting) a fresh buffer for every one of them.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // Debian builds Abseil with mutex deadlock detection on, which walks a
  // lock graph on every acquisition of the hot-path mutexes.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  // Block the shutdown signals in every thread; RunUntilSignal waits for
  // them.
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);

  if (absl::Status s = OpenState(); !s.ok()) return s;
  if (absl::Status s = StartMetrics(); !s.ok()) return s;
  core_ = std::make_unique<Core>(options_.core, metrics_.get(), store_.get());
  // Nothing is served until recovery and imports are done.
  core_->SetServing(false);
  for (const std::string& l : options_.listen) {
    if (!options_.auth.enabled() && !IsLocalAddress(l)) {
      std::fprintf(stderr,
                   "leapd: warning: --listen=%s is reachable from other "
                   "hosts and there is no --admin_token_file: anyone who "
                   "reaches it can call Admin\n",
                   l.c_str());
    }
  }
  sidecar_id_ = RandomId();
  if (absl::Status s = StartGrpc(); !s.ok()) return s;
  if (absl::Status s = StartShm(); !s.ok()) return s;
  // Health says NOT_SERVING (and the data plane "recovering") until every
  // readout replayed its log.
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Service "liveness": SERVING from here on, through recovery, until the
  // drain: what a liveness probe asks (a hung leapd answers nothing), while
  // service "" tells whether predictions are served.
  server_->GetHealthCheckService()->SetServingStatus("liveness", true);
  std::fflush(stdout);
  if (absl::Status s = RecoverState(); !s.ok()) return s;
  if (absl::Status s = StartFleet(); !s.ok()) return s;
  if (absl::Status s = ImportReadouts(); !s.ok()) return s;

  if (options_.bootstrap.has_value()) {
    auto bootstrap = Bootstrap::Start(core_.get(), *options_.bootstrap);
    if (!bootstrap.ok()) {
      return absl::Status(
          bootstrap.status().code(),
          absl::StrCat("bootstrap: ", bootstrap.status().message()));
    }
    bootstrap_ = std::move(*bootstrap);
  }
  core_->SetServing(true);
  if (exposer_ != nullptr) {
    std::string host = options_.metrics_listen;
    host = host.substr(0, host.rfind(':'));
    std::printf("metrics on http://%s:%d/metrics\n", host.c_str(),
                exposer_->GetListeningPorts().at(0));
  }
  // leap_storage_bytes{family} from the first scrape on (refreshed by
  // RunUntilSignal).
  RefreshStorageGauges();
  server_->GetHealthCheckService()->SetServingStatus(true);
  std::printf("leapd %s ready\n", sidecar_id_.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

absl::Status LeapdServer::OpenState() {
  if (options_.data_dir.empty()) return absl::OkStatus();
  const std::string& dir = options_.data_dir;
  auto open_and_load = [&]() -> absl::Status {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    auto opened = storage::OpenRocksStore(dir, options_.store);
    if (!opened.ok()) return opened.status();
    store_ = std::move(*opened);
    auto loaded = store_->Load();
    if (!loaded.ok()) {
      store_.reset();
      return loaded.status();
    }
    recovered_ = std::move(*loaded);
    return absl::OkStatus();
  };
  absl::Status st = open_and_load();
  if (st.code() == absl::StatusCode::kDataLoss &&
      options_.move_aside_unrecoverable) {
    // Corrupt beyond what recovery repairs (not a held lock or an I/O
    // error: those stay fatal). Keep it for inspection, start empty.
    const std::string aside = absl::StrCat(
        dir, ".unrecoverable-",
        absl::FormatTime("%Y%m%dT%H%M%SZ", absl::Now(), absl::UTCTimeZone()));
    std::error_code ec;
    std::filesystem::rename(dir, aside, ec);
    if (ec) {
      return absl::Status(st.code(),
                          absl::StrCat(st.message(), "; cannot move ", dir,
                                       " aside: ", ec.message()));
    }
    std::printf("recovery: state in %s cannot be recovered (%s); moved to %s; "
                "starting with an empty state\n",
                dir.c_str(), std::string(st.message()).c_str(), aside.c_str());
    st = open_and_load();
  }
  if (!st.ok()) return st;
  for (const std::string& p : recovered_.problems) {
    std::printf("recovery: %s\n", p.c_str());
  }
  return absl::OkStatus();
}

absl::Status LeapdServer::StartMetrics() {
  metrics_ = std::make_unique<Metrics>();
  metrics_->SetBuildInfo(LEAP_VERSION, LEAP_GIT_REVISION, LEAP_BUILD_TYPE);
  if (options_.metrics_listen.empty()) return absl::OkStatus();
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(options_.metrics_listen);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", options_.metrics_listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(metrics_->registry());
  return absl::OkStatus();
}

absl::Status LeapdServer::StartGrpc() {
  const std::vector<std::string>& listens = options_.listen;
  predictor_ = std::make_unique<PredictorService>(core_.get(), sidecar_id_,
                                                  options_.outbox_bytes);
  admin_ = std::make_unique<AdminService>(core_.get(), options_.auth);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(options_.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options_.max_message_bytes));
  if (options_.auth.enabled()) {
    Metrics* metrics = metrics_.get();
    auth_processor_ = std::make_shared<AdminAuthProcessor>(
        options_.auth,
        [metrics] { metrics->RequestErrors("UNAUTHENTICATED").Increment(); });
  }
  auto tcp_creds = TcpCredentials(options_.tls, auth_processor_);
  if (!tcp_creds.ok()) return tcp_creds.status();
  std::vector<int> ports(listens.size(), 0);
  for (size_t i = 0; i < listens.size(); ++i) {
    const bool unix_socket = listens[i].rfind("unix", 0) == 0;
    builder.AddListeningPort(
        listens[i],
        unix_socket ? grpc::InsecureServerCredentials() : *tcp_creds,
        &ports[i]);
  }
  builder.RegisterService(predictor_.get());
  builder.RegisterService(admin_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", absl::StrJoin(listens, ", ")));
  }
  // NOT_SERVING from the first moment (gRPC's health service starts out
  // SERVING) until every readout replayed its log.
  server_->GetHealthCheckService()->SetServingStatus(false);
  const int64_t gid = options_.shm.group;
  for (size_t i = 0; i < listens.size(); ++i) {
    if (ports[i] == 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot listen on ", listens[i]));
    }
    std::string addr = listens[i];
    if (addr.rfind("unix:", 0) != 0) {
      addr = absl::StrCat(addr.substr(0, addr.rfind(':')), ":", ports[i]);
    }
    std::printf("listening on %s\n", addr.c_str());
    if (gid >= 0 && addr.rfind("unix:", 0) == 0) {
      std::string path = addr.substr(5);
      if (path.rfind("//", 0) == 0) path = path.substr(2);
      if (chown(path.c_str(), static_cast<uid_t>(-1),
                static_cast<gid_t>(gid)) != 0 ||
          chmod(path.c_str(), 0660) != 0) {
        return absl::PermissionDeniedError(
            absl::StrCat("--shm_group: cannot give ", path, " to gid ", gid,
                         ": ", std::strerror(errno)));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status LeapdServer::StartShm() {
  if (options_.shm.path.empty()) return absl::OkStatus();
  auto started = ShmServer::Start(core_.get(), sidecar_id_, options_.shm);
  if (!started.ok()) return started.status();
  shm_server_ = *std::move(started);
  std::printf("shm on shm://%s\n", options_.shm.path.c_str());
  return absl::OkStatus();
}

absl::Status LeapdServer::RecoverState() {
  if (store_ == nullptr) return absl::OkStatus();
  size_t replayed = 0;
  std::vector<std::string> names;
  for (const auto& r : recovered_.readouts) {
    replayed += r.log.size();
    names.push_back(absl::StrCat(r.meta.name, " (checkpoint v",
                                 r.checkpoint.version, ", ", r.log.size(),
                                 " log records)"));
  }
  const size_t routes = recovered_.routes.size();
  if (options_.fleet.has_value()) {
    // The log records left are the outbox: completions acknowledged or
    // refused before, maybe not yet in the fleet's stream.
    for (const auto& r : recovered_.readouts) {
      if (!r.log.empty()) outbox_[r.meta.name] = r.log;
    }
  }
  if (absl::Status s = core_->Recover(std::move(recovered_)); !s.ok()) {
    return s;
  }
  std::printf("recovered %zu readouts, %zu routes from %s%s%s; replayed %zu "
              "logged completions\n",
              names.size(), routes, options_.data_dir.c_str(),
              names.empty() ? "" : ": ", absl::StrJoin(names, ", ").c_str(),
              replayed);
  return absl::OkStatus();
}

absl::Status LeapdServer::StartFleet() {
  if (!options_.fleet.has_value()) return absl::OkStatus();
  fleet::FleetMemberOptions fo = options_.fleet->member;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  // The service "leap.v1.Fleet" of the health service says NOT_SERVING
  // while the member is degraded (predictions are still served).
  fo.on_degraded = [health](bool degraded) {
    health->SetServingStatus("leap.v1.Fleet", !degraded);
  };
  health->SetServingStatus("leap.v1.Fleet", false);
  auto created = fleet::FleetMember::Create(core_.get(), std::move(fo));
  if (!created.ok()) return created.status();
  fleet_ = std::move(*created);
  fleet_->SetCreateStateWriter(
      [fleet_name = fleet_->options().fleet](
          fleet::NatsClient& nats, const std::string& readout,
          const readout::ReadoutState& state, uint64_t fleet_seq) {
        return fleet::WriteCreateState(nats.raw_jetstream(), fleet_name,
                                       readout, state, fleet_seq);
      });
  core_->SetFleet(fleet_.get());
  size_t unconfirmed = 0;
  for (const auto& [name, records] : outbox_) unconfirmed += records.size();
  if (absl::Status s = fleet_->Start(std::move(outbox_), options_.fleet->wait_ms);
      !s.ok()) {
    return s;
  }
  if (options_.fleet->train) {
    // The trainer's own checkpoint store (its log stays empty), beside
    // the member's.
    const std::string dir = options_.data_dir + "/fleet_trainer";
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    auto opened = storage::OpenRocksStore(dir);
    if (!opened.ok()) return opened.status();
    trainer_store_ = std::move(*opened);
    fleet::TrainerOptions to;
    to.fleet = fleet_->options().fleet;
    to.member = fleet_->options().member;
    to.replicas = fleet_->options().replicas;
    to.lease_ms = fleet_->options().lease_ms;
    to.version_interval_ms = options_.fleet->version_interval_ms;
    to.checkpoint_every_ms = options_.fleet->checkpoint_every_ms;
    // The trainer's RLS is tuned like a single leapd's (docs/FLEET.md).
    to.max_batch = options_.core.readout.rls_batch_max;
    to.rls_threads = options_.core.readout.rls_threads;
    to.quality_window = options_.core.readout.quality_window;
    to.local_store = trainer_store_.get();
    to.registry = metrics_->registry();
    to.on_role = [member = fleet_.get()](bool lead) { member->SetRole(lead); };
    trainer_ = std::make_unique<TrainerRunner>(fleet_.get(), std::move(to));
  }
  std::printf("fleet %s: member %s, %s; %zu outbox records republished\n",
              fleet_->options().fleet.c_str(), fleet_->options().member.c_str(),
              fleet_->degraded() ? "degraded (NATS not reachable yet)"
                                 : "connected",
              unconfirmed);
  return absl::OkStatus();
}

absl::Status LeapdServer::ImportReadouts() {
  std::string first;
  for (const std::string& spec : options_.imports) {
    std::string name, path = spec;
    if (auto eq = spec.find('='); eq != std::string::npos) {
      name = spec.substr(0, eq);
      path = spec.substr(eq + 1);
    } else {
      name = std::filesystem::path(path).stem().string();
    }
    if (core_->GetReadout(name).ok()) {
      std::printf("readout %s already in %s; --import %s skipped\n",
                  name.c_str(), options_.data_dir.c_str(), path.c_str());
      continue;
    }
    if (options_.import_optional) {
      std::error_code ec;
      if (!std::filesystem::exists(path, ec)) {
        std::printf("--import %s: not there; skipped (--import_optional)\n",
                    spec.c_str());
        continue;
      }
    }
    auto state = readout::ReadArtifact(path);
    if (!state.ok()) return state.status();
    const int64_t dim = state->spec.dim;
    if (fleet_ != nullptr) {
      // Fleet mode: created for the whole fleet unless it exists there.
      absl::Status s = fleet_->CreateReadout(name, std::move(*state));
      if (!s.ok()) {
        std::fprintf(stderr, "leapd: warning: --import %s: not created in the "
                     "fleet: %s\n", spec.c_str(), std::string(s.message()).c_str());
        continue;
      }
    } else if (absl::Status s = core_->CreateReadout(name, std::move(*state));
               !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("--import ", spec, ": ", s.message()));
    }
    std::printf("imported readout %s (d=%lld) from %s\n", name.c_str(),
                static_cast<long long>(dim), path.c_str());
    if (first.empty()) first = name;
  }
  const std::string def =
      options_.default_readout.empty() ? first : options_.default_readout;
  if (!def.empty() && core_->ListRoutes().empty()) {
    Route r;
    r.arms.push_back({def, def, 100.0, false});
    if (absl::Status s = fleet_ != nullptr && fleet_->ready()
                             ? fleet_->SetRoute(r)
                             : core_->SetRoute(r);
        !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("default route: ", s.message()));
    }
  }
  return absl::OkStatus();
}

void LeapdServer::RefreshStorageGauges() {
  if (store_ == nullptr) return;
  for (const auto& [family, bytes] : store_->BytesPerFamily()) {
    metrics_->StorageBytes(family).Set(static_cast<double>(bytes));
  }
}

void LeapdServer::RunUntilSignal() {
  // Wait for SIGTERM/SIGINT; refresh the storage gauges meanwhile.
  int sig = 0;
  for (;;) {
    RefreshStorageGauges();
    timespec ts{10, 0};
    sig = sigtimedwait(&signals_, nullptr, &ts);
    if (sig == SIGTERM || sig == SIGINT) break;
  }
  std::fprintf(stderr, "leapd: %s: draining\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT");
  server_->GetHealthCheckService()->SetServingStatus(false);
  predictor_->BeginShutdown();
  if (shm_server_ != nullptr) shm_server_->Stop();
  server_->Shutdown(std::chrono::system_clock::now() +
                    absl::ToChronoSeconds(options_.drain_timeout));
  bootstrap_.reset();  // a fit in progress finishes first
  // The trainer first (final checkpoints, the lease released), while NATS
  // is still connected.
  trainer_.reset();
  trainer_store_.reset();
  if (fleet_ != nullptr) {
    core_->SetFleet(nullptr);
    fleet_->Stop();
  }
  core_->Shutdown(/*drain=*/true);  // applies the backlog, final checkpoints
}

absl::Status RunLeapd(LeapdOptions options) {
  LeapdServer server(std::move(options));
  if (absl::Status s = server.Start(); !s.ok()) return s;
  server.RunUntilSignal();
  return absl::OkStatus();
}

}  // namespace leap::sidecar
