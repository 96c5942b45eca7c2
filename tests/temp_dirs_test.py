#!/usr/bin/python3
"""tests/support/temp_dirs.py with real processes: a Python child makes a
folder with temp_dirs.make() and is killed with SIGKILL (what a ctest
timeout does); the next make() of another process removes it, and a folder
in the C++ helper's form (<name>-<pid>-XXXXXX) of a dead owner too, while a
running owner's folder, a folder without an owner file, an owner of another
pid namespace and a folder kept with LEAP_KEEP_TEST_DIRS=1 stay.

Run: /usr/bin/python3 tests/temp_dirs_test.py
"""

import os
import signal
import subprocess
import sys
import unittest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
sys.path.insert(0, SUPPORT)
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)

DEADLINE_S = 30.0
# A child that makes a folder, prints it, then waits for a signal ("hold")
# or removes it and ends ("make").
CHILD = """
import os, signal, sys
sys.path.insert(0, %r)
import temp_dirs
path = temp_dirs.make(sys.argv[2])
print(path, flush=True)
if sys.argv[1] == "hold":
    signal.pause()
temp_dirs.remove(path)
""" % SUPPORT


class TempDirsTest(unittest.TestCase):

    def setUp(self):
        self.base = temp_dirs.make("temp_dirs_test")
        self.addCleanup(temp_dirs.remove, self.base)
        self.env = dict(os.environ, TEST_TMPDIR=self.base, LEAP_KEEP_TEST_DIRS="0")

    def spawn(self, role, name, env=None):
        p = subprocess.Popen([sys.executable, "-c", CHILD, role, name],
                             stdout=subprocess.PIPE, text=True, env=env or self.env)
        path = p.stdout.readline().strip()
        self.assertTrue(path.startswith(self.base + "/%s-%d-" % (name, p.pid)), path)
        return p, path

    def kill9(self, p):
        p.kill()
        self.assertEqual(p.wait(timeout=DEADLINE_S), -signal.SIGKILL)
        p.stdout.close()

    def test_folders_of_killed_processes_are_swept(self):
        victim, victim_path = self.spawn("hold", "victim")
        with open(os.path.join(victim_path, "data"), "w") as f:
            f.write("left behind")
        self.kill9(victim)
        self.assertTrue(os.path.isdir(victim_path), "a killed test cannot clean up")
        alive, alive_path = self.spawn("hold", "alive")
        self.addCleanup(lambda: alive.poll() is None and self.kill9(alive))
        # The C++ helper's form of a folder (6-character suffix), dead owner.
        cxx = os.path.join(self.base, "cxx-%d-abcdef" % victim.pid)
        os.mkdir(cxx)
        with open(os.path.join(cxx, temp_dirs.OWNER_FILE), "w") as f:
            f.write("%d 1 %s\n" % (victim.pid, temp_dirs.pid_namespace()))
        # A dead pid of another pid namespace: not judged, it stays.
        other_ns = os.path.join(self.base, "otherns-%d-abcdef" % victim.pid)
        os.mkdir(other_ns)
        with open(os.path.join(other_ns, temp_dirs.OWNER_FILE), "w") as f:
            f.write("%d 1 pid:[1]\n" % victim.pid)
        foreign = os.path.join(self.base, "foreign-%d-abcdef" % victim.pid)
        os.mkdir(foreign)
        keeper, kept = self.spawn("make", "kept",
                                  dict(self.env, LEAP_KEEP_TEST_DIRS="1"))
        self.assertEqual(keeper.wait(timeout=DEADLINE_S), 0)
        keeper.stdout.close()
        self.assertFalse(os.path.exists(os.path.join(kept, temp_dirs.OWNER_FILE)))

        # Another process's first make() sweeps.
        maker, made = self.spawn("make", "maker")
        self.assertEqual(maker.wait(timeout=DEADLINE_S), 0)
        maker.stdout.close()
        self.assertFalse(os.path.exists(made), "its own folder is removed at its end")
        self.assertFalse(os.path.exists(victim_path), "the killed child's folder is swept")
        self.assertFalse(os.path.exists(cxx), "a C++ folder of a dead owner is swept")
        self.assertTrue(os.path.isdir(alive_path), "a running owner's folder stays")
        self.assertTrue(os.path.isdir(foreign), "a folder without an owner file stays")
        self.assertTrue(os.path.isdir(other_ns), "another pid namespace's folder stays")
        self.assertTrue(os.path.isdir(kept), "a kept folder stays")

        # The sweep, called directly: the owner killed now goes too, while
        # it is still a zombie (killed, not reaped).
        alive.kill()
        os.waitid(os.P_PID, alive.pid, os.WEXITED | os.WNOWAIT)
        self.assertEqual(temp_dirs.sweep(self.base), [alive_path])
        self.assertEqual(alive.wait(timeout=DEADLINE_S), -signal.SIGKILL)
        alive.stdout.close()


if __name__ == "__main__":
    unittest.main()
