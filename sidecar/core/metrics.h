// Prometheus metrics of leapd (listed in README.md). One Metrics object
// per process;
// families are created once, per-label series are resolved once by their
// owners (Family::Add locks and hashes) and then updated lock-free.
#ifndef LEAP_SIDECAR_CORE_METRICS_H_
#define LEAP_SIDECAR_CORE_METRICS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace leap::sidecar {

// The series of one readout.
struct ReadoutMetrics {
  prometheus::Counter* predictions_serving;
  prometheus::Counter* predictions_shadow;
  prometheus::Counter* learned;
  prometheus::Counter* skipped_cancelled;
  prometheus::Counter* skipped_censored;
  prometheus::Counter* skipped_frozen;
  prometheus::Counter* rls_errors;
  prometheus::Counter* publishes;
  prometheus::Histogram* rls_batch_seconds;
  prometheus::Gauge* rls_backlog;
  prometheus::Gauge* version;
  prometheus::Gauge* spearman;
  prometheus::Gauge* spearman_samples;  // completions behind `spearman`
  prometheus::Gauge* frozen;
  prometheus::Histogram* checkpoint_seconds;
  prometheus::Gauge* checkpoint_bytes;
  prometheus::Counter* checkpoint_errors;
  prometheus::Gauge* guardrail_state;
  prometheus::Counter* guardrail_trips_freeze;
  prometheus::Counter* guardrail_trips_rollback;
};

// Thread-safe: any thread (gRPC handlers, shm loop, RLS workers) may call
// any method; the prometheus objects returned are themselves thread-safe.
class Metrics {
 public:
  Metrics();
  const std::shared_ptr<prometheus::Registry>& registry() const {
    return registry_;
  }
  // Resolves (creating on first use) the series of readout `name`. Series
  // are shared by every readout object of one name (a deleted readout may
  // still be alive while its successor runs), so they are counted.
  ReadoutMetrics ForReadout(const std::string& name);
  // Drops one user of `name`'s series; the last one removes them.
  void RemoveReadout(const std::string& name, const ReadoutMetrics& m);
  // Rolling Spearman of one arm (readout it points at, product line, arm
  // name) and the completions its window holds.
  prometheus::Gauge& ArmSpearman(const std::string& readout,
                                 const std::string& product_line,
                                 const std::string& arm);
  prometheus::Gauge& ArmSpearmanSamples(const std::string& readout,
                                        const std::string& product_line,
                                        const std::string& arm);
  // leap_build_info{version,revision,build_type} = 1 (leapd sets it once).
  void SetBuildInfo(const std::string& version, const std::string& revision,
                    const std::string& build_type);
  prometheus::Counter& RequestErrors(const std::string& code);
  // Completions acknowledged as duplicates (not learned again), by reason:
  // "resent" (the same engine instance, request id, features and outcome
  // as a recorded completion), "resent_not_live" (a completion for a request
  // that is not live, recorded for this engine instance and id).
  prometheus::Counter& DuplicateCompletions(const std::string& reason);
  // Bytes on disk of one storage column family.
  prometheus::Gauge& StorageBytes(const std::string& family);

  prometheus::Histogram& prediction_latency() { return *prediction_latency_; }
  // `count` predictions that each took `seconds` (one update of the
  // histogram for a whole batch).
  void ObservePredictions(int64_t count, double seconds);
  prometheus::Gauge& cache_bytes() { return *cache_bytes_; }
  prometheus::Gauge& cache_entries() { return *cache_entries_; }
  prometheus::Counter& evicted_capacity() { return *evicted_capacity_; }
  prometheus::Counter& evicted_ttl() { return *evicted_ttl_; }
  prometheus::Counter& unknown_completions() { return *unknown_completions_; }
  prometheus::Counter& feedback_log_syncs() { return *feedback_log_syncs_; }
  prometheus::Gauge& connected_engines() { return *connected_engines_; }
  // Shared-memory data plane: attach requests refused, engines detached by
  // reason ("hangup", "corrupt", "stalled", "stopping"), live requests
  // cancelled because their engine went away.
  prometheus::Counter& shm_refused() { return *shm_refused_; }
  prometheus::Counter& ShmDetached(const std::string& reason);
  prometheus::Counter& shm_reclaimed() { return *shm_reclaimed_; }
  // Per-consumer outboxes (WatchReadout and Connect streams, leapd
  // --outbox_bytes): bytes queued over all consumers, the largest one
  // consumer's outbox has held since start, queued versions replaced by a
  // newer one (coalesced), consumers dropped as too slow by stream kind
  // ("watch", "connect").
  prometheus::Gauge& outbox_bytes() { return *outbox_bytes_; }
  prometheus::Gauge& outbox_peak_bytes() { return *outbox_peak_bytes_; }
  prometheus::Counter& outbox_coalesced() { return *outbox_coalesced_; }
  prometheus::Counter& OutboxDropped(const std::string& stream);
  // Length priors (prior_table.h): queries answered with a prior or without
  // one (the product line has not learned enough), completions the priors
  // learned, product lines with a prior model.
  prometheus::Counter& prior_answered() { return *prior_answered_; }
  prometheus::Counter& prior_unavailable() { return *prior_unavailable_; }
  prometheus::Counter& prior_learned() { return *prior_learned_; }
  prometheus::Gauge& prior_product_lines() { return *prior_product_lines_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  // Held across the count and the series' Add/Remove, so a readout created
  // while the last user of its name goes away never keeps removed series.
  absl::Mutex users_mu_;
  std::map<std::string, int> users_ ABSL_GUARDED_BY(users_mu_);  // name -> users
  prometheus::Family<prometheus::Counter>* predictions_;
  prometheus::Family<prometheus::Counter>* completions_;
  prometheus::Family<prometheus::Counter>* rls_errors_;
  prometheus::Family<prometheus::Counter>* publishes_;
  prometheus::Family<prometheus::Counter>* request_errors_;
  prometheus::Family<prometheus::Counter>* duplicates_;
  prometheus::Family<prometheus::Histogram>* rls_batch_;
  prometheus::Family<prometheus::Gauge>* rls_backlog_;
  prometheus::Family<prometheus::Gauge>* version_;
  prometheus::Family<prometheus::Gauge>* spearman_;
  prometheus::Family<prometheus::Gauge>* frozen_;
  prometheus::Family<prometheus::Gauge>* arm_spearman_;
  prometheus::Family<prometheus::Gauge>* arm_spearman_samples_;
  prometheus::Family<prometheus::Gauge>* spearman_samples_;
  prometheus::Family<prometheus::Gauge>* build_info_;
  prometheus::Family<prometheus::Histogram>* checkpoint_seconds_;
  prometheus::Family<prometheus::Gauge>* checkpoint_bytes_;
  prometheus::Family<prometheus::Counter>* checkpoint_errors_;
  prometheus::Family<prometheus::Gauge>* storage_bytes_;
  prometheus::Family<prometheus::Gauge>* guardrail_state_;
  prometheus::Family<prometheus::Counter>* guardrail_trips_;
  prometheus::Histogram* prediction_latency_;
  prometheus::Gauge* cache_bytes_;
  prometheus::Gauge* cache_entries_;
  prometheus::Counter* evicted_capacity_;
  prometheus::Counter* evicted_ttl_;
  prometheus::Counter* unknown_completions_;
  prometheus::Counter* feedback_log_syncs_;
  prometheus::Gauge* connected_engines_;
  prometheus::Counter* shm_refused_;
  prometheus::Family<prometheus::Counter>* shm_detached_;
  prometheus::Counter* shm_reclaimed_;
  prometheus::Gauge* outbox_bytes_;
  prometheus::Gauge* outbox_peak_bytes_;
  prometheus::Counter* outbox_coalesced_;
  prometheus::Family<prometheus::Counter>* outbox_dropped_;
  prometheus::Counter* prior_answered_;
  prometheus::Counter* prior_unavailable_;
  prometheus::Counter* prior_learned_;
  prometheus::Gauge* prior_product_lines_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_METRICS_H_
