// leapd's shared-memory data plane: the same messages and semantics as the
// gRPC Connect stream (see common/shm_format.h for the layout), served by
// one thread for every attached engine.
//
// An engine connects to the attach socket at `path` (the endpoint
// "shm://<path>"), asks for d, dtype, slot count and ring size; leapd checks
// them (format version, dim and dtype ranges, a readout of that width, its
// own limits), creates the engine's segment as `<path>.<attach id>.seg` and
// hands over its fd. Features then travel as slot indices: leapd scores them
// where the engine wrote them, keeps the slot for as long as the request is
// live (its features are what rescoring and learning read), and hands it
// back with a kRelease frame when the request is gone.
//
// Fleet mode: a completions frame is answered once JetStream acknowledged
// its completions; meanwhile its answer is parked and the loop goes on
// serving (its Ack may follow the answers to later frames: match by seq).
//
// Failures: the engine's socket hanging up (exit, kill -9) makes leapd
// cancel that engine's live requests, release its segment and keep serving
// the others. A malformed frame, or an index or length out of range, is
// never followed: a bad record gets a RequestError, a corrupt ring detaches
// that engine with an error.
//
// Threads: Start and Stop may be called from any thread (Stop is
// idempotent and joins the server thread). Everything else runs on the one
// server thread: the loop (shm_server.cc), the attach handshake
// (internal/shm_attach.h) and each engine's session (internal/shm_session.h),
// whose headers state what other threads may touch.
#ifndef LEAP_SIDECAR_SHM_SHM_SERVER_H_
#define LEAP_SIDECAR_SHM_SHM_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sidecar/core/core.h"

namespace leap::sidecar {

struct ShmServerOptions {
  // Path of the attach socket; segments are created beside it. Required.
  std::string path;
  // How long the server thread keeps polling after the last frame before
  // it sleeps in epoll. Default: 50 us
  absl::Duration spin = absl::Microseconds(50);
  // Largest slot count and ring size one engine may ask for.
  // Default: 65536 slots, 16 MiB
  uint32_t max_slots = 65536;
  uint32_t max_ring_bytes = 16 << 20;
  // Engines attached at once. Default: 64
  int max_engines = 64;
  // Group given the attach socket and every segment (chown, mode 0660), so
  // that exactly the members of this group may attach (leapd --shm_group).
  // -1: leapd's own group (socket 0660, segments 0600).
  int64_t group = -1;

  absl::Status Validate() const;
};

class ShmServer {
 public:
  // Binds the attach socket (a stale socket file from a dead leapd is
  // replaced; a live one is FAILED_PRECONDITION), removes stale segments
  // and starts the server thread.
  static absl::StatusOr<std::unique_ptr<ShmServer>> Start(
      Core* core, std::string sidecar_id, ShmServerOptions options);
  // Stop().
  ~ShmServer();
  // Detaches every engine (telling them leapd is leaving) and joins the
  // thread. Idempotent; any thread.
  void Stop();

  const std::string& path() const { return options_.path; }

  struct Impl;

 private:
  ShmServer(Core* core, std::string sidecar_id, ShmServerOptions options);
  const ShmServerOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_SHM_SHM_SERVER_H_
