// The attach side of leapd's shared-memory data plane: the attach socket
// engines connect to, and the handshake that turns one engine's attach
// request into a mapped segment (sidecar/shm/shm_server.h describes the
// protocol, common/shm_format.h the layout). Internal to leap::sidecar_shm.
//
// Threads: BindAttachSocket runs on ShmServer::Start's caller, before the
// server thread exists; AttachEngine, Refuse and SendAttachError on the shm
// server thread (SendAttachError also from ShmServer::Stop after the thread
// is joined). None of them keeps state between calls.
#ifndef LEAP_SIDECAR_SHM_INTERNAL_SHM_ATTACH_H_
#define LEAP_SIDECAR_SHM_INTERNAL_SHM_ATTACH_H_

#include <atomic>
#include <cstdint>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "sidecar/core/core.h"
#include "sidecar/shm/internal/shm_session.h"
#include "sidecar/shm/shm_server.h"

namespace leap::sidecar::shm_internal {

// Binds and listens on options.path (SOCK_SEQPACKET, non-blocking). A stale
// socket file from a dead leapd is replaced (a live one is
// FAILED_PRECONDITION), and the segments of a dead leapd's engines beside it
// are removed. With options.group >= 0 the socket goes to that group; mode
// 0660. *listen_fd is the socket (-1 if none); *bound turns true once the
// socket file is ours to remove, even when a later step fails.
absl::Status BindAttachSocket(const ShmServerOptions& options, int* listen_fd,
                              bool* bound);

// What an attach needs besides the engine's request.
struct AttachContext {
  Core* core = nullptr;
  const ShmServerOptions* options = nullptr;
  const std::string* sidecar_id = nullptr;
  int attached_now = 0;                           // engines attached already
  std::mt19937_64* rng = nullptr;                 // attach ids
  std::atomic<uint64_t>* next_session = nullptr;  // Core session ids
};

// Checks one engine's attach request `packet` (format version, hello, dim
// and dtype, the server's limits, a readout of that width), creates and maps
// its segment `<path>.<attach id>.seg` into `a` and sends the grant with the
// segment's fd and a wake-up eventfd (a->efd). An error: refuse the engine
// with it (Refuse). OK with a->dead set: the engine hung up before the grant
// reached it. OK otherwise: the caller registers a->efd and marks `a`
// attached.
absl::Status AttachEngine(const AttachContext& ctx, const std::string& packet,
                          ShmSession* a);

// Tells the engine why it was refused, counts it, logs it and marks `a`
// dead.
void Refuse(Core& core, ShmSession* a, const absl::Status& s);

// Sends `code` and `text` as an AttachReply over an attach socket (a
// refusal, or the detach of an engine with a corrupt ring). Best effort.
void SendAttachError(int sock, absl::StatusCode code, absl::string_view text);

}  // namespace leap::sidecar::shm_internal

#endif  // LEAP_SIDECAR_SHM_INTERNAL_SHM_ATTACH_H_
