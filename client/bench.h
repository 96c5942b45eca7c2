// `leapctl bench` (and the leapd_bench program): a load generator for
// leapd's Connect stream. Phase 1 measures sustained predictions/s with
// --batch records per message on --streams concurrent streams (each keeping
// two batches in flight) for --seconds; phase 2 the round trip of single
// requests, one at a time, on an otherwise idle server. Requests are
// cancelled in bulk, never completed, so no readout learns from them.
#ifndef LEAP_CLIENT_BENCH_H_
#define LEAP_CLIENT_BENCH_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/admin_client.h"
#include "common/progress.h"

namespace leap::client {

// Inputs of `leapctl bench`.
struct BenchOptions {
  ServerOptions server;
  // Feature width. Default: 4096
  int64_t dim = 4096;
  // Records per FeatureBatch message, in [1, 65536]. Default: 64
  int64_t batch = 64;
  // Concurrent Connect streams, in [1, 256]. Default: 2
  int64_t streams = 2;
  // Length of the throughput phase, seconds in (0, 3600]. Default: 10
  double seconds = 10;
  // Single-request round trips in the latency phase, in [0, 10^7].
  // Default: 2000
  int64_t latency_requests = 2000;
  // "float32" or "bfloat16". Default: float32
  std::string dtype = "float32";
  // The readout that scores the traffic: used when it exists (its dim must
  // be `dim`), otherwise created as a cold start and deleted at the end.
  // Default: leapctl-bench
  std::string readout = "leapctl-bench";
  // The product line the traffic is sent on: its route is used when it
  // exists, otherwise a single-arm route to `readout` is set and deleted at
  // the end. Default: leapctl-bench
  std::string product_line = "leapctl-bench";

  // InvalidArgument (a usage error) for a value out of range.
  absl::Status Validate() const;
};

// What `leapctl bench` measured.
struct BenchReport {
  std::string server;
  std::string cpu_model;
  int64_t cores = 0;
  int64_t dim = 0;
  std::string dtype;
  int64_t batch = 0;
  int64_t streams = 0;
  // Throughput phase.
  double wall_seconds = 0;
  int64_t predictions = 0;
  int64_t errors = 0;
  double predictions_per_s = 0;
  // Client process CPU time over the phase / wall time (cores busy).
  double client_cpu_cores = 0;
  // Latency phase (microseconds; 0 with no samples).
  int64_t latency_samples = 0;
  double latency_p50_us = 0;
  double latency_p99_us = 0;
  double latency_max_us = 0;
  // What the run created (and removed again).
  bool created_readout = false;
  bool created_route = false;
};

// Runs both phases. Fails when the server is unreachable, the readout's dim
// differs from `dim`, or no request was predicted (with the first per-request
// error).
absl::StatusOr<BenchReport> RunBench(const BenchOptions& options,
                                     const ProgressFn& progress);
// Human-readable lines: machine, throughput, client CPU, latency.
std::string FormatBenchReport(const BenchReport& report);

// The CPU's model name from /proc/cpuinfo ("model name"; on some ARM kernels
// "Model" or "Processor"), or "unknown": printed beside every benchmark
// figure.
std::string CpuModel();
// One JSON object: {"server", "machine": {"cpu_model", "cores"}, "dim",
// "dtype", "batch", "streams", "seconds", "predictions", "errors",
// "predictions_per_s", "client_cpu_cores", "latency_samples",
// "latency_p50_us", "latency_p99_us", "latency_max_us"}.
std::string FormatBenchJson(const BenchReport& report);

}  // namespace leap::client

#endif  // LEAP_CLIENT_BENCH_H_
