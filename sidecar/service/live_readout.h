// A readout being served: its published version (read lock-free by the
// predicting threads), its RLS state and the RLS worker thread that learns
// from completions and publishes new versions.
#ifndef LEAP_SIDECAR_SERVICE_LIVE_READOUT_H_
#define LEAP_SIDECAR_SERVICE_LIVE_READOUT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "sidecar/readout/artifact.h"
#include "sidecar/readout/readout.h"
#include "sidecar/readout/rls.h"
#include "sidecar/service/metrics.h"
#include "sidecar/service/quality.h"

namespace leap::sidecar {

// One published version: what predictions use. Immutable.
struct PublishedVersion {
  int64_t version = 0;
  readout::FoldedReadout folded;
  int64_t completions_learned = 0;
  int64_t published_unix_ms = 0;
  std::string cause;  // "create", "rls", ...
};

// Receives every publish of every readout. OnPublish runs on the publishing
// thread (an RLS worker or an admin handler) and must not block.
class PublishListener {
 public:
  virtual ~PublishListener() = default;
  virtual void OnPublish(const std::string& readout,
                         const std::shared_ptr<const PublishedVersion>& v) = 0;
};

// Fans publishes out to listeners that are still alive. Thread-safe.
class PublishHub {
 public:
  void Subscribe(std::weak_ptr<PublishListener> l);
  void Notify(const std::string& readout,
              const std::shared_ptr<const PublishedVersion>& v);

 private:
  absl::Mutex mu_;
  std::vector<std::weak_ptr<PublishListener>> listeners_ ABSL_GUARDED_BY(mu_);
};

struct LiveReadoutOptions {
  // Completions per RLS batch. Default: 8
  int rls_batch = 8;
  // A partial batch is applied once its oldest completion waited this long.
  // Default: 200 ms
  int64_t flush_after_ns = 200'000'000;
  // Pairs in each rolling Spearman window. Default: 1000
  int64_t quality_window = 1000;
  // Version records kept in memory (the oldest are dropped). Default: 10000
  int64_t versions_kept = 10000;

  absl::Status Validate() const;
};

// Metadata of one published version, with its online quality.
struct VersionRecord {
  int64_t version = 0;
  int64_t completions_learned = 0;
  int64_t published_unix_ms = 0;
  std::string cause;
  double spearman = 0;  // NaN until 2 pairs
  int64_t spearman_n = 0;
};

// Thread-safe unless stated.
class LiveReadout {
 public:
  // Starts the RLS thread when `state` has a P matrix.
  LiveReadout(std::string name, readout::ReadoutState state,
              LiveReadoutOptions options, Metrics* metrics, PublishHub* hub);
  ~LiveReadout();
  LiveReadout(const LiveReadout&) = delete;
  LiveReadout& operator=(const LiveReadout&) = delete;

  const std::string& name() const { return name_; }
  const readout::ReadoutSpec& spec() const { return spec_; }
  // The current version. Lock-free.
  std::shared_ptr<const PublishedVersion> current() const {
    return current_.load(std::memory_order_acquire);
  }
  // True when the readout has P (can learn).
  bool adaptive() const { return adaptive_; }
  bool frozen() const { return frozen_.load(); }
  // FailedPrecondition when unfreezing a readout without P or after an RLS
  // failure that left P unusable.
  absl::Status SetFrozen(bool frozen);

  // Queues one completion for learning: standardizes x here (off the RLS
  // thread) and wakes the RLS thread.
  void Learn(const readout::FeatureView& x, double target);
  // Adds a (predicted, true) pair to the windows of `version` and overall.
  void RecordQuality(int64_t version, double predicted_tokens,
                     double true_tokens);

  // Completions queued and not yet applied.
  int64_t backlog() const;
  int64_t completions_learned() const;
  int64_t created_unix_ms() const { return created_unix_ms_; }
  double spearman(int64_t* n) const;
  std::vector<VersionRecord> Versions() const;
  ReadoutMetrics& metrics() { return metrics_; }

  // The full state (theta, P, standardization) as of the last applied batch.
  readout::ReadoutState Export();
  // Blocks until every queued completion is applied.
  void WaitIdle();
  // Stops the RLS thread; with `drain`, applies what is queued first.
  void Stop(bool drain);

 private:
  struct Pending {
    std::vector<float> u;
    double y;
    int64_t enqueued_ns;
  };
  void WorkerLoop();
  void Publish(const Eigen::VectorXd& theta, int64_t learned,
               const std::string& cause);

  const std::string name_;
  const readout::ReadoutSpec spec_;
  const readout::Standardizer standardizer_;
  const LiveReadoutOptions options_;
  const bool adaptive_;
  const int64_t created_unix_ms_;
  Metrics* const metrics_owner_;
  ReadoutMetrics metrics_;
  PublishHub* const hub_;
  std::atomic<std::shared_ptr<const PublishedVersion>> current_;
  std::atomic<bool> frozen_;

  // Queue, worker control.
  mutable absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool drain_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;

  // RLS state: only the worker updates it; Export reads it.
  absl::Mutex state_mu_;
  std::optional<readout::RlsState> rls_ ABSL_GUARDED_BY(state_mu_);
  Eigen::VectorXd theta_ ABSL_GUARDED_BY(state_mu_);
  std::atomic<int64_t> learned_;
  std::atomic<int64_t> version_;

  // Versions and quality.
  mutable absl::Mutex quality_mu_;
  std::deque<VersionRecord> versions_ ABSL_GUARDED_BY(quality_mu_);
  std::map<int64_t, RollingSpearman> per_version_ ABSL_GUARDED_BY(quality_mu_);
  RollingSpearman overall_ ABSL_GUARDED_BY(quality_mu_);

  std::thread worker_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_SERVICE_LIVE_READOUT_H_
