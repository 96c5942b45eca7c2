// leapd's flags for the data it keeps for training and quality (the dataset,
// the quality history) and for bootstrap mode (docs/BOOTSTRAP.md).
#ifndef LEAP_SIDECAR_LEAPD_DATA_FLAGS_H_
#define LEAP_SIDECAR_LEAPD_DATA_FLAGS_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "sidecar/core/bootstrap.h"
#include "sidecar/core/core.h"
#include "storage/rocksdb_store.h"

namespace leap::sidecar {

// Copies --dataset_max_records/--dataset_max_bytes/--quality_kept into the
// options; INVALID_ARGUMENT for bad values or a bootstrap flag set wrong.
absl::Status ApplyDataFlags(storage::RocksStoreOptions* store,
                            CoreOptions* core);
// With --bootstrap_readout: starts the bootstrap (after recovery and
// imports); null without it.
absl::StatusOr<std::unique_ptr<Bootstrap>> StartBootstrapFromFlags(Core* core);

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_LEAPD_DATA_FLAGS_H_
