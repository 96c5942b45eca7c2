// One engine attached to leapd's shared-memory data plane: its mapped
// segment, rings and slot leases, its live requests, and the decoding of its
// frames into Core calls and of Core's answers into frames
// (sidecar/shm/shm_server.h describes the protocol, common/shm_format.h the
// layout). Internal to leap::sidecar_shm.
//
// Threads: a ShmSession belongs to the shm server thread (the loop in
// shm_server.cc); every member and method is touched there only, except
//   - OnPublish (the publish hub's thread), which takes pub_mu;
//   - has_publish, parked_ready and the Waker, which are atomics (a parked
//     completions answer's OnReady, on a NATS thread, sets parked_ready and
//     wakes the loop);
//   - Mapping::Release, which any thread may call (a request destroyed on an
//     RLS or gRPC thread).
// The loop's shutdown (ShmServer::Stop) calls Detach after joining the
// thread, so it too is then the only thread.
#ifndef LEAP_SIDECAR_SHM_INTERNAL_SHM_SESSION_H_
#define LEAP_SIDECAR_SHM_INTERNAL_SHM_SESSION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/shm_format.h"
#include "leap/v1/predictor.pb.h"
#include "sidecar/core/core.h"
#include "sidecar/core/engine_messages.h"

namespace leap::sidecar::shm_internal {

// Answers buffered for an engine whose ring is full before it is detached.
inline constexpr size_t kMaxPendingBytes = size_t{64} << 20;

// Wakes the server thread from any thread (slot releases, publishes).
// Notify: any thread. The loop owns efd and the sleeping flag.
struct Waker {
  int efd = -1;
  std::atomic<bool> sleeping{false};
  std::atomic<bool> pending{false};
  ~Waker();
  void Notify();
};

// Marks the calling thread as the shm server thread: slots released on it
// are flushed by the loop itself, without a wake-up. Called once by the
// loop.
void MarkServerThread();

// An engine's mapped segment, and the slots its live requests no longer
// read: a bitmap any thread sets (Release) and the server thread drains
// (Drain) into kRelease frames. Outlives its session while any live request
// still reads a slot.
struct Mapping final : public ExternalFeatures {
  void* base = nullptr;
  size_t bytes = 0;
  std::shared_ptr<Waker> waker;
  std::unique_ptr<std::atomic<uint64_t>[]> released;
  size_t words = 0;
  std::atomic<bool> any_released{false};

  explicit Mapping(size_t slots);
  ~Mapping() override;
  // Any thread.
  void Release(uint32_t slot) override;
  // Server thread: appends the released slots to `out` and clears them.
  void Drain(std::vector<uint32_t>* out);
};

// Buffers the server thread reuses for every session's frames (one set per
// server; server thread only).
struct SessionScratch {
  std::string preds, errs;
  std::vector<std::pair<shm::FeatureRecordView, int>> records;
  std::vector<ScoreRequest> reqs;
  std::vector<absl::StatusOr<ScoreResult>> results;
  std::vector<std::shared_ptr<LiveRequest>> lives;
  std::vector<absl::string_view> cancel_ids;
  std::vector<uint32_t> released;
};

// One connection to the attach socket, then (once attached) one engine.
// The attach handshake (shm_attach.h) fills the segment fields; the loop
// owns the session's lifetime.
struct ShmSession final : public PublishListener, public LiveTracker {
  // Set by the loop when it accepts the connection.
  Core* core = nullptr;
  int epfd = -1;  // the loop's epoll set (Detach removes sock and efd)
  SessionScratch* scratch = nullptr;
  std::shared_ptr<Waker> waker;
  int64_t accepted_ns = 0;
  int sock = -1;

  // Set by the attach handshake.
  uint64_t attach_id = 0;
  uint64_t session = 0;
  int efd = -1;  // the engine writes it to wake the server
  std::string seg_path;
  std::shared_ptr<Mapping> mapping;
  shm::SegmentHeader* hdr = nullptr;
  shm::Layout layout;
  shm::Ring in, out;
  leap::v1::Hello hello;
  readout::DType dtype = readout::DType::kFloat32;

  bool attached = false;
  bool dead = false;
  bool waiting_space = false;  // this round's sleep waits for ring room
  std::vector<uint8_t> held;
  // Frames waiting for room in the engine's ring (it reads too slowly).
  std::deque<std::pair<shm::FrameKind, std::string>> pending;
  size_t pending_bytes = 0;
  bool out_dirty = false;
  // Live requests to rescore: by slot for slot-backed ones (an entry is
  // overwritten when its slot is reused), by id for features sent inline.
  std::vector<std::weak_ptr<LiveRequest>> by_slot;
  absl::flat_hash_map<std::string, std::weak_ptr<LiveRequest>> inline_live;
  size_t prune_at = 1024;

  // Completions frames whose answer waits for JetStream's acknowledgements
  // (fleet mode): parked, so predictions on this ring keep flowing; each is
  // answered by Service once ready, ready ones first (the answer carries the
  // frame's seq). Server thread only.
  struct Parked {
    uint64_t seq = 0;
    std::shared_ptr<CompletionsAnswer> answer;
  };
  std::deque<Parked> parked;
  // Set (then the waker notified) by a parked answer that became ready; it
  // may outlive the session. Any thread.
  std::shared_ptr<std::atomic<bool>> parked_ready =
      std::make_shared<std::atomic<bool>>(false);

  // Publishes waiting for the server thread (OnPublish: any thread).
  absl::Mutex pub_mu;
  std::vector<std::pair<std::string, int64_t>> published
      ABSL_GUARDED_BY(pub_mu);
  std::unordered_map<std::string, std::shared_ptr<const PublishedVersion>>
      rescore ABSL_GUARDED_BY(pub_mu);
  std::atomic<bool> has_publish{false};

  ~ShmSession() override;

  // PublishListener: any thread.
  void OnPublish(const std::string& readout,
                 const std::shared_ptr<const PublishedVersion>& v) override;
  // LiveTracker: server thread.
  void Track(std::shared_ptr<LiveRequest> r) override;
  // Slot-backed requests need no untracking: a gone request is skipped, and
  // its entry is overwritten when the slot comes back.
  void Untrack(absl::string_view id) override { inline_live.erase(id); }
  // Every tracked request still live (for rescoring and reclaiming).
  std::vector<std::shared_ptr<LiveRequest>> Live();
  char* Slot(uint32_t i) const {
    return static_cast<char*>(mapping->base) + layout.slots_offset +
           uint64_t{layout.slot_bytes} * i;
  }

  // One round for an attached engine: answers waiting for ring room, up to
  // 64 frames of input, released slots and publishes. True when it did
  // anything.
  bool Service();
  // Ends the session: cancels its live requests, tells the engine (with
  // `why` when `corrupt`), removes its segment. `label`: the
  // leap_shm_detached_total reason. Idempotent.
  void Detach(const std::string& why, bool corrupt, const char* label);

 private:
  void HandleFeatures(const char* payload, size_t bytes);
  void HandleProto(const char* payload, size_t bytes);
  void HandleCancels(const char* payload, size_t bytes);
  // Starts a completions message; answers it now or parks it.
  void StartCompletionsAnswer(const leap::v1::EngineMessage& msg);
  // Emits the parked answers that are ready. True when it emitted any.
  bool FlushParked();
  void Emit(shm::FrameKind kind, const std::string& bytes);
  void EmitParts(shm::FrameKind kind,
                 std::initializer_list<absl::string_view> parts);
  void EmitProto(const leap::v1::SidecarMessage& m);
  // An answer to an engine message: split over several frames with its seq
  // when it does not fit one (docs/WIRE.md, "Messages and answers larger than a frame").
  void EmitAnswer(leap::v1::SidecarMessage m);
  bool FlushPending();
  void FlushReleases();
  void FlushPublishes();
  void Publish();
};

}  // namespace leap::sidecar::shm_internal

#endif  // LEAP_SIDECAR_SHM_INTERNAL_SHM_SESSION_H_
