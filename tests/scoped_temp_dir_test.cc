// ScopedTempDir's sweep of folders left by killed tests, with real
// processes: this binary re-runs itself (/proc/self/exe) as a child that
// makes a folder and is then killed with SIGKILL (what a ctest timeout
// does), or that makes a folder and ends normally (its first ScopedTempDir
// sweeps). The folder of a killed child is gone after the next process made
// its first folder; folders of live processes, folders without an owner
// file (foreign ones, kept ones) stay; a pid reused by a process started at
// another time does not protect a dead owner's folder; an owner of another
// pid namespace is not judged; the Python tests' folders
// (tests/support/temp_dirs.py) are swept alike.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/scoped_temp_dir.h"

namespace {

namespace fs = std::filesystem;
using ::leap::testing::ScopedTempDir;

constexpr const char* kRoleVar = "LEAP_SCOPED_TEMP_DIR_TEST_ROLE";

// The child roles, run before gtest when kRoleVar is set: "hold" makes a
// folder, prints its path and waits to be killed; "make" makes a folder,
// prints its path and ends normally (the destructor runs).
struct ChildRole {
  ChildRole() {
    const char* role = ::getenv(kRoleVar);
    if (role == nullptr) return;
    const std::string r = role;
    if (r != "hold" && r != "make") std::_Exit(3);
    {
      ScopedTempDir dir(r == "hold" ? "victim" : "maker");
      std::printf("%s\n", dir.path().c_str());
      std::fflush(stdout);
      if (r == "hold") {
        for (;;) ::pause();  // until SIGKILL
      }
    }
    std::_Exit(0);
  }
} child_role;

struct Child {
  pid_t pid = -1;
  std::string path;  // the folder it made
};

// Starts this binary as `role` with `env` added; returns once the child
// printed its folder (read from its stdout: no sleeping).
Child Spawn(const std::string& role, const std::vector<std::string>& env) {
  int out[2];
  if (::pipe(out) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    ::close(out[1]);
    ::setenv(kRoleVar, role.c_str(), 1);
    for (const std::string& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
    ::execl("/proc/self/exe", "scoped_temp_dir_test", static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  ::close(out[1]);
  Child c;
  c.pid = pid;
  char ch;
  while (::read(out[0], &ch, 1) == 1 && ch != '\n') c.path.push_back(ch);
  ::close(out[0]);
  return c;
}

int Wait(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

void Kill9(pid_t pid) {
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const int status = Wait(pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
}

// Runs a "make" child to completion: its first ScopedTempDir sweeps.
void Sweep(const std::vector<std::string>& env) {
  Child c = Spawn("make", env);
  ASSERT_FALSE(c.path.empty());
  const int status = Wait(c.pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_FALSE(fs::exists(c.path)) << "its own folder is removed at its end";
}

TEST(ScopedTempDirTest, FoldersOfKilledTestsAreSweptByTheNextProcess) {
  ScopedTempDir root("scoped_temp_dir_test");
  const std::string base = root.File("base");
  ASSERT_TRUE(fs::create_directory(base));
  const std::vector<std::string> env = {"TEST_TMPDIR=" + base, "LEAP_KEEP_TEST_DIRS=0"};

  // A test killed with SIGKILL leaves its folder, with its owner file.
  Child victim = Spawn("hold", env);
  ASSERT_FALSE(victim.path.empty());
  EXPECT_EQ(fs::path(victim.path).parent_path(), fs::path(base));
  EXPECT_NE(victim.path.find("victim-" + std::to_string(victim.pid) + "-"), std::string::npos)
      << victim.path;
  ASSERT_TRUE(fs::exists(fs::path(victim.path) / ScopedTempDir::kOwnerFile));
  std::ofstream(fs::path(victim.path) / "data") << "left behind";
  Kill9(victim.pid);
  ASSERT_TRUE(fs::exists(victim.path)) << "a killed test cannot clean up";

  // A folder of the Python tests' form (temp_dirs.py: 8-character suffix)
  // whose owner was killed too.
  const std::string python_form =
      base + "/py-" + std::to_string(victim.pid) + "-abcdefgh";
  ASSERT_TRUE(fs::create_directory(python_form));
  std::ofstream(fs::path(python_form) / ScopedTempDir::kOwnerFile)
      << victim.pid << " 1 " << ScopedTempDir::PidNamespace() << "\n";
  // A dead pid of another pid namespace (a /tmp shared with a container):
  // this process cannot judge it, it stays.
  const std::string other_ns = base + "/otherns-" + std::to_string(victim.pid) + "-abcdef";
  ASSERT_TRUE(fs::create_directory(other_ns));
  std::ofstream(fs::path(other_ns) / ScopedTempDir::kOwnerFile)
      << victim.pid << " 1 pid:[1]\n";

  // A running test's folder.
  Child alive = Spawn("hold", env);
  ASSERT_FALSE(alive.path.empty());
  // A folder named like ours for a dead pid, but without an owner file.
  const std::string foreign =
      base + "/foreign-" + std::to_string(victim.pid) + "-abcdef";
  ASSERT_TRUE(fs::create_directory(foreign));
  // An owner file naming a live pid (this process) with another start time:
  // that pid was reused, the owner is gone.
  const std::string reused = base + "/reused-" + std::to_string(::getpid()) + "-abcdef";
  ASSERT_TRUE(fs::create_directory(reused));
  std::ofstream(fs::path(reused) / ScopedTempDir::kOwnerFile)
      << ::getpid() << " 1 " << ScopedTempDir::PidNamespace() << "\n";
  // A folder kept with LEAP_KEEP_TEST_DIRS=1 (its maker ended normally).
  Child kept = Spawn("make", {"TEST_TMPDIR=" + base, "LEAP_KEEP_TEST_DIRS=1"});
  ASSERT_EQ(Wait(kept.pid), 0);
  ASSERT_TRUE(fs::exists(kept.path));
  EXPECT_FALSE(fs::exists(fs::path(kept.path) / ScopedTempDir::kOwnerFile));

  Sweep(env);
  EXPECT_FALSE(fs::exists(victim.path)) << "the killed test's folder is swept";
  EXPECT_FALSE(fs::exists(reused)) << "a reused pid does not keep it";
  EXPECT_FALSE(fs::exists(python_form)) << "a Python test's folder is swept too";
  EXPECT_TRUE(fs::exists(alive.path)) << "a running test's folder stays";
  EXPECT_TRUE(fs::exists(foreign)) << "a folder without an owner file stays";
  EXPECT_TRUE(fs::exists(other_ns)) << "another pid namespace's folder stays";
  EXPECT_TRUE(fs::exists(kept.path)) << "a kept folder stays";

  // With LEAP_KEEP_TEST_DIRS=1 nothing is swept, not even a dead owner's.
  // The owner killed now is left a zombie (killed, not reaped: what a test
  // reparented to an init that does not reap looks like): dead all the same.
  ASSERT_EQ(::kill(alive.pid, SIGKILL), 0);
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, alive.pid, &info, WEXITED | WNOWAIT), 0);
  Child keeper = Spawn("make", {"TEST_TMPDIR=" + base, "LEAP_KEEP_TEST_DIRS=1"});
  ASSERT_EQ(Wait(keeper.pid), 0);
  EXPECT_TRUE(fs::exists(alive.path));
  // The next process without it sweeps the killed one.
  Sweep(env);
  EXPECT_FALSE(fs::exists(alive.path)) << "a zombie owner is not running";
  Wait(alive.pid);
  EXPECT_TRUE(fs::exists(foreign));
  EXPECT_TRUE(fs::exists(kept.path));
}

}  // namespace
