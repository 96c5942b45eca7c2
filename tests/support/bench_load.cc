#include "tests/support/bench_load.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "leap/v1/predictor.grpc.pb.h"
#include "tests/support/engine_client.h"

namespace leap::testing {
namespace pb = ::leap::v1;

namespace {
const char* FlagValue(int argc, char** argv, const std::string& name) {
  const std::string pre = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], pre.c_str(), pre.size()) == 0) {
      return argv[i] + pre.size();
    }
  }
  return nullptr;
}
}  // namespace

std::string StatusText(const grpc::Status& s) {
  // gRPC's codes are the canonical ones absl names.
  const std::string name =
      absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()));
  return s.error_message().empty() ? name : absl::StrCat(name, " ", s.error_message());
}

int64_t IntFlag(int argc, char** argv, const std::string& name, int64_t def) {
  const char* v = FlagValue(argc, argv, name);
  return v == nullptr ? def : std::atoll(v);
}

std::string StrFlag(int argc, char** argv, const std::string& name,
                    const std::string& def) {
  const char* v = FlagValue(argc, argv, name);
  return v == nullptr ? def : std::string(v);
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double Ms(BenchClock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

double Pct(std::vector<double> v, double p) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

std::string Sh(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return "";
  char buf[512];
  while (fgets(buf, sizeof(buf), f) != nullptr) out += buf;
  pclose(f);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

VersionWatcher::VersionWatcher(const std::string& address)
    : channel_(MakeChannel(address)) {
  thread_ = std::thread([this] { Run(); });
}

VersionWatcher::~VersionWatcher() {
  ctx_.TryCancel();
  thread_.join();
}

std::vector<SeenVersion> VersionWatcher::seen() {
  std::lock_guard<std::mutex> l(mu_);
  return seen_;
}

uint64_t VersionWatcher::last_seq() {
  std::lock_guard<std::mutex> l(mu_);
  return seen_.empty() ? 0 : seen_.back().fleet_seq;
}

int64_t VersionWatcher::learned() {
  std::lock_guard<std::mutex> l(mu_);
  return seen_.empty() ? 0 : seen_.back().learned;
}

std::string VersionWatcher::state() {
  std::lock_guard<std::mutex> l(mu_);
  return end_.empty() ? "watching" : end_;
}

void VersionWatcher::Run() {
  auto stub = pb::Predictor::NewStub(channel_);
  pb::WatchReadoutRequest req;
  req.set_readout("r");
  auto w = stub->WatchReadout(&ctx_, req);
  pb::ReadoutVersion v;
  while (w->Read(&v)) {
    std::lock_guard<std::mutex> l(mu_);
    seen_.push_back({BenchClock::now(), v.fleet_seq(), v.completions_learned(),
                     v.published_unix_ms()});
  }
  const grpc::Status st = w->Finish();
  std::lock_guard<std::mutex> l(mu_);
  end_ = absl::StrCat("ended: ", StatusText(st));
}

double RunPacedClients(const PacedClientsOptions& o, std::atomic<int64_t>* next_id,
                       std::vector<AckedCompletion>* acked, int64_t* failures,
                       std::vector<std::string>* failure_reasons) {
  std::mutex mu;
  std::vector<std::thread> threads;
  const auto start = BenchClock::now();
  const auto end = start + std::chrono::duration_cast<BenchClock::duration>(
                               std::chrono::duration<double>(o.seconds));
  std::atomic<int64_t> failed{0};
  for (int64_t c = 0; c < o.clients; ++c) {
    threads.emplace_back([&, c] {
      const std::string& address = o.addresses[c % o.addresses.size()];
      auto stub = pb::Predictor::NewStub(MakeChannel(address));
      auto fail = [&](const std::string& why) {
        ++failed;
        if (failure_reasons == nullptr) return;
        std::lock_guard<std::mutex> l(mu);
        failure_reasons->push_back(why);
      };
      std::mt19937_64 rng(c + 1 + next_id->load());
      std::normal_distribution<float> n01;
      std::vector<float> x(o.dim);
      std::vector<AckedCompletion> mine;
      for (int64_t i = 0;; ++i) {
        if (o.per_client_rate > 0) {
          const auto due = start + std::chrono::microseconds(
                                       static_cast<int64_t>(i * 1e6 / o.per_client_rate));
          if (due >= end) break;
          std::this_thread::sleep_until(due);
        } else if (BenchClock::now() >= end) {
          break;
        }
        double s = 18;
        for (int64_t k = 0; k < o.dim; ++k) {
          x[k] = n01(rng);
          if (k < 16) s += 0.5 * x[k];
        }
        const std::string id = absl::StrCat("b", next_id->fetch_add(1));
        pb::PredictRequest preq;
        preq.set_dtype(pb::FEATURE_DTYPE_FLOAT32);
        preq.mutable_record()->set_request_id(id);
        preq.mutable_record()->set_features(
            std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
        pb::PredictResponse presp;
        grpc::ClientContext pctx;
        if (grpc::Status st = stub->Predict(&pctx, preq, &presp); !st.ok()) {
          fail(absl::StrCat("Predict at ", address, ": ", StatusText(st)));
          continue;
        }
        pb::CompleteRequest creq;
        creq.mutable_completion()->set_request_id(id);
        creq.mutable_completion()->set_output_tokens(
            std::clamp<int64_t>(std::llround(s * s), 1, 4000));
        creq.mutable_completion()->set_reason(pb::FINISH_REASON_STOP);
        pb::CompleteResponse cresp;
        grpc::ClientContext cctx;
        if (grpc::Status st = stub->Complete(&cctx, creq, &cresp); !st.ok()) {
          fail(absl::StrCat("Complete at ", address, ": ", StatusText(st)));
          continue;
        }
        if (o.require_fleet_seq && cresp.fleet_seq() == 0) {
          fail(absl::StrCat("Complete at ", address, ": acknowledged without fleet_seq"));
          continue;
        }
        mine.push_back({BenchClock::now(), NowUnixMs(), cresp.fleet_seq()});
      }
      std::lock_guard<std::mutex> l(mu);
      acked->insert(acked->end(), mine.begin(), mine.end());
    });
  }
  for (auto& t : threads) t.join();
  *failures = failed.load();
  std::sort(acked->begin(), acked->end(),
            [](const AckedCompletion& a, const AckedCompletion& b) { return a.t < b.t; });
  return Ms(BenchClock::now() - start) / 1000;
}

}  // namespace leap::testing
