#include "tests/support/engine_client.h"

namespace leap::testing {

namespace pb = ::leap::v1;

grpc::Status CreateDefaultReadout(const std::string& address,
                                  const std::string& name, int64_t dim) {
  auto admin = leap::v1::Admin::NewStub(MakeChannel(address));
  grpc::ClientContext ctx;
  leap::v1::CreateReadoutRequest req;
  req.set_name(name);
  req.mutable_cold_start()->set_dim(dim);
  req.mutable_cold_start()->set_lambda(1.0);
  leap::v1::ReadoutInfo info;
  grpc::Status s = admin->CreateReadout(&ctx, req, &info);
  if (!s.ok()) return s;
  grpc::ClientContext rctx;
  leap::v1::SetRouteRequest route;
  route.mutable_route()->add_arms()->set_readout(name);
  route.mutable_route()->mutable_arms(0)->set_percent(100);
  leap::v1::Route out;
  return admin->SetRoute(&rctx, route, &out);
}

int64_t AwaitLearned(const std::string& address, const std::string& readout,
                     int64_t learned, std::chrono::seconds timeout) {
  auto stub = pb::Predictor::NewStub(MakeChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  pb::WatchReadoutRequest req;
  req.set_readout(readout);
  auto watch = stub->WatchReadout(&ctx, req);
  pb::ReadoutVersion v;
  int64_t seen = -1;
  while (watch->Read(&v)) {
    seen = v.completions_learned();
    if (seen >= learned) break;
  }
  ctx.TryCancel();
  return seen;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(512 << 20);
  args.SetMaxSendMessageSize(512 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

EngineStream::EngineStream(std::shared_ptr<grpc::Channel> channel, int64_t dim,
                           pb::FeatureDType dtype,
                           const std::string& instance_id) {
  auto stub = pb::Predictor::NewStub(channel);
  stream_ = stub->Connect(&ctx_);
  pb::EngineMessage hello;
  hello.set_seq(0);
  hello.mutable_hello()->set_engine_id("test-engine");
  hello.mutable_hello()->set_instance_id(instance_id);
  hello.mutable_hello()->set_dim(dim);
  hello.mutable_hello()->set_dtype(dtype);
  stream_->Write(hello);
  reader_ = std::thread([this] { ReadLoop(); });
}

EngineStream::~EngineStream() {
  ctx_.TryCancel();
  if (reader_.joinable()) reader_.join();
}

void EngineStream::ReadLoop() {
  pb::SidecarMessage m;
  while (stream_->Read(&m)) {
    absl::MutexLock lock(&mu_);
    if (m.has_published()) {
      published_[m.published().readout()].push_back(m.published().version());
    } else if (m.has_rescore()) {
      auto& by_version =
          rescores_[m.rescore().readout()][m.rescore().version()];
      for (const auto& p : m.rescore().predictions()) {
        by_version[p.request_id()] = p;
      }
    } else {
      answers_[m.seq()] = m;
    }
    ++changes_;
  }
  absl::MutexLock lock(&mu_);
  closed_ = true;
  ++changes_;
}

uint64_t EngineStream::Send(pb::EngineMessage m) {
  absl::MutexLock lock(&write_mu_);
  const uint64_t seq = next_seq_++;
  m.set_seq(seq);
  if (!stream_->Write(m)) alive_ = false;
  return seq;
}

bool EngineStream::Await(uint64_t seq, pb::SidecarMessage* out,
                         absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return closed_ || answers_.count(seq) != 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) return false;
  auto it = answers_.find(seq);
  if (it == answers_.end()) return false;
  *out = std::move(it->second);
  answers_.erase(it);
  return true;
}

pb::SidecarMessage EngineStream::Call(pb::EngineMessage m) {
  pb::SidecarMessage out;
  const uint64_t seq = Send(std::move(m));
  if (!Await(seq, &out)) out.mutable_error()->set_message("no answer");
  return out;
}

bool EngineStream::WaitUntil(const std::function<bool()>& pred,
                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    uint64_t seen;
    {
      absl::MutexLock lock(&mu_);
      seen = changes_;
    }
    // Without mu_: pred reads through published()/rescores(), which lock.
    if (pred()) return true;
    absl::MutexLock lock(&mu_);
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return changes_ != seen;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
      return false;
    }
  }
}

grpc::Status EngineStream::Finish() {
  {
    absl::MutexLock lock(&write_mu_);
    stream_->WritesDone();
  }
  if (reader_.joinable()) reader_.join();
  return stream_->Finish();
}

std::vector<int64_t> EngineStream::published(const std::string& readout) {
  absl::MutexLock lock(&mu_);
  auto it = published_.find(readout);
  if (it == published_.end()) return {};
  return it->second;
}

std::map<int64_t, std::map<std::string, pb::Prediction>>
EngineStream::rescores(const std::string& readout) {
  absl::MutexLock lock(&mu_);
  auto it = rescores_.find(readout);
  if (it == rescores_.end()) return {};
  return it->second;
}

}  // namespace leap::testing
