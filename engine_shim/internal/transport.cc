#include "engine_shim/internal/transport.h"

#include <atomic>

#include <fstream>
#include <sstream>

#include <chrono>

#include <sched.h>

#include <deque>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine_shim/shm_channel.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/predictor.grpc.pb.h"

namespace leap::shim {
namespace {

namespace pb = ::leap::v1;

// A Connect stream whose Send never blocks the caller: messages are queued
// and a writer thread of the stream's own writes them. A gRPC Write blocked
// on a hung leapd's flow control is not released by cancelling the call
// (measured: it stays blocked until leapd reads again or dies), so it must
// not be the Client's thread that waits in it. Close cancels the call (the
// reader's Read returns at once); the destructor joins the writer when it
// is done, and otherwise leaves it, with the stream it writes to, to finish
// by itself once leapd moves or goes away.
class GrpcTransport final : public Transport {
 public:
  explicit GrpcTransport(std::shared_ptr<grpc::Channel> channel)
      : s_(std::make_shared<State>()) {
    s_->stub = pb::Predictor::NewStub(channel);
    s_->stream = s_->stub->Connect(&s_->ctx);
    writer_ = std::thread([s = s_] { WriterLoop(*s); });
  }

  ~GrpcTransport() override {
    Close();
    bool done;
    {
      absl::MutexLock lock(&s_->mu);
      auto finished = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s_->mu) {
        return s_->writer_done;
      };
      done = s_->mu.AwaitWithTimeout(absl::Condition(&finished),
                                     absl::Milliseconds(100));
    }
    if (done) {
      writer_.join();
    } else {
      writer_.detach();  // owns its State: ends when its Write returns
    }
  }

  bool Send(const pb::EngineMessage& m) override {
    absl::MutexLock lock(&s_->mu);
    if (s_->closed || s_->failed) return false;
    s_->queue.push_back(m);
    return true;
  }

  bool Receive(pb::SidecarMessage* m) override { return s_->stream->Read(m); }

  void Close() override {
    {
      absl::MutexLock lock(&s_->mu);
      if (s_->closed) return;
      s_->closed = true;
    }
    s_->ctx.TryCancel();
  }

 private:
  struct State {
    grpc::ClientContext ctx;
    std::unique_ptr<pb::Predictor::Stub> stub;
    std::unique_ptr<
        grpc::ClientReaderWriter<pb::EngineMessage, pb::SidecarMessage>>
        stream;
    absl::Mutex mu;
    std::deque<pb::EngineMessage> queue ABSL_GUARDED_BY(mu);
    bool closed ABSL_GUARDED_BY(mu) = false;
    bool failed ABSL_GUARDED_BY(mu) = false;
    bool writer_done ABSL_GUARDED_BY(mu) = false;
  };

  static void WriterLoop(State& s) {
    for (;;) {
      pb::EngineMessage m;
      {
        absl::MutexLock lock(&s.mu);
        auto ready = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
          return s.closed || !s.queue.empty();
        };
        s.mu.Await(absl::Condition(&ready));
        if (s.closed) break;
        m = std::move(s.queue.front());
        s.queue.pop_front();
      }
      if (!s.stream->Write(m)) {
        absl::MutexLock lock(&s.mu);
        s.failed = true;
        break;
      }
    }
    absl::MutexLock lock(&s.mu);
    s.writer_done = true;
  }

  std::shared_ptr<State> s_;
  std::thread writer_;
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
    if (m.has_completions()) {
      for (const pb::Completion& c : m.completions().completions()) {
        EndHeld(c.request_id());
      }
    }
    if (m.has_cancels()) {
      for (const std::string& id : m.cancels().request_ids()) EndHeld(id);
    }
    const size_t limit = ch->max_frame_payload();
    if (m.has_cancels()) {
      // A batch larger than a frame goes as several kCancels frames with
      // its seq (each answered by its own Ack).
      const auto& ids = m.cancels().request_ids();
      std::vector<absl::string_view> views;
      size_t bytes = sizeof(shm::CancelsHead);
      for (const std::string& id : ids) {
        const size_t add = sizeof(uint16_t) + id.size();
        if (!views.empty() && bytes + add > limit) {
          if (!ch->SendCancels(m.seq(), views).ok()) return false;
          views.clear();
          bytes = sizeof(shm::CancelsHead);
        }
        views.push_back(id);
        bytes += add;
      }
      if (!ch->SendCancels(m.seq(), views).ok()) return false;
      ch->Flush();
      return true;
    }
    if (m.ByteSizeLong() > limit &&
        (m.has_completions() || m.has_prior_queries())) {
      // A message larger than a frame goes as several kProto frames with
      // its seq, each a run of its records, each answered by its own Ack /
      // PriorBatch: the Client adds the parts up (docs/WIRE.md, "Messages
      // and answers larger than a frame").
      pb::EngineMessage part;
      part.set_seq(m.seq());
      const size_t base = part.ByteSizeLong() + 16;
      size_t bytes = base;
      int records = 0;
      auto ship = [&]() -> bool {
        if (records == 0) return true;
        if (!ch->SendProto(part).ok()) return false;
        part.Clear();
        part.set_seq(m.seq());
        bytes = base;
        records = 0;
        return true;
      };
      if (m.has_completions()) {
        for (const pb::Completion& c : m.completions().completions()) {
          const size_t add = c.ByteSizeLong() + 6;
          if (bytes + add > limit && !ship()) return false;
          *part.mutable_completions()->add_completions() = c;
          bytes += add;
          ++records;
        }
      } else {
        for (const pb::ArrivalRecord& a : m.prior_queries().records()) {
          const size_t add = a.ByteSizeLong() + 6;
          if (bytes + add > limit && !ship()) return false;
          *part.mutable_prior_queries()->add_records() = a;
          bytes += add;
          ++records;
        }
      }
      if (!ship()) return false;
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
          continue;  // (the hook set at attach settled each slot)
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
    (*ch)->SetReleaseHook([this](uint32_t slot) { Released(slot); });
    ch_ = *std::move(ch);
    return true;
  }

  bool SendFeatures(ShmChannel* ch, const pb::EngineMessage& m) {
    const size_t want = ch->feature_bytes();
    // No slot came from a wait (nothing owed, deadline passed, channel
    // closed): later records do not wait.
    bool wait_failed = false;
    std::vector<ShmChannel::Record> records;
    pb::SidecarMessage errors;
    errors.set_seq(m.seq());
    auto* batch = errors.mutable_predictions();
    size_t frame_bytes = sizeof(shm::FeaturesHead);
    auto ship = [&]() -> bool {
      if (records.empty()) return true;
      {
        // Before the frame goes: leapd may release a slot at once.
        absl::MutexLock lock(&held_mu_);
        for (const auto& r : records) {
          held_[std::string(r.request_id)] = r.slot;
          holder_[r.slot] = std::string(r.request_id);
        }
      }
      absl::Status s = ch->SendFeatures(m.seq(), records);
      if (!s.ok()) {
        for (const auto& r : records) ch->ReturnSlot(r.slot);
        return false;  // the transport is done: held_ no longer matters
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
      if (slot < 0 && !wait_failed) {
        // Every slot holds a live request. Wait (up to the send deadline)
        // only for the releases leapd owes for completions and cancels
        // already sent (the reader thread frees those slots). Once a wait
        // found none (nothing owed, or the deadline passed), the message's
        // later records take a slot freed meanwhile or are refused, without
        // waiting. The other requests end only when the engine completes
        // them, and that completion would queue behind this very message.
        const absl::Time deadline = absl::Now() + timeout_;
        for (;;) {
          // Read before the attempt: nothing owed means every owed slot
          // was settled, and the release hook settles a slot under the
          // free-list lock just before freeing it, so the attempt sees it.
          const bool owed = MayWaitForRelease();
          slot = ch->AcquireSlot();
          if (slot >= 0 || !owed || ch->closed()) break;
          if (absl::Now() >= deadline) {
            StopWaitingForTheOwed();
            break;
          }
          if (!ship()) return false;  // (no slot of ours outside `records`)
          ch->Flush();
          sched_yield();
        }
        // If no slot came, the rest of this message does not wait.
        wait_failed = slot < 0;
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

  // A completion or cancel goes out for a request whose features leapd
  // holds in a slot: that slot's release is owed.
  void EndHeld(const std::string& request_id) {
    absl::MutexLock lock(&held_mu_);
    auto it = held_.find(request_id);
    if (it == held_.end()) return;
    owed_.insert(it->second);
    holder_.erase(it->second);
    held_.erase(it);
  }
  // Reader thread (ShmChannel's release hook), before the slot can be
  // acquired again: an owed release is settled; any other (leapd evicted
  // the request or refused its record) ends the request's hold, so its
  // later completion owes nothing.
  void Released(uint32_t slot) {
    absl::MutexLock lock(&held_mu_);
    if (owed_.erase(slot) > 0 || stale_.erase(slot) > 0) return;
    auto h = holder_.find(slot);
    if (h == holder_.end()) return;
    held_.erase(h->second);
    holder_.erase(h);
  }
  bool MayWaitForRelease() {
    absl::MutexLock lock(&held_mu_);
    return !owed_.empty();
  }
  // A wait timed out: the slots owed now are not waited for again (leapd
  // kept those requests, e.g. it refused their completions); their
  // releases, when they come, are still settled.
  void StopWaitingForTheOwed() {
    absl::MutexLock lock(&held_mu_);
    stale_.insert(owed_.begin(), owed_.end());
    owed_.clear();
  }

  const std::string path_;
  const absl::Duration timeout_;
  const TransportOptions options_;
  // The requests (wire ids) whose features went out in a slot that leapd
  // still holds, both ways, and the slots of requests that ended (a
  // completion or cancel sent) whose release has not come yet: owed_ is
  // waited for, stale_ (owed_ when a wait timed out) no longer. Manager
  // thread (Send) and reader thread (the release hook, under the channel's
  // free-list lock: held_mu_ is taken after it, never before).
  absl::Mutex held_mu_;
  absl::flat_hash_map<std::string, uint32_t> held_ ABSL_GUARDED_BY(held_mu_);
  absl::flat_hash_map<uint32_t, std::string> holder_ ABSL_GUARDED_BY(held_mu_);
  absl::flat_hash_set<uint32_t> owed_ ABSL_GUARDED_BY(held_mu_);
  absl::flat_hash_set<uint32_t> stale_ ABSL_GUARDED_BY(held_mu_);
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

absl::Status CheckEndpoint(const std::string& endpoint) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "endpoint '", endpoint, "' ", why,
        "; use host:port, unix:///path/to/leapd.sock or "
        "shm:///path/to/leap.shm"));
  };
  if (endpoint.empty()) return bad("is empty");
  auto starts = [&](absl::string_view p) {
    return endpoint.size() > p.size() && absl::StartsWith(endpoint, p);
  };
  if (starts("shm://") || starts("unix://")) {
    const size_t at = endpoint.find("://") + 3;
    if (endpoint[at] != '/') return bad("must name an absolute path");
    return absl::OkStatus();
  }
  if (starts("unix:") || starts("unix-abstract:") || starts("dns:") ||
      starts("ipv4:") || starts("ipv6:")) {
    return absl::OkStatus();
  }
  const size_t scheme = endpoint.find("://");
  if (scheme != std::string::npos) {
    return bad(absl::StrCat("has scheme '", endpoint.substr(0, scheme),
                            "', which leapd does not speak"));
  }
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon + 1 == endpoint.size() ||
      endpoint.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
    return bad("has no port");
  }
  return absl::OkStatus();
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
