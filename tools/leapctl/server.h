// The logic of leapctl's commands that talk to a running leapd through its
// Admin service (proto/leap/v1/admin.proto): a client that turns gRPC
// statuses into absl::Status, the commands that need more than one call or
// local files (create, export, freeze/resume, route parsing), and the text
// and JSON formatters of what the server answered.
//
// Every error from the server keeps its gRPC code (the codes map one to one)
// and its message starts with the code's name: "NOT_FOUND: unknown readout
// 'x'". An unreachable server is "UNAVAILABLE: cannot reach leapd at ADDR
// (...)".
#ifndef LEAP_TOOLS_LEAPCTL_SERVER_H_
#define LEAP_TOOLS_LEAPCTL_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/admin_client.h"
#include "leap/v1/admin.grpc.pb.h"

namespace leap::leapctl {

// The Admin client (client/admin_client.h).
using ::leap::client::AdminClient;
using ::leap::client::FromGrpc;
using ::leap::client::MakeChannel;
using ::leap::client::ReadTokenFile;
using ::leap::client::ServerOptions;

// ---- readouts create --------------------------------------------------------

// Inputs of `leapctl readouts create`: exactly one of an artifact file or a
// cold start.
struct CreateReadoutOptions {
  // Readout name, [A-Za-z0-9._-]{1,64} (checked by leapd). Required.
  std::string name;
  // A .leapr artifact to upload (leapctl train, adapt or export).
  std::string artifact_path;
  // A readout with no training data: theta = 0, P = I / lambda.
  bool cold_start = false;
  // Cold start only: feature width (required), prior precision lambda > 0
  // (required), budget M, layer and model id.
  int64_t dim = 0;
  double lambda = 0;
  // Default: 2048
  int64_t max_tokens = 2048;
  // Default: -1 (unknown)
  int64_t layer = -1;
  // Default: empty
  std::string model_id;

  // InvalidArgument (a usage error) unless exactly one source is given with
  // its flags and values in range.
  absl::Status Validate() const;
};

// Reads and checks the artifact (the error names the file) or builds the
// cold start, and creates the readout.
absl::StatusOr<v1::ReadoutInfo> RunCreateReadout(
    AdminClient& client, const CreateReadoutOptions& options);

// ---- export ----------------------------------------------------------------

// What `leapctl export` wrote.
struct ExportReport {
  std::string name;
  // The version leapd reported and the one inside the artifact.
  int64_t version = 0;
  int64_t artifact_version = 0;
  int64_t dim = 0;
  int64_t completions_learned = 0;
  bool has_p = false;
  int64_t bytes = 0;
  std::string out_path;
};

// Exports readout `name`, checks that the bytes parse as an artifact, and
// writes them unchanged to `out_path` atomically.
// `from_trainer`: fleet mode, the trainer's theta and P.
absl::StatusOr<ExportReport> RunExport(AdminClient& client,
                                       const std::string& name,
                                       const std::string& out_path,
                                       bool from_trainer = false);
std::string FormatExportReport(const ExportReport& report);

// ---- freeze / resume --------------------------------------------------------

// Freezes (or resumes) adaptation of `name`. With `wait_idle`, then polls
// the readout until its RLS backlog (completions queued before the freeze)
// is applied, at most the options' timeout, so the returned version is final
// until the next resume. DeadlineExceeded when the backlog does not drain.
absl::StatusOr<v1::ReadoutInfo> RunSetAdaptation(AdminClient& client,
                                                 const std::string& name,
                                                 bool frozen, bool wait_idle);

// ---- route -----------------------------------------------------------------

// Parses "NAME=READOUT:PERCENT" (a serving arm; with `percent_optional`,
// "NAME=READOUT" and plain "READOUT", an arm named after its readout, mean
// 100) or, for a shadow, "NAME=READOUT".
// InvalidArgument (a usage error) naming the flag and the expected syntax.
absl::StatusOr<v1::Arm> ParseArm(absl::string_view spec, bool shadow,
                                 bool percent_optional);
// The route of `product_line` from the --arm and --shadow values (a single
// --arm may omit :PERCENT, or be just READOUT).
absl::StatusOr<v1::Route> ParseRoute(const std::string& product_line,
                                     const std::vector<std::string>& arms,
                                     const std::vector<std::string>& shadows);

// Parses a routes file: the JSON that `leapctl route list --json` prints,
// {"routes": [{"product_line": "chat", "arms": [{"name": "a", "readout":
// "chat-v1", "percent": 90}, {"name": "s", "readout": "cold", "shadow":
// true}]}]} ("percent" is ignored for a shadow arm; "shadow" defaults to
// false). InvalidArgument naming `source` and the offending route or arm.
absl::StatusOr<std::vector<v1::Route>> ParseRoutesJson(
    absl::string_view text, const std::string& source);

// Sets every route of `routes`, in order, after checking that every readout
// they name exists on leapd (NotFound listing the missing ones, and nothing
// changed). Returns the routes as leapd stored them.
absl::StatusOr<std::vector<v1::Route>> RunApplyRoutes(
    AdminClient& client, const std::vector<v1::Route>& routes);

// ---- formatters ------------------------------------------------------------

// "key: value" lines of one readout.
std::string FormatReadoutInfo(const v1::ReadoutInfo& info);
// One object with the ReadoutInfo fields (snake_case keys).
std::string FormatReadoutInfoJson(const v1::ReadoutInfo& info);
// A table: name, dim, version, learned, frozen, backlog, M, layer, model.
std::string FormatReadoutList(const v1::ListReadoutsResponse& list);
// {"readouts": [ReadoutInfo objects]}.
std::string FormatReadoutListJson(const v1::ListReadoutsResponse& list);
// A table: version, completions learned, published time (UTC), cause,
// spearman, n.
std::string FormatVersions(const v1::ListVersionsResponse& versions);
// {"versions": [{"version", "completions_learned", "published_unix_ms",
// "cause", "spearman", "spearman_n"}]}; NaN is null.
std::string FormatVersionsJson(const v1::ListVersionsResponse& versions);
// One line per arm: product line ("(default)" for ""), arm, readout,
// percent or "shadow".
std::string FormatRoute(const v1::Route& route);
std::string FormatRoutes(const v1::ListRoutesResponse& routes);
// {"routes": [{"product_line", "arms": [{"name", "readout", "percent",
// "shadow"}]}]}.
std::string FormatRoutesJson(const v1::ListRoutesResponse& routes);
// Per readout: version, learned, skipped, predictions, Spearman, versions
// with quality; per arm: predictions, completions, Spearman; cache and
// unknown-completion counters.
std::string FormatStats(const v1::StatsResponse& stats);
// {"readouts": [{"name", "version", "frozen", "rls_backlog", "predictions",
// "completions_learned", "skipped": {"cancelled", "censored", "frozen"},
// "spearman", "spearman_n", "versions": [...]}], "arms": [{"product_line",
// "arm", "readout", "shadow", "predictions", "completions", "spearman",
// "spearman_n"}], "live_requests", "feature_cache_bytes",
// "unknown_completions", "evicted_capacity", "evicted_ttl"}; NaN is null.
std::string FormatStatsJson(const v1::StatsResponse& stats);

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_SERVER_H_
