// Who may call leap.v1.Admin. With a token configured (leapd
// --admin_token_file), a call arriving over TCP must carry the metadata
// "authorization: Bearer <token>"; a call over a unix socket is trusted (the
// socket lives in the pod's own volume and its file permissions decide who
// connects). Without a token every caller is allowed, as before.
// Predictor, health and reflection never go through this check.
#ifndef LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_
#define LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/string_ref.h"

namespace leap::sidecar {

// Reads an admin token file: its whole content with surrounding whitespace
// (a trailing newline, as `echo` and Kubernetes Secrets leave) removed.
// NotFound / PermissionDenied when it cannot be read, InvalidArgument when
// it is empty, longer than 4096 bytes, or holds whitespace or control
// characters inside.
absl::StatusOr<std::string> ReadAdminTokenFile(const std::string& path);

// Compares two byte strings in time that depends only on `expected`'s
// length, not on where they differ (a mismatch position must not leak
// through response times).
bool ConstantTimeEquals(absl::string_view given, absl::string_view expected);

// The admin check. Immutable after construction: any thread may call it.
class AdminAuth {
 public:
  // No token: every call is allowed.
  AdminAuth() = default;
  // `token` must be non-empty (ReadAdminTokenFile guarantees it).
  explicit AdminAuth(std::string token) : token_(std::move(token)) {}

  // Whether a token is required over TCP.
  bool enabled() const { return !token_.empty(); }

  // OK when no token is configured, when `peer` is a unix-socket peer
  // (gRPC's peer string starts with "unix:"), or when `metadata` has an
  // "authorization" entry "Bearer <token>" (the scheme is case-insensitive)
  // with the configured token. Unauthenticated otherwise, with a message
  // saying what was missing or wrong.
  absl::Status Check(
      absl::string_view peer,
      const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;
  // Check(ctx.peer(), ctx.client_metadata()) as a grpc::Status.
  grpc::Status Check(const grpc::ServerContext& ctx) const;

 private:
  std::string token_;
};

// The admin check run by gRPC on a call's initial metadata, before the
// call is dispatched and before its request body is read: a leap.v1.Admin
// call without the token is refused with UNAUTHENTICATED however large its
// message, and nothing of the message is buffered. Other services pass.
// Installed on TCP listeners only (unix sockets are trusted).
class AdminAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  // `on_refused` runs for every refused call (metrics).
  AdminAuthProcessor(AdminAuth auth, std::function<void()> on_refused)
      : auth_(std::move(auth)), on_refused_(std::move(on_refused)) {}

  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata& auth_metadata,
                       grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

 private:
  const AdminAuth auth_;
  const std::function<void()> on_refused_;
};

// Plaintext server credentials (TCP) that run `processor` on every call.
std::shared_ptr<grpc::ServerCredentials> InsecureServerCredentialsWithAuth(
    std::shared_ptr<AdminAuthProcessor> processor);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_
