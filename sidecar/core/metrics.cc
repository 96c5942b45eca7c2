#include "sidecar/core/metrics.h"

namespace leap::sidecar {
namespace {

// Dense around the alerts' thresholds (deploy/prometheus/alerts.yaml):
// LeapPredictionLatencyHigh at p99 > 1 ms, LeapRlsBatchSlow at p99 > 0.3 s,
// LeapCheckpointSlow at p99 > 1 s; histogram_quantile interpolates inside a
// bucket, so the buckets next to a threshold decide whether it fires.
const prometheus::Histogram::BucketBoundaries kPredictionBuckets = {
    1e-6, 2e-6,   5e-6, 1e-5, 2e-5,   5e-5, 1e-4, 2e-4,
    5e-4, 7.5e-4, 1e-3, 1.25e-3, 1.5e-3, 2e-3, 5e-3, 1e-2};
const prometheus::Histogram::BucketBoundaries kRlsBatchBuckets = {
    1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 1.0};
const prometheus::Histogram::BucketBoundaries kCheckpointBuckets = {
    1e-3, 1e-2, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.5, 5.0};

// Label values documented in README.md ("Metrics"), created at zero at
// start so that rate() and absent() work before the first event.
const char* const kErrorCodes[] = {
    "INVALID_ARGUMENT", "NOT_FOUND",     "ALREADY_EXISTS",
    "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
    "UNAUTHENTICATED", "DATA_LOSS",     "DEADLINE_EXCEEDED"};
const char* const kDuplicateReasons[] = {"resent", "resent_not_live"};
const char* const kShmDetachReasons[] = {"hangup", "corrupt", "stalled",
                                         "stopping"};
const char* const kOutboxStreams[] = {"watch", "connect"};

}  // namespace

void Metrics::ObservePredictions(int64_t count, double seconds) {
  if (count <= 0) return;
  if (count == 1) {
    prediction_latency_->Observe(seconds);
    return;
  }
  // One increment in the bucket `seconds` falls in (the last is +Inf).
  std::vector<double> increments(kPredictionBuckets.size() + 1, 0.0);
  size_t b = 0;
  while (b < kPredictionBuckets.size() && seconds > kPredictionBuckets[b]) ++b;
  increments[b] = static_cast<double>(count);
  prediction_latency_->ObserveMultiple(increments, seconds * count);
}

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  predictions_ = &BuildCounter()
                      .Name("leap_predictions_total")
                      .Help("Requests scored, by readout and arm kind")
                      .Register(r);
  completions_ = &BuildCounter()
                      .Name("leap_completions_total")
                      .Help("Completions by readout and outcome (learned, "
                            "skipped_cancelled, skipped_censored, skipped_frozen)")
                      .Register(r);
  rls_errors_ = &BuildCounter()
                     .Name("leap_rls_errors_total")
                     .Help("RLS batches rejected (e.g. P lost definiteness)")
                     .Register(r);
  publishes_ = &BuildCounter()
                    .Name("leap_publishes_total")
                    .Help("Readout versions published")
                    .Register(r);
  request_errors_ = &BuildCounter()
                         .Name("leap_request_errors_total")
                         .Help("Per-request errors returned, by status code")
                         .Register(r);
  duplicates_ = &BuildCounter()
                     .Name("leap_duplicate_completions_total")
                     .Help("Completions acknowledged as duplicates of a "
                           "recorded one (not learned again), by reason")
                     .Register(r);
  rls_batch_ = &BuildHistogram()
                    .Name("leap_rls_batch_seconds")
                    .Help("Time of one RLS batch update")
                    .Register(r);
  rls_backlog_ = &BuildGauge()
                      .Name("leap_rls_backlog")
                      .Help("Completions waiting for the RLS thread")
                      .Register(r);
  version_ = &BuildGauge()
                  .Name("leap_readout_version")
                  .Help("Published version of each readout")
                  .Register(r);
  spearman_ = &BuildGauge()
                   .Name("leap_readout_spearman")
                   .Help("Rolling Spearman of predicted vs true length over "
                         "the last N learned completions")
                   .Register(r);
  frozen_ = &BuildGauge()
                 .Name("leap_readout_frozen")
                 .Help("1 while adaptation of the readout is frozen")
                 .Register(r);
  guardrail_state_ = &BuildGauge()
                         .Name("leap_guardrail_state")
                         .Help("1 while the quality guardrail holds the "
                               "readout's learning frozen (until resumed)")
                         .Register(r);
  guardrail_trips_ = &BuildCounter()
                          .Name("leap_guardrail_trips_total")
                          .Help("Quality guardrail trips by the action taken "
                                "(freeze, rollback)")
                          .Register(r);
  arm_spearman_ = &BuildGauge()
                       .Name("leap_arm_spearman")
                       .Help("Rolling Spearman per readout, product line and "
                             "A/B arm (shadow arms included)")
                       .Register(r);
  arm_spearman_samples_ =
      &BuildGauge()
           .Name("leap_arm_spearman_samples")
           .Help("Completions in the window behind leap_arm_spearman")
           .Register(r);
  spearman_samples_ =
      &BuildGauge()
           .Name("leap_readout_spearman_samples")
           .Help("Completions in the window behind leap_readout_spearman")
           .Register(r);
  build_info_ = &BuildGauge()
                     .Name("leap_build_info")
                     .Help("1; labels: leapd's version, git revision and "
                           "build type (as leapd --version prints them)")
                     .Register(r);
  checkpoint_seconds_ = &BuildHistogram()
                             .Name("leap_checkpoint_seconds")
                             .Help("Time to write one checkpoint of theta and P")
                             .Register(r);
  checkpoint_bytes_ = &BuildGauge()
                           .Name("leap_checkpoint_bytes")
                           .Help("Payload bytes of the last checkpoint")
                           .Register(r);
  checkpoint_errors_ = &BuildCounter()
                            .Name("leap_checkpoint_errors_total")
                            .Help("Checkpoints that failed to write")
                            .Register(r);
  storage_bytes_ = &BuildGauge()
                        .Name("leap_storage_bytes")
                        .Help("Bytes on disk per RocksDB column family")
                        .Register(r);
  prediction_latency_ =
      &BuildHistogram()
           .Name("leap_prediction_latency_seconds")
           .Help("Time to score one request (routing, dot products, cache)")
           .Register(r)
           .Add({}, kPredictionBuckets);
  cache_bytes_ = &BuildGauge()
                      .Name("leap_feature_cache_bytes")
                      .Help("Bytes of live-request features held (bounded by "
                            "--feature_cache_bytes)")
                      .Register(r)
                      .Add({});
  cache_entries_ = &BuildGauge()
                        .Name("leap_feature_cache_entries")
                        .Help("Live requests whose features are held")
                        .Register(r)
                        .Add({});
  auto& evict = BuildCounter()
                    .Name("leap_feature_cache_evictions_total")
                    .Help("Live requests evicted, by reason (capacity, ttl)")
                    .Register(r);
  evicted_capacity_ = &evict.Add({{"reason", "capacity"}});
  evicted_ttl_ = &evict.Add({{"reason", "ttl"}});
  auto& prior_queries =
      BuildCounter()
          .Name("leap_length_prior_queries_total")
          .Help("Length prior queries answered, by result (prior, "
                "unavailable: the product line has not learned enough)")
          .Register(r);
  prior_answered_ = &prior_queries.Add({{"result", "prior"}});
  prior_unavailable_ = &prior_queries.Add({{"result", "unavailable"}});
  prior_learned_ = &BuildCounter()
                        .Name("leap_length_prior_learned_total")
                        .Help("Completions the length priors learned")
                        .Register(r)
                        .Add({});
  prior_product_lines_ = &BuildGauge()
                              .Name("leap_length_prior_product_lines")
                              .Help("Product lines with a length prior model")
                              .Register(r)
                              .Add({});
  unknown_completions_ =
      &BuildCounter()
           .Name("leap_unknown_completions_total")
           .Help("Completions or cancels for request ids not live")
           .Register(r)
           .Add({});
  feedback_log_syncs_ =
      &BuildCounter()
           .Name("leap_feedback_log_syncs_total")
           .Help("Syncs of the feedback log requested before acknowledging "
                 "completions, failed ones included (--sync_log: one per "
                 "unary Complete, one per completions message of a stream "
                 "or shared-memory ring; concurrent ones may share an fsync)")
           .Register(r)
           .Add({});
  connected_engines_ = &BuildGauge()
                            .Name("leap_connected_engines")
                            .Help("Open Connect streams and attached shm engines")
                            .Register(r)
                            .Add({});
  shm_refused_ = &BuildCounter()
                      .Name("leap_shm_attach_refused_total")
                      .Help("Shared-memory attach requests refused")
                      .Register(r)
                      .Add({});
  shm_detached_ = &BuildCounter()
                       .Name("leap_shm_detached_total")
                       .Help("Engines detached from the shared-memory data plane, "
                             "by reason (hangup, corrupt, stalled, stopping)")
                       .Register(r);
  shm_reclaimed_ = &BuildCounter()
                        .Name("leap_shm_reclaimed_requests_total")
                        .Help("Live requests cancelled because their shm engine "
                              "went away")
                        .Register(r)
                        .Add({});
  outbox_bytes_ = &BuildGauge()
                       .Name("leap_outbox_bytes")
                       .Help("Bytes queued for WatchReadout and Connect "
                             "consumers, all together")
                       .Register(r)
                       .Add({});
  outbox_peak_bytes_ = &BuildGauge()
                            .Name("leap_outbox_peak_bytes")
                            .Help("Largest outbox of one consumer since start "
                                  "(bounded by --outbox_bytes)")
                            .Register(r)
                            .Add({});
  outbox_coalesced_ = &BuildCounter()
                           .Name("leap_outbox_coalesced_total")
                           .Help("Queued versions replaced by a newer one for "
                                 "a consumer over --outbox_bytes")
                           .Register(r)
                           .Add({});
  outbox_dropped_ = &BuildCounter()
                         .Name("leap_outbox_dropped_total")
                         .Help("Consumers dropped as too slow, by stream "
                               "(watch, connect)")
                         .Register(r);
  for (const char* code : kErrorCodes) request_errors_->Add({{"code", code}});
  for (const char* reason : kDuplicateReasons) {
    duplicates_->Add({{"reason", reason}});
  }
  for (const char* reason : kShmDetachReasons) {
    shm_detached_->Add({{"reason", reason}});
  }
  for (const char* stream : kOutboxStreams) {
    outbox_dropped_->Add({{"stream", stream}});
  }
}

void Metrics::SetBuildInfo(const std::string& version,
                           const std::string& revision,
                           const std::string& build_type) {
  build_info_
      ->Add({{"version", version},
             {"revision", revision},
             {"build_type", build_type}})
      .Set(1);
}

prometheus::Counter& Metrics::OutboxDropped(const std::string& stream) {
  return outbox_dropped_->Add({{"stream", stream}});
}

prometheus::Counter& Metrics::ShmDetached(const std::string& reason) {
  return shm_detached_->Add({{"reason", reason}});
}

ReadoutMetrics Metrics::ForReadout(const std::string& name) {
  absl::MutexLock lock(&users_mu_);
  ++users_[name];
  ReadoutMetrics m;
  m.predictions_serving =
      &predictions_->Add({{"readout", name}, {"arm_kind", "serving"}});
  m.predictions_shadow =
      &predictions_->Add({{"readout", name}, {"arm_kind", "shadow"}});
  m.learned = &completions_->Add({{"readout", name}, {"outcome", "learned"}});
  m.skipped_cancelled = &completions_->Add(
      {{"readout", name}, {"outcome", "skipped_cancelled"}});
  m.skipped_censored = &completions_->Add(
      {{"readout", name}, {"outcome", "skipped_censored"}});
  m.skipped_frozen =
      &completions_->Add({{"readout", name}, {"outcome", "skipped_frozen"}});
  m.rls_errors = &rls_errors_->Add({{"readout", name}});
  m.publishes = &publishes_->Add({{"readout", name}});
  m.rls_batch_seconds = &rls_batch_->Add({{"readout", name}}, kRlsBatchBuckets);
  m.rls_backlog = &rls_backlog_->Add({{"readout", name}});
  m.version = &version_->Add({{"readout", name}});
  m.spearman = &spearman_->Add({{"readout", name}});
  m.spearman_samples = &spearman_samples_->Add({{"readout", name}});
  m.frozen = &frozen_->Add({{"readout", name}});
  m.checkpoint_seconds =
      &checkpoint_seconds_->Add({{"readout", name}}, kCheckpointBuckets);
  m.checkpoint_bytes = &checkpoint_bytes_->Add({{"readout", name}});
  m.checkpoint_errors = &checkpoint_errors_->Add({{"readout", name}});
  m.guardrail_state = &guardrail_state_->Add({{"readout", name}});
  m.guardrail_trips_freeze =
      &guardrail_trips_->Add({{"readout", name}, {"action", "freeze"}});
  m.guardrail_trips_rollback =
      &guardrail_trips_->Add({{"readout", name}, {"action", "rollback"}});
  return m;
}

void Metrics::RemoveReadout(const std::string& name, const ReadoutMetrics& m) {
  absl::MutexLock lock(&users_mu_);
  if (--users_[name] > 0) return;
  users_.erase(name);
  predictions_->Remove(m.predictions_serving);
  predictions_->Remove(m.predictions_shadow);
  completions_->Remove(m.learned);
  completions_->Remove(m.skipped_cancelled);
  completions_->Remove(m.skipped_censored);
  completions_->Remove(m.skipped_frozen);
  rls_errors_->Remove(m.rls_errors);
  publishes_->Remove(m.publishes);
  rls_batch_->Remove(m.rls_batch_seconds);
  rls_backlog_->Remove(m.rls_backlog);
  version_->Remove(m.version);
  spearman_->Remove(m.spearman);
  spearman_samples_->Remove(m.spearman_samples);
  frozen_->Remove(m.frozen);
  checkpoint_seconds_->Remove(m.checkpoint_seconds);
  checkpoint_bytes_->Remove(m.checkpoint_bytes);
  checkpoint_errors_->Remove(m.checkpoint_errors);
  guardrail_state_->Remove(m.guardrail_state);
  guardrail_trips_->Remove(m.guardrail_trips_freeze);
  guardrail_trips_->Remove(m.guardrail_trips_rollback);
}

prometheus::Gauge& Metrics::StorageBytes(const std::string& family) {
  return storage_bytes_->Add({{"family", family}});
}

prometheus::Gauge& Metrics::ArmSpearman(const std::string& readout,
                                        const std::string& product_line,
                                        const std::string& arm) {
  return arm_spearman_->Add(
      {{"readout", readout}, {"product_line", product_line}, {"arm", arm}});
}

prometheus::Gauge& Metrics::ArmSpearmanSamples(const std::string& readout,
                                               const std::string& product_line,
                                               const std::string& arm) {
  return arm_spearman_samples_->Add(
      {{"readout", readout}, {"product_line", product_line}, {"arm", arm}});
}

prometheus::Counter& Metrics::RequestErrors(const std::string& code) {
  return request_errors_->Add({{"code", code}});
}

prometheus::Counter& Metrics::DuplicateCompletions(const std::string& reason) {
  return duplicates_->Add({{"reason", reason}});
}

}  // namespace leap::sidecar
