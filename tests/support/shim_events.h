// The events a shim::Client delivers to its callback, recorded so that a test
// waits on an event (with a deadline) instead of sleeping; and a Client
// started with fast reconnects whose callback records into one. Header only,
// test-only: the test links leap::shim_client.
#ifndef LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_
#define LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  std::vector<shim::Event> events() {
    absl::MutexLock lock(&mu_);
    return events_;
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

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SHIM_EVENTS_H_
