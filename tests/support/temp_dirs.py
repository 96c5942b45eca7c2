"""Temp folders of the Python tests, with the same rules as the C++ tests'
ScopedTempDir (tests/support/scoped_temp_dir.h): made by make() under
$TEST_TMPDIR, else $TMPDIR, else /tmp, as <name>-<pid>-XXXXXXXX with an owner
file (.leap-test-owner: "<pid> <start time> <pid namespace>"); removed by remove() when the
test ends, kept (the path printed to stderr, the owner file removed) with
LEAP_KEEP_TEST_DIRS=1.

A test killed before its clean-ups ran (a ctest timeout, kill -9) leaves
its folder: the first make() of a process removes every such folder whose
owner process is no longer running (C++ and Python folders alike; only
owners of the sweeper's pid namespace; never a folder without an owner
file; nothing with LEAP_KEEP_TEST_DIRS=1)."""

import os
import re
import shutil
import sys
import tempfile

OWNER_FILE = ".leap-test-owner"
_FOLDER = re.compile(r"^.+-([0-9]{1,9})-[^-]{6,8}$")  # 6: C++, 8: Python
_swept = False


def _keep():
    return os.environ.get("LEAP_KEEP_TEST_DIRS") == "1"


def base():
    """$TEST_TMPDIR, else $TMPDIR, else /tmp."""
    for var in ("TEST_TMPDIR", "TMPDIR"):
        v = os.environ.get(var)
        if v:
            return v.rstrip("/") or "/"
    return "/tmp"


def start_time(pid):
    """Field 22 of /proc/PID/stat; '' when the process does not exist or is
    a zombie (dead, not yet reaped)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 1:].split()
    if len(fields) < 20 or fields[0] == "Z":
        return ""
    return fields[19]


def pid_namespace():
    """This process's pid namespace ("pid:[N]"); a pid is judged only by a
    process of the namespace that recorded it."""
    try:
        return os.readlink("/proc/self/ns/pid") or "-"
    except OSError:
        return "-"


def sweep(where=None):
    """Removes every <name>-<pid>-XXXXXX(XX) folder under `where` (default:
    base()) whose owner file names a process no longer running; returns
    their paths."""
    where = where or base()
    removed = []
    try:
        names = os.listdir(where)
    except OSError:
        return removed
    for name in names:
        m = _FOLDER.match(name)
        path = os.path.join(where, name)
        if not m or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = f.read().split()
        except OSError:
            continue
        if len(owner) != 3 or owner[0] != m.group(1) or owner[2] != pid_namespace():
            continue
        if start_time(int(owner[0])) == owner[1]:
            continue  # running: no such process, a zombie or a reused pid is not
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            print("temp_dirs: removed %s, left by process %s (no longer running)"
                  % (path, owner[0]), file=sys.stderr)
    return removed


def make(name):
    """A fresh folder <base>/<name>-<pid>-XXXXXXXX with its owner file; the
    first call of a process sweeps the folders of dead owners first."""
    global _swept
    if not _swept and not _keep():
        sweep()
    _swept = True
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix="%s-%d-" % (name, pid), dir=base())
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write("%d %s %s\n" % (pid, start_time(pid), pid_namespace()))
    return path


def remove(path):
    """Removes `path` and everything in it, or keeps it and says so when
    LEAP_KEEP_TEST_DIRS=1. Call it after the children using it stopped."""
    if _keep():
        try:
            os.unlink(os.path.join(path, OWNER_FILE))  # kept: never swept
        except OSError:
            pass
        print("LEAP_KEEP_TEST_DIRS=1: kept " + path, file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)
