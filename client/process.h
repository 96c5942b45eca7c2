// A real child process for end-to-end tests: started with fork/exec, its
// stdout read line by line through a pipe (stderr is inherited so failures
// show in the test log), signalled and reaped. Test-only.
#ifndef LEAP_TESTS_SUPPORT_PROCESS_H_
#define LEAP_TESTS_SUPPORT_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace leap::testing {

class Process {
 public:
  // Starts argv[0] (a path) with the given arguments.
  static absl::StatusOr<std::unique_ptr<Process>> Start(
      const std::vector<std::string>& argv);
  ~Process();  // SIGKILLs and reaps the child if it is still running

  // Reads stdout until a line starting with `prefix`; returns the rest of
  // that line. DeadlineExceeded after `timeout`, NotFound at EOF.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix,
                                          absl::Duration timeout);
  // Every stdout line read so far.
  const std::vector<std::string>& lines() const { return lines_; }
  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits for exit; returns the raw wait status (see WIFEXITED etc.).
  int Wait();

 private:
  Process() = default;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  std::string buffer_;
  std::vector<std::string> lines_;
};

// Starts leapd (path from the LEAPD_PATH compile definition or argument)
// with `args` plus --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 unless
// given, and waits for it to be ready. `address` receives host:port.
// GET http://host:port/path over a plain socket (loopback test servers);
// returns the body.
absl::StatusOr<std::string> HttpGet(const std::string& host_port,
                                    const std::string& path);

absl::StatusOr<std::unique_ptr<Process>> StartLeapd(
    const std::string& leapd_path, std::vector<std::string> args,
    std::string* address, absl::Duration timeout = absl::Seconds(30));

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_PROCESS_H_
