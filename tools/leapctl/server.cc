#include "tools/leapctl/server.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "readout/artifact.h"
#include "readout/features.h"
#include "readout/target.h"
#include "tools/leapctl/data.h"

namespace leap::leapctl {
namespace {

namespace pb = ::leap::v1;

absl::Status Usage(absl::string_view what) {
  return absl::InvalidArgumentError(what);
}

nlohmann::json JsonNumber(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

std::string FormatSpearman(double v) {
  return std::isfinite(v) ? absl::StrFormat("%.4f", v) : "-";
}

std::string FormatTimeMs(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

std::string ProductLineName(const std::string& product_line) {
  return product_line.empty() ? "(default)" : product_line;
}

nlohmann::json InfoJson(const pb::ReadoutInfo& i) {
  nlohmann::json j;
  j["name"] = i.name();
  j["dim"] = i.dim();
  j["layer"] = i.layer();
  j["model_id"] = i.model_id();
  j["max_tokens"] = i.max_tokens();
  j["lambda"] = JsonNumber(i.lambda());
  j["version"] = i.version();
  j["completions_learned"] = i.completions_learned();
  j["frozen"] = i.frozen();
  j["frozen_reason"] = i.frozen_reason();
  j["rls_backlog"] = i.rls_backlog();
  j["created_unix_ms"] = i.created_unix_ms();
  return j;
}

nlohmann::json GuardrailJson(const pb::GuardrailStats& g) {
  nlohmann::json j;
  j["state"] = g.state().empty() ? "off" : g.state();
  j["spearman"] = JsonNumber(g.spearman());
  j["spearman_n"] = g.spearman_n();
  j["trips"] = g.trips();
  j["last_trip"] = g.last_trip();
  j["last_trip_unix_ms"] = g.last_trip_unix_ms();
  j["last_good_label"] = g.last_good_label();
  j["last_good_spearman"] = g.last_good_label().empty()
                                ? nlohmann::json()
                                : JsonNumber(g.last_good_spearman());
  j["last_good_spearman_n"] = g.last_good_spearman_n();
  return j;
}

nlohmann::json VersionJson(const pb::VersionInfo& v) {
  nlohmann::json j;
  j["version"] = v.version();
  j["completions_learned"] = v.completions_learned();
  j["published_unix_ms"] = v.published_unix_ms();
  j["cause"] = v.cause();
  j["spearman"] = JsonNumber(v.spearman());
  j["spearman_n"] = v.spearman_n();
  return j;
}

nlohmann::json RouteJson(const pb::Route& r) {
  nlohmann::json j;
  j["product_line"] = r.product_line();
  j["arms"] = nlohmann::json::array();
  for (const pb::Arm& a : r.arms()) {
    nlohmann::json arm;
    arm["name"] = a.name();
    arm["readout"] = a.readout();
    arm["percent"] =
        a.shadow() ? nlohmann::json(nullptr) : nlohmann::json(a.percent());
    arm["shadow"] = a.shadow();
    j["arms"].push_back(std::move(arm));
  }
  return j;
}

}  // namespace

// ---- readouts create --------------------------------------------------------

absl::Status CreateReadoutOptions::Validate() const {
  if (name.empty()) return Usage("missing required argument NAME");
  const bool artifact = !artifact_path.empty();
  if (artifact == cold_start) {
    return Usage("give exactly one of --artifact PATH or --cold-start");
  }
  if (artifact) {
    if (dim != 0 || lambda != 0) {
      return Usage("--dim and --lambda only apply with --cold-start");
    }
    return absl::OkStatus();
  }
  if (dim < readout::kMinDim || dim > readout::kMaxDim) {
    return Usage(absl::StrCat("--cold-start needs --dim in [", readout::kMinDim,
                              ", ", readout::kMaxDim, "], got ", dim));
  }
  if (!(lambda > 0)) {
    return Usage(absl::StrCat("--cold-start needs --lambda > 0, got ", lambda));
  }
  if (max_tokens < 1 || max_tokens > readout::kMaxReportedTokens) {
    return Usage(absl::StrCat("--max-tokens must be in [1, ",
                              readout::kMaxReportedTokens, "], got ",
                              max_tokens));
  }
  if (layer < -1 || layer > INT32_MAX) {
    return Usage(absl::StrCat("--layer must be >= -1, got ", layer));
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::ReadoutInfo> RunCreateReadout(
    AdminClient& client, const CreateReadoutOptions& o) {
  RETURN_IF_ERROR(o.Validate());
  pb::CreateReadoutRequest req;
  req.set_name(o.name);
  if (o.cold_start) {
    pb::ColdStart* c = req.mutable_cold_start();
    c->set_dim(o.dim);
    c->set_lambda(o.lambda);
    c->set_max_tokens(o.max_tokens);
    c->set_layer(static_cast<int32_t>(o.layer));
    c->set_model_id(o.model_id);
  } else {
    ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(o.artifact_path));
    // Check locally so a bad file is named by its path.
    RETURN_IF_ERROR(readout::ParseArtifact(bytes, o.artifact_path).status());
    req.set_artifact(std::move(bytes));
  }
  return client.CreateReadout(req);
}

// ---- export ----------------------------------------------------------------

absl::StatusOr<ExportReport> RunExport(AdminClient& client,
                                       const std::string& name,
                                       const std::string& out_path,
                                       bool from_trainer) {
  if (name.empty()) return Usage("missing required argument NAME");
  if (out_path.empty()) return Usage("missing required flag --out");
  ASSIGN_OR_RETURN(pb::ExportReadoutResponse resp, client.ExportReadout(name, from_trainer));
  absl::StatusOr<readout::ReadoutState> state = readout::ParseArtifact(
      resp.artifact(),
      absl::StrCat("artifact exported by leapd for '", name, "'"));
  if (!state.ok()) {
    return absl::DataLossError(absl::StrCat(
        "leapd exported an invalid artifact: ", state.status().message()));
  }
  RETURN_IF_ERROR(WriteFileAtomically(out_path, resp.artifact()));
  ExportReport r;
  r.name = name;
  r.version = resp.version();
  r.artifact_version = state->version;
  r.dim = state->spec.dim;
  r.completions_learned = state->completions_learned;
  r.has_p = state->p.has_value();
  r.bytes = static_cast<int64_t>(resp.artifact().size());
  r.out_path = out_path;
  return r;
}

std::string FormatExportReport(const ExportReport& r) {
  std::string s = absl::StrFormat("exported readout %s version %d to %s\n",
                                  r.name, r.artifact_version, r.out_path);
  absl::StrAppendFormat(&s, "version: %d\n", r.artifact_version);
  if (r.version != r.artifact_version) {
    absl::StrAppendFormat(
        &s, "server_version: %d (differs from the artifact)\n", r.version);
  }
  absl::StrAppendFormat(&s, "dim: %d\ncompletions_learned: %d\n", r.dim,
                        r.completions_learned);
  absl::StrAppendFormat(&s, "rls_matrix_p: %s\nbytes: %d\nout: %s\n",
                        r.has_p ? "yes" : "no", r.bytes, r.out_path);
  return s;
}

// ---- freeze / resume --------------------------------------------------------

absl::StatusOr<pb::ReadoutInfo> RunSetAdaptation(AdminClient& client,
                                                 const std::string& name,
                                                 bool frozen, bool wait_idle) {
  if (name.empty()) return Usage("missing required argument NAME");
  ASSIGN_OR_RETURN(pb::ReadoutInfo info, client.SetAdaptation(name, frozen));
  // Freezing is immediate on the sidecar (no batch is applied after the
  // call returns), so --wait has nothing left to wait for.
  (void)wait_idle;
  return info;
}

// ---- route -----------------------------------------------------------------

absl::StatusOr<pb::Arm> ParseArm(absl::string_view spec, bool shadow,
                                 bool percent_optional) {
  const std::string flag = shadow ? "--shadow" : "--arm";
  const std::string syntax = shadow ? "NAME=READOUT" : "NAME=READOUT:PERCENT";
  const auto bad = [&](absl::string_view why) {
    return Usage(
        absl::StrCat(flag, " '", spec, "': ", why, " (expected ", syntax, ")"));
  };
  const size_t eq = spec.find('=');
  pb::Arm arm;
  if (eq == absl::string_view::npos && percent_optional && !spec.empty() &&
      spec.find(':') == absl::string_view::npos) {
    // A lone arm given as just READOUT: named after it, 100%.
    arm.set_name(std::string(spec));
    arm.set_readout(std::string(spec));
    arm.set_percent(100);
    return arm;
  }
  if (eq == absl::string_view::npos) return bad("no '='");
  arm.set_name(std::string(spec.substr(0, eq)));
  if (arm.name().empty()) return bad("empty arm name");
  absl::string_view rest = spec.substr(eq + 1);
  arm.set_shadow(shadow);
  if (shadow) {
    if (rest.empty()) return bad("empty readout name");
    if (rest.find(':') != absl::string_view::npos) {
      return bad("a shadow arm takes no percent");
    }
    arm.set_readout(std::string(rest));
    return arm;
  }
  const size_t colon = rest.rfind(':');
  if (colon == absl::string_view::npos) {
    if (!percent_optional) return bad("no ':PERCENT'");
    if (rest.empty()) return bad("empty readout name");
    arm.set_readout(std::string(rest));
    arm.set_percent(100);
    return arm;
  }
  arm.set_readout(std::string(rest.substr(0, colon)));
  if (arm.readout().empty()) return bad("empty readout name");
  double percent = 0;
  if (!absl::SimpleAtod(rest.substr(colon + 1), &percent) ||
      !std::isfinite(percent)) {
    return bad(
        absl::StrCat("percent '", rest.substr(colon + 1), "' is not a number"));
  }
  if (!(percent > 0) || percent > 100) {
    return bad(absl::StrCat("percent must be in (0, 100], got ", percent));
  }
  arm.set_percent(percent);
  return arm;
}

absl::StatusOr<pb::Route> ParseRoute(const std::string& product_line,
                                     const std::vector<std::string>& arms,
                                     const std::vector<std::string>& shadows) {
  if (arms.empty()) return Usage("a route needs at least one --arm");
  pb::Route route;
  route.set_product_line(product_line);
  for (const std::string& a : arms) {
    ASSIGN_OR_RETURN(pb::Arm arm,
                     ParseArm(a, /*shadow=*/false,
                              /*percent_optional=*/arms.size() == 1));
    *route.add_arms() = std::move(arm);
  }
  for (const std::string& s : shadows) {
    ASSIGN_OR_RETURN(pb::Arm arm, ParseArm(s, /*shadow=*/true,
                                           /*percent_optional=*/false));
    *route.add_arms() = std::move(arm);
  }
  return route;
}

absl::StatusOr<std::vector<pb::Route>> ParseRoutesJson(
    absl::string_view text, const std::string& source) {
  const auto bad = [&](const std::string& why) {
    return Usage(absl::StrCat(source, ": ", why,
                              " (expected {\"routes\": [{\"product_line\", "
                              "\"arms\": [{\"name\", \"readout\", "
                              "\"percent\" | \"shadow\": true}]}]})"));
  };
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                           /*allow_exceptions=*/false);
  if (j.is_discarded()) return bad("not valid JSON");
  if (!j.is_object() || !j.contains("routes") || !j["routes"].is_array()) {
    return bad("no \"routes\" array");
  }
  std::vector<pb::Route> routes;
  for (size_t i = 0; i < j["routes"].size(); ++i) {
    const nlohmann::json& r = j["routes"][i];
    const std::string where = absl::StrCat("routes[", i, "]");
    if (!r.is_object() || !r.contains("product_line") ||
        !r["product_line"].is_string()) {
      return bad(absl::StrCat(where, " has no string \"product_line\""));
    }
    if (!r.contains("arms") || !r["arms"].is_array() || r["arms"].empty()) {
      return bad(absl::StrCat(where, " has no \"arms\""));
    }
    pb::Route route;
    route.set_product_line(r["product_line"].get<std::string>());
    for (size_t k = 0; k < r["arms"].size(); ++k) {
      const nlohmann::json& a = r["arms"][k];
      const std::string arm_where = absl::StrCat(where, ".arms[", k, "]");
      if (!a.is_object() || !a.contains("name") || !a["name"].is_string() ||
          !a.contains("readout") || !a["readout"].is_string()) {
        return bad(
            absl::StrCat(arm_where, " needs string \"name\" and \"readout\""));
      }
      pb::Arm* arm = route.add_arms();
      arm->set_name(a["name"].get<std::string>());
      arm->set_readout(a["readout"].get<std::string>());
      if (a.contains("shadow") && !a["shadow"].is_boolean()) {
        return bad(
            absl::StrCat(arm_where, " \"shadow\" must be true or false"));
      }
      arm->set_shadow(a.value("shadow", false));
      if (arm->shadow()) continue;
      if (!a.contains("percent") || !a["percent"].is_number()) {
        return bad(absl::StrCat(arm_where, " needs a number \"percent\""));
      }
      arm->set_percent(a["percent"].get<double>());
    }
    routes.push_back(std::move(route));
  }
  if (routes.empty()) return bad("no routes");
  return routes;
}

absl::StatusOr<std::vector<pb::Route>> RunApplyRoutes(
    AdminClient& client, const std::vector<pb::Route>& routes) {
  ASSIGN_OR_RETURN(pb::ListReadoutsResponse have, client.ListReadouts());
  std::vector<std::string> missing;
  for (const pb::Route& r : routes) {
    for (const pb::Arm& a : r.arms()) {
      const bool found = std::any_of(
          have.readouts().begin(), have.readouts().end(),
          [&](const pb::ReadoutInfo& i) { return i.name() == a.readout(); });
      if (!found && std::find(missing.begin(), missing.end(), a.readout()) ==
                        missing.end()) {
        missing.push_back(a.readout());
      }
    }
  }
  if (!missing.empty()) {
    std::string names;
    for (const std::string& m : missing) {
      absl::StrAppend(&names, names.empty() ? "" : ", ", "'", m, "'");
    }
    return absl::NotFoundError(absl::StrCat(
        "NOT_FOUND: the routes name readouts leapd does not have: ", names,
        " (import them first); no route was changed"));
  }
  std::vector<pb::Route> stored;
  for (const pb::Route& r : routes) {
    absl::StatusOr<pb::Route> s = client.SetRoute(r);
    if (!s.ok()) {
      return absl::Status(
          s.status().code(),
          absl::StrCat(s.status().message(), " (route for product line '",
                       r.product_line(), "'; ", stored.size(),
                       " route(s) before it were set)"));
    }
    stored.push_back(std::move(*s));
  }
  return stored;
}

// ---- formatters ------------------------------------------------------------

std::string FormatReadoutInfo(const pb::ReadoutInfo& i) {
  std::string s = absl::StrFormat("name: %s\n", i.name());
  absl::StrAppendFormat(&s, "version: %d\n", i.version());
  absl::StrAppendFormat(&s, "completions_learned: %d\n",
                        i.completions_learned());
  absl::StrAppendFormat(&s, "frozen: %s\n", i.frozen() ? "yes" : "no");
  if (!i.frozen_reason().empty()) {
    absl::StrAppendFormat(&s, "frozen_reason: %s\n", i.frozen_reason());
  }
  absl::StrAppendFormat(&s, "rls_backlog: %d\n", i.rls_backlog());
  absl::StrAppendFormat(&s, "dim: %d\n", i.dim());
  absl::StrAppendFormat(&s, "max_tokens: %d\n", i.max_tokens());
  absl::StrAppendFormat(&s, "lambda: %.6g\n", i.lambda());
  absl::StrAppendFormat(&s, "layer: %d\n", i.layer());
  absl::StrAppendFormat(&s, "model: %s\n",
                        i.model_id().empty() ? "-" : i.model_id());
  absl::StrAppendFormat(&s, "created: %s\n", FormatTimeMs(i.created_unix_ms()));
  return s;
}

std::string FormatReadoutInfoJson(const pb::ReadoutInfo& info) {
  return InfoJson(info).dump() + "\n";
}

std::string FormatReadoutList(const pb::ListReadoutsResponse& list) {
  if (list.readouts().empty()) return "no readouts\n";
  std::string s = absl::StrFormat("%-24s %6s %8s %10s %6s %8s %6s %6s  %s\n",
                                  "NAME", "DIM", "VERSION", "LEARNED", "FROZEN",
                                  "BACKLOG", "M", "LAYER", "MODEL");
  for (const pb::ReadoutInfo& i : list.readouts()) {
    absl::StrAppendFormat(&s, "%-24s %6d %8d %10d %6s %8d %6d %6d  %s\n",
                          i.name(), i.dim(), i.version(),
                          i.completions_learned(), i.frozen() ? "yes" : "no",
                          i.rls_backlog(), i.max_tokens(), i.layer(),
                          i.model_id().empty() ? "-" : i.model_id());
  }
  return s;
}

std::string FormatReadoutListJson(const pb::ListReadoutsResponse& list) {
  nlohmann::json j;
  j["readouts"] = nlohmann::json::array();
  for (const pb::ReadoutInfo& i : list.readouts()) {
    j["readouts"].push_back(InfoJson(i));
  }
  return j.dump() + "\n";
}

std::string FormatVersions(const pb::ListVersionsResponse& versions) {
  std::string s =
      absl::StrFormat("%8s %12s  %-24s %-10s %8s %6s\n", "VERSION", "LEARNED",
                      "PUBLISHED (UTC)", "CAUSE", "SPEARMAN", "N");
  for (const pb::VersionInfo& v : versions.versions()) {
    absl::StrAppendFormat(&s, "%8d %12d  %-24s %-10s %8s %6d\n", v.version(),
                          v.completions_learned(),
                          FormatTimeMs(v.published_unix_ms()), v.cause(),
                          FormatSpearman(v.spearman()), v.spearman_n());
  }
  if (versions.total_versions() > versions.versions_size()) {
    absl::StrAppendFormat(&s, "(newest %d of %d versions; --limit 0 for all)\n",
                          versions.versions_size(), versions.total_versions());
  }
  if (versions.quality_scope() == "fleet") {
    absl::StrAppendFormat(&s,
                          "(spearman: fleet-wide, every member's completions up to "
                          "fleet_seq %d; windows and labels: this member's)\n",
                          versions.quality_fleet_seq());
  }
  if (versions.windows_size() > 0) {
    absl::StrAppendFormat(&s, "\nquality per window of %d completions:\n",
                          versions.window());
    absl::StrAppendFormat(&s, "%12s %6s  %-17s %-24s %8s\n", "FIRST", "N",
                          "VERSIONS", "END (UTC)", "SPEARMAN");
    for (const pb::QualityWindow& w : versions.windows()) {
      absl::StrAppendFormat(
          &s, "%12d %6d  %-17s %-24s %8s\n", w.first_completion(),
          w.completions(),
          absl::StrCat(w.first_version(), "-", w.last_version()),
          FormatTimeMs(w.end_unix_ms()), FormatSpearman(w.spearman()));
    }
  }
  if (versions.labels_size() > 0) {
    absl::StrAppend(&s, "\nquality since each snapshot label:\n");
    absl::StrAppendFormat(&s, "%-24s %-17s %8s %8s\n", "LABEL", "VERSIONS", "N",
                          "SPEARMAN");
    for (const pb::LabelQuality& l : versions.labels()) {
      absl::StrAppendFormat(
          &s, "%-24s %-17s %8d %8s\n", l.label(),
          absl::StrCat(l.from_version(), "-",
                       l.to_version() == 0 ? std::string("now")
                                           : absl::StrCat(l.to_version() - 1)),
          l.completions(), FormatSpearman(l.spearman()));
    }
  }
  return s;
}

std::string FormatVersionsJson(const pb::ListVersionsResponse& versions) {
  nlohmann::json j;
  j["versions"] = nlohmann::json::array();
  for (const pb::VersionInfo& v : versions.versions()) {
    j["versions"].push_back(VersionJson(v));
  }
  j["total_versions"] = versions.total_versions();
  j["quality_scope"] = versions.quality_scope();
  j["quality_fleet_seq"] = versions.quality_fleet_seq();
  j["window"] = versions.window();
  j["windows"] = nlohmann::json::array();
  for (const pb::QualityWindow& w : versions.windows()) {
    j["windows"].push_back({{"first_completion", w.first_completion()},
                            {"completions", w.completions()},
                            {"first_version", w.first_version()},
                            {"last_version", w.last_version()},
                            {"start_unix_ms", w.start_unix_ms()},
                            {"end_unix_ms", w.end_unix_ms()},
                            {"spearman", JsonNumber(w.spearman())}});
  }
  j["labels"] = nlohmann::json::array();
  for (const pb::LabelQuality& l : versions.labels()) {
    j["labels"].push_back({{"label", l.label()},
                           {"from_version", l.from_version()},
                           {"to_version", l.to_version()},
                           {"completions", l.completions()},
                           {"spearman", JsonNumber(l.spearman())}});
  }
  return j.dump() + "\n";
}

std::string FormatRoute(const pb::Route& r) {
  std::string s;
  for (const pb::Arm& a : r.arms()) {
    absl::StrAppendFormat(
        &s, "%-20s %-16s %-24s %s\n", ProductLineName(r.product_line()),
        a.name(), a.readout(),
        a.shadow() ? "shadow" : absl::StrFormat("%g%%", a.percent()));
  }
  return s;
}

std::string FormatRoutes(const pb::ListRoutesResponse& routes) {
  if (routes.routes().empty()) return "no routes\n";
  std::string s = absl::StrFormat("%-20s %-16s %-24s %s\n", "PRODUCT_LINE",
                                  "ARM", "READOUT", "SHARE");
  for (const pb::Route& r : routes.routes())
    absl::StrAppend(&s, FormatRoute(r));
  return s;
}

std::string FormatRoutesJson(const pb::ListRoutesResponse& routes) {
  nlohmann::json j;
  j["routes"] = nlohmann::json::array();
  for (const pb::Route& r : routes.routes())
    j["routes"].push_back(RouteJson(r));
  return j.dump() + "\n";
}

std::string FormatStats(const pb::StatsResponse& st) {
  std::string s;
  for (const pb::ReadoutStats& r : st.readouts()) {
    const pb::ReadoutInfo& i = r.info();
    absl::StrAppendFormat(
        &s, "readout %s: version %d%s, rls backlog %d\n", i.name(),
        i.version(),
        !i.frozen()                    ? ""
        : i.frozen_reason().empty()    ? " (frozen)"
                                       : absl::StrCat(" (frozen: ",
                                                      i.frozen_reason(), ")"),
        i.rls_backlog());
    absl::StrAppendFormat(
        &s,
        "  predictions %d, learned %d, skipped %d (cancelled %d, censored %d, "
        "frozen %d)\n",
        r.predictions(), r.completions_learned(),
        r.skipped_cancelled() + r.skipped_censored() + r.skipped_frozen(),
        r.skipped_cancelled(), r.skipped_censored(), r.skipped_frozen());
    absl::StrAppendFormat(
        &s, "  spearman %s (last %d completions%s)\n", FormatSpearman(r.spearman()),
        r.spearman_n(),
        r.quality_scope() == "fleet"
            ? absl::StrFormat(", fleet-wide up to fleet_seq %d", r.quality_fleet_seq())
            : std::string());
    if (i.frozen() && !i.frozen_reason().empty()) {
      absl::StrAppendFormat(&s, "  frozen: %s\n", i.frozen_reason());
    }
    const pb::GuardrailStats& g = r.guardrail();
    if (!g.state().empty() && g.state() != "off") {
      absl::StrAppendFormat(
          &s, "  guardrail %s: spearman %s (n %d), last good %s, trips %d\n",
          g.state(), FormatSpearman(g.spearman()), g.spearman_n(),
          g.last_good_label().empty()
              ? std::string("none")
              : absl::StrFormat("'%s' (spearman %s, n %d)",
                                g.last_good_label(),
                                FormatSpearman(g.last_good_spearman()),
                                g.last_good_spearman_n()),
          g.trips());
      if (!g.last_trip().empty()) {
        absl::StrAppendFormat(&s, "    last trip %s: %s\n",
                              FormatTimeMs(g.last_trip_unix_ms()),
                              g.last_trip());
      }
    }
    // The latest few; `leapctl versions` lists them all.
    constexpr int kShownVersions = 8;
    const int first = std::max(0, r.versions_size() - kShownVersions);
    if (first > 0) {
      absl::StrAppendFormat(&s,
                            "    (%d older versions with quality: see "
                            "'leapctl versions %s')\n",
                            first, i.name());
    }
    for (int k = first; k < r.versions_size(); ++k) {
      const pb::VersionInfo& v = r.versions(k);
      absl::StrAppendFormat(&s, "    version %d (%s): spearman %s (n %d)\n",
                            v.version(), v.cause(),
                            FormatSpearman(v.spearman()), v.spearman_n());
    }
  }
  if (!st.arms().empty()) {
    absl::StrAppendFormat(&s, "%-20s %-16s %-24s %6s %11s %11s %8s %6s\n",
                          "PRODUCT_LINE", "ARM", "READOUT", "SHADOW",
                          "PREDICTIONS", "COMPLETIONS", "SPEARMAN", "N");
    for (const pb::ArmStats& a : st.arms()) {
      absl::StrAppendFormat(&s, "%-20s %-16s %-24s %6s %11d %11d %8s %6d\n",
                            ProductLineName(a.product_line()), a.arm(),
                            a.readout(), a.shadow() ? "yes" : "no",
                            a.predictions(), a.completions(),
                            FormatSpearman(a.spearman()), a.spearman_n());
    }
    if (std::any_of(st.arms().begin(), st.arms().end(),
                    [](const pb::ArmStats& a) { return a.quality_scope() == "fleet"; })) {
      absl::StrAppend(&s, "(completions, spearman: fleet-wide; predictions: this member's)\n");
    }
  }
  absl::StrAppendFormat(&s, "live_requests: %d\n", st.live_requests());
  absl::StrAppendFormat(&s, "feature_cache_bytes: %d\n",
                        st.feature_cache_bytes());
  absl::StrAppendFormat(&s, "unknown_completions: %d\n",
                        st.unknown_completions());
  absl::StrAppendFormat(&s, "evicted: %d (capacity), %d (ttl)\n",
                        st.evicted_capacity(), st.evicted_ttl());
  if (st.has_fleet()) {
    const pb::FleetStats& f = st.fleet();
    absl::StrAppendFormat(
        &s, "fleet: %s, member %s (%s), trainer %s, last_fleet_seq %d, "
            "unconfirmed %d%s%s\n",
        f.fleet(), f.member(), f.role(), f.trainer().empty() ? "-" : f.trainer(),
        f.last_fleet_seq(), f.unconfirmed(), f.degraded() ? ", DEGRADED: " : "",
        f.degraded() ? f.degraded_reason() : "");
  }
  return s;
}

std::string FormatStatsJson(const pb::StatsResponse& st) {
  nlohmann::json j;
  j["readouts"] = nlohmann::json::array();
  for (const pb::ReadoutStats& r : st.readouts()) {
    nlohmann::json o;
    o["name"] = r.info().name();
    o["version"] = r.info().version();
    o["frozen"] = r.info().frozen();
    o["frozen_reason"] = r.info().frozen_reason();
    o["guardrail"] = GuardrailJson(r.guardrail());
    o["rls_backlog"] = r.info().rls_backlog();
    o["predictions"] = r.predictions();
    o["completions_learned"] = r.completions_learned();
    o["skipped"] = {{"cancelled", r.skipped_cancelled()},
                    {"censored", r.skipped_censored()},
                    {"frozen", r.skipped_frozen()}};
    o["spearman"] = JsonNumber(r.spearman());
    o["spearman_n"] = r.spearman_n();
    o["quality_scope"] = r.quality_scope();
    o["quality_fleet_seq"] = r.quality_fleet_seq();
    o["versions"] = nlohmann::json::array();
    for (const pb::VersionInfo& v : r.versions()) {
      o["versions"].push_back(VersionJson(v));
    }
    j["readouts"].push_back(std::move(o));
  }
  j["arms"] = nlohmann::json::array();
  for (const pb::ArmStats& a : st.arms()) {
    nlohmann::json o;
    o["product_line"] = a.product_line();
    o["arm"] = a.arm();
    o["readout"] = a.readout();
    o["shadow"] = a.shadow();
    o["predictions"] = a.predictions();
    o["completions"] = a.completions();
    o["spearman"] = JsonNumber(a.spearman());
    o["spearman_n"] = a.spearman_n();
    o["quality_scope"] = a.quality_scope();
    j["arms"].push_back(std::move(o));
  }
  j["live_requests"] = st.live_requests();
  j["feature_cache_bytes"] = st.feature_cache_bytes();
  j["unknown_completions"] = st.unknown_completions();
  j["evicted_capacity"] = st.evicted_capacity();
  j["evicted_ttl"] = st.evicted_ttl();
  if (st.has_fleet()) {
    const pb::FleetStats& f = st.fleet();
    j["fleet"] = {{"fleet", f.fleet()},
                  {"member", f.member()},
                  {"role", f.role()},
                  {"trainer", f.trainer()},
                  {"degraded", f.degraded()},
                  {"degraded_reason", f.degraded_reason()},
                  {"last_fleet_seq", f.last_fleet_seq()},
                  {"unconfirmed", f.unconfirmed()}};
  }
  return j.dump() + "\n";
}

}  // namespace leap::leapctl
