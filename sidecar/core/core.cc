#include "sidecar/core/core.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "common/ids.h"
#include "nlohmann/json.hpp"

namespace leap::sidecar {
namespace {

// FNV-1a, 64 bits: stable across processes (the dedup index outlives them).
uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

// Dedup keys. 0x01: one recorded completion (instance, id, features,
// outcome); 0x02: the (instance, id) pair of a recorded completion.
std::string CompletionKey(absl::string_view instance, absl::string_view id,
                          absl::string_view features, int64_t tokens,
                          readout::FinishReason reason) {
  uint64_t h = Fnv1a(0xcbf29ce484222325ull, features.data(), features.size());
  h = Fnv1a(h, &tokens, sizeof(tokens));
  const uint8_t r = static_cast<uint8_t>(reason);
  h = Fnv1a(h, &r, 1);
  std::string key = absl::StrCat("\x01", LiveRequestKey(instance, id));
  key.push_back('\0');
  for (int i = 7; i >= 0; --i) key.push_back(static_cast<char>(h >> (8 * i)));
  return key;
}

std::string IdKey(absl::string_view instance, absl::string_view id) {
  return absl::StrCat("\x02", LiveRequestKey(instance, id));
}

absl::Status Recovering() {
  return absl::UnavailableError(
      "leapd is recovering (replaying its feedback log); retry shortly");
}

}  // namespace

absl::Status ValidateInstanceId(absl::string_view instance) {
  if (instance.size() > 128 || instance.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        "instance_id must be at most 128 bytes without NUL");
  }
  return absl::OkStatus();
}

absl::Status ValidateReadoutName(absl::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "readout name must be 1-64 characters, got ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "readout name '", name, "' may only use [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status CoreOptions::Validate() const {
  RETURN_IF_ERROR(readout.Validate());
  RETURN_IF_ERROR(cache.Validate());
  if (max_batch_bytes < 1024) {
    return absl::InvalidArgumentError("max_batch_bytes must be >= 1024");
  }
  return absl::OkStatus();
}

Core::Core(CoreOptions options, Metrics* metrics, storage::StateStore* store)
    : options_(options),
      metrics_(metrics),
      store_(store),
      cache_(options.cache, [metrics](bool ttl) {
        (ttl ? metrics->evicted_ttl() : metrics->evicted_capacity())
            .Increment();
      }) {
  readouts_.store(std::make_shared<const ReadoutMap>());
  routes_.store(std::make_shared<const RoutingTable>());
}

Core::~Core() { Shutdown(/*drain=*/false); }

absl::Status Core::CreateReadout(const std::string& name,
                                 readout::ReadoutState state) {
  return CreateReadoutImpl(name, std::move(state), false, "");
}

absl::Status Core::CreateColdReadout(const std::string& name,
                                     readout::ReadoutState state,
                                     const std::string& reason) {
  state.p.reset();
  return CreateReadoutImpl(name, std::move(state), true, reason);
}

absl::Status Core::ReplaceReadout(const std::string& name,
                                  readout::ReadoutState state,
                                  const std::string& cause) {
  RETURN_IF_ERROR(state.Validate());
  std::shared_ptr<LiveReadout> old;
  {
    absl::MutexLock lock(&admin_mu_);
    auto current = readouts_.load();
    auto it = current->find(name);
    if (it == current->end()) {
      return absl::NotFoundError(absl::StrCat("unknown readout '", name, "'"));
    }
    old = it->second;
    if (old->spec().dim != state.spec.dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "readout '", name, "' reads dim ", old->spec().dim,
          "; the replacement has dim ", state.spec.dim));
    }
    state.version = old->current()->version + 1;
    LiveReadoutInit init;
    init.name = name;
    init.store = store_;
    init.meta.name = name;
    init.meta.spec = state.spec;
    init.meta.standardizer = state.standardizer;
    init.meta.has_p = state.p.has_value();
    init.meta.frozen = !state.p.has_value();
    init.meta.created_unix_ms = UnixMs();
    init.cause = cause;
    if (store_ != nullptr) {
      storage::ReadoutCheckpoint initial;
      initial.version = state.version;
      initial.completions_learned = state.completions_learned;
      initial.unix_ms = init.meta.created_unix_ms;
      initial.theta = state.theta;
      initial.p = state.p;
      // Not atomic: a crash in between leaves no readout `name` (a
      // bootstrap then starts again from its dataset, which is kept).
      RETURN_IF_ERROR(store_->DeleteReadout(old->meta()));
      RETURN_IF_ERROR(store_->CreateReadout(&init.meta, initial));
      storage::VersionEntry v{state.version, state.completions_learned,
                              init.meta.created_unix_ms, cause};
      v.has_last_seq = true;
      store_->PutVersion(init.meta, v, state.theta).IgnoreError();
      init.history.push_back(v);
    }
    init.frozen = init.meta.frozen;
    init.state = std::move(state);
    auto next = std::make_shared<ReadoutMap>(*current);
    auto live = std::make_shared<LiveReadout>(std::move(init), options_.readout,
                                              metrics_, &hub_);
    (*next)[name] = live;
    readouts_.store(std::move(next));
    hub_.Notify(name, live->current());
  }
  old->Stop(/*drain=*/false);
  return absl::OkStatus();
}

absl::Status Core::CreateReadoutImpl(const std::string& name,
                                     readout::ReadoutState state, bool cold,
                                     const std::string& reason) {
  RETURN_IF_ERROR(ValidateReadoutName(name));
  RETURN_IF_ERROR(state.Validate());
  // Fleet mode: the trainer learns; members serve without P.
  if (options_.readout.serving_only) state.p.reset();
  absl::MutexLock lock(&admin_mu_);
  auto current = readouts_.load();
  if (current->count(name) != 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("readout '", name, "' already exists"));
  }
  LiveReadoutInit init;
  init.name = name;
  init.store = store_;
  init.meta.name = name;
  init.meta.spec = state.spec;
  init.meta.standardizer = state.standardizer;
  init.meta.has_p = state.p.has_value();
  init.meta.frozen = !state.p.has_value() && !options_.readout.serving_only;
  init.meta.frozen_reason = reason;
  init.meta.created_unix_ms =
      state.created_unix_ms > 0 && options_.readout.serving_only
          ? state.created_unix_ms
          : UnixMs();
  init.cold = cold;
  init.frozen_reason = reason;
  if (state.version < 1) state.version = 1;
  if (store_ != nullptr) {
    storage::ReadoutCheckpoint initial;
    initial.version = state.version;
    initial.completions_learned = state.completions_learned;
    initial.last_seq = 0;
    initial.unix_ms = init.meta.created_unix_ms;
    initial.theta = state.theta;
    initial.p = state.p;
    RETURN_IF_ERROR(store_->CreateReadout(&init.meta, initial));
    // The created version is recorded like every later one: a restart lists
    // it also when the checkpoint it starts from names a newer version.
    storage::VersionEntry v{state.version, state.completions_learned,
                            init.meta.created_unix_ms, init.cause};
    v.has_last_seq = true;
    store_->PutVersion(init.meta, v, state.theta).IgnoreError();
    init.history.push_back(v);
  }
  init.frozen = init.meta.frozen;
  init.state = std::move(state);
  auto next = std::make_shared<ReadoutMap>(*current);
  (*next)[name] = std::make_shared<LiveReadout>(std::move(init), options_.readout,
                                                metrics_, &hub_);
  auto v = (*next)[name]->current();
  readouts_.store(std::move(next));
  hub_.Notify(name, v);
  return absl::OkStatus();
}

absl::Status Core::Recover(storage::RecoveredState state) {
  absl::MutexLock lock(&admin_mu_);
  auto next = std::make_shared<ReadoutMap>(*readouts_.load());
  std::vector<std::string> problems;
  for (storage::RecoveredReadout& r : state.readouts) {
    LiveReadoutInit init;
    init.name = r.meta.name;
    init.store = store_;
    init.meta = r.meta;
    init.frozen = r.meta.frozen;
    init.frozen_reason = r.meta.frozen_reason;
    init.cold = !r.meta.has_p && r.meta.frozen_reason.rfind("bootstrap:", 0) == 0;
    init.cause = "checkpoint";
    for (const storage::VersionEntry& h : r.versions) {
      if (h.version == r.checkpoint.version) init.cause = h.cause;
    }
    init.last_seq = r.checkpoint.last_seq;
    init.history = r.versions;
    init.state.spec = r.meta.spec;
    init.state.standardizer = r.meta.standardizer;
    init.state.theta = std::move(r.checkpoint.theta);
    init.state.p = std::move(r.checkpoint.p);
    init.state.completions_learned = r.checkpoint.completions_learned;
    // The checkpoint's own number: it names this state.
    init.state.version = r.checkpoint.version;
    auto live = std::make_shared<LiveReadout>(std::move(init), options_.readout,
                                              metrics_, &hub_);
    live->RecoverLog(std::move(r.log), r.versions,
                     std::max(r.max_version, r.checkpoint.version),
                     &problems);
    (*next)[r.meta.name] = std::move(live);
  }
  // The completions acknowledged but never applied before the crash are
  // applied (and published) before leapd serves.
  for (const auto& [name, live] : *next) live->WaitIdle();
  for (const std::string& p : problems) {
    std::printf("recovery: %s\n", p.c_str());
  }
  readouts_.store(std::move(next));
  for (const auto& [pl, text] : state.routes) {
    absl::StatusOr<Route> route = RouteFromJson(text);
    if (!route.ok()) {
      std::fprintf(stderr, "leapd: route '%s' not restored: %s\n", pl.c_str(),
                   std::string(route.status().message()).c_str());
      continue;
    }
    absl::Status s = InstallRouteLocked(std::move(*route), /*persist=*/false);
    if (!s.ok()) {
      std::fprintf(stderr, "leapd: route '%s' not restored: %s\n", pl.c_str(),
                   std::string(s.message()).c_str());
    }
  }
  return absl::OkStatus();
}

std::string RouteToJson(const Route& r) {
  nlohmann::json arms = nlohmann::json::array();
  for (const Arm& a : r.arms) {
    arms.push_back({{"name", a.name},
                    {"readout", a.readout},
                    {"percent", a.percent},
                    {"shadow", a.shadow}});
  }
  return nlohmann::json{{"product_line", r.product_line}, {"arms", arms}}.dump();
}

absl::StatusOr<Route> RouteFromJson(absl::string_view text) {
  nlohmann::json j = nlohmann::json::parse(std::string(text), nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError("route is not JSON");
  Route r;
  try {
    r.product_line = j.at("product_line").get<std::string>();
    for (const auto& a : j.at("arms")) {
      r.arms.push_back({a.at("name").get<std::string>(),
                        a.at("readout").get<std::string>(),
                        a.at("percent").get<double>(), a.at("shadow").get<bool>()});
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("route JSON: ", e.what()));
  }
  return r;
}

absl::StatusOr<storage::SnapshotInfo> Core::Snapshot(const std::string& readout,
                                                     const std::string& label) {
  ASSIGN_OR_RETURN(auto r, GetReadout(readout));
  return r->Snapshot(label);
}

absl::StatusOr<int64_t> Core::Rollback(const std::string& readout,
                                       const std::string& label) {
  ASSIGN_OR_RETURN(auto r, GetReadout(readout));
  return r->Rollback(label);
}

absl::Status Core::DeleteReadout(const std::string& name) {
  std::shared_ptr<LiveReadout> victim;
  {
    absl::MutexLock lock(&admin_mu_);
    auto current = readouts_.load();
    auto it = current->find(name);
    if (it == current->end()) {
      return absl::NotFoundError(absl::StrCat("unknown readout '", name, "'"));
    }
    const std::shared_ptr<const RoutingTable> table = routes_.load();
    for (const auto& [pl, route] : table->routes()) {
      for (const auto& arm : route.arms) {
        if (arm.readout == name) {
          return absl::FailedPreconditionError(absl::StrCat(
              "readout '", name, "' is used by the route of product line '",
              pl, "' (arm '", arm.name, "'); change the route first"));
        }
      }
    }
    victim = it->second;
    if (store_ != nullptr) RETURN_IF_ERROR(store_->DeleteReadout(victim->meta()));
    auto next = std::make_shared<ReadoutMap>(*current);
    next->erase(name);
    readouts_.store(std::move(next));
  }
  victim->Stop(/*drain=*/false);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<LiveReadout>> Core::GetReadout(
    absl::string_view name) const {
  auto map = readouts_.load();
  auto it = map->find(name);
  if (it == map->end()) {
    return absl::NotFoundError(absl::StrCat("unknown readout '", name, "'"));
  }
  return it->second;
}

std::vector<std::shared_ptr<LiveReadout>> Core::ListReadouts() const {
  std::vector<std::shared_ptr<LiveReadout>> out;
  for (const auto& [name, r] : *readouts_.load()) out.push_back(r);
  return out;
}

absl::Status Core::SetRoute(Route route) {
  if (static_cast<int64_t>(route.product_line.size()) > options_.max_id_bytes) {
    return absl::InvalidArgumentError("product line name too long");
  }
  if (route.arms.size() == 1 && route.arms[0].name.empty()) {
    route.arms[0].name = route.arms[0].readout;
  }
  RETURN_IF_ERROR(route.Validate());
  absl::MutexLock lock(&admin_mu_);
  return InstallRouteLocked(std::move(route), /*persist=*/true);
}

absl::Status Core::InstallRouteLocked(Route route, bool persist) {
  RETURN_IF_ERROR(route.Validate());
  auto map = readouts_.load();
  int64_t dim = -1;
  for (const auto& arm : route.arms) {
    auto it = map->find(arm.readout);
    if (it == map->end()) {
      return absl::NotFoundError(absl::StrCat(
          "arm '", arm.name, "' names unknown readout '", arm.readout, "'"));
    }
    if (dim >= 0 && it->second->spec().dim != dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "arms of one route must read the same feature width: arm '",
          arm.name, "' (readout '", arm.readout, "') has dim ",
          it->second->spec().dim, ", an earlier arm has ", dim));
    }
    dim = it->second->spec().dim;
  }
  if (persist && store_ != nullptr) {
    RETURN_IF_ERROR(store_->PutRoute(route.product_line, RouteToJson(route)));
  }
  routes_.store(routes_.load()->With(std::move(route)));
  return absl::OkStatus();
}

absl::Status Core::DeleteRoute(const std::string& product_line) {
  absl::MutexLock lock(&admin_mu_);
  auto table = routes_.load();
  if (table->routes().count(product_line) == 0) {
    return absl::NotFoundError(
        absl::StrCat("no route for product line '", product_line, "'"));
  }
  if (store_ != nullptr) RETURN_IF_ERROR(store_->DeleteRoute(product_line));
  routes_.store(table->Without(product_line));
  return absl::OkStatus();
}

std::vector<Route> Core::ListRoutes() const {
  std::vector<Route> out;
  // Held for the loop: the range-for would destroy a temporary load() at
  // once, and a route change on another thread could then free the table.
  const std::shared_ptr<const RoutingTable> table = routes_.load();
  for (const auto& [pl, r] : table->routes()) out.push_back(r);
  return out;
}

Core::ArmState* Core::Arm(const std::string& product_line,
                          const sidecar::Arm& arm) {
  const auto key = std::make_pair(product_line, arm.name);
  {
    absl::ReaderMutexLock lock(&arms_mu_);
    auto it = arms_.find(key);
    if (it != arms_.end() && it->second->readout == arm.readout) {
      return it->second.get();
    }
  }
  absl::MutexLock lock(&arms_mu_);
  auto& slot = arms_[key];
  if (slot != nullptr && slot->readout == arm.readout) {
    slot->shadow = arm.shadow;  // switched between serving and shadow
    return slot.get();
  }
  {
    // New arm, or the arm now points at another readout: fresh window.
    slot = std::make_unique<ArmState>(options_.readout.quality_window);
    slot->readout = arm.readout;
    slot->shadow = arm.shadow;
    slot->gauge = &metrics_->ArmSpearman(arm.readout, product_line, arm.name);
    slot->samples =
        &metrics_->ArmSpearmanSamples(arm.readout, product_line, arm.name);
    if (store_ != nullptr) {
      // The arm's quality as it was before a restart.
      int64_t total = 0;
      absl::StatusOr<std::vector<storage::QualityPair>> pairs =
          store_->LoadQuality(
              storage::ArmQualitySeries(product_line, arm.name, arm.readout),
              options_.readout.quality_window, &total);
      if (pairs.ok()) {
        for (const storage::QualityPair& p : *pairs) {
          slot->window.Add(p.predicted, p.truth);
        }
        slot->completions = total;
        if (!pairs->empty()) slot->gauge->Set(slot->window.Value());
        slot->samples->Set(static_cast<double>(slot->window.size()));
      }
    }
  }
  return slot.get();
}

absl::Status Core::CheckRequest(const ScoreRequest& r) const {
  if (r.request_id.empty()) {
    return absl::InvalidArgumentError("request_id is empty");
  }
  if (r.request_id.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError("request_id must not contain NUL");
  }
  RETURN_IF_ERROR(ValidateInstanceId(r.instance));
  const size_t max_id = static_cast<size_t>(options_.max_id_bytes);
  RETURN_IF_ERROR(CheckIdBytes("request_id", r.request_id, max_id));
  RETURN_IF_ERROR(CheckIdBytes("product_line", r.product_line, max_id));
  if (r.request_max_tokens < 0 ||
      r.request_max_tokens > readout::kMaxReportedTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decoding max_tokens must be in [0, ", readout::kMaxReportedTokens,
        "], got ", r.request_max_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<ScoreResult> Core::Predict(const ScoreRequest& req,
                                          uint64_t session,
                                          std::shared_ptr<LiveRequest>* live) {
  std::vector<absl::StatusOr<ScoreResult>> results;
  std::vector<std::shared_ptr<LiveRequest>> lives;
  PredictBatch({&req, 1}, session, &results, &lives);
  if (live != nullptr) *live = std::move(lives[0]);
  return std::move(results[0]);
}

void Core::PredictBatch(absl::Span<const ScoreRequest> reqs, uint64_t session,
                        std::vector<absl::StatusOr<ScoreResult>>* results,
                        std::vector<std::shared_ptr<LiveRequest>>* lives) {
  const int64_t t0 = NowNs();
  const size_t n = reqs.size();
  results->assign(n, absl::StatusOr<ScoreResult>());
  lives->assign(n, nullptr);
  if (!serving()) {
    results->assign(n, Recovering());
    return;
  }
  auto table = routes_.load();
  auto map = readouts_.load();
  struct Item {
    size_t i;
    const Route* route;
    ArmChoice choice;
    LiveReadout* serving;
    const PublishedVersion* version;
    std::vector<const sidecar::Arm*> scored_shadows;
  };
  absl::InlinedVector<Item, 64> items;
  // One version per serving readout for the whole batch, so its rows are
  // scored together.
  struct Serving {
    std::shared_ptr<LiveReadout> readout;
    std::shared_ptr<const PublishedVersion> version;
  };
  absl::InlinedVector<Serving, 2> versions;
  // A request that fails before it has a LiveRequest gives its slot back
  // here; afterwards the LiveRequest's destructor does.
  const sidecar::Arm* last_arm = nullptr;
  ReadoutMap::const_iterator last_it = map->end();
  absl::string_view last_line;
  absl::StatusOr<const Route*> last_route;
  auto fail = [&](size_t i, absl::Status s) {
    (*results)[i] = std::move(s);
    if (reqs[i].external_owner != nullptr) {
      reqs[i].external_owner->Release(reqs[i].external_slot);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const ScoreRequest& req = reqs[i];
    if (absl::Status s = CheckRequest(req); !s.ok()) {
      fail(i, s);
      continue;
    }
    // Consecutive requests mostly share their product line: one lookup.
    if (i == 0 || req.product_line != last_line) {
      last_line = req.product_line;
      last_route = table->Find(req.product_line);
    }
    const absl::StatusOr<const Route*>& route = last_route;
    if (!route.ok()) {
      fail(i, route.status());
      continue;
    }
    ArmChoice choice = RoutingTable::Choose(**route, req.request_id);
    // Consecutive requests mostly share their serving arm: one lookup.
    if (choice.serving != last_arm) {
      last_arm = choice.serving;
      last_it = map->find(choice.serving->readout);
    }
    auto it = last_it;
    if (it == map->end()) {
      fail(i, absl::NotFoundError(absl::StrCat(
          "route of '", (*route)->product_line, "' names unknown readout '",
          choice.serving->readout, "'")));
      continue;
    }
    LiveReadout& serving = *it->second;
    const int64_t dim = serving.spec().dim;
    const size_t want = static_cast<size_t>(dim) * readout::DTypeSize(req.dtype);
    if (req.features.size() != want) {
      fail(i, absl::InvalidArgumentError(absl::StrCat(
          "feature size mismatch for readout '", serving.name(), "': expected ",
          dim, " ", readout::DTypeName(req.dtype), " values (", want,
          " bytes), got ", req.features.size(), " bytes")));
      continue;
    }
    auto r = std::make_shared<LiveRequest>();
    r->request_id = std::string(req.request_id);
    r->key = LiveRequestKey(req.instance, req.request_id);
    r->product_line = std::string(req.product_line);
    r->route_key = (*route)->product_line;
    r->dtype = req.dtype;
    r->dim = dim;
    if (req.external_owner != nullptr) {
      r->external = req.features.data();
      r->owner = req.external_owner;
      r->slot = req.external_slot;
    } else if (req.owned_features != nullptr) {
      r->features.swap(*req.owned_features);
    } else {
      r->features = std::string(req.features);
    }
    r->request_max_tokens = req.request_max_tokens;
    r->session = session;
    const PublishedVersion* version = nullptr;
    for (const Serving& sv : versions) {
      if (sv.readout.get() == &serving) version = sv.version.get();
    }
    if (version == nullptr) {
      versions.push_back({it->second, serving.current()});
      version = versions.back().version.get();
    }
    (*lives)[i] = std::move(r);
    items.push_back({i, *route, std::move(choice), &serving, version, {}});
  }

  // Score the rows of each version together.
  std::vector<readout::FeatureView> views;
  std::vector<double> scores;
  std::vector<absl::Status> status;
  std::vector<Item*> group;
  for (const Serving& sv : versions) {
    const std::shared_ptr<const PublishedVersion>& v = sv.version;
    group.clear();
    views.clear();
    for (Item& item : items) {
      if (item.version != v.get()) continue;
      group.push_back(&item);
      views.push_back((*lives)[item.i]->view());
    }
    scores.assign(group.size(), 0.0);
    status.assign(group.size(), absl::OkStatus());
    v->folded.ScoreRows(views.data(), static_cast<int64_t>(views.size()),
                        scores.data(), status.data());
    for (size_t g = 0; g < group.size(); ++g) {
      Item& item = *group[g];
      if (!status[g].ok()) {
        (*results)[item.i] = status[g];
        (*lives)[item.i] = nullptr;
        continue;
      }
      LiveRequest& r = *(*lives)[item.i];
      ScoreResult result{item.choice.serving->name, item.serving->name(),
                         v->version,
                         readout::RequestTokensFromScore(
                             scores[g], item.serving->spec().max_tokens,
                             r.request_max_tokens),
                         scores[g], item.serving->cold()};
      r.scores.push_back({result.arm, result.readout, result.version,
                          result.predicted_tokens, false, sv.readout});
      (*results)[item.i] = std::move(result);
    }
  }
  // Shadow arms (rare): one row at a time.
  for (Item& item : items) {
    LiveRequest* r = (*lives)[item.i].get();
    if (r == nullptr) continue;
    for (const sidecar::Arm* shadow : item.choice.shadows) {
      auto sit = map->find(shadow->readout);
      if (sit == map->end() || sit->second->spec().dim != r->dim) continue;
      auto sv = sit->second->current();
      auto s = sv->folded.PredictTokens(r->view());
      if (!s.ok()) continue;
      r->scores.push_back(
          {shadow->name, shadow->readout, sv->version, *s, true, sit->second});
      item.scored_shadows.push_back(shadow);
    }
  }

  std::vector<absl::Status> inserted;
  cache_.InsertBatch(*lives, t0, &inserted);
  // Counted only once the request is live (duplicates are errors).
  const sidecar::Arm* counted_arm = nullptr;
  const Route* counted_route = nullptr;
  ArmState* counted_state = nullptr;
  const double seconds = (NowNs() - t0) * 1e-9;
  // Counter increments per readout, once per batch.
  absl::InlinedVector<std::pair<LiveReadout*, double>, 2> served;
  int64_t observed = 0;
  for (Item& item : items) {
    if ((*lives)[item.i] == nullptr) continue;
    if (!inserted[item.i].ok()) {
      (*results)[item.i] = inserted[item.i];
      (*lives)[item.i] = nullptr;
      continue;
    }
    if (served.empty() || served.back().first != item.serving) {
      served.emplace_back(item.serving, 0.0);
    }
    served.back().second += 1;
    if (item.choice.serving != counted_arm || item.route != counted_route) {
      counted_arm = item.choice.serving;
      counted_route = item.route;
      counted_state = Arm(item.route->product_line, *item.choice.serving);
    }
    counted_state->predictions.fetch_add(1, std::memory_order_relaxed);
    for (const sidecar::Arm* shadow : item.scored_shadows) {
      map->find(shadow->readout)->second->metrics().predictions_shadow->Increment();
      Arm(item.route->product_line, *shadow)->predictions.fetch_add(1);
    }
    ++observed;
  }
  metrics_->ObservePredictions(observed, seconds);
  for (const auto& [ro, count] : served) {
    ro->metrics().predictions_serving->Increment(count);
  }
  metrics_->cache_bytes().Set(static_cast<double>(cache_.bytes()));
  metrics_->cache_entries().Set(static_cast<double>(cache_.size()));
}

absl::StatusOr<CompletionOutcome> Core::Complete(absl::string_view request_id,
                                                 int64_t output_tokens,
                                                 readout::FinishReason reason,
                                                 absl::string_view instance,
                                                 bool defer_fleet_ack,
                                                 bool defer_log_sync) {
  // A duplicate is announced (counted, logged) only once acknowledged:
  // after the sync, here, or by the caller who syncs.
  const bool hold = options_.sync_feedback_log && store_ != nullptr;
  absl::StatusOr<CompletionOutcome> outcome = CompleteUnsynced(
      request_id, output_tokens, reason, instance, defer_fleet_ack, hold);
  if (outcome.ok() && !defer_log_sync) {
    if (absl::Status synced = SyncFeedbackLog(); !synced.ok()) return synced;
    if (outcome->announce_duplicate) {
      outcome->announce_duplicate();
      outcome->announce_duplicate = nullptr;
    }
  }
  return outcome;
}

absl::Status Core::SyncFeedbackLog() {
  if (!options_.sync_feedback_log || store_ == nullptr) return absl::OkStatus();
  metrics_->feedback_log_syncs().Increment();
  if (absl::Status s = store_->SyncLog(); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "feedback not synced to disk (not acknowledged; resend it, after a "
        "restart of leapd if the sync keeps failing): ",
        s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<CompletionOutcome> Core::CompleteUnsynced(
    absl::string_view request_id, int64_t output_tokens,
    readout::FinishReason reason, absl::string_view instance,
    bool defer_fleet_ack, bool hold_announcement) {
  if (!serving()) return Recovering();
  RETURN_IF_ERROR(ValidateInstanceId(instance));
  if (request_id.find('\0') != absl::string_view::npos) {
    // It could name another instance's request (keys are instance NUL id).
    return absl::InvalidArgumentError(
        "request_id must not contain NUL characters");
  }
  // Validate the counts before touching the live entry: a bad completion
  // must not lose the request.
  RETURN_IF_ERROR(
      readout::ClassifyFeedback(output_tokens, reason, 0,
                                readout::kDefaultMaxTokens)
          .status());
  const std::string key = LiveRequestKey(instance, request_id);
  std::shared_ptr<LiveRequest> peek = cache_.Find(key);
  std::vector<std::string> dedup_keys;
  if (store_ != nullptr) {
    // A completion resent after a reconnect was recorded before: it is
    // acknowledged again and not learned twice. Checked even when the
    // request is live (an engine resubmits the features of requests whose
    // completion it has not seen acknowledged), then by the exact features
    // and outcome, so an id reused for a new request is learned.
    std::string dup_reason;
    if (peek != nullptr) {
      const readout::FeatureView v = peek->view();
      dedup_keys.push_back(CompletionKey(
          instance, request_id,
          absl::string_view(static_cast<const char*>(v.data),
                            static_cast<size_t>(v.dim) *
                                readout::DTypeSize(v.dtype)),
          output_tokens, reason));
      absl::StatusOr<bool> seen = store_->WasRecorded(dedup_keys.back());
      if (seen.ok() && *seen) dup_reason = "resent";
    } else {
      absl::StatusOr<bool> seen = store_->WasRecorded(IdKey(instance, request_id));
      if (seen.ok() && *seen) dup_reason = "resent_not_live";
    }
    uint64_t dup_fleet_seq = 0;
    std::shared_ptr<PendingFleetAck> dup_ack;
    if (FleetLink* fleet = fleet_.load(); fleet != nullptr && !dup_reason.empty()) {
      // Fleet mode: acknowledged once its outbox record is in the fleet's
      // stream (else UNAVAILABLE). ResolveDuplicate never waits for NATS;
      // with defer_fleet_ack an answer not known yet is the caller's to
      // wait for, as a first publish is.
      std::vector<std::string> keys = dedup_keys;
      keys.push_back(IdKey(instance, request_id));
      dup_ack = fleet->ResolveDuplicate(keys);
      if (!defer_fleet_ack || dup_ack->done()) {
        absl::StatusOr<uint64_t> seq = dup_ack->Wait();
        if (!seq.ok()) return seq.status();  // the request left as it is
        // (A deferred ack that fails later finds the request taken below:
        // the engine's next resend is then classed resent_not_live, still
        // deduplicated; only the label differs.)
        dup_fleet_seq = *seq;
        dup_ack = nullptr;
      }
    }
    if (!dup_reason.empty()) {
      if (peek != nullptr) cache_.TakeIf(key, peek.get());
      // Counted and logged once it is acknowledged (a deferred one: from the
      // thread that sets its ack; not when that is UNAVAILABLE).
      auto announce = [counter = &metrics_->DuplicateCompletions(dup_reason),
                       id = std::string(request_id),
                       inst = std::string(instance), dup_reason] {
        counter->Increment();
        std::fprintf(stderr,
                     "leapd: completion of request '%s' (engine instance '%s') "
                     "acknowledged as a duplicate, not learned again: %s\n",
                     id.c_str(), inst.c_str(),
                     dup_reason == "resent"
                         ? "resent (same features and outcome as one recorded "
                           "within the dedup window)"
                         : "resent_not_live (not live; a completion with this "
                           "id was recorded within the dedup window)");
      };
      CompletionOutcome dup;
      std::function<void()> announce_once_acknowledged =
          dup_ack == nullptr
              ? std::function<void()>(std::move(announce))
              : [dup_ack, announce] {
                  dup_ack->OnDone([ack = dup_ack.get(), announce] {
                    if (ack->Wait().ok()) announce();  // set: no wait
                  });
                };
      if (hold_announcement) {
        // Not before the log sync (the caller's): a duplicate whose sync
        // fails is not acknowledged.
        dup.announce_duplicate = std::move(announce_once_acknowledged);
      } else {
        announce_once_acknowledged();
      }
      dup.learned = true;
      dup.duplicate = true;
      dup.duplicate_reason = dup_reason;
      dup.fleet_seq = dup_fleet_seq;
      dup.fleet_ack = std::move(dup_ack);
      return dup;
    }
    dedup_keys.push_back(IdKey(instance, request_id));
  }
  if (peek == nullptr) {
    unknown_.fetch_add(1);
    metrics_->unknown_completions().Increment();
    return absl::NotFoundError(absl::StrCat(
        "completion for unknown request id '", request_id,
        "' (never predicted, already ended, or evicted)"));
  }
  RETURN_IF_ERROR(readout::ClassifyFeedback(output_tokens, reason,
                                            peek->request_max_tokens,
                                            readout::kDefaultMaxTokens)
                      .status());
  std::shared_ptr<LiveRequest> taken_req = cache_.TakeIf(key, peek.get());
  absl::StatusOr<std::shared_ptr<LiveRequest>> taken =
      taken_req != nullptr
          ? absl::StatusOr<std::shared_ptr<LiveRequest>>(std::move(taken_req))
          : absl::NotFoundError(absl::StrCat(
                "completion for unknown request id '", request_id,
                "' (ended concurrently)"));
  if (!taken.ok()) {  // completed concurrently
    unknown_.fetch_add(1);
    metrics_->unknown_completions().Increment();
    return taken.status();
  }
  const LiveRequest& r = **taken;
  // Features in engine-writable shared memory may have changed since the
  // prediction: learn from a checked private copy.
  std::string copied;
  readout::FeatureView x = r.view();
  if (r.external != nullptr) {
    copied.assign(static_cast<const char*>(x.data),
                  static_cast<size_t>(r.dim) * readout::DTypeSize(r.dtype));
    x.data = copied.data();
    absl::Status valid = readout::ValidateFeatures(x, r.dim);
    if (!valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "features of request '", r.request_id,
          "' changed in their shared-memory slot after the prediction: ",
          valid.message()));
    }
  }
  metrics_->cache_bytes().Set(static_cast<double>(cache_.bytes()));
  metrics_->cache_entries().Set(static_cast<double>(cache_.size()));

  CompletionOutcome outcome;
  // The dataset record goes into the serving readout's feedback-log write
  // when that readout learns the completion (one durable write for both);
  // otherwise it is appended on its own below.
  std::optional<storage::DatasetRecord> dataset =
      DatasetRecordFor(r, x, output_tokens, reason);
  // Set once the dataset record is written: the append's result.
  std::optional<absl::StatusOr<storage::DatasetStats>> dataset_result;
  auto map = readouts_.load();
  std::vector<std::string> learners;  // a readout learns a completion once
  for (size_t i = 0; i < r.scores.size(); ++i) {
    const ArmScore& s = r.scores[i];
    std::shared_ptr<LiveReadout> scorer = s.scorer.lock();
    auto it = map->find(s.readout);
    if (scorer == nullptr || it == map->end() || it->second != scorer) {
      if (i == 0) outcome.skip_reason = "readout_deleted";
      continue;
    }
    LiveReadout& ro = *scorer;
    // Never fails: counts were validated above.
    const readout::FeedbackAction action =
        *readout::ClassifyFeedback(output_tokens, reason, r.request_max_tokens,
                                   ro.spec().max_tokens);
    std::string skip;
    if (action == readout::FeedbackAction::kSkipCancelled) {
      skip = "cancelled";
      ro.metrics().skipped_cancelled->Increment();
    } else if (action == readout::FeedbackAction::kSkipCensored) {
      skip = "censored";
      ro.metrics().skipped_censored->Increment();
    } else {
      const double truth = static_cast<double>(
          std::min(output_tokens, ro.spec().max_tokens));
      ro.RecordQuality(s.version, s.predicted_tokens, truth);
      bool arm_found = false;
      {
        absl::MutexLock lock(&arms_mu_);
        auto ait = arms_.find({r.route_key, s.arm});
        if (ait != arms_.end() && ait->second->readout == s.readout) {
          ait->second->completions++;
          ait->second->window.Add(s.predicted_tokens, truth);
          ait->second->gauge->Set(ait->second->window.Value());
          ait->second->samples->Set(
              static_cast<double>(ait->second->window.size()));
          arm_found = true;
        }
      }
      if (arm_found && store_ != nullptr) {
        store_->AppendQuality(
                  storage::ArmQualitySeries(r.route_key, s.arm, s.readout),
                  {s.version, s.predicted_tokens, truth, UnixMs()})
            .IgnoreError();  // quality only; the completion is not at stake
      }
      if (std::find(learners.begin(), learners.end(), s.readout) !=
          learners.end()) {
        // Same readout on two arms (serving and shadow): learned once.
      } else if (ro.frozen() && fleet_.load() == nullptr) {
        // (In fleet mode every learnable completion goes to the stream; a
        // frozen readout's trainer keeps it there without learning it.)
        skip = "frozen";
        ro.metrics().skipped_frozen->Increment();
      } else {
        learners.push_back(s.readout);
        const double target =
            readout::TargetFromTokens(output_tokens, ro.spec().max_tokens);
        Learnable item;
        item.request_id = r.request_id;
        item.x = x;
        item.target = target;
        item.dedup_keys = dedup_keys;
        if (i == 0 && dataset.has_value()) item.dataset = &*dataset;
        absl::StatusOr<Learned> learned = ro.Learn(item);
        if (learned.ok() && learned->dataset.has_value()) {
          dataset_result = *std::move(learned->dataset);
        }
        if (FleetLink* fleet = fleet_.load(); fleet != nullptr && learned.ok()) {
          FleetCompletionRecord c;
          c.readout = s.readout;
          c.request_id = r.request_id;
          c.instance = std::string(instance);
          c.product_line = r.route_key;
          c.arm = s.arm;
          c.dtype = x.dtype;
          c.features = absl::string_view(
              static_cast<const char*>(x.data),
              static_cast<size_t>(x.dim) * readout::DTypeSize(x.dtype));
          c.target = target;
          c.predicted_tokens = s.predicted_tokens;
          c.served_version = s.version;
          c.true_tokens = truth;
          c.local_seq = learned->seq;
          c.dedup_keys = dedup_keys;
          if (defer_fleet_ack) {
            // Pipelined: the caller acknowledges the engine once set.
            auto ack = std::make_shared<PendingFleetAck>();
            if (i != 0) {
              const std::string name = ro.name();
              ack->OnDone([ack_raw = ack.get(), name] {
                absl::StatusOr<uint64_t> r = ack_raw->Wait();
                if (!r.ok()) {
                  std::fprintf(stderr, "leapd: shadow readout '%s': %s\n",
                               name.c_str(),
                               std::string(r.status().message()).c_str());
                }
              });
            } else {
              outcome.fleet_ack = ack;
            }
            fleet->PublishCompletionAsync(c, std::move(ack));
          }
          absl::StatusOr<uint64_t> seq =
              defer_fleet_ack ? absl::StatusOr<uint64_t>(uint64_t{0})
                              : fleet->PublishCompletion(c);
          if (!seq.ok()) {
            // Recorded in the outbox, not acknowledged: the engine resends,
            // and the resend is acknowledged once the record is published.
            if (i == 0) {
              if (dataset_result.has_value()) {
                DatasetAppended(r.scores[0].readout, *dataset_result);
              }
              return seq.status();
            }
            std::fprintf(stderr, "leapd: shadow readout '%s': %s\n",
                         ro.name().c_str(), std::string(seq.status().message()).c_str());
          } else if (i == 0) {
            outcome.fleet_seq = *seq;
          }
        }
        if (!learned.ok()) {
          if (i == 0) {
            // Not acknowledged: keep the request live so a retry can learn it.
            (*taken)->gone.store(false);
            cache_.Insert(*taken, NowNs()).IgnoreError();
            return learned.status();
          }
          std::fprintf(stderr, "leapd: shadow readout '%s': %s\n",
                       ro.name().c_str(),
                       std::string(learned.status().message()).c_str());
        }
      }
    }
    if (i == 0) {
      outcome.learned = skip.empty();
      outcome.skip_reason = skip;
    }
  }
  if (dataset.has_value()) {
    const std::string& name = r.scores[0].readout;
    if (!dataset_result.has_value()) {
      // Not learned by the serving readout (or not written with its log
      // record): on its own.
      dataset_result = store_->AppendDataset(name, std::move(*dataset));
    }
    DatasetAppended(name, *dataset_result);
  }
  return outcome;
}

std::optional<storage::DatasetRecord> Core::DatasetRecordFor(
    const LiveRequest& r, readout::FeatureView x, int64_t output_tokens,
    readout::FinishReason reason) {
  if (store_ == nullptr || !options_.dataset || r.scores.empty()) {
    return std::nullopt;
  }
  // Kept under the serving readout's name, when its true length is known
  // (not cancelled, not cut at the request's own max_tokens).
  const std::string& name = r.scores[0].readout;
  int64_t budget = readout::kDefaultMaxTokens;
  if (auto ro = GetReadout(name); ro.ok()) budget = (*ro)->spec().max_tokens;
  absl::StatusOr<readout::FeedbackAction> action = readout::ClassifyFeedback(
      output_tokens, reason, r.request_max_tokens, budget);
  if (!action.ok() || *action == readout::FeedbackAction::kSkipCancelled ||
      *action == readout::FeedbackAction::kSkipCensored) {
    return std::nullopt;
  }
  storage::DatasetRecord rec;
  rec.dtype = x.dtype;
  rec.features.assign(static_cast<const char*>(x.data),
                      static_cast<size_t>(x.dim) * readout::DTypeSize(x.dtype));
  rec.tokens = output_tokens;
  rec.unix_ms = UnixMs();
  return rec;
}

void Core::DatasetAppended(const std::string& name,
                           const absl::StatusOr<storage::DatasetStats>& st) {
  if (!st.ok()) {
    std::fprintf(stderr, "leapd: dataset of '%s': record not kept: %s\n",
                 name.c_str(), std::string(st.status().message()).c_str());
    return;
  }
  if (DatasetObserver* o = dataset_observer_.load(); o != nullptr) {
    o->OnDatasetRecord(name, *st);
  }
}

bool Core::CancelExact(const LiveRequest& r) {
  // The cache key: instance NUL id for engines that say their instance, the
  // id alone otherwise (a request inserted with an empty key).
  std::shared_ptr<LiveRequest> taken =
      cache_.TakeIf(r.key.empty() ? absl::string_view(r.request_id)
                                  : absl::string_view(r.key),
                    &r);
  if (taken == nullptr) return false;
  metrics_->cache_bytes().Set(static_cast<double>(cache_.bytes()));
  metrics_->cache_entries().Set(static_cast<double>(cache_.size()));
  return true;
}

void Core::CancelBatch(absl::Span<const absl::string_view> ids,
                       std::vector<absl::Status>* status,
                       absl::string_view instance) {
  if (!serving() || !ValidateInstanceId(instance).ok()) {
    status->assign(ids.size(), serving() ? ValidateInstanceId(instance)
                                         : Recovering());
    return;
  }
  std::vector<std::shared_ptr<LiveRequest>> taken;
  // An id holding a NUL could name another instance's key (instance NUL id):
  // it is looked up as "" (no live request has an empty key) and refused.
  bool has_nul = false;
  for (absl::string_view id : ids) {
    has_nul |= id.find('\0') != absl::string_view::npos;
  }
  if (instance.empty() && !has_nul) {
    cache_.TakeBatch(ids, &taken, status);
  } else {
    std::vector<std::string> keys;
    keys.reserve(ids.size());
    for (absl::string_view id : ids) {
      keys.push_back(id.find('\0') != absl::string_view::npos
                         ? std::string()
                         : LiveRequestKey(instance, id));
    }
    std::vector<absl::string_view> views(keys.begin(), keys.end());
    cache_.TakeBatch(views, &taken, status);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (keys[i].empty()) {
        (*status)[i] = absl::InvalidArgumentError(
            "request_id must not contain NUL characters");
      } else if (!(*status)[i].ok()) {
        (*status)[i] = absl::NotFoundError(
            absl::StrCat("unknown request id '", ids[i],
                         "' (never predicted, already ended, or evicted)"));
      }
    }
  }
  int64_t unknown = 0;
  for (const absl::Status& s : *status) unknown += s.ok() ? 0 : 1;
  if (unknown > 0) {
    unknown_.fetch_add(unknown);
    metrics_->unknown_completions().Increment(static_cast<double>(unknown));
  }
  metrics_->cache_bytes().Set(static_cast<double>(cache_.bytes()));
  metrics_->cache_entries().Set(static_cast<double>(cache_.size()));
  // The requests (and the slots they hold) go here, outside the cache lock.
}

absl::Status Core::Cancel(absl::string_view request_id,
                          absl::string_view instance) {
  std::vector<absl::Status> status;
  CancelBatch({&request_id, 1}, &status, instance);
  return status[0];
}

std::vector<ArmStat> Core::ArmStats() const {
  std::vector<ArmStat> out;
  absl::MutexLock lock(&arms_mu_);
  for (const auto& [key, a] : arms_) {
    ArmStat s;
    s.product_line = key.first;
    s.arm = key.second;
    s.readout = a->readout;
    s.shadow = a->shadow;
    s.predictions = a->predictions.load();
    s.completions = a->completions;
    s.spearman = a->window.Value();
    s.spearman_n = a->window.size();
    out.push_back(std::move(s));
  }
  return out;
}

void Core::WaitIdle() {
  for (auto& r : ListReadouts()) r->WaitIdle();
}

void Core::Shutdown(bool drain) {
  for (auto& r : ListReadouts()) r->Stop(drain);
}

}  // namespace leap::sidecar
