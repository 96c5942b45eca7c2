// Helpers for the tests that drive the real `leapctl` binary as a
// subprocess: a scratch directory and a runner capturing exit code, stdout
// and stderr. The binary's path comes from the LEAPCTL_PATH compile
// definition.
#ifndef LEAP_TESTS_LEAPCTL_TEST_UTIL_H_
#define LEAP_TESTS_LEAPCTL_TEST_UTIL_H_

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/process.h"
#include "tests/support/scoped_temp_dir.h"

#ifndef LEAPCTL_PATH
#error "LEAPCTL_PATH must name the leapctl binary"
#endif

namespace leap::leapctl_test {

struct RunResult {
  int exit_code = -1;  // -1: did not exit normally (signal)
  std::string out;
  std::string err;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A fresh directory under $TMPDIR (or /tmp), removed on destruction (kept
// with LEAP_KEEP_TEST_DIRS=1; see tests/support/scoped_temp_dir.h).
class ScratchDir : public ::leap::testing::ScopedTempDir {
 public:
  ScratchDir() : ScopedTempDir("leapctl_test") {}
};

// Runs `leapctl args...` with stdout and stderr captured (the launcher of
// tests/support/process.h) and waits for it. `scratch` is where the command's
// files go; the runner itself writes none.
inline RunResult RunLeapctl(const ScratchDir& scratch,
                            const std::vector<std::string>& args) {
  std::vector<std::string> argv = {LEAPCTL_PATH};
  argv.insert(argv.end(), args.begin(), args.end());
  RunResult r;
  absl::StatusOr<testing::ProcessResult> run = testing::RunProcess(argv);
  if (!run.ok()) {
    ADD_FAILURE() << "cannot run " << argv[0] << ": " << run.status();
    return r;
  }
  if (WIFEXITED(run->status)) r.exit_code = WEXITSTATUS(run->status);
  r.out = std::move(run->out);
  r.err = std::move(run->err);
  return r;
}

// For failure messages.
// `leapctl synth` arguments writing NAME.npy and NAME_len.npy in `dir`,
// followed by `extra` (model and domain flags).
inline std::vector<std::string> SynthArgs(const ScratchDir& dir,
                                          const std::string& name, int n,
                                          int seed,
                                          const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"synth",
                                   "--out-features",
                                   dir.File(name + ".npy"),
                                   "--out-lengths",
                                   dir.File(name + "_len.npy"),
                                   "--n",
                                   std::to_string(n),
                                   "--seed",
                                   std::to_string(seed)};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

inline std::string Describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + "\n--- stdout:\n" + r.out +
         "--- stderr:\n" + r.err;
}

}  // namespace leap::leapctl_test

#endif  // LEAP_TESTS_LEAPCTL_TEST_UTIL_H_
