// The engine's client of leapd. Thread-safe; no call blocks the caller:
// submissions queue up and a background thread ships them, keeps the
// connection alive (reconnecting with backoff), and after a sidecar restart
// resubmits the features of every live request and resends unacknowledged
// completions (the sidecar recognises duplicates). Predictions and rescores
// arrive through Poll() or a callback.
#ifndef LEAP_ENGINE_SHIM_CLIENT_H_
#define LEAP_ENGINE_SHIM_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/wire.h"
#include "engine_shim/internal/transport.h"

namespace leap::shim {

// Fail-open: the engine never waits for leapd. Submit, Complete, Cancel,
// Poll, stats() and the destructor return at once (bounded by the current
// Dial's connect_timeout for the destructor) whether leapd is up, dead or
// hung; a leapd that leaves a message unanswered for response_timeout
// (answering nothing sent before it meanwhile) is treated as gone (the connection is abandoned, the
// client reconnects with backoff and resubmits). While no leapd answers the
// client is degraded (degraded(), ClientStats::degraded, a kDisconnected
// event with the reason): requests get no prediction, and the scheduler
// places them by arrival (CountdownScheduler, UnpredictedPolicy). Once a
// leapd answers again, predictions resume by themselves.
//
// Element type of the features an engine ships and how a request ended
// (common/wire.h). kStop is learned, kLength only when it reached the
// budget, kCancelled and kAborted never.
using ::leap::DType;
using ::leap::DTypeSize;
using ::leap::FinishReason;

// The captured hidden state of one request, ready to ship.
struct CapturedFeatures {
  std::string request_id;
  std::string product_line;
  // dim values of the client's dtype, little-endian, contiguous.
  std::string bytes;
  // The request's own output cap (0 = none).
  int64_t max_tokens = 0;
};

// What the engine knows about a request at arrival, before its prefill: the
// question RequestPriors asks leapd (docs/WIRE.md, "Length prior").
struct Arrival {
  std::string request_id;
  std::string product_line;
  // Prompt length in tokens (>= 1).
  int64_t prompt_tokens = 0;
  // The request's own output cap (0 = none).
  int64_t max_tokens = 0;
};

struct ClientOptions {
  // "host:port" or "unix:///path" (gRPC), or "shm:///path" (shared memory
  // with a leapd in the same pod; /path is its --shm socket).
  // Default: 127.0.0.1:7070
  std::string endpoint = "127.0.0.1:7070";
  // Identity for leapd's logs and metrics (e.g. the pod name). At most
  // kMaxIdBytes (256) bytes, as model_id.
  std::string engine_id;
  // This engine's instance id (Hello.instance_id): leapd scopes request ids
  // to it, so engines that number requests alike never collide. Kept for
  // the Client's life (reconnects find their requests again). Default: a
  // random 128-bit hex id made by Start. At most 128 bytes, no NUL.
  std::string instance_id;
  // The serving model (Hello.model_id), checked against the readouts' own.
  // At most kMaxIdBytes (256) bytes.
  std::string model_id;
  int32_t layer = -1;
  // Feature width and dtype of every submission. Required.
  int64_t dim = 0;
  DType dtype = DType::kFloat32;
  // Reconnect backoff: doubles from min to max, each wait drawn in
  // [half, all] of it. The same schedule, per completion, spaces the resends
  // of a completion leapd refused UNAVAILABLE (see Complete). Default:
  // 50 ms, 5 s
  absl::Duration min_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(5);
  absl::Duration connect_timeout = absl::Seconds(1);
  // A connection on which a message waited this long for its answer, with
  // no answer to an earlier message meanwhile, is abandoned as hung (e.g.
  // leapd SIGSTOPped or wedged): the client reconnects and reports
  // degraded. Every message awaiting its answer is watched (the oldest
  // first), also a completions Ack that comes after the answers to later
  // messages (fleet mode on shm). Keep it above the longest a healthy leapd
  // may take: in fleet mode a completions answer waits for JetStream's
  // acknowledgement, up to leapd's NATS publish timeout (2 s), so the
  // default leaves 3 s beyond that. Default: 5 s
  absl::Duration response_timeout = absl::Seconds(5);
  // shm only: feature slots (each live request holds one until it ends),
  // in [1, 1048576], and ring bytes, a power of two in [64 KiB, 64 MiB].
  // A request submitted while every slot is held gets a RESOURCE_EXHAUSTED
  // error event of its own; the client waits for a slot (up to
  // connect_timeout) only while a completion or cancel it sent is owed one
  // (docs/WIRE.md, "Slots"). Default: 1024, 1 MiB
  uint32_t shm_slots = 1024;
  uint32_t shm_ring_bytes = 1 << 20;
  // Records per FeatureBatch message. Default: 256
  int max_batch_records = 256;
  // Live requests kept for resubmission; submissions beyond are refused
  // with an error event. Default: 65536
  int64_t max_live_requests = 65536;
  // gRPC over TCP with TLS (leapd --tls_cert): PEM file of the CA that
  // signed leapd's certificate; for mutual TLS (leapd --tls_client_ca) also
  // this engine's certificate chain and key. All empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;

  absl::Status Validate() const;
};

// Something the sidecar said, delivered asynchronously.
struct Event {
  // kDisconnected: the client's session ended, it is degraded (message:
  // why; degraded() turns true as soon as the connection is found gone,
  // before this event is delivered); kConnected: leapd acknowledged the
  // hello (message: the sidecar id; degraded() turns false once the session
  // is set up, right after). Each kConnected is followed by one
  // kDisconnected when that session ends. kPrior: the length
  // prior asked by RequestPriors (predicted_tokens; hand it to
  // CountdownScheduler::SetPrior).
  enum class Kind {
    kPrediction,
    kRescore,
    kError,
    kConnected,
    kDisconnected,
    kPrior
  };
  Kind kind = Kind::kPrediction;
  std::string request_id;
  // kPrediction / kRescore.
  double predicted_tokens = 0;
  double score = 0;
  std::string readout;
  int64_t version = 0;
  // kError: google.rpc code and message. kConnected: the sidecar id.
  // A submission that leapd refuses because the id is already live for this
  // engine instance (another request of this instance, or of an engine with
  // the same instance id) is a kError with code 6 (ALREADY_EXISTS), and the
  // request is dropped from the client; a resubmission after a reconnect
  // that leapd already holds is not an error (it is kept, no event).
  int32_t code = 0;
  std::string message;
};

struct ClientStats {
  int64_t connects = 0;
  int64_t resubmitted = 0;   // features resent after a sidecar restart
  int64_t predictions = 0;
  // Cold predictions (a bootstrapping readout, Prediction.cold): not
  // delivered as events, the request stays unpredicted (first-come order).
  int64_t cold = 0;
  int64_t rescores = 0;
  int64_t errors = 0;
  int64_t live = 0;          // requests kept for resubmission
  int64_t stalls = 0;        // connections abandoned as hung (response_timeout)
  // Completions leapd refused UNAVAILABLE (fleet member without NATS,
  // feedback log not written, leapd recovering): each refusal schedules a
  // resend after a backoff; no event (see Client::Complete).
  int64_t completion_retries = 0;
  // Length priors (RequestPriors): received (kPrior events), answered as
  // not available yet (the product line has not learned enough; no event),
  // dropped unasked (no leapd answering, or one that does not serve priors:
  // fail-open, no event).
  int64_t priors = 0;
  int64_t priors_unavailable = 0;
  int64_t priors_dropped = 0;
  // The connected leapd answered a prior query with "empty engine message"
  // (older than priors): no more are sent until the next connection.
  bool priors_unsupported = false;
  bool degraded = true;      // no leapd answering now (see degraded())
  std::string degraded_reason;  // why, while degraded
};

// Threads: the engine's threads may call any public method; the manager
// thread (ManagerLoop: connects, ships the outbox) and a reader thread per
// connection (ReaderLoop) are the client's own, and emit the events. The destructor
// joins them and must not be called from a callback.
class Client {
 public:
  // Starts the background threads; connecting happens there.
  static absl::StatusOr<std::unique_ptr<Client>> Start(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Queues features of new requests. What leapd would refuse for its size
  // is refused here, as an error event for that request alone (never
  // thrown; the others go on): features not dim values of the dtype, and a
  // request id that is empty, holds a NUL or is longer than kMaxIdBytes
  // (256, common/ids.h), or a product line longer than that
  // (INVALID_ARGUMENT, leapd's words, naming the size, the limit and the
  // id's start). So no record can outgrow a shm frame or a gRPC message
  // (docs/WIRE.md, "Sizes"). Features alone larger than the connected
  // leapd's max_batch_bytes are refused when they would be sent
  // (RESOURCE_EXHAUSTED).
  void Submit(std::vector<CapturedFeatures> features);
  // Queues how a request ended. It stays known (for resending) until the
  // sidecar acknowledges it, it is cancelled, or the client is destroyed. A
  // completion refused UNAVAILABLE (code 14: a transient refusal, nothing
  // recorded) is resent by the client itself after a backoff (min_backoff
  // doubling to max_backoff per completion, jittered), on the same or the
  // next connection, with no event (ClientStats::completion_retries counts
  // the refusals); leapd recognises a duplicate, so it is learned once. Any
  // other refusal (e.g. INVALID_ARGUMENT) is a kError event and the request
  // is dropped. `prompt_tokens` (0 = not given; negative is
  // treated as 0) is the request's prompt length: sent with the completion,
  // it teaches leapd's length prior of the request's product line.
  void Complete(const std::string& request_id, int64_t output_tokens,
                FinishReason reason, int64_t prompt_tokens = 0);
  // Drops a request (no learning).
  void Cancel(const std::string& request_id);
  // Asks leapd for the length prior of requests that just arrived (before
  // prefill). Each available prior comes back as a kPrior event; a query
  // leapd refuses is a kError event (INVALID_ARGUMENT naming the field); one
  // whose ids leapd would refuse (as Submit's) is refused here at once, the
  // same way, whether connected or not.
  // Fail-open: while degraded, or connected to a leapd that does not serve
  // priors, the queries are dropped at once (ClientStats::priors_dropped)
  // and no event comes: the scheduler keeps first-come placement. Queries
  // not yet answered when the connection ends are dropped too (never
  // resent: a late prior is worth nothing once prefill ran).
  void RequestPriors(std::vector<Arrival> arrivals);

  // Takes up to `max` queued events (when no callback is set).
  std::vector<Event> Poll(size_t max = SIZE_MAX);
  // Delivers events to `cb` instead of the queue. The events queued before
  // the call (e.g. kConnected, when the hello was answered before it, or an
  // error of an earlier Submit) go to `cb` first, in order, on the calling
  // thread, before SetCallback returns; later ones on the client's threads
  // (or, for Submit's refusals, on the thread that called Submit), one at a
  // time, in order. So a callback set right after Start misses nothing.
  // `cb` must not block, and may call Submit, Complete and Cancel (an event
  // that causes is delivered right after `cb` returns) but not Poll or
  // SetCallback. Pass nullptr to go back to Poll: later events are queued.
  void SetCallback(std::function<void(const Event&)> cb);

  // The instance id in every Hello: ClientOptions::instance_id, or the one
  // Start made up when it was empty.
  const std::string& instance_id() const { return options_.instance_id; }
  bool connected() const { return connected_.load(); }
  // True while no leapd is answering: before the first hello is
  // acknowledged, after a disconnect or a stall, until the next
  // acknowledged hello. Never blocks.
  bool degraded() const { return !connected_.load(); }
  // Blocks until connected() is true on a live connection (the hello
  // acknowledged and the session's resends queued), or the timeout (tests
  // and startup checks only).
  bool WaitConnected(absl::Duration timeout);
  // Counters since Start.
  ClientStats stats() const;

 private:
  explicit Client(ClientOptions options) : options_(std::move(options)) {}
  struct Live {
    CapturedFeatures features;  // its bytes moved to `bytes`
    // The feature bytes, shared with the message being built: the manager
    // copies them into it after releasing mu_, so a step-loop call never
    // waits for a batch's copy.
    std::shared_ptr<const std::string> bytes;
    std::string held_by;  // sidecar id that holds its features
    int sends = 0;        // times its features were sent
    bool completing = false;
    int64_t output_tokens = 0;
    int64_t prompt_tokens = 0;
    FinishReason reason = FinishReason::kStop;
    // Completions refused UNAVAILABLE in a row (their resend backoff).
    int refusals = 0;
    // Order of Submit and of Complete calls: a reconnect resends features
    // and completions in the order the engine gave them.
    uint64_t submitted_at = 0;
    uint64_t completed_at = 0;
  };
  uint64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
  // Prior queries waiting to be sent on this connection.
  std::deque<Arrival> priors_out_ ABSL_GUARDED_BY(mu_);
  // Sequence numbers of prior queries in flight on this connection.
  std::map<uint64_t, int> prior_inflight_ ABSL_GUARDED_BY(mu_);
  bool priors_unsupported_ ABSL_GUARDED_BY(mu_) = false;
  struct Outgoing {
    enum class Kind { kFeatures, kCompletion, kCancel } kind;
    std::string request_id;
  };
  void ManagerLoop();
  // Abandons connections on which leapd stopped answering.
  void WatchdogLoop();
  // Before sending a message with sequence number `seq` that leapd answers.
  void NoteSent(uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteAnswered(uint64_t seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A completion refused UNAVAILABLE: schedules its resend (retries_).
  void ScheduleRetry(const std::string& request_id, Live* live)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReaderLoop(Transport* t, uint64_t generation);
  // The current connection is done for (its reader saw it end, or the
  // watchdog abandoned it): the session stops, and the client is degraded
  // from here on, not only once the manager has cleaned up after it.
  void MarkBroken(std::string reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The degraded reason of a session that ended without a stall.
  static const char* SessionEndReason(bool acked_hello);
  // Called without mu_: the callback may call Submit, Complete, Cancel
  // (an event Submit emits from inside the callback is delivered right
  // after the callback returns).
  void Emit(Event e) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs the callback on `e`, then on the events it emitted itself.
  void Deliver(const Event& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(events_mu_);
  // One connection's life; returns when it breaks or the client stops.
  void Session(Transport* t);

  const ClientOptions options_;
  std::atomic<bool> connected_{false};

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<std::string, Live> live_ ABSL_GUARDED_BY(mu_);
  std::deque<Outgoing> outbox_ ABSL_GUARDED_BY(mu_);
  // A completions message in flight on this connection. Its answer may come
  // in several Ack parts with its seq (shm: an Ack larger than a frame,
  // docs/WIRE.md); it is complete once accepted + skipped + errors over the
  // parts reach ids.size(). Only then are the completions no error named
  // taken as acknowledged.
  struct InflightCompletions {
    std::vector<std::string> ids;
    // Ids no error of the answer named yet.
    absl::flat_hash_set<std::string> unnamed;
    // Completions answered by the parts so far.
    int64_t answered = 0;
  };
  // Completion messages in flight on this connection, by seq.
  std::map<uint64_t, InflightCompletions> inflight_ ABSL_GUARDED_BY(mu_);
  // Resends (after a backoff) every completion of `in` that no answer
  // named: its outcome is unknown (an answer that does not say).
  void RetryUnnamed(InflightCompletions* in) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completions refused UNAVAILABLE, by the time they are resent (moved to
  // the outbox by Session; a reconnect resends them at once).
  std::set<std::pair<absl::Time, std::string>> retries_ ABSL_GUARDED_BY(mu_);
  std::mt19937_64 retry_rng_ ABSL_GUARDED_BY(mu_){std::random_device{}()};
  std::string sidecar_id_ ABSL_GUARDED_BY(mu_);
  // The connected leapd's largest feature payload per message (HelloAck;
  // 0: it said none).
  int64_t max_batch_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool acked_hello_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  ClientStats stats_ ABSL_GUARDED_BY(mu_);
  // The connection the manager uses now (closed by the watchdog on a stall
  // and by the destructor), and answer tracking on it: every message sent
  // and not answered yet, by seq, with the time leapd's silence on it is
  // counted from (its send; for the oldest, the later of that and the last
  // answer to an earlier message). The watchdog watches the oldest.
  Transport* current_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<uint64_t, absl::Time> unanswered_ ABSL_GUARDED_BY(mu_);
  std::string degraded_reason_ ABSL_GUARDED_BY(mu_) = "not connected yet";

  absl::Mutex events_mu_;  // never held with mu_
  std::deque<Event> events_ ABSL_GUARDED_BY(events_mu_);
  std::function<void(const Event&)> callback_ ABSL_GUARDED_BY(events_mu_);
  // Events emitted by the callback itself, delivered after it returns.
  std::deque<Event> nested_ ABSL_GUARDED_BY(events_mu_);

  std::thread manager_;
  std::thread watchdog_;
};

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_CLIENT_H_
