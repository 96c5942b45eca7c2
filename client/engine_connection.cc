#include "client/engine_connection.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/admin_client.h"

namespace leap::client {

namespace pb = ::leap::v1;

absl::StatusOr<std::unique_ptr<EngineConnection>> EngineConnection::Open(
    const std::shared_ptr<grpc::Channel>& channel, const std::string& address,
    int64_t dim, pb::FeatureDType dtype, const std::string& engine_id) {
  std::unique_ptr<EngineConnection> c(new EngineConnection(address));
  c->stub_ = pb::Predictor::NewStub(channel);
  c->stream_ = c->stub_->Connect(&c->ctx_);
  pb::EngineMessage hello;
  hello.mutable_hello()->set_engine_id(engine_id);
  hello.mutable_hello()->set_dim(dim);
  hello.mutable_hello()->set_dtype(dtype);
  pb::SidecarMessage answer;
  bool ok = c->stream_->Write(hello);
  while (ok) {
    ok = c->stream_->Read(&answer);
    if (ok && answer.has_hello_ack()) break;
    if (ok && answer.has_error()) {
      c->Cancel();
      return absl::Status(
          static_cast<absl::StatusCode>(answer.error().code()),
          absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(
                           answer.error().code())),
                       ": ", answer.error().message()));
    }
  }
  if (!ok) {
    c->WritesDone();
    pb::SidecarMessage drain;
    while (c->stream_->Read(&drain)) {
    }
    absl::Status s = c->Finish();
    if (s.ok()) {
      s = absl::UnavailableError(
          absl::StrCat("UNAVAILABLE: leapd at ", address,
                       " closed the stream before acknowledging hello"));
    }
    return s;
  }
  c->ack_ = answer.hello_ack();
  return c;
}

EngineConnection::~EngineConnection() {
  if (finished_ || stream_ == nullptr) return;
  Cancel();
  pb::SidecarMessage drain;
  while (stream_->Read(&drain)) {
  }
  stream_->Finish().ok();  // the status of a cancelled stream
}

bool EngineConnection::Write(const pb::EngineMessage& m) {
  return stream_->Write(m);
}

bool EngineConnection::Read(pb::SidecarMessage* m) { return stream_->Read(m); }

void EngineConnection::WritesDone() {
  if (writes_done_) return;
  writes_done_ = true;
  stream_->WritesDone();
}

void EngineConnection::Cancel() { ctx_.TryCancel(); }

absl::Status EngineConnection::Finish() {
  if (finished_) return absl::OkStatus();
  finished_ = true;
  return FromGrpc(stream_->Finish(), address_);
}

pb::FeatureDType DTypeFromName(absl::string_view name) {
  if (name == "float32") return pb::FEATURE_DTYPE_FLOAT32;
  if (name == "bfloat16") return pb::FEATURE_DTYPE_BFLOAT16;
  if (name == "float16") return pb::FEATURE_DTYPE_FLOAT16;
  return pb::FEATURE_DTYPE_UNSPECIFIED;
}

absl::Status FromRequestError(const pb::RequestError& e) {
  const auto code = static_cast<absl::StatusCode>(e.code());
  return absl::Status(
      code,
      absl::StrCat(absl::StatusCodeToString(code), ": ", e.message(),
                   e.request_id().empty()
                       ? ""
                       : absl::StrCat(" (request '", e.request_id(), "')")));
}

std::string RandomRunId(absl::string_view prefix) {
  std::random_device rd;
  return absl::StrCat(prefix, "-", absl::Hex(rd(), absl::kZeroPad8), "-");
}

}  // namespace leap::client
