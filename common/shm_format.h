// The shared-memory data plane's layout, shared by leapd and the engine shim.
//
// One segment per attached engine, created by leapd and handed to the engine
// over the attach socket (SCM_RIGHTS), so one engine can never touch another's
// memory and an engine that dies takes nothing but its own segment with it:
//
//   SegmentHeader (4 KiB)   magic, format version, d, dtype, slot count, the
//                           byte offsets below, and the two rings' control
//                           words on separate cache lines
//   to-sidecar ring         engine -> leapd frames (ring_bytes, power of two)
//   to-engine ring          leapd -> engine frames (ring_bytes)
//   slot arena              slot_count feature slots of slot_bytes each
//                           (d values of dtype, rounded up to 64 bytes)
//
// Both rings are single-producer/single-consumer byte rings of 8-byte
// aligned frames (FrameHeader + payload). A frame never wraps: a producer
// that reaches the end of the ring writes a kPad frame to it. Every index,
// length and count read from the segment is checked before it is followed
// (the other side may be buggy or hostile): a bad one makes the reader
// declare the segment corrupt, never read outside it.
//
// Wake-ups: a consumer spins briefly, then sets its ring's `sleeping` word,
// re-checks, and sleeps; a producer that sees `sleeping` after publishing
// clears it and wakes the consumer. leapd sleeps in epoll on one eventfd per
// engine (passed to the engine with the segment), the engine on a futex on
// its ring's `wake` word, so an idle pair burns no CPU.
#ifndef LEAP_COMMON_SHM_FORMAT_H_
#define LEAP_COMMON_SHM_FORMAT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace leap::shm {

inline constexpr uint64_t kMagic = 0x314d48535041454cULL;  // "LEAPSHM1"
inline constexpr uint32_t kFormatVersion = 2;  // 2: RingControl::space_wanted
inline constexpr size_t kHeaderBytes = 4096;
inline constexpr size_t kFrameAlign = 8;

// Control words of one ring. The producer owns `tail`, the consumer `head`;
// each sits on its own cache line so the two cores do not share one.
struct RingControl {
  alignas(64) std::atomic<uint64_t> tail;  // bytes ever published
  alignas(64) std::atomic<uint64_t> head;  // bytes ever consumed
  // Set by a consumer about to sleep; cleared by whoever wakes it.
  alignas(64) std::atomic<uint32_t> sleeping;
  // Set by a producer that waits for room; the consumer that frees some
  // clears it and wakes the producer.
  std::atomic<uint32_t> space_wanted;
  // Futex word bumped on every wake-up (engine side).
  std::atomic<uint32_t> wake;
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct SegmentHeader {
  uint64_t magic;
  uint32_t format_version;
  uint32_t header_bytes;
  // Random id of this attachment; the engine checks it against the reply.
  uint64_t attach_id;
  int64_t dim;
  uint32_t dtype;  // leap.v1.FeatureDType number
  uint32_t slot_bytes;
  uint32_t slot_count;
  uint32_t ring_bytes;
  uint64_t to_sidecar_offset;
  uint64_t to_engine_offset;
  uint64_t slots_offset;
  uint64_t total_bytes;
  // Set by a side that is leaving (the other stops waiting on it).
  alignas(64) std::atomic<uint32_t> engine_closed;
  std::atomic<uint32_t> sidecar_closed;
  RingControl to_sidecar;
  RingControl to_engine;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

// What a segment holds, and where.
struct Layout {
  int64_t dim = 0;
  uint32_t dtype = 0;
  uint32_t dtype_size = 0;
  uint32_t slot_bytes = 0;
  uint32_t slot_count = 0;
  uint32_t ring_bytes = 0;
  uint64_t to_sidecar_offset = 0;
  uint64_t to_engine_offset = 0;
  uint64_t slots_offset = 0;
  uint64_t total_bytes = 0;
};

// Bounds on what one attachment may ask for.
inline constexpr uint32_t kMinRingBytes = 64 << 10;
inline constexpr uint32_t kMaxRingBytes = 64 << 20;
inline constexpr uint32_t kMaxSlots = 1 << 20;

// Element size of a leap.v1.FeatureDType number; 0 when unknown.
uint32_t DTypeSize(uint32_t dtype);

// The layout for d values of `dtype` in `slots` slots and rings of
// `ring_bytes`; INVALID_ARGUMENT naming the bad value.
absl::StatusOr<Layout> ComputeLayout(int64_t dim, uint32_t dtype,
                                     uint32_t slots, uint32_t ring_bytes);

// Writes a fresh header for `layout` at `base` (zeroed memory).
void InitHeader(void* base, const Layout& layout, uint64_t attach_id);

// Checks a mapped header of `mapped_bytes` against what was agreed:
// FAILED_PRECONDITION naming the first field that differs.
absl::Status CheckHeader(const void* base, size_t mapped_bytes,
                         const Layout& expected, uint64_t attach_id);

// ---------------------------------------------------------------- frames

enum class FrameKind : uint16_t {
  kPad = 0,          // filler to the ring's end
  kProto = 1,        // a serialized leap.v1 EngineMessage / SidecarMessage
  kFeatures = 2,     // engine -> leapd: records whose features are in slots
  kPredictions = 3,  // leapd -> engine: the answer to one kFeatures frame
  kRelease = 4,      // leapd -> engine: slots leapd no longer reads
  kCancels = 5,      // engine -> leapd: a CancelBatch without protobuf
};

struct FrameHeader {
  uint32_t bytes;  // payload bytes (the frame takes them rounded up to 8)
  uint16_t kind;
  uint16_t reserved;
};
static_assert(sizeof(FrameHeader) == 8);

// Reads a T from possibly unaligned memory another process may be writing:
// one copy, taken once (fields are then checked on the copy).
template <typename T>
T LoadUnaligned(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

inline constexpr size_t AlignFrame(size_t n) {
  return (n + kFrameAlign - 1) & ~(kFrameAlign - 1);
}

// One ring as seen by its producer or its consumer. Not thread-safe: one
// producer thread and one consumer thread per ring.
class Ring {
 public:
  Ring() = default;
  Ring(RingControl* control, char* data, uint32_t bytes)
      : c_(control), data_(data), bytes_(bytes) {}

  // Largest payload one frame may carry (a quarter of the ring).
  size_t max_payload() const { return bytes_ / 4 - sizeof(FrameHeader); }

  // --- producer
  // Space for a `payload`-byte frame, or null when the ring is too full.
  // Frames reserved and committed become visible at Publish().
  char* Reserve(size_t payload, FrameKind kind);
  void Commit();
  // Makes committed frames visible; returns true when the consumer was
  // sleeping (the caller wakes it).
  bool Publish();
  // Whether a `payload`-byte frame fits right now.
  bool Fits(size_t payload);
  // About to wait for room for a `payload`-byte frame: announces it, then
  // re-checks. False (announcement withdrawn) when it fits now.
  bool PrepareWaitForSpace(size_t payload);

  // --- consumer
  enum class Peek { kFrame, kEmpty, kCorrupt };
  // The next frame, or kEmpty, or kCorrupt (with `error` saying what)
  // when an index or length is out of range.
  Peek Next(FrameHeader* header, const char** payload, std::string* error);
  // Consumes the frame returned by Next (visible to the producer at
  // ReleaseConsumed()).
  void Pop();
  // Returns true when the producer waits for room (the caller wakes it).
  bool ReleaseConsumed();
  // Cheap emptiness check (acquire load of the producer's tail).
  bool Empty() const;
  // Marks this consumer sleeping; returns false (and clears it) when a
  // frame arrived meanwhile (Dekker with Publish's fence).
  bool PrepareSleep();
  void CancelSleep();
  RingControl* control() const { return c_; }

 private:
  RingControl* c_ = nullptr;
  char* data_ = nullptr;
  uint32_t bytes_ = 0;
  // Producer-local.
  uint64_t ptail_ = 0;       // committed, maybe not yet published
  uint64_t cached_head_ = 0;
  char* reserved_ = nullptr;
  uint32_t reserved_frame_ = 0;
  // Consumer-local.
  uint64_t chead_ = 0;
  uint64_t cached_tail_ = 0;
  uint32_t peeked_frame_ = 0;
  bool initialized_ = false;
  void InitLocal();
};

// ------------------------------------------------------- payload codecs
// Little-endian host layouts (the two sides share one machine).

struct FeaturesHead {
  uint64_t seq;
  uint32_t count;
  uint32_t reserved;
};
struct FeatureRecordHead {
  uint32_t slot;
  uint16_t id_len;
  uint16_t product_line_len;
  int64_t max_tokens;
};  // then id, product line, padding to 8
struct PredictionsHead {
  uint64_t seq;
  uint32_t predictions;
  uint32_t errors;
};
struct PredictionRecordHead {
  uint32_t slot;
  uint16_t id_len;
  uint8_t readout_len;
  uint8_t arm_len;
  double predicted_tokens;
  double score;
  int64_t version;
};  // then id, readout, arm, padding to 8
struct ErrorRecordHead {
  uint32_t slot;
  int32_t code;
  uint16_t id_len;
  uint16_t message_len;
  uint32_t reserved;
};  // then id, message, padding to 8
struct CancelsHead {
  uint64_t seq;
  uint32_t count;
  uint32_t reserved;
};  // then count x (uint16 length, id bytes), unpadded
struct ReleaseHead {
  uint32_t count;
  uint32_t reserved;
};  // then count uint32 slot indices

// A feature record decoded (views into the frame payload).
struct FeatureRecordView {
  uint32_t slot;
  int64_t max_tokens;
  absl::string_view request_id;
  absl::string_view product_line;
};

// Walks a kFeatures payload, checking every length against the payload.
class FeaturesReader {
 public:
  FeaturesReader(const char* payload, size_t bytes);
  // INVALID_ARGUMENT when the head is malformed.
  absl::Status Init(uint64_t* seq, uint32_t* count);
  // The next record; INVALID_ARGUMENT when it overruns the payload.
  absl::Status Next(FeatureRecordView* out);

 private:
  const char* p_;
  size_t bytes_, pos_ = 0;
};

// A kPredictions payload decoded (views into the payload).
struct PredictionView {
  uint32_t slot;
  absl::string_view request_id, readout, arm;
  double predicted_tokens, score;
  int64_t version;
};
struct ErrorView {
  uint32_t slot;
  int32_t code;
  absl::string_view request_id, message;
};
// Decodes a kPredictions payload (leapd -> engine), checking every length
// against it. DATA_LOSS when the head or a record overruns the payload;
// `predictions` and `errors` then hold the records read before it.
absl::Status DecodePredictions(const char* payload, size_t bytes,
                               uint64_t* seq,
                               std::vector<PredictionView>* predictions,
                               std::vector<ErrorView>* errors);
// Decodes a kRelease payload (leapd -> engine): the slot indices it holds,
// at most as many as fit in the payload whatever its head claims (a short
// head: none). Returns how many it passed to `slot`.
uint32_t DecodeRelease(const char* payload, size_t bytes,
                       const std::function<void(uint32_t)>& slot);
// Decodes a kCancels payload (engine -> leapd): its seq (0 when even the
// head is short) and request ids (views into the payload).
// INVALID_ARGUMENT, with no ids, when an id overruns the payload.
absl::Status DecodeCancels(const char* payload, size_t bytes, uint64_t* seq,
                           std::vector<absl::string_view>* ids);

inline size_t FeatureRecordBytes(size_t id, size_t product_line) {
  return AlignFrame(sizeof(FeatureRecordHead) + id + product_line);
}
inline size_t PredictionRecordBytes(size_t id, size_t readout, size_t arm) {
  return AlignFrame(sizeof(PredictionRecordHead) + id + readout + arm);
}
inline size_t ErrorRecordBytes(size_t id, size_t message) {
  return AlignFrame(sizeof(ErrorRecordHead) + id + message);
}

// Appends a record at `out` (which has room); returns the bytes written.
size_t WriteFeatureRecord(char* out, uint32_t slot, int64_t max_tokens,
                          absl::string_view id, absl::string_view product_line);
size_t WritePredictionRecord(char* out, uint32_t slot, absl::string_view id,
                             absl::string_view readout, absl::string_view arm,
                             double predicted_tokens, double score,
                             int64_t version);
size_t WriteErrorRecord(char* out, uint32_t slot, absl::string_view id,
                        int32_t code, absl::string_view message);

// ------------------------------------------------------------- attaching
// Over the attach socket (SOCK_SEQPACKET): the engine sends AttachRequest +
// a serialized leap.v1.EngineMessage (hello); leapd answers AttachReply +
// a serialized leap.v1.SidecarMessage (hello_ack) with the segment and
// wake eventfd as SCM_RIGHTS, or with code != 0 and an error text and no
// fds. The socket stays open for the attachment's life: its hang-up is how
// each side learns that the other died.

struct AttachRequest {
  uint64_t magic;
  uint32_t format_version;
  uint32_t dtype;
  int64_t dim;
  uint32_t slots;
  uint32_t ring_bytes;
  uint32_t hello_bytes;
  uint32_t reserved;
};
struct AttachReply {
  uint64_t magic;
  uint32_t format_version;
  int32_t code;  // absl/google.rpc code; 0 = attached
  uint64_t attach_id;
  uint64_t segment_bytes;
  uint32_t body_bytes;  // hello_ack or error text
  uint32_t reserved;
};
inline constexpr size_t kMaxAttachPacket = 64 << 10;

// ------------------------------------------------------------ OS helpers

// Sleeps on a futex word while it equals `expected`, at most `timeout_ns`
// (< 0 = no limit). Works across processes on a shared mapping.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected,
               int64_t timeout_ns);
void FutexWakeAll(std::atomic<uint32_t>* word);

// A seqpacket message with up to 4 file descriptors.
absl::Status SendPacket(int sock, absl::string_view bytes,
                        const std::vector<int>& fds);
// Receives one packet (EOF -> UNAVAILABLE; nothing to read on a
// non-blocking socket -> DEADLINE_EXCEEDED; a packet over `max_bytes` ->
// INVALID_ARGUMENT; more than 4 fds -> FAILED_PRECONDITION); received fds go
// to `fds`.
absl::Status ReceivePacket(int sock, std::string* bytes,
                           std::vector<int>* fds, size_t max_bytes);

}  // namespace leap::shm

#endif  // LEAP_COMMON_SHM_FORMAT_H_
