// The engine side of one leapd Connect stream (proto/leap/v1/predictor.proto),
// shared by `leapctl bench` and `leapctl feed`: Open sends Hello and waits
// for HelloAck; then messages are written and read as they are.
#ifndef LEAP_CLIENT_ENGINE_CONNECTION_H_
#define LEAP_CLIENT_ENGINE_CONNECTION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/predictor.grpc.pb.h"

namespace leap::client {

// One Connect stream. Write may run on one thread while Read runs on
// another (gRPC's contract for a synchronous stream); never two writers or
// two readers at once.
class EngineConnection {
 public:
  // Opens the stream and exchanges Hello / HelloAck. Errors are FromGrpc's
  // ("UNAVAILABLE: cannot reach leapd at ADDR (...)", "INVALID_ARGUMENT:
  // hello dim ...").
  static absl::StatusOr<std::unique_ptr<EngineConnection>> Open(
      const std::shared_ptr<grpc::Channel>& channel, const std::string& address,
      int64_t dim, v1::FeatureDType dtype, const std::string& engine_id);
  // Cancels and reaps the stream if Finish() was not called.
  ~EngineConnection();
  EngineConnection(const EngineConnection&) = delete;
  EngineConnection& operator=(const EngineConnection&) = delete;

  const v1::HelloAck& hello_ack() const { return ack_; }

  // False once the stream is broken.
  bool Write(const v1::EngineMessage& m);
  // False at the end of the stream.
  bool Read(v1::SidecarMessage* m);
  // No more writes; leapd then ends the stream once it answered everything.
  void WritesDone();
  // Aborts the stream (pending and later Reads return false).
  void Cancel();
  // Call after Read returned false: the stream's status.
  absl::Status Finish();

 private:
  EngineConnection(std::string address) : address_(std::move(address)) {}

  std::string address_;
  grpc::ClientContext ctx_;
  std::unique_ptr<v1::Predictor::Stub> stub_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::EngineMessage, v1::SidecarMessage>>
      stream_;
  v1::HelloAck ack_;
  bool writes_done_ = false;
  bool finished_ = false;
};

// FEATURE_DTYPE_FLOAT32 for "float32", BFLOAT16 for "bfloat16", FLOAT16 for
// "float16", UNSPECIFIED otherwise.
v1::FeatureDType DTypeFromName(absl::string_view name);

// A per-request error as a Status: its code, message "CODE_NAME: message
// (request 'id')".
absl::Status FromRequestError(const v1::RequestError& error);

// "<prefix>-<8 hex digits>-": a request id prefix unique to this run (leapd
// may still hold live ids of an earlier run).
std::string RandomRunId(absl::string_view prefix);

}  // namespace leap::client

#endif  // LEAP_CLIENT_ENGINE_CONNECTION_H_
