"""Temp folders of the Python tests, with the same rule as the C++ tests'
ScopedTempDir (tests/support/scoped_temp_dir.h): removed when the test ends,
kept (and the path printed to stderr) with LEAP_KEEP_TEST_DIRS=1."""

import os
import shutil
import sys


def remove(path):
    """Removes `path` and everything in it, or keeps it and says so when
    LEAP_KEEP_TEST_DIRS=1. Call it after the children using it stopped."""
    if os.environ.get("LEAP_KEEP_TEST_DIRS") == "1":
        print("LEAP_KEEP_TEST_DIRS=1: kept " + path, file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)
