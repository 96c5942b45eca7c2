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
#include "grpcpp/grpcpp.h"
#include "leap/v1/admin.grpc.pb.h"

namespace leap::leapctl {

// Where leapd is and how long to wait for it.
struct ServerOptions {
  // host:port or unix:///path. Default: 127.0.0.1:7070
  std::string address = "127.0.0.1:7070";
  // Deadline of each unary call, in seconds (also how long a stream waits
  // for one answer). Default: 30
  double timeout_s = 30;
  // File holding leapd's admin bearer token (leapd --admin_token_file),
  // sent as the metadata "authorization: Bearer TOKEN" on every Admin call;
  // surrounding whitespace is ignored. Needed over TCP when leapd requires
  // a token, never over a unix socket. The command line fills it from
  // --token-file or $LEAP_ADMIN_TOKEN_FILE. Default: empty (no token sent).
  std::string token_file;
  // TLS to a leapd with --tls_cert (TCP only): PEM file of the CA that
  // signed leapd's certificate; for mutual TLS (leapd --tls_client_ca) also
  // this client's certificate chain and key. The command line fills them
  // from --tls-ca, --tls-cert, --tls-key or $LEAP_TLS_CA, $LEAP_TLS_CERT,
  // $LEAP_TLS_KEY. All empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;

  // InvalidArgument (a usage error) for an empty address, a timeout
  // outside (0, 86400], a TLS file that cannot be read, or only one of
  // tls_cert_file and tls_key_file.
  absl::Status Validate() const;
};

// A gRPC channel to `options.address` without message size limits (an
// exported artifact at d = 4096 is ~70 MB).
std::shared_ptr<grpc::Channel> MakeChannel(const ServerOptions& options);

// The absl::Status of a failed call: same code, message
// "CODE_NAME: server message"; for UNAVAILABLE, "UNAVAILABLE: cannot reach
// leapd at ADDR (server message)".
absl::Status FromGrpc(const grpc::Status& status, const std::string& address);

// leapd's Admin service. Each call has the options' deadline and, with a
// token file, the bearer token (read once, when the client is made; a file
// that cannot be read fails every call with the reason). Thread-safe (a
// gRPC stub is).
class AdminClient {
 public:
  explicit AdminClient(ServerOptions options);
  AdminClient(ServerOptions options, std::shared_ptr<grpc::Channel> channel);

  const ServerOptions& options() const { return options_; }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

  absl::StatusOr<v1::ListReadoutsResponse> ListReadouts();
  absl::StatusOr<v1::ReadoutInfo> GetReadout(const std::string& name);
  absl::StatusOr<v1::ReadoutInfo> CreateReadout(
      const v1::CreateReadoutRequest& request);
  absl::Status DeleteReadout(const std::string& name);
  absl::StatusOr<v1::ListVersionsResponse> ListVersions(
      const std::string& name);
  absl::StatusOr<v1::ExportReadoutResponse> ExportReadout(
      const std::string& name);
  absl::StatusOr<v1::ReadoutInfo> SetAdaptation(const std::string& name,
                                                bool frozen);
  absl::StatusOr<v1::Route> SetRoute(const v1::Route& route);
  absl::StatusOr<v1::ListRoutesResponse> ListRoutes();
  absl::Status DeleteRoute(const std::string& product_line);
  absl::StatusOr<v1::StatsResponse> GetStats(const std::string& readout);
  absl::StatusOr<v1::SnapshotInfo> CreateSnapshot(const std::string& readout,
                                                  const std::string& label);
  absl::StatusOr<v1::ListSnapshotsResponse> ListSnapshots(
      const std::string& readout);
  absl::StatusOr<v1::RollbackResponse> Rollback(const std::string& readout,
                                                const std::string& label);

 private:
  template <class Request, class Response, class Method>
  absl::StatusOr<Response> Call(Method method, const Request& request);

  ServerOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> stub_;
  // The token from options_.token_file, or why it could not be read.
  absl::StatusOr<std::string> token_;
};

// The token in an admin token file: its content without surrounding
// whitespace. FailedPrecondition naming the file when it cannot be read or
// is empty.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

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
absl::StatusOr<ExportReport> RunExport(AdminClient& client,
                                       const std::string& name,
                                       const std::string& out_path);
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
