// Child processes: the one launcher of leapd (and other tools) for the replay
// simulator, the tests and the benchmarks. A child is started with
// fork/exec; a reader thread drains its stdout into lines from the start (so
// a chatty child never blocks on a full pipe), which WaitForLine consumes in
// order. stderr is inherited (failures show in the test log) unless merged
// into the lines. The destructor stops and reaps the child.
#ifndef LEAP_CLIENT_PROCESS_H_
#define LEAP_CLIENT_PROCESS_H_

#include <sys/types.h>

#include <cstddef>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace leap::client {

struct ProcessOptions {
  // stderr into the same lines as stdout (else inherited). Default: false
  bool merge_stderr = false;
  // The child gets SIGTERM when this process dies (PR_SET_PDEATHSIG:
  // strictly, when the thread that called Start ends, so start such a child
  // from a thread that lives as long as it should). Default: false
  bool die_with_parent = false;
  // Lines kept for lines() and Tail(), the oldest dropped first; 0 keeps
  // every line. Default: 0
  size_t kept_lines = 0;
  // How the destructor stops a running child: zero sends SIGKILL at once;
  // otherwise SIGTERM, then SIGKILL when its output has not ended within
  // this long. Default: zero
  absl::Duration stop_grace = absl::ZeroDuration();
};

// One child process. WaitForLine, lines, Tail, Signal and Wait may be called
// from one thread at a time (the reader thread is internal).
class Process {
 public:
  // Starts argv[0] (a path) with the given arguments.
  static absl::StatusOr<std::unique_ptr<Process>> Start(
      const std::vector<std::string>& argv, ProcessOptions options = {});
  // Stops (see ProcessOptions::stop_grace) and reaps the child if it is
  // still running.
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  // Reads output until a line starting with `prefix`, after the lines
  // earlier calls consumed; returns the rest of that line.
  // DeadlineExceeded after `timeout`, NotFound at the end of the output.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix,
                                          absl::Duration timeout);
  // Every output line read so far (the last kept_lines with a limit).
  std::vector<std::string> lines() const;
  // lines() joined with " | ".
  std::string Tail() const;
  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits for exit; returns the raw wait status (see WIFEXITED etc.).
  int Wait();

 private:
  explicit Process(ProcessOptions options) : options_(options) {}
  void ReadLoop();

  const ProcessOptions options_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::deque<std::string> lines_ ABSL_GUARDED_BY(mu_);
  // Lines dropped from the front of lines_ (kept_lines), and the index
  // (counting dropped ones) of the next line WaitForLine looks at.
  size_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
};

// The program `name` beside the running executable: `name` in its folder
// (an installation), then in each of `build_tree_dirs`, taken relative to
// that folder (a build tree, e.g. "../../sidecar"), then on PATH.
// NotFound "cannot find NAME (tried A, B, PATH)".
absl::StatusOr<std::string> FindProgram(
    const std::string& name, const std::vector<std::string>& build_tree_dirs);

// Runs argv[0] to its end with stdout and stderr captured.
struct ProcessResult {
  // The raw wait status (see WIFEXITED etc.).
  int status = 0;
  std::string out;
  std::string err;
};
absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv);

// Starts leapd at `leapd_path` with `args` plus --listen=127.0.0.1:0
// --metrics_listen=127.0.0.1:0 unless given, and waits for "listening on
// ADDR" and "leapd ID ready". `address` (may be null) receives ADDR.
absl::StatusOr<std::unique_ptr<Process>> StartLeapd(
    const std::string& leapd_path, std::vector<std::string> args,
    std::string* address, absl::Duration timeout = absl::Seconds(30),
    ProcessOptions options = {});

}  // namespace leap::client

#endif  // LEAP_CLIENT_PROCESS_H_
