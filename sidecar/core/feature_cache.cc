#include "sidecar/core/feature_cache.h"

#include "absl/strings/str_cat.h"

namespace leap::sidecar {

absl::Status FeatureCacheOptions::Validate() const {
  if (max_bytes < (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature cache must hold at least 1 MiB, got ", max_bytes));
  }
  if (ttl_ns <= 0) return absl::InvalidArgumentError("cache TTL must be > 0");
  return absl::OkStatus();
}

std::string LiveRequestKey(absl::string_view instance,
                           absl::string_view request_id) {
  // Neither instance ids nor request ids hold a NUL (checked where they
  // enter): an engine without an instance id keys by its id alone, others
  // by instance NUL id, so keys of different (instance, id) pairs differ.
  if (instance.empty()) return std::string(request_id);
  std::string key;
  key.reserve(instance.size() + 1 + request_id.size());
  key.append(instance.data(), instance.size());
  key.push_back('\0');
  key.append(request_id.data(), request_id.size());
  return key;
}

std::shared_ptr<LiveRequest> FeatureCache::EraseLocked(Index::iterator it) {
  std::shared_ptr<LiveRequest> r = std::move(it->second);
  index_.erase(it);
  r->gone.store(true);
  bytes_ -= r->bytes();
  (r->cache_older != nullptr ? r->cache_older->cache_newer : oldest_) =
      r->cache_newer;
  (r->cache_newer != nullptr ? r->cache_newer->cache_older : newest_) =
      r->cache_older;
  r->cache_older = r->cache_newer = nullptr;
  return r;
}

void FeatureCache::ExpireLocked(int64_t now_ns) {
  while (oldest_ != nullptr && oldest_->inserted_ns < now_ns - options_.ttl_ns) {
    EraseLocked(index_.find(absl::string_view(oldest_->key)));
    evicted_ttl_.fetch_add(1);
    if (on_evict_) on_evict_(true);
  }
}

void FeatureCache::PublishSizesLocked() {
  bytes_seen_.store(bytes_, std::memory_order_relaxed);
  size_seen_.store(static_cast<int64_t>(index_.size()), std::memory_order_relaxed);
}

absl::Status FeatureCache::InsertLocked(std::shared_ptr<LiveRequest> r,
                                        int64_t now_ns) {
  const int64_t need = r->bytes();
  if (need > options_.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request needs ", need, " bytes of feature cache, "
                     "capacity is ", options_.max_bytes));
  }
  if (r->key.empty()) r->key = r->request_id;
  // Expired first: an id whose entry outlived the TTL is no longer live.
  ExpireLocked(now_ns);
  if (index_.count(r->key) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request id '", r->request_id,
                     "' is already live for this engine instance (ids must be "
                     "unique among an engine's live requests)"));
  }
  while (bytes_ + need > options_.max_bytes && oldest_ != nullptr) {
    EraseLocked(index_.find(absl::string_view(oldest_->key)));
    evicted_capacity_.fetch_add(1);
    if (on_evict_) on_evict_(false);
  }
  r->inserted_ns = now_ns;
  LiveRequest* raw = r.get();
  index_.emplace(absl::string_view(raw->key), std::move(r));
  raw->cache_older = newest_;
  raw->cache_newer = nullptr;
  (newest_ != nullptr ? newest_->cache_newer : oldest_) = raw;
  newest_ = raw;
  bytes_ += need;
  return absl::OkStatus();
}

absl::Status FeatureCache::Insert(std::shared_ptr<LiveRequest> r,
                                  int64_t now_ns) {
  absl::MutexLock lock(&mu_);
  absl::Status s = InsertLocked(std::move(r), now_ns);
  PublishSizesLocked();
  return s;
}

void FeatureCache::InsertBatch(std::vector<std::shared_ptr<LiveRequest>>& rs,
                               int64_t now_ns, std::vector<absl::Status>* status) {
  status->resize(rs.size());
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < rs.size(); ++i) {
    if (rs[i] == nullptr) continue;
    (*status)[i] = InsertLocked(rs[i], now_ns);
  }
  PublishSizesLocked();
}

absl::StatusOr<std::shared_ptr<LiveRequest>> FeatureCache::Take(
    absl::string_view id) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown request id '", id,
                     "' (never predicted, already ended, or evicted)"));
  }
  std::shared_ptr<LiveRequest> r = EraseLocked(it);
  PublishSizesLocked();
  return r;
}

std::shared_ptr<LiveRequest> FeatureCache::TakeIf(absl::string_view id,
                                                  const LiveRequest* expected) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  if (it == index_.end() || it->second.get() != expected) return nullptr;
  std::shared_ptr<LiveRequest> r = EraseLocked(it);
  PublishSizesLocked();
  return r;
}

void FeatureCache::TakeBatch(absl::Span<const absl::string_view> ids,
                             std::vector<std::shared_ptr<LiveRequest>>* taken,
                             std::vector<absl::Status>* status) {
  taken->assign(ids.size(), nullptr);
  status->assign(ids.size(), absl::OkStatus());
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = index_.find(ids[i]);
    if (it == index_.end()) {
      (*status)[i] = absl::NotFoundError(
          absl::StrCat("unknown request id '", ids[i],
                       "' (never predicted, already ended, or evicted)"));
      continue;
    }
    (*taken)[i] = EraseLocked(it);
  }
  PublishSizesLocked();
}

std::shared_ptr<LiveRequest> FeatureCache::Find(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : it->second;
}

void FeatureCache::Expire(int64_t now_ns) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(now_ns);
  PublishSizesLocked();
}

}  // namespace leap::sidecar
