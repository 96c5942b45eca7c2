// Shared pieces of the outbox tests (leapd_outbox_test, leapd_soak_test):
// a real leapd, a publisher that makes versions at a steady rate through
// Predict + Complete, WatchReadout consumers that read (at full speed or
// slowly) or stall (never read), an engine that stalls on its Connect
// stream, and /metrics and /proc readers. Test-only.
#ifndef LEAP_TESTS_OUTBOX_TEST_UTIL_H_
#define LEAP_TESTS_OUTBOX_TEST_UTIL_H_

#include <dirent.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "leap/v1/admin.grpc.pb.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"

namespace leap::outbox_test {

namespace pb = ::leap::v1;

// The value of the series `series` (name with labels, exactly as printed)
// in a Prometheus text page; -1 when absent.
inline double MetricValue(const std::string& page, const std::string& series) {
  std::istringstream in(page);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) != 0) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
  }
  return -1;
}

inline double Metric(const std::string& metrics_address,
                     const std::string& series) {
  auto page = testing::HttpGet(metrics_address, "/metrics");
  return page.ok() ? MetricValue(*page, series) : -1;
}

// VmRSS of `pid` in KiB (from /proc/PID/status); -1 if unreadable.
inline int64_t RssKiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    int64_t kib = 0;
    std::istringstream(line.substr(6)) >> kib;
    return kib;
  }
  return -1;
}

// Open file descriptors of `pid` (entries of /proc/PID/fd).
inline int FdCount(pid_t pid) {
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

// The metrics address printed by a started leapd.
inline std::string MetricsAddress(const testing::Process& p) {
  const std::string prefix = "metrics on http://";
  for (const std::string& l : p.lines()) {
    if (l.rfind(prefix, 0) == 0) {
      return l.substr(prefix.size(), l.rfind("/metrics") - prefix.size());
    }
  }
  return "";
}

// Makes versions: each Predict + Complete pair is one learned completion,
// and with --rls_batch=1 one published version. `period` paces the pairs
// (zero: as fast as leapd answers).
class Publisher {
 public:
  Publisher(const std::string& address, int64_t dim, absl::Duration period)
      : stub_(pb::Predictor::NewStub(testing::MakeChannel(address))),
        dim_(dim),
        period_(period) {}
  ~Publisher() { Stop(); }

  // One completion learned; false (with the status in *error) on failure.
  bool PublishOne(std::string* error) {
    const int64_t i = next_++;
    const std::string id = absl::StrCat("pub-", i);
    std::vector<float> x(static_cast<size_t>(dim_));
    for (int64_t j = 0; j < dim_; ++j) {
      x[static_cast<size_t>(j)] =
          static_cast<float>(((i * 31 + j * 17) % 97) - 48) / 48.0f;
    }
    pb::PredictRequest req;
    req.mutable_record()->set_request_id(id);
    req.mutable_record()->set_features(
        std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
    req.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    pb::PredictResponse resp;
    grpc::ClientContext c1;
    grpc::Status s = stub_->Predict(&c1, req, &resp);
    if (!s.ok()) {
      *error = "Predict: " + s.error_message();
      return false;
    }
    pb::CompleteRequest creq;
    creq.mutable_completion()->set_request_id(id);
    creq.mutable_completion()->set_output_tokens(10 + (i % 200));
    creq.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);
    pb::CompleteResponse cresp;
    grpc::ClientContext c2;
    s = stub_->Complete(&c2, creq, &cresp);
    if (!s.ok()) {
      *error = "Complete: " + s.error_message();
      return false;
    }
    return true;
  }

  void Start() {
    thread_ = std::thread([this] {
      absl::Time next = absl::Now();
      while (!stop_.load()) {
        std::string error;
        if (!PublishOne(&error)) {
          absl::MutexLock lock(&mu_);
          error_ = error;
          return;
        }
        published_.fetch_add(1);
        next += period_;
        absl::SleepFor(next - absl::Now());  // pacing, not waiting
      }
    });
  }
  void Stop() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  int64_t published() const { return published_.load(); }
  std::string error() {
    absl::MutexLock lock(&mu_);
    return error_;
  }

 private:
  std::unique_ptr<pb::Predictor::Stub> stub_;
  const int64_t dim_;
  const absl::Duration period_;
  int64_t next_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> published_{0};
  absl::Mutex mu_;
  std::string error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// A channel whose receive window stays small (no BDP probing), so that a
// consumer that stops reading makes leapd's writes wait at once.
inline std::shared_ptr<grpc::Channel> StallingChannel(
    const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(512 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 16 << 10);
  // Its own connection, not shared with the test's other channels.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

// A WatchReadout consumer. `read_delay` zero reads at full speed; positive
// waits that long after each message (a slow consumer). Stalled() opens the
// stream and never reads.
class Watcher {
 public:
  Watcher(std::shared_ptr<grpc::Channel> channel, const std::string& readout,
          absl::Duration read_delay = absl::ZeroDuration())
      : stub_(pb::Predictor::NewStub(std::move(channel))),
        readout_(readout),
        read_delay_(read_delay) {}
  ~Watcher() { Cancel(); }

  void StartReading() {
    Open();
    thread_ = std::thread([this] { ReadAll(); });
  }
  // Opens the stream without reading (a stalled consumer).
  void Open() {
    pb::WatchReadoutRequest req;
    req.set_readout(readout_);
    req.set_include_weights(true);
    reader_ = stub_->WatchReadout(&ctx_, req);
  }
  // Reads everything from now on (a stalled consumer resuming).
  void ResumeReading() {
    thread_ = std::thread([this] { ReadAll(); });
  }
  void Cancel() {
    ctx_.TryCancel();
    if (thread_.joinable()) thread_.join();
  }
  // Waits until a version >= `v` arrived or the stream ended.
  bool WaitForVersion(int64_t v, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return ended_ || (!versions_.empty() && versions_.back() >= v);
    };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout) &&
           !versions_.empty() && versions_.back() >= v;
  }
  bool WaitForEnd(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&ended_), timeout);
  }
  std::vector<int64_t> versions() {
    absl::MutexLock lock(&mu_);
    return versions_;
  }
  grpc::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // Versions missing between the first and the last received (0: every
  // version arrived, in order).
  int64_t Gaps() {
    absl::MutexLock lock(&mu_);
    int64_t gaps = 0;
    for (size_t i = 1; i < versions_.size(); ++i) {
      if (versions_[i] != versions_[i - 1] + 1) ++gaps;
    }
    return gaps;
  }

 private:
  void ReadAll() {
    pb::ReadoutVersion v;
    while (reader_->Read(&v)) {
      {
        absl::MutexLock lock(&mu_);
        versions_.push_back(v.version());
      }
      if (read_delay_ > absl::ZeroDuration()) absl::SleepFor(read_delay_);
    }
    grpc::Status s = reader_->Finish();
    absl::MutexLock lock(&mu_);
    status_ = s;
    ended_ = true;
  }

  std::unique_ptr<pb::Predictor::Stub> stub_;
  const std::string readout_;
  const absl::Duration read_delay_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<pb::ReadoutVersion>> reader_;
  absl::Mutex mu_;
  std::vector<int64_t> versions_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// An engine that keeps sending on its Connect stream and never reads its
// answers: FeatureBatches of `records` records with a wrong feature width,
// each answered with one error per record (nothing is kept by leapd).
class StalledEngine {
 public:
  StalledEngine(const std::string& address, int64_t dim)
      : stub_(pb::Predictor::NewStub(StallingChannel(address))),
        dim_(dim) {
    stream_ = stub_->Connect(&ctx_);
    pb::EngineMessage hello;
    hello.set_seq(seq_++);
    hello.mutable_hello()->set_engine_id("stalled");
    hello.mutable_hello()->set_dim(dim_);
    hello.mutable_hello()->set_dtype(pb::FEATURE_DTYPE_FLOAT32);
    stream_->Write(hello);
  }
  ~StalledEngine() { ctx_.TryCancel(); }

  // Sends one batch; false once the stream is closed.
  bool SendBadBatch(int records) {
    pb::EngineMessage m;
    m.set_seq(seq_++);
    for (int i = 0; i < records; ++i) {
      pb::FeatureRecord* r = m.mutable_features()->add_records();
      r->set_request_id(absl::StrCat("stalled-", seq_, "-", i));
      r->set_features(std::string(3, 'x'));  // not dim floats
    }
    return stream_->Write(m);
  }
  // Reads whatever was answered, then the status.
  grpc::Status DrainAndFinish(int64_t* messages) {
    pb::SidecarMessage m;
    *messages = 0;
    while (stream_->Read(&m)) ++*messages;
    return stream_->Finish();
  }

 private:
  std::unique_ptr<pb::Predictor::Stub> stub_;
  const int64_t dim_;
  uint64_t seq_ = 1;
  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<pb::EngineMessage, pb::SidecarMessage>>
      stream_;
};

}  // namespace leap::outbox_test

#endif  // LEAP_TESTS_OUTBOX_TEST_UTIL_H_
