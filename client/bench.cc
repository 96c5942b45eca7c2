#include "client/bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "readout/features.h"
#include "client/engine_connection.h"

namespace leap::client {
namespace {

namespace pb = ::leap::v1;
using Clock = std::chrono::steady_clock;

// Bulk cancels are sent once this many request ids are live on a stream.
constexpr int64_t kCancelEvery = 8192;
// Feature batches in flight per stream.
constexpr int64_t kInFlight = 2;

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Sets up the readout and route the traffic uses; removes what it created
// when destroyed.
class BenchTarget {
 public:
  BenchTarget(AdminClient& admin, const BenchOptions& o,
              const ProgressFn& progress)
      : admin_(admin), o_(o), progress_(progress) {}
  ~BenchTarget() {
    if (created_route_) {
      absl::Status s = admin_.DeleteRoute(o_.product_line);
      if (!s.ok() && progress_) {
        progress_(
            absl::StrCat("could not delete the bench route: ", s.message()));
      }
    }
    if (created_readout_) {
      absl::Status s = admin_.DeleteReadout(o_.readout);
      if (!s.ok() && progress_) {
        progress_(
            absl::StrCat("could not delete the bench readout: ", s.message()));
      }
    }
  }

  absl::Status SetUp() {
    absl::StatusOr<pb::ReadoutInfo> info = admin_.GetReadout(o_.readout);
    if (info.ok()) {
      if (info->dim() != o_.dim) {
        return absl::FailedPreconditionError(absl::StrCat(
            "readout '", o_.readout, "' exists with dim ", info->dim(),
            ", not --dim ", o_.dim, "; pick another --readout"));
      }
    } else if (info.status().code() == absl::StatusCode::kNotFound) {
      pb::CreateReadoutRequest req;
      req.set_name(o_.readout);
      req.mutable_cold_start()->set_dim(o_.dim);
      req.mutable_cold_start()->set_lambda(1.0);
      RETURN_IF_ERROR(admin_.CreateReadout(req).status());
      created_readout_ = true;
      if (progress_) {
        progress_(absl::StrCat("created cold-start readout ", o_.readout,
                               " (d=", o_.dim, ")"));
      }
    } else {
      return info.status();
    }
    ASSIGN_OR_RETURN(pb::ListRoutesResponse routes, admin_.ListRoutes());
    for (const pb::Route& r : routes.routes()) {
      if (r.product_line() == o_.product_line) return absl::OkStatus();
    }
    pb::Route route;
    route.set_product_line(o_.product_line);
    pb::Arm* arm = route.add_arms();
    arm->set_name(o_.readout);
    arm->set_readout(o_.readout);
    arm->set_percent(100);
    RETURN_IF_ERROR(admin_.SetRoute(route).status());
    created_route_ = true;
    if (progress_) {
      progress_(absl::StrCat("routed product line '", o_.product_line, "' to ",
                             o_.readout));
    }
    return absl::OkStatus();
  }

  bool created_readout() const { return created_readout_; }
  bool created_route() const { return created_route_; }

 private:
  AdminClient& admin_;
  const BenchOptions& o_;
  const ProgressFn& progress_;
  bool created_readout_ = false;
  bool created_route_ = false;
};

// What one throughput stream saw.
struct StreamCounts {
  int64_t predicted = 0;
  int64_t errors = 0;
  absl::Status first_error;   // of a request
  absl::Status stream_error;  // of the stream itself
};

// One throughput stream: a writer (this thread) keeping kInFlight batches in
// flight and a reader thread counting answers.
StreamCounts RunStream(const std::shared_ptr<grpc::Channel>& channel,
                       const BenchOptions& o, const std::string& payload,
                       const std::string& id_prefix, Clock::time_point end) {
  StreamCounts counts;
  absl::StatusOr<std::unique_ptr<EngineConnection>> opened =
      EngineConnection::Open(channel, o.server.address, o.dim,
                             DTypeFromName(o.dtype), id_prefix);
  if (!opened.ok()) {
    counts.stream_error = opened.status();
    return counts;
  }
  EngineConnection* conn = opened->get();
  absl::Mutex mu;
  int64_t answered_batches = 0;  // guarded by mu
  int64_t answered_total = 0;    // guarded by mu
  bool broken = false;           // guarded by mu
  std::thread reader([&] {
    pb::SidecarMessage m;
    while (conn->Read(&m)) {
      if (m.seq() == 0) continue;  // publish / rescore pushes
      absl::MutexLock lock(&mu);
      ++answered_total;
      if (m.has_predictions()) {
        ++answered_batches;
        counts.predicted += m.predictions().predictions_size();
        counts.errors += m.predictions().errors_size();
        if (counts.first_error.ok() && m.predictions().errors_size() > 0) {
          counts.first_error = FromRequestError(m.predictions().errors(0));
        }
      }
    }
    absl::MutexLock lock(&mu);
    broken = true;
  });

  pb::EngineMessage msg;
  for (int64_t i = 0; i < o.batch; ++i) {
    pb::FeatureRecord* r = msg.mutable_features()->add_records();
    r->set_product_line(o.product_line);
    r->set_features(payload);
  }
  pb::EngineMessage cancel;
  uint64_t seq = 0;
  int64_t sent_batches = 0, sent_total = 0;
  int64_t next_id = 0, live_from = 0;
  const auto id = [&](int64_t n) { return absl::StrCat(id_prefix, n); };
  const auto send_cancels = [&](int64_t upto) {
    cancel.Clear();
    for (int64_t n = live_from; n < upto; ++n) {
      cancel.mutable_cancels()->add_request_ids(id(n));
    }
    live_from = upto;
    if (cancel.cancels().request_ids_size() == 0) return true;
    cancel.set_seq(++seq);
    if (!conn->Write(cancel)) return false;
    ++sent_total;
    return true;
  };
  bool ok = true;
  while (ok && Clock::now() < end) {
    {
      absl::MutexLock lock(&mu);
      const auto room = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
        return broken || sent_batches - answered_batches < kInFlight;
      };
      mu.Await(absl::Condition(&room));
      if (broken) break;
    }
    for (int64_t i = 0; i < o.batch; ++i) {
      msg.mutable_features()
          ->mutable_records(static_cast<int>(i))
          ->set_request_id(id(next_id++));
    }
    msg.set_seq(++seq);
    ok = conn->Write(msg);
    if (!ok) break;
    ++sent_batches;
    ++sent_total;
    if (next_id - live_from >= kCancelEvery) {
      ok = send_cancels(next_id - 2 * kInFlight * o.batch);
    }
  }
  if (ok) ok = send_cancels(next_id);
  {
    absl::MutexLock lock(&mu);
    const auto drained = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return broken || answered_total >= sent_total;
    };
    mu.Await(absl::Condition(&drained));
  }
  conn->WritesDone();
  reader.join();
  counts.stream_error = conn->Finish();
  return counts;
}

// Round trips of single-record messages, one at a time. Appends each in
// microseconds to `lat`.
absl::Status RunLatency(const std::shared_ptr<grpc::Channel>& channel,
                        const BenchOptions& o, const std::string& payload,
                        const std::string& id_prefix,
                        std::vector<double>* lat) {
  ASSIGN_OR_RETURN(std::unique_ptr<EngineConnection> conn,
                   EngineConnection::Open(channel, o.server.address, o.dim,
                                          DTypeFromName(o.dtype), id_prefix));
  pb::EngineMessage msg, cancel;
  pb::FeatureRecord* r = msg.mutable_features()->add_records();
  r->set_product_line(o.product_line);
  r->set_features(payload);
  pb::SidecarMessage in;
  uint64_t seq = 0;
  const auto await = [&](uint64_t want) {
    while (conn->Read(&in)) {
      if (in.seq() == want) return true;
    }
    return false;
  };
  for (int64_t i = 0; i < o.latency_requests; ++i) {
    r->set_request_id(absl::StrCat(id_prefix, i));
    msg.set_seq(++seq);
    const auto a = Clock::now();
    if (!conn->Write(msg) || !await(seq)) break;
    lat->push_back(
        std::chrono::duration<double, std::micro>(Clock::now() - a).count());
    if (in.predictions().predictions_size() == 0) {
      conn->Cancel();
      return in.predictions().errors_size() > 0
                 ? FromRequestError(in.predictions().errors(0))
                 : absl::InternalError("INTERNAL: leapd sent no prediction");
    }
    cancel.Clear();
    cancel.set_seq(++seq);
    cancel.mutable_cancels()->add_request_ids(r->request_id());
    if (!conn->Write(cancel) || !await(seq)) break;
  }
  conn->WritesDone();
  while (conn->Read(&in)) {
  }
  return conn->Finish();
}

// Nearest-rank percentile of sorted values.
double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t rank =
      static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    // x86: "model name"; some ARM kernels: "Model" or "Processor".
    for (const char* key : {"model name", "Model", "Processor"}) {
      if (line.rfind(key, 0) == 0) {
        const size_t colon = line.find(':');
        if (colon != std::string::npos && colon + 2 <= line.size()) {
          return line.substr(colon + 2);
        }
      }
    }
  }
  return "unknown";
}

absl::Status BenchOptions::Validate() const {
  RETURN_IF_ERROR(server.Validate());
  if (dim < readout::kMinDim || dim > readout::kMaxDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dim must be in [", readout::kMinDim, ", ",
                     readout::kMaxDim, "], got ", dim));
  }
  if (batch < 1 || batch > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch must be in [1, 65536], got ", batch));
  }
  if (streams < 1 || streams > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("--streams must be in [1, 256], got ", streams));
  }
  if (!(seconds > 0) || seconds > 3600) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seconds must be in (0, 3600], got ", seconds));
  }
  if (latency_requests < 0 || latency_requests > 10'000'000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--latency-requests must be in [0, 10000000], got ", latency_requests));
  }
  if (dtype != "float32" && dtype != "bfloat16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype must be float32 or bfloat16, got '", dtype, "'"));
  }
  if (readout.empty()) return absl::InvalidArgumentError("--readout is empty");
  return absl::OkStatus();
}

absl::StatusOr<BenchReport> RunBench(const BenchOptions& o,
                                     const ProgressFn& progress) {
  RETURN_IF_ERROR(o.Validate());
  const std::shared_ptr<grpc::Channel> channel = MakeChannel(o.server);
  AdminClient admin(o.server, channel);
  BenchTarget target(admin, o, progress);
  RETURN_IF_ERROR(target.SetUp());

  // One feature payload reused by every record (leapd reads it anew).
  std::mt19937 rng(1);
  std::normal_distribution<float> n01;
  std::string payload;
  if (o.dtype == "bfloat16") {
    std::vector<uint16_t> x(static_cast<size_t>(o.dim));
    for (uint16_t& v : x) v = FloatToBf16(n01(rng));
    payload.assign(reinterpret_cast<const char*>(x.data()), x.size() * 2);
  } else {
    std::vector<float> x(static_cast<size_t>(o.dim));
    for (float& v : x) v = n01(rng);
    payload.assign(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  }
  // Request ids unique to this run: leapd may hold live ids of another run.
  const std::string run = RandomRunId("bench");

  if (progress) {
    progress(absl::StrFormat("throughput: %d streams, batch %d, d=%d %s, %g s",
                             o.streams, o.batch, o.dim, o.dtype, o.seconds));
  }
  std::vector<StreamCounts> counts(static_cast<size_t>(o.streams));
  const auto t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  const auto end =
      t0 + std::chrono::microseconds(static_cast<int64_t>(o.seconds * 1e6));
  {
    std::vector<std::thread> threads;
    for (int64_t s = 0; s < o.streams; ++s) {
      threads.emplace_back([&, s] {
        counts[static_cast<size_t>(s)] =
            RunStream(channel, o, payload, absl::StrCat(run, "s", s, "-"), end);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  BenchReport r;
  r.wall_seconds = SecondsSince(t0);
  const double cpu = ProcessCpuSeconds() - cpu0;
  absl::Status first_error;
  for (const StreamCounts& c : counts) {
    if (!c.stream_error.ok()) return c.stream_error;
    r.predictions += c.predicted;
    r.errors += c.errors;
    if (first_error.ok()) first_error = c.first_error;
  }
  if (r.predictions == 0) {
    if (!first_error.ok()) return first_error;
    return absl::UnavailableError(
        "UNAVAILABLE: no prediction came back in the throughput phase");
  }
  r.predictions_per_s = static_cast<double>(r.predictions) / r.wall_seconds;
  r.client_cpu_cores = cpu / r.wall_seconds;

  if (o.latency_requests > 0) {
    if (progress) {
      progress(absl::StrCat("latency: ", o.latency_requests,
                            " single-request round trips"));
    }
    std::vector<double> lat;
    lat.reserve(static_cast<size_t>(o.latency_requests));
    RETURN_IF_ERROR(
        RunLatency(channel, o, payload, absl::StrCat(run, "lat-"), &lat));
    std::sort(lat.begin(), lat.end());
    r.latency_samples = static_cast<int64_t>(lat.size());
    r.latency_p50_us = Percentile(lat, 0.50);
    r.latency_p99_us = Percentile(lat, 0.99);
    r.latency_max_us = lat.empty() ? 0 : lat.back();
  }
  r.server = o.server.address;
  r.cpu_model = CpuModel();
  r.cores = std::thread::hardware_concurrency();
  r.dim = o.dim;
  r.dtype = o.dtype;
  r.batch = o.batch;
  r.streams = o.streams;
  r.created_readout = target.created_readout();
  r.created_route = target.created_route();
  return r;
}

std::string FormatBenchReport(const BenchReport& r) {
  std::string s =
      absl::StrFormat("machine: %s, %d cores\n", r.cpu_model, r.cores);
  absl::StrAppendFormat(&s, "server: %s\n", r.server);
  absl::StrAppendFormat(
      &s,
      "connect stream, d=%d %s, batch=%d, streams=%d: %.0f predictions/s "
      "(%d in %.2f s, %d errors)\n",
      r.dim, r.dtype, r.batch, r.streams, r.predictions_per_s, r.predictions,
      r.wall_seconds, r.errors);
  absl::StrAppendFormat(&s, "client CPU: %.2f cores\n", r.client_cpu_cores);
  if (r.latency_samples > 0) {
    absl::StrAppendFormat(
        &s,
        "single request round trip (idle server, %d samples): p50 %.0f us, "
        "p99 %.0f us, max %.0f us\n",
        r.latency_samples, r.latency_p50_us, r.latency_p99_us,
        r.latency_max_us);
  }
  return s;
}

std::string FormatBenchJson(const BenchReport& r) {
  nlohmann::json j;
  j["server"] = r.server;
  j["machine"] = {{"cpu_model", r.cpu_model}, {"cores", r.cores}};
  j["dim"] = r.dim;
  j["dtype"] = r.dtype;
  j["batch"] = r.batch;
  j["streams"] = r.streams;
  j["seconds"] = r.wall_seconds;
  j["predictions"] = r.predictions;
  j["errors"] = r.errors;
  j["predictions_per_s"] = r.predictions_per_s;
  j["client_cpu_cores"] = r.client_cpu_cores;
  j["latency_samples"] = r.latency_samples;
  j["latency_p50_us"] = r.latency_p50_us;
  j["latency_p99_us"] = r.latency_p99_us;
  j["latency_max_us"] = r.latency_max_us;
  return j.dump() + "\n";
}

}  // namespace leap::client
