// Bootstrap mode (docs/BOOTSTRAP.md): leapd starts with no trained readout,
// serves a placeholder whose predictions are flagged cold (the engine keeps
// first-come order) while the dataset collects the features and true lengths
// of finished requests, then fits the first readout itself (ridge with
// cross-validation: readout::FitRidge with the options `leapctl train` uses)
// and swaps it in as the readout's next version (engines rescore).
#ifndef LEAP_SIDECAR_CORE_BOOTSTRAP_H_
#define LEAP_SIDECAR_CORE_BOOTSTRAP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "sidecar/core/core.h"
#include "storage/state_store.h"

namespace leap::sidecar {

struct BootstrapOptions {
  // Readout to bootstrap ([A-Za-z0-9._-]{1,64}). Empty: no bootstrap.
  std::string readout;
  // Feature width the engine sends. Required.
  int64_t dim = 0;
  // Completions to collect before training. Default: 1000
  int64_t after = 1000;
  // Product line routed to it when that product line has no route (""
  // is the default route). Default: ""
  std::string product_line;
  // Recorded in the readout (the model layer the features come from, the
  // serving model). Default: -1, ""
  int32_t layer = -1;
  std::string model_id;
  // Output budget M. Default: 2048
  int64_t max_tokens = 2048;
  // Cross-validation folds of the ridge fit. Default: 5
  int folds = 5;

  absl::Status Validate() const;
};

// Rows of width `dim` of a readout's dataset, oldest first (the newest
// `limit` when > 0), widened to float32 (exactly); other widths and corrupt
// records are counted in *skipped.
absl::Status LoadDatasetRows(storage::StateStore* store,
                             const std::string& readout, int64_t dim,
                             int64_t limit, std::vector<float>* features,
                             std::vector<int64_t>* tokens, int64_t* skipped);
// Appends `record`'s features as float32 to *out (dim values).
void WidenToFloat32(const storage::DatasetRecord& record,
                    std::vector<float>* out);

// Thread: one trainer thread, started by Start and joined by the destructor.
class Bootstrap final : public DatasetObserver {
 public:
  // Needs a store. Creates the placeholder readout unless a readout of that
  // name exists (a trained one: nothing to do; a placeholder recovered after
  // a restart: collecting goes on), routes `product_line` to it when that
  // has no route, and starts waiting for `after` records.
  static absl::StatusOr<std::unique_ptr<Bootstrap>> Start(Core* core,
                                                          BootstrapOptions o);
  ~Bootstrap() override;
  void OnDatasetRecord(const std::string& readout,
                       const storage::DatasetStats& stats) override;
  // True once the trained readout is published (or was at start).
  bool done() const;

 private:
  Bootstrap(Core* core, BootstrapOptions o) : core_(core), o_(std::move(o)) {}
  void Run();
  // Fits and swaps in the readout; false (printed) when the fit failed.
  bool Train();

  Core* const core_;
  const BootstrapOptions o_;
  mutable absl::Mutex mu_;
  int64_t records_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t need_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_CORE_BOOTSTRAP_H_
