#include "client/admin_client.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"

namespace leap::client {
namespace {

namespace pb = ::leap::v1;

absl::Status Usage(absl::string_view what) {
  return absl::InvalidArgumentError(what);
}

}  // namespace

absl::Status ServerOptions::Validate() const {
  if (address.empty()) return Usage("--server must not be empty");
  if (!(timeout_s > 0) || timeout_s > 86400) {
    return Usage(absl::StrCat("--timeout must be in (0, 86400] seconds, got ",
                              timeout_s));
  }
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return Usage("--tls-cert and --tls-key go together");
  }
  for (const std::string* f : {&tls_ca_file, &tls_cert_file, &tls_key_file}) {
    if (!f->empty() && !ReadFileBytes(*f).ok()) {
      return Usage(absl::StrCat("cannot read TLS file ", *f));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::Channel> MakeChannel(const ServerOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT_MAX);
  args.SetMaxSendMessageSize(INT_MAX);
  std::shared_ptr<grpc::ChannelCredentials> creds =
      grpc::InsecureChannelCredentials();
  if (!options.tls_ca_file.empty() || !options.tls_cert_file.empty()) {
    auto read = [](const std::string& path) {
      absl::StatusOr<std::string> bytes = ReadFileBytes(path);
      return bytes.ok() ? *std::move(bytes) : std::string();
    };
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca_file.empty()) {
      ssl.pem_root_certs = read(options.tls_ca_file);
    }
    if (!options.tls_cert_file.empty()) {
      ssl.pem_cert_chain = read(options.tls_cert_file);
      ssl.pem_private_key = read(options.tls_key_file);
    }
    creds = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(options.address, creds, args);
}

absl::Status FromGrpc(const grpc::Status& status, const std::string& address) {
  if (status.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(status.error_code());
  const std::string name = absl::StatusCodeToString(code);
  if (code == absl::StatusCode::kUnavailable) {
    return absl::Status(
        code, absl::StrCat(name, ": cannot reach leapd at ", address, " (",
                           status.error_message(), ")"));
  }
  if (code == absl::StatusCode::kDeadlineExceeded) {
    return absl::Status(code, absl::StrCat(name, ": leapd at ", address,
                                           " did not answer in time (",
                                           status.error_message(), ")"));
  }
  return absl::Status(code, absl::StrCat(name, ": ", status.error_message()));
}

AdminClient::AdminClient(ServerOptions options)
    : AdminClient(options, MakeChannel(options)) {}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadFileBytes(path);
  if (!bytes.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read the admin token file (--token-file / "
                     "$LEAP_ADMIN_TOKEN_FILE): ",
                     bytes.status().message()));
  }
  absl::string_view token = absl::StripAsciiWhitespace(*bytes);
  if (token.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the admin token file ", path, " is empty"));
  }
  return std::string(token);
}

AdminClient::AdminClient(ServerOptions options,
                         std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(pb::Admin::NewStub(channel_)),
      token_(options_.token_file.empty() ? absl::StatusOr<std::string>("")
                                         : ReadTokenFile(options_.token_file)) {
}

template <class Request, class Response, class Method>
absl::StatusOr<Response> AdminClient::Call(Method method,
                                           const Request& request) {
  if (!token_.ok()) return token_.status();
  grpc::ClientContext ctx;
  if (!token_->empty()) ctx.AddMetadata("authorization", "Bearer " + *token_);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(
                       static_cast<int64_t>(options_.timeout_s * 1e6)));
  Response response;
  grpc::Status s = (stub_.get()->*method)(&ctx, request, &response);
  if (!s.ok()) return FromGrpc(s, options_.address);
  return response;
}

absl::StatusOr<pb::ListReadoutsResponse> AdminClient::ListReadouts() {
  return Call<pb::ListReadoutsRequest, pb::ListReadoutsResponse>(
      &pb::Admin::Stub::ListReadouts, pb::ListReadoutsRequest());
}

absl::StatusOr<pb::ReadoutInfo> AdminClient::GetReadout(
    const std::string& name) {
  pb::GetReadoutRequest req;
  req.set_name(name);
  return Call<pb::GetReadoutRequest, pb::ReadoutInfo>(
      &pb::Admin::Stub::GetReadout, req);
}

absl::StatusOr<pb::ReadoutInfo> AdminClient::CreateReadout(
    const pb::CreateReadoutRequest& request) {
  return Call<pb::CreateReadoutRequest, pb::ReadoutInfo>(
      &pb::Admin::Stub::CreateReadout, request);
}

absl::Status AdminClient::DeleteReadout(const std::string& name) {
  pb::DeleteReadoutRequest req;
  req.set_name(name);
  return Call<pb::DeleteReadoutRequest, pb::DeleteReadoutResponse>(
             &pb::Admin::Stub::DeleteReadout, req)
      .status();
}

absl::Status AdminClient::ExportDataset(
    const std::string& readout, int64_t limit,
    const std::function<bool(const pb::DatasetChunk&)>& on_chunk) {
  if (!token_.ok()) return token_.status();
  grpc::ClientContext ctx;
  if (!token_->empty()) ctx.AddMetadata("authorization", "Bearer " + *token_);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(static_cast<int64_t>(
                       std::max(options_.timeout_s, 3600.0) * 1e6)));
  pb::ExportDatasetRequest req;
  req.set_readout(readout);
  req.set_limit(limit);
  std::unique_ptr<grpc::ClientReader<pb::DatasetChunk>> reader =
      stub_->ExportDataset(&ctx, req);
  pb::DatasetChunk chunk;
  bool stopped = false;
  while (reader->Read(&chunk)) {
    if (!on_chunk(chunk)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  grpc::Status s = reader->Finish();
  if (stopped) return absl::CancelledError("export stopped");
  if (!s.ok()) return FromGrpc(s, options_.address);
  return absl::OkStatus();
}

absl::StatusOr<pb::ListVersionsResponse> AdminClient::ListVersions(
    const std::string& name, int64_t limit) {
  pb::ListVersionsRequest req;
  req.set_name(name);
  req.set_limit(limit);
  return Call<pb::ListVersionsRequest, pb::ListVersionsResponse>(
      &pb::Admin::Stub::ListVersions, req);
}

absl::StatusOr<pb::ExportReadoutResponse> AdminClient::ExportReadout(
    const std::string& name, bool from_trainer) {
  pb::ExportReadoutRequest req;
  req.set_name(name);
  req.set_from_trainer(from_trainer);
  return Call<pb::ExportReadoutRequest, pb::ExportReadoutResponse>(
      &pb::Admin::Stub::ExportReadout, req);
}

absl::StatusOr<pb::ReadoutInfo> AdminClient::SetAdaptation(
    const std::string& name, bool frozen) {
  pb::SetAdaptationRequest req;
  req.set_name(name);
  req.set_frozen(frozen);
  return Call<pb::SetAdaptationRequest, pb::ReadoutInfo>(
      &pb::Admin::Stub::SetAdaptation, req);
}

absl::StatusOr<pb::Route> AdminClient::SetRoute(const pb::Route& route) {
  pb::SetRouteRequest req;
  *req.mutable_route() = route;
  return Call<pb::SetRouteRequest, pb::Route>(&pb::Admin::Stub::SetRoute, req);
}

absl::StatusOr<pb::ListRoutesResponse> AdminClient::ListRoutes() {
  return Call<pb::ListRoutesRequest, pb::ListRoutesResponse>(
      &pb::Admin::Stub::ListRoutes, pb::ListRoutesRequest());
}

absl::Status AdminClient::DeleteRoute(const std::string& product_line) {
  pb::DeleteRouteRequest req;
  req.set_product_line(product_line);
  return Call<pb::DeleteRouteRequest, pb::DeleteRouteResponse>(
             &pb::Admin::Stub::DeleteRoute, req)
      .status();
}

absl::StatusOr<pb::SnapshotInfo> AdminClient::CreateSnapshot(
    const std::string& readout, const std::string& label) {
  pb::CreateSnapshotRequest req;
  req.set_readout(readout);
  req.set_label(label);
  return Call<pb::CreateSnapshotRequest, pb::SnapshotInfo>(
      &pb::Admin::Stub::CreateSnapshot, req);
}

absl::StatusOr<pb::ListSnapshotsResponse> AdminClient::ListSnapshots(
    const std::string& readout) {
  pb::ListSnapshotsRequest req;
  req.set_readout(readout);
  return Call<pb::ListSnapshotsRequest, pb::ListSnapshotsResponse>(
      &pb::Admin::Stub::ListSnapshots, req);
}

absl::StatusOr<pb::RollbackResponse> AdminClient::Rollback(
    const std::string& readout, const std::string& label) {
  pb::RollbackRequest req;
  req.set_readout(readout);
  req.set_label(label);
  return Call<pb::RollbackRequest, pb::RollbackResponse>(
      &pb::Admin::Stub::Rollback, req);
}

absl::StatusOr<pb::StatsResponse> AdminClient::GetStats(
    const std::string& readout) {
  pb::GetStatsRequest req;
  req.set_readout(readout);
  return Call<pb::GetStatsRequest, pb::StatsResponse>(
      &pb::Admin::Stub::GetStats, req);
}

}  // namespace leap::client
