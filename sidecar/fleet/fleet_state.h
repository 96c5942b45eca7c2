// Complete readout states (theta, P, position) in the fleet's STATE stream
// (docs/FLEET.md): checkpoints on leap.<fleet>.ckpt.<readout> and snapshots on
// leap.<fleet>.snap.<readout>.<label>, each written as FleetStateChunk
// messages of at most kStateChunkBytes payload, the last one carrying the
// metadata (chunk count, CRC-32C of all the data, fleet_seq). A reader
// assembles chunks by state_id and takes the newest complete one whose CRC
// matches, so a state cut short by a crash is never read.
#ifndef LEAP_SIDECAR_FLEET_FLEET_STATE_H_
#define LEAP_SIDECAR_FLEET_FLEET_STATE_H_

#include <nats/nats.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "readout/rls.h"
#include "sidecar/fleet/nats_client.h"

namespace leap::fleet {

// Payload bytes per chunk: below NATS's default max_payload (1 MiB) with
// room for the chunk's other fields.
inline constexpr int64_t kStateChunkBytes = 1000 * 1000;

// One complete state of a readout.
struct FleetState {
  Eigen::VectorXd theta;               // d + 1, bias last, FP64
  std::optional<readout::SymMatrix> p;  // FP32, absent for a readout without P
  int64_t version = 0;
  int64_t completions_learned = 0;
  // Every FEEDBACK message with stream sequence <= fleet_seq is in it.
  uint64_t fleet_seq = 0;
  bool frozen = false;
  std::string label;   // snapshots
  // Checkpoints: FEEDBACK sequences <= fleet_seq of completions taken but not
  // applied (kept after a rejected RLS batch, retried on resume).
  std::vector<uint64_t> kept_seqs;
  // Checkpoints: the trainer's fleet-wide quality (a serialized FleetQuality
  // with pairs, FleetStateChunk.quality on the last chunk); "" when none.
  std::string quality;
  int64_t unix_ms = 0;
  // The readout's incarnation (FleetReadoutConfig.created_unix_ms) the state
  // belongs to; 0: not named (exports, states written before the field).
  int64_t created_unix_ms = 0;
  std::string state_id;  // as read or written
  int32_t chunks = 0;    // as read or written
};

// Stream, bucket and subject names: sidecar/fleet/nats_client.h.

// Where the trainer writes the state an EXPORT operation asks for:
// leap.<fleet>.ckpt.<readout>.export.<token of op_id> (STATE stream; read
// and purged by the asking member).
std::string ExportSubject(absl::string_view fleet, absl::string_view readout,
                          absl::string_view op_id);

// theta, P and the flags as one byte string (little-endian), and back. P
// goes as its upper triangle (n (n + 1) / 2 FP32 values, row i from column
// i on: 32 MiB at d = 4096 instead of 64); Decode also reads the full n x n
// layout of states written before, and mirrors the triangle into a full
// symmetric P either way.
std::string EncodeStatePayload(const FleetState& s);
absl::Status DecodeStatePayload(absl::string_view data, FleetState* s);

// A write fenced on the subject's last sequence (PublishState).
struct StateFence {
  // In: the subject's last stream sequence the writer saw (0: the subject
  // must be empty). Every chunk is published with JetStream's expected last
  // subject sequence: the first on this one, each next one on the chunk
  // before it. Out: the sequence of the last chunk stored.
  uint64_t last_subject_seq = 0;
  // Out: the sequence of the first chunk (0 when none was stored).
  uint64_t first_seq = 0;
};

// Writes `s` on `subject` (stream `stream`) as chunks under `state_id`,
// each publish acknowledged by JetStream (message id state_id/index, so a
// resend is de-duplicated). Returns the number of chunks. With `fence`,
// a chunk refused because something else was stored on the subject since
// (JetStream error 10071, wrong last sequence) ends the write with
// FailedPrecondition (the chunks stored before it stay: an incomplete state
// no reader takes).
absl::StatusOr<int32_t> PublishState(jsCtx* js, const std::string& stream,
                                     const std::string& subject,
                                     const std::string& readout,
                                     const std::string& state_id,
                                     const FleetState& s,
                                     StateFence* fence = nullptr);

// The newest complete, CRC-valid state on `subject` (in stream order); with
// `max_fleet_seq`, the newest whose fleet_seq <= it; with `incarnation`,
// the newest that names it or no incarnation (created_unix_ms 0): a state of
// another incarnation of the readout is skipped (and logged). NotFound when
// there is none. `nc` is the connection of `js` (the consumer is ended with
// CloseSubscription on it).
absl::StatusOr<FleetState> ReadNewestState(
    natsConnection* nc, jsCtx* js, const std::string& stream, const std::string& subject,
    std::optional<uint64_t> max_fleet_seq = std::nullopt,
    std::optional<int64_t> incarnation = std::nullopt);

// Creates (or accepts as they are) the streams and the lease bucket of a
// fleet, with `replicas` JetStream replicas and a lease TTL of `lease_ms`.
absl::Status EnsureFleetStreams(jsCtx* js, const std::string& fleet,
                                int replicas, int64_t lease_ms);

// The stream sequence of a message, whether it came from a consumer (reply
// subject metadata) or a direct get; 0 when it has neither.
uint64_t StreamSequence(natsMsg* m);

// "nats: <text> (status N, JetStream error E)".
absl::Status NatsFailure(const std::string& what, natsStatus s,
                       jsErrCode code = static_cast<jsErrCode>(0));

}  // namespace leap::fleet

#endif  // LEAP_SIDECAR_FLEET_FLEET_STATE_H_
