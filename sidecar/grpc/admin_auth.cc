#include "sidecar/grpc/admin_auth.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace leap::sidecar {
namespace {

// A token is a secret string, not a file: anything bigger is a mistake
// (a wrong path, a binary file).
constexpr size_t kMaxTokenBytes = 4096;

}  // namespace

absl::StatusOr<std::string> ReadAdminTokenFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int e = errno;
    const std::string msg = absl::StrCat("cannot read admin token file ", path,
                                         ": ", std::strerror(e));
    if (e == ENOENT) return absl::NotFoundError(msg);
    if (e == EACCES || e == EPERM) return absl::PermissionDeniedError(msg);
    return absl::UnavailableError(msg);
  }
  std::string bytes;
  char buf[1024];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
    bytes.append(buf, n);
    if (bytes.size() > kMaxTokenBytes + 64) break;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) {
    return absl::UnavailableError(
        absl::StrCat("cannot read admin token file ", path));
  }
  absl::string_view token = absl::StripAsciiWhitespace(bytes);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin token file ", path, " is empty"));
  }
  if (token.size() > kMaxTokenBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin token file ", path, " holds more than ",
                     kMaxTokenBytes, " bytes; expected one token"));
  }
  for (char c : token) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "admin token file ", path,
          " holds whitespace or control characters inside the token; "
          "expected one printable token (e.g. `openssl rand -hex 32`)"));
    }
  }
  return std::string(token);
}

bool ConstantTimeEquals(absl::string_view given, absl::string_view expected) {
  // Every byte of `expected` is visited whatever `given` holds; the length
  // mismatch is folded into the same accumulator.
  volatile unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g =
        i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff = diff | (g ^ static_cast<unsigned char>(expected[i]));
  }
  return diff == 0;
}

absl::Status AdminAuth::Check(
    absl::string_view peer,
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  if (token_.empty()) return absl::OkStatus();
  if (absl::StartsWith(peer, "unix:")) return absl::OkStatus();
  auto [begin, end] = metadata.equal_range("authorization");
  if (begin == end) {
    return absl::UnauthenticatedError(
        "admin RPCs over TCP need the metadata 'authorization: Bearer "
        "<token>' (leapd runs with --admin_token_file); leapctl sends it "
        "with --token-file PATH or $LEAP_ADMIN_TOKEN_FILE, or use leapd's "
        "unix socket");
  }
  constexpr absl::string_view kScheme = "bearer ";
  bool bearer = false;
  for (auto it = begin; it != end; ++it) {
    absl::string_view value(it->second.data(), it->second.size());
    if (value.size() < kScheme.size() ||
        !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
      continue;
    }
    bearer = true;
    if (ConstantTimeEquals(
            absl::StripAsciiWhitespace(value.substr(kScheme.size())), token_)) {
      return absl::OkStatus();
    }
  }
  if (!bearer) {
    return absl::UnauthenticatedError(
        "the 'authorization' metadata of this admin RPC is not 'Bearer "
        "<token>'");
  }
  return absl::UnauthenticatedError(
      "the admin bearer token of this RPC does not match leapd's "
      "--admin_token_file");
}

grpc::Status AdminAuth::Check(const grpc::ServerContext& ctx) const {
  if (token_.empty()) return grpc::Status::OK;
  absl::Status s = Check(ctx.peer(), ctx.client_metadata());
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(s.message()));
}

grpc::Status AdminAuthProcessor::Process(const InputMetadata& auth_metadata,
                                         grpc::AuthContext*, OutputMetadata*,
                                         OutputMetadata*) {
  auto path = auth_metadata.find(":path");
  if (path == auth_metadata.end() ||
      !absl::StartsWith(absl::string_view(path->second.data(),
                                          path->second.size()),
                        "/leap.v1.Admin/")) {
    return grpc::Status::OK;
  }
  absl::Status s = auth_.Check("", auth_metadata);
  if (s.ok()) return grpc::Status::OK;
  if (on_refused_) on_refused_();
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      std::string(s.message()));
}

namespace {

// gRPC's C processor interface over an AdminAuthProcessor (the C++
// InsecureServerCredentials cannot carry one).
void ProcessC(void* state, grpc_auth_context*, const grpc_metadata* md,
              size_t num_md, grpc_process_auth_metadata_done_cb cb,
              void* user_data) {
  auto* p = static_cast<AdminAuthProcessor*>(state);
  grpc::AuthMetadataProcessor::InputMetadata in;
  for (size_t i = 0; i < num_md; ++i) {
    in.emplace(
        grpc::string_ref(
            reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].key)),
            GRPC_SLICE_LENGTH(md[i].key)),
        grpc::string_ref(
            reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(md[i].value)),
            GRPC_SLICE_LENGTH(md[i].value)));
  }
  grpc::AuthMetadataProcessor::OutputMetadata unused;
  grpc::Status s = p->Process(in, nullptr, &unused, &unused);
  cb(user_data, nullptr, 0, nullptr, 0,
     static_cast<grpc_status_code>(s.error_code()),
     s.ok() ? nullptr : s.error_message().c_str());
}

class InsecureWithAuth final : public grpc::ServerCredentials {
 public:
  explicit InsecureWithAuth(std::shared_ptr<AdminAuthProcessor> p)
      : processor_(std::move(p)) {}
  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    grpc_server_credentials* c = grpc_insecure_server_credentials_create();
    grpc_server_credentials_set_auth_metadata_processor(
        c, grpc_auth_metadata_processor{ProcessC, nullptr, processor_.get()});
    const int port = grpc_server_add_http2_port(server, addr.c_str(), c);
    grpc_server_credentials_release(c);
    return port;
  }

  const std::shared_ptr<AdminAuthProcessor> processor_;
};

}  // namespace

std::shared_ptr<grpc::ServerCredentials> InsecureServerCredentialsWithAuth(
    std::shared_ptr<AdminAuthProcessor> processor) {
  return std::make_shared<InsecureWithAuth>(std::move(processor));
}

}  // namespace leap::sidecar
