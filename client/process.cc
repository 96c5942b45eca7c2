#include "tests/support/process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace leap::testing {

absl::StatusOr<std::unique_ptr<Process>> Process::Start(
    const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  auto p = std::unique_ptr<Process>(new Process());
  p->pid_ = pid;
  p->out_fd_ = fds[0];
  return p;
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    Wait();
  }
  if (out_fd_ >= 0) close(out_fd_);
}

absl::StatusOr<std::string> Process::WaitForLine(const std::string& prefix,
                                                 absl::Duration timeout) {
  const auto deadline = absl::Now() + timeout;
  for (;;) {
    size_t nl;
    while ((nl = buffer_.find('\n')) != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      lines_.push_back(line);
      if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    }
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line starting with '", prefix, "' within ",
                       absl::FormatDuration(timeout), "; got: ",
                       absl::StrJoin(lines_, " | ")));
    }
    pollfd pfd{out_fd_, POLLIN, 0};
    const int r = poll(&pfd, 1, static_cast<int>(left_ms));
    if (r < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("poll: ", std::strerror(errno)));
    }
    if (r <= 0) continue;
    char buf[4096];
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n == 0) {
      return absl::NotFoundError(absl::StrCat(
          "process exited before printing '", prefix,
          "'; got: ", absl::StrJoin(lines_, " | ")));
    }
    if (n > 0) buffer_.append(buf, n);
  }
}

void Process::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

int Process::Wait() {
  int status = 0;
  if (reaped_) return 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
  return status;
}

absl::StatusOr<std::string> HttpGet(const std::string& host_port,
                                    const std::string& path) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError("expected host:port");
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(host_port.substr(colon + 1))));
  if (inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError("expected an IPv4 host");
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("connect ", host_port, ": ",
                                               std::strerror(errno)));
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ",
                                       host_port, "\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::InternalError("short write");
  }
  std::string resp;
  char buf[8192];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) resp.append(buf, n);
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.", 0) != 0 || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("bad HTTP response: ", resp.substr(0, 80)));
  }
  return resp.substr(body + 4);
}

absl::StatusOr<std::unique_ptr<Process>> StartLeapd(
    const std::string& leapd_path, std::vector<std::string> args,
    std::string* address, absl::Duration timeout) {
  bool has_listen = false, has_metrics = false;
  for (const auto& a : args) {
    has_listen |= a.rfind("--listen", 0) == 0;
    has_metrics |= a.rfind("--metrics_listen", 0) == 0;
  }
  std::vector<std::string> argv = {leapd_path};
  if (!has_listen) argv.push_back("--listen=127.0.0.1:0");
  if (!has_metrics) argv.push_back("--metrics_listen=127.0.0.1:0");
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = Process::Start(argv);
  if (!p.ok()) return p.status();
  auto addr = (*p)->WaitForLine("listening on ", timeout);
  if (!addr.ok()) return addr.status();
  if (address != nullptr) *address = *addr;
  auto ready = (*p)->WaitForLine("leapd ", timeout);  // after 'metrics on'
  if (!ready.ok()) return ready.status();
  return p;
}

}  // namespace leap::testing
