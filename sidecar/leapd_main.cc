// leapd: the LEAP sidecar daemon. Serves predictions, learns from
// completions with RLS, pushes new readout versions to engines.
// See `leapd --help`, the README and docs/ARCHITECTURE.md. The flags and
// their validation live in sidecar/app/leapd_options.h, the assembly of the
// process in sidecar/app/leapd_server.h.
#include <cstdio>
#include <string>

#include "readout/rls.h"
#include "sidecar/app/leapd_options.h"
#include "sidecar/app/leapd_server.h"

namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "leapd: error: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread starts (see the function's comment).
  leap::readout::PrepareOpenBlasForRls();
  leap::sidecar::ParseLeapdFlags(argc, argv);
  absl::StatusOr<leap::sidecar::LeapdOptions> options =
      leap::sidecar::LeapdOptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  // RunLeapd returns once everything it started (the RocksDB store and its
  // lock included) is gone, so a new leapd may start at once.
  if (absl::Status s = leap::sidecar::RunLeapd(*std::move(options)); !s.ok()) {
    return Fail(s);
  }
  std::fprintf(stderr, "leapd: stopped\n");
  return 0;
}
