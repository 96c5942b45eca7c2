// The LEAP side of `leapctl replay`: a leapd process to talk to, the
// synthetic hidden states of the replayed requests, the source-domain readout,
// and the Predictor that gets its predictions from leapd through the engine
// shim's Client (the product's own path: Submit features, predictions and
// rescores as events, Complete with the true length so RLS learns).
#ifndef LEAP_REPLAY_LEAP_DRIVER_H_
#define LEAP_REPLAY_LEAP_DRIVER_H_

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine_shim/client.h"
#include "readout/artifact.h"
#include "readout/synth.h"
#include "common/progress.h"
#include "replay/engine_model.h"
#include "client/admin_client.h"
#include "client/process.h"

namespace leap::replay {

// leapd started as a child process: in memory (or on an embedded RocksDB in
// `data_dir` when given), gRPC on a free loopback port, no metrics listener. Its stdout and stderr are kept
// (the last lines appear in error messages; client/process.h launches it).
// Destruction sends SIGTERM and
// waits up to 10 s for the exit, then SIGKILL. The child also gets SIGTERM
// when this process dies (PR_SET_PDEATHSIG). Thread-compatible.
class LeapdProcess {
 public:
  static absl::StatusOr<std::unique_ptr<LeapdProcess>> Start(
      const std::string& path, absl::Duration timeout,
      const std::string& data_dir = "");
  ~LeapdProcess() = default;
  LeapdProcess(const LeapdProcess&) = delete;
  LeapdProcess& operator=(const LeapdProcess&) = delete;

  // host:port of its gRPC service.
  const std::string& address() const { return address_; }

 private:
  LeapdProcess() = default;

  std::unique_ptr<client::Process> process_;
  std::string address_;
};

// The leapd binary beside this leapctl: "leapd" in the same directory (an
// installation), then ../../sidecar/leapd (this build tree), then PATH.
// NotFound naming the places tried.
absl::StatusOr<std::string> FindLeapd();

// Row-major [requests.size(), generator.dim] float32 features: request i
// (by id) gets FeaturesForLength(domains[segment], true output length) from
// its own seeded stream, so features do not depend on arrival order or load.
std::vector<float> RequestFeatures(const readout::SynthGenerator& generator,
                                   std::span<const SimRequest> requests,
                                   const readout::SynthDomain domains[2],
                                   uint64_t seed);

// A ridge readout (docs/MATH.md, cross-validated lambda, with P0 so RLS can
// adapt it) fitted on `rows` synthetic requests of `domain` whose output
// lengths are drawn with replacement from `length_pool` (the source
// segment's true lengths), clipped to [1, max_tokens].
absl::StatusOr<readout::ReadoutState> TrainSourceReadout(
    const readout::SynthGenerator& generator,
    const readout::SynthDomain& domain, std::span<const int64_t> length_pool,
    int64_t rows, int64_t max_tokens, uint64_t seed,
    const ProgressFn& progress);

// One LEAP arm for one run: readout `name` created on leapd from artifact
// bytes (frozen on request), and a route from product line `name` to it.
// Remove() deletes the route and the readout; the destructor does it when
// Remove was not called (errors then ignored).
class LeapArm {
 public:
  static absl::StatusOr<std::unique_ptr<LeapArm>> Create(
      const client::ServerOptions& server, const std::string& name,
      const std::string& artifact, bool frozen);
  ~LeapArm();
  absl::Status Remove();
  const std::string& name() const { return name_; }

 private:
  LeapArm(const client::ServerOptions& server, std::string name)
      : admin_(server), name_(std::move(name)) {}
  client::AdminClient admin_;
  std::string name_;
  bool removed_ = false;
};

struct LeapPredictorOptions {
  // leapd's address (host:port or unix:///path). Required.
  std::string endpoint;
  // Product line of every request (routes to the run's readout). Required.
  std::string product_line;
  // Features of request id i at features[i * dim, (i + 1) * dim).
  int64_t dim = 0;
  std::span<const float> features;
  // Optional per-request decoding max_tokens (max_tokens[id]; 0 = none),
  // sent with the features. Empty = none.
  std::span<const int64_t> max_tokens;
  // How long to wait for the Client's first connection. Default: 10 s
  absl::Duration connect_timeout = absl::Seconds(10);
  // Longest wall time the simulation waits for one prediction; one that
  // takes longer (leapd down) stops holding the simulation back, and the
  // request stays unpredicted until it arrives. Default: 2 s
  absl::Duration max_wait = absl::Seconds(2);
  // Charge every prediction this latency (s) on the simulated timeline
  // instead of the measured one; Collect(now) then waits (up to max_wait
  // after its submission) for every prediction due by `now`. A frozen
  // readout's runs are then repeatable: nothing depends on wall time.
  // Unset = the measured latency.
  std::optional<double> charged_latency_s;
};

// Predictions from leapd through shim::Client. The latency of a prediction
// is measured in wall time from Submit to the prediction event and charged
// on the simulated timeline: a prediction is known from capture time +
// latency on. Collect(now) waits for the outstanding predictions (on the
// event, no polling) only as long as they could still be known by `now`,
// i.e. until submit time + (now - capture time) in wall time. With
// LeapPredictorOptions::charged_latency_s a prediction is known from capture
// time + that latency instead, and Collect(now) waits for every prediction
// due by `now` (each up to max_wait after its submission; those that miss
// it are counted, wait_timeouts(), and handed over when they arrive, so
// the run no longer repeats). Rescores after
// an RLS publish are handed over at the first Collect after they arrive.
// Every finished request is completed with its true length (STOP), so a
// readout that adapts learns from it. Called from the simulation thread;
// events arrive on the Client's thread.
class LeapPredictor : public Predictor {
 public:
  static absl::StatusOr<std::unique_ptr<LeapPredictor>> Create(
      LeapPredictorOptions options);
  ~LeapPredictor() override;

  absl::Status Prefilled(std::span<const SimRequest* const> requests,
                         double capture_s, double end_s) override;
  absl::Status Collect(double now_s,
                       std::vector<PredictionUpdate>* out) override;
  absl::Status Finished(const SimRequest& request) override;

  // Measured prediction latencies (Submit to event), seconds.
  std::vector<double> latencies() const;
  // Per-request errors from leapd or the client, and the first message.
  int64_t errors() const;
  std::string first_error() const;
  // Highest readout version seen on a prediction or rescore.
  int64_t max_version() const;
  // Rescore events received.
  int64_t rescores() const;
  // charged_latency_s: predictions that were due but missed max_wait.
  int64_t wait_timeouts() const;
  // Per request id: the first prediction and the latency charged for it
  // (s): the measured one, or LeapPredictorOptions::charged_latency_s;
  // also for requests that finished before their prediction arrived.
  absl::flat_hash_map<int64_t, std::pair<double, double>> recorded() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    double capture_s = 0;
    Clock::time_point submitted;
    bool arrived = false;
    double latency_s = 0;  // charged on the simulated timeline
    double tokens = 0;
    // The request finished before its prediction arrived: kept only to
    // record the prediction (recorded()) when it comes.
    bool finished = false;
    bool timed_out = false;  // charged_latency_s: counted in wait_timeouts_
  };
  explicit LeapPredictor(LeapPredictorOptions options)
      : options_(std::move(options)) {}
  void OnEvent(const shim::Event& e);
  int64_t IdOf(const std::string& request_id) const;

  const LeapPredictorOptions options_;
  std::unique_ptr<shim::Client> client_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<int64_t, double>> rescored_ ABSL_GUARDED_BY(mu_);
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);
  int64_t errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::string first_error_ ABSL_GUARDED_BY(mu_);
  int64_t max_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rescores_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wait_timeouts_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> due_missing_ ABSL_GUARDED_BY(mu_);  // Collect's
  absl::flat_hash_map<int64_t, std::pair<double, double>> recorded_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace leap::replay

#endif  // LEAP_REPLAY_LEAP_DRIVER_H_
