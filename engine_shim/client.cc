#include "engine_shim/client.h"

#include <algorithm>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/ids.h"
#include "common/shm_format.h"

namespace leap::shim {
namespace {

namespace pb = ::leap::v1;

constexpr int32_t kAlreadyExists = 6;
constexpr int32_t kInvalidArgument = 3;
constexpr int32_t kResourceExhausted = 8;
constexpr int32_t kUnavailable = 14;  // a transient refusal: resent

// Largest message the Client builds (a batch of features, completions,
// cancels or prior queries, counted as the records' bytes plus
// kRecordOverhead each): far below gRPC's send limit (256 MiB, set in Dial)
// and leapd's --max_message_bytes (512 MiB). A batch that would outgrow it
// goes in several messages.
constexpr size_t kMaxMessageBytes = size_t{16} << 20;
constexpr size_t kRecordOverhead = 32;  // a record's protobuf framing, at most

// The Client whose callback this thread is running (Emit from inside the
// callback queues instead of taking events_mu_ again).
thread_local const Client* tls_delivering = nullptr;

// A 'prediction' or 'rescore' event carrying `p`.
Event PredictionEvent(Event::Kind kind, const pb::Prediction& p) {
  Event e;
  e.kind = kind;
  e.request_id = p.request_id();
  e.predicted_tokens = p.predicted_tokens();
  e.score = p.score();
  e.readout = p.readout();
  e.version = p.version();
  return e;
}

// The ids of a feature or arrival record, checked as leapd checks them
// (docs/WIRE.md, "Feature records"): INVALID_ARGUMENT in leapd's words.
absl::Status CheckRecordIds(const std::string& request_id,
                            const std::string& product_line) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id is empty");
  if (request_id.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("request_id must not contain NUL");
  }
  if (absl::Status s = CheckIdBytes("request_id", request_id); !s.ok()) return s;
  return CheckIdBytes("product_line", product_line);
}

// An 'error' event (request_id empty for a stream-level error).
Event ErrorEvent(const std::string& request_id, int32_t code,
                 const std::string& message) {
  Event e;
  e.kind = Event::Kind::kError;
  e.request_id = request_id;
  e.code = code;
  e.message = message;
  return e;
}

}  // namespace

absl::Status ClientOptions::Validate() const {
  if (absl::Status s = CheckEndpoint(endpoint); !s.ok()) return s;
  if (dim < 1 || dim > 16384) {
    return absl::InvalidArgumentError(
        absl::StrCat("dim must be in [1, 16384], got ", dim));
  }
  if (min_backoff <= absl::ZeroDuration() || max_backoff < min_backoff) {
    return absl::InvalidArgumentError("need 0 < min_backoff <= max_backoff");
  }
  if (response_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("response_timeout must be > 0");
  }
  if (instance_id.size() > 128 || instance_id.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "instance_id must be at most 128 bytes without NUL, got ", instance_id.size(),
        " bytes", instance_id.find('\0') != std::string::npos ? " with a NUL" : ""));
  }
  // leapd refuses a longer one at the hello (docs/WIRE.md, "Sizes"): refused
  // here, before any I/O, instead of failing every connection.
  if (absl::Status s = CheckIdBytes("engine_id", engine_id); !s.ok()) return s;
  if (absl::Status s = CheckIdBytes("model_id", model_id); !s.ok()) return s;
  if (shm_slots < 1 || shm_slots > ::leap::shm::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_slots must be in [1, ", ::leap::shm::kMaxSlots, "], got ", shm_slots));
  }
  if (shm_ring_bytes < ::leap::shm::kMinRingBytes || shm_ring_bytes > ::leap::shm::kMaxRingBytes ||
      (shm_ring_bytes & (shm_ring_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_ring_bytes must be a power of two in [", ::leap::shm::kMinRingBytes, ", ",
        ::leap::shm::kMaxRingBytes, "], got ", shm_ring_bytes));
  }
  if (max_batch_records < 1) {
    return absl::InvalidArgumentError("max_batch_records must be >= 1");
  }
  if (max_live_requests < 1) {
    return absl::InvalidArgumentError("max_live_requests must be >= 1");
  }
  TransportOptions t;
  t.tls_ca_file = tls_ca_file;
  t.tls_cert_file = tls_cert_file;
  t.tls_key_file = tls_key_file;
  return ChannelCredentials(t).status();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Start(ClientOptions options) {
  absl::Status s = options.Validate();
  if (!s.ok()) return s;
  if (options.instance_id.empty()) {
    std::random_device rd;
    options.instance_id = absl::StrFormat("%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  }
  std::unique_ptr<Client> c(new Client(std::move(options)));
  c->manager_ = std::thread([p = c.get()] { p->ManagerLoop(); });
  c->watchdog_ = std::thread([p = c.get()] { p->WatchdogLoop(); });
  return c;
}

Client::~Client() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    // A Send blocked on a hung leapd returns once its connection closes.
    if (current_ != nullptr) current_->Close();
  }
  if (watchdog_.joinable()) watchdog_.join();
  if (manager_.joinable()) manager_.join();
}

void Client::NoteSent(uint64_t seq) {
  unanswered_.emplace(seq, absl::Now());
}

void Client::NoteAnswered(uint64_t seq) {
  auto it = unanswered_.find(seq);
  if (it == unanswered_.end()) return;  // (a later part of a split answer)
  const bool oldest = it == unanswered_.begin();
  unanswered_.erase(it);
  // The new oldest is watched from now: leapd just answered an earlier
  // message. Answers to later messages do not restart its clock (a
  // completions answer parked behind JetStream stays watched while the
  // predictions sent after it are answered).
  if (oldest && !unanswered_.empty()) {
    unanswered_.begin()->second =
        std::max(unanswered_.begin()->second, absl::Now());
  }
}

void Client::ScheduleRetry(const std::string& request_id, Live* live) {
  ++live->refusals;
  ++stats_.completion_retries;
  // min_backoff doubling per refusal up to max_backoff, drawn in [half, all].
  absl::Duration backoff = options_.min_backoff;
  for (int i = 1; i < live->refusals && backoff < options_.max_backoff; ++i) {
    backoff *= 2;
  }
  backoff = std::min(backoff, options_.max_backoff);
  std::uniform_real_distribution<double> jitter(0.5, 1.0);
  retries_.emplace(absl::Now() + backoff * jitter(retry_rng_), request_id);
}

void Client::RetryUnnamed(InflightCompletions* in) {
  for (const std::string& id : in->ids) {
    if (!in->unnamed.contains(id)) continue;
    auto it = live_.find(id);
    if (it != live_.end() && it->second.completing) {
      ScheduleRetry(id, &it->second);
    }
  }
  in->unnamed.clear();
}

void Client::WatchdogLoop() {
  const absl::Duration tick =
      std::min(options_.response_timeout / 4, absl::Milliseconds(100));
  absl::MutexLock lock(&mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
  while (!mu_.AwaitWithTimeout(absl::Condition(&stopping), tick)) {
    if (current_ == nullptr || broken_ || unanswered_.empty()) continue;
    const auto& [seq, since] = *unanswered_.begin();
    const absl::Duration waited = absl::Now() - since;
    if (waited <= options_.response_timeout) continue;
    ++stats_.stalls;
    MarkBroken(absl::StrCat(
        "leapd answered nothing for ", absl::FormatDuration(waited),
        " to message seq ", seq, " (", unanswered_.size(),
        " unanswered; response_timeout ",
        absl::FormatDuration(options_.response_timeout),
        "): connection abandoned as hung, reconnecting"));
    current_->Close();
  }
}

void Client::Emit(Event e) {
  if (tls_delivering == this) {
    // From inside the callback (it called Submit, which refused something):
    // this thread holds events_mu_ in Deliver, which passes it on after
    // the callback returns.
    events_mu_.AssertHeld();
    nested_.push_back(std::move(e));
    return;
  }
  absl::MutexLock lock(&events_mu_);
  if (callback_) {
    Deliver(e);
  } else {
    events_.push_back(std::move(e));
  }
}

void Client::Deliver(const Event& e) {
  const Client* outer = tls_delivering;
  tls_delivering = this;
  callback_(e);
  while (!nested_.empty()) {
    const Event n = std::move(nested_.front());
    nested_.pop_front();
    callback_(n);
  }
  tls_delivering = outer;
}

void Client::Submit(std::vector<CapturedFeatures> features) {
  const size_t want =
      static_cast<size_t>(options_.dim) * DTypeSize(options_.dtype);
  std::vector<Event> rejected;
  {
    absl::MutexLock lock(&mu_);
    for (CapturedFeatures& f : features) {
      Event err;
      err.kind = Event::Kind::kError;
      err.request_id = f.request_id;
      if (absl::Status bad = CheckRecordIds(f.request_id, f.product_line);
          !bad.ok()) {
        // Refused here, as leapd would: a record that could outgrow a shm
        // frame or a gRPC message never reaches the connection.
        err.code = kInvalidArgument;
        err.message = std::string(bad.message());
      } else if (f.bytes.size() != want) {
        err.code = kInvalidArgument;
        err.message = absl::StrCat("features of ", f.bytes.size(),
                                   " bytes; the client ships ", want);
      } else if (live_.contains(f.request_id)) {
        err.code = kAlreadyExists;
        err.message = "request id already live in this client";
      } else if (static_cast<int64_t>(live_.size()) >= options_.max_live_requests) {
        err.code = 8;  // RESOURCE_EXHAUSTED
        err.message = "too many live requests in the client";
      } else {
        const std::string id = f.request_id;
        Live& live = live_[id];
        live.bytes = std::make_shared<const std::string>(std::move(f.bytes));
        f.bytes.clear();
        live.features = std::move(f);
        live.submitted_at = ++calls_;
        outbox_.push_back({Outgoing::Kind::kFeatures, id});
        continue;
      }
      ++stats_.errors;
      rejected.push_back(std::move(err));
    }
  }
  for (auto& e : rejected) Emit(std::move(e));
}

void Client::Complete(const std::string& request_id, int64_t output_tokens,
                      FinishReason reason, int64_t prompt_tokens) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(request_id);
  if (it == live_.end() || it->second.completing) return;
  it->second.completing = true;
  it->second.completed_at = ++calls_;
  it->second.output_tokens = output_tokens;
  it->second.reason = reason;
  it->second.prompt_tokens = std::max<int64_t>(prompt_tokens, 0);
  outbox_.push_back({Outgoing::Kind::kCompletion, request_id});
}

void Client::RequestPriors(std::vector<Arrival> arrivals) {
  // A record leapd would refuse for its ids is refused here (an error
  // event, as from leapd), connected or not; the others go on.
  std::vector<Event> rejected;
  for (auto a = arrivals.begin(); a != arrivals.end();) {
    absl::Status bad = CheckRecordIds(a->request_id, a->product_line);
    if (bad.ok()) {
      ++a;
      continue;
    }
    rejected.push_back(ErrorEvent(a->request_id, kInvalidArgument,
                                  absl::StrCat("arrival record: ", bad.message())));
    a = arrivals.erase(a);
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.errors += static_cast<int64_t>(rejected.size());
    if (!acked_hello_ || broken_ || priors_unsupported_ ||
        static_cast<int64_t>(priors_out_.size() + arrivals.size()) >
            options_.max_live_requests) {
      stats_.priors_dropped += static_cast<int64_t>(arrivals.size());
    } else {
      for (Arrival& a : arrivals) priors_out_.push_back(std::move(a));
    }
  }
  for (auto& e : rejected) Emit(std::move(e));
}

void Client::Cancel(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  if (live_.erase(request_id) == 0) return;
  outbox_.push_back({Outgoing::Kind::kCancel, request_id});
}

std::vector<Event> Client::Poll(size_t max) {
  absl::MutexLock lock(&events_mu_);
  std::vector<Event> out;
  while (!events_.empty() && out.size() < max) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return out;
}

void Client::SetCallback(std::function<void(const Event&)> cb) {
  absl::MutexLock lock(&events_mu_);
  callback_ = std::move(cb);
  if (!callback_) return;
  // The events queued before (e.g. kConnected when the hello was answered
  // before this call) go to the new callback first, in order: Emit waits
  // for events_mu_, so none of the client's threads gets ahead of them.
  while (!events_.empty()) {
    const Event e = std::move(events_.front());
    events_.pop_front();
    Deliver(e);
  }
}

bool Client::WaitConnected(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  // connected(), not only the hello's ack: a caller that then reads
  // connected() or stats() sees the session it waited for.
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return connected_.load() && !broken_;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
}

ClientStats Client::stats() const {
  absl::MutexLock lock(&mu_);
  ClientStats s = stats_;
  s.live = static_cast<int64_t>(live_.size());
  s.degraded = !connected_.load();
  if (s.degraded) s.degraded_reason = degraded_reason_;
  return s;
}

void Client::ReaderLoop(Transport* t, uint64_t generation) {
  pb::SidecarMessage m;
  while (t->Receive(&m)) {
    std::vector<Event> events;
    // The feature bytes of the requests this answer ends, freed once mu_ is
    // released (a burst's acknowledgement frees megabytes).
    std::vector<std::shared_ptr<const std::string>> freed;
    const auto erase = [&](auto it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      freed.push_back(std::move(it->second.bytes));
      live_.erase(it);
    };
    {
      absl::MutexLock lock(&mu_);
      if (generation != generation_) break;
      if (m.seq() != 0 && (m.has_predictions() || m.has_ack() ||
                           m.has_error() || m.has_priors())) {
        // Matched by seq: a completions Ack may come after the answers to
        // later messages (fleet mode on shm, docs/WIRE.md).
        NoteAnswered(m.seq());
      }
      switch (m.body_case()) {
        case pb::SidecarMessage::kHelloAck: {
          sidecar_id_ = m.hello_ack().sidecar_id();
          max_batch_bytes_ = m.hello_ack().max_batch_bytes();
          acked_hello_ = true;
          Event e;
          e.kind = Event::Kind::kConnected;
          e.message = sidecar_id_;
          events.push_back(std::move(e));
          break;
        }
        case pb::SidecarMessage::kPredictions:
          for (const auto& p : m.predictions().predictions()) {
            auto it = live_.find(p.request_id());
            if (it != live_.end()) it->second.held_by = sidecar_id_;
            if (p.cold()) {
              // A bootstrap placeholder's value means nothing: the request
              // stays unpredicted (first-come order) until a Rescore.
              ++stats_.cold;
              continue;
            }
            ++stats_.predictions;
            events.push_back(PredictionEvent(Event::Kind::kPrediction, p));
          }
          for (const auto& err : m.predictions().errors()) {
            auto it = live_.find(err.request_id());
            if (err.code() == kAlreadyExists && it != live_.end() &&
                it->second.sends > 1) {
              // A resubmission (the answer to an earlier send was lost):
              // this sidecar holds this instance's request already.
              it->second.held_by = sidecar_id_;
              continue;
            }
            // Otherwise a real collision: the id is live for this engine
            // instance in leapd under another request. Surfaced, dropped.
            if (it != live_.end() && !it->second.completing) erase(it);
            ++stats_.errors;
            events.push_back(
                ErrorEvent(err.request_id(), err.code(), err.message()));
          }
          break;
        case pb::SidecarMessage::kAck: {
          auto in = inflight_.find(m.seq());
          if (in == inflight_.end()) break;  // a cancel's ack
          // One part of the answer (shm splits an Ack larger than a frame:
          // docs/WIRE.md); its errors name their completions.
          InflightCompletions& msg = in->second;
          bool overflow = false;
          for (const pb::RequestError& err : m.ack().errors()) {
            if (err.request_id().empty() && err.code() == kResourceExhausted) {
              // An older leapd's "N more per-request errors omitted": the
              // completions it did not name have an unknown outcome.
              overflow = true;
              continue;
            }
            ++msg.answered;
            if (msg.unnamed.erase(err.request_id()) == 0) continue;
            const std::string& id = err.request_id();
            auto it = live_.find(id);
            if (err.code() == kUnavailable && it != live_.end() &&
                it->second.completing) {
              // Refused for now, nothing recorded (a fleet member without
              // NATS, the feedback log not written, leapd recovering): kept,
              // and resent after a backoff (no event).
              ScheduleRetry(id, &it->second);
              continue;
            }
            if (it != live_.end()) erase(it);
            ++stats_.errors;
            events.push_back(ErrorEvent(id, err.code(), err.message()));
          }
          msg.answered += m.ack().accepted() + m.ack().skipped();
          if (overflow) {
            RetryUnnamed(&msg);
          } else if (msg.answered >= static_cast<int64_t>(msg.ids.size())) {
            // The whole answer is in: the rest was acknowledged.
            for (const std::string& id : msg.unnamed) {
              if (auto it = live_.find(id); it != live_.end()) erase(it);
            }
          } else {
            break;  // more parts to come
          }
          inflight_.erase(in);
          break;
        }
        case pb::SidecarMessage::kRescore:
          for (const auto& p : m.rescore().predictions()) {
            ++stats_.rescores;
            events.push_back(PredictionEvent(Event::Kind::kRescore, p));
          }
          break;
        case pb::SidecarMessage::kPriors:
          prior_inflight_.erase(m.seq());
          for (const auto& p : m.priors().priors()) {
            if (!p.available()) {
              ++stats_.priors_unavailable;
              continue;
            }
            ++stats_.priors;
            Event e;
            e.kind = Event::Kind::kPrior;
            e.request_id = p.request_id();
            e.predicted_tokens = p.predicted_tokens();
            events.push_back(std::move(e));
          }
          for (const auto& err : m.priors().errors()) {
            ++stats_.errors;
            events.push_back(
                ErrorEvent(err.request_id(), err.code(), err.message()));
          }
          break;
        case pb::SidecarMessage::kError:
          if (auto q = prior_inflight_.find(m.seq());
              q != prior_inflight_.end()) {
            stats_.priors_dropped += q->second;
            prior_inflight_.erase(q);
            if (m.error().code() == kInvalidArgument) {
              // A leapd older than priors cannot parse the query ("empty
              // engine message"): no prior on this connection (fail-open,
              // no error event).
              priors_unsupported_ = true;
              stats_.priors_unsupported = true;
              stats_.priors_dropped += static_cast<int64_t>(priors_out_.size());
              priors_out_.clear();
              break;
            }
          }
          if (auto in = inflight_.find(m.seq()); in != inflight_.end()) {
            // A completions message refused whole (no Ack will come):
            // nothing of it was recorded. Its completions are kept and
            // resent after a backoff.
            RetryUnnamed(&in->second);
            inflight_.erase(in);
          }
          ++stats_.errors;
          events.push_back(
              ErrorEvent("", m.error().code(), m.error().message()));
          break;
        default:
          break;
      }
    }
    for (auto& e : events) Emit(std::move(e));
  }
  absl::MutexLock lock(&mu_);
  if (generation == generation_ && !broken_) {  // (keep a stall's reason)
    MarkBroken(SessionEndReason(acked_hello_));
  }
}

const char* Client::SessionEndReason(bool acked_hello) {
  return acked_hello ? "the connection to leapd ended"
                     : "leapd did not acknowledge the hello";
}

void Client::MarkBroken(std::string reason) {
  broken_ = true;
  degraded_reason_ = std::move(reason);
  // Degraded from this moment (degraded(), stats(): no leapd answers), not
  // only once the manager has noticed the end of the session; the manager
  // still reports the disconnect (it pairs with the hello's ack).
  connected_.store(false);
}

// One connection's life: hello, resubmission, then shipping the outbox.
// Returns when the connection breaks or the client stops.
void Client::Session(Transport* t) {
  pb::EngineMessage hello;
  hello.set_seq(0);
  auto* h = hello.mutable_hello();
  h->set_engine_id(options_.engine_id);
  h->set_instance_id(options_.instance_id);
  h->set_model_id(options_.model_id);
  h->set_layer(options_.layer);
  h->set_dim(options_.dim);
  h->set_dtype(static_cast<pb::FeatureDType>(options_.dtype));
  if (!t->Send(hello)) return;
  {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return acked_hello_ || broken_ || stop_;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ready), options_.connect_timeout) ||
        !acked_hello_) {
      return;
    }
    // Rebuild the outbox: the cancels still to send (a request submitted
    // again under a cancelled id must come after its cancel), features of
    // every live request this sidecar does not hold, then every completion
    // not acknowledged (each in the order the engine gave them).
    std::deque<Outgoing> rebuilt;
    for (const Outgoing& o : outbox_) {
      if (o.kind == Outgoing::Kind::kCancel) rebuilt.push_back(o);
    }
    std::vector<std::pair<uint64_t, const std::string*>> order;
    for (auto& [id, live] : live_) {
      if (live.held_by != sidecar_id_) {
        order.emplace_back(live.submitted_at, &id);
        if (!live.held_by.empty()) ++stats_.resubmitted;
      }
    }
    std::sort(order.begin(), order.end());
    for (const auto& [at, id] : order) {
      rebuilt.push_back({Outgoing::Kind::kFeatures, *id});
    }
    order.clear();
    for (auto& [id, live] : live_) {
      if (live.completing) order.emplace_back(live.completed_at, &id);
    }
    std::sort(order.begin(), order.end());
    for (const auto& [at, id] : order) {
      rebuilt.push_back({Outgoing::Kind::kCompletion, *id});
    }
    retries_.clear();  // resent now, with every other completion
    outbox_.swap(rebuilt);
    inflight_.clear();
    ++stats_.connects;
    // Under mu_, so WaitConnected (a condition on mu_) sees it; not for a
    // session that already ended (MarkBroken) or is stopping.
    if (!broken_ && !stop_) connected_.store(true);
  }
  uint64_t seq = 1;
  for (;;) {
    pb::EngineMessage priors, features, completions, cancels;
    std::vector<std::string> completing;
    std::vector<Event> refused;  // emitted once mu_ is released
    // Feature records and the bytes to copy into them once mu_ is released.
    std::vector<std::pair<pb::FeatureRecord*, std::shared_ptr<const std::string>>>
        fills;
    {
      absl::MutexLock lock(&mu_);
      // Wakes for work, and at the time of the earliest completion resend
      // (re-armed when an earlier one is scheduled meanwhile).
      absl::Time armed = absl::InfiniteFuture();
      auto ready = [this, &armed]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || broken_ || !outbox_.empty() || !priors_out_.empty() ||
               (!retries_.empty() && retries_.begin()->first < armed);
      };
      for (;;) {
        armed = retries_.empty() ? absl::InfiniteFuture() : retries_.begin()->first;
        mu_.AwaitWithDeadline(absl::Condition(&ready), armed);
        if (stop_ || broken_) return;
        const absl::Time now = absl::Now();
        while (!retries_.empty() && retries_.begin()->first <= now) {
          auto r = retries_.extract(retries_.begin());
          auto it = live_.find(r.value().second);
          if (it != live_.end() && it->second.completing) {
            outbox_.push_back({Outgoing::Kind::kCompletion, it->first});
          }
        }
        if (!outbox_.empty() || !priors_out_.empty()) break;
      }
      // Prior queries first: they order admission, which comes before
      // everything else a request does.
      size_t prior_bytes = 0;
      while (!priors_out_.empty() &&
             priors.prior_queries().records_size() < options_.max_batch_records) {
        const size_t add = priors_out_.front().request_id.size() +
                           priors_out_.front().product_line.size() + kRecordOverhead;
        if (prior_bytes > 0 && prior_bytes + add > kMaxMessageBytes) break;
        prior_bytes += add;
        Arrival a = std::move(priors_out_.front());
        priors_out_.pop_front();
        auto* r = priors.mutable_prior_queries()->add_records();
        r->set_request_id(std::move(a.request_id));
        r->set_product_line(std::move(a.product_line));
        r->set_prompt_tokens(a.prompt_tokens);
        r->mutable_decoding()->set_max_tokens(a.max_tokens);
      }
      if (priors.has_prior_queries()) {
        priors.set_seq(seq++);
        prior_inflight_[priors.seq()] = priors.prior_queries().records_size();
        NoteSent(priors.seq());
      }
      // Each message holds at most max_batch_records records and
      // kMaxMessageBytes bytes; the features message at most leapd's
      // max_batch_bytes of features (HelloAck) too. What would outgrow its
      // message waits for the next one.
      const size_t feature_cap =
          max_batch_bytes_ > 0
              ? std::min(kMaxMessageBytes, static_cast<size_t>(max_batch_bytes_))
              : kMaxMessageBytes;
      size_t feature_bytes = 0;
      size_t message_bytes[3] = {0, 0, 0};  // by Outgoing::Kind
      // The requests of this features message (views into its records).
      absl::flat_hash_set<absl::string_view> featured;
      bool held_back = false;  // a completion waits for the next message
      while (!held_back && !outbox_.empty() &&
             features.features().records_size() < options_.max_batch_records &&
             completions.completions().completions_size() <
                 options_.max_batch_records) {
        {
          const Outgoing& next = outbox_.front();
          auto it = live_.find(next.request_id);
          const bool has_features =
              next.kind == Outgoing::Kind::kFeatures && it != live_.end();
          const size_t payload = has_features ? it->second.bytes->size() : 0;
          const size_t add =
              next.request_id.size() + kRecordOverhead + payload +
              (has_features ? it->second.features.product_line.size() : 0);
          size_t& used = message_bytes[static_cast<int>(next.kind)];
          if (used > 0 && (used + add > kMaxMessageBytes ||
                           feature_bytes + payload > feature_cap)) {
            break;
          }
          if (payload <= feature_cap) {  // (else refused below)
            used += add;
            feature_bytes += payload;
          }
        }
        Outgoing o = std::move(outbox_.front());
        outbox_.pop_front();
        auto it = live_.find(o.request_id);
        switch (o.kind) {
          case Outgoing::Kind::kFeatures: {
            if (it == live_.end()) break;  // cancelled meanwhile
            const size_t size = it->second.bytes->size();
            if (size > feature_cap) {
              // Alone over leapd's max_batch_bytes (or the 16 MiB message
              // limit): no message can carry it. Refused here, dropped.
              ++stats_.errors;
              refused.push_back(ErrorEvent(
                  o.request_id, kResourceExhausted,
                  feature_cap < kMaxMessageBytes
                      ? absl::StrCat("features of ", size,
                                     " bytes exceed leapd's max_batch_bytes (",
                                     feature_cap, ")")
                      : absl::StrCat("features of ", size,
                                     " bytes exceed the client's message limit (",
                                     feature_cap, " bytes)")));
              live_.erase(it);
              break;
            }
            ++it->second.sends;
            auto* r = features.mutable_features()->add_records();
            r->set_request_id(o.request_id);
            r->set_product_line(it->second.features.product_line);
            fills.emplace_back(r, it->second.bytes);  // copied unlocked
            featured.insert(r->request_id());
            r->mutable_decoding()->set_max_tokens(it->second.features.max_tokens);
            break;
          }
          case Outgoing::Kind::kCompletion: {
            // Gone, or a newer request under the id (Complete, Cancel and
            // Submit again before this ran): not this completion's.
            if (it == live_.end() || !it->second.completing) break;
            if (featured.contains(o.request_id)) {
              // Its features are in this message, which goes after the
              // completions: the completion waits for the next message.
              outbox_.push_front(std::move(o));
              held_back = true;
              break;
            }
            auto* c = completions.mutable_completions()->add_completions();
            c->set_request_id(o.request_id);
            c->set_output_tokens(it->second.output_tokens);
            c->set_reason(static_cast<pb::FinishReason>(it->second.reason));
            if (it->second.prompt_tokens > 0) {
              c->set_prompt_tokens(it->second.prompt_tokens);
            }
            completing.push_back(o.request_id);
            break;
          }
          case Outgoing::Kind::kCancel:
            cancels.mutable_cancels()->add_request_ids(o.request_id);
            break;
        }
      }
      // Completions and cancels go before features, so that over shm the
      // slots they free come back before new requests need them. A
      // completion of a request whose features are in this message waited
      // above for the next one; a cancel always comes first (Cancel forgets
      // the request, so features under its id are a newer request's).
      completions.set_seq(seq++);
      cancels.set_seq(seq++);
      features.set_seq(seq++);
      if (!completing.empty()) {
        InflightCompletions& in = inflight_[completions.seq()];
        in.unnamed.insert(completing.begin(), completing.end());
        in.ids = std::move(completing);
      }
      if (features.has_features()) NoteSent(features.seq());
      if (completions.has_completions()) NoteSent(completions.seq());
      if (cancels.has_cancels()) NoteSent(cancels.seq());
    }
    for (auto& [record, bytes] : fills) record->set_features(*bytes);
    fills.clear();
    for (auto& e : refused) Emit(std::move(e));
    if (priors.has_prior_queries() && !t->Send(priors)) return;
    if (completions.has_completions() && !t->Send(completions)) return;
    if (cancels.has_cancels() && !t->Send(cancels)) return;
    if (features.has_features() && !t->Send(features)) return;
  }
}

void Client::ManagerLoop() {
  std::mt19937_64 rng(std::random_device{}());
  absl::Duration backoff = options_.min_backoff;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    absl::StatusOr<std::unique_ptr<Transport>> t =
        Dial(options_.endpoint, options_.connect_timeout,
             TransportOptions{options_.shm_slots, options_.shm_ring_bytes,
                              options_.tls_ca_file, options_.tls_cert_file,
                              options_.tls_key_file});
    bool had_session = false;
    if (!t.ok()) {
      absl::MutexLock lock(&mu_);
      degraded_reason_ = std::string(t.status().message());
    } else {
      uint64_t generation;
      {
        absl::MutexLock lock(&mu_);
        generation = ++generation_;
        broken_ = false;
        acked_hello_ = false;
        current_ = t->get();
        unanswered_.clear();
        if (stop_) current_->Close();
      }
      Transport* raw = t->get();
      std::thread reader([this, raw, generation] { ReaderLoop(raw, generation); });
      Session(raw);
      std::string reason;
      {
        absl::MutexLock lock(&mu_);
        // The reader emitted kConnected exactly when it took the hello's
        // ack (for this generation; it is reset only here).
        had_session = acked_hello_;
        // Not ended by the reader or the watchdog (which marked it with
        // their reason): the hello went unanswered, a send failed, or stop.
        if (!broken_) MarkBroken(SessionEndReason(had_session));
        acked_hello_ = false;
        ++generation_;  // the reader's late messages are ignored
        // Completions in flight lose their ack: resend them next time.
        inflight_.clear();
        // Prior queries are not: a late prior is worth nothing.
        stats_.priors_dropped += static_cast<int64_t>(priors_out_.size());
        for (const auto& [seq, n] : prior_inflight_) stats_.priors_dropped += n;
        priors_out_.clear();
        prior_inflight_.clear();
        priors_unsupported_ = false;
        stats_.priors_unsupported = false;
        current_ = nullptr;
        reason = degraded_reason_;
      }
      raw->Close();
      // After the reader's last events (its kConnected among them: it
      // emits them once it has released mu_).
      reader.join();
      if (had_session) {
        Event e;
        e.kind = Event::Kind::kDisconnected;
        e.message = reason;
        Emit(std::move(e));
      }
    }
    if (had_session) backoff = options_.min_backoff;
    // Wait out the backoff (with jitter), waking early on stop.
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    const absl::Duration wait = backoff * jitter(rng);
    backoff = std::min(backoff * 2, options_.max_backoff);
    absl::MutexLock lock(&mu_);
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    mu_.AwaitWithTimeout(absl::Condition(&stopping), wait);
  }
}

}  // namespace leap::shim
