"""The command line and the unittest run shared by the Python tests
(tests/python_*_test.py), and the import of the built leap_shim module.
Test-only."""

import argparse
import importlib
import sys
import unittest

_HELP = {
    "leapd": "path to leapd",
    "proto-dir": "directory holding leap/v1/*.proto",
    "module-dir": "directory holding the built leap_shim module",
}


def parse_args(doc, *flags):
    """Parses the required --FLAG of each of `flags` (names in _HELP); the
    test's docstring `doc` gives the description. Returns the namespace
    (ARGS); what is left of sys.argv is kept there for run()."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    for flag in flags:
        parser.add_argument("--" + flag, required=True, help=_HELP[flag])
    args, rest = parser.parse_known_args()
    sys.argv[1:] = rest
    return args


def run():
    """Runs the unittest cases of __main__ with the arguments parse_args
    left (e.g. -k NAME); exits 0 when they all passed, else 1."""
    result = unittest.main(argv=sys.argv, exit=False, verbosity=2)
    sys.exit(0 if result.result.wasSuccessful() else 1)


def import_leap_shim(module_dir):
    """The leap_shim module built in `module_dir`."""
    sys.path.insert(0, module_dir)
    return importlib.import_module("leap_shim")
