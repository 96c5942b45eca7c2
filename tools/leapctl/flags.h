// A small command-line flag parser for leapctl's subcommands.
//
// Flags are "--name value" or "--name=value"; boolean flags take no value
// ("--no-p"). Every flag is registered with a destination, a help line and a
// placeholder; Help() renders them all, so --help documents every flag by
// construction. Positional arguments are accepted only where a command
// registers them (Positional), in order; after "--" every argument is
// positional. Unexpected positionals, unknown flags, repeated flags (except
// list flags), missing values, unparsable values and missing required flags
// or arguments are usage errors.
#ifndef LEAP_TOOLS_LEAPCTL_FLAGS_H_
#define LEAP_TOOLS_LEAPCTL_FLAGS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace leap::leapctl {

// The flags of one command. Not thread-safe; build, parse, read on one
// thread. Destinations must outlive the FlagSet.
class FlagSet {
 public:
  // `command` is the subcommand's name, `usage` its synopsis line and
  // `description` the paragraph printed under it by Help().
  FlagSet(std::string command, std::string usage, std::string description);

  // Registers --name. `value_name` is the placeholder shown in the help
  // ("PATH", "N"); `help` the description (the default is appended when the
  // flag is optional and `show_default` is true). Required flags must be
  // present on the command line.
  void String(const std::string& name, std::string* dst,
              const std::string& value_name, const std::string& help,
              bool required = false);
  void Int64(const std::string& name, int64_t* dst,
             const std::string& value_name, const std::string& help,
             bool required = false);
  void Double(const std::string& name, double* dst,
              const std::string& value_name, const std::string& help);
  // A double that stays nullopt unless given.
  void OptionalDouble(const std::string& name, std::optional<double>* dst,
                      const std::string& value_name, const std::string& help);
  // An integer that stays nullopt unless given.
  void OptionalInt64(const std::string& name, std::optional<int64_t>* dst,
                     const std::string& value_name, const std::string& help);
  // A flag without a value: sets *dst to true when present.
  void Bool(const std::string& name, bool* dst, const std::string& help);
  // A repeatable flag: every occurrence appends its (non-empty) value to
  // *dst.
  void StringList(const std::string& name, std::vector<std::string>* dst,
                  const std::string& value_name, const std::string& help);
  // A positional argument, filled in registration order; `name` is its
  // placeholder in the help ("NAME"). Register required ones first. An empty
  // argument ("") is accepted; the command checks the value.
  void Positional(const std::string& name, std::string* dst,
                  const std::string& help, bool required = true);

  // Parses `args` (the arguments after the subcommand name). Sets
  // help_requested() for "--help"/"-h" and then returns OK without checking
  // required flags. Returns InvalidArgument with a one-line message for a
  // usage error.
  absl::Status Parse(const std::vector<std::string>& args);

  bool help_requested() const { return help_requested_; }
  // Whether --name appeared on the command line (for a positional: whether
  // it was given).
  bool WasSet(const std::string& name) const;

  // The --help text: usage line, description, one entry per positional
  // argument and one per flag.
  std::string Help() const;

 private:
  struct Flag {
    std::string name;
    std::string value_name;  // empty for boolean flags
    std::string help;
    std::string default_text;  // empty: no default shown
    bool required = false;
    bool set = false;
    bool repeatable = false;
    // Parses the value into the destination; false when malformed.
    std::function<bool(absl::string_view)> parse;
  };
  struct Arg {
    std::string name;
    std::string help;
    bool required = true;
    bool set = false;
    std::string* dst = nullptr;
  };
  Flag* Find(absl::string_view name);
  // Adds --name (value_name empty: a boolean flag) parsed by `parse`.
  void Add(const std::string& name, const std::string& value_name,
           std::string help, std::function<bool(absl::string_view)> parse,
           std::string default_text = "", bool required = false,
           bool repeatable = false);
  absl::Status TakePositional(const std::string& value);

  std::string command_;
  std::string usage_;
  std::string description_;
  std::vector<Flag> flags_;
  std::vector<Arg> args_;
  bool help_requested_ = false;
};

}  // namespace leap::leapctl

#endif  // LEAP_TOOLS_LEAPCTL_FLAGS_H_
