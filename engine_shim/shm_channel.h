// The engine's end of one shared-memory attachment to leapd (layout in
// common/shm_format.h). Low level and allocation-free on the hot path: the
// engine (or the GPU's DMA, see capture.h) writes features straight into a
// slot, submits slot indices, and reads predictions as views. The Client
// reaches it through the Transport returned by Dial("shm://...").
//
// Threads: AcquireSlot/ReleaseSlot any thread; the Send* calls and Flush
// from one producer thread; Receive from one consumer thread; Close any.
#ifndef LEAP_ENGINE_SHIM_SHM_CHANNEL_H_
#define LEAP_ENGINE_SHIM_SHM_CHANNEL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/shm_format.h"
#include "leap/v1/predictor.pb.h"

namespace leap::shim {

struct ShmChannelOptions {
  // Path of leapd's attach socket (the endpoint without "shm://").
  std::string path;
  // Sent to leapd; dim and dtype size the slots.
  leap::v1::Hello hello;
  // Feature slots: every live request holds one until leapd releases it,
  // so size it for the engine's resident requests plus a batch in flight.
  // Default: 1024 (16 MiB at d = 4096 fp32)
  uint32_t slots = 1024;
  // Bytes of each ring (power of two). Default: 1 MiB
  uint32_t ring_bytes = 1 << 20;
  // Attach and send deadline. Default: 1 s
  absl::Duration timeout = absl::Seconds(1);
  // Receive polls this long before sleeping on the futex. Default: 20 us
  absl::Duration spin = absl::Microseconds(20);
};

// A prediction or error record of a kPredictions frame (views into the
// ring, valid until the next Receive).
struct ShmPrediction {
  uint32_t slot;
  absl::string_view request_id, readout, arm;
  double predicted_tokens, score;
  int64_t version;
};
struct ShmError {
  uint32_t slot;
  int32_t code;
  absl::string_view request_id, message;
};

// One frame from leapd. Release frames are handled inside Receive (the
// slots go back to the free list) and reported only as a count.
struct ShmIncoming {
  enum class Kind { kPredictions, kProto, kReleased } kind;
  uint64_t seq = 0;
  std::vector<ShmPrediction> predictions;
  std::vector<ShmError> errors;
  leap::v1::SidecarMessage proto;
  uint32_t released = 0;
};

class ShmChannel {
 public:
  // Connects, sends the hello with the wanted layout, maps the segment and
  // checks its header. FAILED_PRECONDITION / RESOURCE_EXHAUSTED /
  // INVALID_ARGUMENT carry leapd's reason when it refuses; UNAVAILABLE when
  // nobody listens. `hello_ack` receives leapd's answer.
  static absl::StatusOr<std::unique_ptr<ShmChannel>> Attach(
      const ShmChannelOptions& options, leap::v1::SidecarMessage* hello_ack);
  ~ShmChannel();

  uint32_t slot_count() const { return layout_.slot_count; }
  // Bytes of one slot's features (dim * dtype size).
  size_t feature_bytes() const { return feature_bytes_; }
  char* slot(uint32_t i) const { return slots_ + size_t{layout_.slot_bytes} * i; }
  // The whole arena (for cudaHostRegister).
  char* arena() const { return slots_; }
  size_t arena_bytes() const {
    return size_t{layout_.slot_bytes} * layout_.slot_count;
  }
  uint64_t attach_id() const { return attach_id_; }
  // Largest payload of one frame to leapd.
  size_t max_frame_payload() const { return out_.max_payload(); }

  // A free slot, or -1 when every slot is submitted and not yet released.
  int64_t AcquireSlot();
  // Gives back a slot acquired but never submitted.
  void ReturnSlot(uint32_t slot);
  int64_t free_slots() const;

  struct Record {
    uint32_t slot;
    absl::string_view request_id;
    absl::string_view product_line;
    int64_t max_tokens = 0;
  };
  // Queues one kFeatures frame; waits (up to the timeout) for ring space.
  // The slots belong to leapd until it releases them.
  absl::Status SendFeatures(uint64_t seq, absl::Span<const Record> records);
  absl::Status SendProto(const leap::v1::EngineMessage& m);
  // A CancelBatch as one kCancels frame (no protobuf on either side);
  // answered by an Ack like the proto message.
  absl::Status SendCancels(uint64_t seq, absl::Span<const absl::string_view> ids);
  // Called by Receive with each slot leapd releases, before the slot can
  // be acquired again (under the free list's lock: it must not call back
  // into the channel). Set it before the first Receive.
  void SetReleaseHook(std::function<void(uint32_t)> hook) {
    on_release_ = std::move(hook);
  }
  // Up to `n` free slots appended to `out` (one lock); returns how many.
  int AcquireSlots(int n, std::vector<uint32_t>* out);
  // Makes queued frames visible and wakes leapd if it sleeps.
  void Flush();

  // The next frame, waiting at most `timeout` (kTimeout-like: returns
  // DEADLINE_EXCEEDED); UNAVAILABLE once leapd left or the channel closed;
  // DATA_LOSS when leapd's ring is corrupt.
  absl::Status Receive(ShmIncoming* in, absl::Duration timeout);

  // Makes a Receive that waits return DEADLINE_EXCEEDED now. Any thread.
  void Interrupt();

  // Detaches: leapd reclaims this engine's requests. Any thread.
  void Close();
  bool closed() const { return closed_.load(); }
  // Why leapd ended the attachment ("" while open).
  std::string close_reason() const;

  // Tests only: queues a frame with any payload (to play a buggy or
  // hostile engine), and the raw segment header.
  absl::Status SendRawForTesting(shm::FrameKind kind, absl::string_view payload);
  shm::SegmentHeader* header_for_testing() const { return hdr_; }
  // Tests only: moves the published tail far past the head and wakes leapd.
  void CorruptRingForTesting();

 private:
  ShmChannel() = default;
  void MonitorLoop();
  void WakeLeapd();
  absl::Status Reserve(size_t bytes, shm::FrameKind kind, char** out);

  int sock_ = -1;
  int wake_fd_ = -1;  // leapd's eventfd for this attachment
  void* base_ = nullptr;
  size_t bytes_ = 0;
  shm::SegmentHeader* hdr_ = nullptr;
  shm::Layout layout_;
  std::function<void(uint32_t)> on_release_;
  char* slots_ = nullptr;
  size_t feature_bytes_ = 0;
  uint64_t attach_id_ = 0;
  shm::Ring out_, in_;
  absl::Duration timeout_;
  int64_t spin_ns_ = 0;
  bool dirty_ = false;
  bool popped_ = false;

  mutable absl::Mutex free_mu_;
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(free_mu_);
  std::vector<uint8_t> busy_ ABSL_GUARDED_BY(free_mu_);

  std::atomic<bool> closed_{false};
  std::atomic<bool> interrupted_{false};
  mutable absl::Mutex reason_mu_;  // never held with free_mu_
  std::string reason_ ABSL_GUARDED_BY(reason_mu_);
  std::thread monitor_;
};

}  // namespace leap::shim

#endif  // LEAP_ENGINE_SHIM_SHM_CHANNEL_H_
