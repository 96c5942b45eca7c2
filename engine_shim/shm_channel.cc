#include "engine_shim/shm_channel.h"

#include <errno.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/clock.h"

namespace leap::shim {
namespace {

namespace pb = ::leap::v1;
using shm::FrameKind;

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Attach(
    const ShmChannelOptions& o, pb::SidecarMessage* hello_ack) {
  const uint32_t dtype = static_cast<uint32_t>(o.hello.dtype());
  absl::StatusOr<shm::Layout> layout =
      shm::ComputeLayout(o.hello.dim(), dtype, o.slots, o.ring_bytes);
  if (!layout.ok()) return layout.status();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (o.path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm path '", o.path, "' is too long"));
  }
  std::memcpy(addr.sun_path, o.path.data(), o.path.size());
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->sock_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (ch->sock_ < 0 ||
      connect(ch->sock_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach leapd's shm socket '", o.path, "': ", std::strerror(errno)));
  }
  timeval tv{};
  tv.tv_sec = absl::ToInt64Seconds(o.timeout);
  tv.tv_usec = absl::ToInt64Microseconds(o.timeout) % 1'000'000;
  setsockopt(ch->sock_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));

  pb::EngineMessage hello;
  *hello.mutable_hello() = o.hello;
  const std::string hello_bytes = hello.SerializeAsString();
  shm::AttachRequest req{};
  req.magic = shm::kMagic;
  req.format_version = shm::kFormatVersion;
  req.dtype = dtype;
  req.dim = o.hello.dim();
  req.slots = o.slots;
  req.ring_bytes = o.ring_bytes;
  req.hello_bytes = static_cast<uint32_t>(hello_bytes.size());
  std::string packet(reinterpret_cast<const char*>(&req), sizeof(req));
  packet += hello_bytes;
  if (absl::Status s = shm::SendPacket(ch->sock_, packet, {}); !s.ok()) return s;

  std::string reply_bytes;
  std::vector<int> fds;
  absl::Status got =
      shm::ReceivePacket(ch->sock_, &reply_bytes, &fds, shm::kMaxAttachPacket);
  auto close_fds = [&] {
    for (int fd : fds) close(fd);
  };
  if (!got.ok()) {
    close_fds();
    return absl::UnavailableError(
        absl::StrCat("leapd did not answer the shm attach: ", got.message()));
  }
  shm::AttachReply reply;
  if (reply_bytes.size() < sizeof(reply)) {
    close_fds();
    return absl::DataLossError("short shm attach reply");
  }
  std::memcpy(&reply, reply_bytes.data(), sizeof(reply));
  const absl::string_view body =
      absl::string_view(reply_bytes).substr(sizeof(reply));
  if (reply.magic != shm::kMagic || reply.format_version != shm::kFormatVersion) {
    close_fds();
    return absl::FailedPreconditionError(absl::StrCat(
        "shm format version mismatch: the engine speaks ", shm::kFormatVersion,
        ", leapd answered ", reply.format_version));
  }
  if (reply.code != 0) {
    close_fds();
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        absl::StrCat("leapd refused the shm attach: ", body));
  }
  if (fds.size() != 2) {
    close_fds();
    return absl::DataLossError(
        absl::StrCat("shm attach reply carries ", fds.size(), " fds, want 2"));
  }
  if (!hello_ack->ParseFromArray(body.data(), static_cast<int>(body.size())) ||
      !hello_ack->has_hello_ack()) {
    close_fds();
    return absl::DataLossError("shm attach reply has no hello_ack");
  }
  const int seg_fd = fds[0];
  ch->wake_fd_ = fds[1];
  struct stat st;
  if (fstat(seg_fd, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < layout->total_bytes ||
      reply.segment_bytes != layout->total_bytes) {
    close(seg_fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "shm segment is ", st.st_size, " bytes (reply: ", reply.segment_bytes,
        "); the agreed layout needs ", layout->total_bytes));
  }
  ch->base_ = mmap(nullptr, layout->total_bytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED, seg_fd, 0);
  close(seg_fd);
  if (ch->base_ == MAP_FAILED) {
    ch->base_ = nullptr;
    return absl::UnavailableError(
        absl::StrCat("cannot map the shm segment: ", std::strerror(errno)));
  }
  ch->bytes_ = layout->total_bytes;
  if (absl::Status s =
          shm::CheckHeader(ch->base_, ch->bytes_, *layout, reply.attach_id);
      !s.ok()) {
    return s;
  }
  ch->layout_ = *layout;
  ch->attach_id_ = reply.attach_id;
  ch->hdr_ = static_cast<shm::SegmentHeader*>(ch->base_);
  char* b = static_cast<char*>(ch->base_);
  ch->out_ = shm::Ring(&ch->hdr_->to_sidecar, b + layout->to_sidecar_offset,
                       layout->ring_bytes);
  ch->in_ = shm::Ring(&ch->hdr_->to_engine, b + layout->to_engine_offset,
                      layout->ring_bytes);
  ch->slots_ = b + layout->slots_offset;
  ch->feature_bytes_ = static_cast<size_t>(layout->dim) * layout->dtype_size;
  ch->timeout_ = o.timeout;
  ch->spin_ns_ = absl::ToInt64Nanoseconds(o.spin);
  {
    absl::MutexLock lock(&ch->free_mu_);
    ch->free_.reserve(layout->slot_count);
    for (uint32_t i = layout->slot_count; i-- > 0;) ch->free_.push_back(i);
    ch->busy_.assign(layout->slot_count, 0);
  }
  tv = timeval{};
  setsockopt(ch->sock_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ch->monitor_ = std::thread([p = ch.get()] { p->MonitorLoop(); });
  return ch;
}

ShmChannel::~ShmChannel() {
  Close();
  if (monitor_.joinable()) monitor_.join();
  if (base_ != nullptr) munmap(base_, bytes_);
  if (sock_ >= 0) close(sock_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void ShmChannel::MonitorLoop() {
  // Blocks until leapd goes away (or says why it ends the attachment).
  std::string packet;
  std::vector<int> fds;
  absl::Status s = shm::ReceivePacket(sock_, &packet, &fds, shm::kMaxAttachPacket);
  for (int fd : fds) close(fd);
  std::string why = "leapd closed the shm attachment";
  if (s.ok() && packet.size() >= sizeof(shm::AttachReply)) {
    why = absl::StrCat("leapd ended the shm attachment: ",
                       packet.substr(sizeof(shm::AttachReply)));
  }
  {
    absl::MutexLock lock(&reason_mu_);
    if (reason_.empty()) reason_ = why;
  }
  closed_.store(true);
  if (hdr_ != nullptr) {
    hdr_->to_engine.wake.fetch_add(1);
    shm::FutexWakeAll(&hdr_->to_engine.wake);
  }
}

std::string ShmChannel::close_reason() const {
  absl::MutexLock lock(&reason_mu_);
  return reason_;
}

void ShmChannel::Close() {
  if (closed_.exchange(true) && sock_ < 0) return;
  {
    absl::MutexLock lock(&reason_mu_);
    if (reason_.empty()) reason_ = "closed by the engine";
  }
  if (hdr_ != nullptr) {
    hdr_->engine_closed.store(1);
    hdr_->to_engine.wake.fetch_add(1);
    shm::FutexWakeAll(&hdr_->to_engine.wake);
  }
  if (sock_ >= 0) shutdown(sock_, SHUT_RDWR);
}

void ShmChannel::Interrupt() {
  interrupted_.store(true);
  hdr_->to_engine.wake.fetch_add(1);
  shm::FutexWakeAll(&hdr_->to_engine.wake);
}

int64_t ShmChannel::AcquireSlot() {
  absl::MutexLock lock(&free_mu_);
  if (free_.empty()) return -1;
  const uint32_t s = free_.back();
  free_.pop_back();
  busy_[s] = 1;
  return s;
}

int ShmChannel::AcquireSlots(int n, std::vector<uint32_t>* out) {
  absl::MutexLock lock(&free_mu_);
  int got = 0;
  while (got < n && !free_.empty()) {
    const uint32_t s = free_.back();
    free_.pop_back();
    busy_[s] = 1;
    out->push_back(s);
    ++got;
  }
  return got;
}

void ShmChannel::ReturnSlot(uint32_t slot) {
  absl::MutexLock lock(&free_mu_);
  if (slot < busy_.size() && busy_[slot]) {
    busy_[slot] = 0;
    free_.push_back(slot);
  }
}

int64_t ShmChannel::free_slots() const {
  absl::MutexLock lock(&free_mu_);
  return static_cast<int64_t>(free_.size());
}

absl::Status ShmChannel::Reserve(size_t bytes, FrameKind kind, char** out) {
  if (bytes > out_.max_payload()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm frame of ", bytes, " bytes exceeds the ring's limit of ",
        out_.max_payload(), " bytes"));
  }
  const int64_t deadline = NowNs() + absl::ToInt64Nanoseconds(timeout_);
  for (int spins = 0;; ++spins) {
    if (closed_.load(std::memory_order_relaxed)) {
      return absl::UnavailableError(close_reason());
    }
    *out = out_.Reserve(bytes, kind);
    if (*out != nullptr) return absl::OkStatus();
    // The ring is full: leapd is behind. Make sure it knows there is work.
    Flush();
    if (NowNs() > deadline) {
      return absl::DeadlineExceededError(
          "shm ring to leapd stayed full past the timeout");
    }
    if (spins > 64) sched_yield();
  }
}

absl::Status ShmChannel::SendFeatures(uint64_t seq,
                                      absl::Span<const Record> records) {
  size_t bytes = sizeof(shm::FeaturesHead);
  for (const Record& r : records) {
    if (r.slot >= layout_.slot_count || r.request_id.size() > 0xffff ||
        r.product_line.size() > 0xffff) {
      return absl::InvalidArgumentError(absl::StrCat(
          "record '", r.request_id.substr(0, 64), "': slot ", r.slot,
          " of ", layout_.slot_count, " or id/product line too long"));
    }
    bytes += shm::FeatureRecordBytes(r.request_id.size(), r.product_line.size());
  }
  char* p;
  if (absl::Status s = Reserve(bytes, FrameKind::kFeatures, &p); !s.ok()) return s;
  const shm::FeaturesHead head{seq, static_cast<uint32_t>(records.size()), 0};
  std::memcpy(p, &head, sizeof(head));
  size_t at = sizeof(head);
  for (const Record& r : records) {
    at += shm::WriteFeatureRecord(p + at, r.slot, r.max_tokens, r.request_id,
                                  r.product_line);
  }
  out_.Commit();
  dirty_ = true;
  return absl::OkStatus();
}

absl::Status ShmChannel::SendCancels(uint64_t seq,
                                     absl::Span<const absl::string_view> ids) {
  size_t bytes = sizeof(shm::CancelsHead);
  for (absl::string_view id : ids) {
    if (id.size() > 0xffff) {
      return absl::InvalidArgumentError("request id longer than 65535 bytes");
    }
    bytes += sizeof(uint16_t) + id.size();
  }
  char* p;
  if (absl::Status s = Reserve(bytes, FrameKind::kCancels, &p); !s.ok()) return s;
  const shm::CancelsHead head{seq, static_cast<uint32_t>(ids.size()), 0};
  std::memcpy(p, &head, sizeof(head));
  size_t at = sizeof(head);
  for (absl::string_view id : ids) {
    const uint16_t len = static_cast<uint16_t>(id.size());
    std::memcpy(p + at, &len, sizeof(len));
    std::memcpy(p + at + sizeof(len), id.data(), id.size());
    at += sizeof(len) + id.size();
  }
  out_.Commit();
  dirty_ = true;
  return absl::OkStatus();
}

absl::Status ShmChannel::SendProto(const pb::EngineMessage& m) {
  const size_t n = m.ByteSizeLong();
  char* p;
  if (absl::Status s = Reserve(n, FrameKind::kProto, &p); !s.ok()) return s;
  m.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(p));
  out_.Commit();
  dirty_ = true;
  return absl::OkStatus();
}

absl::Status ShmChannel::SendRawForTesting(FrameKind kind,
                                           absl::string_view payload) {
  char* p;
  if (absl::Status s = Reserve(payload.size(), kind, &p); !s.ok()) return s;
  std::memcpy(p, payload.data(), payload.size());
  out_.Commit();
  dirty_ = true;
  return absl::OkStatus();
}

void ShmChannel::CorruptRingForTesting() {
  hdr_->to_sidecar.tail.store(hdr_->to_sidecar.head.load() + (uint64_t{1} << 40));
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void ShmChannel::Flush() {
  if (!dirty_) return;
  dirty_ = false;
  if (out_.Publish()) WakeLeapd();
}

void ShmChannel::WakeLeapd() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

absl::Status ShmChannel::Receive(ShmIncoming* in, absl::Duration timeout) {
  if (popped_) {
    in_.Pop();
    if (in_.ReleaseConsumed()) WakeLeapd();
    popped_ = false;
  }
  const int64_t start = NowNs();
  const int64_t limit = absl::ToInt64Nanoseconds(timeout);
  std::string error;
  for (;;) {
    shm::FrameHeader h;
    const char* p;
    const shm::Ring::Peek r = in_.Next(&h, &p, &error);
    if (r == shm::Ring::Peek::kCorrupt) {
      Close();
      return absl::DataLossError("corrupt ring from leapd: " + error);
    }
    if (r == shm::Ring::Peek::kFrame) {
      const size_t n = h.bytes;
      switch (static_cast<FrameKind>(h.kind)) {
        case FrameKind::kRelease: {
          uint32_t count;
          {
            absl::MutexLock lock(&free_mu_);
            count = shm::DecodeRelease(p, n, [this](uint32_t s) {
              free_mu_.AssertHeld();
              if (s < busy_.size() && busy_[s]) {
                if (on_release_) on_release_(s);
                busy_[s] = 0;
                free_.push_back(s);
              }
            });
          }
          in_.Pop();
          if (in_.ReleaseConsumed()) WakeLeapd();
          in->kind = ShmIncoming::Kind::kReleased;
          in->released = count;
          return absl::OkStatus();
        }
        case FrameKind::kPredictions: {
          in->kind = ShmIncoming::Kind::kPredictions;
          popped_ = true;
          thread_local std::vector<shm::PredictionView> preds;
          thread_local std::vector<shm::ErrorView> errs;
          const absl::Status s = shm::DecodePredictions(p, n, &in->seq, &preds, &errs);
          in->predictions.clear();
          in->errors.clear();
          for (const shm::PredictionView& v : preds) {
            in->predictions.push_back({v.slot, v.request_id, v.readout, v.arm,
                                       v.predicted_tokens, v.score, v.version});
          }
          for (const shm::ErrorView& e : errs) {
            in->errors.push_back({e.slot, e.code, e.request_id, e.message});
          }
          return s;
        }
        case FrameKind::kProto: {
          in->kind = ShmIncoming::Kind::kProto;
          popped_ = true;
          if (!in->proto.ParseFromArray(p, static_cast<int>(n))) {
            return absl::DataLossError("malformed SidecarMessage from leapd");
          }
          in->seq = in->proto.seq();
          return absl::OkStatus();
        }
        default:
          in_.Pop();
          if (in_.ReleaseConsumed()) WakeLeapd();
          continue;  // a kind from a newer leapd: skipped
      }
    }
    // Empty. The futex word is read before the checks below, so an
    // Interrupt or a close after them changes it and the wait returns.
    const uint32_t w = hdr_->to_engine.wake.load();
    if (!closed_.load() && hdr_->sidecar_closed.load()) {
      // leapd sends its reason on the socket before it marks the segment:
      // give the monitor thread a moment to record it.
      for (int i = 0; i < 100 && !closed_.load(); ++i) {
        const uint32_t w = hdr_->to_engine.wake.load();
        if (!closed_.load()) shm::FutexWait(&hdr_->to_engine.wake, w, 10'000'000);
      }
    }
    if (closed_.load() || hdr_->sidecar_closed.load()) {
      return absl::UnavailableError(close_reason().empty()
                                        ? std::string("leapd left")
                                        : close_reason());
    }
    if (interrupted_.load(std::memory_order_relaxed) &&
        interrupted_.exchange(false)) {
      return absl::DeadlineExceededError("interrupted");
    }
    const int64_t waited = NowNs() - start;
    if (waited >= limit) return absl::DeadlineExceededError("no frame yet");
    if (waited < spin_ns_) continue;
    if (in_.PrepareSleep()) {
      if (!closed_.load()) {
        shm::FutexWait(&hdr_->to_engine.wake, w,
                       std::min<int64_t>(limit - waited, 100'000'000));
      }
      in_.CancelSleep();
    }
  }
}

}  // namespace leap::shim
