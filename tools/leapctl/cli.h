// leapctl's command line: subcommand dispatch, flags and --help text of the
// offline commands (train, eval, adapt, synth; logic in
// tools/leapctl/commands.h) and of the commands for a running leapd
// (readouts, versions, export, freeze, resume, route, stats, bench, feed;
// logic in tools/leapctl/{server,bench,feed}.h).
#ifndef LEAP_TOOLS_LEAPCTL_CLI_H_
#define LEAP_TOOLS_LEAPCTL_CLI_H_

#include <ostream>
#include <string>
#include <vector>

namespace leap::leapctl {

// Exit codes of every command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Runs `leapctl args...` (`args` excludes the program name). Results go to
// `out`; progress lines and the one-line "leapctl <cmd>: error: ..." message
// go to `err`. Returns kExitOk, kExitFailure (the command failed: bad or
// unreadable input, I/O error, an error from leapd, whose message starts
// with the gRPC code's name, or an unreachable leapd) or kExitUsage (unknown
// command or flag, missing required flag or argument, malformed or
// out-of-range flag value).
// Thread-compatible.
int RunLeapctl(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err);

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_CLI_H_
