#include "client/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace leap::client {
namespace {

// Reads `fd` to its end into `out` (EINTR retried).
void ReadAll(int fd, std::string* out) {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    out->append(buf, static_cast<size_t>(n));
  }
}

int WaitPid(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Process>> Process::Start(
    const std::vector<std::string>& argv, ProcessOptions options) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    if (options.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);  // the parent died before prctl
    }
    dup2(fds[1], STDOUT_FILENO);
    if (options.merge_stderr) dup2(fds[1], STDERR_FILENO);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  std::unique_ptr<Process> p(new Process(options));
  p->pid_ = pid;
  p->out_fd_ = fds[0];
  p->reader_ = std::thread([raw = p.get()] { raw->ReadLoop(); });
  return p;
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    bool ended = false;
    if (options_.stop_grace > absl::ZeroDuration()) {
      kill(pid_, SIGTERM);
      // Its output pipe closes when it exits: wait on that, then reap.
      absl::MutexLock lock(&mu_);
      ended = mu_.AwaitWithTimeout(absl::Condition(&eof_), options_.stop_grace);
    }
    if (!ended) kill(pid_, SIGKILL);
    Wait();
  }
  if (reader_.joinable()) reader_.join();
  if (out_fd_ >= 0) close(out_fd_);
}

void Process::ReadLoop() {
  std::string buffer;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buffer.append(buf, static_cast<size_t>(n));
    size_t nl;
    absl::MutexLock lock(&mu_);
    while ((nl = buffer.find('\n')) != std::string::npos) {
      lines_.push_back(buffer.substr(0, nl));
      buffer.erase(0, nl + 1);
      if (options_.kept_lines > 0 && lines_.size() > options_.kept_lines) {
        lines_.pop_front();
        ++dropped_;
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (!buffer.empty()) lines_.push_back(buffer);
  eof_ = true;
}

absl::StatusOr<std::string> Process::WaitForLine(const std::string& prefix,
                                                 absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (next_ < dropped_) next_ = dropped_;
    while (next_ - dropped_ < lines_.size()) {
      const std::string& line = lines_[next_ - dropped_];
      ++next_;
      if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    }
    if (eof_) {
      return absl::NotFoundError(absl::StrCat(
          "process exited before printing '", prefix,
          "'; got: ", absl::StrJoin(lines_, " | ")));
    }
    const auto more = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return eof_ || next_ < dropped_ + lines_.size();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&more), deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line starting with '", prefix, "' within ",
                       absl::FormatDuration(timeout), "; got: ",
                       absl::StrJoin(lines_, " | ")));
    }
  }
}

std::vector<std::string> Process::lines() const {
  absl::MutexLock lock(&mu_);
  return std::vector<std::string>(lines_.begin(), lines_.end());
}

std::string Process::Tail() const {
  absl::MutexLock lock(&mu_);
  return absl::StrJoin(lines_, " | ");
}

void Process::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

int Process::Wait() {
  if (reaped_) return status_;
  status_ = WaitPid(pid_);
  reaped_ = true;
  return status_;
}

absl::StatusOr<ProcessResult> RunProcess(const std::vector<std::string>& argv) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  ProcessResult r;
  // Both pipes drained at once: a child filling one never blocks.
  std::thread err_reader([&] { ReadAll(err[0], &r.err); });
  ReadAll(out[0], &r.out);
  err_reader.join();
  close(out[0]);
  close(err[0]);
  r.status = WaitPid(pid);
  return r;
}

absl::StatusOr<std::unique_ptr<Process>> StartLeapd(
    const std::string& leapd_path, std::vector<std::string> args,
    std::string* address, absl::Duration timeout, ProcessOptions options) {
  bool has_listen = false, has_metrics = false;
  for (const auto& a : args) {
    has_listen |= a.rfind("--listen", 0) == 0;
    has_metrics |= a.rfind("--metrics_listen", 0) == 0;
  }
  std::vector<std::string> argv = {leapd_path};
  if (!has_listen) argv.push_back("--listen=127.0.0.1:0");
  if (!has_metrics) argv.push_back("--metrics_listen=127.0.0.1:0");
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = Process::Start(argv, options);
  if (!p.ok()) return p.status();
  auto addr = (*p)->WaitForLine("listening on ", timeout);
  if (!addr.ok()) return addr.status();
  if (address != nullptr) *address = *addr;
  auto ready = (*p)->WaitForLine("leapd ", timeout);  // after 'metrics on'
  if (!ready.ok()) return ready.status();
  return p;
}

absl::StatusOr<std::string> FindProgram(
    const std::string& name, const std::vector<std::string>& build_tree_dirs) {
  std::vector<std::string> tried;
  std::error_code ec;
  const std::filesystem::path self =
      std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path dir = self.parent_path();
    std::vector<std::filesystem::path> places = {dir / name};
    for (const std::string& d : build_tree_dirs) places.push_back(dir / d / name);
    for (const std::filesystem::path& p : places) {
      const std::string s = p.lexically_normal().string();
      tried.push_back(s);
      if (access(s.c_str(), X_OK) == 0) return s;
    }
  }
  if (const char* path = getenv("PATH"); path != nullptr) {
    for (absl::string_view d : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      const std::string s = absl::StrCat(d, "/", name);
      if (access(s.c_str(), X_OK) == 0) return s;
    }
    tried.push_back("PATH");
  }
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " (tried ",
                                          absl::StrJoin(tried, ", "), ")"));
}

}  // namespace leap::client
