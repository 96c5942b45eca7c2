// The live-request feature cache: the features of every request between its
// prediction and its completion, so a completion can be learned and a
// publish can rescore live requests. Bounded by bytes; the oldest request is
// evicted first (a request that has waited longest is the likeliest to have
// been dropped without a cancel), and entries older than a TTL expire.
#ifndef LEAP_SIDECAR_CORE_FEATURE_CACHE_H_
#define LEAP_SIDECAR_CORE_FEATURE_CACHE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "readout/features.h"

namespace leap::sidecar {

class LiveReadout;

// One arm's prediction for a live request.
struct ArmScore {
  std::string arm;
  std::string readout;
  int64_t version = 0;
  double predicted_tokens = 0;
  bool shadow = false;
  // The readout object that scored it: a readout deleted and re-created
  // under the same name (maybe another width) never learns this request.
  std::weak_ptr<LiveReadout> scorer;
};

// Owns memory that live requests' features stay in (a shared-memory slot
// arena). Release(slot) is called exactly once per request that was handed
// one: when the request fails to become live, or when its LiveRequest is
// destroyed (no one reads the slot after). Any thread; must not block.
class ExternalFeatures {
 public:
  virtual ~ExternalFeatures() = default;
  virtual void Release(uint32_t slot) = 0;
};

// A live request. Immutable after insertion except `gone`.
struct LiveRequest {
  std::string request_id;
  // Identity in the cache: the owning engine instance and the request id
  // (LiveRequestKey); two engines' requests with one id are two entries.
  std::string key;
  std::string product_line;
  // Product line of the route that served it ("" for the default route).
  std::string route_key;
  readout::DType dtype = readout::DType::kFloat32;
  int64_t dim = 0;
  std::string features;  // dim values of dtype, little-endian
  // Set when the features stay where the engine wrote them (a shared-memory
  // slot) instead of `features`; the slot goes back to `owner` when this
  // request is destroyed.
  const char* external = nullptr;
  std::shared_ptr<ExternalFeatures> owner;
  uint32_t slot = 0;

  // The cache's age order (owned by the FeatureCache, under its lock).
  LiveRequest* cache_older = nullptr;
  LiveRequest* cache_newer = nullptr;

  // User-provided (not "= default"): make_shared would value-initialize,
  // zero-filling the whole object before the members' own initializers.
  LiveRequest() {}
  LiveRequest(const LiveRequest&) = delete;
  LiveRequest& operator=(const LiveRequest&) = delete;
  ~LiveRequest() {
    if (owner != nullptr) owner->Release(slot);
  }
  int64_t request_max_tokens = 0;
  // Serving arm first, then shadows (inline: no allocation without shadows).
  absl::InlinedVector<ArmScore, 1> scores;
  // Connect session that owns it (0 = unary Predict).
  uint64_t session = 0;
  int64_t inserted_ns = 0;
  // Set once the request leaves the cache (completed, cancelled, evicted).
  std::atomic<bool> gone{false};

  readout::FeatureView view() const {
    return {external != nullptr ? external : features.data(), dtype, dim, 1};
  }
  int64_t bytes() const {
    return static_cast<int64_t>(features.size() + request_id.size() +
                                key.size() + product_line.size()) +
           256;
  }
};

// The cache key of request `request_id` of engine instance `instance` ("" for
// engines that do not say theirs: they share one namespace, and the key is
// the id itself). A request inserted with an empty key is keyed by its id.
std::string LiveRequestKey(absl::string_view instance,
                           absl::string_view request_id);

struct FeatureCacheOptions {
  // Bytes of cached requests (features + bookkeeping) before eviction.
  // Default: 1 GiB (65,536 requests at d = 4096 fp32).
  int64_t max_bytes = int64_t{1} << 30;
  // Requests older than this expire. Default: 30 minutes.
  int64_t ttl_ns = int64_t{30} * 60 * 1'000'000'000;

  absl::Status Validate() const;
};

// Thread-safe: gRPC handlers and the shm loop insert and take concurrently;
// one mutex, held for each call (never while calling out, except on_evict).
class FeatureCache {
 public:
  // `on_evict(ttl)` runs (under the cache lock; keep it trivial) for every
  // eviction: ttl = true for expiry, false for capacity.
  explicit FeatureCache(FeatureCacheOptions options,
                        std::function<void(bool)> on_evict = nullptr)
      : options_(options), on_evict_(std::move(on_evict)) {}

  // Ids below are LiveRequest keys (LiveRequestKey).
  // Adds `r` (ALREADY_EXISTS when its key is live; RESOURCE_EXHAUSTED when it
  // alone exceeds the capacity). Expires and evicts to make room.
  absl::Status Insert(std::shared_ptr<LiveRequest> r, int64_t now_ns);
  // Insert for each of `rs` in order under one lock; status[i] says how
  // rs[i] fared (as Insert would).
  void InsertBatch(std::vector<std::shared_ptr<LiveRequest>>& rs,
                   int64_t now_ns, std::vector<absl::Status>* status);
  // Removes and returns the request; NOT_FOUND when unknown.
  absl::StatusOr<std::shared_ptr<LiveRequest>> Take(absl::string_view id);
  // Removes the entry of `id` only when it is `expected`; null otherwise.
  std::shared_ptr<LiveRequest> TakeIf(absl::string_view id,
                                      const LiveRequest* expected);
  // Take for each id under one lock: taken[i] (null when unknown) and
  // status[i] (NOT_FOUND as Take's).
  void TakeBatch(absl::Span<const absl::string_view> ids,
                 std::vector<std::shared_ptr<LiveRequest>>* taken,
                 std::vector<absl::Status>* status);
  // The request without removing it; null when unknown.
  std::shared_ptr<LiveRequest> Find(absl::string_view id) const;
  // Drops entries older than the TTL.
  void Expire(int64_t now_ns);

  // Lock-free reads of the latest sizes.
  int64_t bytes() const { return bytes_seen_.load(std::memory_order_relaxed); }
  int64_t size() const { return size_seen_.load(std::memory_order_relaxed); }
  int64_t evicted_capacity() const { return evicted_capacity_.load(); }
  int64_t evicted_ttl() const { return evicted_ttl_.load(); }

 private:
  // Index keyed by a view of the request's own id (stable: a LiveRequest
  // never moves and its id never changes); the value owns the request.
  using Index = absl::flat_hash_map<absl::string_view, std::shared_ptr<LiveRequest>>;
  // Unlinks and unindexes; returns the request (destroy it outside the lock
  // when convenient).
  std::shared_ptr<LiveRequest> EraseLocked(Index::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireLocked(int64_t now_ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status InsertLocked(std::shared_ptr<LiveRequest> r, int64_t now_ns)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishSizesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const FeatureCacheOptions options_;
  const std::function<void(bool)> on_evict_;
  mutable absl::Mutex mu_;
  Index index_ ABSL_GUARDED_BY(mu_);
  // Intrusive age list through LiveRequest::cache_older/newer.
  LiveRequest* oldest_ ABSL_GUARDED_BY(mu_) = nullptr;
  LiveRequest* newest_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> evicted_capacity_{0}, evicted_ttl_{0};
  std::atomic<int64_t> bytes_seen_{0}, size_seen_{0};
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_FEATURE_CACHE_H_
