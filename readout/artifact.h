// The readout artifact file (.leapr): one self-describing, checksummed file
// per readout version, so a readout trained offline or in another pod can be
// loaded anywhere.
//
// Layout (all integers little-endian):
//   [0, 8)    magic "\x89LEAPR\r\n" (detects text-mode mangling, like PNG)
//   [8, 12)   u32 format version (kArtifactFormatVersion)
//   [12, 16)  u32 header length H
//   [16, 16+H) header: UTF-8 JSON object (spec, provenance, array table with
//             offset, bytes and CRC-32C of every array)
//   u32       CRC-32C of the header bytes
//   arrays    each 64-byte aligned: mean f64[d], scale f64[d],
//             theta f64[d+1], and optionally P f32[(d+1)^2] row-major
//   trailer   u64 total file size, u32 CRC-32C of every byte before the
//             trailer, magic "LEAPREND"
// A truncated, padded or corrupted file is refused with a message naming
// what is wrong (which array failed its checksum, how many bytes are
// missing).
#ifndef LEAP_READOUT_ARTIFACT_H_
#define LEAP_READOUT_ARTIFACT_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"

#include "Eigen/Core"
#include "absl/status/statusor.h"
#include "readout/readout.h"
#include "readout/rls.h"

namespace leap::readout {

inline constexpr uint32_t kArtifactFormatVersion = 1;

// Everything a readout version is: what the artifact file holds.
struct ReadoutState {
  ReadoutSpec spec;
  Standardizer standardizer;
  Eigen::VectorXd theta;      // dim + 1, bias last
  std::optional<SymMatrix> p;  // RLS matrix; absent for a frozen readout
  // Provenance.
  int64_t version = 0;              // readout version this state is
  int64_t completions_learned = 0;  // RLS updates applied since the fit
  int64_t train_rows = 0;           // rows of the offline fit (0 = none)
  std::string note;                 // free text (tool, command line)
  int64_t created_unix_ms = 0;

  // Sizes agree with spec.dim; values finite; spec valid.
  absl::Status Validate() const;
  FoldedReadout Fold() const {
    return FoldedReadout::Fold(standardizer, theta, spec.max_tokens);
  }
};

// The artifact bytes of `state`.
absl::StatusOr<std::string> SerializeArtifact(const ReadoutState& state);
// Parses artifact bytes; `source` names them in error messages (a path).
absl::StatusOr<ReadoutState> ParseArtifact(absl::string_view bytes,
                                           absl::string_view source);
// Writes atomically (temp file, fsync, rename).
absl::Status WriteArtifact(const std::string& path, const ReadoutState& state);
absl::StatusOr<ReadoutState> ReadArtifact(const std::string& path);

}  // namespace leap::readout

#endif  // LEAP_READOUT_ARTIFACT_H_
