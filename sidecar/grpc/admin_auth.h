// Who may call leap.v1.Admin. With a token configured (leapd
// --admin_token_file), a call arriving over TCP must carry the metadata
// "authorization: Bearer <token>"; a call over a unix socket is trusted (the
// socket lives in the pod's own volume and its file permissions decide who
// connects). Without a token every caller is allowed, as before.
// Predictor, health and reflection never go through this check.
#ifndef LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_
#define LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_GRPC_ADMIN_AUTH_H_
