"""Generates the Python gRPC stubs of proto/leap/v1 for the Python tests
(grpc_tools.protoc at test time: the build installs no Python stubs).
Test-only."""

import importlib
import subprocess
import sys

import temp_dirs  # tests/support/temp_dirs.py (same folder)

_MODULES = ("predictor_pb2", "predictor_pb2_grpc", "admin_pb2", "admin_pb2_grpc")


def generate(proto_dir, prefix):
    """Compiles predictor.proto and admin.proto into a new temporary
    directory (the caller removes it) put first on sys.path; returns
    (directory, {module name: module})."""
    out = temp_dirs.make(prefix.rstrip("_"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I" + proto_dir,
         "--python_out=" + out, "--grpc_python_out=" + out,
         "leap/v1/predictor.proto", "leap/v1/admin.proto"],
        check=True)
    sys.path.insert(0, out)
    return out, {name: importlib.import_module("leap.v1." + name)
                 for name in _MODULES}
