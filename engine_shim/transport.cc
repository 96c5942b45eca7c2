#include "engine_shim/transport.h"

#include <fstream>
#include <sstream>

#include <chrono>

#include <sched.h>

#include <deque>

#include "absl/strings/str_cat.h"
#include "engine_shim/shm_channel.h"
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


// The Connect messages over a shared-memory attachment. Features are copied
// into slots (the engine's capture path can write them there directly
// through ShmChannel instead); predictions come back as SidecarMessages, so
// the Client cannot tell the transports apart.
class ShmTransport final : public Transport {
 public:
  ShmTransport(std::string path, absl::Duration timeout, TransportOptions o)
      : path_(std::move(path)), timeout_(timeout), options_(o) {}
  ~ShmTransport() override { Close(); }

  bool Send(const pb::EngineMessage& m) override {
    ShmChannel* ch = channel();
    // The first hello attaches; a later one goes to leapd like any message
    // (which refuses it, exactly as on a gRPC stream).
    if (m.has_hello() && ch == nullptr) return Attach(m);
    if (ch == nullptr) return false;
    if (m.has_features()) return SendFeatures(ch, m);
    if (m.has_cancels()) {
      const auto& ids = m.cancels().request_ids();
      std::vector<absl::string_view> views(ids.begin(), ids.end());
      if (!ch->SendCancels(m.seq(), views).ok()) return false;
      ch->Flush();
      return true;
    }
    if (!ch->SendProto(m).ok()) return false;
    ch->Flush();
    return true;
  }

  bool Receive(pb::SidecarMessage* m) override {
    ShmIncoming in;
    for (;;) {
      ShmChannel* ch;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return closed_ || !local_.empty() || ch_ != nullptr || refused_;
        };
        mu_.Await(absl::Condition(&ready));
        if (!local_.empty()) {
          *m = std::move(local_.front());
          local_.pop_front();
          return true;
        }
        if (closed_ || refused_) return false;
        ch = ch_.get();
      }
      absl::Status s = ch->Receive(&in, absl::Milliseconds(100));
      if (absl::IsDeadlineExceeded(s)) continue;
      if (!s.ok()) return false;
      switch (in.kind) {
        case ShmIncoming::Kind::kReleased:
          continue;
        case ShmIncoming::Kind::kProto:
          *m = std::move(in.proto);
          return true;
        case ShmIncoming::Kind::kPredictions: {
          m->Clear();
          m->set_seq(in.seq);
          pb::PredictionBatch* b = m->mutable_predictions();
          for (const ShmPrediction& p : in.predictions) {
            pb::Prediction* o = b->add_predictions();
            o->set_request_id(std::string(p.request_id));
            o->set_predicted_tokens(p.predicted_tokens);
            o->set_score(p.score);
            o->set_readout(std::string(p.readout));
            o->set_version(p.version);
            o->set_arm(std::string(p.arm));
          }
          for (const ShmError& e : in.errors) {
            pb::RequestError* o = b->add_errors();
            o->set_request_id(std::string(e.request_id));
            o->set_code(e.code);
            o->set_message(std::string(e.message));
          }
          return true;
        }
      }
    }
  }

  void Close() override {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
    closed_ = true;
    if (ch_ != nullptr) ch_->Close();
  }

 private:
  ShmChannel* channel() {
    absl::MutexLock lock(&mu_);
    return closed_ ? nullptr : ch_.get();
  }

  // Queues a message for Receive as if leapd had sent it.
  void Local(pb::SidecarMessage m) {
    absl::MutexLock lock(&mu_);
    local_.push_back(std::move(m));
    if (ch_ != nullptr) ch_->Interrupt();
  }

  bool Attach(const pb::EngineMessage& m) {
    ShmChannelOptions o;
    o.path = path_;
    o.hello = m.hello();
    o.slots = options_.shm_slots;
    o.ring_bytes = options_.shm_ring_bytes;
    o.timeout = timeout_;
    pb::SidecarMessage ack;
    absl::StatusOr<std::unique_ptr<ShmChannel>> ch = ShmChannel::Attach(o, &ack);
    absl::MutexLock lock(&mu_);
    if (!ch.ok()) {
      // Delivered as a message-level error, then the stream ends: the
      // engine sees leapd's reason instead of a silent reconnect loop.
      pb::SidecarMessage err;
      err.set_seq(m.seq());
      err.mutable_error()->set_code(static_cast<int>(ch.status().code()));
      err.mutable_error()->set_message(std::string(ch.status().message()));
      local_.push_back(std::move(err));
      refused_ = true;
      return true;
    }
    ack.set_seq(m.seq());
    hello_ = m.hello();
    local_.push_back(std::move(ack));
    ch_ = *std::move(ch);
    return true;
  }

  bool SendFeatures(ShmChannel* ch, const pb::EngineMessage& m) {
    const size_t want = ch->feature_bytes();
    std::vector<ShmChannel::Record> records;
    pb::SidecarMessage errors;
    errors.set_seq(m.seq());
    auto* batch = errors.mutable_predictions();
    size_t frame_bytes = sizeof(shm::FeaturesHead);
    auto ship = [&]() -> bool {
      if (records.empty()) return true;
      absl::Status s = ch->SendFeatures(m.seq(), records);
      if (!s.ok()) {
        for (const auto& r : records) ch->ReturnSlot(r.slot);
        return false;
      }
      records.clear();
      frame_bytes = sizeof(shm::FeaturesHead);
      return true;
    };
    for (const auto& r : m.features().records()) {
      if (r.features().size() != want) {
        auto* e = batch->add_errors();
        e->set_request_id(r.request_id());
        e->set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
        // The very words leapd uses for this error on a gRPC stream.
        static constexpr const char* kNames[] = {"unknown", "float32",
                                                 "bfloat16", "float16"};
        e->set_message(absl::StrCat(
            "record has ", r.features().size(),
            " bytes of features; hello declared dim ", hello_.dim(), " ",
            kNames[hello_.dtype() >= 1 && hello_.dtype() <= 3 ? hello_.dtype() : 0],
            " (", want, " bytes)"));
        continue;
      }
      int64_t slot = ch->AcquireSlot();
      const absl::Time deadline = absl::Now() + timeout_;
      while (slot < 0 && absl::Now() < deadline && !ch->closed()) {
        // Every slot holds a live request: ship what we have, then wait
        // for leapd to release slots (the reader thread frees them).
        if (!ship()) return false;  // (no slot of ours outside `records`)
        ch->Flush();
        sched_yield();
        slot = ch->AcquireSlot();
      }
      if (slot < 0) {
        auto* e = batch->add_errors();
        e->set_request_id(r.request_id());
        e->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
        e->set_message(absl::StrCat(
            "all ", ch->slot_count(),
            " shm feature slots hold live requests; raise the client's "
            "shm_slots"));
        continue;
      }
      std::memcpy(ch->slot(static_cast<uint32_t>(slot)), r.features().data(), want);
      const size_t rec = shm::FeatureRecordBytes(r.request_id().size(),
                                                 r.product_line().size());
      if (frame_bytes + rec > std::min(ch_max_payload_, ch->max_frame_payload()) &&
          !ship()) {
        ch->ReturnSlot(static_cast<uint32_t>(slot));
        return false;
      }
      records.push_back({static_cast<uint32_t>(slot), r.request_id(),
                         r.product_line(), r.decoding().max_tokens()});
      frame_bytes += rec;
    }
    if (!ship()) return false;
    ch->Flush();
    if (batch->errors_size() > 0) Local(std::move(errors));
    return true;
  }

  const std::string path_;
  const absl::Duration timeout_;
  const TransportOptions options_;
  const size_t ch_max_payload_ = 16 << 10;  // per kFeatures frame
  pb::Hello hello_;  // set at attach, before any Send of features
  absl::Mutex mu_;
  std::unique_ptr<ShmChannel> ch_ ABSL_GUARDED_BY(mu_);
  std::deque<pb::SidecarMessage> local_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool refused_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const TransportOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() &&
      o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together");
  }
  grpc::SslCredentialsOptions ssl;
  for (auto [path, out] : {std::pair{&o.tls_ca_file, &ssl.pem_root_certs},
                           {&o.tls_cert_file, &ssl.pem_cert_chain},
                           {&o.tls_key_file, &ssl.pem_private_key}}) {
    if (path->empty()) continue;
    std::ifstream in(*path, std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    if (!in || bytes.str().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read TLS file ", *path));
    }
    *out = bytes.str();
  }
  return grpc::SslCredentials(ssl);
}

absl::StatusOr<std::unique_ptr<Transport>> Dial(const std::string& endpoint,
                                                absl::Duration timeout,
                                                const TransportOptions& options) {
  if (endpoint.rfind("shm://", 0) == 0) {
    std::string path = endpoint.substr(6);
    if (path.empty() || path[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm endpoint must name an absolute socket path (shm:///dev/shm/"
          "leap-main), got '", endpoint, "'"));
    }
    return std::unique_ptr<Transport>(
        new ShmTransport(std::move(path), timeout, options));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  auto creds = ChannelCredentials(options);
  if (!creds.ok()) return creds.status();
  auto channel = grpc::CreateCustomChannel(endpoint, *creds, args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 absl::ToChronoMilliseconds(timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to leapd at ", endpoint));
  }
  return std::unique_ptr<Transport>(new GrpcTransport(std::move(channel)));
}

}  // namespace leap::shim
