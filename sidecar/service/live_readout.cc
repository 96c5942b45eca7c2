#include "sidecar/service/live_readout.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace leap::sidecar {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Quality windows of this many recent versions are kept.
constexpr size_t kVersionWindows = 64;

}  // namespace

void PublishHub::Subscribe(std::weak_ptr<PublishListener> l) {
  absl::MutexLock lock(&mu_);
  listeners_.push_back(std::move(l));
}

void PublishHub::Notify(const std::string& readout,
                        const std::shared_ptr<const PublishedVersion>& v) {
  std::vector<std::shared_ptr<PublishListener>> live;
  {
    absl::MutexLock lock(&mu_);
    size_t keep = 0;
    for (auto& w : listeners_) {
      if (auto l = w.lock()) {
        live.push_back(std::move(l));
        listeners_[keep++] = w;
      }
    }
    listeners_.resize(keep);
  }
  for (auto& l : live) l->OnPublish(readout, v);
}

absl::Status LiveReadoutOptions::Validate() const {
  if (rls_batch < 1 || rls_batch > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("rls_batch must be in [1, 4096], got ", rls_batch));
  }
  if (flush_after_ns <= 0) {
    return absl::InvalidArgumentError("flush_after must be > 0");
  }
  if (quality_window < 2) {
    return absl::InvalidArgumentError("quality_window must be >= 2");
  }
  return absl::OkStatus();
}

LiveReadout::LiveReadout(std::string name, readout::ReadoutState state,
                         LiveReadoutOptions options, Metrics* metrics,
                         PublishHub* hub)
    : name_(std::move(name)),
      spec_(state.spec),
      standardizer_(state.standardizer),
      options_(options),
      adaptive_(state.p.has_value()),
      created_unix_ms_(UnixMs()),
      metrics_owner_(metrics),
      metrics_(metrics->ForReadout(name_)),
      hub_(hub),
      frozen_(!state.p.has_value()),
      learned_(state.completions_learned),
      version_(std::max<int64_t>(state.version, 1)),
      overall_(options.quality_window) {
  theta_ = state.theta;
  if (state.p.has_value()) {
    rls_.emplace(state.theta, std::move(*state.p));
  }
  auto v = std::make_shared<PublishedVersion>(PublishedVersion{
      version_.load(), state.Fold(), learned_.load(), UnixMs(), "create"});
  current_.store(v);
  {
    absl::MutexLock lock(&quality_mu_);
    versions_.push_back({v->version, v->completions_learned,
                         v->published_unix_ms, v->cause, NAN, 0});
  }
  metrics_.version->Set(static_cast<double>(v->version));
  metrics_.frozen->Set(frozen_.load() ? 1 : 0);
  metrics_.spearman->Set(NAN);
  if (adaptive_) worker_ = std::thread([this] { WorkerLoop(); });
}

LiveReadout::~LiveReadout() {
  Stop(/*drain=*/false);
  metrics_owner_->RemoveReadout(metrics_);
}

absl::Status LiveReadout::SetFrozen(bool frozen) {
  if (!frozen) {
    if (!adaptive_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "readout '", name_,
          "' has no P matrix and cannot adapt; import an artifact with P"));
    }
    absl::MutexLock lock(&mu_);
    if (broken_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "readout '", name_,
          "' stopped adapting after an RLS failure; restore it first"));
    }
  }
  frozen_.store(frozen);
  metrics_.frozen->Set(frozen ? 1 : 0);
  return absl::OkStatus();
}

void LiveReadout::Learn(const readout::FeatureView& x, double target) {
  Pending p;
  p.u.resize(spec_.dim + 1);
  standardizer_.Augment(x, p.u.data());
  p.y = target;
  p.enqueued_ns = NowNs();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(p));
  metrics_.rls_backlog->Set(static_cast<double>(queue_.size()));
}

void LiveReadout::RecordQuality(int64_t version, double predicted_tokens,
                                double true_tokens) {
  absl::MutexLock lock(&quality_mu_);
  auto it = per_version_.find(version);
  if (it == per_version_.end()) {
    it = per_version_.emplace(version, RollingSpearman(options_.quality_window))
             .first;
    while (per_version_.size() > kVersionWindows) {
      per_version_.erase(per_version_.begin());
    }
  }
  it->second.Add(predicted_tokens, true_tokens);
  overall_.Add(predicted_tokens, true_tokens);
  metrics_.spearman->Set(overall_.Value());
}

int64_t LiveReadout::backlog() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size()) + (in_flight_ ? 1 : 0);
}

int64_t LiveReadout::completions_learned() const { return learned_.load(); }

double LiveReadout::spearman(int64_t* n) const {
  absl::MutexLock lock(&quality_mu_);
  if (n != nullptr) *n = overall_.size();
  return overall_.Value();
}

std::vector<VersionRecord> LiveReadout::Versions() const {
  absl::MutexLock lock(&quality_mu_);
  std::vector<VersionRecord> out(versions_.begin(), versions_.end());
  for (VersionRecord& r : out) {
    auto it = per_version_.find(r.version);
    if (it != per_version_.end()) {
      r.spearman = it->second.Value();
      r.spearman_n = it->second.size();
    } else {
      r.spearman = NAN;
      r.spearman_n = 0;
    }
  }
  return out;
}

readout::ReadoutState LiveReadout::Export() {
  readout::ReadoutState s;
  s.spec = spec_;
  s.standardizer = standardizer_;
  absl::MutexLock lock(&state_mu_);
  s.theta = theta_;
  if (rls_.has_value()) s.p = rls_->P();
  s.version = version_.load();
  s.completions_learned = learned_.load();
  s.created_unix_ms = UnixMs();
  return s;
}

void LiveReadout::WaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (queue_.empty() && !in_flight_) || stop_ || !adaptive_;
  };
  mu_.Await(absl::Condition(&idle));
}

void LiveReadout::Stop(bool drain) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    drain_ = drain;
  }
  if (worker_.joinable()) worker_.join();
}

void LiveReadout::WorkerLoop() {
  const int64_t n = spec_.dim + 1;
  std::vector<float> u;
  std::vector<double> y;
  std::vector<Pending> batch;
  for (;;) {
    batch.clear();
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        if (stop_ && (!drain_ || queue_.empty() || broken_)) return;
        if (!broken_ &&
            (static_cast<int>(queue_.size()) >= options_.rls_batch ||
             (!queue_.empty() && (stop_ || NowNs() - queue_.front().enqueued_ns >=
                                                options_.flush_after_ns)))) {
          break;
        }
        if (queue_.empty() || broken_) {
          auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return stop_ || (!broken_ && !queue_.empty());
          };
          mu_.Await(absl::Condition(&ready));
        } else {
          // A partial batch: wait for more or for its flush deadline.
          const int64_t wait_ns = options_.flush_after_ns -
                                  (NowNs() - queue_.front().enqueued_ns);
          auto full = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
            return stop_ ||
                   static_cast<int>(queue_.size()) >= options_.rls_batch;
          };
          mu_.AwaitWithTimeout(absl::Condition(&full),
                               absl::Nanoseconds(std::max<int64_t>(wait_ns, 0)));
        }
      }
      const int k = std::min<int>(options_.rls_batch,
                                  static_cast<int>(queue_.size()));
      for (int i = 0; i < k; ++i) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      in_flight_ = true;
      metrics_.rls_backlog->Set(static_cast<double>(queue_.size()));
    }
    const int64_t k = static_cast<int64_t>(batch.size());
    u.resize(k * n);
    y.resize(k);
    for (int64_t i = 0; i < k; ++i) {
      std::copy(batch[i].u.begin(), batch[i].u.end(), u.begin() + i * n);
      y[i] = batch[i].y;
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s;
    Eigen::VectorXd theta;
    int64_t learned = 0;
    {
      absl::MutexLock lock(&state_mu_);
      s = rls_->Update(u.data(), n, y);
      if (s.ok()) {
        theta_ = rls_->theta();
        theta = theta_;
        learned = learned_.fetch_add(k) + k;
      }
    }
    metrics_.rls_batch_seconds->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
    if (s.ok()) {
      metrics_.learned->Increment(static_cast<double>(k));
      Publish(theta, learned, "rls");
    } else {
      // Never publish a state that failed: stop adapting, keep serving the
      // last good version, and say so.
      std::fprintf(stderr, "leapd: readout '%s': %s; adaptation frozen\n",
                   name_.c_str(), std::string(s.message()).c_str());
      metrics_.rls_errors->Increment();
      frozen_.store(true);
      metrics_.frozen->Set(1);
      absl::MutexLock lock(&mu_);
      broken_ = true;
      queue_.clear();
    }
    absl::MutexLock lock(&mu_);
    in_flight_ = false;
  }
}

void LiveReadout::Publish(const Eigen::VectorXd& theta, int64_t learned,
                          const std::string& cause) {
  auto v = std::make_shared<PublishedVersion>(PublishedVersion{
      version_.fetch_add(1) + 1,
      readout::FoldedReadout::Fold(standardizer_, theta, spec_.max_tokens),
      learned, UnixMs(), cause});
  current_.store(v, std::memory_order_release);
  {
    absl::MutexLock lock(&quality_mu_);
    versions_.push_back({v->version, v->completions_learned,
                         v->published_unix_ms, v->cause, NAN, 0});
    while (static_cast<int64_t>(versions_.size()) > options_.versions_kept) {
      versions_.pop_front();
    }
  }
  metrics_.version->Set(static_cast<double>(v->version));
  metrics_.publishes->Increment();
  hub_->Notify(name_, v);
}

}  // namespace leap::sidecar
