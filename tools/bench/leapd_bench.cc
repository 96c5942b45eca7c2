// leapd_bench: load generator for leapd's Connect stream, kept as a program
// for scripts that call it by name. Exactly `leapctl bench` (see
// 'leapd_bench --help'): it replaces itself with the leapctl beside it
// ("leapctl" in the same folder, an installation; ../leapctl/leapctl, this
// build tree), else the one on PATH.
//
//   leapd_bench --server 127.0.0.1:7070 [--dim 4096] [--batch 64]
//               [--streams 2] [--seconds 10] [--latency-requests 2000]
//               [--dtype float32|bfloat16] [--json]
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/process.h"

int main(int argc, char** argv) {
  absl::StatusOr<std::string> leapctl =
      leap::client::FindProgram("leapctl", {"../leapctl"});
  if (!leapctl.ok()) {
    std::fprintf(stderr, "leapd_bench: error: %s\n",
                 std::string(leapctl.status().message()).c_str());
    return 1;
  }
  std::vector<std::string> args = {*leapctl, "bench"};
  args.insert(args.end(), argv + 1, argv + argc);
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  execv(cargs[0], cargs.data());
  std::fprintf(stderr, "leapd_bench: error: cannot run %s: %s\n",
               leapctl->c_str(), std::strerror(errno));
  return 1;
}
