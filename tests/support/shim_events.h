// The events a shim::Client delivers to its callback, recorded so that a test
// waits on an event (with a deadline) instead of sleeping; a Client started
// with fast reconnects whose callback records into one; and a deadline poll
// for the Client's counters, which no event announces. Header only,
// test-only: the test links leap::shim_client.
#ifndef LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_
#define LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_shim/client.h"

namespace leap::testing {

// Threads: the Client's threads call Add; any test thread calls the rest.
// Declare it before the Client it records: the Client calls back into it
// until the Client is destroyed.
class ShimEvents {
 public:
  void Add(const shim::Event& e) {
    absl::MutexLock lock(&mu_);
    events_.push_back(e);
  }
  // Waits until `pred` over all events so far holds; false at the timeout.
  bool Wait(const std::function<bool(const std::vector<shim::Event>&)>& pred,
            absl::Duration timeout = absl::Seconds(30)) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pred(events_); };
    return mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  }
  // Waits for an event that `match` accepts; returns the first such event
  // (nullopt at the timeout).
  std::optional<shim::Event> Await(const std::function<bool(const shim::Event&)>& match,
                                   absl::Duration timeout = absl::Seconds(30)) {
    std::optional<shim::Event> found;
    Wait(
        [&](const std::vector<shim::Event>& ev) {
          for (const shim::Event& e : ev) {
            if (match(e)) {
              found = e;
              return true;
            }
          }
          return false;
        },
        timeout);
    return found;
  }
  // Waits until at least `n` events of `kind` came; false at the timeout.
  bool AwaitCount(shim::Event::Kind kind, int n,
                  absl::Duration timeout = absl::Seconds(30)) {
    return Wait([&](const std::vector<shim::Event>& ev) { return CountOf(ev, kind) >= n; },
                timeout);
  }
  // Events of `kind` so far.
  int Count(shim::Event::Kind kind) {
    absl::MutexLock lock(&mu_);
    return CountOf(events_, kind);
  }
  std::vector<shim::Event> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  static int CountOf(const std::vector<shim::Event>& ev, shim::Event::Kind kind) {
    return static_cast<int>(std::count_if(
        ev.begin(), ev.end(), [kind](const shim::Event& e) { return e.kind == kind; }));
  }

 private:
  absl::Mutex mu_;
  std::vector<shim::Event> events_ ABSL_GUARDED_BY(mu_);
};

// The first event of `kind` for request `id`, or nullptr.
inline const shim::Event* FindEvent(const std::vector<shim::Event>& ev,
                                    shim::Event::Kind kind, const std::string& id) {
  for (const shim::Event& e : ev) {
    if (e.kind == kind && e.request_id == id) return &e;
  }
  return nullptr;
}

// Matchers for ShimEvents::Await: any event of `kind`; the prediction of `id`.
inline std::function<bool(const shim::Event&)> OfKind(shim::Event::Kind kind) {
  return [kind](const shim::Event& e) { return e.kind == kind; };
}
inline std::function<bool(const shim::Event&)> PredictionOf(const std::string& id) {
  return [id](const shim::Event& e) {
    return e.kind == shim::Event::Kind::kPrediction && e.request_id == id;
  };
}

// Polls `pred` (every 2 ms) until it holds; false after `timeout`. Only for
// what no event announces, such as the Client's counters (stats()).
template <typename F>
bool PollUntil(F pred, absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));  // the poll period
  }
  return true;
}

// Polls until `c` holds no live request: every completion acknowledged
// (or refused for good). Acknowledgements carry no event.
inline bool AwaitNoneLive(shim::Client& c, absl::Duration timeout = absl::Seconds(30)) {
  return PollUntil([&c] { return c.stats().live == 0; }, timeout);
}

// Client options for a test: `endpoint`, width `dim`, `engine_id`, and
// reconnects every 20 ms to 200 ms (a restarted leapd is found at once).
inline shim::ClientOptions TestClientOptions(const std::string& endpoint, int64_t dim,
                                             const std::string& engine_id) {
  shim::ClientOptions o;
  o.endpoint = endpoint;
  o.dim = dim;
  o.engine_id = engine_id;
  o.min_backoff = absl::Milliseconds(20);
  o.max_backoff = absl::Milliseconds(200);
  return o;
}

// Starts a Client whose callback records every event into `events`.
inline absl::StatusOr<std::unique_ptr<shim::Client>> StartRecordedClient(
    shim::ClientOptions o, ShimEvents* events) {
  absl::StatusOr<std::unique_ptr<shim::Client>> c = shim::Client::Start(std::move(o));
  if (c.ok()) (*c)->SetCallback([events](const shim::Event& e) { events->Add(e); });
  return c;
}

// StartRecordedClient, then waits up to `timeout` for its first session
// (WaitConnected); an error if it does not connect by then.
inline absl::StatusOr<std::unique_ptr<shim::Client>> StartConnectedClient(
    shim::ClientOptions o, ShimEvents* events,
    absl::Duration timeout = absl::Seconds(10)) {
  absl::StatusOr<std::unique_ptr<shim::Client>> c =
      StartRecordedClient(std::move(o), events);
  if (c.ok() && !(*c)->WaitConnected(timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the shim client did not connect within ", absl::FormatDuration(timeout)));
  }
  return c;
}

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_
