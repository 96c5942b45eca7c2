// leapd's command line: the flags (defined in leapd_options.cc and
// leapd_data_flags.cc, documented by `leapd --help` and --helpfull) turned
// into one typed, validated LeapdOptions. Nothing here opens state or starts
// a thread.
//
// Threads: ParseLeapdFlags and LeapdOptionsFromFlags are called once, from
// main, before any other thread exists (absl flags are process globals).
#ifndef LEAP_SIDECAR_APP_LEAPD_OPTIONS_H_
#define LEAP_SIDECAR_APP_LEAPD_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "sidecar/core/bootstrap.h"
#include "sidecar/core/core.h"
#include "sidecar/fleet/member.h"
#include "sidecar/grpc/admin_auth.h"
#include "sidecar/shm/shm_server.h"
#include "storage/rocksdb_store.h"

namespace leap::sidecar {

// --fleet and its companions (docs/FLEET.md).
struct LeapdFleetOptions {
  fleet::FleetMemberOptions member;
  // --fleet_trainer=auto: this member competes for the trainer lease.
  bool train = true;
  int64_t version_interval_ms = 200;
  int64_t checkpoint_every_ms = 30'000;
  // How long the start waits for NATS and the fleet's state.
  int64_t wait_ms = 10'000;
};

// --tls_cert / --tls_key / --tls_client_ca (checked readable PEM files).
struct LeapdTlsOptions {
  std::string cert;
  std::string key;
  std::string client_ca;  // mutual TLS when set
  int64_t reload_interval_s = 60;
  bool enabled() const { return !cert.empty(); }
};

struct LeapdOptions {
  std::vector<std::string> listen;        // --listen, in order
  std::string metrics_listen;             // empty: no /metrics
  CoreOptions core;                       // validated (CoreOptions::Validate)
  // --data_dir; empty: state in memory only (store and the policy unused).
  std::string data_dir;
  storage::RocksStoreOptions store;
  bool move_aside_unrecoverable = false;  // --on_unrecoverable_state
  std::vector<std::string> imports;       // --import specs, FILE or NAME=FILE
  bool import_optional = false;
  std::string default_readout;
  int64_t outbox_bytes = int64_t{64} << 20;
  int64_t max_message_bytes = int64_t{512} << 20;
  absl::Duration drain_timeout = absl::Seconds(5);
  AdminAuth auth;                         // from --admin_token_file
  LeapdTlsOptions tls;
  // --shm: served when shm.path is set; shm.group is --shm_group's gid
  // (-1: none), also given to unix:// --listen sockets.
  ShmServerOptions shm;
  std::optional<LeapdFleetOptions> fleet;       // --fleet
  std::optional<BootstrapOptions> bootstrap;    // --bootstrap_readout
};

// Sets the program's usage text, the --version line and which flags --help
// lists, then parses argv (exits on a bad flag, --help or --version, as
// absl does). --listen and --import may be repeated: their occurrences are
// joined before parsing.
void ParseLeapdFlags(int argc, char** argv);

// The parsed flags as options. INVALID_ARGUMENT (or the error of reading
// --admin_token_file) naming the flag for the first bad value, checked in a
// fixed order.
absl::StatusOr<LeapdOptions> LeapdOptionsFromFlags();

// What `leapd --version` prints: version, git revision, build type.
std::string LeapdVersionLine();

}  // namespace leap::sidecar

#endif  // LEAP_SIDECAR_APP_LEAPD_OPTIONS_H_
