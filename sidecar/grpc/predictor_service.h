// leap.v1.Predictor over Core: the engines' data plane on gRPC (Connect
// streams, unary Predict/Complete, WatchReadout). Handlers convert between
// protos and Core types and map absl::Status codes one to one onto
// grpc::Status codes (sidecar/grpc/status.h).
//
// Threads: gRPC's synchronous server calls every handler but Complete on one
// of its threads, any number at once. Complete is a callback method: its
// handler runs on one of gRPC's callback threads and only queues the call
// for the service's completion writers (CompletionWriters, 8 threads),
// which run it through the Core (the feedback log append) and finish it;
// in fleet mode a writer returns with the completion's JetStream publish in
// flight and the call is finished on the NATS thread that receives the
// acknowledgement, so concurrent unary Completes pipeline on the member's
// one NATS connection without holding a thread each. A Connect call's handler thread reads the
// engine's messages and answers them; each Connect stream also owns one
// writer thread that does every Write (answers, publish notices, rescores),
// so a publish never waits on a slow engine. The publishing thread (an RLS
// worker, a fleet member's thread or an Admin handler) calls OnPublish of
// each stream and watch, which only queues (see PublishListener).
// BeginShutdown is called once, from leapd's main thread, before
// grpc::Server::Shutdown.
#ifndef LEAP_SIDECAR_GRPC_PREDICTOR_SERVICE_H_
#define LEAP_SIDECAR_GRPC_PREDICTOR_SERVICE_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "sidecar/core/core.h"

namespace leap::sidecar {

// Byte bound of each consumer's outbox (leapd --outbox_bytes) and the
// process-wide accounting behind the leap_outbox_* metrics. Policy, for a
// consumer (a WatchReadout or Connect stream) whose queued messages exceed
// `bound` bytes: first the queued versions are coalesced to the newest one
// (a WatchReadout queue keeps only its newest version, a Connect outbox only
// the newest publish notice per readout; Connect rescores always carry only
// the newest version); if that is still over the bound, the consumer is
// dropped with RESOURCE_EXHAUSTED "consumer too slow: N bytes queued". The
// message being written counts as queued until its Write returns. Publishing
// and the other consumers never wait on a slow one.
class OutboxLimits {
 public:
  OutboxLimits(Metrics* metrics, int64_t bound)
      : metrics_(metrics), bound_(bound) {}
  int64_t bound() const { return bound_; }
  Metrics& metrics() { return *metrics_; }
  // A consumer's outbox changed by `delta` bytes to `consumer_total`.
  void Account(int64_t delta, int64_t consumer_total);

 private:
  Metrics* const metrics_;
  const int64_t bound_;
  std::atomic<int64_t> peak_{0};
};

// Runs unary Completes off gRPC's callback threads. Core::Complete appends
// the completion to the feedback log (a RocksDB write, synced with
// --sync_log) before it returns, and the call is answered only after; a
// callback thread must not block on that. The appends run here instead, on
// `threads` threads. Appends to one readout still run one at a time (the
// readout keeps its log in order under its own lock), so several threads
// help only across readouts and while one thread waits on a fleet publish
// or a slow append. At most `max_queued` calls wait; past that Run refuses
// (the caller answers UNAVAILABLE: a RocksDB stall must push back on the
// engines, which resend, instead of piling calls up in memory). The
// destructor runs what is queued, then joins.
class CompletionWriters {
 public:
  CompletionWriters(int threads, size_t max_queued);
  ~CompletionWriters();
  CompletionWriters(const CompletionWriters&) = delete;
  CompletionWriters& operator=(const CompletionWriters&) = delete;
  // Queues `f` (never blocks); false (f not run) when `max_queued` calls
  // already wait.
  [[nodiscard]] bool Run(std::function<void()> f);

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  const size_t max_queued_;
  std::vector<std::thread> threads_;
};

class PredictorService final
    : public leap::v1::Predictor::WithCallbackMethod_Complete<
          leap::v1::Predictor::Service> {
 public:
  // `sidecar_id` identifies this process (engines resubmit on change).
  // `outbox_bytes` bounds each consumer's outbox (see OutboxLimits).
  PredictorService(Core* core, std::string sidecar_id,
                   int64_t outbox_bytes = int64_t{64} << 20)
      : core_(core),
        sidecar_id_(std::move(sidecar_id)),
        outbox_(&core->metrics(), outbox_bytes),
        writers_(kCompletionWriters, kCompletionWritersQueue) {}

  // Threads that run unary Completes (CompletionWriters).
  static constexpr int kCompletionWriters = 8;
  // Unary Completes that may wait for a writer before UNAVAILABLE.
  static constexpr size_t kCompletionWritersQueue = 4096;

  // Ends open streams and watches promptly (call before Server::Shutdown):
  // each Connect stream gets a message-level UNAVAILABLE "leapd is shutting
  // down" error and is then cancelled, idle or not.
  void BeginShutdown();

  grpc::Status Connect(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<leap::v1::SidecarMessage,
                               leap::v1::EngineMessage>* stream) override;
  grpc::Status Predict(grpc::ServerContext* ctx,
                       const leap::v1::PredictRequest* req,
                       leap::v1::PredictResponse* resp) override;
  grpc::ServerUnaryReactor* Complete(grpc::CallbackServerContext* ctx,
                                     const leap::v1::CompleteRequest* req,
                                     leap::v1::CompleteResponse* resp) override;
  // The length prior at arrival: QueryPrior (sidecar/core/prior_table.h).
  grpc::Status Prior(grpc::ServerContext* ctx,
                     const leap::v1::PriorRequest* req,
                     leap::v1::PriorResponse* resp) override;
  grpc::Status WatchReadout(
      grpc::ServerContext* ctx, const leap::v1::WatchReadoutRequest* req,
      grpc::ServerWriter<leap::v1::ReadoutVersion>* writer) override;

 private:
  Core* const core_;
  const std::string sidecar_id_;
  std::atomic<uint64_t> next_session_{1};
  std::atomic<bool> shutting_down_{false};
  absl::Mutex sessions_mu_;
  // Open Connect streams (the session is a ConnectSession).
  std::map<grpc::ServerContext*, std::shared_ptr<PublishListener>> sessions_
      ABSL_GUARDED_BY(sessions_mu_);
  OutboxLimits outbox_;
  // Last: destroyed first, while everything its tasks use is alive.
  CompletionWriters writers_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_GRPC_PREDICTOR_SERVICE_H_
