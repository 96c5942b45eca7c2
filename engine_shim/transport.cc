#include "engine_shim/transport.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/predictor.grpc.pb.h"

namespace leap::shim {
namespace {

namespace pb = ::leap::v1;

class GrpcTransport final : public Transport {
 public:
  GrpcTransport(std::shared_ptr<grpc::Channel> channel)
      : stub_(pb::Predictor::NewStub(channel)),
        stream_(stub_->Connect(&ctx_)) {}

  ~GrpcTransport() override { Close(); }

  bool Send(const pb::EngineMessage& m) override {
    absl::MutexLock lock(&write_mu_);
    if (closed_) return false;
    return stream_->Write(m);
  }

  bool Receive(pb::SidecarMessage* m) override { return stream_->Read(m); }

  void Close() override {
    absl::MutexLock lock(&write_mu_);
    if (closed_) return;
    closed_ = true;
    ctx_.TryCancel();
  }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<pb::Predictor::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<pb::EngineMessage, pb::SidecarMessage>>
      stream_;
  absl::Mutex write_mu_;
  bool closed_ ABSL_GUARDED_BY(write_mu_) = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> Dial(const std::string& endpoint,
                                                absl::Duration timeout) {
  if (endpoint.rfind("shm://", 0) == 0) {
    return absl::UnimplementedError(
        "the shared-memory transport is not built yet; use host:port or "
        "unix:///path");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  auto channel = grpc::CreateCustomChannel(
      endpoint, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 absl::ToChronoMilliseconds(timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to leapd at ", endpoint));
  }
  return std::unique_ptr<Transport>(new GrpcTransport(std::move(channel)));
}

}  // namespace leap::shim
