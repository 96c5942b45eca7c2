#include "sidecar/fleet/nats_client.h"

#include <nats/nats.h>

#include <algorithm>
#include <cassert>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/thread.h"

namespace leap::fleet {
namespace {

bool IsPlainChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' ||
         c == '-';
}

std::string Prefix(absl::string_view fleet, absl::string_view kind) {
  return absl::StrCat("leap.", fleet, ".", kind, ".");
}

std::string NatsText(natsStatus s) {
  const char* last = nats_GetLastError(nullptr);
  std::string text = natsStatus_GetText(s);
  if (last != nullptr && last[0] != '\0' && text != last) {
    absl::StrAppend(&text, " (", last, ")");
  }
  return text;
}

}  // namespace

absl::Status ValidateFleetName(absl::string_view fleet) {
  if (fleet.empty() || fleet.size() > 32 ||
      !std::all_of(fleet.begin(), fleet.end(), IsPlainChar)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fleet name \"", absl::CHexEscape(fleet),
        "\" must be 1 to 32 characters of [A-Za-z0-9_-]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateMemberId(absl::string_view member) {
  if (member.empty() || member.size() > 64 ||
      !std::all_of(member.begin(), member.end(),
                   [](char c) { return IsPlainChar(c) || c == '.'; })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fleet member id \"", absl::CHexEscape(member),
        "\" must be 1 to 64 characters of [A-Za-z0-9_.-]"));
  }
  return absl::OkStatus();
}

std::string NameToken(absl::string_view name) {
  if (!name.empty() && std::all_of(name.begin(), name.end(), IsPlainChar)) {
    return std::string(name);
  }
  return absl::StrCat("=", absl::AsciiStrToLower(absl::BytesToHexString(name)));
}

absl::StatusOr<std::string> NameFromToken(absl::string_view token) {
  if (!token.empty() && token[0] == '=') {
    absl::string_view hex = token.substr(1);
    const bool ok = hex.size() % 2 == 0 &&
                    std::all_of(hex.begin(), hex.end(), [](char c) {
                      return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                    });
    if (ok) return absl::HexStringToBytes(hex);
  } else if (!token.empty() &&
             std::all_of(token.begin(), token.end(), IsPlainChar)) {
    return std::string(token);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("not a fleet name token: \"", absl::CHexEscape(token), "\""));
}

std::string FeedbackStream(absl::string_view fleet) {
  return absl::StrCat("LEAP_", fleet, "_FEEDBACK");
}
std::string VersionsStream(absl::string_view fleet) {
  return absl::StrCat("LEAP_", fleet, "_VERSIONS");
}
std::string StateStream(absl::string_view fleet) {
  return absl::StrCat("LEAP_", fleet, "_STATE");
}
std::string ConfigBucket(absl::string_view fleet) {
  return absl::StrCat("LEAP_", fleet, "_CONFIG");
}
std::string LeaseBucket(absl::string_view fleet) {
  return absl::StrCat("LEAP_", fleet, "_LEASE");
}
std::string FeedbackSubject(absl::string_view fleet, absl::string_view r) {
  return absl::StrCat(Prefix(fleet, "fb"), NameToken(r), ".c");
}
std::string ControlSubject(absl::string_view fleet, absl::string_view r) {
  return absl::StrCat(Prefix(fleet, "fb"), NameToken(r), ".ctl");
}
std::string ReadoutFeedbackSubjects(absl::string_view fleet,
                                    absl::string_view r) {
  return absl::StrCat(Prefix(fleet, "fb"), NameToken(r), ".>");
}
std::string VersionSubject(absl::string_view fleet, absl::string_view r) {
  return Prefix(fleet, "ver") + NameToken(r);
}
std::string CheckpointSubject(absl::string_view fleet, absl::string_view r) {
  return Prefix(fleet, "ckpt") + NameToken(r);
}
std::string SnapshotSubject(absl::string_view fleet, absl::string_view r,
                            absl::string_view label) {
  return absl::StrCat(Prefix(fleet, "snap"), NameToken(r), ".",
                      NameToken(label));
}
std::string FeedbackSubjects(absl::string_view fleet) {
  return Prefix(fleet, "fb") + ">";
}
std::string ControlSubjects(absl::string_view fleet) {
  return Prefix(fleet, "fb") + "*.ctl";
}
std::string VersionSubjects(absl::string_view fleet) {
  return Prefix(fleet, "ver") + ">";
}
std::string CheckpointSubjects(absl::string_view fleet) {
  return Prefix(fleet, "ckpt") + ">";
}
std::string SnapshotSubjects(absl::string_view fleet) {
  return Prefix(fleet, "snap") + ">";
}

absl::StatusOr<std::string> ReadoutOfSubject(absl::string_view fleet,
                                             absl::string_view subject) {
  const std::string fb = Prefix(fleet, "fb");
  if (absl::StartsWith(subject, fb)) {
    // leap.<fleet>.fb.<readout>.c | .ctl (a token never holds a '.').
    absl::string_view rest = subject.substr(fb.size());
    const size_t dot = rest.find('.');
    if (dot != absl::string_view::npos &&
        (rest.substr(dot) == ".c" || rest.substr(dot) == ".ctl")) {
      return NameFromToken(rest.substr(0, dot));
    }
  }
  for (absl::string_view kind : {"ver", "ckpt"}) {
    const std::string p = Prefix(fleet, kind);
    if (absl::StartsWith(subject, p)) {
      return NameFromToken(subject.substr(p.size()));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "subject ", subject, " is not a readout subject of fleet ", fleet));
}

std::string ReadoutConfigKey(absl::string_view readout) {
  return "readout." + NameToken(readout);
}
std::string RouteConfigKey(absl::string_view product_line) {
  return "route." + NameToken(product_line);
}

absl::Status NatsError(int nats_status, int js_error_code,
                       absl::string_view what) {
  const natsStatus s = static_cast<natsStatus>(nats_status);
  std::string msg = absl::StrCat(what, ": ", NatsText(s));
  if (js_error_code != 0) {
    absl::StrAppend(&msg, " (jetstream error ", js_error_code, ")");
  }
  switch (js_error_code) {
    case JSStreamNotFoundErr:
    case JSConsumerNotFoundErr:
    case JSNoMessageFoundErr:
      return absl::NotFoundError(msg);
    case JSStreamWrongLastSequenceErr:
    case JSStreamWrongLastMsgIDErr:
      return absl::FailedPreconditionError(msg);
    case JSNotEnabledErr:
    case JSClusterNoPeersErr:
    case JSClusterNotAvailErr:
    case JSClusterNotLeaderErr:
    case JSStreamOfflineErr:
    case JSInsufficientResourcesErr:
      return absl::UnavailableError(msg);
    default:
      break;
  }
  switch (s) {
    case NATS_OK:
      return absl::OkStatus();
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_SERVER:
    case NATS_NOT_YET_CONNECTED:
    case NATS_NO_RESPONDERS:
    case NATS_STALE_CONNECTION:
    case NATS_IO_ERROR:
    case NATS_INSUFFICIENT_BUFFER:
    case NATS_SLOW_CONSUMER:
    case NATS_DRAINING:
      return absl::UnavailableError(msg);
    case NATS_TIMEOUT:
      return absl::DeadlineExceededError(msg);
    case NATS_NOT_FOUND:
      return absl::NotFoundError(msg);
    case NATS_INVALID_ARG:
    case NATS_INVALID_SUBJECT:
    case NATS_INVALID_TIMEOUT:
    case NATS_ADDRESS_MISSING:
    case NATS_MAX_PAYLOAD:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// ---------------------------------------------------------------- messages

StreamMsg ToStreamMsg(natsMsg* msg) {
  StreamMsg m;
  if (const char* s = natsMsg_GetSubject(msg); s != nullptr) m.subject = s;
  if (const char* d = natsMsg_GetData(msg); d != nullptr) {
    m.data.assign(d, static_cast<size_t>(natsMsg_GetDataLength(msg)));
  }
  m.stream_seq = natsMsg_GetSequence(msg);
  m.time_ns = natsMsg_GetTime(msg);
  if (m.stream_seq == 0) {
    jsMsgMetaData* meta = nullptr;
    if (natsMsg_GetMetaData(&meta, msg) == NATS_OK) {
      m.stream_seq = meta->Sequence.Stream;
      m.time_ns = meta->Timestamp;
      m.pending = meta->NumPending;
      jsMsgMetaData_Destroy(meta);
    }
  }
  const char* id = nullptr;
  if (natsMsgHeader_Get(msg, "Nats-Msg-Id", &id) == NATS_OK && id != nullptr) {
    m.msg_id = id;
  }
  return m;
}

// ---------------------------------------------------------------- client

struct NatsClient::Callbacks {
  absl::Mutex mu;
  NatsClient* owner ABSL_GUARDED_BY(mu) = nullptr;
  absl::Notification closed;
  // Asynchronous publishes in flight, by their message (the ack handler
  // gets the message it answers), and answers being delivered.
  //
  // nats.c 3.4 registers a message for its acknowledgement before it writes
  // it to the connection, so the answer (a JetStream ack, or the MaxWait
  // timeout its timer thread injects) can reach the ack handler while
  // js_PublishMsgAsync is still reading the message: if the handler
  // destroyed it then, the publishing thread would read freed memory. So
  // while `publishing`, the handler leaves the message to the publishing
  // thread (`own_msg`), which destroys it once js_PublishMsgAsync returned.
  struct AsyncPub {
    PublishCallback done;    // empty once answered (or failed by Close)
    bool publishing = true;  // js_PublishMsgAsync has not returned yet
    bool own_msg = false;    // answered: the message is ours to destroy
  };
  absl::Mutex amu;
  std::unordered_map<natsMsg*, AsyncPub> pending ABSL_GUARDED_BY(amu);
  int64_t answered_while_publishing ABSL_GUARDED_BY(amu) = 0;
  int delivering ABSL_GUARDED_BY(amu) = 0;
  bool closed_async ABSL_GUARDED_BY(amu) = false;
};

absl::StatusOr<std::unique_ptr<NatsClient>> NatsClient::Connect(
    NatsClientOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("no NATS server given");
  }
  std::unique_ptr<NatsClient> c(new NatsClient());
  c->options_ = std::move(options);
  const NatsClientOptions& o = c->options_;
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s != NATS_OK) return NatsError(s, 0, "nats options");
  c->opts_ = opts;
  std::vector<const char*> urls;
  for (const std::string& u : o.servers) urls.push_back(u.c_str());
  auto check = [](natsStatus st, absl::string_view what) {
    return st == NATS_OK ? absl::OkStatus() : NatsError(st, 0, what);
  };
  if (absl::Status st = check(
          natsOptions_SetServers(opts, urls.data(), static_cast<int>(urls.size())),
          absl::StrCat("NATS servers ", absl::StrJoin(o.servers, ",")));
      !st.ok()) {
    return st;
  }
  if (!o.name.empty()) natsOptions_SetName(opts, o.name.c_str());
  natsOptions_SetTimeout(opts, o.timeout_ms);
  natsOptions_SetAllowReconnect(opts, true);
  natsOptions_SetMaxReconnect(opts, -1);  // forever
  natsOptions_SetReconnectWait(opts, o.reconnect_wait_ms);
  natsOptions_SetReconnectJitter(opts, o.reconnect_wait_ms / 2 + 1,
                                 o.reconnect_wait_ms + 1);
  // Requests in flight fail at once on a disconnect instead of waiting for
  // their timeout.
  natsOptions_SetFailRequestsOnDisconnect(opts, true);
  // Spot a dead server within ~2 s rather than the default 4 minutes.
  natsOptions_SetPingInterval(opts, 1000);
  natsOptions_SetMaxPingsOut(opts, 2);
  // Asynchronous publishes (completions) go out at once instead of waiting
  // in nats.c's buffer for its flusher (~1 ms per lone completion).
  natsOptions_SetSendAsap(opts, true);
  c->callbacks_ = new Callbacks();
  {
    absl::MutexLock lock(&c->callbacks_->mu);
    c->callbacks_->owner = c.get();
  }
  natsOptions_SetDisconnectedCB(opts, &NatsClient::OnDisconnected, c->callbacks_);
  natsOptions_SetReconnectedCB(opts, &NatsClient::OnReconnected, c->callbacks_);
  natsOptions_SetClosedCB(opts, &NatsClient::OnClosed, c->callbacks_);
  natsOptions_SetRetryOnFailedConnect(opts, true, &NatsClient::OnConnected,
                                      c->callbacks_);
  if (!o.creds_file.empty()) {
    if (absl::Status st = check(
            natsOptions_SetUserCredentialsFromFiles(opts, o.creds_file.c_str(),
                                                    nullptr),
            absl::StrCat("--fleet_creds=", o.creds_file));
        !st.ok()) {
      return st;
    }
  }
  if (!o.tls_ca.empty() || !o.tls_cert.empty()) {
    natsOptions_SetSecure(opts, true);
    if (!o.tls_ca.empty()) {
      if (absl::Status st = check(
              natsOptions_LoadCATrustedCertificates(opts, o.tls_ca.c_str()),
              absl::StrCat("--fleet_tls_ca=", o.tls_ca));
          !st.ok()) {
        return st;
      }
    }
    if (!o.tls_cert.empty()) {
      if (absl::Status st = check(
              natsOptions_LoadCertificatesChain(opts, o.tls_cert.c_str(),
                                                o.tls_key.c_str()),
              absl::StrCat("--fleet_tls_cert=", o.tls_cert,
                           " --fleet_tls_key=", o.tls_key));
          !st.ok()) {
        return st;
      }
    }
  }
  s = natsConnection_Connect(&c->nc_, opts);
  if (s == NATS_OK) {
    c->SetConnected(true);
  } else if (s != NATS_NOT_YET_CONNECTED) {
    return NatsError(s, 0,
                     absl::StrCat("connect to ", absl::StrJoin(o.servers, ",")));
  }
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = o.timeout_ms;
  s = natsConnection_JetStream(&c->js_, c->nc_, &jo);
  if (s != NATS_OK) return NatsError(s, 0, "JetStream context");
  jsOptions ja;
  jsOptions_Init(&ja);
  ja.Wait = o.timeout_ms;
  ja.PublishAsync.AckHandler = &NatsClient::OnAsyncAck;
  ja.PublishAsync.AckHandlerClosure = c->callbacks_;
  ja.PublishAsync.MaxPending = 1 << 16;
  s = natsConnection_JetStream(&c->async_js_, c->nc_, &ja);
  if (s != NATS_OK) return NatsError(s, 0, "JetStream context (async)");
  return c;
}

void NatsClient::Close() {
  if (closed_once_.exchange(true)) return;
  if (callbacks_ != nullptr) {
    // Waits for a callback in progress; none reaches this object after.
    absl::MutexLock l(&callbacks_->mu);
    callbacks_->owner = nullptr;
  }
  connected_.store(false);
  if (nc_ != nullptr) {
    natsConnection_Close(nc_);  // joins the reader thread
    FreeParkedSubscriptions(nc_);
  }
  if (callbacks_ != nullptr) {
    // Asynchronous publishes still in flight get UNAVAILABLE now; answers
    // being delivered are waited for (none reaches a caller after this).
    // (A message still being published stays listed, without its callback,
    // for its publishing thread to settle.)
    std::vector<PublishCallback> left;
    {
      absl::MutexLock l(&callbacks_->amu);
      callbacks_->closed_async = true;
      auto& pending = callbacks_->pending;
      for (auto it = pending.begin(); it != pending.end();) {
        if (it->second.done) left.push_back(std::move(it->second.done));
        it->second.done = nullptr;
        if (it->second.publishing) {
          ++it;
        } else {
          it = pending.erase(it);
        }
      }
      callbacks_->amu.Await(absl::Condition(
          +[](int* delivering) { return *delivering == 0; },
          &callbacks_->delivering));
    }
    for (PublishCallback& done : left) {
      done(absl::UnavailableError(
          "publish: the NATS connection was closed before JetStream "
          "acknowledged it"));
    }
  }
}

NatsClient::~NatsClient() {
  Close();
  bool closed = true;
  if (js_ != nullptr) jsCtx_Destroy(js_);
  if (async_js_ != nullptr) jsCtx_Destroy(async_js_);
  if (nc_ != nullptr) {
    // The closed callback is the last one nats.c delivers. (While it is
    // reconnecting it may come late: not waited for long.)
    if (callbacks_ != nullptr) {
      closed = callbacks_->closed.WaitForNotificationWithTimeout(
          absl::Milliseconds(500));
    }
    natsConnection_Destroy(nc_);
  }
  if (callbacks_ != nullptr) {
    if (closed || nc_ == nullptr) {
      delete callbacks_;
    } else {
      static absl::Mutex kept_mu(absl::kConstInit);
      static std::vector<Callbacks*>* kept = new std::vector<Callbacks*>();
      absl::MutexLock l(&kept_mu);
      kept->push_back(callbacks_);
    }
  }
  if (opts_ != nullptr) natsOptions_Destroy(opts_);
}

void NatsClient::SetConnected(bool c) {
  connected_.store(c);
  {
    absl::MutexLock l(&mu_);
    connected_cv_ = c;
  }
  if (options_.on_connection_change) options_.on_connection_change(c);
}

void NatsClient::OnDisconnected(natsConnection*, void* closure) {
  auto* cb = static_cast<Callbacks*>(closure);
  absl::MutexLock l(&cb->mu);
  if (cb->owner == nullptr) return;
  if (cb->owner->connected_.load()) cb->owner->disconnects_.fetch_add(1);
  cb->owner->SetConnected(false);
}
void NatsClient::OnReconnected(natsConnection*, void* closure) {
  auto* cb = static_cast<Callbacks*>(closure);
  absl::MutexLock l(&cb->mu);
  if (cb->owner != nullptr) cb->owner->SetConnected(true);
}
void NatsClient::OnConnected(natsConnection*, void* closure) {
  auto* cb = static_cast<Callbacks*>(closure);
  absl::MutexLock l(&cb->mu);
  if (cb->owner != nullptr) cb->owner->SetConnected(true);
}
void NatsClient::OnClosed(natsConnection*, void* closure) {
  auto* cb = static_cast<Callbacks*>(closure);
  {
    absl::MutexLock l(&cb->mu);
    if (cb->owner != nullptr) cb->owner->connected_.store(false);
  }
  if (!cb->closed.HasBeenNotified()) cb->closed.Notify();
}

absl::Status NatsClient::WaitConnected(int64_t timeout_ms) {
  absl::MutexLock l(&mu_);
  if (!mu_.AwaitWithTimeout(absl::Condition(&connected_cv_),
                            absl::Milliseconds(timeout_ms))) {
    return absl::DeadlineExceededError(
        absl::StrCat("no NATS server of ", absl::StrJoin(options_.servers, ","),
                     " answered within ", timeout_ms, " ms"));
  }
  return absl::OkStatus();
}

std::vector<StreamSpec> FleetStreamSpecs(absl::string_view fleet,
                                         int replicas,
                                         int64_t feedback_duplicate_window_ms) {
  StreamSpec fb{FeedbackStream(fleet), {FeedbackSubjects(fleet)}, replicas};
  fb.duplicate_window_ms = feedback_duplicate_window_ms;
  StreamSpec ver{VersionsStream(fleet), {VersionSubjects(fleet)}, replicas};
  ver.max_msgs_per_subject = 10000;
  StreamSpec st{StateStream(fleet),
                {CheckpointSubjects(fleet), SnapshotSubjects(fleet)},
                replicas};
  st.duplicate_window_ms = 60'000;
  return {std::move(fb), std::move(ver), std::move(st)};
}

absl::Status EnsureStream(jsCtx* js, const StreamSpec& spec) {
  jsStreamConfig cfg;
  jsStreamConfig_Init(&cfg);
  cfg.Name = spec.name.c_str();
  std::vector<const char*> subjects;
  for (const std::string& s : spec.subjects) subjects.push_back(s.c_str());
  cfg.Subjects = subjects.data();
  cfg.SubjectsLen = static_cast<int>(subjects.size());
  cfg.Storage = js_FileStorage;
  cfg.Replicas = spec.replicas;
  cfg.MaxMsgsPerSubject =
      spec.max_msgs_per_subject > 0 ? spec.max_msgs_per_subject : -1;
  cfg.MaxAge = spec.max_age_ms * 1'000'000;
  cfg.Duplicates = spec.duplicate_window_ms * 1'000'000;
  if (spec.max_msg_size > 0) cfg.MaxMsgSize = spec.max_msg_size;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  jsStreamInfo* si = nullptr;
  natsStatus s = js_AddStream(&si, js, &cfg, nullptr, &jerr);
  if (s == NATS_OK) {
    jsStreamInfo_Destroy(si);
    return absl::OkStatus();
  }
  if (jerr == JSStreamNameExistErr) {
    // It exists with another configuration (created by another member or an
    // operator): used as it is.
    return absl::OkStatus();
  }
  return NatsError(s, jerr, absl::StrCat("create stream ", spec.name));
}

absl::Status NatsClient::EnsureStream(const StreamSpec& spec) {
  return leap::fleet::EnsureStream(js_, spec);
}

absl::StatusOr<std::unique_ptr<KvBucket>> NatsClient::EnsureKv(
    const KvSpec& spec) {
  kvConfig cfg;
  kvConfig_Init(&cfg);
  cfg.Bucket = spec.bucket.c_str();
  cfg.History = static_cast<uint8_t>(std::clamp(spec.history, 1, 64));
  cfg.TTL = spec.ttl_ms * 1'000'000;  // nanoseconds (the stream's MaxAge)
  cfg.Replicas = spec.replicas;
  cfg.StorageType = js_FileStorage;
  kvStore* kv = nullptr;
  natsStatus s = js_CreateKeyValue(&kv, js_, &cfg);
  if (s != NATS_OK) {
    // An existing bucket with another configuration: bind to it.
    s = js_KeyValue(&kv, js_, spec.bucket.c_str());
    if (s != NATS_OK) {
      return NatsError(s, 0, absl::StrCat("key-value bucket ", spec.bucket));
    }
  }
  return std::unique_ptr<KvBucket>(new KvBucket(spec.bucket, kv, nc_, js_));
}

namespace {

// The JetStream publish options of one publish (msg_id points into
// `options`, which must outlive the publish call).
jsPubOptions ToJsPubOptions(const PublishOptions& options,
                            int64_t default_timeout_ms) {
  jsPubOptions po;
  jsPubOptions_Init(&po);
  if (!options.msg_id.empty()) po.MsgId = options.msg_id.c_str();
  if (options.expect_last_subject_seq.has_value()) {
    if (*options.expect_last_subject_seq == 0) {
      po.ExpectNoMessage = true;
    } else {
      po.ExpectLastSubjectSeq = *options.expect_last_subject_seq;
    }
  }
  po.MaxWait = options.timeout_ms > 0 ? options.timeout_ms : default_timeout_ms;
  return po;
}

absl::Status NotConnected(const std::string& subject,
                          const std::vector<std::string>& servers) {
  return absl::UnavailableError(absl::StrCat("publish to ", subject,
                                             ": not connected to NATS (",
                                             absl::StrJoin(servers, ","), ")"));
}

}  // namespace

absl::StatusOr<PublishResult> NatsClient::Publish(
    const std::string& subject, absl::string_view data,
    const PublishOptions& options) {
  if (!connected()) {
    return NotConnected(subject, options_.servers);
  }
  jsPubOptions po = ToJsPubOptions(options, options_.timeout_ms);
  jsPubAck* ack = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  const natsStatus s = js_Publish(&ack, js_, subject.c_str(), data.data(),
                                  static_cast<int>(data.size()), &po, &jerr);
  if (s != NATS_OK) {
    absl::Status st = NatsError(s, jerr, absl::StrCat("publish to ", subject));
    if (absl::IsDeadlineExceeded(st)) {
      // No acknowledgement in time: to the caller the log is unreachable.
      return absl::UnavailableError(st.message());
    }
    return st;
  }
  PublishResult r{ack->Sequence, ack->Duplicate};
  jsPubAck_Destroy(ack);
  return r;
}

void NatsClient::PublishAsync(const std::string& subject,
                              absl::string_view data,
                              const PublishOptions& options,
                              PublishCallback done) {
  if (!connected() || async_js_ == nullptr) {
    done(NotConnected(subject, options_.servers));
    return;
  }
  natsMsg* msg = nullptr;
  natsStatus s = natsMsg_Create(&msg, subject.c_str(), nullptr, data.data(),
                                static_cast<int>(data.size()));
  if (s != NATS_OK) {
    done(NatsError(s, 0, absl::StrCat("publish to ", subject)));
    return;
  }
  jsPubOptions po = ToJsPubOptions(options, options_.timeout_ms);
  natsMsg* const key = msg;
  {
    // Registered first: the acknowledgement may arrive before
    // js_PublishMsgAsync returns.
    absl::MutexLock l(&callbacks_->amu);
    if (callbacks_->closed_async) {
      natsMsg_Destroy(msg);
      done(absl::UnavailableError(
          absl::StrCat("publish to ", subject, ": the NATS client is closed")));
      return;
    }
    // A live message's address is not reused: every entry goes before its
    // message is destroyed.
    auto [it, fresh] = callbacks_->pending.try_emplace(key);
    assert(fresh);
    (void)fresh;
    it->second.done = std::move(done);
  }
  s = js_PublishMsgAsync(async_js_, &msg, &po);
  if (s == NATS_OK) {
    bool destroy = false;
    {
      absl::MutexLock l(&callbacks_->amu);
      auto it = callbacks_->pending.find(key);
      if (it != callbacks_->pending.end()) {
        it->second.publishing = false;
        if (it->second.own_msg) {
          // Answered while it was being written (see AsyncPub).
          destroy = true;
          callbacks_->pending.erase(it);
        } else if (!it->second.done) {
          // Failed by Close meanwhile; nats.c keeps the message.
          callbacks_->pending.erase(it);
        }
      }
    }
    if (destroy) natsMsg_Destroy(key);
  } else {
    // The library did not take the message: no answer came or will come
    // for it (nats.c reports an answered message as taken). Its entry goes
    // before the message does (a new message may reuse the address).
    PublishCallback d;
    {
      absl::MutexLock l(&callbacks_->amu);
      auto it = callbacks_->pending.find(key);
      if (it != callbacks_->pending.end()) {
        d = std::move(it->second.done);
        callbacks_->pending.erase(it);
      }
    }
    natsMsg_Destroy(msg);
    if (d) {
      absl::Status st = NatsError(s, 0, absl::StrCat("publish to ", subject));
      if (absl::IsDeadlineExceeded(st)) st = absl::UnavailableError(st.message());
      d(st);
    }
  }
}

int64_t NatsClient::async_in_flight() const {
  if (callbacks_ == nullptr) return 0;
  absl::MutexLock l(&callbacks_->amu);
  int64_t n = 0;
  for (const auto& [msg, p] : callbacks_->pending) n += p.done ? 1 : 0;
  return n;
}

int64_t NatsClient::async_answered_while_publishing() const {
  if (callbacks_ == nullptr) return 0;
  absl::MutexLock l(&callbacks_->amu);
  return callbacks_->answered_while_publishing;
}

void NatsClient::OnAsyncAck(jsCtx*, natsMsg* msg, jsPubAck* pa,
                            jsPubAckErr* pae, void* closure) {
  auto* cb = static_cast<Callbacks*>(closure);
  // The answer is built first, while the message is surely alive: once
  // `own_msg` is set below, its publishing thread may destroy it.
  absl::StatusOr<PublishResult> r;
  if (pa != nullptr) {
    r = PublishResult{pa->Sequence, pa->Duplicate};
  } else {
    const std::string subject =
        natsMsg_GetSubject(msg) != nullptr ? natsMsg_GetSubject(msg) : "";
    absl::Status st =
        NatsError(pae != nullptr ? pae->Err : NATS_ERR,
                  pae != nullptr ? pae->ErrCode : 0,
                  absl::StrCat("publish to ", subject,
                               pae != nullptr && pae->ErrText != nullptr
                                   ? absl::StrCat(" (", pae->ErrText, ")")
                                   : std::string()));
    if (absl::IsDeadlineExceeded(st)) {
      // No acknowledgement in time: to the caller the log is unreachable.
      st = absl::UnavailableError(st.message());
    }
    r = st;
  }
  PublishCallback done;
  bool destroy = true;  // false: its publishing thread destroys it
  {
    absl::MutexLock l(&cb->amu);
    auto it = cb->pending.find(msg);
    if (it != cb->pending.end()) {
      done = std::move(it->second.done);
      it->second.done = nullptr;
      if (it->second.publishing) {
        it->second.own_msg = true;
        destroy = false;
        ++cb->answered_while_publishing;
      } else {
        cb->pending.erase(it);
      }
      if (done) ++cb->delivering;
    }
  }
  if (destroy) natsMsg_Destroy(msg);
  if (!done) return;
  done(std::move(r));
  absl::MutexLock l(&cb->amu);
  --cb->delivering;
}

absl::StatusOr<StreamMsg> NatsClient::GetLastMsg(const std::string& stream,
                                                 const std::string& subject) {
  natsMsg* msg = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  const natsStatus s =
      js_GetLastMsg(&msg, js_, stream.c_str(), subject.c_str(), nullptr, &jerr);
  if (s != NATS_OK) {
    return NatsError(s, jerr,
                     absl::StrCat("last message of ", subject, " in ", stream));
  }
  StreamMsg m = ToStreamMsg(msg);
  natsMsg_Destroy(msg);
  return m;
}

absl::StatusOr<StreamMsg> NatsClient::GetMsg(const std::string& stream,
                                             uint64_t seq) {
  natsMsg* msg = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  const natsStatus s = js_GetMsg(&msg, js_, stream.c_str(), seq, nullptr, &jerr);
  if (s != NATS_OK) {
    return NatsError(s, jerr, absl::StrCat("message ", seq, " of ", stream));
  }
  StreamMsg m = ToStreamMsg(msg);
  natsMsg_Destroy(msg);
  return m;
}

absl::StatusOr<uint64_t> NatsClient::LastSeq(const std::string& stream) {
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  const natsStatus s =
      js_GetStreamInfo(&si, js_, stream.c_str(), nullptr, &jerr);
  if (s != NATS_OK) {
    return NatsError(s, jerr, absl::StrCat("info of stream ", stream));
  }
  const uint64_t last = si->State.LastSeq;
  jsStreamInfo_Destroy(si);
  return last;
}

absl::StatusOr<std::map<std::string, uint64_t>> NatsClient::Subjects(
    const std::string& stream, const std::string& filter) {
  jsOptions o;
  jsOptions_Init(&o);
  o.Stream.Info.SubjectsFilter = filter.c_str();
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  const natsStatus s = js_GetStreamInfo(&si, js_, stream.c_str(), &o, &jerr);
  if (s != NATS_OK) {
    return NatsError(s, jerr, absl::StrCat("subjects ", filter, " of ", stream));
  }
  std::map<std::string, uint64_t> out;
  if (si->State.Subjects != nullptr) {
    for (int i = 0; i < si->State.Subjects->Count; ++i) {
      out[si->State.Subjects->List[i].Subject] = si->State.Subjects->List[i].Msgs;
    }
  }
  jsStreamInfo_Destroy(si);
  return out;
}

// ---------------------------------------------------------------- subscription

struct Subscription::State {
  absl::Mutex mu;  // held while the callback runs
  bool stopped ABSL_GUARDED_BY(mu) = false;
  std::function<void(const StreamMsg&)> callback;
  natsSubscription* sub = nullptr;
  natsConnection* nc = nullptr;
};

namespace {

void OnSubMsg(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
  auto* state = static_cast<std::shared_ptr<Subscription::State>*>(closure);
  {
    absl::MutexLock l(&(*state)->mu);
    if (!(*state)->stopped) (*state)->callback(ToStreamMsg(msg));
  }
  natsMsg_Destroy(msg);
}

void OnSubComplete(void* closure) {
  delete static_cast<std::shared_ptr<Subscription::State>*>(closure);
}

}  // namespace

Subscription::Subscription(std::shared_ptr<State> state)
    : state_(std::move(state)) {}

void Subscription::Stop() {
  natsSubscription* sub = nullptr;
  {
    absl::MutexLock l(&state_->mu);
    if (state_->stopped) return;
    state_->stopped = true;
    sub = state_->sub;
  }
  if (sub == nullptr) return;
  UnsubscribeAndDrain(state_->nc, sub);
}

Subscription::~Subscription() {
  Stop();
  DestroySubscription(state_->nc, state_->sub);
}

absl::StatusOr<std::unique_ptr<Subscription>> NatsClient::Subscribe(
    const std::string& subject, const SubscribeOptions& options,
    std::function<void(const StreamMsg&)> callback) {
  auto state = std::make_shared<Subscription::State>();
  state->callback = std::move(callback);
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Ordered = true;
  if (!options.stream.empty()) so.Stream = options.stream.c_str();
  switch (options.start) {
    case SubscribeOptions::Start::kAll:
      so.Config.DeliverPolicy = js_DeliverAll;
      break;
    case SubscribeOptions::Start::kNew:
      so.Config.DeliverPolicy = js_DeliverNew;
      break;
    case SubscribeOptions::Start::kLastPerSubject:
      so.Config.DeliverPolicy = js_DeliverLastPerSubject;
      break;
    case SubscribeOptions::Start::kFromSeq:
      so.Config.DeliverPolicy = js_DeliverByStartSequence;
      so.Config.OptStartSeq = std::max<uint64_t>(1, options.start_seq);
      break;
  }
  auto* closure = new std::shared_ptr<Subscription::State>(state);
  natsSubscription* sub = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  // Hold the state's lock so that no message is handled before `sub` is
  // recorded.
  natsStatus s;
  {
    absl::MutexLock l(&state->mu);
    s = js_Subscribe(&sub, js_, subject.c_str(), &OnSubMsg, closure, nullptr,
                     &so, &jerr);
    if (s == NATS_OK) {
      state->sub = sub;
      state->nc = nc_;
      natsSubscription_SetPendingLimits(sub, -1, -1);
      natsSubscription_SetOnCompleteCB(sub, &OnSubComplete, closure);
    }
  }
  if (s != NATS_OK) {
    delete closure;
    return NatsError(s, jerr, absl::StrCat("subscribe to ", subject));
  }
  return std::unique_ptr<Subscription>(new Subscription(std::move(state)));
}

// ---------------------------------------------------------------- KV

KvBucket::~KvBucket() { kvStore_Destroy(kv_); }

namespace {

KvEntry ToKvEntry(kvEntry* e) {
  KvEntry out;
  out.key = kvEntry_Key(e);
  if (const void* v = kvEntry_Value(e); v != nullptr) {
    out.value.assign(static_cast<const char*>(v),
                     static_cast<size_t>(kvEntry_ValueLen(e)));
  }
  out.revision = kvEntry_Revision(e);
  out.deleted = kvEntry_Operation(e) != kvOp_Put;
  return out;
}

}  // namespace

absl::StatusOr<KvEntry> KvBucket::Get(const std::string& key) {
  kvEntry* e = nullptr;
  const natsStatus s = kvStore_Get(&e, kv_, key.c_str());
  if (s != NATS_OK) {
    return NatsError(s, 0, absl::StrCat("get ", name_, "/", key));
  }
  KvEntry out = ToKvEntry(e);
  kvEntry_Destroy(e);
  return out;
}

absl::StatusOr<uint64_t> KvBucket::Put(const std::string& key,
                                       absl::string_view v) {
  uint64_t rev = 0;
  const natsStatus s = kvStore_Put(&rev, kv_, key.c_str(), v.data(),
                                   static_cast<int>(v.size()));
  if (s != NATS_OK) {
    return NatsError(s, 0, absl::StrCat("put ", name_, "/", key));
  }
  return rev;
}

absl::StatusOr<uint64_t> KvBucket::Create(const std::string& key,
                                          absl::string_view v) {
  uint64_t rev = 0;
  const natsStatus s = kvStore_Create(&rev, kv_, key.c_str(), v.data(),
                                      static_cast<int>(v.size()));
  if (s == NATS_OK) return rev;
  absl::Status st = NatsError(s, 0, absl::StrCat("create ", name_, "/", key));
  // nats.c reports an existing key as a wrong-last-sequence error.
  const char* last = nats_GetLastError(nullptr);
  if (last != nullptr && (std::strstr(last, "wrong last sequence") != nullptr ||
                          std::strstr(last, "10071") != nullptr)) {
    return absl::AlreadyExistsError(st.message());
  }
  if (absl::StatusOr<KvEntry> e = Get(key); e.ok()) {
    return absl::AlreadyExistsError(st.message());
  }
  return st;
}

absl::StatusOr<uint64_t> KvBucket::Update(const std::string& key,
                                          absl::string_view v,
                                          uint64_t last_revision) {
  uint64_t rev = 0;
  const natsStatus s =
      kvStore_Update(&rev, kv_, key.c_str(), v.data(),
                     static_cast<int>(v.size()), last_revision);
  if (s == NATS_OK) return rev;
  absl::Status st = NatsError(
      s, 0, absl::StrCat("update ", name_, "/", key, " at revision ",
                         last_revision));
  const char* last = nats_GetLastError(nullptr);
  if (absl::IsInternal(st) && last != nullptr &&
      (std::strstr(last, "wrong last sequence") != nullptr ||
       std::strstr(last, "10071") != nullptr)) {
    return absl::FailedPreconditionError(st.message());
  }
  return st;
}

absl::Status KvBucket::Delete(const std::string& key) {
  const natsStatus s = kvStore_Delete(kv_, key.c_str());
  if (s != NATS_OK) {
    return NatsError(s, 0, absl::StrCat("delete ", name_, "/", key));
  }
  return absl::OkStatus();
}

namespace {

// One entry of a watch: a message of the bucket's stream on
// "$KV.<bucket>.<key>"; `pending` is what the consumer had left after it.
KvEntry MsgToKvEntry(natsMsg* m, size_t key_at, uint64_t* pending) {
  KvEntry out;
  const absl::string_view subject = natsMsg_GetSubject(m);
  if (subject.size() > key_at) out.key = std::string(subject.substr(key_at));
  if (const char* d = natsMsg_GetData(m); d != nullptr) {
    out.value.assign(d, static_cast<size_t>(natsMsg_GetDataLength(m)));
  }
  *pending = 0;
  jsMsgMetaData* meta = nullptr;
  if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
    out.revision = meta->Sequence.Stream;
    *pending = meta->NumPending;
    jsMsgMetaData_Destroy(meta);
  }
  // A delete or purge marker carries "KV-Operation: DEL" or "PURGE".
  const char* op = nullptr;
  out.deleted = natsMsgHeader_Get(m, "KV-Operation", &op) == NATS_OK && op != nullptr;
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvWatcher>> KvBucket::Watch(
    const std::string& keys, std::function<void(const KvEntry&)> callback,
    std::function<void()> on_initial_done) {
  // What kvStore_Watch does (an ordered consumer on the bucket's stream, the
  // last value of each key first), on a subscription of our own: ended with
  // UnsubscribeAndDrain, never by kvWatcher_Stop, whose unsubscribe deletes
  // the consumer (the libnats 3.4.1 use after free UnsubscribeAndDrain
  // describes).
  const std::string prefix = absl::StrCat("$KV.", name_, ".");
  const std::string subject = prefix + (keys.empty() ? ">" : keys);
  const std::string stream = "KV_" + name_;
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = stream.c_str();
  so.Ordered = true;
  so.Config.DeliverPolicy = js_DeliverLastPerSubject;
  std::unique_ptr<KvWatcher> watcher(new KvWatcher());
  watcher->nc_ = nc_;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_SubscribeSync(&watcher->sub_, js_, subject.c_str(), nullptr, &so, &jerr);
  if (s != NATS_OK) {
    watcher->sub_ = nullptr;
    return NatsError(s, jerr, absl::StrCat("watch ", name_, "/", keys));
  }
  natsSubscription_SetPendingLimits(watcher->sub_, -1, -1);
  // The initial values: what the consumer had when it was made (delivered
  // since or not). None: they are done at once. (NOT_FOUND: the library
  // recreated the ordered consumer in between, e.g. after a gap; asked
  // once more, of the new one.)
  uint64_t initial_count = 0;
  for (int attempt = 0;; ++attempt) {
    jsConsumerInfo* ci = nullptr;
    s = natsSubscription_GetConsumerInfo(&ci, watcher->sub_, nullptr, &jerr);
    if (s == NATS_NOT_FOUND && attempt == 0) continue;
    if (s != NATS_OK) {
      return NatsError(s, jerr, absl::StrCat("watch ", name_, "/", keys));
    }
    initial_count = ci->NumPending + ci->Delivered.Consumer;
    jsConsumerInfo_Destroy(ci);
    break;
  }
  KvWatcher* raw = watcher.get();
  watcher->thread_ = std::thread([raw, initial_count, key_at = prefix.size(),
                                  callback = std::move(callback),
                                  done = std::move(on_initial_done)]() mutable {
    bool initial = initial_count > 0;
    uint64_t received = 0;
    if (!initial && done) done();
    while (!raw->stop_.load()) {
      natsMsg* m = nullptr;
      const natsStatus st = natsSubscription_NextMsg(&m, raw->sub_, 250);
      if (st == NATS_TIMEOUT) continue;
      if (st != NATS_OK) break;  // stopped
      uint64_t pending = 0;
      const KvEntry k = MsgToKvEntry(m, key_at, &pending);
      natsMsg_Destroy(m);
      if (raw->stop_.load()) break;  // nothing reaches the callback after Stop
      callback(k);
      // Done after the last of them: when nothing is left, or (values
      // written meanwhile keep the pending count above zero) once as many
      // as there were have come.
      if (initial && (pending == 0 || ++received >= initial_count)) {
        initial = false;
        if (done) done();
      }
    }
  });
  NameThread(watcher->thread_, "leap-kv-watch");
  return watcher;
}

void KvWatcher::Stop() {
  if (stop_.exchange(true)) return;
  // Out of the connection (NextMsg then returns at once when it got any
  // message; else within its 250 ms).
  UnsubscribeAndDrain(nc_, sub_);
}

KvWatcher::~KvWatcher() {
  Stop();
  if (thread_.joinable()) thread_.join();
  DestroySubscription(nc_, sub_);
}

namespace {

// Whether `sub` reads a JetStream consumer, without I/O: libnats answers
// NATS_INVALID_SUBSCRIPTION for a core NATS subscription (and NATS_NOT_FOUND
// or NATS_OK for a JetStream one).
bool IsJetStream(natsSubscription* sub) {
  jsConsumerSequenceMismatch csm;
  return natsSubscription_GetSequenceMismatch(&csm, sub) != NATS_INVALID_SUBSCRIPTION;
}

}  // namespace

void UnsubscribeAndDrain(natsConnection* nc, natsSubscription* sub) {
  if (sub == nullptr) return;
  const auto connected = [nc] {
    return nc != nullptr && natsConnection_Status(nc) == NATS_CONN_STATUS_CONNECTED;
  };
  if (connected() && !IsJetStream(sub)) {
    natsSubscription_Unsubscribe(sub);
  } else {
    // A limit of one message: the subscription leaves the connection at
    // once when it got any message (a reconnect does not subscribe it
    // again); one that got none leaves with the one more message the server
    // may send it, or in Destroy. Never natsSubscription_Unsubscribe on a
    // JetStream subscription: it would also delete the consumer the library
    // created, which (1) without a server waits out a request's timeout and
    // (2) in libnats 3.4.1 reads the consumer's name after releasing the
    // subscription's lock, while the thread that recreates an ordered
    // consumer (after missed heartbeats, e.g. a NATS node lost) frees that
    // name: a use after free when the delete answers "not found", which
    // AddressSanitizer caught in the fleet tests. The server removes an
    // ephemeral consumer without interest by itself (after 5 s).
    // One that got none stays in the connection's table (libnats takes it
    // out when it hands out the message that reaches the limit): freed by
    // DestroySubscription only after the connection is closed.
    natsSubscription_AutoUnsubscribe(sub, 1);
  }
  // Checked again: a reconnect may have come in between.
  if (connected()) natsConnection_FlushTimeout(nc, 2000);
}

namespace {

// Subscriptions still registered in their connection after
// UnsubscribeAndDrain (a JetStream one that never handed out a message),
// per connection, until NatsClient::Close has closed it.
absl::Mutex parked_mu(absl::kConstInit);
std::unordered_map<natsConnection*, std::vector<natsSubscription*>>& Parked()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(parked_mu) {
  static auto* parked =
      new std::unordered_map<natsConnection*, std::vector<natsSubscription*>>();
  return *parked;
}

}  // namespace

void DestroySubscription(natsConnection* nc, natsSubscription* sub) {
  if (sub == nullptr) return;
  // Still valid = still in the connection's table of subscriptions: the
  // reader thread may look it up for a message at any time (a heartbeat of
  // its consumer, the one message its limit lets through), so it is freed
  // only once the connection is closed and its reader joined.
  if (nc != nullptr && natsSubscription_IsValid(sub) && !natsConnection_IsClosed(nc)) {
    absl::MutexLock l(&parked_mu);
    Parked()[nc].push_back(sub);
    return;
  }
  natsSubscription_Destroy(sub);
}

void FreeParkedSubscriptions(natsConnection* nc) {
  std::vector<natsSubscription*> subs;
  {
    absl::MutexLock l(&parked_mu);
    auto it = Parked().find(nc);
    if (it == Parked().end()) return;
    subs = std::move(it->second);
    Parked().erase(it);
  }
  for (natsSubscription* sub : subs) natsSubscription_Destroy(sub);
}

int ParkedSubscriptions(natsConnection* nc) {
  absl::MutexLock l(&parked_mu);
  auto it = Parked().find(nc);
  return it == Parked().end() ? 0 : static_cast<int>(it->second.size());
}

void CloseSubscription(natsConnection* nc, natsSubscription* sub) {
  if (sub == nullptr) return;
  UnsubscribeAndDrain(nc, sub);
  DestroySubscription(nc, sub);
}

}  // namespace leap::fleet
