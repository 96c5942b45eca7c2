#include "sidecar/fleet/member.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/thread.h"
#include "sidecar/fleet/fleet_quality.h"
#include "sidecar/fleet/fleet_state.h"
#include "leap/v1/fleet.pb.h"
#include "prometheus/registry.h"

namespace leap::fleet {
namespace {

namespace fpb = ::leap::v1::fleet;

constexpr size_t kKnownKeys = 200'000;

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

uint64_t Fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    h ^= b[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string RandomOpId(const std::string& member) {
  std::random_device rd;
  return absl::StrCat(member, "-", absl::Hex(rd(), absl::kZeroPad8),
                      absl::Hex(rd(), absl::kZeroPad8));
}

absl::StatusOr<Eigen::VectorXd> DecodeTheta(const std::string& bytes) {
  if (bytes.size() % sizeof(double) != 0 || bytes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("theta of ", bytes.size(), " bytes"));
  }
  Eigen::VectorXd t(static_cast<Eigen::Index>(bytes.size() / sizeof(double)));
  std::memcpy(t.data(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

absl::Status FleetMemberOptions::Validate() const {
  if (absl::Status s = ValidateFleetName(fleet); !s.ok()) return s;
  if (absl::Status s = ValidateMemberId(member); !s.ok()) return s;
  if (replicas < 1 || replicas > 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fleet_replicas must be in [1, 5] (JetStream's limit), got ",
        replicas));
  }
  if (lease_ms < 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fleet_lease_ms must be >= 100, got ", lease_ms));
  }
  if (nats.servers.empty()) {
    return absl::InvalidArgumentError("--fleet names no NATS server");
  }
  return absl::OkStatus();
}

std::string FleetMember::MessageId(absl::string_view readout,
                                   absl::string_view request_id, int dtype,
                                   absl::string_view features, double target) {
  auto hash = [&](uint64_t h) {
    h = Fnv(h, readout.data(), readout.size());
    h = Fnv(h, "\0", 1);
    h = Fnv(h, request_id.data(), request_id.size());
    h = Fnv(h, "\0", 1);
    h = Fnv(h, &dtype, sizeof(dtype));
    h = Fnv(h, features.data(), features.size());
    h = Fnv(h, &target, sizeof(target));
    return h;
  };
  return absl::StrCat(absl::Hex(hash(0xcbf29ce484222325ull), absl::kZeroPad16),
                      absl::Hex(hash(0x84222325cbf29ce4ull), absl::kZeroPad16));
}

FleetMember::FleetMember(sidecar::Core* core, FleetMemberOptions options)
    : core_(core), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<FleetMember>> FleetMember::Create(
    sidecar::Core* core, FleetMemberOptions options) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  std::unique_ptr<FleetMember> m(new FleetMember(core, std::move(options)));
  prometheus::Registry& reg = *core->metrics().registry();
  m->g_degraded_ = &prometheus::BuildGauge()
                        .Name("leap_fleet_degraded")
                        .Help("1 while this fleet member cannot reach NATS "
                              "(completions refused with UNAVAILABLE)")
                        .Register(reg)
                        .Add({});
  m->g_trainer_ = &prometheus::BuildGauge()
                       .Name("leap_fleet_trainer")
                       .Help("1 while this member holds the trainer lease")
                       .Register(reg)
                       .Add({});
  m->g_unconfirmed_ = &prometheus::BuildGauge()
                           .Name("leap_fleet_outbox_unconfirmed")
                           .Help("Completions in the local outbox not yet "
                                 "acknowledged by the FEEDBACK stream")
                           .Register(reg)
                           .Add({});
  m->g_last_seq_ = &prometheus::BuildGauge()
                        .Name("leap_fleet_last_seq")
                        .Help("FEEDBACK stream sequence of the newest "
                              "completion this member acknowledged")
                        .Register(reg)
                        .Add({});
  m->c_published_ = &prometheus::BuildCounter()
                         .Name("leap_fleet_completions_published_total")
                         .Help("Completions published to the FEEDBACK stream "
                               "and acknowledged by JetStream")
                         .Register(reg)
                         .Add({});
  m->c_duplicates_ = &prometheus::BuildCounter()
                          .Name("leap_fleet_publish_duplicates_total")
                          .Help("Publishes JetStream recognised as a message "
                                "id already in the stream")
                          .Register(reg)
                          .Add({});
  m->c_publish_errors_ = &prometheus::BuildCounter()
                              .Name("leap_fleet_publish_errors_total")
                              .Help("Completion publishes that failed (the "
                                    "completion was refused UNAVAILABLE)")
                              .Register(reg)
                              .Add({});
  m->c_versions_ = &prometheus::BuildCounter()
                        .Name("leap_fleet_versions_installed_total")
                        .Help("Fleet versions installed into this member's "
                              "readouts")
                        .Register(reg)
                        .Add({});
  m->g_degraded_->Set(1);
  NatsClientOptions no = m->options_.nats;
  if (no.name.empty()) no.name = absl::StrCat("leapd-", m->options_.member);
  FleetMember* raw = m.get();
  no.on_connection_change = [raw](bool c) { raw->OnConnection(c); };
  absl::StatusOr<std::unique_ptr<NatsClient>> nc =
      NatsClient::Connect(std::move(no));
  if (!nc.ok()) return nc.status();
  m->nats_ = std::move(*nc);
  return m;
}

FleetMember::~FleetMember() { Stop(); }

void FleetMember::Stop() {
  {
    absl::MutexLock l(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (maintainer_.joinable()) maintainer_.join();
  // Closed first: ending the subscriptions then needs no server round trip
  // (which would wait for its timeout while NATS is unreachable); the
  // server drops their ephemeral consumers by itself.
  nats_->Close();
  versions_sub_.reset();
  config_watch_.reset();
  lease_watch_.reset();
}

void FleetMember::OnConnection(bool connected) {
  if (connected) {
    absl::MutexLock l(&mu_);
    wake_ = true;  // the maintainer republishes and clears degraded
  } else {
    SetDegraded(true, "NATS connection lost");
  }
}

void FleetMember::SetDegraded(bool degraded, const std::string& reason) {
  {
    absl::MutexLock l(&mu_);
    degraded_reason_ = degraded ? reason : "";
  }
  const bool was = degraded_.exchange(degraded);
  if (g_degraded_ != nullptr) g_degraded_->Set(degraded ? 1 : 0);
  if (was != degraded) {
    std::fprintf(stderr, "leapd: fleet %s: %s%s\n", options_.fleet.c_str(),
                 degraded ? "degraded: " : "connected to NATS",
                 degraded ? reason.c_str() : "");
    if (options_.on_degraded) options_.on_degraded(degraded);
  }
}

void FleetMember::SetReadoutsListener(
    std::function<void(const std::vector<FleetReadoutEntry>&)> l) {
  {
    absl::MutexLock lock(&mu_);
    readouts_listener_ = std::move(l);
  }
  NotifyReadouts();
}

void FleetMember::SetRole(bool trainer) {
  trainer_role_.store(trainer);
  g_trainer_->Set(trainer ? 1 : 0);
}

absl::Status FleetMember::Start(
    std::map<std::string, std::vector<storage::LogRecord>> outbox,
    int64_t wait_ms) {
  {
    absl::MutexLock l(&mu_);
    for (auto& [readout, records] : outbox) {
      for (storage::LogRecord& r : records) {
        fpb::FleetCompletion c;
        c.set_readout(readout);
        c.set_request_id(r.request_id);
        c.set_dtype(static_cast<int>(r.dtype));
        c.set_features(r.features);
        c.set_target(r.target);
        c.set_true_tokens(r.target * r.target);
        c.set_member(options_.member);
        c.set_acked_unix_ms(NowUnixMs());
        Pending p;
        p.readout = readout;
        p.local_seq = r.seq;
        p.subject = FeedbackSubject(options_.fleet, readout);
        p.msg_id = MessageId(readout, r.request_id, static_cast<int>(r.dtype),
                             r.features, r.target);
        p.payload = c.SerializeAsString();
        max_local_[readout] = std::max(max_local_[readout], r.seq);
        pending_[{readout, r.seq}] = std::move(p);
      }
    }
    g_unconfirmed_->Set(static_cast<double>(pending_.size()));
    wake_ = true;
  }
  maintainer_ = std::thread([this] { MaintainLoop(); });
  NameThread(maintainer_, "leap-fleet");
  absl::MutexLock l(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || (ready_.load() && config_initial_done_ && pending_.empty());
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done),
                            absl::Milliseconds(wait_ms))) {
    std::fprintf(stderr,
                 "leapd: fleet %s: not ready within %lld ms (%s); serving the "
                 "local state, degraded, and retrying in the background\n",
                 options_.fleet.c_str(), static_cast<long long>(wait_ms),
                 degraded_reason_.empty() ? "NATS not reachable"
                                          : degraded_reason_.c_str());
  }
  return absl::OkStatus();
}

absl::Status FleetMember::SetUp() {
  const std::string& f = options_.fleet;
  const int r = options_.replicas;
  for (const StreamSpec& s :
       FleetStreamSpecs(f, r, options_.duplicate_window_ms)) {
    if (absl::Status e = nats_->EnsureStream(s); !e.ok()) return e;
  }
  auto cfg = nats_->EnsureKv({ConfigBucket(f), r, 1, 0});
  if (!cfg.ok()) return cfg.status();
  auto lease = nats_->EnsureKv({LeaseBucket(f), r, 1, options_.lease_ms});
  if (!lease.ok()) return lease.status();
  config_kv_ = std::move(*cfg);
  lease_kv_ = std::move(*lease);
  auto lw = lease_kv_->Watch(kTrainerKey, [this](const KvEntry& e) { OnLease(e); });
  if (!lw.ok()) return lw.status();
  lease_watch_ = std::move(*lw);
  // Versions first (the newest of each readout; ones for readouts not yet
  // known wait for their CONFIG entry), then CONFIG.
  SubscribeOptions so;
  so.start = SubscribeOptions::Start::kLastPerSubject;
  so.stream = VersionsStream(f);
  auto vs = nats_->Subscribe(VersionSubjects(f), so,
                             [this](const StreamMsg& m) { OnVersion(m); });
  if (!vs.ok()) return vs.status();
  versions_sub_ = std::move(*vs);
  auto cw = config_kv_->Watch(
      "", [this](const KvEntry& e) { OnConfig(e); },
      [this] { OnConfigInitialDone(); });
  if (!cw.ok()) return cw.status();
  config_watch_ = std::move(*cw);
  return absl::OkStatus();
}

void FleetMember::MaintainLoop() {
  int64_t last_prune_ms = 0;
  for (;;) {
    bool set_up;
    std::vector<Pending> todo;
    {
      absl::MutexLock l(&mu_);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || wake_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Seconds(1));
      if (stop_) return;
      wake_ = false;
      set_up = set_up_;
    }
    if (!nats_->connected()) continue;
    if (!set_up) {
      absl::Status s = SetUp();
      if (!s.ok()) {
        SetDegraded(true, std::string(s.message()));
        continue;
      }
      absl::MutexLock l(&mu_);
      set_up_ = true;
      ready_.store(true);
    }
    {
      absl::MutexLock l(&mu_);
      for (const auto& [k, p] : pending_) todo.push_back(p);
    }
    bool all_ok = true;
    for (const Pending& p : todo) {
      if (!PublishPending(p).ok()) {
        all_ok = false;
        break;
      }
    }
    if (all_ok) SetDegraded(false, "");
    if (NowUnixMs() - last_prune_ms >= 1000) {
      PruneOutboxes();
      last_prune_ms = NowUnixMs();
    }
  }
}

absl::StatusOr<uint64_t> FleetMember::PublishPending(const Pending& p) {
  PublishOptions po;
  po.msg_id = p.msg_id;
  return Published(p, nats_->Publish(p.subject, p.payload, po));
}

void FleetMember::Confirm(const Pending& p, uint64_t seq) {
  absl::MutexLock l(&mu_);
  pending_.erase({p.readout, p.local_seq});
  for (const std::string& k : p.dedup_keys) {
    auto it = known_.find(k);
    if (it != known_.end()) it->second.fleet_seq = seq;
  }
  g_unconfirmed_->Set(static_cast<double>(pending_.size()));
  uint64_t prev = last_fleet_seq_.load();
  while (seq > prev && !last_fleet_seq_.compare_exchange_weak(prev, seq)) {
  }
  g_last_seq_->Set(static_cast<double>(last_fleet_seq_.load()));
}

FleetMember::Pending FleetMember::Register(
    const sidecar::FleetCompletionRecord& c,
    std::shared_ptr<sidecar::PendingFleetAck> inflight) {
  fpb::FleetCompletion m;
  m.set_readout(c.readout);
  m.set_request_id(c.request_id);
  m.set_instance_id(c.instance);
  m.set_dtype(static_cast<int>(c.dtype));
  m.set_features(std::string(c.features));
  m.set_target(c.target);
  m.set_product_line(c.product_line);
  m.set_arm(c.arm);
  m.set_predicted_tokens(c.predicted_tokens);
  m.set_served_version(c.served_version);
  m.set_true_tokens(c.true_tokens);
  m.set_member(options_.member);
  m.set_acked_unix_ms(NowUnixMs());
  Pending p;
  p.readout = c.readout;
  p.local_seq = c.local_seq;
  p.subject = FeedbackSubject(options_.fleet, c.readout);
  p.msg_id = MessageId(c.readout, c.request_id, static_cast<int>(c.dtype),
                       c.features, c.target);
  p.payload = m.SerializeAsString();
  p.dedup_keys = c.dedup_keys;
  p.inflight = std::move(inflight);
  {
    absl::MutexLock l(&mu_);
    pending_[{p.readout, p.local_seq}] = p;
    max_local_[p.readout] = std::max(max_local_[p.readout], p.local_seq);
    for (const std::string& k : c.dedup_keys) {
      if (known_.emplace(k, Known{c.readout, c.local_seq, 0}).second) {
        known_order_.push_back(k);
      }
    }
    while (known_order_.size() > kKnownKeys) {
      known_.erase(known_order_.front());
      known_order_.pop_front();
    }
    g_unconfirmed_->Set(static_cast<double>(pending_.size()));
  }
  return p;
}

absl::StatusOr<uint64_t> FleetMember::PublishCompletion(
    const sidecar::FleetCompletionRecord& c) {
  return PublishPending(Register(c));
}

void FleetMember::PublishCompletionAsync(
    const sidecar::FleetCompletionRecord& c,
    std::shared_ptr<sidecar::PendingFleetAck> ack) {
  auto p = std::make_shared<Pending>(Register(c, ack));
  p->inflight = nullptr;  // (the callback below holds `ack` itself)
  PublishPendingAsync(std::move(p), std::move(ack));
}

void FleetMember::PublishPendingAsync(
    std::shared_ptr<const Pending> p,
    std::shared_ptr<sidecar::PendingFleetAck> ack) {
  PublishOptions po;
  po.msg_id = p->msg_id;
  nats_->PublishAsync(
      p->subject, p->payload, po,
      [this, p, ack = std::move(ack)](absl::StatusOr<PublishResult> r) {
        ack->Set(Published(*p, r));
      });
}

absl::StatusOr<uint64_t> FleetMember::Published(
    const Pending& p, const absl::StatusOr<PublishResult>& r) {
  if (!r.ok()) {
    c_publish_errors_->Increment();
    SetDegraded(true, std::string(r.status().message()));
    return absl::UnavailableError(absl::StrCat(
        "fleet ", options_.fleet,
        ": completion recorded in this member's outbox but not yet in the "
        "fleet's stream (resend it; it will be acknowledged once published): ",
        r.status().message()));
  }
  if (r->duplicate) c_duplicates_->Increment();
  c_published_->Increment();
  Confirm(p, r->seq);
  return r->seq;
}

std::shared_ptr<sidecar::PendingFleetAck> FleetMember::ResolveDuplicate(
    const std::vector<std::string>& dedup_keys) {
  auto ack = std::make_shared<sidecar::PendingFleetAck>();
  std::shared_ptr<Pending> todo;
  {
    absl::MutexLock l(&mu_);
    for (const std::string& k : dedup_keys) {
      auto it = known_.find(k);
      if (it == known_.end()) continue;
      if (it->second.fleet_seq != 0) {
        ack->Set(it->second.fleet_seq);
        return ack;
      }
      auto p = pending_.find({it->second.readout, it->second.local_seq});
      if (p == pending_.end()) {  // confirmed elsewhere
        ack->Set(uint64_t{0});
        return ack;
      }
      // Its publish still in flight: the resend is answered with it (a
      // second publish would only be de-duplicated by JetStream). Not set
      // while the record is pending means in flight: a success confirms
      // (removes the record) before it sets the ack.
      if (p->second.inflight != nullptr && !p->second.inflight->done()) {
        return p->second.inflight;
      }
      // Never published, or its publish failed: published again now,
      // asynchronously; a further resend shares this publish.
      p->second.inflight = ack;
      todo = std::make_shared<Pending>(p->second);
      todo->inflight = nullptr;
      break;
    }
    if (todo == nullptr) {
      // Recorded before a restart: its outbox record was republished at
      // start unless NATS has been unreachable since.
      if (!pending_.empty() && degraded_.load()) {
        ack->Set(absl::UnavailableError(absl::StrCat(
            "fleet ", options_.fleet,
            ": completion recorded in this member's outbox, NATS not "
            "reachable (", degraded_reason_, "); resend it")));
      } else {
        ack->Set(uint64_t{0});
      }
      return ack;
    }
  }
  PublishPendingAsync(std::move(todo), ack);
  return ack;
}

void FleetMember::PruneOutboxes() {
  std::vector<std::pair<std::string, uint64_t>> todo;
  {
    absl::MutexLock l(&mu_);
    for (const auto& [readout, max_seq] : max_local_) {
      uint64_t upto = max_seq;
      auto it = pending_.lower_bound({readout, 0});
      if (it != pending_.end() && it->first.first == readout) {
        upto = it->first.second - 1;
      }
      if (upto > pruned_[readout]) todo.emplace_back(readout, upto);
    }
  }
  for (const auto& [readout, upto] : todo) {
    absl::StatusOr<std::shared_ptr<sidecar::LiveReadout>> r =
        core_->GetReadout(readout);
    if (!r.ok()) continue;
    if ((*r)->ConfirmLog(upto).ok()) {
      absl::MutexLock l(&mu_);
      pruned_[readout] = std::max(pruned_[readout], upto);
    }
  }
}

// ---------------------------------------------------------------- versions

void FleetMember::OnVersion(const StreamMsg& m) {
  absl::StatusOr<std::string> readout =
      ReadoutOfSubject(options_.fleet, m.subject);
  if (!readout.ok()) return;
  if (!core_->GetReadout(*readout).ok()) {
    if (options_.before_early_version) options_.before_early_version(*readout);
    // Kept per incarnation it names (an unreadable one under 0: reported
    // when installed).
    fpb::FleetVersion v;
    const int64_t created = v.ParseFromString(m.data) ? v.created_unix_ms() : 0;
    {
      absl::MutexLock l(&mu_);
      early_versions_[*readout][created] = m.data;
    }
    // The CONFIG watcher creates the readout, then takes its kept versions.
    // If it created it after the check above and looked before the version
    // was kept, it found none: the readout is there now, and the version is
    // taken back here. Whichever of the two takes it installs it.
    absl::StatusOr<std::shared_ptr<sidecar::LiveReadout>> r =
        core_->GetReadout(*readout);
    if (!r.ok()) return;
    InstallEarlyVersions(*readout, (*r)->created_unix_ms());
    return;
  }
  InstallVersionMsg(*readout, m.data);
}

void FleetMember::InstallEarlyVersions(const std::string& readout,
                                       int64_t created_unix_ms) {
  std::map<int64_t, std::string> kept;
  {
    absl::MutexLock l(&mu_);
    auto it = early_versions_.find(readout);
    if (it == early_versions_.end()) return;
    kept = std::move(it->second);
    early_versions_.erase(it);
  }
  for (auto& [created, data] : kept) {
    if (created != 0 && created != created_unix_ms) {
      std::fprintf(stderr,
                   "leapd: fleet: a kept version of '%s' of another incarnation "
                   "(created %lld, this one %lld) dropped\n",
                   readout.c_str(), static_cast<long long>(created),
                   static_cast<long long>(created_unix_ms));
      continue;
    }
    // (Both an unnamed and a named one: the higher number is served.)
    InstallVersionMsg(readout, data);
  }
}

void FleetMember::InstallVersionMsg(const std::string& readout,
                                    const std::string& data) {
  fpb::FleetVersion v;
  if (!v.ParseFromString(data)) {
    std::fprintf(stderr, "leapd: fleet: unreadable version of '%s' skipped\n",
                 readout.c_str());
    return;
  }
  absl::StatusOr<std::shared_ptr<sidecar::LiveReadout>> r =
      core_->GetReadout(readout);
  if (!r.ok()) return;
  if (v.created_unix_ms() != 0 && v.created_unix_ms() != (*r)->created_unix_ms()) {
    // A version of another incarnation of the name (one deleted before this
    // readout was created): never served by this one.
    std::fprintf(stderr,
                 "leapd: fleet: version %lld of '%s' belongs to another incarnation "
                 "(created %lld, this one %lld); not installed\n",
                 static_cast<long long>(v.version()), readout.c_str(),
                 static_cast<long long>(v.created_unix_ms()),
                 static_cast<long long>((*r)->created_unix_ms()));
    return;
  }
  absl::StatusOr<Eigen::VectorXd> theta = DecodeTheta(v.theta());
  absl::StatusOr<bool> installed = absl::InternalError("no theta");
  // (A trainer's refusal of an operation, cause "error...", carries the
  // unchanged state under a new number: served like any version, so every
  // member reports the same number.)
  if (theta.ok()) {
    sidecar::InstalledVersion iv;
    iv.version = v.version();
    iv.theta = std::move(*theta);
    iv.completions_learned = v.completions_learned();
    iv.published_unix_ms = v.published_unix_ms();
    iv.cause = v.cause();
    iv.fleet_seq = v.fleet_seq();
    iv.frozen = v.frozen();
    installed = (*r)->InstallVersion(iv);
  } else {
    installed = theta.status();
  }
  if (!installed.ok()) {
    std::fprintf(stderr, "leapd: fleet: version %lld of '%s' not installed: %s\n",
                 static_cast<long long>(v.version()), readout.c_str(),
                 std::string(installed.status().message()).c_str());
  } else if (*installed) {
    c_versions_->Increment();
  }
  if (!v.op_id().empty()) {
    absl::MutexLock l(&mu_);
    ops_[v.op_id()] = OpResult{v.version(), v.completions_learned(),
                               v.published_unix_ms(), v.cause()};
  }
}

// ---------------------------------------------------------------- CONFIG

void FleetMember::OnConfig(const KvEntry& e) {
  const std::string readout_prefix = "readout.";
  const std::string route_prefix = "route.";
  const std::string quality_prefix = "quality.";
  if (e.key.rfind(quality_prefix, 0) == 0) {
    absl::StatusOr<std::string> name =
        NameFromToken(e.key.substr(quality_prefix.size()));
    if (!name.ok()) return;
    fpb::FleetQuality q;
    absl::MutexLock l(&mu_);
    if (e.deleted || !q.ParseFromString(e.value)) {
      quality_.erase(*name);
    } else {
      quality_[*name] = {q.created_unix_ms(), QualityView(q)};
    }
    return;
  }
  if (e.key.rfind(readout_prefix, 0) == 0) {
    absl::StatusOr<std::string> name =
        NameFromToken(e.key.substr(readout_prefix.size()));
    if (!name.ok()) return;
    fpb::FleetReadoutConfig cfg;
    const bool gone = e.deleted || !cfg.ParseFromString(e.value) || cfg.deleted();
    if (gone) {
      {
        absl::MutexLock l(&mu_);
        config_.erase(*name);
      }
      if (core_->GetReadout(*name).ok()) {
        absl::Status s = core_->DeleteReadout(*name);
        std::printf("fleet: readout %s deleted%s%s\n", name->c_str(),
                    s.ok() ? "" : ": ", std::string(s.message()).c_str());
      }
      NotifyReadouts();
      return;
    }
    absl::StatusOr<readout::ReadoutState> state =
        readout::ParseArtifact(cfg.spec(), absl::StrCat("fleet readout ", *name));
    if (!state.ok()) {
      std::fprintf(stderr, "leapd: fleet: readout '%s' not applied: %s\n",
                   name->c_str(), std::string(state.status().message()).c_str());
      return;
    }
    {
      absl::MutexLock l(&mu_);
      config_[*name] = FleetReadoutEntry{*name, state->spec, state->standardizer,
                                         cfg.created_unix_ms()};
    }
    absl::StatusOr<std::shared_ptr<sidecar::LiveReadout>> local =
        core_->GetReadout(*name);
    if (local.ok() && (*local)->created_unix_ms() != cfg.created_unix_ms()) {
      // Another incarnation of the name (deleted and created again).
      core_->DeleteReadout(*name).IgnoreError();
      local = absl::NotFoundError("");
    }
    if (!local.ok()) {
      state->created_unix_ms = cfg.created_unix_ms();
      absl::Status s = core_->CreateReadout(*name, std::move(*state));
      if (!s.ok() && !absl::IsAlreadyExists(s)) {
        std::fprintf(stderr, "leapd: fleet: readout '%s' not created: %s\n",
                     name->c_str(), std::string(s.message()).c_str());
        return;
      }
      std::printf("fleet: readout %s (d=%lld) from the fleet\n", name->c_str(),
                  static_cast<long long>(state->spec.dim));
      std::fflush(stdout);
    }
    InstallEarlyVersions(*name, cfg.created_unix_ms());
    NotifyReadouts();
  } else if (e.key.rfind(route_prefix, 0) == 0) {
    absl::StatusOr<std::string> pl =
        NameFromToken(e.key.substr(route_prefix.size()));
    if (!pl.ok()) return;
    if (e.deleted) {
      core_->DeleteRoute(*pl).IgnoreError();
      return;
    }
    absl::StatusOr<sidecar::Route> route = sidecar::RouteFromJson(e.value);
    absl::Status s = route.ok() ? core_->SetRoute(*route) : route.status();
    if (!s.ok()) {
      std::fprintf(stderr, "leapd: fleet: route '%s' not applied: %s\n",
                   pl->c_str(), std::string(s.message()).c_str());
    }
  }
}

void FleetMember::OnConfigInitialDone() {
  std::vector<std::string> stale;
  {
    absl::MutexLock l(&mu_);
    for (const auto& r : core_->ListReadouts()) {
      if (config_.count(r->name()) == 0) stale.push_back(r->name());
    }
  }
  // Readouts deleted from the fleet while this member was away.
  for (const std::string& name : stale) {
    core_->DeleteReadout(name).IgnoreError();
    std::printf("fleet: readout %s is no longer in the fleet; deleted here\n",
                name.c_str());
  }
  {
    absl::MutexLock l(&mu_);
    config_initial_done_ = true;
  }
  NotifyReadouts();
}

void FleetMember::NotifyReadouts() {
  std::function<void(const std::vector<FleetReadoutEntry>&)> l;
  std::vector<FleetReadoutEntry> list;
  {
    absl::MutexLock lock(&mu_);
    if (!config_initial_done_ || !readouts_listener_) return;
    l = readouts_listener_;
    for (const auto& [n, e] : config_) list.push_back(e);
  }
  l(list);
}

void FleetMember::OnLease(const KvEntry& e) {
  fpb::FleetLease lease;
  absl::MutexLock l(&mu_);
  if (e.deleted || !lease.ParseFromString(e.value)) {
    trainer_.clear();
  } else {
    trainer_ = lease.member();
  }
}

// ---------------------------------------------------------------- admin

namespace {
absl::Status NotReady(const std::string& fleet) {
  return absl::UnavailableError(absl::StrCat(
      "fleet ", fleet, ": not connected to NATS yet; fleet-wide changes are "
                       "refused until it is"));
}
}  // namespace

absl::Status FleetMember::CreateReadout(const std::string& name,
                                        readout::ReadoutState state) {
  if (absl::Status s = sidecar::ValidateReadoutName(name); !s.ok()) return s;
  if (absl::Status s = state.Validate(); !s.ok()) return s;
  if (!ready_.load()) return NotReady(options_.fleet);
  const std::string key = ReadoutConfigKey(name);
  if (absl::StatusOr<KvEntry> e = config_kv_->Get(key); e.ok()) {
    fpb::FleetReadoutConfig cfg;
    if (cfg.ParseFromString(e->value) && !cfg.deleted()) {
      return absl::AlreadyExistsError(
          absl::StrCat("readout '", name, "' already exists in fleet ",
                       options_.fleet));
    }
  } else if (!absl::IsNotFound(e.status())) {
    return e.status();
  }
  if (state.version < 1) state.version = 1;
  state.created_unix_ms = NowUnixMs();
  // Completions on its subject before this point belong to an earlier
  // incarnation of the name: the new one starts after them.
  absl::StatusOr<uint64_t> fleet_seq =
      nats_->LastSeq(FeedbackStream(options_.fleet));
  if (!fleet_seq.ok()) return fleet_seq.status();
  // 1. The creation state (with P) for the trainer.
  if (create_state_) {
    if (absl::Status s = create_state_(*nats_, name, state, *fleet_seq); !s.ok()) {
      return s;
    }
  }
  // 2. Version `state.version` for every member.
  fpb::FleetVersion v;
  v.set_readout(name);
  v.set_version(state.version);
  v.set_theta(std::string(reinterpret_cast<const char*>(state.theta.data()),
                          state.theta.size() * sizeof(double)));
  v.set_completions_learned(state.completions_learned);
  v.set_fleet_seq(*fleet_seq);
  v.set_published_unix_ms(state.created_unix_ms);
  v.set_cause("create");
  v.set_trainer(options_.member);
  v.set_frozen(!state.p.has_value());
  v.set_created_unix_ms(state.created_unix_ms);
  absl::StatusOr<PublishResult> pv =
      nats_->Publish(VersionSubject(options_.fleet, name), v.SerializeAsString());
  if (!pv.ok()) return pv.status();
  // 3. The configuration (the commit point: members create it on seeing it).
  readout::ReadoutState spec_only = state;
  spec_only.p.reset();
  absl::StatusOr<std::string> artifact = readout::SerializeArtifact(spec_only);
  if (!artifact.ok()) return artifact.status();
  fpb::FleetReadoutConfig cfg;
  cfg.set_name(name);
  cfg.set_spec(*artifact);
  cfg.set_created_unix_ms(state.created_unix_ms);
  absl::StatusOr<uint64_t> put = config_kv_->Put(key, cfg.SerializeAsString());
  if (!put.ok()) return put.status();
  // Applied here at once (the watcher then finds it in place).
  absl::Status local = core_->CreateReadout(name, std::move(state));
  if (absl::IsAlreadyExists(local)) return absl::OkStatus();
  return local;
}

absl::Status FleetMember::DeleteReadout(const std::string& name) {
  if (!ready_.load()) return NotReady(options_.fleet);
  if (absl::StatusOr<KvEntry> e = config_kv_->Get(ReadoutConfigKey(name));
      !e.ok()) {
    if (absl::IsNotFound(e.status())) {
      return absl::NotFoundError(absl::StrCat("readout '", name,
                                              "' is not in fleet ",
                                              options_.fleet));
    }
    return e.status();
  }
  if (absl::Status s = config_kv_->Delete(ReadoutConfigKey(name)); !s.ok()) {
    return s;
  }
  // Its fleet-wide quality goes with it (a new incarnation starts afresh).
  config_kv_->Delete(QualityConfigKey(name)).IgnoreError();
  absl::Status local = core_->DeleteReadout(name);
  if (absl::IsNotFound(local)) return absl::OkStatus();
  return local;
}

absl::Status FleetMember::SetRoute(const sidecar::Route& route) {
  if (!ready_.load()) return NotReady(options_.fleet);
  // Validated here first (arms must name known readouts).
  if (absl::Status s = core_->SetRoute(route); !s.ok()) return s;
  absl::StatusOr<uint64_t> put = config_kv_->Put(
      RouteConfigKey(route.product_line), sidecar::RouteToJson(route));
  return put.status();
}

absl::Status FleetMember::DeleteRoute(const std::string& product_line) {
  if (!ready_.load()) return NotReady(options_.fleet);
  if (absl::Status s = core_->DeleteRoute(product_line); !s.ok()) return s;
  return config_kv_->Delete(RouteConfigKey(product_line));
}

absl::StatusOr<FleetMember::OpResult> FleetMember::RunControl(
    const std::string& readout, int op, const std::string& label) {
  if (!core_->GetReadout(readout).ok()) {
    return absl::NotFoundError(absl::StrCat("no readout '", readout, "'"));
  }
  if (!ready_.load()) return NotReady(options_.fleet);
  fpb::FleetControl c;
  c.set_readout(readout);
  c.set_op(static_cast<fpb::FleetControl::Op>(op));
  c.set_label(label);
  c.set_member(options_.member);
  const std::string op_id = RandomOpId(options_.member);
  c.set_op_id(op_id);
  PublishOptions po;
  po.msg_id = op_id;
  absl::StatusOr<PublishResult> r = nats_->Publish(
      ControlSubject(options_.fleet, readout), c.SerializeAsString(), po);
  if (!r.ok()) return r.status();
  absl::MutexLock l(&mu_);
  auto answered = [this, &op_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || ops_.count(op_id) != 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&answered),
                            absl::Milliseconds(options_.op_timeout_ms)) ||
      ops_.count(op_id) == 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "fleet ", options_.fleet, ": the ",
        fpb::FleetControl::Op_Name(static_cast<fpb::FleetControl::Op>(op)),
        " of readout '", readout, "' is in the stream (sequence ", r->seq,
        ") but no trainer answered within ", options_.op_timeout_ms,
        " ms (trainer: ", trainer_.empty() ? "none" : trainer_,
        "); it is applied when one does"));
  }
  OpResult out = ops_[op_id];
  ops_.erase(op_id);
  if (out.cause.rfind("error", 0) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("fleet ", options_.fleet, ": readout '", readout,
                     "': ", out.cause));
  }
  return out;
}

absl::StatusOr<storage::SnapshotInfo> FleetMember::Snapshot(
    const std::string& readout, const std::string& label) {
  if (label.empty() || label.size() > 128) {
    return absl::InvalidArgumentError("snapshot label must be 1-128 bytes");
  }
  absl::StatusOr<OpResult> r = RunControl(readout, fpb::FleetControl::SNAPSHOT, label);
  if (!r.ok()) return r.status();
  // As the fleet lists it (the state's own version), when it can be read.
  if (absl::StatusOr<std::vector<storage::SnapshotInfo>> all = ListSnapshots(readout);
      all.ok()) {
    for (const storage::SnapshotInfo& i : *all) {
      if (i.label == label) return i;
    }
  }
  storage::SnapshotInfo info;
  info.label = label;
  info.version = r->version;
  info.completions_learned = r->completions_learned;
  info.unix_ms = r->unix_ms;
  info.spearman = NAN;
  return info;
}

absl::StatusOr<int64_t> FleetMember::Rollback(const std::string& readout,
                                              const std::string& label) {
  absl::StatusOr<OpResult> r = RunControl(readout, fpb::FleetControl::ROLLBACK, label);
  if (!r.ok()) return r.status();
  return r->version;
}

absl::Status FleetMember::SetFrozen(const std::string& readout, bool frozen) {
  return RunControl(readout,
                    frozen ? fpb::FleetControl::FREEZE : fpb::FleetControl::RESUME,
                    "")
      .status();
}

absl::StatusOr<readout::ReadoutState> FleetMember::ExportState(
    const std::string& readout) {
  absl::StatusOr<std::shared_ptr<sidecar::LiveReadout>> local =
      core_->GetReadout(readout);
  if (!local.ok()) return local.status();
  if (!ready_.load()) return NotReady(options_.fleet);
  // An EXPORT operation: the trainer writes its state at that point of the
  // stream to a subject of its own, and publishes no version.
  const std::string op_id = RandomOpId(options_.member);
  const std::string stream = StateStream(options_.fleet);
  const std::string subject = ExportSubject(options_.fleet, readout, op_id);
  natsSubscription* sub = nullptr;
  if (natsStatus st =
          natsConnection_SubscribeSync(&sub, nats_->raw_connection(), subject.c_str());
      st != NATS_OK) {
    return NatsFailure("subscribing to " + subject, st);
  }
  natsSubscription_SetPendingLimits(sub, -1, -1);
  fpb::FleetControl c;
  c.set_readout(readout);
  c.set_op(fpb::FleetControl::EXPORT);
  c.set_member(options_.member);
  c.set_op_id(op_id);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.op_timeout_ms);
  // The trainer does not answer after this (the subject is purged then).
  c.set_deadline_unix_ms(absl::ToUnixMillis(deadline));
  PublishOptions po;
  po.msg_id = op_id;
  absl::StatusOr<PublishResult> published = nats_->Publish(
      ControlSubject(options_.fleet, readout), c.SerializeAsString(), po);
  absl::Status answered = published.status();
  while (answered.ok()) {
    natsMsg* m = nullptr;
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    natsStatus st = natsSubscription_NextMsg(&m, sub, std::max<int64_t>(left, 1));
    if (st == NATS_TIMEOUT) {
      answered = absl::DeadlineExceededError(absl::StrCat(
          "fleet ", options_.fleet, ": the EXPORT of readout '", readout,
          "' is in the stream (sequence ", published->seq,
          ") but no trainer answered within ", options_.op_timeout_ms,
          " ms (trainer: ", Status().trainer.empty() ? "none" : Status().trainer, ")"));
      break;
    }
    if (st != NATS_OK) {
      answered = NatsFailure("waiting for the export on " + subject, st);
      break;
    }
    fpb::FleetStateChunk chunk;
    const bool last = chunk.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m)) &&
                      chunk.last();
    natsMsg_Destroy(m);
    if (last) break;
  }
  // On the timeout path chunks may still be arriving.
  CloseSubscription(nats_->raw_connection(), sub);
  absl::StatusOr<FleetState> fs =
      answered.ok() ? ReadNewestState(nats_->raw_connection(), nats_->raw_jetstream(),
                                      stream, subject)
                    : absl::StatusOr<FleetState>(answered);
  // A one-off subject: nothing is left in STATE.
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Stream.Purge.Subject = subject.c_str();
  jsErrCode code = static_cast<jsErrCode>(0);
  if (natsStatus st = js_PurgeStream(nats_->raw_jetstream(), stream.c_str(), &jo, &code);
      st != NATS_OK) {
    std::fprintf(stderr, "leapd: fleet: export state %s not purged: %s\n",
                 subject.c_str(), NatsFailure("purge", st, code).ToString().c_str());
  }
  if (!fs.ok()) return fs.status();
  readout::ReadoutState state = (*local)->Export();
  if (fs->theta.size() != state.theta.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fleet ", options_.fleet, ": the trainer's state of '", readout,
        "' has ", fs->theta.size(), " weights, the readout ", state.theta.size()));
  }
  state.theta = fs->theta;
  state.p = std::move(fs->p);
  state.version = fs->version;
  state.completions_learned = fs->completions_learned;
  return state;
}

absl::StatusOr<std::vector<storage::SnapshotInfo>> FleetMember::ListSnapshots(
    const std::string& readout) {
  if (!core_->GetReadout(readout).ok()) {
    return absl::NotFoundError(absl::StrCat("no readout '", readout, "'"));
  }
  if (!ready_.load()) return NotReady(options_.fleet);
  const std::string stream = StateStream(options_.fleet);
  const std::string prefix = SnapshotSubject(options_.fleet, readout, "x");
  const std::string filter = prefix.substr(0, prefix.size() - 1) + "*";
  absl::StatusOr<std::map<std::string, uint64_t>> subjects =
      nats_->Subjects(stream, filter);
  if (!subjects.ok()) return subjects.status();
  std::vector<storage::SnapshotInfo> out;
  for (const auto& [subject, n] : *subjects) {
    // The newest state written under the label, when it is complete.
    absl::StatusOr<StreamMsg> m = nats_->GetLastMsg(stream, subject);
    if (!m.ok()) continue;
    fpb::FleetStateChunk c;
    if (!c.ParseFromString(m->data) || !c.last()) continue;
    storage::SnapshotInfo info;
    absl::StatusOr<std::string> label =
        NameFromToken(subject.substr(subject.rfind('.') + 1));
    info.label = c.label().empty() && label.ok() ? *label : c.label();
    info.version = c.version();
    info.completions_learned = c.completions_learned();
    info.unix_ms = c.unix_ms();
    info.spearman = NAN;
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(),
            [](const storage::SnapshotInfo& a, const storage::SnapshotInfo& b) {
              return a.unix_ms < b.unix_ms;
            });
  return out;
}

sidecar::FleetStatus FleetMember::Status() const {
  sidecar::FleetStatus s;
  s.fleet = options_.fleet;
  s.member = options_.member;
  s.role = trainer_role_.load() ? "trainer" : "member";
  s.degraded = degraded_.load();
  s.last_fleet_seq = last_fleet_seq_.load();
  absl::MutexLock l(&mu_);
  s.trainer = trainer_;
  s.degraded_reason = degraded_reason_;
  s.unconfirmed = static_cast<int64_t>(pending_.size());
  return s;
}

std::optional<sidecar::FleetQualityView> FleetMember::Quality(
    const std::string& readout) const {
  absl::MutexLock l(&mu_);
  auto it = quality_.find(readout);
  if (it == quality_.end()) return std::nullopt;
  // Only for the incarnation this member serves (the key of a deleted one
  // may outlive it).
  auto cfg = config_.find(readout);
  if (cfg == config_.end() || cfg->second.created_unix_ms != it->second.first) {
    return std::nullopt;
  }
  return it->second.second;
}

}  // namespace leap::fleet
