// leapctl's command line: subcommand dispatch, flags and --help text for
// train, eval, adapt and synth (tools/leapctl/commands.h holds their logic).
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
// unreadable input, I/O error) or kExitUsage (unknown command or flag,
// missing required flag, malformed or out-of-range flag value).
// Thread-compatible.
int RunLeapctl(const std::vector<std::string>& args, std::ostream& out,
               std::ostream& err);

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_CLI_H_
