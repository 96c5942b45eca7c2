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
// Header only and without gtest, so benchmarks and tools can use it too.
#ifndef LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_
#define LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_

#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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
    std::string base = "/tmp";
    for (const char* var : {"TEST_TMPDIR", "TMPDIR"}) {
      const char* v = ::getenv(var);
      if (v != nullptr && *v != '\0') {
        base = v;
        break;
      }
    }
    while (base.size() > 1 && base.back() == '/') base.pop_back();
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
  }
  ~ScopedTempDir() {
    if (path_.empty()) return;
    if (KeepRequested()) {
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

 private:
  std::string path_;
};

}  // namespace leap::testing

#endif  // LEAP_TESTS_SUPPORT_SCOPED_TEMP_DIR_H_
