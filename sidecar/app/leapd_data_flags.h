// leapd's flags for the data it keeps for training and quality (the dataset,
// the quality history) and for bootstrap mode (docs/BOOTSTRAP.md), read by
// LeapdOptionsFromFlags (leapd_options.h). Called from main's thread only.
#ifndef LEAP_SIDECAR_APP_LEAPD_DATA_FLAGS_H_
#define LEAP_SIDECAR_APP_LEAPD_DATA_FLAGS_H_

#include <optional>

#include "absl/status/status.h"
#include "sidecar/core/bootstrap.h"
#include "sidecar/core/core.h"
#include "storage/rocksdb_store.h"

namespace leap::sidecar {

// Copies --dataset_max_records/--dataset_max_bytes/--quality_kept into the
// options; INVALID_ARGUMENT for bad values or a bootstrap flag set wrong.
absl::Status ApplyDataFlags(storage::RocksStoreOptions* store,
                            CoreOptions* core);
// With --bootstrap_readout: the bootstrap's options (validated when leapd
// starts it, after recovery and imports); nullopt without it.
std::optional<BootstrapOptions> BootstrapOptionsFromFlags();

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_APP_LEAPD_DATA_FLAGS_H_
