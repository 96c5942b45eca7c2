// Request traces for `leapctl replay`: parsers of the three file formats, a
// synthetic generator, and arrival processes (Poisson, or a trace's own
// timestamps rescaled to a load).
//
// Formats:
//   azure    Azure LLM inference CSV: header with TIMESTAMP, ContextTokens,
//            GeneratedTokens (any column order, other columns ignored).
//            TIMESTAMP is "YYYY-MM-DD HH:MM:SS[.fraction]" (UTC) or a number
//            of seconds.
//   lengths  Length-only CSV: header with num_prefill_tokens and
//            num_decode_tokens (other columns ignored); no arrival times.
//   jsonl    One JSON object per line: "timestamp" (milliseconds, number),
//            "input_length" and "output_length" (non-negative integers).
// Every malformed input is InvalidArgument "SOURCE:LINE: what is wrong".
#ifndef LEAP_REPLAY_TRACE_H_
#define LEAP_REPLAY_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "readout/synth.h"

namespace leap::replay {

// A trace file's format (see the file comment); kAuto guesses it.
enum class TraceFormat { kAuto, kAzure, kLengths, kJsonl };

// "auto", "azure", "lengths", "jsonl"; InvalidArgument otherwise.
absl::StatusOr<TraceFormat> ParseTraceFormat(absl::string_view name);
absl::string_view TraceFormatName(TraceFormat format);

// One request of a trace.
struct TraceRow {
  // Arrival time in seconds since the trace's first request (0 for that
  // one); meaningless when the trace has no timestamps.
  double arrival_s = 0;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
};

struct Trace {
  std::vector<TraceRow> rows;
  // False for the lengths format and synthetic traces (arrivals are drawn).
  bool has_timestamps = false;
  TraceFormat format = TraceFormat::kAuto;
  // File name or "synthetic", for messages.
  std::string source;
};

// Parses `text` (the whole file). kAuto picks jsonl when `source` ends in
// .jsonl or .json or the first non-blank character is '{', azure when the
// header has TIMESTAMP, lengths when it has num_decode_tokens. Rows are
// sorted by timestamp (stable) and shifted so the first arrives at 0.
// `max_rows` > 0 keeps only the first max_rows data rows of the file.
// Zero token counts are kept as they are (the engine model treats an output
// of 0 as 1 token: the first token comes from prefill).
absl::StatusOr<Trace> ParseTrace(absl::string_view text, TraceFormat format,
                                 absl::string_view source,
                                 int64_t max_rows = 0);

// Reads and parses a file.
absl::StatusOr<Trace> ReadTrace(const std::string& path, TraceFormat format,
                                int64_t max_rows = 0);

// A synthetic trace: `n` requests, the first `shift_index` with output
// lengths drawn from `before` and the rest from `after` (log-normal, clipped
// to [1, max_tokens]); prompt lengths log-normal with median
// kSyntheticPromptMedian and sigma kSyntheticPromptSigma, clipped to
// [1, kSyntheticPromptMax]. No timestamps. Deterministic for a seed.
inline constexpr double kSyntheticPromptMedian = 512;
inline constexpr double kSyntheticPromptSigma = 0.8;
inline constexpr int64_t kSyntheticPromptMax = 8192;
Trace SyntheticTrace(int64_t n, const readout::SynthDomain& before,
                     const readout::SynthDomain& after, int64_t shift_index,
                     int64_t max_tokens, uint64_t seed);

// Poisson arrivals: requests [0, shift_index) at rates[0] requests/s, the
// rest at rates[1] (continuing from the last arrival before). Rates > 0.
std::vector<double> PoissonArrivals(int64_t n, int64_t shift_index,
                                    double rate_before, double rate_after,
                                    uint64_t seed);

// Mean arrival rate of a timestamped trace: (n - 1) / span, in requests/s
// (0 when n < 2 or the span is 0).
double TraceRate(const Trace& trace);

}  // namespace leap::replay

#endif  // LEAP_REPLAY_TRACE_H_
