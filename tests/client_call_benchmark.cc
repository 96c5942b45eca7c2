// client_call_benchmark: how long an engine's step loop waits inside the
// shim's Client calls while the Client ships large feature batches, at
// d = 4096 (fp32: 16 KiB a request), over gRPC (unix socket) and shared
// memory, against a real leapd.
//
// The step loop (this process's main thread) runs like an engine's: every
// --step-us a step; every --burst-every steps a burst of --burst requests
// arrives (one Submit of their features), every other step one request
// does; each step it drains Poll and completes the requests submitted
// --complete-after steps before (Complete). Measured: the wall time of each
// call, split into the burst Submits (they move the engine's own features
// in), the small calls that take the Client's lock (one-request Submit,
// Complete, stats), whose time is what the Client's threads can add to a
// step, and Poll (the event queue's own lock). The limit printed beside
// them: one memcpy of a burst's feature bytes, measured in the same run (a
// lower bound on copying them as 256 separate strings): a call that waited
// behind the Client's manager while it copied a burst into a message would
// wait at least that long. Also: how many predictions came only after
// their request was completed, the time from Submit to the prediction's
// Poll (p50, p99, max, and p50 of each half of the run: a growing figure
// is a leapd that falls behind; requests never predicted are not in them,
// their count is printed), and the error events by message.
//
// Usage: client_call_benchmark [--seconds S] [--burst N] [--burst-every K]
//                              [--step-us U] [--complete-after C]
//                              [--transports unix,shm] [--leapd-arg ARG]...
// --transports: which to run, each against its own leapd (a transport run
// after another would inherit the first one's learning backlog);
// --leapd-arg: a flag for leapd (repeatable).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "client/bench.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_shim/client.h"
#include "tests/support/engine_client.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kDim = 4096;

double Us(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

struct Options {
  double seconds = 5;
  int burst = 256;
  int burst_every = 50;
  int step_us = 2000;
  int complete_after = 20;
  std::vector<std::string> transports = {"unix", "shm"};
  std::vector<std::string> leapd_args;  // --leapd-arg, repeatable
};

// The best of 20 copies of `bytes` bytes (a burst's features), microseconds.
double CopyUs(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes);
  double best = 1e30;
  for (int i = 0; i < 20; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    const double us = Us(Clock::now() - t0);
    asm volatile("" : : "r"(dst.data()) : "memory");
    best = std::min(best, us);
  }
  return best;
}

struct Result {
  std::vector<double> small, polls, bursts;
  int64_t steps = 0, predictions = 0, submitted = 0, errors = 0;
  int64_t late = 0;  // predictions polled after the request was completed
  int64_t unpredicted = 0;  // requests with no prediction by the run's end
  std::vector<double> pred_ms;  // Submit to the prediction's Poll, ms
  std::map<std::string, int64_t> error_kinds;  // "code: message" -> count
};

Result Run(const std::string& endpoint, const std::string& instance,
           const Options& o) {
  leap::shim::ClientOptions co;
  co.endpoint = endpoint;
  co.dim = kDim;
  co.instance_id = instance;
  auto client = leap::shim::Client::Start(co);
  if (!client.ok()) {
    std::fprintf(stderr, "Client::Start: %s\n", client.status().ToString().c_str());
    std::exit(1);
  }
  leap::shim::Client& c = **client;
  if (!c.WaitConnected(absl::Seconds(10))) {
    std::fprintf(stderr, "no connection to %s\n", endpoint.c_str());
    std::exit(1);
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0, 1);
  std::string features(static_cast<size_t>(kDim) * sizeof(float), '\0');
  for (int64_t i = 0; i < kDim; ++i) {
    const float v = g(rng);
    std::memcpy(features.data() + i * sizeof(float), &v, sizeof(float));
  }
  Result r;
  std::deque<std::pair<int64_t, std::vector<std::string>>> to_complete;
  std::unordered_set<std::string> done;
  std::unordered_map<std::string, Clock::time_point> sent;
  int64_t next_id = 0;
  const auto timed = [&](std::vector<double>& into, auto&& call) {
    const auto t0 = Clock::now();
    call();
    into.push_back(Us(Clock::now() - t0));
  };
  const auto start = Clock::now();
  auto next_step = start;
  while (Clock::now() - start < std::chrono::duration<double>(o.seconds)) {
    const bool burst = r.steps % o.burst_every == 0;
    const int n = burst ? o.burst : 1;
    std::vector<leap::shim::CapturedFeatures> batch;
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) {
      leap::shim::CapturedFeatures f;
      f.request_id = absl::StrCat("r", next_id++);
      f.product_line = std::string(1, 'p');
      f.bytes = features;  // the engine's own copy, before the call
      ids.push_back(f.request_id);
      sent[f.request_id] = Clock::now();
      batch.push_back(std::move(f));
    }
    r.submitted += n;
    timed(burst ? r.bursts : r.small, [&] { c.Submit(std::move(batch)); });
    to_complete.emplace_back(r.steps, std::move(ids));
    timed(r.polls, [&] {
      for (const auto& e : c.Poll()) {
        if (e.kind == leap::shim::Event::Kind::kPrediction) {
          ++r.predictions;
          r.late += done.count(e.request_id);
          if (auto it = sent.find(e.request_id); it != sent.end()) {
            r.pred_ms.push_back(Us(Clock::now() - it->second) / 1000);
            sent.erase(it);
          }
        } else if (e.kind == leap::shim::Event::Kind::kError) {
          ++r.error_kinds[absl::StrCat(e.code, ": ", e.message.substr(0, 100))];
        }
      }
    });
    while (!to_complete.empty() &&
           to_complete.front().first + o.complete_after <= r.steps) {
      for (const std::string& id : to_complete.front().second) {
        timed(r.small, [&] {
          c.Complete(id, 100, leap::shim::FinishReason::kStop);
        });
        done.insert(id);
      }
      to_complete.pop_front();
    }
    timed(r.small, [&] { (void)c.stats(); });
    ++r.steps;
    next_step += std::chrono::microseconds(o.step_us);
    std::this_thread::sleep_until(next_step);  // the step's GPU time
  }
  r.errors = c.stats().errors;
  r.unpredicted = static_cast<int64_t>(sent.size());
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: client_call_benchmark [--seconds S] [--burst N] "
                   "[--burst-every K] [--step-us U] [--complete-after C] [--transports unix,shm] "
                   "[--leapd-arg ARG]...\n");
      return k == "--help" ? 0 : 2;
    }
    const double v = std::atof(argv[i + 1]);
    if (k == "--transports") {
      o.transports = absl::StrSplit(argv[i + 1], ',');
      for (size_t t = 0; t < o.transports.size(); ++t) {
        const std::string& name = o.transports[t];
        if (name != "unix" && name != "shm") {
          std::fprintf(stderr, "--transports: unknown transport '%s' (unix, shm)\n",
                       name.c_str());
          return 2;
        }
        if (std::find(o.transports.begin(), o.transports.begin() + t, name) !=
            o.transports.begin() + t) {
          std::fprintf(stderr, "--transports: '%s' given twice\n", name.c_str());
          return 2;
        }
      }
      continue;
    }
    if (k == "--leapd-arg") {
      o.leapd_args.push_back(argv[i + 1]);
      continue;
    }
    if (k == "--seconds") o.seconds = v;
    else if (k == "--burst") o.burst = static_cast<int>(v);
    else if (k == "--burst-every") o.burst_every = static_cast<int>(v);
    else if (k == "--step-us") o.step_us = static_cast<int>(v);
    else if (k == "--complete-after") o.complete_after = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (o.burst < 1 || o.burst_every < 1 || o.step_us < 1 || o.seconds <= 0 ||
      o.complete_after < 0) {
    std::fprintf(stderr, "flags must be positive\n");
    return 2;
  }
  const leap::testing::ScopedTempDir tmp("client-call-bench");
  const size_t burst_bytes =
      static_cast<size_t>(o.burst) * static_cast<size_t>(kDim) * sizeof(float);
  const double copy_us = CopyUs(burst_bytes);
  std::printf("machine: %s, %ld cores; d = %lld fp32; burst %d requests "
              "(%.1f MiB) every %d steps of %d us; one copy of a burst: "
              "%.0f us\n",
              leap::client::CpuModel().c_str(), sysconf(_SC_NPROCESSORS_ONLN),
              static_cast<long long>(kDim), o.burst,
              static_cast<double>(burst_bytes) / (1 << 20), o.burst_every,
              o.step_us, copy_us);
  for (const std::string& transport : o.transports) {
    // A leapd of its own: no learning backlog left by the previous run.
    const std::string dir = tmp.path() + "/" + transport;
    const std::string sock = "unix://" + dir + ".sock";
    std::string addr;
    std::vector<std::string> args = {"--listen=" + sock, "--data_dir=" + dir,
                                     "--shm=" + dir + ".shm"};
    args.insert(args.end(), o.leapd_args.begin(), o.leapd_args.end());
    auto leapd = leap::testing::StartLeapd(LEAPD_PATH, args, &addr);
    if (!leapd.ok()) {
      std::fprintf(stderr, "leapd: %s\n", leapd.status().ToString().c_str());
      return 1;
    }
    if (const grpc::Status s =
            leap::testing::CreateDefaultReadout(sock, "r", kDim);
        !s.ok()) {
      std::fprintf(stderr, "CreateReadout: %s\n", s.error_message().c_str());
      return 1;
    }
    const std::string endpoint =
        transport == "shm" ? "shm://" + dir + ".shm" : sock;
    const Result r = Run(endpoint, "bench-" + transport, o);
    const double max_small = Quantile(r.small, 1.0);
    std::printf("%-4s  steps %lld, requests %lld, predictions %lld, errors "
                "%lld; locked calls (%zu): p50 %.1f us, p99 %.1f us, p99.9 "
                "%.1f us, max %.0f us (%.2f x one burst copy); Poll (%zu): "
                "p99.9 %.1f us, max %.0f us; burst Submits (%zu): p50 %.0f "
                "us, max %.0f us\n",
                transport.c_str(), static_cast<long long>(r.steps),
                static_cast<long long>(r.submitted),
                static_cast<long long>(r.predictions),
                static_cast<long long>(r.errors), r.small.size(),
                Quantile(r.small, 0.5), Quantile(r.small, 0.99),
                Quantile(r.small, 0.999), max_small, max_small / copy_us,
                r.polls.size(), Quantile(r.polls, 0.999),
                Quantile(r.polls, 1.0), r.bursts.size(),
                Quantile(r.bursts, 0.5), Quantile(r.bursts, 1.0));
    const size_t h = r.pred_ms.size() / 2;
    std::printf("      predictions after the request ended: %lld; no "
                "prediction by the end: %lld; Submit to prediction (of those "
                "predicted: lower bounds when some are not): p50 %.1f ms, "
                "p99 %.1f ms, max %.1f ms; first half p50 %.1f ms, second "
                "half p50 %.1f ms\n",
                static_cast<long long>(r.late),
                static_cast<long long>(r.unpredicted), Quantile(r.pred_ms, 0.5),
                Quantile(r.pred_ms, 0.99), Quantile(r.pred_ms, 1.0),
                Quantile({r.pred_ms.begin(), r.pred_ms.begin() + h}, 0.5),
                Quantile({r.pred_ms.begin() + h, r.pred_ms.end()}, 0.5));
    for (const auto& [what, n] : r.error_kinds) {
      std::printf("      error events %lld x %s\n", static_cast<long long>(n),
                  what.c_str());
    }
  }
  return 0;
}
