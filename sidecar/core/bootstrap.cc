#include "sidecar/core/bootstrap.h"

#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/half.h"
#include "common/status_macros.h"
#include "common/thread.h"
#include "readout/ridge.h"

namespace leap::sidecar {

absl::Status BootstrapOptions::Validate() const {
  RETURN_IF_ERROR(ValidateReadoutName(readout));
  if (dim < readout::kMinDim || dim > readout::kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bootstrap_dim must be in [", readout::kMinDim, ", ",
        readout::kMaxDim, "], got ", dim));
  }
  if (after < 2 * folds) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bootstrap_after must be >= 2 x --bootstrap_folds (", 2 * folds,
        "), got ", after));
  }
  if (folds < 2 || folds > 100) {
    return absl::InvalidArgumentError(
        absl::StrCat("--bootstrap_folds must be in [2, 100], got ", folds));
  }
  if (max_tokens < 1 || max_tokens > readout::kMaxReportedTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bootstrap_max_tokens must be in [1, ", readout::kMaxReportedTokens,
        "], got ", max_tokens));
  }
  return absl::OkStatus();
}

void WidenToFloat32(const storage::DatasetRecord& r, std::vector<float>* out) {
  const size_t n = r.features.size() / DTypeSize(r.dtype);
  const char* p = r.features.data();
  for (size_t i = 0; i < n; ++i) {
    switch (r.dtype) {
      case DType::kFloat32: {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        out->push_back(f);
        break;
      }
      case DType::kFloat16: {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out->push_back(Fp16ToFloat(h));
        break;
      }
      case DType::kBFloat16: {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out->push_back(Bf16ToFloat(h));
        break;
      }
    }
  }
}

absl::Status LoadDatasetRows(storage::StateStore* store,
                             const std::string& name, int64_t dim,
                             int64_t limit, std::vector<float>* features,
                             std::vector<int64_t>* tokens, int64_t* skipped) {
  int64_t corrupt = 0, other = 0;
  RETURN_IF_ERROR(store->ScanDataset(
      name, limit,
      [&](const storage::DatasetRecord& r) {
        const size_t size = DTypeSize(r.dtype);
        if (size == 0 || r.features.size() != static_cast<size_t>(dim) * size) {
          ++other;
          return true;
        }
        WidenToFloat32(r, features);
        tokens->push_back(r.tokens);
        return true;
      },
      &corrupt));
  if (skipped != nullptr) *skipped = corrupt + other;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Bootstrap>> Bootstrap::Start(Core* core,
                                                            BootstrapOptions o) {
  RETURN_IF_ERROR(o.Validate());
  if (core->store() == nullptr) {
    return absl::FailedPreconditionError(
        "--bootstrap_readout needs --data_dir (the dataset is kept there)");
  }
  std::unique_ptr<Bootstrap> b(new Bootstrap(core, o));
  absl::StatusOr<std::shared_ptr<LiveReadout>> existing = core->GetReadout(o.readout);
  if (existing.ok() && !(*existing)->cold()) {
    if ((*existing)->spec().dim != o.dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--bootstrap_dim=", o.dim, " but readout '", o.readout,
          "' exists with dim ", (*existing)->spec().dim));
    }
    absl::MutexLock lock(&b->mu_);
    b->done_ = true;  // trained already (before a restart, or imported)
    return b;
  }
  if (!existing.ok()) {
    readout::ReadoutState cold;
    cold.spec.dim = o.dim;
    cold.spec.layer = o.layer;
    cold.spec.model_id = o.model_id;
    cold.spec.max_tokens = o.max_tokens;
    cold.spec.lambda = 1.0;
    cold.standardizer = readout::Standardizer::Identity(o.dim);
    cold.theta = Eigen::VectorXd::Zero(o.dim + 1);
    cold.version = 1;
    cold.created_unix_ms = UnixMs();
    cold.note = "bootstrap placeholder";
    RETURN_IF_ERROR(core->CreateColdReadout(
        o.readout, std::move(cold),
        absl::StrCat("bootstrap: collecting ", o.after,
                     " completions before training")));
  } else if ((*existing)->spec().dim != o.dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--bootstrap_dim=", o.dim, " but the bootstrap readout '", o.readout,
        "' has dim ", (*existing)->spec().dim));
  }
  bool routed = false;
  for (const Route& r : core->ListRoutes()) routed |= r.product_line == o.product_line;
  if (!routed) {
    Route r;
    r.product_line = o.product_line;
    r.arms.push_back({o.readout, o.readout, 100.0, false});
    RETURN_IF_ERROR(core->SetRoute(std::move(r)));
  }
  ASSIGN_OR_RETURN(storage::DatasetStats st,
                   core->store()->GetDatasetStats(o.readout));
  {
    absl::MutexLock lock(&b->mu_);
    b->records_ = st.records;
    b->need_ = o.after;
  }
  core->SetDatasetObserver(b.get());
  std::printf("bootstrap: readout %s collecting (%lld of %lld completions)\n",
              o.readout.c_str(), static_cast<long long>(st.records),
              static_cast<long long>(o.after));
  std::fflush(stdout);
  b->thread_ = std::thread([p = b.get()] { p->Run(); });
  NameThread(b->thread_, "leap-bootstrap");
  return b;
}

Bootstrap::~Bootstrap() {
  core_->SetDatasetObserver(nullptr);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool Bootstrap::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

void Bootstrap::OnDatasetRecord(const std::string& readout,
                                const storage::DatasetStats& stats) {
  if (readout != o_.readout) return;
  absl::MutexLock lock(&mu_);
  records_ = std::max(records_, stats.records);
}

void Bootstrap::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || records_ >= need_;
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
    }
    if (Train()) {
      absl::MutexLock lock(&mu_);
      done_ = true;
      core_->SetDatasetObserver(nullptr);
      return;
    }
    absl::MutexLock lock(&mu_);
    need_ = records_ * 2;  // try again with twice the data
  }
}

bool Bootstrap::Train() {
  std::vector<float> x;
  std::vector<int64_t> tokens;
  int64_t skipped = 0;
  absl::Status loaded = LoadDatasetRows(core_->store(), o_.readout, o_.dim, 0,
                                        &x, &tokens, &skipped);
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (!loaded.ok() || n < o_.after) {
    std::printf("bootstrap: readout %s: %s\n", o_.readout.c_str(),
                loaded.ok() ? absl::StrCat("only ", n, " usable records (",
                                           skipped, " skipped); waiting")
                                  .c_str()
                            : std::string(loaded.message()).c_str());
    std::fflush(stdout);
    return false;
  }
  readout::FeatureMatrix m;
  m.data = x.data();
  m.dtype = DType::kFloat32;
  m.rows = n;
  m.cols = o_.dim;
  // The options `leapctl train` uses (tools/leapctl/commands.cc RunTrain).
  readout::RidgeOptions ro;
  ro.folds = o_.folds;
  ro.max_tokens = o_.max_tokens;
  ro.compute_p0 = true;
  absl::StatusOr<readout::RidgeResult> fit = readout::FitRidge(m, tokens, ro);
  if (!fit.ok()) {
    std::printf("bootstrap: readout %s: fit on %lld completions failed: %s; "
                "waiting for twice as many\n",
                o_.readout.c_str(), static_cast<long long>(n),
                std::string(fit.status().message()).c_str());
    std::fflush(stdout);
    return false;
  }
  readout::ReadoutState state;
  state.spec.dim = o_.dim;
  state.spec.layer = o_.layer;
  state.spec.model_id = o_.model_id;
  state.spec.max_tokens = o_.max_tokens;
  state.spec.lambda = fit->lambda;
  state.standardizer = std::move(fit->standardizer);
  state.theta = std::move(fit->theta);
  state.p = std::move(fit->p0);
  state.train_rows = n;
  state.note = absl::StrCat("bootstrap: ridge fit on ", n, " completions");
  state.created_unix_ms = UnixMs();
  absl::Status s = core_->ReplaceReadout(o_.readout, std::move(state), "bootstrap");
  if (!s.ok()) {
    std::printf("bootstrap: readout %s: not published: %s\n", o_.readout.c_str(),
                std::string(s.message()).c_str());
    std::fflush(stdout);
    return false;
  }
  int64_t version = 0;
  if (auto r = core_->GetReadout(o_.readout); r.ok()) version = (*r)->current()->version;
  std::printf("bootstrap: readout %s trained on %lld completions (lambda %.6g, "
              "%lld skipped), published as version %lld\n",
              o_.readout.c_str(), static_cast<long long>(n), fit->lambda,
              static_cast<long long>(skipped), static_cast<long long>(version));
  std::fflush(stdout);
  return true;
}

}  // namespace leap::sidecar
