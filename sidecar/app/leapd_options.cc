// leapd's flags and their conversion into LeapdOptions (leapd_options.h).
// `leapd --help` lists the flags defined in this file; the data and
// bootstrap flags (leapd_data_flags.cc) are listed by --helpfull.
#include "sidecar/app/leapd_options.h"

#include <grp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "leap_build_info.h"
#include "sidecar/app/leapd_data_flags.h"
#include "sidecar/fleet/nats_client.h"

ABSL_FLAG(std::vector<std::string>, listen, {"127.0.0.1:7070"},
          "Address to serve gRPC on: host:port (port 0 picks a free port) or "
          "unix:///path. Repeatable (or comma-separated). Each bound address "
          "is printed on stdout as 'listening on ADDR'.");
ABSL_FLAG(std::string, data_dir, "",
          "Directory of the embedded RocksDB with readouts, checkpoints, the "
          "feedback log, versions, snapshots and routes. On start the newest "
          "valid checkpoint of every readout is loaded and the log after it "
          "replayed in the batches recorded with its versions, publishing "
          "nothing (each readout resumes at the version number its state "
          "had), then the completions acknowledged but not yet applied are "
          "applied; until all of that is done gRPC health reports "
          "NOT_SERVING and the data plane (Connect, Predict, Complete, shm "
          "attach) answers UNAVAILABLE \"recovering\". Empty: state lives in "
          "memory only.");
ABSL_FLAG(absl::Duration, dedup_window, absl::Hours(1),
          "With --data_dir: how long a recorded completion is remembered, so "
          "that one resent after a reconnect is acknowledged as a duplicate "
          "and not learned twice. Only a resend of the same completion is a "
          "duplicate: same engine instance (Hello.instance_id), request id, "
          "features and outcome, or the same instance and id while the "
          "request is not live. Reused ids with new features are learned.");
ABSL_FLAG(bool, sync_log, false,
          "fsync the feedback log before acknowledging completions: once per "
          "unary Complete, once per completions message of a Connect stream "
          "or shared-memory ring (an acknowledged completion survives a power "
          "loss; without it, kill -9 of leapd).");
ABSL_FLAG(int64_t, checkpoint_every_batches, 256,
          "Checkpoint theta and P after this many RLS batches...");
ABSL_FLAG(absl::Duration, checkpoint_every, absl::Seconds(60),
          "...or this long after the last checkpoint, whichever comes first.");
ABSL_FLAG(int32_t, checkpoints_kept, 2,
          "Valid checkpoints kept per readout (the log is kept from the "
          "oldest, so a corrupt newest one falls back without loss).");
ABSL_FLAG(int64_t, versions_kept, 10000,
          "Published versions kept per readout on disk and in memory (with "
          "--data_dir at least --checkpoint_every_batches: recovery replays "
          "the log in the batches of the versions since the checkpoint).");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "host:port for Prometheus /metrics (port 0 picks one; empty "
          "disables). Printed as 'metrics on http://ADDR/metrics'.");
ABSL_FLAG(std::vector<std::string>, import, {},
          "Readout artifact (.leapr) to load at start, as FILE or NAME=FILE "
          "(NAME defaults to the file name without extension). Repeatable.");
ABSL_FLAG(std::string, on_unrecoverable_state, "fail",
          "With --data_dir: what to do when the stored state is corrupt beyond "
          "what recovery repairs (a DATA_LOSS when opening or loading it; a "
          "held lock or an I/O error always fails). 'fail': exit with the "
          "reason. 'move_aside': rename the directory to "
          "DIR.unrecoverable-<UTC time> (kept for inspection), print a "
          "'recovery:' line and start with an empty state, so that leapd "
          "serves again (after an import) without anyone scaling the pod "
          "down. The parent of --data_dir must be writable.");
ABSL_FLAG(bool, import_optional, false,
          "A --import FILE that does not exist is reported ('--import FILE: "
          "not there; skipped') and skipped instead of failing the start: for "
          "artifacts an init step fetches, which may have failed (leapd then "
          "serves what its --data_dir holds, or nothing, and engines keep "
          "first-come order). A file that exists but does not load still "
          "fails the start.");
ABSL_FLAG(bool, allow_hello_mismatch, false,
          "Serve an engine whose Hello.model_id or Hello.layer differs from "
          "the metadata (model id, layer) of a readout of its width. Without "
          "it such a hello is refused with FAILED_PRECONDITION naming both "
          "(gRPC Connect and shm attach alike); hellos and readouts that "
          "declare no model id (an empty one; a hello layer <= 0, a readout "
          "layer -1) are not compared.");
ABSL_FLAG(std::string, default_readout, "",
          "Readout serving the default route (product line \"\"). Default: "
          "the first --import.");
ABSL_FLAG(int32_t, rls_batch, 8,
          "Completions per RLS update while learning keeps up.");
ABSL_FLAG(int32_t, rls_batch_max, 256,
          "With a backlog, up to this many queued completions are applied in "
          "one exact RLS batch (same result, P streamed once). [1, 4096]");
ABSL_FLAG(int32_t, rls_threads, 0,
          "Threads of each readout's RLS update and fold (0: the cores this "
          "process may run on). Results do not depend on it.");
ABSL_FLAG(absl::Duration, rls_flush, absl::Milliseconds(200),
          "A partial RLS batch is applied once its oldest completion waited "
          "this long.");
ABSL_FLAG(int64_t, feature_cache_bytes, int64_t{1} << 30,
          "Bytes of live-request features kept for learning and rescoring; "
          "the oldest requests are evicted beyond it.");
ABSL_FLAG(absl::Duration, feature_cache_ttl, absl::Minutes(30),
          "Live requests older than this are evicted.");
ABSL_FLAG(int64_t, quality_window, 1000,
          "Completions in each rolling Spearman window.");
ABSL_FLAG(std::optional<double>, guardrail_floor, std::nullopt,
          "Quality guardrail: while a readout learns, when the rolling "
          "Spearman of its predicted vs. true lengths (over its latest "
          "--quality_window completions, judged once it holds "
          "--guardrail_min_samples) falls below this value in [-1, 1], "
          "leapd freezes its learning (persisted, with the reason) and "
          "applies --guardrail_action. Unset: no floor.");
ABSL_FLAG(std::optional<double>, guardrail_margin, std::nullopt,
          "Quality guardrail: trip also when that Spearman is more than this "
          "(in (0, 2]) below the one recorded with the last good snapshot "
          "(the newest snapshot whose recorded Spearman covered at least "
          "--guardrail_min_samples completions and met the floor). Unset: no "
          "margin check. With neither floor nor margin the guardrail is off.");
ABSL_FLAG(int64_t, guardrail_min_samples, 500,
          "Quality guardrail: completions the window must hold before it is "
          "judged (and that a snapshot's recorded Spearman must cover to "
          "count as good); in [2, --quality_window].");
ABSL_FLAG(double, guardrail_hysteresis, 0.05,
          "Quality guardrail: a warming guardrail is armed only by a judged "
          "window at least this far (in [0, 1]) above its trip line (the "
          "floor, and the last good snapshot's Spearman less the margin), so a "
          "quality hovering at the line cannot arm and trip it again and "
          "again. 0: armed by the first window that passes.");
ABSL_FLAG(std::string, guardrail_action, "freeze",
          "Quality guardrail: what a trip does: 'freeze' (learning frozen "
          "until 'leapctl resume') or 'rollback' (frozen, and the readout "
          "rolled back to the last good snapshot, published as a new "
          "version; frozen only when there is none).");
ABSL_FLAG(int64_t, max_batch_bytes, int64_t{64} << 20,
          "Largest feature payload of one message; larger ones get "
          "RESOURCE_EXHAUSTED without ending the stream.");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{512} << 20,
          "gRPC transport limit on one message (admin artifacts included).");
ABSL_FLAG(int64_t, outbox_bytes, int64_t{64} << 20,
          "Bytes queued for one consumer (a WatchReadout or Connect stream) "
          "that does not read fast enough. Over it, queued versions are "
          "first coalesced to the newest (a WatchReadout keeps only the "
          "newest version, a Connect stream only the newest publish notice "
          "per readout; rescores always carry the newest version); if still "
          "over, the consumer is dropped with RESOURCE_EXHAUSTED \"consumer "
          "too slow: N bytes queued\". Others never wait on it.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(5),
          "On SIGTERM/SIGINT: time given to calls in flight to finish. Open "
          "Connect streams (idle or not) are ended at once with a "
          "message-level UNAVAILABLE \"leapd is shutting down\" error, "
          "WatchReadout streams end within 100 ms.");
ABSL_FLAG(std::string, admin_token_file, "",
          "File holding the bearer token that every leap.v1.Admin call "
          "arriving over TCP must carry as the metadata 'authorization: "
          "Bearer TOKEN' (else UNAUTHENTICATED). Read once at start; "
          "surrounding whitespace is ignored. Admin calls over a unix socket "
          "are trusted; Predictor, health and reflection are not affected. "
          "Empty: no token is required.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this server. With --tls_key, every TCP "
          "--listen serves TLS only (plaintext clients are refused); unix "
          "sockets stay plaintext. The files are re-read every "
          "--tls_reload_interval: new connections use the new certificate.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle for mutual TLS: with it, TCP clients must present a "
          "certificate signed by one of these CAs (others are refused in the "
          "handshake). Re-read like --tls_cert. Needs --tls_cert.");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(60),
          "How often the --tls_cert, --tls_key and --tls_client_ca files are "
          "checked for changes (whole seconds, at least 1 s).");

ABSL_FLAG(std::string, shm, "",
          "Serve the shared-memory data plane on this attach socket path "
          "(engines use the endpoint shm://PATH, e.g. "
          "shm:///dev/shm/leap-main). Each engine's segment is created "
          "beside it as PATH.<id>.seg and removed when the engine detaches. "
          "In Kubernetes, put it on an emptyDir (medium: Memory) both "
          "containers mount. Empty: no shared-memory data plane.");
ABSL_FLAG(absl::Duration, shm_spin, absl::Microseconds(50),
          "How long the shm thread keeps polling after the last frame before "
          "it sleeps (0 = sleep at once; longer = lower latency under light "
          "load for more CPU).");
ABSL_FLAG(int32_t, shm_max_slots, 65536,
          "Largest feature-slot count one engine may ask for.");
ABSL_FLAG(std::string, shm_group, "",
          "Group (name or numeric gid) given the --shm attach socket, "
          "every segment and every unix:// --listen socket, all mode 0660: "
          "only its members (and leapd's user) may attach or connect (an "
          "engine running as another user, e.g. in Kubernetes with the pod's "
          "fsGroup). leapd must be a member of it (or root). Empty: leapd's "
          "own group, attach socket 0660, segments 0600, --listen sockets as "
          "the umask makes them.");
ABSL_FLAG(int32_t, shm_max_engines, 64,
          "Engines attached over shm at once.");

// Fleet mode (docs/FLEET.md).
ABSL_FLAG(std::string, fleet, "",
          "Fleet mode: nats://HOST:PORT[,nats://HOST:PORT...] (tls://... "
          "too), the NATS JetStream servers of the fleet. Every leapd of the "
          "fleet serves the same readouts, versions and routes; one of them "
          "(the trainer) learns from every member's completions. A learnable "
          "completion is acknowledged only once it is in the local outbox "
          "(--data_dir, required) and in the fleet's FEEDBACK stream; while "
          "NATS is unreachable completions get UNAVAILABLE (engines resend "
          "them) and predictions go on with the last weights. Empty: no "
          "fleet, leapd learns alone.");
ABSL_FLAG(std::string, fleet_name, "",
          "Fleet mode: the fleet's name, [A-Za-z0-9_-]{1,32}; it names the "
          "streams (LEAP_<name>_FEEDBACK, ...) and subjects (leap.<name>.*).");
ABSL_FLAG(std::string, fleet_member, "",
          "Fleet mode: this member's id, unique in the fleet, "
          "[A-Za-z0-9_.-]{1,64}. Default: $HOSTNAME.");
ABSL_FLAG(int32_t, fleet_replicas, 1,
          "Fleet mode: JetStream replicas of the streams and buckets a member "
          "creates when they do not exist yet (1 to 5; 3 for a 3-node NATS "
          "cluster). Existing ones are used as they are.");
ABSL_FLAG(int64_t, fleet_lease_ms, 2000,
          "Fleet mode: the trainer lease's time to live; a dead trainer is "
          "replaced within about this plus a third of it.");
ABSL_FLAG(int64_t, fleet_version_interval_ms, 200,
          "Fleet mode: minimum time between two versions of a readout the "
          "trainer publishes (batches applied meanwhile go into the next "
          "one); control operations are published at once.");
ABSL_FLAG(std::string, fleet_trainer, "auto",
          "Fleet mode: 'auto' (this member competes for the trainer lease) or "
          "'never' (it serves but never trains).");
ABSL_FLAG(std::string, fleet_creds, "",
          "Fleet mode: NATS credentials file (JWT and NKey seed).");
ABSL_FLAG(std::string, fleet_tls_ca, "",
          "Fleet mode: PEM CA bundle to verify the NATS servers (turns TLS "
          "on).");
ABSL_FLAG(std::string, fleet_tls_cert, "",
          "Fleet mode: PEM client certificate for mutual TLS with NATS "
          "(with --fleet_tls_key).");
ABSL_FLAG(std::string, fleet_tls_key, "",
          "Fleet mode: PEM private key of --fleet_tls_cert.");
ABSL_FLAG(int64_t, fleet_checkpoint_every_s, 30,
          "Fleet mode: how often the trainer writes a checkpoint of theta, P "
          "and its stream position into the fleet's STATE stream.");
ABSL_FLAG(int64_t, fleet_wait_ms, 10000,
          "Fleet mode: at start, how long to wait for NATS and the fleet's "
          "readouts, routes and versions before serving the local state "
          "(degraded until NATS answers).");

namespace leap::sidecar {
namespace {

// absl vector flags take one comma-separated value; also accept repeats by
// joining every occurrence of --name before parsing.
std::vector<char*> JoinRepeated(int argc, char** argv,
                                const std::vector<std::string>& names,
                                std::vector<std::string>& storage) {
  std::vector<char*> out = {argv[0]};
  std::vector<std::vector<std::string>> values(names.size());
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool taken = false;
    for (size_t n = 0; n < names.size(); ++n) {
      const std::string eq = "--" + names[n] + "=";
      if (a.rfind(eq, 0) == 0) {
        values[n].push_back(a.substr(eq.size()));
        taken = true;
      } else if (a == "--" + names[n] && i + 1 < argc) {
        values[n].push_back(argv[++i]);
        taken = true;
      }
    }
    if (!taken) {
      storage.push_back(a);
    }
  }
  for (size_t n = 0; n < names.size(); ++n) {
    if (!values[n].empty()) {
      storage.push_back("--" + names[n] + "=" + absl::StrJoin(values[n], ","));
    }
  }
  for (auto& s : storage) out.push_back(s.data());
  return out;
}


// --FLAG=PATH names a file leapd can open for reading: the file, or
// INVALID_ARGUMENT "--FLAG=PATH: cannot read: <why>".
absl::StatusOr<std::FILE*> OpenFlagFile(const std::string& flag,
                                        const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, "=", path, ": cannot read: ", std::strerror(errno)));
  }
  return f;
}

// INVALID_ARGUMENT "--FLAG must be in [LO, HI], got V" outside [lo, hi].
absl::Status CheckFlagRange(const char* flag, int64_t v, int64_t lo, int64_t hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in [", lo, ", ", hi, "], got ", v));
}

// A readable PEM file (checked at start; later changes are picked up by the
// certificate watcher).
absl::Status CheckPemFile(const std::string& flag, const std::string& path) {
  absl::StatusOr<std::FILE*> opened = OpenFlagFile(flag, path);
  if (!opened.ok()) return opened.status();
  std::FILE* f = *opened;
  char buf[4096];
  const size_t n = std::fread(buf, 1, sizeof(buf), f);
  std::fclose(f);
  if (std::string(buf, n).find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": not a PEM file"));
  }
  return absl::OkStatus();
}

// Credentials of the TCP listeners: TLS (mutual with --tls_client_ca) from
// files a watcher re-reads, else plaintext; with an admin token, the

// The fleet flags, validated (an error names the flag); nullopt without
// --fleet.
absl::StatusOr<std::optional<LeapdFleetOptions>> FleetOptions() {
  const std::string servers = absl::GetFlag(FLAGS_fleet);
  if (servers.empty()) {
    for (const auto& [flag, value] :
         {std::pair<std::string, std::string>{"fleet_name",
                                              absl::GetFlag(FLAGS_fleet_name)},
          {"fleet_member", absl::GetFlag(FLAGS_fleet_member)},
          {"fleet_creds", absl::GetFlag(FLAGS_fleet_creds)},
          {"fleet_tls_ca", absl::GetFlag(FLAGS_fleet_tls_ca)},
          {"fleet_tls_cert", absl::GetFlag(FLAGS_fleet_tls_cert)},
          {"fleet_tls_key", absl::GetFlag(FLAGS_fleet_tls_key)}}) {
      if (!value.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", flag, " needs --fleet"));
      }
    }
    return std::nullopt;
  }
  LeapdFleetOptions lo;
  leap::fleet::FleetMemberOptions& o = lo.member;
  for (absl::string_view url : absl::StrSplit(servers, ',')) {
    const std::string u(url);
    const size_t scheme = u.find("://");
    const std::string rest = scheme == std::string::npos ? "" : u.substr(scheme + 3);
    const size_t colon = rest.rfind(':');
    int port = 0;
    if ((u.rfind("nats://", 0) != 0 && u.rfind("tls://", 0) != 0) ||
        colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(rest.substr(colon + 1), &port) || port < 1 ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fleet=", servers, ": \"", u,
          "\" is not nats://HOST:PORT or tls://HOST:PORT"));
    }
    o.nats.servers.push_back(u);
  }
  if (absl::GetFlag(FLAGS_data_dir).empty()) {
    return absl::InvalidArgumentError(
        "--fleet needs --data_dir (the outbox of completions not yet in the "
        "fleet's stream)");
  }
  o.fleet = absl::GetFlag(FLAGS_fleet_name);
  if (o.fleet.empty()) return absl::InvalidArgumentError("--fleet needs --fleet_name");
  if (absl::Status s = leap::fleet::ValidateFleetName(o.fleet); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--fleet_name: ", s.message()));
  }
  o.member = absl::GetFlag(FLAGS_fleet_member);
  if (o.member.empty()) {
    const char* host = std::getenv("HOSTNAME");
    if (host != nullptr) o.member = host;
    if (o.member.empty()) {
      char buf[256] = {};
      if (gethostname(buf, sizeof(buf) - 1) == 0) o.member = buf;
    }
  }
  if (absl::Status s = leap::fleet::ValidateMemberId(o.member); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--fleet_member (default $HOSTNAME): ", s.message()));
  }
  o.replicas = absl::GetFlag(FLAGS_fleet_replicas);
  if (absl::Status s = CheckFlagRange("fleet_replicas", o.replicas, 1, 5); !s.ok()) {
    return s;
  }
  o.lease_ms = absl::GetFlag(FLAGS_fleet_lease_ms);
  if (absl::Status s = CheckFlagRange("fleet_lease_ms", o.lease_ms, 300, 600'000);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckFlagRange("fleet_version_interval_ms",
                                      absl::GetFlag(FLAGS_fleet_version_interval_ms),
                                      0, 3'600'000);
      !s.ok()) {
    return s;
  }
  if (const std::string t = absl::GetFlag(FLAGS_fleet_trainer);
      t != "auto" && t != "never") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--fleet_trainer must be 'auto' or 'never', got '", t, "'"));
  }
  if (absl::Status s = CheckFlagRange("fleet_checkpoint_every_s",
                                      absl::GetFlag(FLAGS_fleet_checkpoint_every_s),
                                      1, 86'400);
      !s.ok()) {
    return s;
  }
  if (absl::GetFlag(FLAGS_fleet_wait_ms) < 0) {
    return absl::InvalidArgumentError("--fleet_wait_ms must be >= 0");
  }
  o.nats.creds_file = absl::GetFlag(FLAGS_fleet_creds);
  o.nats.tls_ca = absl::GetFlag(FLAGS_fleet_tls_ca);
  o.nats.tls_cert = absl::GetFlag(FLAGS_fleet_tls_cert);
  o.nats.tls_key = absl::GetFlag(FLAGS_fleet_tls_key);
  if (o.nats.tls_cert.empty() != o.nats.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--fleet_tls_cert and --fleet_tls_key go together");
  }
  for (const auto& [flag, path] :
       {std::pair<std::string, std::string>{"fleet_creds", o.nats.creds_file},
        {"fleet_tls_ca", o.nats.tls_ca},
        {"fleet_tls_cert", o.nats.tls_cert},
        {"fleet_tls_key", o.nats.tls_key}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::FILE*> f = OpenFlagFile(flag, path);
    if (!f.ok()) return f.status();
    std::fclose(*f);
  }
  o.nats.name = "leapd-" + o.member;
  lo.train = absl::GetFlag(FLAGS_fleet_trainer) == "auto";
  lo.version_interval_ms = absl::GetFlag(FLAGS_fleet_version_interval_ms);
  lo.checkpoint_every_ms = absl::GetFlag(FLAGS_fleet_checkpoint_every_s) * 1000;
  lo.wait_ms = absl::GetFlag(FLAGS_fleet_wait_ms);
  return std::optional<LeapdFleetOptions>(std::move(lo));
}


// --help, --helpshort: the flags of leapd's two flag files, this one and
// leapd_data_flags.cc (dataset and bootstrap). absl's default shows only a
// file named after the program (leapd.cc, leapd_main.cc, leapd-main.cc), so
// without this every flag would be in --helpfull only.
bool IsMainFlagsFile(absl::string_view file) {
  for (absl::string_view name : {"leapd_options.cc", "leapd_data_flags.cc"}) {
    if (file == name || absl::EndsWith(file, absl::StrCat("/", name))) {
      return true;
    }
  }
  return false;
}

}  // namespace

// What `leapd --version` prints and leap_build_info carries: the CMake
// project version, the git revision at configure time, the build type.
std::string LeapdVersionLine() {
  return absl::StrCat("leapd ", LEAP_VERSION, " (revision ", LEAP_GIT_REVISION,
                      ", ", LEAP_BUILD_TYPE, " build)\n");
}


void ParseLeapdFlags(int argc, char** argv) {
  {
    absl::FlagsUsageConfig config;
    config.version_string = LeapdVersionLine;
    config.contains_helpshort_flags = IsMainFlagsFile;
    config.contains_help_flags = IsMainFlagsFile;
    absl::SetFlagsUsageConfig(config);
  }
  absl::SetProgramUsageMessage(
      "the LEAP sidecar: length predictions from the serving model's hidden "
      "states, corrected online by RLS.\n"
      "  leapd --listen=127.0.0.1:0 --import=chat=chat.leapr\n"
      "Serves leap.v1.Predictor and leap.v1.Admin (proto/leap/v1), the gRPC "
      "health service and reflection; Prometheus metrics on --metrics_listen. "
      "SIGTERM/SIGINT drain streams, apply queued completions and exit 0.");
  std::vector<std::string> storage;
  std::vector<char*> args =
      JoinRepeated(argc, argv, {"listen", "import"}, storage);
  int nargs = static_cast<int>(args.size());
  absl::ParseCommandLine(nargs, args.data());
}

absl::StatusOr<LeapdOptions> LeapdOptionsFromFlags() {
  LeapdOptions lo;
  CoreOptions& options = lo.core;
  options.readout.rls_batch = absl::GetFlag(FLAGS_rls_batch);
  options.readout.rls_batch_max = absl::GetFlag(FLAGS_rls_batch_max);
  options.readout.rls_threads = absl::GetFlag(FLAGS_rls_threads);
  options.readout.flush_after_ns =
      absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_rls_flush));
  options.readout.quality_window = absl::GetFlag(FLAGS_quality_window);
  options.cache.max_bytes = absl::GetFlag(FLAGS_feature_cache_bytes);
  options.cache.ttl_ns =
      absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_feature_cache_ttl));
  options.max_batch_bytes = absl::GetFlag(FLAGS_max_batch_bytes);
  options.allow_hello_mismatch = absl::GetFlag(FLAGS_allow_hello_mismatch);
  options.readout.checkpoint_every_batches =
      absl::GetFlag(FLAGS_checkpoint_every_batches);
  options.readout.checkpoint_every_ns =
      absl::ToInt64Nanoseconds(absl::GetFlag(FLAGS_checkpoint_every));
  options.readout.versions_kept = absl::GetFlag(FLAGS_versions_kept);
  if (options.readout.versions_kept < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--versions_kept must be >= 1, got ", options.readout.versions_kept));
  }
  if (absl::GetFlag(FLAGS_checkpoints_kept) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--checkpoints_kept must be >= 1, got ", absl::GetFlag(FLAGS_checkpoints_kept)));
  }
  options.readout.guardrail.floor =
      absl::GetFlag(FLAGS_guardrail_floor).value_or(NAN);
  options.readout.guardrail.margin =
      absl::GetFlag(FLAGS_guardrail_margin).value_or(NAN);
  options.readout.guardrail.min_samples =
      absl::GetFlag(FLAGS_guardrail_min_samples);
  options.readout.guardrail.hysteresis =
      absl::GetFlag(FLAGS_guardrail_hysteresis);
  {
    absl::StatusOr<GuardrailAction> action =
        ParseGuardrailAction(absl::GetFlag(FLAGS_guardrail_action));
    if (!action.ok()) {
      return absl::InvalidArgumentError(action.status().message());
    }
    options.readout.guardrail.action = *action;
  }
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  absl::StatusOr<std::optional<LeapdFleetOptions>> fleet = FleetOptions();
  if (!fleet.ok()) return fleet.status();
  lo.fleet = std::move(*fleet);
  // Fleet mode: the readouts here only serve; the trainer learns.
  options.readout.serving_only = lo.fleet.has_value();
  // The shm group and the admin token first: bad ones fail before any
  // state is opened.
  int64_t shm_gid = -1;
  if (const std::string g = absl::GetFlag(FLAGS_shm_group); !g.empty()) {
    if (int64_t n = -1; absl::SimpleAtoi(g, &n) && n >= 0) {
      shm_gid = n;
    } else {
      std::vector<char> buf(16384);
      group gr{};
      group* found = nullptr;
      if (getgrnam_r(g.c_str(), &gr, buf.data(), buf.size(), &found) == 0 &&
          found != nullptr) {
        shm_gid = found->gr_gid;
      }
    }
    if (shm_gid < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shm_group=", g, ": no such group"));
    }
  }
  if (!absl::GetFlag(FLAGS_admin_token_file).empty()) {
    auto token = ReadAdminTokenFile(absl::GetFlag(FLAGS_admin_token_file));
    if (!token.ok()) return token.status();
    lo.auth = AdminAuth(std::move(*token));
  }
  lo.data_dir = absl::GetFlag(FLAGS_data_dir);
  if (!lo.data_dir.empty()) {
    // Recovery replays the log after the newest checkpoint in the batches
    // of the versions published since (docs/STORAGE.md, "Recovery"): up to
    // --checkpoint_every_batches of them, which must all be kept. A fleet
    // member's readouts serve only: it replays nothing in batches.
    if (!lo.fleet.has_value() &&
        options.readout.versions_kept < options.readout.checkpoint_every_batches) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--versions_kept (", options.readout.versions_kept,
          ") must be >= --checkpoint_every_batches (",
          options.readout.checkpoint_every_batches,
          ") with --data_dir: recovery replays the log since the newest "
          "checkpoint in the batches of the versions published after it"));
    }
    storage::RocksStoreOptions& so = lo.store;
    // Synced by Core before each acknowledgement (one fsync per message),
    // not by the store on every append.
    so.sync_log = false;
    options.sync_feedback_log = absl::GetFlag(FLAGS_sync_log);
    so.checkpoints_kept = absl::GetFlag(FLAGS_checkpoints_kept);
    so.versions_kept = absl::GetFlag(FLAGS_versions_kept);
    so.dedup_window_ms =
        absl::ToInt64Milliseconds(absl::GetFlag(FLAGS_dedup_window));
    if (absl::Status s = ApplyDataFlags(&so, &options); !s.ok()) return s;
    if (so.dedup_window_ms < 0) {
      return absl::InvalidArgumentError("--dedup_window must be >= 0");
    }
    const std::string policy = absl::GetFlag(FLAGS_on_unrecoverable_state);
    if (policy != "fail" && policy != "move_aside") {
      return absl::InvalidArgumentError(
          absl::StrCat("--on_unrecoverable_state must be fail or "
                       "move_aside, got '", policy, "'"));
    }
    lo.move_aside_unrecoverable = policy == "move_aside";
  }
  lo.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  lo.listen = absl::GetFlag(FLAGS_listen);
  lo.outbox_bytes = absl::GetFlag(FLAGS_outbox_bytes);
  if (lo.outbox_bytes < 1) {
    return absl::InvalidArgumentError("--outbox_bytes must be >= 1");
  }
  lo.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  lo.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  // TLS of the TCP listeners: files readable PEM now; a watcher re-reads
  // them while leapd runs.
  lo.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  lo.tls.key = absl::GetFlag(FLAGS_tls_key);
  lo.tls.client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  if (lo.tls.cert.empty() != lo.tls.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (lo.tls.cert.empty()) {
    if (!lo.tls.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert");
    }
  } else {
    for (const auto& [flag, path] :
         {std::pair<std::string, std::string>{"tls_cert", lo.tls.cert},
          {"tls_key", lo.tls.key}, {"tls_client_ca", lo.tls.client_ca}}) {
      if (path.empty()) continue;
      if (absl::Status s = CheckPemFile(flag, path); !s.ok()) return s;
    }
  }
  lo.tls.reload_interval_s = std::max<int64_t>(
      1, absl::ToInt64Seconds(absl::GetFlag(FLAGS_tls_reload_interval)));
  lo.shm.path = absl::GetFlag(FLAGS_shm);
  lo.shm.spin = absl::GetFlag(FLAGS_shm_spin);
  lo.shm.max_slots =
      static_cast<uint32_t>(std::max(1, absl::GetFlag(FLAGS_shm_max_slots)));
  lo.shm.max_engines = absl::GetFlag(FLAGS_shm_max_engines);
  lo.shm.group = shm_gid;
  lo.imports = absl::GetFlag(FLAGS_import);
  lo.import_optional = absl::GetFlag(FLAGS_import_optional);
  lo.default_readout = absl::GetFlag(FLAGS_default_readout);
  lo.bootstrap = BootstrapOptionsFromFlags();
  return lo;
}

}  // namespace leap::sidecar
