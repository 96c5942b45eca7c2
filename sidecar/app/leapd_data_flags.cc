#include "sidecar/app/leapd_data_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int64_t, dataset_max_records, 100000,
          "With --data_dir: finished requests kept per readout in the dataset "
          "(features and true output length, for 'leapctl dataset export' and "
          "--bootstrap_readout); the oldest are deleted beyond it or beyond "
          "--dataset_max_bytes. 0 keeps no dataset.");
ABSL_FLAG(int64_t, dataset_max_bytes, int64_t{1} << 30,
          "With --data_dir: bytes of dataset records kept per readout "
          "(features included).");
ABSL_FLAG(int64_t, quality_kept, 100000,
          "(predicted, true) length pairs kept per readout and per route arm, "
          "in memory and with --data_dir on disk: quality windows "
          "('leapctl versions') and the rolling Spearman survive restarts.");
ABSL_FLAG(std::string, bootstrap_readout, "",
          "Bootstrap mode (needs --data_dir): when no readout of this name "
          "exists, serve a placeholder whose predictions are flagged cold "
          "(engines keep first-come order), collect --bootstrap_after "
          "finished requests, then fit the readout (ridge with "
          "cross-validation, as 'leapctl train') and publish it as its next "
          "version (engines rescore). A trained readout of that name is left "
          "alone.");
ABSL_FLAG(int64_t, bootstrap_dim, 0,
          "Bootstrap mode: feature width (the model's hidden size).");
ABSL_FLAG(int64_t, bootstrap_after, 1000,
          "Bootstrap mode: completions (with a known length) to collect "
          "before training.");
ABSL_FLAG(std::string, bootstrap_product_line, "",
          "Bootstrap mode: product line routed to the readout when it has no "
          "route (\"\" = the default route).");
ABSL_FLAG(int32_t, bootstrap_layer, -1,
          "Bootstrap mode: layer the features come from (recorded).");
ABSL_FLAG(std::string, bootstrap_model_id, "",
          "Bootstrap mode: serving model id (recorded).");
ABSL_FLAG(int64_t, bootstrap_max_tokens, 2048,
          "Bootstrap mode: output budget M of the readout.");
ABSL_FLAG(int32_t, bootstrap_folds, 5,
          "Bootstrap mode: cross-validation folds of the ridge fit.");

namespace leap::sidecar {

absl::Status ApplyDataFlags(storage::RocksStoreOptions* store,
                            CoreOptions* core) {
  store->dataset_max_records = absl::GetFlag(FLAGS_dataset_max_records);
  store->dataset_max_bytes = absl::GetFlag(FLAGS_dataset_max_bytes);
  store->quality_kept = absl::GetFlag(FLAGS_quality_kept);
  if (store->dataset_max_records < 0) {
    return absl::InvalidArgumentError("--dataset_max_records must be >= 0");
  }
  if (store->dataset_max_bytes < 1) {
    return absl::InvalidArgumentError("--dataset_max_bytes must be >= 1");
  }
  if (store->quality_kept < 1) {
    return absl::InvalidArgumentError("--quality_kept must be >= 1");
  }
  core->dataset = store->dataset_max_records > 0;
  core->readout.quality_kept = store->quality_kept;
  if (!absl::GetFlag(FLAGS_bootstrap_readout).empty() && !core->dataset) {
    return absl::InvalidArgumentError(
        "--bootstrap_readout needs a dataset (--dataset_max_records > 0)");
  }
  return absl::OkStatus();
}

std::optional<BootstrapOptions> BootstrapOptionsFromFlags() {
  if (absl::GetFlag(FLAGS_bootstrap_readout).empty()) return std::nullopt;
  BootstrapOptions o;
  o.readout = absl::GetFlag(FLAGS_bootstrap_readout);
  o.dim = absl::GetFlag(FLAGS_bootstrap_dim);
  o.after = absl::GetFlag(FLAGS_bootstrap_after);
  o.product_line = absl::GetFlag(FLAGS_bootstrap_product_line);
  o.layer = absl::GetFlag(FLAGS_bootstrap_layer);
  o.model_id = absl::GetFlag(FLAGS_bootstrap_model_id);
  o.max_tokens = absl::GetFlag(FLAGS_bootstrap_max_tokens);
  o.folds = absl::GetFlag(FLAGS_bootstrap_folds);
  return o;
}

}  // namespace leap::sidecar
