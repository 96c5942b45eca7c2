// fail_open_engine: an engine-side process for the fail-open test. It runs
// an engine's step loop on the shim's Client and CountdownScheduler: every
// step a request arrives (its features are submitted), predictions and
// rescores are applied, a decode step is selected, and requests that reached
// their (random) true length complete. It never waits for leapd.
//
//   fail_open_engine ENDPOINT DIM STEP_US RESPONSE_TIMEOUT_MS
//
// Prints, every 100 ms:
//   status steps=S completed=C predicted=P unpredicted_completed=U
//          degraded=0|1 stalls=K live=L max_call_us=M order_violations=V
// (predicted: predictions received; unpredicted_completed: requests that
// finished without ever having a prediction; max_call_us: the longest time
// one step spent inside the Client's calls (Submit, Poll, Complete, stats:
// what must never wait for leapd); order_violations:
// selections where requests without a prediction were not in arrival order
// among themselves), and "event connected ID" / "event disconnected REASON"
// as the Client reports them. On SIGTERM: destroys the Client, prints
// "exit destroy_us=N" and exits 0.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_shim/client.h"
#include "engine_shim/scheduler.h"

namespace {

std::atomic<bool> g_stop{false};

void OnTerm(int) { g_stop.store(true); }

struct Request {
  int64_t true_len = 0;
  int64_t generated = 0;
  bool predicted = false;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr,
                 "usage: fail_open_engine ENDPOINT DIM STEP_US "
                 "RESPONSE_TIMEOUT_MS\n");
    return 2;
  }
  signal(SIGTERM, OnTerm);
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  leap::shim::ClientOptions o;
  o.endpoint = argv[1];
  o.dim = std::atoll(argv[2]);
  const absl::Duration step = absl::Microseconds(std::atoll(argv[3]));
  o.response_timeout = absl::Milliseconds(std::atoll(argv[4]));
  o.engine_id = "fail-open-engine";
  o.min_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  o.connect_timeout = absl::Milliseconds(300);
  o.shm_slots = 4096;
  auto client = leap::shim::Client::Start(o);
  if (!client.ok()) {
    std::fprintf(stderr, "client: %s\n", client.status().ToString().c_str());
    return 1;
  }
  leap::shim::SchedulerOptions so;
  so.slots = 32;  // ~1.5 completions per step for one arrival per step
  // No waiting cap: its promotions (most-waited first) would reorder
  // requests on purpose; what is checked here is the placement of requests
  // without a prediction (UnpredictedPolicy::kMedian, the default).
  so.waiting_cap = 0;
  auto sched = leap::shim::CountdownScheduler::Create(so);
  if (!sched.ok()) return 1;

  std::mt19937 rng(7);
  std::normal_distribution<float> n01;
  std::uniform_int_distribution<int> len(4, 40);
  std::map<std::string, Request> live;
  int64_t next_id = 0, steps = 0, completed = 0, predicted = 0,
          unpredicted_completed = 0, violations = 0;
  absl::Duration max_call;
  absl::Time next_status = absl::Now() + absl::Milliseconds(100);
  absl::Time next_step = absl::Now();
  std::vector<float> x(static_cast<size_t>(o.dim));
  while (!g_stop.load()) {
    absl::Duration in_client;
    // One arrival per step.
    const std::string id = absl::StrCat("r", next_id++);
    for (float& v : x) v = n01(rng);
    leap::shim::CapturedFeatures f;
    f.request_id = id;
    f.bytes.assign(reinterpret_cast<const char*>(x.data()), x.size() * 4);
    absl::Time t0 = absl::Now();
    (*client)->Submit({std::move(f)});
    in_client += absl::Now() - t0;
    (void)sched->Add(id);
    live[id].true_len = len(rng);
    t0 = absl::Now();
    const std::vector<leap::shim::Event> events = (*client)->Poll();
    in_client += absl::Now() - t0;
    for (const auto& e : events) {
      switch (e.kind) {
        case leap::shim::Event::Kind::kPrediction:
          ++predicted;
          if (live.count(e.request_id) &&
              sched->SetPrediction(e.request_id, e.predicted_tokens).ok()) {
            live[e.request_id].predicted = true;
          }
          break;
        case leap::shim::Event::Kind::kRescore:
          if (live.count(e.request_id) &&
              sched->Rescore(e.request_id, e.predicted_tokens).ok()) {
            live[e.request_id].predicted = true;
          }
          break;
        case leap::shim::Event::Kind::kConnected:
          std::printf("event connected %s\n", e.message.c_str());
          break;
        case leap::shim::Event::Kind::kDisconnected:
          std::printf("event disconnected %s\n", e.message.c_str());
          break;
        case leap::shim::Event::Kind::kError:
          break;
        case leap::shim::Event::Kind::kPrior:  // this engine asks for none
          break;
      }
    }
    // Requests without a prediction are served first-come among
    // themselves: the ones chosen are the earliest-arrived of them, in
    // arrival order.
    std::vector<uint64_t> waiting;  // arrivals of unpredicted live requests
    for (const auto& [id, r] : live) {
      auto st = sched->GetRequest(id);
      if (st.ok() && !st->predicted_tokens.has_value()) {
        waiting.push_back(st->arrival);
      }
    }
    std::sort(waiting.begin(), waiting.end());
    const std::vector<std::string> chosen = sched->Select();
    size_t next_unpredicted = 0;
    for (const std::string& c : chosen) {
      auto st = sched->GetRequest(c);
      if (!st.ok() || st->predicted_tokens.has_value()) continue;
      if (next_unpredicted >= waiting.size() ||
          st->arrival != waiting[next_unpredicted]) {
        ++violations;
      }
      ++next_unpredicted;
    }
    for (const std::string& c : chosen) {
      Request& r = live[c];
      if (++r.generated >= r.true_len) {
        t0 = absl::Now();
        (*client)->Complete(c, r.generated, leap::shim::FinishReason::kStop);
        in_client += absl::Now() - t0;
        (void)sched->Remove(c);
        ++completed;
        if (!r.predicted) ++unpredicted_completed;
        live.erase(c);
      }
    }
    t0 = absl::Now();
    const leap::shim::ClientStats cs = (*client)->stats();
    in_client += absl::Now() - t0;
    max_call = std::max(max_call, in_client);
    ++steps;
    if (absl::Now() >= next_status) {
      std::printf(
          "status steps=%lld completed=%lld predicted=%lld "
          "unpredicted_completed=%lld degraded=%d stalls=%lld live=%lld "
          "max_call_us=%lld order_violations=%lld\n",
          static_cast<long long>(steps), static_cast<long long>(completed),
          static_cast<long long>(predicted),
          static_cast<long long>(unpredicted_completed), cs.degraded ? 1 : 0,
          static_cast<long long>(cs.stalls), static_cast<long long>(cs.live),
          static_cast<long long>(absl::ToInt64Microseconds(max_call)),
          static_cast<long long>(violations));
      next_status += absl::Milliseconds(100);
    }
    next_step += step;
    const absl::Duration left = next_step - absl::Now();
    if (left > absl::ZeroDuration()) {
      absl::SleepFor(left);
    } else {
      next_step = absl::Now();
    }
  }
  const absl::Time t_end = absl::Now();
  client->reset();
  std::printf("exit destroy_us=%lld\n",
              static_cast<long long>(absl::ToInt64Microseconds(absl::Now() - t_end)));
  return 0;
}
