#include "replay/leap_driver.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "readout/ridge.h"

namespace leap::replay {
namespace {

namespace pb = ::leap::v1;
constexpr size_t kKeptLines = 40;

}  // namespace

// ---- leapd process
// -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<LeapdProcess>> LeapdProcess::Start(
    const std::string& path, absl::Duration timeout,
    const std::string& data_dir) {
  if (access(path.c_str(), X_OK) != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot run leapd at ", path, ": ", std::strerror(errno)));
  }
  std::vector<std::string> argv = {path, "--listen=127.0.0.1:0",
                                   "--metrics_listen="};
  if (!data_dir.empty()) argv.push_back("--data_dir=" + data_dir);
  client::ProcessOptions options;
  options.merge_stderr = true;
  options.die_with_parent = true;
  options.kept_lines = kKeptLines;
  options.stop_grace = absl::Seconds(10);
  std::unique_ptr<LeapdProcess> p(new LeapdProcess());
  ASSIGN_OR_RETURN(p->process_, client::Process::Start(argv, options));

  // Wait for "listening on ADDR" and then "leapd ID ready".
  const absl::Time deadline = absl::Now() + timeout;
  absl::StatusOr<std::string> address =
      p->process_->WaitForLine("listening on ", timeout);
  absl::StatusOr<std::string> ready = absl::UnavailableError("not ready");
  while (address.ok()) {
    ready = p->process_->WaitForLine("leapd ", deadline - absl::Now());
    if (!ready.ok() ||
        absl::StrContains(absl::StrCat(" ", *ready), " ready")) {
      break;
    }
  }
  if (!address.ok() || !ready.ok()) {
    const absl::Status why = !address.ok() ? address.status() : ready.status();
    const bool exited = absl::IsNotFound(why);
    const std::string tail = p->process_->Tail();
    return absl::UnavailableError(
        absl::StrCat("leapd at ", path,
                     exited ? " exited before it was ready"
                            : absl::StrCat(" was not ready within ",
                                           absl::FormatDuration(timeout)),
                     tail.empty() ? "" : absl::StrCat("; its output: ", tail)));
  }
  p->address_ = *address;
  return p;
}

absl::StatusOr<std::string> FindLeapd() {
  absl::StatusOr<std::string> path =
      client::FindProgram("leapd", {"../../sidecar"});
  if (!path.ok()) {
    return absl::NotFoundError(absl::StrCat(
        path.status().message(), "; pass --leapd PATH or --server ADDR"));
  }
  return path;
}

// ---- features and the source readout ----------------------------------------

std::vector<float> RequestFeatures(const readout::SynthGenerator& generator,
                                   std::span<const SimRequest> requests,
                                   const readout::SynthDomain domains[2],
                                   uint64_t seed) {
  const int64_t d = generator.options().dim;
  std::vector<float> x(requests.size() * static_cast<size_t>(d));
  for (const SimRequest& r : requests) {
    std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull +
                        static_cast<uint64_t>(r.id) * 0xD1B54A32D192ED03ull +
                        1);
    generator.FeaturesForLength(domains[r.segment == 0 ? 0 : 1],
                                std::max<int64_t>(r.output_tokens, 1), rng,
                                x.data() + static_cast<size_t>(r.id) * d);
  }
  return x;
}

absl::StatusOr<readout::ReadoutState> TrainSourceReadout(
    const readout::SynthGenerator& generator,
    const readout::SynthDomain& domain, std::span<const int64_t> length_pool,
    int64_t rows, int64_t max_tokens, uint64_t seed,
    const ProgressFn& progress) {
  if (length_pool.empty()) {
    return absl::InvalidArgumentError("no source-domain lengths to train on");
  }
  const int64_t d = generator.options().dim;
  std::vector<float> x(static_cast<size_t>(rows * d));
  std::vector<int64_t> lengths(static_cast<size_t>(rows));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, length_pool.size() - 1);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t l =
        std::clamp<int64_t>(length_pool[pick(rng)], 1, max_tokens);
    lengths[static_cast<size_t>(i)] = l;
    generator.FeaturesForLength(domain, l, rng, x.data() + i * d);
  }
  if (progress) {
    progress(absl::StrCat("training the source readout: ", rows, " synthetic '",
                          domain.name, "' requests, d=", d,
                          ", ridge with 5-fold CV"));
  }
  readout::RidgeOptions ro;
  ro.max_tokens = max_tokens;
  ro.compute_p0 = true;
  ro.seed = seed;
  readout::FeatureMatrix m;
  m.data = x.data();
  m.dtype = readout::DType::kFloat32;
  m.rows = rows;
  m.cols = d;
  ASSIGN_OR_RETURN(readout::RidgeResult fit, FitRidge(m, lengths, ro));
  readout::ReadoutState state;
  state.spec.dim = d;
  state.spec.layer = 30;
  state.spec.model_id = "synthetic-replay";
  state.spec.max_tokens = max_tokens;
  state.spec.lambda = fit.lambda;
  state.standardizer = std::move(fit.standardizer);
  state.theta = std::move(fit.theta);
  state.p = std::move(fit.p0);
  state.version = 1;
  state.train_rows = rows;
  state.note = "leapctl replay: synthetic source-domain readout";
  RETURN_IF_ERROR(state.Validate());
  return state;
}

// ---- arms ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LeapArm>> LeapArm::Create(
    const client::ServerOptions& server, const std::string& name,
    const std::string& artifact, bool frozen) {
  std::unique_ptr<LeapArm> arm(new LeapArm(server, name));
  pb::CreateReadoutRequest create;
  create.set_name(name);
  create.set_artifact(artifact);
  absl::StatusOr<pb::ReadoutInfo> info = arm->admin_.CreateReadout(create);
  if (!info.ok()) {
    arm->removed_ = true;
    return info.status();
  }
  if (frozen) {
    absl::StatusOr<pb::ReadoutInfo> f = arm->admin_.SetAdaptation(name, true);
    if (!f.ok()) return f.status();
  }
  pb::Route route;
  route.set_product_line(name);
  pb::Arm* a = route.add_arms();
  a->set_name(name);
  a->set_readout(name);
  a->set_percent(100);
  absl::StatusOr<pb::Route> r = arm->admin_.SetRoute(route);
  if (!r.ok()) return r.status();
  return arm;
}

absl::Status LeapArm::Remove() {
  if (removed_) return absl::OkStatus();
  removed_ = true;
  absl::Status route = admin_.DeleteRoute(name_);
  absl::Status readout = admin_.DeleteReadout(name_);
  return route.ok() ? readout : route;
}

LeapArm::~LeapArm() { Remove().IgnoreError(); }

// ---- predictor
// ----------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LeapPredictor>> LeapPredictor::Create(
    LeapPredictorOptions options) {
  if (options.dim < 1 ||
      options.features.size() % static_cast<size_t>(options.dim) != 0) {
    return absl::InvalidArgumentError("features do not match dim");
  }
  if (options.charged_latency_s.has_value() &&
      !(*options.charged_latency_s >= 0 &&
        std::isfinite(*options.charged_latency_s))) {
    return absl::InvalidArgumentError(
        absl::StrCat("charged latency must be finite and >= 0, got ",
                     *options.charged_latency_s));
  }
  if (!(options.max_wait >= absl::ZeroDuration())) {
    return absl::InvalidArgumentError("max_wait must be >= 0");
  }
  std::unique_ptr<LeapPredictor> p(new LeapPredictor(std::move(options)));
  shim::ClientOptions co;
  co.endpoint = p->options_.endpoint;
  co.engine_id = "leapctl-replay";
  co.model_id = "synthetic-replay";
  co.layer = 30;
  co.dim = p->options_.dim;
  co.dtype = shim::DType::kFloat32;
  ASSIGN_OR_RETURN(p->client_, shim::Client::Start(co));
  p->client_->SetCallback(
      [raw = p.get()](const shim::Event& e) { raw->OnEvent(e); });
  if (!p->client_->WaitConnected(p->options_.connect_timeout)) {
    return absl::UnavailableError(absl::StrCat(
        "UNAVAILABLE: the engine shim could not connect to leapd at ",
        p->options_.endpoint, " within ",
        absl::FormatDuration(p->options_.connect_timeout)));
  }
  return p;
}

LeapPredictor::~LeapPredictor() {
  if (client_ != nullptr) client_->SetCallback(nullptr);
  client_.reset();
}

int64_t LeapPredictor::IdOf(const std::string& request_id) const {
  const size_t slash = request_id.rfind('/');
  if (slash == std::string::npos) return -1;
  int64_t v = -1;
  const char* b = request_id.data() + slash + 1;
  const char* e = request_id.data() + request_id.size();
  const auto [end, ec] = std::from_chars(b, e, v);
  return ec == std::errc() && end == e ? v : -1;
}

void LeapPredictor::OnEvent(const shim::Event& e) {
  absl::MutexLock lock(&mu_);
  switch (e.kind) {
    case shim::Event::Kind::kPrediction: {
      max_version_ = std::max(max_version_, e.version);
      auto it = pending_.find(IdOf(e.request_id));
      if (it == pending_.end() || it->second.arrived) break;
      const double measured =
          std::chrono::duration<double>(Clock::now() - it->second.submitted)
              .count();
      const double charged = options_.charged_latency_s.value_or(measured);
      latencies_.push_back(measured);
      // Recorded even for a request that finished first: a later run that
      // reuses the predictions (another discipline) may still hold it.
      recorded_[it->first] = {e.predicted_tokens, charged};
      if (it->second.finished) {
        pending_.erase(it);  // outstanding_ counted it out at Finished
        break;
      }
      it->second.arrived = true;
      it->second.latency_s = charged;
      it->second.tokens = e.predicted_tokens;
      --outstanding_;
      break;
    }
    case shim::Event::Kind::kRescore:
      max_version_ = std::max(max_version_, e.version);
      ++rescores_;
      rescored_.emplace_back(IdOf(e.request_id), e.predicted_tokens);
      break;
    case shim::Event::Kind::kError: {
      ++errors_;
      if (first_error_.empty()) {
        first_error_ = absl::StrCat(e.request_id.empty() ? "" : e.request_id,
                                    e.request_id.empty() ? "" : ": ", "code ",
                                    e.code, ": ", e.message);
      }
      auto it = pending_.find(IdOf(e.request_id));
      if (it != pending_.end()) {
        if (!it->second.arrived && !it->second.finished) --outstanding_;
        pending_.erase(it);
      }
      break;
    }
    default:
      break;
  }
}

absl::Status LeapPredictor::Prefilled(
    std::span<const SimRequest* const> requests, double capture_s,
    double end_s) {
  const size_t row = static_cast<size_t>(options_.dim) * sizeof(float);
  std::vector<shim::CapturedFeatures> batch;
  batch.reserve(requests.size());
  for (const SimRequest* r : requests) {
    const size_t at =
        static_cast<size_t>(r->id) * static_cast<size_t>(options_.dim);
    if (at + static_cast<size_t>(options_.dim) > options_.features.size()) {
      return absl::InternalError(
          absl::StrCat("no features for request ", r->id));
    }
    shim::CapturedFeatures f;
    f.request_id = absl::StrCat(options_.product_line, "/", r->id);
    f.product_line = options_.product_line;
    f.bytes.assign(reinterpret_cast<const char*>(options_.features.data() + at),
                   row);
    if (static_cast<size_t>(r->id) < options_.max_tokens.size()) {
      f.max_tokens = options_.max_tokens[static_cast<size_t>(r->id)];
    }
    batch.push_back(std::move(f));
  }
  {
    absl::MutexLock lock(&mu_);
    const Clock::time_point now = Clock::now();
    for (const SimRequest* r : requests) {
      Pending& p = pending_[r->id];
      p = Pending();
      p.capture_s = capture_s;
      p.submitted = now;
      ++outstanding_;
    }
  }
  // Outside the lock: Submit may report a bad request through OnEvent.
  client_->Submit(std::move(batch));
  return absl::OkStatus();
}

absl::Status LeapPredictor::Collect(double now_s,
                                    std::vector<PredictionUpdate>* out) {
  absl::MutexLock lock(&mu_);
  if (outstanding_ > 0) {
    // Capped so that an infinite max_wait converts to the clock's duration.
    const double max_wait =
        std::min(absl::ToDoubleSeconds(options_.max_wait), 86400.0);
    const Clock::time_point wall_now = Clock::now();
    Clock::time_point deadline = wall_now;
    if (options_.charged_latency_s.has_value()) {
      // Every prediction due by `now` (capture + the charged latency) and
      // still within max_wait of its submission is waited for.
      const double charged = *options_.charged_latency_s;
      const auto max_wait_d = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(max_wait));
      std::vector<int64_t>& due = due_missing_;
      due.clear();
      for (auto& [id, p] : pending_) {
        if (p.arrived || p.finished || p.capture_s + charged > now_s) continue;
        if (p.submitted + max_wait_d <= wall_now) {
          if (!p.timed_out) ++wait_timeouts_;
          p.timed_out = true;
          continue;
        }
        due.push_back(id);
        deadline = std::max(deadline, p.submitted + max_wait_d);
      }
      const auto all_due_in = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (int64_t id : due) {
          auto it = pending_.find(id);
          if (it != pending_.end() && !it->second.arrived) return false;
        }
        return true;
      };
      const absl::Duration left = absl::FromChrono(deadline - Clock::now());
      if (!due.empty() && left > absl::ZeroDuration()) {
        mu_.AwaitWithTimeout(absl::Condition(&all_due_in), left);
      }
    } else {
      // A prediction still missing is known at `now` only if it arrives
      // within (now - capture) of its submission: wait for the latest such
      // moment, but never past max_wait after its submission.
      for (const auto& [id, p] : pending_) {
        if (p.arrived || p.finished) continue;
        const auto slack = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(
                std::clamp(now_s - p.capture_s, 0.0, max_wait)));
        deadline = std::max(deadline, p.submitted + slack);
      }
      const auto all_in = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return outstanding_ == 0;
      };
      const absl::Duration left = absl::FromChrono(deadline - Clock::now());
      if (left > absl::ZeroDuration()) {
        mu_.AwaitWithTimeout(absl::Condition(&all_in), left);
      }
    }
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    const Pending& p = it->second;
    if (p.arrived && p.capture_s + p.latency_s <= now_s) {
      out->push_back({it->first, p.tokens, false});
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  for (const auto& [id, tokens] : rescored_) {
    auto it = pending_.find(id);
    if (it != pending_.end()) {
      // Not handed over yet: the newer value goes with it when it is due.
      if (it->second.arrived) it->second.tokens = tokens;
      continue;
    }
    if (id >= 0) out->push_back({id, tokens, true});
  }
  rescored_.clear();
  return absl::OkStatus();
}

absl::Status LeapPredictor::Finished(const SimRequest& request) {
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(request.id);
    if (it != pending_.end()) {
      if (it->second.arrived) {
        pending_.erase(it);
      } else if (!it->second.finished) {
        // Kept until its prediction arrives, to record it (recorded()).
        it->second.finished = true;
        --outstanding_;
      }
    }
  }
  client_->Complete(absl::StrCat(options_.product_line, "/", request.id),
                    std::max<int64_t>(request.output_tokens, 1),
                    shim::FinishReason::kStop);
  return absl::OkStatus();
}

std::vector<double> LeapPredictor::latencies() const {
  absl::MutexLock lock(&mu_);
  return latencies_;
}
int64_t LeapPredictor::errors() const {
  absl::MutexLock lock(&mu_);
  return errors_;
}
std::string LeapPredictor::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
}
int64_t LeapPredictor::max_version() const {
  absl::MutexLock lock(&mu_);
  return max_version_;
}
absl::flat_hash_map<int64_t, std::pair<double, double>>
LeapPredictor::recorded() const {
  absl::MutexLock lock(&mu_);
  return recorded_;
}
int64_t LeapPredictor::wait_timeouts() const {
  absl::MutexLock lock(&mu_);
  return wait_timeouts_;
}

int64_t LeapPredictor::rescores() const {
  absl::MutexLock lock(&mu_);
  return rescores_;
}

}  // namespace leap::replay
