// What the end-to-end learning benchmarks (tests/fleet_benchmark.cc,
// tests/leapd_learning_benchmark.cc) share: their flag parsing, percentiles,
// a WatchReadout recorder and the paced predict+complete clients.
#ifndef LEAP_TESTS_SUPPORT_BENCH_LOAD_H_
#define LEAP_TESTS_SUPPORT_BENCH_LOAD_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"

namespace leap::testing {

using BenchClock = std::chrono::steady_clock;

// --name=value from argv, or `def` when absent.
int64_t IntFlag(int argc, char** argv, const std::string& name, int64_t def);
std::string StrFlag(int argc, char** argv, const std::string& name,
                    const std::string& def);

int64_t NowUnixMs();
double Ms(BenchClock::duration d);
// The p-quantile (0..1) of v by nearest rank; NaN when empty.
double Pct(std::vector<double> v, double p);
// The output of a shell command, trailing newlines dropped ("" on failure).
std::string Sh(const std::string& cmd);
// "NOT_FOUND message": a gRPC status for a report.
std::string StatusText(const grpc::Status& s);

// One version seen by WatchReadout, with the time it arrived.
struct SeenVersion {
  BenchClock::time_point t;
  uint64_t fleet_seq;
  int64_t learned;
  int64_t published_unix_ms;
};

// Records every version of readout "r" a leapd serves, on its own thread,
// from construction until destruction.
class VersionWatcher {
 public:
  explicit VersionWatcher(const std::string& address);
  ~VersionWatcher();
  VersionWatcher(const VersionWatcher&) = delete;
  VersionWatcher& operator=(const VersionWatcher&) = delete;

  std::vector<SeenVersion> seen();
  uint64_t last_seq();  // fleet_seq of the newest version (0: none)
  int64_t learned();    // completions_learned of the newest version (0: none)
  // "watching", or how the WatchReadout call ended (e.g. NOT_FOUND when the
  // leapd did not have readout "r" yet): a watch that ended sees nothing more.
  std::string state();

 private:
  void Run();
  std::shared_ptr<grpc::Channel> channel_;
  grpc::ClientContext ctx_;
  std::mutex mu_;
  std::vector<SeenVersion> seen_;
  std::string end_;  // how the call ended; empty while it runs
  std::thread thread_;
};

// One acknowledged completion.
struct AckedCompletion {
  BenchClock::time_point t;  // when the ack arrived
  int64_t unix_ms;
  uint64_t fleet_seq;        // 0 outside fleet mode
};

struct PacedClientsOptions {
  std::vector<std::string> addresses;  // client c talks to addresses[c % size]
  int64_t clients = 1;
  // > 0: request i of each client is due at start + i / rate; else closed loop.
  double per_client_rate = 0;
  double seconds = 10;
  int64_t dim = 4096;
  // Count a completion acknowledged without a fleet_seq as failed.
  bool require_fleet_seq = false;
};

// Clients, one thread each, sending Predict then Complete for readout "r"
// (default route) with N(0,1) features and a length of (18 + 0.5·Σx[0..15])²
// tokens, request ids "b<n>" from *next_id. Fills *acked (sorted by ack time)
// and *failures; returns the seconds it ran. `failure_reasons` (may be null)
// receives each failure as "Predict|Complete at ADDRESS: CODE message" (or
// "... acknowledged without fleet_seq").
double RunPacedClients(const PacedClientsOptions& options,
                       std::atomic<int64_t>* next_id,
                       std::vector<AckedCompletion>* acked, int64_t* failures,
                       std::vector<std::string>* failure_reasons = nullptr);

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_BENCH_LOAD_H_
