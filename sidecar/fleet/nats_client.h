// A small RAII layer over the NATS C client (nats.c 3.4) for fleet mode:
// one connection to a list of servers that reconnects forever, its JetStream
// context, idempotent creation of the fleet's streams and key-value buckets,
// synchronous publishes with a message id, ordered-consumer subscriptions,
// and KV watchers. Every failure comes back as an absl::Status that names
// the operation, the subject/stream/key and NATS' own text.
//
// Also the fleet's naming: stream, subject and bucket names derived from the
// fleet name (proto/leap/v1/fleet.proto, docs/FLEET.md).
#ifndef LEAP_SIDECAR_FLEET_NATS_CLIENT_H_
#define LEAP_SIDECAR_FLEET_NATS_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

// nats.c types, declared here so that users of this header need not include
// <nats/nats.h> (they may, for the raw handles).
struct __natsConnection;
struct __natsOptions;
struct __natsSubscription;
struct __natsMsg;
struct __jsCtx;
struct __kvStore;
struct jsPubAck;
struct jsPubAckErr;

namespace leap::fleet {

// ---------------------------------------------------------------- naming
// Fleet names: [A-Za-z0-9_-]{1,32}.
absl::Status ValidateFleetName(absl::string_view fleet);
// Member ids: [A-Za-z0-9_.-]{1,64} (a host name fits).
absl::Status ValidateMemberId(absl::string_view member);

// One token of a subject or KV key for a readout name, snapshot label or
// product line: the name itself when it only holds [A-Za-z0-9_-] (and is
// not empty), else "=" followed by the lowercase hex of its bytes (readout
// names may hold '.', which separates subject tokens; the default product
// line is ""). Readout names and labels never contain '=', so the two
// forms cannot collide.
std::string NameToken(absl::string_view name);
// The inverse; InvalidArgument for something NameToken never produces.
absl::StatusOr<std::string> NameFromToken(absl::string_view token);

// Streams and buckets.
std::string FeedbackStream(absl::string_view fleet);  // LEAP_<fleet>_FEEDBACK
std::string VersionsStream(absl::string_view fleet);  // LEAP_<fleet>_VERSIONS
std::string StateStream(absl::string_view fleet);     // LEAP_<fleet>_STATE
std::string ConfigBucket(absl::string_view fleet);    // LEAP_<fleet>_CONFIG
std::string LeaseBucket(absl::string_view fleet);     // LEAP_<fleet>_LEASE
// Subjects of one readout (readout passed as its name, tokenized here).
// Completions and control operations of a readout share the prefix
// leap.<fleet>.fb.<readout>: completions on .c, control operations on
// .ctl, so that one consumer filter (ReadoutFeedbackSubjects) reads both in
// stream order (nats-server 2.9 takes one filter subject per consumer).
std::string FeedbackSubject(absl::string_view fleet, absl::string_view readout);
std::string ControlSubject(absl::string_view fleet, absl::string_view readout);
// leap.<fleet>.fb.<readout>.> : a readout's completions and control ops.
std::string ReadoutFeedbackSubjects(absl::string_view fleet,
                                    absl::string_view readout);
std::string VersionSubject(absl::string_view fleet, absl::string_view readout);
std::string CheckpointSubject(absl::string_view fleet,
                              absl::string_view readout);
std::string SnapshotSubject(absl::string_view fleet, absl::string_view readout,
                            absl::string_view label);
// Wildcards of all readouts: leap.<fleet>.fb.> (completions and control
// operations: the FEEDBACK stream's one subject), leap.<fleet>.fb.*.ctl
// (control operations only), .ver.>, .ckpt.>, .snap.>
std::string FeedbackSubjects(absl::string_view fleet);
std::string ControlSubjects(absl::string_view fleet);
std::string VersionSubjects(absl::string_view fleet);
std::string CheckpointSubjects(absl::string_view fleet);
std::string SnapshotSubjects(absl::string_view fleet);
// The readout name of a fb/ctl/ver/ckpt subject of this fleet;
// InvalidArgument for another subject.
absl::StatusOr<std::string> ReadoutOfSubject(absl::string_view fleet,
                                             absl::string_view subject);
// CONFIG keys: readout.<token>, route.<token of the product line>.
std::string ReadoutConfigKey(absl::string_view readout);
std::string RouteConfigKey(absl::string_view product_line);
inline constexpr char kTrainerKey[] = "trainer";

// ---------------------------------------------------------------- status
// A nats.c status (and JetStream error code, 0 when none) as an
// absl::Status: "<what>: <nats text>[ (jetstream error N)]". Connection
// problems → UNAVAILABLE, timeouts → DEADLINE_EXCEEDED, not found →
// NOT_FOUND, wrong expected sequence → FAILED_PRECONDITION, KV key exists →
// ALREADY_EXISTS, bad arguments → INVALID_ARGUMENT, others → INTERNAL.
absl::Status NatsError(int nats_status, int js_error_code,
                       absl::string_view what);

// ---------------------------------------------------------------- client
struct NatsClientOptions {
  // nats://host:port URLs (tls:// too); at least one.
  std::vector<std::string> servers;
  // Connection name shown by the server (the member id).
  std::string name;
  // Optional credentials (.creds file with JWT and seed) and TLS files.
  std::string creds_file;
  std::string tls_ca;    // CA bundle to verify the servers (turns TLS on)
  std::string tls_cert;  // client certificate (mutual TLS), with tls_key
  std::string tls_key;
  // Connect timeout, and default wait of JetStream API calls and publish
  // acknowledgements. Default: 2000 ms
  int64_t timeout_ms = 2000;
  // Pause between reconnect attempts (plus jitter). Default: 100 ms
  int64_t reconnect_wait_ms = 100;
  // Called on every connect/disconnect/reconnect (true = connected), from a
  // nats.c thread; must not block.
  std::function<void(bool connected)> on_connection_change;
};

// A message read from a stream (or delivered by a subscription).
struct StreamMsg {
  std::string subject;
  std::string data;
  uint64_t stream_seq = 0;  // 0 when not a JetStream message
  int64_t time_ns = 0;      // when the stream stored it (unix ns), 0 unknown
  std::string msg_id;       // the Nats-Msg-Id header, "" when none
  uint64_t pending = 0;     // messages left after it for this consumer
};

struct StreamSpec {
  std::string name;
  std::vector<std::string> subjects;
  int replicas = 1;
  // Messages kept per subject (0 = unlimited), e.g. 1 for the newest only.
  int64_t max_msgs_per_subject = 0;
  // Age limit (0 = none) and de-duplication window of message ids.
  int64_t max_age_ms = 0;
  int64_t duplicate_window_ms = 10 * 60 * 1000;
  int32_t max_msg_size = 0;  // 0 = the server's limit
};

// The fleet's three streams as created when absent (docs/FLEET.md):
// FEEDBACK (leap.<fleet>.fb.>, message-id de-duplication over
// `feedback_duplicate_window_ms`), VERSIONS (leap.<fleet>.ver.>, 10,000 kept
// per readout) and STATE (.ckpt.> and .snap.>, 1 min de-duplication), with
// `replicas` JetStream replicas.
std::vector<StreamSpec> FleetStreamSpecs(
    absl::string_view fleet, int replicas,
    int64_t feedback_duplicate_window_ms = 10 * 60 * 1000);

// Creates the stream on `js` (file storage) from `spec`; an existing stream
// of that name is used as it is (created by another member, or by an
// operator with other limits). The one place a jsStreamConfig is built.
absl::Status EnsureStream(__jsCtx* js, const StreamSpec& spec);

struct KvSpec {
  std::string bucket;
  int replicas = 1;
  int history = 1;
  int64_t ttl_ms = 0;  // 0 = keys never expire
};

struct PublishOptions {
  std::string msg_id;  // "" = no de-duplication
  // Fencing: refuse (FAILED_PRECONDITION) unless the last message on this
  // subject has this stream sequence (0 = a check that the subject is empty
  // only when expect_subject_empty).
  std::optional<uint64_t> expect_last_subject_seq;
  int64_t timeout_ms = 0;  // 0 = NatsClientOptions::timeout_ms
};

struct PublishResult {
  uint64_t seq = 0;
  // The message id was already in the stream's de-duplication window: not
  // stored again, seq is that of the first copy.
  bool duplicate = false;
};

struct SubscribeOptions {
  enum class Start { kAll, kNew, kLastPerSubject, kFromSeq };
  Start start = Start::kAll;
  uint64_t start_seq = 0;  // with kFromSeq
  // Bind to this stream (faster; else looked up from the subject).
  std::string stream;
};

// A subscription delivering to a callback on a nats.c thread, in stream
// order (an ordered consumer: it survives reconnects and re-creates itself
// past the last delivered sequence). Unsubscribes on destruction; the
// destructor waits until no callback is running.
class Subscription {
 public:
  ~Subscription();
  Subscription(const Subscription&) = delete;
  Subscription& operator=(const Subscription&) = delete;
  // Stops delivery at once (idempotent).
  void Stop();

 struct State;  // implementation detail

 private:
  friend class NatsClient;
  explicit Subscription(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

// One entry of a KV bucket (or a watcher's update).
struct KvEntry {
  std::string key;
  std::string value;
  uint64_t revision = 0;
  bool deleted = false;  // a delete or purge marker
};

class KvWatcher;

// A key-value bucket handle. Thread-safe.
class KvBucket {
 public:
  ~KvBucket();
  KvBucket(const KvBucket&) = delete;
  KvBucket& operator=(const KvBucket&) = delete;

  const std::string& name() const { return name_; }
  // NOT_FOUND when absent or deleted.
  absl::StatusOr<KvEntry> Get(const std::string& key);
  // Returns the new revision.
  absl::StatusOr<uint64_t> Put(const std::string& key, absl::string_view v);
  // Create-if-absent: ALREADY_EXISTS when the key holds a value.
  absl::StatusOr<uint64_t> Create(const std::string& key, absl::string_view v);
  // Compare-and-set: FAILED_PRECONDITION when the key's revision is not
  // `last_revision`.
  absl::StatusOr<uint64_t> Update(const std::string& key, absl::string_view v,
                                  uint64_t last_revision);
  absl::Status Delete(const std::string& key);
  // Watches `keys` (a key or a wildcard such as "readout.>"; "" = all):
  // first the current value of each key, then every change, in order, to
  // `callback` on a thread of the watcher. `on_initial_done` (optional) is
  // called once the initial values were delivered.
  absl::StatusOr<std::unique_ptr<KvWatcher>> Watch(
      const std::string& keys, std::function<void(const KvEntry&)> callback,
      std::function<void()> on_initial_done = nullptr);

  __kvStore* raw() const { return kv_; }

 private:
  friend class NatsClient;
  KvBucket(std::string name, __kvStore* kv, __natsConnection* nc, __jsCtx* js)
      : name_(std::move(name)), kv_(kv), nc_(nc), js_(js) {}
  const std::string name_;
  __kvStore* const kv_;
  __natsConnection* const nc_;  // the connection of kv_
  __jsCtx* const js_;           // its JetStream context (watchers)
};

// A bucket's watch on an ordered consumer of its own (not libnats's
// kvWatcher, whose stop deletes the consumer: see UnsubscribeAndDrain). Stop
// ends the subscription with UnsubscribeAndDrain; the destructor then joins
// the thread and only then frees the subscription (DestroySubscription), so
// libnats 3.4.1's reader thread cannot use it after it is freed. The thread
// passes nothing to the callback once it has seen the stop.
class KvWatcher {
 public:
  ~KvWatcher();
  KvWatcher(const KvWatcher&) = delete;
  KvWatcher& operator=(const KvWatcher&) = delete;
  void Stop();

 private:
  friend class KvBucket;
  KvWatcher() = default;
  __natsSubscription* sub_ = nullptr;
  __natsConnection* nc_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

// Thread-safe.
class NatsClient {
 public:
  // Connects (or keeps trying in the background when no server answers
  // yet: connected() is false until one does). Fails only for bad options
  // (unreadable creds/TLS files, bad URLs).
  static absl::StatusOr<std::unique_ptr<NatsClient>> Connect(
      NatsClientOptions options);
  ~NatsClient();
  NatsClient(const NatsClient&) = delete;
  NatsClient& operator=(const NatsClient&) = delete;

  bool connected() const { return connected_.load(); }
  // Closes the connection (no callback reaches the options' handler after
  // it; every later call fails). Idempotent; the destructor does it too.
  void Close();
  // Waits until connected; DEADLINE_EXCEEDED after timeout_ms.
  absl::Status WaitConnected(int64_t timeout_ms);
  // Times the connection was lost so far.
  int64_t disconnects() const { return disconnects_.load(); }
  const NatsClientOptions& options() const { return options_; }

  // leap::fleet::EnsureStream on this client's JetStream context.
  absl::Status EnsureStream(const StreamSpec& spec);
  absl::StatusOr<std::unique_ptr<KvBucket>> EnsureKv(const KvSpec& spec);

  // Synchronous JetStream publish: returns once the stream acknowledged it
  // (stored at its replication factor). UNAVAILABLE at once while
  // disconnected.
  absl::StatusOr<PublishResult> Publish(const std::string& subject,
                                        absl::string_view data,
                                        const PublishOptions& options = {});
  // Asynchronous JetStream publish (pipelined: many in flight on the
  // connection). `done` is called exactly once: with JetStream's
  // acknowledgement, or UNAVAILABLE when disconnected, not acknowledged
  // within the timeout, or the client is closed meanwhile; other errors as
  // Publish. It runs on a nats.c thread (or in this call when the publish
  // fails at once) and must not block.
  using PublishCallback = std::function<void(absl::StatusOr<PublishResult>)>;
  void PublishAsync(const std::string& subject, absl::string_view data,
                    const PublishOptions& options, PublishCallback done);
  // Asynchronous publishes not yet answered.
  int64_t async_in_flight() const;
  // Answers (acknowledgements or timeouts) that came while nats.c was still
  // writing their message (see NatsClient::Callbacks::AsyncPub; for tests).
  int64_t async_answered_while_publishing() const;

  // The newest message on `subject` in `stream` (NOT_FOUND when none).
  absl::StatusOr<StreamMsg> GetLastMsg(const std::string& stream,
                                       const std::string& subject);
  // The message with stream sequence `seq` (NOT_FOUND when none).
  absl::StatusOr<StreamMsg> GetMsg(const std::string& stream, uint64_t seq);
  // The subjects holding messages in `stream` that match `filter`
  // (wildcards allowed), with their message counts.
  absl::StatusOr<std::map<std::string, uint64_t>> Subjects(
      const std::string& stream, const std::string& filter);
  // The stream's last sequence (0 when empty).
  absl::StatusOr<uint64_t> LastSeq(const std::string& stream);

  // An ordered push consumer on `subject` (wildcards allowed).
  absl::StatusOr<std::unique_ptr<Subscription>> Subscribe(
      const std::string& subject, const SubscribeOptions& options,
      std::function<void(const StreamMsg&)> callback);

  // Raw handles for what this layer does not wrap.
  __natsConnection* raw_connection() const { return nc_; }
  __jsCtx* raw_jetstream() const { return js_; }

 private:
  NatsClient() = default;
  static void OnDisconnected(__natsConnection* nc, void* closure);
  static void OnReconnected(__natsConnection* nc, void* closure);
  static void OnClosed(__natsConnection* nc, void* closure);
  static void OnConnected(__natsConnection* nc, void* closure);
  static void OnAsyncAck(__jsCtx* js, __natsMsg* msg, ::jsPubAck* pa,
                         ::jsPubAckErr* pae, void* closure);
  void SetConnected(bool c);

  NatsClientOptions options_;
  __natsOptions* opts_ = nullptr;
  __natsConnection* nc_ = nullptr;
  __jsCtx* js_ = nullptr;
  // A second context for asynchronous publishes (its ack handler answers
  // them).
  __jsCtx* async_js_ = nullptr;
  std::atomic<bool> connected_{false};
  // What nats.c's connection callbacks reach: outlives this object when
  // nats.c has not delivered the closed callback by the end of the
  // destructor (then kept, reachable, for any late callback).
  struct Callbacks;
  Callbacks* callbacks_ = nullptr;
  std::atomic<bool> closed_once_{false};
  std::atomic<int64_t> disconnects_{0};
  absl::Mutex mu_;
  bool connected_cv_ ABSL_GUARDED_BY(mu_) = false;
};

// Converts one nats.c message (not consumed).
StreamMsg ToStreamMsg(__natsMsg* msg);

// Ends a subscription on `nc` so that it can be freed while messages may
// still arrive for it. libnats 3.4.1's reader thread looks a message's
// subscription up and then uses it without holding a reference, so
// natsSubscription_Destroy alone (unsubscribe and free at once) is a use
// after free in the reader. The UNSUB always goes first (whatever the
// connection's state: a reconnect can come at any time); then, when
// connected, a flush (at most 2 s) returns once the reader has handled all
// the server sent before its PONG, and after the UNSUB nothing more comes for
// `sub` — except for a JetStream subscription that never handed out a
// message: its UNSUB carries a limit of one (below), so it stays in the
// connection's table; DestroySubscription parks it. A JetStream consumer the library created is never deleted here
// (libnats 3.4.1's delete races with its own ordered-consumer recreation, a
// use after free; see the .cc): the server removes an ephemeral consumer
// without interest by itself, 5 s after its subscriber left.
void UnsubscribeAndDrain(__natsConnection* nc, __natsSubscription* sub);

// Frees a subscription after UnsubscribeAndDrain: at once when it has left
// the connection (it got any message, or the connection is closed); else (a
// JetStream subscription that never handed out a message stays in the
// connection's table with its limit of one) it is parked and freed when
// NatsClient::Close has closed the connection, since the reader may still
// look it up. A parked subscription holds at most the one message its limit
// lets through. Null `sub`: nothing.
void DestroySubscription(__natsConnection* nc, __natsSubscription* sub);

// Frees the subscriptions parked for `nc`; call only after
// natsConnection_Close(nc) (NatsClient::Close does).
void FreeParkedSubscriptions(__natsConnection* nc);

// How many subscriptions are parked for `nc` (tests).
int ParkedSubscriptions(__natsConnection* nc);

// UnsubscribeAndDrain, then DestroySubscription. Use it for every
// subscription that may still receive messages. Null `sub`: nothing.
void CloseSubscription(__natsConnection* nc, __natsSubscription* sub);

}  // namespace leap::fleet

#endif  // LEAP_SIDECAR_FLEET_NATS_CLIENT_H_
