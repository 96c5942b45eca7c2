#include "sidecar/grpc/admin_service.h"

#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "sidecar/grpc/status.h"

namespace leap::sidecar {
namespace {

namespace pb = ::leap::v1;

void FillInfo(LiveReadout& r, pb::ReadoutInfo* info) {
  info->set_name(r.name());
  info->set_dim(r.spec().dim);
  info->set_layer(r.spec().layer);
  info->set_model_id(r.spec().model_id);
  info->set_max_tokens(r.spec().max_tokens);
  info->set_lambda(r.spec().lambda);
  info->set_version(r.current()->version);
  info->set_completions_learned(r.completions_learned());
  info->set_frozen(r.frozen());
  info->set_frozen_reason(r.frozen_reason());
  info->set_rls_backlog(r.backlog());
  info->set_created_unix_ms(r.created_unix_ms());
}

void FillGuardrail(const GuardrailStatus& g, pb::GuardrailStats* out) {
  out->set_state(g.state);
  out->set_spearman(g.spearman);
  out->set_spearman_n(g.spearman_n);
  out->set_trips(g.trips);
  out->set_last_trip(g.last_trip);
  out->set_last_trip_unix_ms(g.last_trip_unix_ms);
  if (g.last_good.has_value()) {
    out->set_last_good_label(g.last_good->label);
    out->set_last_good_spearman(g.last_good->spearman);
    out->set_last_good_spearman_n(g.last_good->spearman_n);
  }
}

// Fleet mode: the trainer's fleet-wide numbers for a version (NaN and 0
// when it counted none predicted by that version).
void FleetVersionQuality(const FleetQualityView& q, pb::VersionInfo* v) {
  v->set_spearman(NAN);
  v->set_spearman_n(0);
  for (const FleetQualitySeriesView& s : q.versions) {
    if (s.version == v->version()) {
      v->set_spearman(s.spearman);
      v->set_spearman_n(s.spearman_n);
      return;
    }
  }
}

}  // namespace

void FillVersion(const VersionRecord& v, pb::VersionInfo* out) {
  out->set_version(v.version);
  out->set_completions_learned(v.completions_learned);
  out->set_published_unix_ms(v.published_unix_ms);
  out->set_cause(v.cause);
  out->set_spearman(v.spearman);
  out->set_spearman_n(v.spearman_n);
}

grpc::Status AdminService::CheckAdmin(grpc::ServerContext* ctx) {
  grpc::Status s = auth_.Check(*ctx);
  if (!s.ok()) core_->metrics().RequestErrors("UNAUTHENTICATED").Increment();
  return s;
}

grpc::Status AdminService::CheckAdminWrite(grpc::ServerContext* ctx) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  // A change made while the feedback log is being replayed would interleave
  // with the replay (a rollback under it, a route to a readout not yet
  // back): refused until leapd serves, like the data plane.
  if (!core_->serving()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "leapd is recovering (replaying its feedback log); "
                        "admin changes are refused until it serves; retry "
                        "shortly");
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListReadouts(grpc::ServerContext* ctx,
                                        const pb::ListReadoutsRequest*,
                                        pb::ListReadoutsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  for (auto& r : core_->ListReadouts()) FillInfo(*r, resp->add_readouts());
  return grpc::Status::OK;
}

grpc::Status AdminService::GetReadout(grpc::ServerContext* ctx,
                                      const pb::GetReadoutRequest* req,
                                      pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  FillInfo(**r, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::CreateReadout(grpc::ServerContext* ctx,
                                         const pb::CreateReadoutRequest* req,
                                         pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  readout::ReadoutState state;
  if (req->has_cold_start()) {
    const pb::ColdStart& c = req->cold_start();
    if (!(c.lambda() > 0.0)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("cold start lambda must be > 0, got ",
                                       c.lambda()));
    }
    state.spec.dim = c.dim();
    state.spec.layer = c.has_layer() ? c.layer() : -1;
    state.spec.model_id = c.model_id();
    state.spec.max_tokens = c.max_tokens() == 0 ? readout::kDefaultMaxTokens
                                                : c.max_tokens();
    state.spec.lambda = c.lambda();
    absl::Status s = state.spec.Validate();
    if (!s.ok()) return ToGrpc(s);
    state.standardizer = readout::Standardizer::Identity(c.dim());
    state.theta = Eigen::VectorXd::Zero(c.dim() + 1);
    state.p = readout::SymMatrix::ScaledIdentity(
        c.dim() + 1, static_cast<float>(1.0 / c.lambda()));
    state.version = 1;
  } else if (req->source_case() == pb::CreateReadoutRequest::kArtifact) {
    auto parsed = readout::ParseArtifact(req->artifact(), "uploaded artifact");
    if (!parsed.ok()) return ToGrpc(parsed.status());
    state = std::move(*parsed);
    if (state.version < 1) state.version = 1;
  } else {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "CreateReadout needs an artifact or a cold_start");
  }
  // Fleet mode: created for the whole fleet (every member applies it).
  absl::Status s = core_->fleet() != nullptr
                       ? core_->fleet()->CreateReadout(req->name(), std::move(state))
                       : core_->CreateReadout(req->name(), std::move(state));
  if (!s.ok()) return ToGrpc(s);
  FillInfo(**core_->GetReadout(req->name()), resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::DeleteReadout(grpc::ServerContext* ctx,
                                         const pb::DeleteReadoutRequest* req,
                                         pb::DeleteReadoutResponse*) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  if (core_->fleet() != nullptr) {
    return ToGrpc(core_->fleet()->DeleteReadout(req->name()));
  }
  return ToGrpc(core_->DeleteReadout(req->name()));
}

grpc::Status AdminService::ListVersions(grpc::ServerContext* ctx,
                                        const pb::ListVersionsRequest* req,
                                        pb::ListVersionsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  if (req->limit() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "limit must be >= 0");
  }
  FillQualityHistory(**r, req->limit(), core_->options().readout.quality_window,
                     resp);
  if (core_->fleet() != nullptr) {
    if (std::optional<FleetQualityView> q = core_->fleet()->Quality(req->name());
        q.has_value()) {
      for (pb::VersionInfo& v : *resp->mutable_versions()) FleetVersionQuality(*q, &v);
      resp->set_quality_scope("fleet");
      resp->set_quality_fleet_seq(q->fleet_seq);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ExportReadout(grpc::ServerContext* ctx,
                                         const pb::ExportReadoutRequest* req,
                                         pb::ExportReadoutResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  readout::ReadoutState state;
  if (req->from_trainer() && core_->fleet() != nullptr) {
    // Fleet mode: theta and P as the trainer holds them (no version added).
    absl::StatusOr<readout::ReadoutState> s = core_->fleet()->ExportState(req->name());
    if (!s.ok()) return ToGrpc(s.status());
    state = std::move(*s);
  } else {
    state = (*r)->Export();
  }
  state.note = absl::StrCat("exported from leapd readout '", req->name(), "'");
  auto bytes = readout::SerializeArtifact(state);
  if (!bytes.ok()) return ToGrpc(bytes.status());
  resp->set_artifact(std::move(*bytes));
  resp->set_version(state.version);
  return grpc::Status::OK;
}

grpc::Status AdminService::SetAdaptation(grpc::ServerContext* ctx,
                                         const pb::SetAdaptationRequest* req,
                                         pb::ReadoutInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->name());
  if (!r.ok()) return ToGrpc(r.status());
  absl::Status s = core_->fleet() != nullptr
                       ? core_->fleet()->SetFrozen(req->name(), req->frozen())
                       : (*r)->SetFrozen(req->frozen());
  if (!s.ok()) return ToGrpc(s);
  FillInfo(**r, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::SetRoute(grpc::ServerContext* ctx,
                                    const pb::SetRouteRequest* req,
                                    pb::Route* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  Route route;
  route.product_line = req->route().product_line();
  for (const auto& a : req->route().arms()) {
    route.arms.push_back({a.name(), a.readout(), a.percent(), a.shadow()});
  }
  absl::Status s = core_->fleet() != nullptr ? core_->fleet()->SetRoute(route)
                                              : core_->SetRoute(route);
  if (!s.ok()) return ToGrpc(s);
  for (const Route& r : core_->ListRoutes()) {
    if (r.product_line != route.product_line) continue;
    resp->set_product_line(r.product_line);
    for (const auto& a : r.arms) {
      pb::Arm* arm = resp->add_arms();
      arm->set_name(a.name);
      arm->set_readout(a.readout);
      arm->set_percent(a.percent);
      arm->set_shadow(a.shadow);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::ListRoutes(grpc::ServerContext* ctx,
                                      const pb::ListRoutesRequest*,
                                      pb::ListRoutesResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  for (const Route& r : core_->ListRoutes()) {
    pb::Route* out = resp->add_routes();
    out->set_product_line(r.product_line);
    for (const auto& a : r.arms) {
      pb::Arm* arm = out->add_arms();
      arm->set_name(a.name);
      arm->set_readout(a.readout);
      arm->set_percent(a.percent);
      arm->set_shadow(a.shadow);
    }
  }
  return grpc::Status::OK;
}

grpc::Status AdminService::DeleteRoute(grpc::ServerContext* ctx,
                                       const pb::DeleteRouteRequest* req,
                                       pb::DeleteRouteResponse*) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  if (core_->fleet() != nullptr) {
    return ToGrpc(core_->fleet()->DeleteRoute(req->product_line()));
  }
  return ToGrpc(core_->DeleteRoute(req->product_line()));
}

grpc::Status AdminService::GetStats(grpc::ServerContext* ctx,
                                    const pb::GetStatsRequest* req,
                                    pb::StatsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  if (!req->readout().empty()) {
    auto r = core_->GetReadout(req->readout());
    if (!r.ok()) return ToGrpc(r.status());
  }
  // Fleet mode: the fleet-wide quality the trainer published, per readout.
  std::map<std::string, FleetQualityView> fleet_quality;
  for (auto& r : core_->ListReadouts()) {
    if (!req->readout().empty() && r->name() != req->readout()) continue;
    std::optional<FleetQualityView> q;
    if (core_->fleet() != nullptr) q = core_->fleet()->Quality(r->name());
    pb::ReadoutStats* s = resp->add_readouts();
    FillInfo(*r, s->mutable_info());
    ReadoutMetrics& m = r->metrics();
    s->set_predictions(static_cast<int64_t>(m.predictions_serving->Value() +
                                            m.predictions_shadow->Value()));
    s->set_completions_learned(r->completions_learned());
    s->set_skipped_cancelled(static_cast<int64_t>(m.skipped_cancelled->Value()));
    s->set_skipped_censored(static_cast<int64_t>(m.skipped_censored->Value()));
    s->set_skipped_frozen(static_cast<int64_t>(m.skipped_frozen->Value()));
    int64_t n = 0;
    s->set_spearman(r->spearman(&n));
    s->set_spearman_n(n);
    if (q.has_value()) {
      s->set_spearman(q->overall.spearman);
      s->set_spearman_n(q->overall.spearman_n);
      s->set_quality_scope("fleet");
      s->set_quality_fleet_seq(q->fleet_seq);
    }
    for (const VersionRecord& v : r->Versions()) {
      pb::VersionInfo info;
      FillVersion(v, &info);
      if (q.has_value()) FleetVersionQuality(*q, &info);
      if (info.spearman_n() > 0 || v.version == r->current()->version) {
        *s->add_versions() = std::move(info);
      }
    }
    FillGuardrail(r->guardrail(), s->mutable_guardrail());
    if (q.has_value()) fleet_quality[r->name()] = std::move(*q);
  }
  std::set<std::tuple<std::string, std::string, std::string>> listed;
  for (const ArmStat& a : core_->ArmStats()) {
    if (!req->readout().empty() && a.readout != req->readout()) continue;
    pb::ArmStats* s = resp->add_arms();
    s->set_product_line(a.product_line);
    s->set_arm(a.arm);
    s->set_readout(a.readout);
    s->set_shadow(a.shadow);
    s->set_predictions(a.predictions);
    s->set_completions(a.completions);
    s->set_spearman(a.spearman);
    s->set_spearman_n(a.spearman_n);
    auto q = fleet_quality.find(a.readout);
    if (q == fleet_quality.end()) continue;
    // Fleet-wide: this arm's completions on every member (none counted yet
    // is 0 and NaN).
    s->set_completions(0);
    s->set_spearman(NAN);
    s->set_spearman_n(0);
    s->set_quality_scope("fleet");
    listed.emplace(a.readout, a.product_line, a.arm);
    for (const FleetQualitySeriesView& f : q->second.arms) {
      if (f.product_line == a.product_line && f.arm == a.arm) {
        s->set_completions(f.completions);
        s->set_spearman(f.spearman);
        s->set_spearman_n(f.spearman_n);
      }
    }
  }
  // Arms that only other members served (no prediction here).
  for (const auto& [name, q] : fleet_quality) {
    for (const FleetQualitySeriesView& f : q.arms) {
      if (listed.contains({name, f.product_line, f.arm})) continue;
      pb::ArmStats* s = resp->add_arms();
      s->set_product_line(f.product_line);
      s->set_arm(f.arm);
      s->set_readout(name);
      for (const Route& route : core_->ListRoutes()) {
        if (route.product_line != f.product_line) continue;
        for (const Arm& arm : route.arms) {
          if (arm.name == f.arm && arm.readout == name) s->set_shadow(arm.shadow);
        }
      }
      s->set_completions(f.completions);
      s->set_spearman(f.spearman);
      s->set_spearman_n(f.spearman_n);
      s->set_quality_scope("fleet");
    }
  }
  resp->set_live_requests(core_->cache().size());
  resp->set_feature_cache_bytes(core_->cache().bytes());
  resp->set_unknown_completions(core_->unknown_completions());
  resp->set_evicted_capacity(core_->cache().evicted_capacity());
  resp->set_evicted_ttl(core_->cache().evicted_ttl());
  if (core_->store() != nullptr) {
    for (const auto& [family, bytes] : core_->store()->BytesPerFamily()) {
      (*resp->mutable_storage_bytes())[family] = bytes;
    }
  }
  if (core_->fleet() != nullptr) {
    const FleetStatus f = core_->fleet()->Status();
    pb::FleetStats* out = resp->mutable_fleet();
    out->set_fleet(f.fleet);
    out->set_member(f.member);
    out->set_role(f.role);
    out->set_trainer(f.trainer);
    out->set_degraded(f.degraded);
    out->set_degraded_reason(f.degraded_reason);
    out->set_last_fleet_seq(f.last_fleet_seq);
    out->set_unconfirmed(f.unconfirmed);
  }
  return grpc::Status::OK;
}

namespace {
void FillSnapshot(const storage::SnapshotInfo& i, pb::SnapshotInfo* out) {
  out->set_label(i.label);
  out->set_version(i.version);
  out->set_completions_learned(i.completions_learned);
  out->set_spearman(i.spearman);
  out->set_unix_ms(i.unix_ms);
  out->set_spearman_n(i.spearman_n);
}
}  // namespace

grpc::Status AdminService::CreateSnapshot(grpc::ServerContext* ctx,
                                          const pb::CreateSnapshotRequest* req,
                                          pb::SnapshotInfo* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto info = core_->fleet() != nullptr
                  ? core_->fleet()->Snapshot(req->readout(), req->label())
                  : core_->Snapshot(req->readout(), req->label());
  if (!info.ok()) return ToGrpc(info.status());
  FillSnapshot(*info, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::ListSnapshots(grpc::ServerContext* ctx,
                                         const pb::ListSnapshotsRequest* req,
                                         pb::ListSnapshotsResponse* resp) {
  if (grpc::Status s = CheckAdmin(ctx); !s.ok()) return s;
  auto r = core_->GetReadout(req->readout());
  if (!r.ok()) return ToGrpc(r.status());
  auto list = core_->fleet() != nullptr
                  ? core_->fleet()->ListSnapshots(req->readout())
                  : (*r)->ListSnapshots();
  if (!list.ok()) return ToGrpc(list.status());
  for (const auto& i : *list) FillSnapshot(i, resp->add_snapshots());
  return grpc::Status::OK;
}

grpc::Status AdminService::Rollback(grpc::ServerContext* ctx,
                                    const pb::RollbackRequest* req,
                                    pb::RollbackResponse* resp) {
  if (grpc::Status s = CheckAdminWrite(ctx); !s.ok()) return s;
  auto v = core_->fleet() != nullptr
               ? core_->fleet()->Rollback(req->readout(), req->label())
               : core_->Rollback(req->readout(), req->label());
  if (!v.ok()) return ToGrpc(v.status());
  resp->set_version(*v);
  return grpc::Status::OK;
}

}  // namespace leap::sidecar
