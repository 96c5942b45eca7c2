#include "common/shm_format.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <new>

#include "absl/strings/str_cat.h"

namespace leap::shm {
namespace {

constexpr uint64_t Align(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

}  // namespace

uint32_t DTypeSize(uint32_t dtype) {
  switch (dtype) {
    case 1:
      return 4;
    case 2:
    case 3:
      return 2;
    default:
      return 0;
  }
}

absl::StatusOr<Layout> ComputeLayout(int64_t dim, uint32_t dtype,
                                     uint32_t slots, uint32_t ring_bytes) {
  Layout l;
  l.dtype_size = DTypeSize(dtype);
  if (l.dtype_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: dtype must be 1 (FLOAT32), 2 (BFLOAT16) or 3 (FLOAT16), got ",
        dtype));
  }
  if (dim < 1 || dim > (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: dim must be in [1, 1048576], got ", dim));
  }
  if (slots < 1 || slots > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: slot count must be in [1, ", kMaxSlots, "], got ", slots));
  }
  if (ring_bytes < kMinRingBytes || ring_bytes > kMaxRingBytes ||
      (ring_bytes & (ring_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: ring bytes must be a power of two in [", kMinRingBytes, ", ",
        kMaxRingBytes, "], got ", ring_bytes));
  }
  l.dim = dim;
  l.dtype = dtype;
  l.slot_count = slots;
  l.ring_bytes = ring_bytes;
  l.slot_bytes = static_cast<uint32_t>(Align(dim * l.dtype_size, 64));
  l.to_sidecar_offset = kHeaderBytes;
  l.to_engine_offset = l.to_sidecar_offset + ring_bytes;
  l.slots_offset = Align(l.to_engine_offset + ring_bytes, 4096);
  l.total_bytes =
      Align(l.slots_offset + uint64_t{l.slot_bytes} * slots, 4096);
  return l;
}

void InitHeader(void* base, const Layout& l, uint64_t attach_id) {
  auto* h = new (base) SegmentHeader();
  h->magic = kMagic;
  h->format_version = kFormatVersion;
  h->header_bytes = kHeaderBytes;
  h->attach_id = attach_id;
  h->dim = l.dim;
  h->dtype = l.dtype;
  h->slot_bytes = l.slot_bytes;
  h->slot_count = l.slot_count;
  h->ring_bytes = l.ring_bytes;
  h->to_sidecar_offset = l.to_sidecar_offset;
  h->to_engine_offset = l.to_engine_offset;
  h->slots_offset = l.slots_offset;
  h->total_bytes = l.total_bytes;
  h->engine_closed.store(0);
  h->sidecar_closed.store(0);
  for (RingControl* c : {&h->to_sidecar, &h->to_engine}) {
    c->head.store(0);
    c->tail.store(0);
    c->sleeping.store(0);
    c->space_wanted.store(0);
    c->wake.store(0);
  }
}

absl::Status CheckHeader(const void* base, size_t mapped_bytes,
                         const Layout& l, uint64_t attach_id) {
  if (mapped_bytes < sizeof(SegmentHeader)) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm segment of ", mapped_bytes, " bytes has no header"));
  }
  const auto* h = static_cast<const SegmentHeader*>(base);
  auto differs = [](const char* what, auto want, auto got) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm segment mismatch: ", what, " expected ", want, ", got ", got));
  };
  if (h->magic != kMagic) return differs("magic", kMagic, h->magic);
  if (h->format_version != kFormatVersion) {
    return differs("format version", kFormatVersion, h->format_version);
  }
  if (h->attach_id != attach_id) return differs("attach id", attach_id, h->attach_id);
  if (h->dim != l.dim) return differs("dim", l.dim, h->dim);
  if (h->dtype != l.dtype) return differs("dtype", l.dtype, h->dtype);
  if (h->slot_count != l.slot_count) {
    return differs("slot count", l.slot_count, h->slot_count);
  }
  if (h->slot_bytes != l.slot_bytes) {
    return differs("slot bytes", l.slot_bytes, h->slot_bytes);
  }
  if (h->ring_bytes != l.ring_bytes) {
    return differs("ring bytes", l.ring_bytes, h->ring_bytes);
  }
  if (h->to_sidecar_offset != l.to_sidecar_offset ||
      h->to_engine_offset != l.to_engine_offset ||
      h->slots_offset != l.slots_offset || h->total_bytes != l.total_bytes) {
    return differs("layout (offsets)", l.total_bytes, h->total_bytes);
  }
  if (mapped_bytes < l.total_bytes) {
    return differs("segment bytes", l.total_bytes, mapped_bytes);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------ Ring

void Ring::InitLocal() {
  // Every segment is fresh: both ends start at 0 (never from words the
  // other side could have written first).
  ptail_ = cached_head_ = chead_ = cached_tail_ = 0;
  initialized_ = true;
}

bool Ring::Fits(size_t payload) {
  if (!initialized_) InitLocal();
  const uint64_t frame = AlignFrame(sizeof(FrameHeader) + payload);
  if (frame > bytes_ / 4) return false;
  const uint64_t pos = ptail_ & (bytes_ - 1);
  const uint64_t need = bytes_ - pos < frame ? (bytes_ - pos) + frame : frame;
  auto room = [&] {
    const uint64_t used = ptail_ - cached_head_;
    return used <= bytes_ && bytes_ - used >= need;
  };
  if (room()) return true;
  cached_head_ = c_->head.load(std::memory_order_acquire);
  return room();
}

char* Ring::Reserve(size_t payload, FrameKind kind) {
  if (!Fits(payload)) return nullptr;
  const uint64_t frame = AlignFrame(sizeof(FrameHeader) + payload);
  uint64_t pos = ptail_ & (bytes_ - 1);
  if (bytes_ - pos < frame) {
    const FrameHeader pad{static_cast<uint32_t>(bytes_ - pos - sizeof(FrameHeader)),
                          static_cast<uint16_t>(FrameKind::kPad), 0};
    std::memcpy(data_ + pos, &pad, sizeof(pad));
    ptail_ += bytes_ - pos;
    pos = 0;
  }
  const FrameHeader h{static_cast<uint32_t>(payload),
                      static_cast<uint16_t>(kind), 0};
  std::memcpy(data_ + pos, &h, sizeof(h));
  reserved_ = data_ + pos + sizeof(FrameHeader);
  reserved_frame_ = static_cast<uint32_t>(frame);
  return reserved_;
}

void Ring::Commit() {
  ptail_ += reserved_frame_;
  reserved_frame_ = 0;
  reserved_ = nullptr;
}

bool Ring::Publish() {
  if (!initialized_) InitLocal();
  c_->tail.store(ptail_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return c_->sleeping.load(std::memory_order_relaxed) != 0 &&
         c_->sleeping.exchange(0) != 0;
}

Ring::Peek Ring::Next(FrameHeader* header, const char** payload,
                      std::string* error) {
  if (!initialized_) InitLocal();
  for (;;) {
    if (chead_ == cached_tail_) {
      cached_tail_ = c_->tail.load(std::memory_order_acquire);
    }
    const uint64_t avail = cached_tail_ - chead_;
    if (avail == 0) return Peek::kEmpty;
    if (avail > bytes_ || avail % kFrameAlign != 0) {
      *error = absl::StrCat("ring tail ", cached_tail_, " is out of range (head ",
                            chead_, ", ring ", bytes_, " bytes)");
      return Peek::kCorrupt;
    }
    const uint64_t pos = chead_ & (bytes_ - 1);
    const FrameHeader h = LoadUnaligned<FrameHeader>(data_ + pos);
    const uint64_t frame = AlignFrame(sizeof(FrameHeader) + uint64_t{h.bytes});
    if (uint64_t{h.bytes} > bytes_ || pos + frame > bytes_ || frame > avail) {
      *error = absl::StrCat("frame of ", h.bytes, " bytes at ring offset ", pos,
                            " runs past the published data (", avail,
                            " bytes) or the ring end");
      return Peek::kCorrupt;
    }
    if (h.kind == static_cast<uint16_t>(FrameKind::kPad)) {
      chead_ += frame;
      continue;
    }
    *header = h;
    *payload = data_ + pos + sizeof(FrameHeader);
    peeked_frame_ = static_cast<uint32_t>(frame);
    return Peek::kFrame;
  }
}

void Ring::Pop() {
  chead_ += peeked_frame_;
  peeked_frame_ = 0;
}

bool Ring::ReleaseConsumed() {
  c_->head.store(chead_, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return c_->space_wanted.load(std::memory_order_relaxed) != 0 &&
         c_->space_wanted.exchange(0) != 0;
}

bool Ring::PrepareWaitForSpace(size_t payload) {
  c_->space_wanted.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (Fits(payload)) {
    c_->space_wanted.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

bool Ring::Empty() const {
  return c_->tail.load(std::memory_order_acquire) == chead_;
}

bool Ring::PrepareSleep() {
  c_->sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!Empty()) {
    c_->sleeping.store(0, std::memory_order_relaxed);
    return false;
  }
  return true;
}

void Ring::CancelSleep() { c_->sleeping.store(0, std::memory_order_relaxed); }

// ---------------------------------------------------------------- codecs

FeaturesReader::FeaturesReader(const char* payload, size_t bytes)
    : p_(payload), bytes_(bytes) {}

absl::Status FeaturesReader::Init(uint64_t* seq, uint32_t* count) {
  if (bytes_ < sizeof(FeaturesHead)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "features frame of ", bytes_, " bytes is shorter than its head"));
  }
  const auto h = LoadUnaligned<FeaturesHead>(p_);
  *seq = h.seq;
  *count = h.count;
  pos_ = sizeof(FeaturesHead);
  if (uint64_t{h.count} * sizeof(FeatureRecordHead) > bytes_ - pos_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "features frame claims ", h.count, " records in ", bytes_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status FeaturesReader::Next(FeatureRecordView* out) {
  if (bytes_ - pos_ < sizeof(FeatureRecordHead)) {
    return absl::InvalidArgumentError("features frame ends inside a record");
  }
  const auto h = LoadUnaligned<FeatureRecordHead>(p_ + pos_);
  const size_t n = FeatureRecordBytes(h.id_len, h.product_line_len);
  if (n > bytes_ - pos_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature record of ", n, " bytes overruns its frame (", bytes_ - pos_,
        " bytes left)"));
  }
  const char* s = p_ + pos_ + sizeof(FeatureRecordHead);
  out->slot = h.slot;
  out->max_tokens = h.max_tokens;
  out->request_id = absl::string_view(s, h.id_len);
  out->product_line = absl::string_view(s + h.id_len, h.product_line_len);
  pos_ += n;
  return absl::OkStatus();
}

absl::Status DecodePredictions(const char* p, size_t n, uint64_t* seq,
                               std::vector<PredictionView>* predictions,
                               std::vector<ErrorView>* errors) {
  predictions->clear();
  errors->clear();
  if (n < sizeof(PredictionsHead)) {
    return absl::DataLossError("short predictions frame from leapd");
  }
  const auto head = LoadUnaligned<PredictionsHead>(p);
  *seq = head.seq;
  size_t at = sizeof(head);
  for (uint32_t i = 0; i < head.predictions; ++i) {
    if (n - at < sizeof(PredictionRecordHead)) {
      return absl::DataLossError("truncated prediction record");
    }
    const auto ph = LoadUnaligned<PredictionRecordHead>(p + at);
    const size_t len = PredictionRecordBytes(ph.id_len, ph.readout_len, ph.arm_len);
    if (len > n - at) return absl::DataLossError("prediction overruns frame");
    const char* s = p + at + sizeof(ph);
    predictions->push_back(
        {ph.slot, absl::string_view(s, ph.id_len),
         absl::string_view(s + ph.id_len, ph.readout_len),
         absl::string_view(s + ph.id_len + ph.readout_len, ph.arm_len),
         ph.predicted_tokens, ph.score, ph.version});
    at += len;
  }
  for (uint32_t i = 0; i < head.errors; ++i) {
    if (n - at < sizeof(ErrorRecordHead)) {
      return absl::DataLossError("truncated error record");
    }
    const auto eh = LoadUnaligned<ErrorRecordHead>(p + at);
    const size_t len = ErrorRecordBytes(eh.id_len, eh.message_len);
    if (len > n - at) return absl::DataLossError("error overruns frame");
    const char* s = p + at + sizeof(eh);
    errors->push_back({eh.slot, eh.code, absl::string_view(s, eh.id_len),
                       absl::string_view(s + eh.id_len, eh.message_len)});
    at += len;
  }
  return absl::OkStatus();
}

uint32_t DecodeRelease(const char* p, size_t n,
                       const std::function<void(uint32_t)>& slot) {
  if (n < sizeof(ReleaseHead)) return 0;
  const auto rh = LoadUnaligned<ReleaseHead>(p);
  const uint64_t count =
      std::min<uint64_t>(rh.count, (n - sizeof(rh)) / sizeof(uint32_t));
  for (uint64_t i = 0; i < count; ++i) {
    slot(LoadUnaligned<uint32_t>(p + sizeof(rh) + sizeof(uint32_t) * i));
  }
  return static_cast<uint32_t>(count);
}

absl::Status DecodeCancels(const char* p, size_t n, uint64_t* seq,
                           std::vector<absl::string_view>* ids) {
  ids->clear();
  *seq = 0;
  if (n < sizeof(CancelsHead)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cancels frame of ", n, " bytes overruns itself (0 ids claimed); "
        "nothing cancelled"));
  }
  const auto head = LoadUnaligned<CancelsHead>(p);
  *seq = head.seq;
  size_t at = sizeof(head);
  for (uint32_t i = 0; i < head.count; ++i) {
    uint16_t len;
    if (n - at < sizeof(len) ||
        (len = LoadUnaligned<uint16_t>(p + at), n - at - sizeof(len) < len)) {
      ids->clear();
      return absl::InvalidArgumentError(absl::StrCat(
          "cancels frame of ", n, " bytes overruns itself (", head.count,
          " ids claimed); nothing cancelled"));
    }
    at += sizeof(len);
    ids->emplace_back(p + at, len);
    at += len;
  }
  return absl::OkStatus();
}

size_t WriteFeatureRecord(char* out, uint32_t slot, int64_t max_tokens,
                          absl::string_view id, absl::string_view pl) {
  const FeatureRecordHead h{slot, static_cast<uint16_t>(id.size()),
                            static_cast<uint16_t>(pl.size()), max_tokens};
  std::memcpy(out, &h, sizeof(h));
  char* s = out + sizeof(h);
  std::memcpy(s, id.data(), id.size());
  std::memcpy(s + id.size(), pl.data(), pl.size());
  return FeatureRecordBytes(id.size(), pl.size());
}

size_t WritePredictionRecord(char* out, uint32_t slot, absl::string_view id,
                             absl::string_view readout, absl::string_view arm,
                             double predicted_tokens, double score,
                             int64_t version) {
  const PredictionRecordHead h{slot,
                               static_cast<uint16_t>(id.size()),
                               static_cast<uint8_t>(readout.size()),
                               static_cast<uint8_t>(arm.size()),
                               predicted_tokens,
                               score,
                               version};
  std::memcpy(out, &h, sizeof(h));
  char* s = out + sizeof(h);
  std::memcpy(s, id.data(), id.size());
  std::memcpy(s + id.size(), readout.data(), readout.size());
  std::memcpy(s + id.size() + readout.size(), arm.data(), arm.size());
  return PredictionRecordBytes(id.size(), readout.size(), arm.size());
}

size_t WriteErrorRecord(char* out, uint32_t slot, absl::string_view id,
                        int32_t code, absl::string_view message) {
  const ErrorRecordHead h{slot, code, static_cast<uint16_t>(id.size()),
                          static_cast<uint16_t>(message.size()), 0};
  std::memcpy(out, &h, sizeof(h));
  char* s = out + sizeof(h);
  std::memcpy(s, id.data(), id.size());
  std::memcpy(s + id.size(), message.data(), message.size());
  return ErrorRecordBytes(id.size(), message.size());
}

// ------------------------------------------------------------ OS helpers

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               int64_t timeout_ns) {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = timeout_ns / 1'000'000'000;
    ts.tv_nsec = timeout_ns % 1'000'000'000;
    tsp = &ts;
  }
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected,
          tsp, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX,
          nullptr, nullptr, 0);
}

absl::Status SendPacket(int sock, absl::string_view bytes,
                        const std::vector<int>& fds) {
  if (fds.size() > 4) return absl::InvalidArgumentError("at most 4 fds");
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    return absl::UnavailableError(
        absl::StrCat("shm: sendmsg failed: ", std::strerror(errno)));
  }
}

absl::Status ReceivePacket(int sock, std::string* bytes, std::vector<int>* fds,
                           size_t max_bytes) {
  bytes->resize(max_bytes);
  iovec iov{bytes->data(), max_bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return absl::DeadlineExceededError("shm: no packet yet");
    }
    return absl::UnavailableError(
        absl::StrCat("shm: recvmsg failed: ", std::strerror(errno)));
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->push_back(fd);
      }
    }
  }
  if (n == 0) return absl::UnavailableError("shm: peer closed the socket");
  if (msg.msg_flags & MSG_TRUNC) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: control packet larger than ", max_bytes, " bytes"));
  }
  if (msg.msg_flags & MSG_CTRUNC) {
    return absl::FailedPreconditionError(
        "shm: control packet with more file descriptors than expected");
  }
  bytes->resize(static_cast<size_t>(n));
  return absl::OkStatus();
}

}  // namespace leap::shm
