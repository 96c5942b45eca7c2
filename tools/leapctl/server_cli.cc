// The command lines of leapctl's commands for a running leapd: flags, --help
// text and output. The logic lives in server.h, bench.h and feed.h.
#include <cstdlib>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/bench.h"
#include "tools/leapctl/data.h"
#include "tools/leapctl/feed.h"
#include "tools/leapctl/flags.h"
#include "tools/leapctl/internal/command.h"
#include "tools/leapctl/server.h"

namespace leap::leapctl::internal {

using client::BenchOptions;
using client::BenchReport;
using client::FormatBenchJson;
using client::FormatBenchReport;
using client::RunBench;

namespace {

namespace pb = ::leap::v1;

void ServerFlags(FlagSet& flags, ServerOptions* o) {
  if (const char* env = std::getenv("LEAP_SERVER"); env != nullptr && *env) {
    o->address = env;
  }
  flags.String("server", &o->address, "ADDR",
               "leapd's gRPC address: host:port or unix:///path. Default: "
               "$LEAP_SERVER, else 127.0.0.1:7070.");
  flags.Double("timeout", &o->timeout_s, "SECONDS",
               "How long to wait for each answer from leapd.");
  if (const char* env = std::getenv("LEAP_ADMIN_TOKEN_FILE");
      env != nullptr && o->token_file.empty()) {
    o->token_file = env;
  }
  flags.String("token-file", &o->token_file, "PATH",
               "File with leapd's admin bearer token (leapd "
               "--admin_token_file), sent on every admin call; needed over "
               "TCP when leapd requires one. Default: $LEAP_ADMIN_TOKEN_FILE.");
  for (auto [env, field] : {std::pair{"LEAP_TLS_CA", &o->tls_ca_file},
                            {"LEAP_TLS_CERT", &o->tls_cert_file},
                            {"LEAP_TLS_KEY", &o->tls_key_file}}) {
    if (const char* v = std::getenv(env); v != nullptr && field->empty()) {
      *field = v;
    }
  }
  flags.String("tls-ca", &o->tls_ca_file, "PATH",
               "PEM CA certificate that signed leapd's TLS certificate "
               "(leapd --tls_cert): connect with TLS. Default: $LEAP_TLS_CA.");
  flags.String("tls-cert", &o->tls_cert_file, "PATH",
               "PEM client certificate chain for mutual TLS (leapd "
               "--tls_client_ca); with --tls-key. Default: $LEAP_TLS_CERT.");
  flags.String("tls-key", &o->tls_key_file, "PATH",
               "PEM private key of --tls-cert. Default: $LEAP_TLS_KEY.");
}

// Checks the server flags; -1 to continue, else the exit code.
int CheckServer(Command& cmd, const ServerOptions& o) {
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  return -1;
}

bool IsHelp(const std::string& a) {
  return a == "--help" || a == "-h" || a == "help";
}

// Dispatches `leapctl GROUP SUB ...` to `subs`; prints the group's help for
// "--help" and a usage error for a missing or unknown subcommand.
struct Sub {
  std::string name;
  int (*run)(const std::vector<std::string>&, std::ostream&, std::ostream&);
};
int Dispatch(const std::string& group, const std::string& help,
             const std::vector<Sub>& subs, const std::vector<std::string>& args,
             std::ostream& out, std::ostream& err) {
  std::vector<std::string> names;
  for (const Sub& s : subs) names.push_back(s.name);
  if (!args.empty() && IsHelp(args[0])) {
    out << help;
    return kExitOk;
  }
  if (args.empty()) {
    err << "leapctl " << group << ": error: missing subcommand ("
        << absl::StrJoin(names, ", ") << "; see 'leapctl " << group
        << " --help')" << std::endl;
    return kExitUsage;
  }
  for (const Sub& s : subs) {
    if (args[0] == s.name) {
      return s.run(std::vector<std::string>(args.begin() + 1, args.end()), out,
                   err);
    }
  }
  err << "leapctl " << group << ": error: unknown subcommand '"
      << OneLine(args[0]) << "' (" << absl::StrJoin(names, ", ")
      << "; see 'leapctl " << group << " --help')" << std::endl;
  return kExitUsage;
}

// ---- readouts --------------------------------------------------------------

constexpr char kReadoutsHelp[] =
    "Usage: leapctl readouts <subcommand> [arguments] [flags]\n"
    "\n"
    "Manages the readouts a running leapd serves.\n"
    "\n"
    "Subcommands:\n"
    "  list          Every readout: dim, version, completions learned, "
    "frozen,\n"
    "                RLS backlog, budget, layer, model.\n"
    "  get NAME      One readout's details.\n"
    "  create NAME   Upload a .leapr artifact (--artifact) or start from "
    "nothing\n"
    "                (--cold-start --dim D --lambda L).\n"
    "  delete NAME   Remove a readout (no route may use it).\n"
    "\n"
    "Run 'leapctl readouts <subcommand> --help' for its flags.\n";

int ReadoutsList(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Command cmd("readouts list", out, err);
  ServerOptions server;
  bool json = false;
  FlagSet flags("readouts list", "leapctl readouts list [--json]",
                "Lists the readouts leapd serves: name, feature width, "
                "current version,\ncompletions learned by RLS, whether "
                "adaptation is frozen, completions\nqueued for RLS, output "
                "budget M, layer and model id.");
  ServerFlags(flags, &server);
  flags.Bool("json", &json,
             "Print one JSON object {\"readouts\": [{\"name\", \"dim\", "
             "\"layer\", \"model_id\", \"max_tokens\", \"lambda\", "
             "\"version\", \"completions_learned\", \"frozen\", "
             "\"rls_backlog\", \"created_unix_ms\"}]} instead of a table.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ListReadoutsResponse> r = client.ListReadouts();
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatReadoutListJson(*r) : FormatReadoutList(*r));
  return kExitOk;
}

int ReadoutsGet(const std::vector<std::string>& args, std::ostream& out,
                std::ostream& err) {
  Command cmd("readouts get", out, err);
  ServerOptions server;
  std::string name;
  bool json = false;
  FlagSet flags("readouts get", "leapctl readouts get NAME [--json]",
                "Prints one readout: current version, completions learned, "
                "frozen, RLS\nbacklog, dim, budget M, lambda, layer, model "
                "and creation time.");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  flags.Bool("json", &json,
             "Print one JSON object with the fields of 'readouts list "
             "--json'.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ReadoutInfo> r = client.GetReadout(name);
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatReadoutInfoJson(*r) : FormatReadoutInfo(*r));
  return kExitOk;
}

int ReadoutsDelete(const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err) {
  Command cmd("readouts delete", out, err);
  ServerOptions server;
  std::string name;
  FlagSet flags("readouts delete", "leapctl readouts delete NAME",
                "Removes a readout from leapd. Fails with FAILED_PRECONDITION "
                "while a route\nuses it (change the route first). Its "
                "queued completions are dropped.");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  if (absl::Status s = client.DeleteReadout(name); !s.ok()) {
    return cmd.Failure(s);
  }
  out << "deleted readout " << name << "\n";
  return kExitOk;
}

int ReadoutsCreate(const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err) {
  Command cmd("readouts create", out, err);
  ServerOptions server;
  CreateReadoutOptions o;
  std::optional<int64_t> dim;
  std::optional<double> lambda;
  FlagSet flags(
      "readouts create",
      "leapctl readouts create NAME --artifact R.leapr\n"
      "       leapctl readouts create NAME --cold-start --dim D --lambda L "
      "[--max-tokens M]\n"
      "               [--layer N] [--model ID]",
      "Creates a readout on leapd, at version 1 unless the artifact says "
      "otherwise.\n"
      "With --artifact the .leapr file (leapctl train, adapt or export) is "
      "checked\n"
      "here and uploaded; it adapts online when it holds the RLS matrix P.\n"
      "With --cold-start the readout starts with no training data: theta = "
      "0,\n"
      "P = I / lambda, identity standardization; it learns everything from\n"
      "completions. Prints the created readout.");
  flags.Positional("NAME", &o.name,
                   "Name of the new readout: 1-64 of [A-Za-z0-9._-].");
  ServerFlags(flags, &server);
  flags.String("artifact", &o.artifact_path, "PATH",
               "Readout artifact (.leapr) to upload.");
  flags.Bool("cold-start", &o.cold_start,
             "Create an untrained readout (needs --dim and --lambda).");
  flags.OptionalInt64("dim", &dim, "D",
                      "Cold start: feature width, in [1, 16384].");
  flags.OptionalDouble("lambda", &lambda, "L",
                       "Cold start: prior precision (> 0); P0 = I / L. "
                       "Smaller learns faster.");
  flags.Int64("max-tokens", &o.max_tokens, "M",
              "Cold start: output budget M (predictions are clipped to "
              "[1, M]).");
  flags.Int64("layer", &o.layer, "N",
              "Cold start: model layer the features come from (-1 = "
              "unknown; leapd also reads 0 as unknown).");
  flags.String("model", &o.model_id, "ID",
               "Cold start: serving model id (e.g. Qwen/Qwen3-8B). Default: "
               "empty.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  if (!o.cold_start) {
    for (const char* f : {"dim", "lambda", "max-tokens", "layer", "model"}) {
      if (flags.WasSet(f)) {
        return cmd.UsageError(absl::InvalidArgumentError(
            absl::StrCat("--", f, " only applies with --cold-start")));
      }
    }
  } else {
    if (!dim.has_value()) {
      return cmd.UsageError(
          absl::InvalidArgumentError("--cold-start needs --dim"));
    }
    if (!lambda.has_value()) {
      return cmd.UsageError(
          absl::InvalidArgumentError("--cold-start needs --lambda"));
    }
    o.dim = *dim;
    o.lambda = *lambda;
  }
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  AdminClient client(server);
  absl::StatusOr<pb::ReadoutInfo> r = RunCreateReadout(client, o);
  if (!r.ok()) return cmd.Failure(r.status());
  out << absl::StrFormat(
      "created readout %s version %d (%s)\n", r->name(), r->version(),
      o.cold_start ? "cold start" : absl::StrCat("from ", o.artifact_path));
  out << FormatReadoutInfo(*r);
  return kExitOk;
}

// ---- route -----------------------------------------------------------------

constexpr char kRouteHelp[] =
    "Usage: leapctl route <subcommand> [arguments] [flags]\n"
    "\n"
    "Routes decide which readout serves a product line. A route has serving\n"
    "arms that split the traffic by percent (a request id always lands on "
    "the\n"
    "same arm) and shadow arms that score every request and are measured, "
    "but\n"
    "never answer the engine. The default route (product line \"\") serves\n"
    "product lines without a route of their own.\n"
    "\n"
    "Subcommands:\n"
    "  set PRODUCT_LINE|--default --arm NAME=READOUT:PERCENT [--arm ...]\n"
    "      [--shadow NAME=READOUT ...]   Create or replace a route.\n"
    "  apply --file ROUTES.json          Set every route of a file (the "
    "JSON of\n"
    "                                    'route list --json').\n"
    "  list                              Every route and its arms.\n"
    "  delete PRODUCT_LINE|--default     Remove a route.\n"
    "\n"
    "Run 'leapctl route <subcommand> --help' for its flags.\n";

// Resolves PRODUCT_LINE vs. --default; -1 to continue, else the exit code.
int ProductLine(Command& cmd, const FlagSet& flags, bool use_default,
                std::string* product_line) {
  const bool given = flags.WasSet("PRODUCT_LINE");
  if (given == use_default) {
    return cmd.UsageError(absl::InvalidArgumentError(
        "give exactly one of PRODUCT_LINE or --default"));
  }
  if (given && product_line->empty()) {
    return cmd.UsageError(absl::InvalidArgumentError(
        "empty PRODUCT_LINE; use --default for the default route"));
  }
  if (use_default) product_line->clear();
  return -1;
}

int RouteSet(const std::vector<std::string>& args, std::ostream& out,
             std::ostream& err) {
  Command cmd("route set", out, err);
  ServerOptions server;
  std::string product_line;
  bool use_default = false;
  std::vector<std::string> arms, shadows;
  FlagSet flags(
      "route set",
      "leapctl route set PRODUCT_LINE|--default --arm NAME=READOUT:PERCENT "
      "[--arm ...]\n"
      "                 [--shadow NAME=READOUT ...]",
      "Creates or replaces the route of a product line. The serving arms' "
      "percents\n"
      "must sum to 100; a single --arm may omit :PERCENT (100), or be just "
      "READOUT\n"
      "(an arm named after it). Arm names are reported with predictions and "
      "in\n"
      "'leapctl stats'. Example:\n"
      "  leapctl route set chat --arm a=chat-v1:90 --arm b=chat-v2:10 "
      "--shadow s=cold\n"
      "Prints the route as leapd stored it.");
  flags.Positional("PRODUCT_LINE", &product_line,
                   "The product line (the engine's FeatureRecord."
                   "product_line).",
                   /*required=*/false);
  ServerFlags(flags, &server);
  flags.Bool("default", &use_default,
             "Set the default route (product line \"\") instead of "
             "PRODUCT_LINE.");
  flags.StringList("arm", &arms, "NAME=READOUT:PERCENT",
                   "A serving arm: arm name, readout, share of traffic in "
                   "(0, 100]. At least one.");
  flags.StringList("shadow", &shadows, "NAME=READOUT",
                   "A shadow arm: scores every request of the product line "
                   "and is measured, never served. Note: its readout also "
                   "learns from the completions.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  if (int rc = ProductLine(cmd, flags, use_default, &product_line); rc >= 0) {
    return rc;
  }
  absl::StatusOr<pb::Route> route = ParseRoute(product_line, arms, shadows);
  if (!route.ok()) return cmd.UsageError(route.status());
  AdminClient client(server);
  absl::StatusOr<pb::Route> r = client.SetRoute(*route);
  if (!r.ok()) return cmd.Failure(r.status());
  out << "set route for "
      << (product_line.empty()
              ? "the default product line"
              : absl::StrCat("product line '", product_line, "'"))
      << ":\n"
      << FormatRoute(*r);
  return kExitOk;
}

int RouteApply(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err) {
  Command cmd("route apply", out, err);
  ServerOptions server;
  std::string path;
  FlagSet flags(
      "route apply", "leapctl route apply --file ROUTES.json",
      "Creates or replaces every route of a routes file, in order: the JSON "
      "that\n"
      "'leapctl route list --json' prints, {\"routes\": [{\"product_line\", "
      "\"arms\":\n"
      "[{\"name\", \"readout\", \"percent\"}, {\"name\", \"readout\", "
      "\"shadow\": true}]}]}.\n"
      "Every readout named must exist on leapd, else nothing is changed. "
      "Routes\n"
      "not in the file are left as they are. Prints the routes as leapd "
      "stored\n"
      "them.");
  ServerFlags(flags, &server);
  flags.String("file", &path, "PATH", "The routes file.", true);
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  absl::StatusOr<std::string> text = ReadFileBytes(path);
  if (!text.ok()) return cmd.Failure(text.status());
  absl::StatusOr<std::vector<pb::Route>> routes = ParseRoutesJson(*text, path);
  if (!routes.ok()) return cmd.UsageError(routes.status());
  AdminClient client(server);
  absl::StatusOr<std::vector<pb::Route>> r = RunApplyRoutes(client, *routes);
  if (!r.ok()) return cmd.Failure(r.status());
  out << "applied " << r->size() << " route(s) from " << path << ":\n";
  for (const pb::Route& route : *r) out << FormatRoute(route);
  return kExitOk;
}

int RouteList(const std::vector<std::string>& args, std::ostream& out,
              std::ostream& err) {
  Command cmd("route list", out, err);
  ServerOptions server;
  bool json = false;
  FlagSet flags("route list", "leapctl route list [--json]",
                "Lists every route: product line ((default) for \"\"), arm, "
                "readout, and\nthe arm's share of traffic or 'shadow'.");
  ServerFlags(flags, &server);
  flags.Bool("json", &json,
             "Print one JSON object {\"routes\": [{\"product_line\", "
             "\"arms\": [{\"name\", \"readout\", \"percent\" (null for a "
             "shadow), \"shadow\"}]}]}.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ListRoutesResponse> r = client.ListRoutes();
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatRoutesJson(*r) : FormatRoutes(*r));
  return kExitOk;
}

int RouteDelete(const std::vector<std::string>& args, std::ostream& out,
                std::ostream& err) {
  Command cmd("route delete", out, err);
  ServerOptions server;
  std::string product_line;
  bool use_default = false;
  FlagSet flags("route delete", "leapctl route delete PRODUCT_LINE|--default",
                "Removes the route of a product line; its traffic then "
                "falls back to the\ndefault route (or fails with NOT_FOUND "
                "when there is none).");
  flags.Positional("PRODUCT_LINE", &product_line, "The product line.",
                   /*required=*/false);
  ServerFlags(flags, &server);
  flags.Bool("default", &use_default,
             "Delete the default route (product line \"\") instead.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  if (int rc = ProductLine(cmd, flags, use_default, &product_line); rc >= 0) {
    return rc;
  }
  AdminClient client(server);
  if (absl::Status s = client.DeleteRoute(product_line); !s.ok()) {
    return cmd.Failure(s);
  }
  out << "deleted route for "
      << (product_line.empty()
              ? std::string("the default product line")
              : absl::StrCat("product line '", product_line, "'"))
      << "\n";
  return kExitOk;
}

}  // namespace

int ReadoutsCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err) {
  return Dispatch("readouts", kReadoutsHelp,
                  {{"list", ReadoutsList},
                   {"get", ReadoutsGet},
                   {"create", ReadoutsCreate},
                   {"delete", ReadoutsDelete}},
                  args, out, err);
}

int RouteCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  return Dispatch("route", kRouteHelp,
                  {{"set", RouteSet},
                   {"apply", RouteApply},
                   {"list", RouteList},
                   {"delete", RouteDelete}},
                  args, out, err);
}

namespace {

std::string FormatSnapshot(const pb::SnapshotInfo& s) {
  const absl::Time t = absl::FromUnixMillis(s.unix_ms());
  return absl::StrFormat(
      "%-24s version %-8d learned %-9d spearman %s (n %d)  %s\n", s.label(),
      s.version(), s.completions_learned(),
      std::isfinite(s.spearman()) ? absl::StrFormat("%.4f", s.spearman())
                                  : std::string("-"),
      s.spearman_n(),
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", t, absl::UTCTimeZone()));
}

int SnapshotCreate(const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err) {
  Command cmd("snapshot create", out, err);
  ServerOptions server;
  std::string name, label;
  FlagSet flags(
      "snapshot create", "leapctl snapshot create NAME LABEL",
      "Labels the current state of a readout (theta, RLS matrix P,\n"
      "standardization, version, completions learned, online Spearman) so it\n"
      "can be restored with 'leapctl rollback'. Take one before a rollout.\n"
      "Taking a label again replaces that snapshot.");
  flags.Positional("NAME", &name, "The readout.");
  flags.Positional("LABEL", &label, "Snapshot label (1-128 bytes).");
  ServerFlags(flags, &server);
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::SnapshotInfo> r = client.CreateSnapshot(name, label);
  if (!r.ok()) return cmd.Failure(r.status());
  out << "snapshot of readout " << name << " taken:\n" << FormatSnapshot(*r);
  return kExitOk;
}

int SnapshotList(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Command cmd("snapshot list", out, err);
  ServerOptions server;
  std::string name;
  FlagSet flags("snapshot list", "leapctl snapshot list NAME",
                "Lists the snapshots of a readout: label, version, "
                "completions learned,\n"
                "online Spearman when taken, and time.");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ListSnapshotsResponse> r = client.ListSnapshots(name);
  if (!r.ok()) return cmd.Failure(r.status());
  out << r->snapshots_size() << " snapshot(s) of readout " << name << "\n";
  for (const auto& s : r->snapshots()) out << FormatSnapshot(s);
  return kExitOk;
}

}  // namespace

int SnapshotCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err) {
  return Dispatch("snapshot",
                  "usage: leapctl snapshot create NAME LABEL | list NAME\n",
                  {{"create", SnapshotCreate}, {"list", SnapshotList}}, args,
                  out, err);
}

int RollbackCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err) {
  Command cmd("rollback", out, err);
  ServerOptions server;
  std::string name, label;
  FlagSet flags(
      "rollback", "leapctl rollback NAME LABEL",
      "Restores a readout's theta and P exactly as in snapshot LABEL. The\n"
      "rollback is published as a NEW version (history is append-only), "
      "pushed\n"
      "to every engine, which rescores its live requests. Completions not yet\n"
      "applied when it happens are dropped.");
  flags.Positional("NAME", &name, "The readout.");
  flags.Positional("LABEL", &label, "The snapshot to restore.");
  ServerFlags(flags, &server);
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::RollbackResponse> r = client.Rollback(name, label);
  if (!r.ok()) return cmd.Failure(r.status());
  out << "rolled readout " << name << " back to snapshot " << label
      << " as version " << r->version() << "\n";
  return kExitOk;
}

int ImportCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err) {
  // The same as `readouts create NAME --artifact FILE`, under the name the
  // storage runbook uses.
  std::vector<std::string> forwarded = {"create"};
  forwarded.insert(forwarded.end(), args.begin(), args.end());
  return ReadoutsCommand(forwarded, out, err);
}

void AddServerFlags(FlagSet& flags, ServerOptions* o) { ServerFlags(flags, o); }
int CheckServerFlags(Command& cmd, const ServerOptions& o) {
  return CheckServer(cmd, o);
}

int VersionsCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err) {
  Command cmd("versions", out, err);
  ServerOptions server;
  std::string name;
  bool json = false;
  int64_t limit = 20;
  FlagSet flags(
      "versions", "leapctl versions NAME [--limit N] [--json]",
      "Lists the published versions of a readout, oldest first: version,\n"
      "completions learned when it was published, publish time (UTC), cause\n"
      "(create, rls, ...), and the online Spearman of predicted vs. true "
      "length\n"
      "over the completions this version predicted, with their number n ('-' "
      "until\n"
      "two are known; leapd keeps the quality of the 64 latest versions).\n"
      "Then the quality over windows of --quality_window completions (leapd's\n"
      "flag; the newest may be partial) and since each snapshot label; both\n"
      "survive leapd restarts with --data_dir.");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  flags.Bool("json", &json,
             "Print one JSON object {\"versions\": [{\"version\", "
             "\"completions_learned\", \"published_unix_ms\", \"cause\", "
             "\"spearman\" (null when undefined), \"spearman_n\"}], "
             "\"total_versions\", \"window\", \"windows\": "
             "[{\"first_completion\", \"completions\", \"first_version\", "
             "\"last_version\", \"start_unix_ms\", \"end_unix_ms\", "
             "\"spearman\"}], \"labels\": [{\"label\", \"from_version\", "
             "\"to_version\" (0 = open), \"completions\", \"spearman\"}]}.");
  flags.Int64("limit", &limit, "N",
              "Only the newest N versions and N quality windows (0 = all "
              "kept).");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (limit < 0) {
    return cmd.UsageError(absl::InvalidArgumentError(
        absl::StrCat("--limit must be >= 0, got ", limit)));
  }
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ListVersionsResponse> r = client.ListVersions(name, limit);
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatVersionsJson(*r) : FormatVersions(*r));
  return kExitOk;
}

int ExportCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err) {
  Command cmd("export", out, err);
  ServerOptions server;
  std::string name, out_path;
  bool from_trainer = false;
  FlagSet flags(
      "export", "leapctl export NAME --out R.leapr [--from-trainer]",
      "Writes the current state of a served readout (theta, RLS matrix P,\n"
      "standardization, version, completions learned) as a .leapr artifact, "
      "as\n"
      "leapd sent it, after checking it parses. The file is written "
      "atomically\n"
      "(temporary file, fsync, rename). It can be evaluated offline "
      "(leapctl eval),\n"
      "adapted (leapctl adapt) or loaded into another leapd (leapctl readouts "
      "create\n"
      "--artifact, leapd --import).");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  flags.String("out", &out_path, "PATH", "Artifact to write.", true);
  flags.Bool("from-trainer", &from_trainer,
             "Fleet mode (leapd --fleet): export theta and P as the fleet's "
             "trainer holds them (a member serves theta without P); adds no "
             "version. Ignored by a single leapd.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<ExportReport> r = RunExport(client, name, out_path, from_trainer);
  if (!r.ok()) return cmd.Failure(r.status());
  out << FormatExportReport(*r);
  return kExitOk;
}

int AdaptationCommand(bool frozen, const std::vector<std::string>& args,
                      std::ostream& out, std::ostream& err) {
  const std::string verb = frozen ? "freeze" : "resume";
  Command cmd(verb, out, err);
  ServerOptions server;
  std::string name;
  bool wait = false;
  FlagSet flags(
      verb, absl::StrCat("leapctl ", verb, " NAME", frozen ? " [--wait]" : ""),
      frozen
          ? "Freezes online adaptation of a readout: later completions are "
            "still\n"
            "measured (Spearman) but not learned, and no new version is "
            "published.\n"
            "The freeze is immediate: once this returns no batch is applied "
            "and the\n"
            "printed version is final until 'leapctl resume' (completions "
            "queued\n"
            "before it wait, they are not lost)."
          : "Resumes online adaptation of a frozen readout: completions are "
            "learned\n"
            "again. Fails with FAILED_PRECONDITION for a readout without the "
            "RLS\n"
            "matrix P (trained with --no-p) or one stopped by an RLS "
            "failure.");
  flags.Positional("NAME", &name, "The readout.");
  ServerFlags(flags, &server);
  if (frozen) {
    flags.Bool("wait", &wait,
               "Accepted for compatibility; the freeze is immediate.");
  }
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  absl::StatusOr<pb::ReadoutInfo> r =
      RunSetAdaptation(client, name, frozen, wait);
  if (!r.ok()) return cmd.Failure(r.status());
  out << absl::StrFormat("%s readout %s at version %d (rls backlog %d)\n",
                         frozen ? "froze" : "resumed", r->name(), r->version(),
                         r->rls_backlog());
  out << FormatReadoutInfo(*r);
  return kExitOk;
}

int StatsCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Command cmd("stats", out, err);
  ServerOptions server;
  std::string name;
  bool json = false;
  FlagSet flags(
      "stats", "leapctl stats [NAME] [--json]",
      "Online quality and counters from leapd. Per readout: version, "
      "frozen, RLS\n"
      "backlog, predictions (serving and shadow), completions learned, "
      "skipped\n"
      "(cancelled, censored, frozen), the rolling Spearman of predicted vs. "
      "true\n"
      "length over the latest completions, and per version. Per (product "
      "line,\n"
      "arm): predictions, completions joined, rolling Spearman. With leapd's "
      "quality\n"
      "guardrail on (--guardrail_floor/--guardrail_margin): its state "
      "(warming,\n"
      "watching, paused, tripped), judged Spearman, last good snapshot, trips "
      "and\n"
      "the last trip's reason. Then the "
      "live\n"
      "requests, feature cache bytes, completions for unknown request ids "
      "and\n"
      "evictions.");
  flags.Positional("NAME", &name,
                   "Only this readout (and the arms that use it). Default: "
                   "all.",
                   /*required=*/false);
  ServerFlags(flags, &server);
  flags.Bool("json", &json,
             "Print one JSON object: {\"readouts\": [{\"name\", \"version\", "
             "\"frozen\", \"frozen_reason\", \"guardrail\": {\"state\", "
             "\"spearman\", \"spearman_n\", \"trips\", \"last_trip\", "
             "\"last_trip_unix_ms\", \"last_good_label\", "
             "\"last_good_spearman\", \"last_good_spearman_n\"}, "
             "\"rls_backlog\", \"predictions\", "
             "\"completions_learned\", \"skipped\": {\"cancelled\", "
             "\"censored\", \"frozen\"}, \"spearman\", \"spearman_n\", "
             "\"versions\": [...]}], \"arms\": [{\"product_line\", \"arm\", "
             "\"readout\", \"shadow\", \"predictions\", \"completions\", "
             "\"spearman\", \"spearman_n\"}], \"live_requests\", "
             "\"feature_cache_bytes\", \"unknown_completions\", "
             "\"evicted_capacity\", \"evicted_ttl\"}; undefined Spearman is "
             "null.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (int rc = CheckServer(cmd, server); rc >= 0) return rc;
  AdminClient client(server);
  if (!name.empty()) {
    // GetStats answers an empty list for an unknown name: say NOT_FOUND.
    if (absl::Status s = client.GetReadout(name).status(); !s.ok()) {
      return cmd.Failure(s);
    }
  }
  absl::StatusOr<pb::StatsResponse> r = client.GetStats(name);
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatStatsJson(*r) : FormatStats(*r));
  return kExitOk;
}

int BenchCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err) {
  Command cmd("bench", out, err);
  BenchOptions o;
  bool json = false;
  FlagSet flags(
      "bench",
      "leapctl bench [--server ADDR] [--dim 4096] [--batch 64] [--streams 2] "
      "[--seconds 10]\n"
      "              [--latency-requests 2000] [--dtype float32|bfloat16] "
      "[--json]",
      "Load-tests leapd's Connect stream. Phase 1: --streams streams, each "
      "keeping\n"
      "two FeatureBatch messages of --batch records in flight, for "
      "--seconds;\n"
      "reports predictions/s and the CPU this client used. Phase 2: "
      "--latency-requests\n"
      "single-record round trips, one at a time, on the otherwise idle "
      "server;\n"
      "reports p50, p99 and max. Also prints the machine (CPU model, cores).\n"
      "Requests are cancelled in bulk, never completed: nothing is learned.\n"
      "The traffic goes to --product-line, scored by --readout; either is "
      "created\n"
      "(cold start, single-arm route) when missing and removed at the end.\n"
      "Run against a Release build of leapd, on an otherwise idle machine.");
  ServerFlags(flags, &o.server);
  flags.Int64("dim", &o.dim, "D", "Feature width, in [1, 16384].");
  flags.Int64("batch", &o.batch, "K",
              "Records per FeatureBatch message, in [1, 65536].");
  flags.Int64("streams", &o.streams, "S",
              "Concurrent Connect streams, in [1, 256].");
  flags.Double("seconds", &o.seconds, "T",
               "Duration of the throughput phase, in (0, 3600].");
  flags.Int64("latency-requests", &o.latency_requests, "N",
              "Single-request round trips in the latency phase (0 skips "
              "it).");
  flags.String("dtype", &o.dtype, "float32|bfloat16",
               "Element type of the features sent.");
  flags.String("readout", &o.readout, "NAME",
               "Readout that scores the traffic; must have --dim when it "
               "exists.");
  flags.String("product-line", &o.product_line, "P",
               "Product line the traffic is sent on.");
  flags.Bool("json", &json,
             "Print one JSON object: {\"server\", \"machine\": "
             "{\"cpu_model\", \"cores\"}, \"dim\", \"dtype\", \"batch\", "
             "\"streams\", \"seconds\", \"predictions\", \"errors\", "
             "\"predictions_per_s\", \"client_cpu_cores\", "
             "\"latency_samples\", \"latency_p50_us\", \"latency_p99_us\", "
             "\"latency_max_us\"}.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  absl::StatusOr<BenchReport> r = RunBench(o, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatBenchJson(*r) : FormatBenchReport(*r));
  return kExitOk;
}

int FeedCommand(const std::vector<std::string>& args, std::ostream& out,
                std::ostream& err) {
  Command cmd("feed", out, err);
  FeedOptions o;
  bool json = false;
  FlagSet flags(
      "feed",
      "leapctl feed [--server ADDR] --features F.npy --lengths L.npy "
      "[--product-line P]\n"
      "             [--batch 64] [--finish-reasons R.npy] [--report-every "
      "1000] [--json]",
      "Simulates an engine on one Connect stream. Hello declares the "
      "feature file's\n"
      "dtype (float32 or float16) and width; then, --batch rows at a time, "
      "it sends\n"
      "the rows' features, waits for their predictions, and sends how they "
      "ended\n"
      "(STOP with the true length, or the --finish-reasons), so the serving "
      "readout\n"
      "learns as it predicts. Every --report-every rows it prints the "
      "Spearman of\n"
      "predicted vs. true length over those rows (the ones that ended with "
      "STOP),\n"
      "the readout versions that predicted them, and the totals of "
      "completions\n"
      "learned and skipped and of rescored predictions received. At the end:\n"
      "totals and each readout's final version. Exits 1 when any request "
      "was\n"
      "refused (after the report).");
  ServerFlags(flags, &o.server);
  flags.String("features", &o.features_path, "PATH",
               "Features: .npy float32 or float16 [n, d], all finite; d must "
               "match the routed readout.",
               true);
  flags.String("lengths", &o.lengths_path, "PATH",
               "True output lengths in tokens: .npy int32 or int64 [n].", true);
  flags.String("product-line", &o.product_line, "P",
               "Product line of every request. Default: \"\" (the default "
               "route).");
  flags.Int64("batch", &o.batch, "K", "Requests per message, in [1, 65536].");
  flags.String("finish-reasons", &o.finish_reasons_path, "PATH",
               "Optional .npy int32/int64 [n] of finish reasons: 1 stop, 2 "
               "length, 3 cancelled, 4 aborted. Default: every request "
               "stops naturally.");
  flags.Int64("report-every", &o.report_every, "N",
              "Rows per reported window (>= 2).");
  flags.Bool("json", &json,
             "Print only one JSON object at the end: {\"rows\", \"dim\", "
             "\"dtype\", \"predicted\", \"prediction_errors\", \"learned\", "
             "\"skipped\", \"completion_errors\", \"rescore_messages\", "
             "\"rescored_predictions\", \"published\", \"spearman\", "
             "\"windows\": [{\"first_row\", \"last_row\", \"n\", "
             "\"spearman\", \"versions\": {READOUT: {\"first\", \"last\"}}, "
             "\"learned\", \"skipped\", \"rescore_messages\", "
             "\"rescored_predictions\"}], \"final\": [{\"readout\", "
             "\"version\", \"completions_learned\", \"rls_backlog\", "
             "\"frozen\"}], \"first_error\", \"time_s\"}.");
  if (int rc = cmd.Parse(flags, args); rc >= 0) return rc;
  if (absl::Status s = o.Validate(); !s.ok()) return cmd.UsageError(s);
  FeedWindowFn on_window;
  if (!json) {
    on_window = [&out](const FeedWindow& w) {
      out << FormatFeedWindow(w) << std::flush;
    };
  }
  absl::StatusOr<FeedReport> r = RunFeed(o, on_window, cmd.Progress());
  if (!r.ok()) return cmd.Failure(r.status());
  out << (json ? FormatFeedJson(*r) : FormatFeedReport(*r));
  const int64_t failed = r->prediction_errors + r->completion_errors;
  if (failed > 0) {
    return cmd.Failure(
        absl::Status(r->first_error.code(),
                     absl::StrCat(failed, " requests were refused; first: ",
                                  r->first_error.message())));
  }
  return kExitOk;
}

}  // namespace leap::leapctl::internal
