#include "sidecar/shm/internal/shm_session.h"

#include <sys/epoll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "sidecar/shm/internal/shm_attach.h"

namespace leap::sidecar::shm_internal {

namespace pb = ::leap::v1;
using shm::FrameKind;

namespace {

// True on the shm server thread (it flushes releases itself; other threads
// must wake it).
thread_local bool tls_shm_thread = false;

// Splits an answer that would not fit one frame of the engine's ring
// (payload `limit`) into parts that do, each a SidecarMessage with the same
// seq and body kind holding a consecutive run of its entries: the answers
// (predictions, priors) first, then the per-request errors, in their order.
// An Ack's counts (accepted, skipped, duplicates) travel in the last part.
// Nothing is dropped: the engine learns the outcome of every record
// (docs/WIRE.md, "Messages and answers larger than a frame"). An answer that fits, or a
// body with no entries to split, is the one part.
std::vector<pb::SidecarMessage> SplitAnswer(pb::SidecarMessage m,
                                            size_t limit) {
  std::vector<pb::SidecarMessage> parts;
  if (m.ByteSizeLong() <= limit) {
    parts.push_back(std::move(m));
    return parts;
  }
  google::protobuf::RepeatedPtrField<pb::RequestError> errors;
  google::protobuf::RepeatedPtrField<pb::Prediction> predictions;
  google::protobuf::RepeatedPtrField<pb::LengthPrior> priors;
  int64_t accepted = 0, skipped = 0, duplicates = 0;
  switch (m.body_case()) {
    case pb::SidecarMessage::kAck:
      errors.Swap(m.mutable_ack()->mutable_errors());
      accepted = m.ack().accepted();
      skipped = m.ack().skipped();
      duplicates = m.ack().duplicates();
      m.mutable_ack()->Clear();
      break;
    case pb::SidecarMessage::kPredictions:
      predictions.Swap(m.mutable_predictions()->mutable_predictions());
      errors.Swap(m.mutable_predictions()->mutable_errors());
      break;
    case pb::SidecarMessage::kPriors:
      priors.Swap(m.mutable_priors()->mutable_priors());
      errors.Swap(m.mutable_priors()->mutable_errors());
      break;
    default:
      parts.push_back(std::move(m));
      return parts;
  }
  // `m` is now the empty skeleton of every part: seq and body kind. Room is
  // left for the counts of the last part; an entry costs its size, its tag
  // and its length prefix.
  const size_t base = m.ByteSizeLong() + 64;
  pb::SidecarMessage part = m;
  size_t size = base;
  bool has_entries = false;
  auto room_for = [&](size_t entry_bytes) {
    if (has_entries && size + entry_bytes + 6 > limit) {
      parts.push_back(std::move(part));
      part = m;
      size = base;
      has_entries = false;
    }
    size += entry_bytes + 6;
    has_entries = true;
  };
  for (pb::Prediction& p : predictions) {
    room_for(p.ByteSizeLong());
    *part.mutable_predictions()->add_predictions() = std::move(p);
  }
  for (pb::LengthPrior& p : priors) {
    room_for(p.ByteSizeLong());
    *part.mutable_priors()->add_priors() = std::move(p);
  }
  for (pb::RequestError& e : errors) {
    // Ids are echoed up to 4 KiB; a message is cut to 1 KiB when the entry
    // would not fit a frame of the smallest ring (16 KiB) otherwise.
    if (e.ByteSizeLong() + base + 6 > limit && e.message().size() > 1024) {
      e.mutable_message()->resize(1024);
    }
    room_for(e.ByteSizeLong());
    pb::RequestError* to = nullptr;
    switch (m.body_case()) {
      case pb::SidecarMessage::kAck:
        to = part.mutable_ack()->add_errors();
        break;
      case pb::SidecarMessage::kPredictions:
        to = part.mutable_predictions()->add_errors();
        break;
      default:
        to = part.mutable_priors()->add_errors();
        break;
    }
    *to = std::move(e);
  }
  if (m.body_case() == pb::SidecarMessage::kAck) {
    part.mutable_ack()->set_accepted(accepted);
    part.mutable_ack()->set_skipped(skipped);
    part.mutable_ack()->set_duplicates(duplicates);
  }
  parts.push_back(std::move(part));
  return parts;
}

}  // namespace

void MarkServerThread() { tls_shm_thread = true; }

Waker::~Waker() {
  if (efd >= 0) close(efd);
}

void Waker::Notify() {
  // Release: the caller's earlier stores (a released slot, a publish) are
  // visible to whoever sees `pending`.
  pending.store(true, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (sleeping.load(std::memory_order_relaxed)) {
    const uint64_t one = 1;
    (void)!write(efd, &one, sizeof(one));
  }
}

Mapping::Mapping(size_t slots)
    : released(new std::atomic<uint64_t>[(slots + 63) / 64]),
      words((slots + 63) / 64) {
  for (size_t i = 0; i < words; ++i) released[i].store(0);
}

Mapping::~Mapping() {
  if (base != nullptr) munmap(base, bytes);
}

void Mapping::Release(uint32_t slot) {
  released[slot >> 6].fetch_or(uint64_t{1} << (slot & 63),
                               std::memory_order_release);
  any_released.store(true, std::memory_order_release);
  if (!tls_shm_thread) waker->Notify();
}

void Mapping::Drain(std::vector<uint32_t>* out) {
  if (!any_released.exchange(false, std::memory_order_acquire)) return;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = released[i].exchange(0, std::memory_order_acquire);
    while (w != 0) {
      const int b = __builtin_ctzll(w);
      out->push_back(static_cast<uint32_t>(i * 64 + b));
      w &= w - 1;
    }
  }
}

ShmSession::~ShmSession() {
  if (sock >= 0) close(sock);
  if (efd >= 0) close(efd);
}

void ShmSession::OnPublish(const std::string& readout,
                           const std::shared_ptr<const PublishedVersion>& v) {
  {
    absl::MutexLock lock(&pub_mu);
    published.emplace_back(readout, v->version);
    auto& slot = rescore[readout];
    if (slot == nullptr || slot->version < v->version) slot = v;
  }
  has_publish.store(true);
  waker->Notify();
}

void ShmSession::Track(std::shared_ptr<LiveRequest> r) {
  if (r->owner.get() == mapping.get() && r->slot < by_slot.size()) {
    by_slot[r->slot] = std::move(r);
    return;
  }
  inline_live[r->request_id] = r;
  if (inline_live.size() > prune_at) {
    for (auto it = inline_live.begin(); it != inline_live.end();) {
      auto cur = it++;
      auto p = cur->second.lock();
      if (p == nullptr || p->gone.load()) inline_live.erase(cur);
    }
    prune_at = std::max<size_t>(1024, 2 * inline_live.size());
  }
}

std::vector<std::shared_ptr<LiveRequest>> ShmSession::Live() {
  std::vector<std::shared_ptr<LiveRequest>> out;
  for (auto& w : by_slot) {
    auto r = w.lock();
    if (r != nullptr && !r->gone.load()) out.push_back(std::move(r));
  }
  for (auto it = inline_live.begin(); it != inline_live.end();) {
    auto cur = it++;
    auto r = cur->second.lock();
    if (r == nullptr || r->gone.load()) {
      inline_live.erase(cur);
      continue;
    }
    out.push_back(std::move(r));
  }
  return out;
}

void ShmSession::Detach(const std::string& why, bool corrupt,
                        const char* label) {
  if (dead) return;
  dead = true;
  if (!attached) return;
  if (corrupt) {
    std::fprintf(stderr, "leapd: shm engine '%s' detached: %s\n",
                 hello.engine_id().c_str(), why.c_str());
    SendAttachError(sock, absl::StatusCode::kDataLoss, why);
  }
  // The engine is gone: its live requests can never complete. Cancelling
  // them drops their slot leases; the mapping goes with the last one.
  int64_t reclaimed = 0;
  for (const auto& r : Live()) {
    if (r->session != session) continue;
    if (core->CancelExact(*r)) ++reclaimed;
  }
  by_slot.clear();
  inline_live.clear();
  // Completions still awaiting JetStream stay unacknowledged (the engine
  // resends them); the publishes themselves go on.
  parked.clear();
  core->metrics().shm_reclaimed().Increment(static_cast<double>(reclaimed));
  core->metrics().ShmDetached(label).Increment();
  hdr->sidecar_closed.store(1);
  hdr->to_engine.wake.fetch_add(1);
  shm::FutexWakeAll(&hdr->to_engine.wake);
  unlink(seg_path.c_str());
  epoll_ctl(epfd, EPOLL_CTL_DEL, sock, nullptr);
  epoll_ctl(epfd, EPOLL_CTL_DEL, efd, nullptr);
  core->metrics().connected_engines().Decrement();
  // Lifecycle lines go to stdout beside "listening on" (tests and operators
  // wait on them).
  std::printf("shm: engine '%s' detached (%s); %lld live requests reclaimed\n",
              hello.engine_id().c_str(), why.c_str(),
              static_cast<long long>(reclaimed));
  std::fflush(stdout);
}

// ------------------------------------------------------------ servicing

bool ShmSession::Service() {
  bool busy = false;
  if (FlushPending()) {
    std::string error;
    for (int frames = 0; frames < 64; ++frames) {
      shm::FrameHeader h;
      const char* payload;
      const shm::Ring::Peek p = in.Next(&h, &payload, &error);
      if (p == shm::Ring::Peek::kEmpty) break;
      if (p == shm::Ring::Peek::kCorrupt) {
        Detach("corrupt engine->sidecar ring: " + error, true, "corrupt");
        return true;
      }
      switch (static_cast<FrameKind>(h.kind)) {
        case FrameKind::kFeatures:
          HandleFeatures(payload, h.bytes);
          break;
        case FrameKind::kProto:
          HandleProto(payload, h.bytes);
          break;
        case FrameKind::kCancels:
          HandleCancels(payload, h.bytes);
          break;
        default: {
          pb::SidecarMessage m;
          m.mutable_error()->set_code(
              static_cast<int>(absl::StatusCode::kInvalidArgument));
          m.mutable_error()->set_message(
              absl::StrCat("unknown shm frame kind ", h.kind));
          EmitProto(m);
        }
      }
      in.Pop();
      busy = true;
      // Hand answers and freed slots over after every frame: the engine
      // refills while leapd works on the next frames (no idle gap waiting
      // for the engine's reaction at the end of a long round).
      FlushReleases();
      if (out_dirty) Publish();
      if (!pending.empty()) break;  // the engine is not reading: wait
    }
    if (busy) in.ReleaseConsumed();
  }
  FlushReleases();
  if (has_publish.load(std::memory_order_relaxed)) FlushPublishes();
  if (!parked.empty() && parked_ready->load(std::memory_order_acquire)) {
    busy |= FlushParked();
  }
  if (pending_bytes > kMaxPendingBytes) {
    // An engine that stopped reading (hung, or its ring's head is garbage):
    // do not buffer for it without bound.
    Detach(absl::StrCat("the engine stopped reading its ring: ", pending_bytes,
                        " bytes of answers pending"),
           true, "stalled");
    return true;
  }
  if (out_dirty) {
    Publish();
    busy = true;
  }
  return busy;
}

void ShmSession::Publish() {
  out_dirty = false;
  if (out.Publish()) {
    hdr->to_engine.wake.fetch_add(1, std::memory_order_relaxed);
    shm::FutexWakeAll(&hdr->to_engine.wake);
  }
}

void ShmSession::Emit(FrameKind kind, const std::string& bytes) {
  if (bytes.size() > out.max_payload()) {
    // Never queue what the ring can never take (it would stall the engine):
    // answer with a short message-level error instead.
    pb::SidecarMessage m;
    if (kind == FrameKind::kProto) {
      pb::SidecarMessage big;
      if (big.ParseFromString(bytes)) m.set_seq(big.seq());
    }
    m.mutable_error()->set_code(
        static_cast<int>(absl::StatusCode::kResourceExhausted));
    m.mutable_error()->set_message(absl::StrCat(
        "the answer (", bytes.size(),
        " bytes) does not fit this engine's ring (", out.max_payload(),
        " bytes per frame): send fewer records per message "
        "or attach with larger rings"));
    core->metrics().RequestErrors("RESOURCE_EXHAUSTED").Increment();
    Emit(FrameKind::kProto, m.SerializeAsString());
    return;
  }
  EmitParts(kind, {bytes});
}

void ShmSession::EmitParts(FrameKind kind,
                           std::initializer_list<absl::string_view> parts) {
  size_t n = 0;
  for (absl::string_view p : parts) n += p.size();
  if (pending.empty()) {
    if (char* dst = out.Reserve(n, kind)) {
      for (absl::string_view p : parts) {
        std::memcpy(dst, p.data(), p.size());
        dst += p.size();
      }
      out.Commit();
      out_dirty = true;
      return;
    }
  }
  std::string frame;
  frame.reserve(n);
  for (absl::string_view p : parts) frame.append(p.data(), p.size());
  pending_bytes += frame.size();
  pending.emplace_back(kind, std::move(frame));
}

void ShmSession::EmitProto(const pb::SidecarMessage& m) {
  Emit(FrameKind::kProto, m.SerializeAsString());
}

void ShmSession::EmitAnswer(pb::SidecarMessage m) {
  // The parts go out back to back: nothing comes between them in the ring.
  for (const pb::SidecarMessage& part :
       SplitAnswer(std::move(m), out.max_payload())) {
    EmitProto(part);
  }
}

bool ShmSession::FlushPending() {
  while (!pending.empty()) {
    auto& [kind, bytes] = pending.front();
    char* p = out.Reserve(bytes.size(), kind);
    if (p == nullptr) {
      if (out_dirty) Publish();
      return false;
    }
    std::memcpy(p, bytes.data(), bytes.size());
    out.Commit();
    out_dirty = true;
    pending_bytes -= bytes.size();
    pending.pop_front();
  }
  return true;
}

void ShmSession::HandleFeatures(const char* payload, size_t bytes) {
  shm::FeaturesReader reader(payload, bytes);
  uint64_t seq = 0;
  uint32_t count = 0;
  Metrics& metrics = core->metrics();
  auto frame_error = [&](const absl::Status& s) {
    pb::SidecarMessage m;
    m.set_seq(seq);
    m.mutable_error()->set_code(static_cast<int>(s.code()));
    m.mutable_error()->set_message(std::string(s.message()));
    metrics.RequestErrors(absl::StatusCodeToString(s.code())).Increment();
    EmitProto(m);
  };
  if (absl::Status s = reader.Init(&seq, &count); !s.ok()) {
    frame_error(s);
    return;
  }
  const size_t feature_bytes =
      static_cast<size_t>(layout.dim) * layout.dtype_size;
  const size_t max_payload = out.max_payload();
  uint32_t n_pred = 0, n_err = 0;
  std::string& preds = scratch->preds;
  std::string& errs = scratch->errs;
  preds.clear();
  errs.clear();
  auto flush = [&] {
    const shm::PredictionsHead head{seq, n_pred, n_err};
    EmitParts(
        FrameKind::kPredictions,
        {absl::string_view(reinterpret_cast<const char*>(&head), sizeof(head)),
         preds, errs});
    preds.clear();
    errs.clear();
    n_pred = n_err = 0;
  };
  auto add_error = [&](uint32_t slot, absl::string_view id,
                       const absl::Status& s) {
    // Bounded echo (as gRPC's up to 4 KiB ids; longer ones name no live
    // request anyway), the message too, so a record always fits a frame of
    // the smallest ring.
    id = id.substr(0, 4096);
    const std::string msg(s.message().substr(0, 1024));
    const size_t need = shm::ErrorRecordBytes(id.size(), msg.size());
    if (sizeof(shm::PredictionsHead) + preds.size() + errs.size() + need >
        max_payload) {
      flush();
    }
    const size_t at = errs.size();
    errs.resize(at + need);
    shm::WriteErrorRecord(errs.data() + at, slot, id,
                          static_cast<int>(s.code()), msg);
    ++n_err;
    metrics.RequestErrors(absl::StatusCodeToString(s.code())).Increment();
  };
  // First pass: decode and check slots; then one PredictBatch; then the
  // answers in record order.
  scratch->records.clear();
  scratch->reqs.clear();
  for (uint32_t i = 0; i < count; ++i) {
    shm::FeatureRecordView rec;
    if (absl::Status s = reader.Next(&rec); !s.ok()) {
      // Nothing of this frame is scored: give back the slots taken so far.
      for (const ScoreRequest& r : scratch->reqs)
        mapping->Release(r.external_slot);
      scratch->reqs.clear();
      frame_error(s);
      return;
    }
    int req = -1;
    if (rec.slot < layout.slot_count && !held[rec.slot]) {
      held[rec.slot] = 1;
      ScoreRequest sr;
      sr.request_id = rec.request_id;
      sr.instance = hello.instance_id();
      sr.product_line = rec.product_line;
      sr.features = absl::string_view(Slot(rec.slot), feature_bytes);
      sr.dtype = dtype;
      sr.request_max_tokens = rec.max_tokens;
      sr.external_owner = mapping;
      sr.external_slot = rec.slot;
      req = static_cast<int>(scratch->reqs.size());
      scratch->reqs.push_back(std::move(sr));
    }
    scratch->records.emplace_back(rec, req);
  }
  core->PredictBatch(scratch->reqs, session, &scratch->results,
                     &scratch->lives);
  scratch->reqs.clear();
  for (size_t k = 0; k < scratch->records.size(); ++k) {
    const auto& [rec, req] = scratch->records[k];
    if (req < 0) {
      add_error(rec.slot, rec.request_id,
                rec.slot >= layout.slot_count
                    ? absl::InvalidArgumentError(absl::StrCat(
                          "slot index ", rec.slot, " is out of range [0, ",
                          layout.slot_count, ")"))
                    : absl::InvalidArgumentError(absl::StrCat(
                          "slot ", rec.slot,
                          " is still held by leapd for a live request; wait "
                          "for its release before reusing it")));
      continue;
    }
    const absl::StatusOr<ScoreResult>& s = scratch->results[req];
    if (!s.ok()) {
      add_error(rec.slot, rec.request_id, s.status());
      continue;
    }
    std::shared_ptr<LiveRequest>& live = scratch->lives[req];
    const size_t need = shm::PredictionRecordBytes(
        rec.request_id.size(), std::min<size_t>(s->readout.size(), 255),
        std::min<size_t>(s->arm.size(), 255));
    if (sizeof(shm::PredictionsHead) + preds.size() + errs.size() + need >
        max_payload) {
      flush();
    }
    const size_t at = preds.size();
    preds.resize(at + need);
    shm::WritePredictionRecord(preds.data() + at, rec.slot, live->request_id,
                               absl::string_view(s->readout).substr(0, 255),
                               absl::string_view(s->arm).substr(0, 255),
                               s->predicted_tokens, s->score, s->version);
    ++n_pred;
    Track(std::move(live));
  }
  scratch->lives.clear();
  scratch->results.clear();
  flush();
}

void ShmSession::HandleProto(const char* payload, size_t bytes) {
  pb::EngineMessage msg;
  pb::SidecarMessage answer;
  if (!msg.ParseFromArray(payload, static_cast<int>(bytes))) {
    answer.mutable_error()->set_code(
        static_cast<int>(absl::StatusCode::kInvalidArgument));
    answer.mutable_error()->set_message(
        absl::StrCat("malformed EngineMessage frame of ", bytes, " bytes"));
    core->metrics().RequestErrors("INVALID_ARGUMENT").Increment();
  } else if (msg.body_case() == pb::EngineMessage::kCompletions) {
    StartCompletionsAnswer(msg);
    return;
  } else {
    HandleEngineMessage(core, session, hello, dtype, &msg, &answer, this);
  }
  EmitAnswer(std::move(answer));
}

void ShmSession::StartCompletionsAnswer(const pb::EngineMessage& msg) {
  // As HandleEngineMessage answers it, but without waiting for JetStream
  // (fleet mode): the answer is parked until its acknowledgements are in.
  std::shared_ptr<CompletionsAnswer> a =
      StartCompletions(core, hello, msg.completions());
  if (!a->ready()) {
    parked.push_back({msg.seq(), a});
    a->OnReady([ready = parked_ready, w = waker] {
      ready->store(true, std::memory_order_release);
      w->Notify();
    });
    return;
  }
  pb::SidecarMessage answer;
  answer.set_seq(msg.seq());
  a->Finish(answer.mutable_ack(), this);
  EmitAnswer(std::move(answer));
}

bool ShmSession::FlushParked() {
  // Cleared first: an answer that turns ready after its check below sets
  // it again (and wakes the loop).
  parked_ready->store(false, std::memory_order_seq_cst);
  bool emitted = false;
  for (auto it = parked.begin(); it != parked.end();) {
    if (!it->answer->ready()) {
      ++it;
      continue;
    }
    pb::SidecarMessage answer;
    answer.set_seq(it->seq);
    it->answer->Finish(answer.mutable_ack(), this);
    EmitAnswer(std::move(answer));
    emitted = true;
    it = parked.erase(it);
  }
  return emitted;
}

void ShmSession::HandleCancels(const char* payload, size_t bytes) {
  pb::SidecarMessage answer;
  std::vector<absl::string_view>& ids = scratch->cancel_ids;
  uint64_t seq = 0;
  // Fuzzed in fuzz/fuzz_shm_frames.cc.
  const absl::Status decoded = shm::DecodeCancels(payload, bytes, &seq, &ids);
  answer.set_seq(seq);
  if (!decoded.ok()) {
    answer.mutable_error()->set_code(static_cast<int>(decoded.code()));
    answer.mutable_error()->set_message(std::string(decoded.message()));
    core->metrics().RequestErrors("INVALID_ARGUMENT").Increment();
  } else {
    CancelRequests(core, ids, answer.mutable_ack(), this, hello.instance_id());
  }
  EmitAnswer(std::move(answer));
}

void ShmSession::FlushReleases() {
  std::vector<uint32_t>& slots = scratch->released;
  slots.clear();
  mapping->Drain(&slots);
  if (slots.empty()) return;
  const size_t per_frame =
      (out.max_payload() - sizeof(shm::ReleaseHead)) / sizeof(uint32_t);
  for (size_t i = 0; i < slots.size(); i += per_frame) {
    const size_t n = std::min(per_frame, slots.size() - i);
    shm::ReleaseHead head{static_cast<uint32_t>(n), 0};
    std::string frame(reinterpret_cast<const char*>(&head), sizeof(head));
    frame.append(reinterpret_cast<const char*>(slots.data() + i),
                 n * sizeof(uint32_t));
    for (size_t j = i; j < i + n; ++j) held[slots[j]] = 0;
    Emit(FrameKind::kRelease, frame);
  }
}

void ShmSession::FlushPublishes() {
  has_publish.store(false);
  std::vector<std::pair<std::string, int64_t>> published_now;
  std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>>
      rescore_now;
  {
    absl::MutexLock lock(&pub_mu);
    published_now.swap(published);
    rescore_now.swap(rescore);
  }
  for (const auto& [name, version] : published_now) {
    pb::SidecarMessage m;
    m.mutable_published()->set_readout(name);
    m.mutable_published()->set_version(version);
    EmitProto(m);
  }
  for (const auto& [name, v] : rescore_now) {
    std::vector<std::shared_ptr<LiveRequest>> mine = Live();
    std::vector<pb::Prediction> predictions;
    RescorePredictions(name, *v, mine, &predictions);
    mine.clear();
    pb::SidecarMessage m;
    m.mutable_rescore()->set_readout(name);
    m.mutable_rescore()->set_version(v->version);
    const size_t limit = out.max_payload() - 1024;
    size_t size = 0;
    for (auto& p : predictions) {
      const size_t add = p.ByteSizeLong() + 8;
      if (size + add > limit && m.rescore().predictions_size() > 0) {
        EmitProto(m);
        m.mutable_rescore()->clear_predictions();
        size = 0;
      }
      *m.mutable_rescore()->add_predictions() = std::move(p);
      size += add;
    }
    if (m.rescore().predictions_size() > 0) EmitProto(m);
  }
}

}  // namespace leap::sidecar::shm_internal
