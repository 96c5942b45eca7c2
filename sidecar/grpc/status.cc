#include "sidecar/grpc/status.h"

#include <string>

namespace leap::sidecar {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

}  // namespace leap::sidecar
