// The one mapping of absl::Status onto grpc::Status used by every leapd
// service: codes one to one (absl's codes are gRPC's), the message kept.
// A pure function: any thread.
#ifndef LEAP_SIDECAR_GRPC_STATUS_H_
#define LEAP_SIDECAR_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace leap::sidecar {

grpc::Status ToGrpc(const absl::Status& s);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_GRPC_STATUS_H_
