#include "sidecar/service/feature_cache.h"

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

void FeatureCache::EraseLocked(List::iterator it) {
  (*it)->gone.store(true);
  bytes_ -= (*it)->bytes();
  index_.erase((*it)->request_id);
  order_.erase(it);
}

void FeatureCache::ExpireLocked(int64_t now_ns) {
  while (!order_.empty() &&
         order_.front()->inserted_ns < now_ns - options_.ttl_ns) {
    EraseLocked(order_.begin());
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
  if (index_.count(r->request_id) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request id '", r->request_id, "' is already live"));
  }
  ExpireLocked(now_ns);
  while (bytes_ + need > options_.max_bytes && !order_.empty()) {
    EraseLocked(order_.begin());
    evicted_capacity_.fetch_add(1);
    if (on_evict_) on_evict_(false);
  }
  r->inserted_ns = now_ns;
  order_.push_back(std::move(r));
  index_[order_.back()->request_id] = std::prev(order_.end());
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
  std::shared_ptr<LiveRequest> r = *it->second;
  EraseLocked(it->second);
  PublishSizesLocked();
  return r;
}

std::shared_ptr<LiveRequest> FeatureCache::Find(absl::string_view id) const {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(id);
  return it == index_.end() ? nullptr : *it->second;
}

void FeatureCache::Expire(int64_t now_ns) {
  absl::MutexLock lock(&mu_);
  ExpireLocked(now_ns);
  PublishSizesLocked();
}

}  // namespace leap::sidecar
