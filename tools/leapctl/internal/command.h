// Private to leapctl's command line (cli.cc, server_cli.cc): the plumbing
// shared by every subcommand, and the entry points of the server commands.
#ifndef LEAP_TOOLS_LEAPCTL_INTERNAL_COMMAND_H_
#define LEAP_TOOLS_LEAPCTL_INTERNAL_COMMAND_H_

#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/string_view.h"
#include "tools/leapctl/cli.h"
#include "tools/leapctl/commands.h"
#include "tools/leapctl/flags.h"
#include "tools/leapctl/server.h"

namespace leap::leapctl::internal {

// One line (a status message may carry newlines from file contents or the
// server).
inline std::string OneLine(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"\n", " "}, {"\r", " "}});
}

// Shared plumbing of one subcommand run. `name` is what follows "leapctl"
// in messages ("train", "readouts get").
class Command {
 public:
  Command(std::string name, std::ostream& out, std::ostream& err)
      : name_(std::move(name)), out_(out), err_(err) {}

  // Parses; returns -1 to continue, or the exit code to return now (help
  // printed or usage error reported).
  int Parse(FlagSet& flags, const std::vector<std::string>& args) {
    absl::Status s = flags.Parse(args);
    if (!s.ok()) return UsageError(s);
    if (flags.help_requested()) {
      out_ << flags.Help();
      return kExitOk;
    }
    return -1;
  }
  int UsageError(const absl::Status& s) {
    err_ << "leapctl " << name_ << ": error: " << OneLine(s.message())
         << " (see 'leapctl " << name_ << " --help')" << std::endl;
    return kExitUsage;
  }
  int Failure(const absl::Status& s) {
    err_ << "leapctl " << name_ << ": error: " << OneLine(s.message())
         << std::endl;
    return kExitFailure;
  }
  ProgressFn Progress() {
    return [this](const std::string& line) {
      err_ << "leapctl " << name_ << ": " << line << std::endl;
    };
  }
  std::ostream& out() { return out_; }
  std::ostream& err() { return err_; }

 private:
  std::string name_;
  std::ostream& out_;
  std::ostream& err_;
};

// The server commands (server_cli.cc). `args` excludes the command word(s).
int ReadoutsCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err);
int VersionsCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err);
int ExportCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err);
// tools/leapctl/dataset.cc
int DatasetCommand(const std::vector<std::string>& args, std::ostream& out,
                   std::ostream& err);
// The --server/--timeout/--token-file/--tls-* flags of every server command
// and their check (-1 to continue, else the exit code).
void AddServerFlags(FlagSet& flags, ServerOptions* o);
int CheckServerFlags(Command& cmd, const ServerOptions& o);
int AdaptationCommand(bool frozen, const std::vector<std::string>& args,
                      std::ostream& out, std::ostream& err);
int RouteCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);
int StatsCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);
int BenchCommand(const std::vector<std::string>& args, std::ostream& out,
                 std::ostream& err);
int FeedCommand(const std::vector<std::string>& args, std::ostream& out,
                std::ostream& err);
int SnapshotCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err);
int RollbackCommand(const std::vector<std::string>& args, std::ostream& out,
                    std::ostream& err);
int ImportCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err);
// `leapctl replay` (replay_cli.cc): the command line over replay/replay.h.
int ReplayCommand(const std::vector<std::string>& args, std::ostream& out,
                  std::ostream& err);

}  // namespace leap::leapctl::internal

#endif  // LEAP_TOOLS_LEAPCTL_INTERNAL_COMMAND_H_
