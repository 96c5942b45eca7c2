// The one temp directory helper of the tests and benchmarks: a fresh empty
// directory that is removed, with everything in it, when the object goes
// out of scope, whether the test passed or failed (an ASSERT_* that returns
// early still runs the destructor). With LEAP_KEEP_TEST_DIRS=1 in the
// environment the directory is kept and its path printed to stderr, for
// looking at a failed test's data afterwards.
//
// Declare it BEFORE the leapd / nats-server processes that use it, so that
// those are stopped (their destructors run first) before it is removed.
//
// A test killed before its destructors run (a ctest timeout, kill -9)
// cannot remove its folder, so each folder holds an owner file,
// .leap-test-owner ("<pid> <start time> <pid namespace>" of the process
// that made it), and
// the first ScopedTempDir a process makes sweeps the base folder: every
// <name>-<pid>-XXXXXX folder (and the Python tests' <name>-<pid>-XXXXXXXX,
// tests/support/temp_dirs.py) whose owner file names a process that is no
// longer running (no such pid, a zombie, or a pid reused by a process
// started at another time) is removed; only the owners of the sweeper's own pid
// namespace are judged. Folders without an owner file (anything not
// made here, and folders kept with LEAP_KEEP_TEST_DIRS=1, whose owner file
// is removed when they are kept) are never touched; with
// LEAP_KEEP_TEST_DIRS=1 nothing is swept.
//
// Header only and without gtest, so benchmarks and tools can use it too.
#ifndef LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_
#define LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace leap::testing {

class ScopedTempDir {
 public:
  // <base>/<name>-<pid>-XXXXXX, base being $TEST_TMPDIR, else $TMPDIR, else
  // /tmp. Aborts the process when the directory cannot be made (nothing a
  // test could do without it).
  explicit ScopedTempDir(const std::string& name) {
    const std::string base = Base();
    // Once per process: folders of killed tests go before a new one comes.
    static const int swept = KeepRequested() ? 0 : SweepDeadOwners(base);
    (void)swept;
    std::string tmpl =
        base + "/" + name + "-" + std::to_string(::getpid()) + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {
      std::fprintf(stderr, "ScopedTempDir: mkdtemp %s: %s\n", tmpl.c_str(),
                   std::strerror(errno));
      std::abort();
    }
    path_ = buf.data();
    std::ofstream owner(File(kOwnerFile));
    owner << ::getpid() << " " << StartTime(::getpid()) << " " << PidNamespace() << "\n";
    if (!owner.flush()) {
      std::fprintf(stderr, "ScopedTempDir: cannot write %s\n", File(kOwnerFile).c_str());
      std::abort();
    }
  }
  ~ScopedTempDir() {
    if (path_.empty()) return;
    if (KeepRequested()) {
      ::unlink(File(kOwnerFile).c_str());  // kept: never swept later
      std::fprintf(stderr, "LEAP_KEEP_TEST_DIRS=1: kept %s\n", path_.c_str());
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    if (ec) {
      std::fprintf(stderr, "ScopedTempDir: removing %s: %s\n", path_.c_str(),
                   ec.message().c_str());
    }
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  const std::string& path() const { return path_; }
  // Path of `name` inside the directory.
  std::string File(const std::string& name) const { return path_ + "/" + name; }

  static bool KeepRequested() {
    const char* v = ::getenv("LEAP_KEEP_TEST_DIRS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }

  // The owner file in every folder made here.
  static constexpr const char* kOwnerFile = ".leap-test-owner";

  // $TEST_TMPDIR, else $TMPDIR, else /tmp, without trailing slashes.
  static std::string Base() {
    std::string base = "/tmp";
    for (const char* var : {"TEST_TMPDIR", "TMPDIR"}) {
      const char* v = ::getenv(var);
      if (v != nullptr && *v != '\0') {
        base = v;
        break;
      }
    }
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    return base;
  }

  // This process's pid namespace ("pid:[N]"): a pid is judged only by a
  // process of the namespace that recorded it (a /tmp shared between
  // containers holds folders whose owners this one cannot see).
  static std::string PidNamespace() {
    std::error_code ec;
    const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
    return ec || ns.empty() ? "-" : ns;
  }

  // Field 22 of /proc/PID/stat (start time in clock ticks since boot);
  // "" when the process does not exist. A zombie (state Z: dead, not yet
  // reaped, e.g. a killed test reparented to an init that does not reap)
  // has none either.
  static std::string StartTime(pid_t pid) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');  // the command name may hold spaces
    if (paren == std::string::npos) return "";
    std::istringstream rest(stat.substr(paren + 1));
    std::string field;
    for (int i = 3; i <= 22 && (rest >> field); ++i) {
      if (i == 3 && field == "Z") return "";
      if (i == 22) return field;
    }
    return "";
  }

  // Removes every <name>-<pid>-XXXXXX folder under `base` whose owner file
  // names a process that is no longer running; returns how many.
  static int SweepDeadOwners(const std::string& base) {
    int removed = 0;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(base, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string folder = it->path().filename().string();
      // <name>-<pid>-XXXXXX (XXXXXXXX from temp_dirs.py): the pid is the
      // digits between the last two '-'.
      const size_t last = folder.rfind('-');
      if (last == std::string::npos || last == 0 || folder.size() - last < 7 ||
          folder.size() - last > 9) {
        continue;
      }
      const size_t prev = folder.rfind('-', last - 1);
      if (prev == std::string::npos || prev + 1 == last) continue;
      const std::string pid_text = folder.substr(prev + 1, last - prev - 1);
      if (pid_text.find_first_not_of("0123456789") != std::string::npos ||
          pid_text.size() > 9) {
        continue;
      }
      struct stat st;
      if (::lstat(it->path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
      std::ifstream owner(it->path() / kOwnerFile);
      std::string owner_pid, owner_start, owner_ns;
      if (!(owner >> owner_pid >> owner_start >> owner_ns) || owner_pid != pid_text ||
          owner_ns != PidNamespace()) {
        continue;  // not ours, or a pid this process cannot judge
      }
      const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
      // Gone: no such process, a zombie, or the pid reused by a process
      // started at another time.
      if (StartTime(pid) == owner_start) continue;
      std::error_code rm;
      std::filesystem::remove_all(it->path(), rm);
      if (!rm) {
        ++removed;
        std::fprintf(stderr, "ScopedTempDir: removed %s, left by process %s (no longer running)\n",
                     it->path().c_str(), pid_text.c_str());
      }
    }
    return removed;
  }

 private:
  std::string path_;
};

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_
