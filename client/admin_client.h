// The client of leapd's Admin service (proto/leap/v1/admin.proto): where
// leapd is, a channel to it, and calls that turn gRPC statuses into
// absl::Status.
//
// Every error from the server keeps its gRPC code (the codes map one to one)
// and its message starts with the code's name: "NOT_FOUND: unknown readout
// 'x'". An unreachable server is "UNAVAILABLE: cannot reach leapd at ADDR
// (...)".
#ifndef LEAP_CLIENT_ADMIN_CLIENT_H_
#define LEAP_CLIENT_ADMIN_CLIENT_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/admin.grpc.pb.h"

namespace leap::client {

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
  // limit: the newest versions and quality windows only (0 = all).
  absl::StatusOr<v1::ListVersionsResponse> ListVersions(
      const std::string& name, int64_t limit = 0);
  // Streams a readout's dataset; `on_chunk` sees every message (the first
  // has dim and records) and may stop it by returning false (CANCELLED).
  // The whole stream gets max(timeout, 1 h).
  absl::Status ExportDataset(
      const std::string& readout, int64_t limit,
      const std::function<bool(const v1::DatasetChunk&)>& on_chunk);
  // `from_trainer`: fleet mode, theta and P as the fleet's trainer holds
  // them (ExportReadoutRequest.from_trainer).
  absl::StatusOr<v1::ExportReadoutResponse> ExportReadout(
      const std::string& name, bool from_trainer = false);
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

}  // namespace leap::client

#endif  // LEAP_CLIENT_ADMIN_CLIENT_H_
