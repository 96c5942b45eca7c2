#include "sidecar/fleet/fleet_state.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "leap/v1/fleet.pb.h"
#include "sidecar/fleet/fleet_quality.h"

namespace leap::fleet {
namespace {

constexpr char kMagic[4] = {'L', 'F', 'S', '1'};
constexpr size_t kHeader = 12;  // magic, n (u32), P layout, frozen, 2 spare

// The P layout byte: no P; all n x n entries row by row (what states were
// written as before; still read); the upper triangle, row i from column i
// on (n (n + 1) / 2 entries: half the bytes; written since).
constexpr char kPNone = 0, kPFull = 1, kPUpper = 2;

constexpr int64_t UpperFloats(int64_t n) { return n * (n + 1) / 2; }

struct MsgDel {
  void operator()(natsMsg* m) const { natsMsg_Destroy(m); }
};
using MsgPtr = std::unique_ptr<natsMsg, MsgDel>;

}  // namespace

absl::Status NatsFailure(const std::string& what, natsStatus s, jsErrCode code) {
  std::string text = absl::StrCat("nats: ", what, ": ", natsStatus_GetText(s));
  if (const char* last = nats_GetLastError(nullptr); last != nullptr && *last) {
    absl::StrAppend(&text, " (", last, ")");
  }
  if (code != 0) absl::StrAppend(&text, " [JetStream error ", static_cast<int>(code), "]");
  if (s == NATS_TIMEOUT || s == NATS_NO_SERVER || s == NATS_CONNECTION_CLOSED ||
      s == NATS_CONNECTION_DISCONNECTED || s == NATS_NO_RESPONDERS) {
    return absl::UnavailableError(text);
  }
  if (s == NATS_NOT_FOUND || code == JSNoMessageFoundErr) {
    return absl::NotFoundError(text);
  }
  return absl::InternalError(text);
}

uint64_t StreamSequence(natsMsg* m) {
  jsMsgMetaData* meta = nullptr;
  if (natsMsg_GetMetaData(&meta, m) == NATS_OK && meta != nullptr) {
    const uint64_t seq = meta->Sequence.Stream;
    jsMsgMetaData_Destroy(meta);
    return seq;
  }
  return natsMsg_GetSequence(m);
}

std::string EncodeStatePayload(const FleetState& s) {
  const int64_t n = s.theta.size();
  const int64_t pbytes = s.p.has_value() ? UpperFloats(n) * 4 : 0;
  std::string out(kHeader + n * 8 + pbytes, '\0');
  char* w = out.data();
  std::memcpy(w, kMagic, 4);
  const uint32_t n32 = static_cast<uint32_t>(n);
  std::memcpy(w + 4, &n32, 4);
  w[8] = s.p.has_value() ? kPUpper : kPNone;
  w[9] = s.frozen ? 1 : 0;
  std::memcpy(w + kHeader, s.theta.data(), n * 8);
  if (s.p.has_value()) {
    // P is symmetric: its upper triangle, row i from column i on.
    char* pw = w + kHeader + n * 8;
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(pw, s.p->row(i) + i, (n - i) * 4);
      pw += (n - i) * 4;
    }
  }
  return out;
}

absl::Status DecodeStatePayload(absl::string_view data, FleetState* s) {
  if (data.size() < kHeader || std::memcmp(data.data(), kMagic, 4) != 0) {
    return absl::DataLossError("fleet state: bad header");
  }
  uint32_t n32 = 0;
  std::memcpy(&n32, data.data() + 4, 4);
  const int64_t n = n32;
  const char layout = data[8];
  if (layout != kPNone && layout != kPFull && layout != kPUpper) {
    return absl::DataLossError(
        absl::StrCat("fleet state: unknown P layout ", static_cast<int>(layout)));
  }
  if (n < 2 || n > 16385) {
    return absl::DataLossError(absl::StrCat("fleet state: bad width ", n));
  }
  const int64_t pfloats =
      layout == kPFull ? n * n : (layout == kPUpper ? UpperFloats(n) : 0);
  const size_t want = kHeader + n * 8 + pfloats * 4;
  if (data.size() != want) {
    return absl::DataLossError(absl::StrCat("fleet state: ", data.size(),
                                            " bytes, expected ", want));
  }
  s->frozen = data[9] != 0;
  s->theta.resize(n);
  std::memcpy(s->theta.data(), data.data() + kHeader, n * 8);
  if (layout == kPNone) {
    s->p.reset();
    return absl::OkStatus();
  }
  readout::SymMatrix p(n);
  const char* pr = data.data() + kHeader + n * 8;
  if (layout == kPFull) {  // written before the upper-triangle layout
    for (int64_t i = 0; i < n; ++i) std::memcpy(p.row(i), pr + i * n * 4, n * 4);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(p.row(i) + i, pr, (n - i) * 4);
      pr += (n - i) * 4;
    }
    p.MirrorUpper();
  }
  s->p = std::move(p);
  return absl::OkStatus();
}

std::string ExportSubject(absl::string_view fleet, absl::string_view readout,
                          absl::string_view op_id) {
  return absl::StrCat(CheckpointSubject(fleet, readout), ".export.", NameToken(op_id));
}

absl::StatusOr<int32_t> PublishState(jsCtx* js, const std::string& stream,
                                     const std::string& subject,
                                     const std::string& readout,
                                     const std::string& state_id,
                                     const FleetState& s,
                                     StateFence* fence) {
  const std::string data = EncodeStatePayload(s);
  const uint32_t crc = Crc32c(data.data(), data.size());
  // The quality rides on the last chunk, whose data shrinks to make room
  // (every message stays under kStateChunkBytes of payload). The trainer's
  // quality stays below this bound (FleetQualityTracker::Encode leaves
  // series out), so it never makes a checkpoint fail.
  static_assert(kQualityEncodeBytes + 4096 <= kStateChunkBytes / 2);
  const int64_t extra = static_cast<int64_t>(s.quality.size());
  if (extra > kStateChunkBytes / 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state quality of ", extra, " bytes exceeds ", kStateChunkBytes / 2));
  }
  const int64_t size = static_cast<int64_t>(data.size());
  int32_t chunks = static_cast<int32_t>(
      std::max<int64_t>(1, (size + kStateChunkBytes - 1) / kStateChunkBytes));
  if (extra > 0 && size - static_cast<int64_t>(chunks - 1) * kStateChunkBytes + extra >
                       kStateChunkBytes) {
    ++chunks;
  }
  if (fence != nullptr) fence->first_seq = 0;
  std::string bytes;
  for (int32_t i = 0; i < chunks; ++i) {
    leap::v1::fleet::FleetStateChunk c;
    c.set_readout(readout);
    c.set_state_id(state_id);
    c.set_index(i);
    c.set_created_unix_ms(s.created_unix_ms);
    const int64_t off = std::min<int64_t>(static_cast<int64_t>(i) * kStateChunkBytes, size);
    c.set_data(data.substr(static_cast<size_t>(off), kStateChunkBytes));
    if (i == chunks - 1) {
      c.set_last(true);
      c.set_version(s.version);
      c.set_completions_learned(s.completions_learned);
      c.set_fleet_seq(s.fleet_seq);
      c.set_crc32c(crc);
      c.set_unix_ms(s.unix_ms);
      c.set_label(s.label);
      c.set_chunks(chunks);
      for (uint64_t k : s.kept_seqs) c.add_kept_seqs(k);
      if (!s.quality.empty()) c.set_quality(s.quality);
    }
    bytes.clear();
    c.SerializeToString(&bytes);
    jsPubOptions po;
    jsPubOptions_Init(&po);
    const std::string id = absl::StrCat(state_id, "/", i);
    po.MsgId = id.c_str();
    po.ExpectStream = stream.c_str();
    if (fence != nullptr) {
      if (fence->last_subject_seq > 0) {
        po.ExpectLastSubjectSeq = fence->last_subject_seq;
      } else {
        po.ExpectNoMessage = true;
      }
    }
    jsPubAck* ack = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus st = js_Publish(&ack, js, subject.c_str(), bytes.data(),
                               static_cast<int>(bytes.size()), &po, &code);
    if (st == NATS_OK && fence != nullptr && ack != nullptr) {
      fence->last_subject_seq = ack->Sequence;
      if (i == 0) fence->first_seq = ack->Sequence;
    }
    if (ack != nullptr) jsPubAck_Destroy(ack);
    if (st != NATS_OK) {
      absl::Status failure = NatsFailure(
          absl::StrCat("publishing state ", state_id, " chunk ", i, " on ", subject), st,
          code);
      if (fence != nullptr && code == JSStreamWrongLastSequenceErr) {
        return absl::FailedPreconditionError(failure.message());
      }
      return failure;
    }
  }
  return chunks;
}

absl::StatusOr<FleetState> ReadNewestState(natsConnection* nc, jsCtx* js,
                                           const std::string& stream,
                                           const std::string& subject,
                                           std::optional<uint64_t> max_fleet_seq,
                                           std::optional<int64_t> incarnation) {
  // The end: the subject's last message now (NotFound: nothing written).
  uint64_t last_seq = 0;
  {
    natsMsg* m = nullptr;
    jsErrCode code = static_cast<jsErrCode>(0);
    natsStatus st = js_GetLastMsg(&m, js, stream.c_str(), subject.c_str(),
                                  nullptr, &code);
    if (st != NATS_OK) {
      if (st == NATS_NOT_FOUND || code == JSNoMessageFoundErr) {
        return absl::NotFoundError(absl::StrCat("no state on ", subject));
      }
      return NatsFailure(absl::StrCat("reading the last message of ", subject), st,
                       code);
    }
    last_seq = natsMsg_GetSequence(m);
    natsMsg_Destroy(m);
  }
  // Walk the subject from its first message with an ordered consumer
  // (flow-controlled; ephemeral: the server removes it 5 s after the
  // close below).
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = stream.c_str();
  so.Ordered = true;
  so.Config.DeliverPolicy = js_DeliverAll;
  natsSubscription* sub = nullptr;
  jsErrCode code = static_cast<jsErrCode>(0);
  natsStatus st = js_SubscribeSync(&sub, js, subject.c_str(), nullptr, &so, &code);
  if (st != NATS_OK) {
    return NatsFailure(absl::StrCat("subscribing to ", subject), st, code);
  }
  std::map<std::string, std::string> partial;  // state_id -> data so far
  std::map<std::string, int32_t> next_index;
  std::optional<FleetState> best;
  absl::Status err = absl::OkStatus();
  for (;;) {
    natsMsg* raw = nullptr;
    st = natsSubscription_NextMsg(&raw, sub, 10000);
    if (st != NATS_OK) {
      err = NatsFailure(absl::StrCat("reading ", subject), st);
      break;
    }
    MsgPtr m(raw);
    const uint64_t seq = StreamSequence(m.get());
    leap::v1::fleet::FleetStateChunk c;
    if (c.ParseFromArray(natsMsg_GetData(m.get()), natsMsg_GetDataLength(m.get()))) {
      const std::string& id = c.state_id();
      if (c.index() == 0) {
        partial[id].clear();
        next_index[id] = 0;
      }
      auto it = next_index.find(id);
      if (it != next_index.end() && it->second == c.index()) {
        partial[id] += c.data();
        ++it->second;
        if (c.last()) {
          std::string data = std::move(partial[id]);
          partial.erase(id);
          next_index.erase(id);
          FleetState s;
          const bool other_incarnation = incarnation.has_value() &&
                                         c.created_unix_ms() != 0 &&
                                         c.created_unix_ms() != *incarnation;
          if (other_incarnation) {
            std::fprintf(stderr,
                         "leapd: fleet state: %s: state %s (seq %llu) belongs to "
                         "incarnation %lld of the readout, not %lld; skipped\n",
                         subject.c_str(), id.c_str(), static_cast<unsigned long long>(seq),
                         static_cast<long long>(c.created_unix_ms()),
                         static_cast<long long>(*incarnation));
          } else if (c.chunks() == c.index() + 1 &&
                     Crc32c(data.data(), data.size()) == c.crc32c() &&
                     DecodeStatePayload(data, &s).ok() &&
                     (!max_fleet_seq.has_value() || c.fleet_seq() <= *max_fleet_seq)) {
            s.version = c.version();
            s.completions_learned = c.completions_learned();
            s.fleet_seq = c.fleet_seq();
            s.label = c.label();
            s.unix_ms = c.unix_ms();
            s.created_unix_ms = c.created_unix_ms();
            s.state_id = id;
            s.chunks = c.chunks();
            s.kept_seqs.assign(c.kept_seqs().begin(), c.kept_seqs().end());
            s.quality = c.quality();
            best = std::move(s);
          }
        }
      } else if (it != next_index.end()) {
        partial.erase(id);  // a gap: this state is incomplete
        next_index.erase(it);
      }
    }
    if (seq >= last_seq) break;
  }
  // Flow control and heartbeats may still come for the ordered consumer.
  CloseSubscription(nc, sub);
  if (!err.ok()) return err;
  if (!best.has_value()) {
    return absl::NotFoundError(absl::StrCat("no complete state on ", subject));
  }
  return std::move(*best);
}

absl::Status EnsureFleetStreams(jsCtx* js, const std::string& fleet,
                                int replicas, int64_t lease_ms) {
  for (const StreamSpec& spec : FleetStreamSpecs(fleet, replicas)) {
    if (absl::Status s = EnsureStream(js, spec); !s.ok()) return s;
  }
  {
    const std::string bucket = LeaseBucket(fleet);
    kvStore* kv = nullptr;
    natsStatus st = js_KeyValue(&kv, js, bucket.c_str());
    if (st != NATS_OK) {
      kvConfig kc;
      kvConfig_Init(&kc);
      kc.Bucket = bucket.c_str();
      kc.History = 1;
      kc.TTL = lease_ms * 1'000'000;  // nanoseconds (the stream's MaxAge)
      kc.Replicas = replicas;
      kc.StorageType = js_FileStorage;
      st = js_CreateKeyValue(&kv, js, &kc);
      if (st != NATS_OK) {
        // A concurrent creator may have won.
        st = js_KeyValue(&kv, js, bucket.c_str());
      }
    }
    if (kv != nullptr) kvStore_Destroy(kv);
    if (st != NATS_OK) return NatsFailure("creating bucket " + bucket, st);
  }
  return absl::OkStatus();
}

}  // namespace leap::fleet
