#!/usr/bin/python3
"""A second leapd client, in Python: Debian's python3-grpcio with stubs
generated from proto/ at test time (python3-grpc-tools).

Each test starts its own leapd (port 0, --rls_batch=1) and ends it with
SIGTERM, expecting exit code 0.
  - Predict / Complete / WatchReadout: a cold-start readout predicts exactly
    1 token (score 0); three STOP completions publish versions 2.. that the
    WatchReadout stream pushes in order; the pushed weights equal the FP64
    ridge closed form over the learned completions, and a later Predict
    scores with exactly those weights.
  - Bad input: wrong feature size (INVALID_ARGUMENT naming expected and got),
    unspecified dtype, negative token count, a duplicate id, a completion
    for an unknown id (NOT_FOUND); none of them changes the readout.

Run: /usr/bin/python3 tests/python_client_test.py --leapd PATH --proto-dir DIR
"""

import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import unittest

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import leapd_lines  # noqa: E402  (tests/support/leapd_lines.py)
import proto_stubs  # noqa: E402  (tests/support/proto_stubs.py)
import test_main  # noqa: E402  (tests/support/test_main.py)

ARGS = None  # parsed command line (set in main)
PB = {}  # generated modules: predictor_pb2, predictor_pb2_grpc, admin_...
STUB_DIR = None

DIM = 16
LAMBDA = 1.0
BUDGET = 2048  # the cold start's default output budget M
READOUT = "py"
DEADLINE_S = 30.0


def setUpModule():
    """Generates the Python stubs from proto/ into a temporary directory."""
    global STUB_DIR
    STUB_DIR, stubs = proto_stubs.generate(ARGS.proto_dir, "leap_py_stubs_")
    PB.update(stubs)


def tearDownModule():
    if STUB_DIR is not None:
        shutil.rmtree(STUB_DIR, ignore_errors=True)


class Leapd:
    """A leapd child process on 127.0.0.1:0; its stdout is read by a thread
    so waiting for a line has a deadline."""

    def __init__(self, extra_args):
        self.proc = subprocess.Popen(
            [ARGS.leapd, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"]
            + extra_args,
            stdout=subprocess.PIPE, text=True)
        self.lines = leapd_lines.StdoutLines(self.proc, DEADLINE_S)
        self.address = self.wait_for_line("listening on ")
        self.wait_for_line("leapd ")  # "leapd <id> ready"
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=DEADLINE_S)

    def wait_for_line(self, prefix):
        return self.lines.wait_for(prefix)

    def terminate(self):
        """SIGTERM; returns the exit code."""
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=DEADLINE_S)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def pack_f32(values):
    """dim float32 values, little-endian, packed."""
    return struct.pack("<%df" % len(values), *values)


def unpack_f32(data):
    return list(struct.unpack("<%df" % (len(data) // 4), data))


def ridge_closed_form(rows, targets, lam):
    """FP64 theta = (lam I + sum u u')^-1 sum u y, u = [x, 1] (cold start:
    identity standardization, P0 = I / lam over the bias too). Gaussian
    elimination with partial pivoting."""
    n = len(rows[0]) + 1
    a = [[lam if i == j else 0.0 for j in range(n)] for i in range(n)]
    rhs = [0.0] * n
    for x, y in zip(rows, targets):
        u = [float(v) for v in x] + [1.0]
        for i in range(n):
            rhs[i] += u[i] * y
            for j in range(n):
                a[i][j] += u[i] * u[j]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        rhs[col], rhs[piv] = rhs[piv], rhs[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            rhs[r] -= f * rhs[col]
    theta = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = rhs[r] - sum(a[r][c] * theta[c] for c in range(r + 1, n))
        theta[r] = s / a[r][r]
    return theta


class WatchThread:
    """Follows Predictor.WatchReadout on a thread; tests wait on events."""

    def __init__(self, stub, readout):
        pb = PB["predictor_pb2"]
        self.call = stub.WatchReadout(
            pb.WatchReadoutRequest(readout=readout, include_weights=True))
        self.versions = []
        self.error = None
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for v in self.call:
                with self.cond:
                    self.versions.append(v)
                    self.cond.notify_all()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, pred, timeout=DEADLINE_S):
        """Waits until some received version satisfies pred; returns it or
        None at the deadline (or when the stream ended first)."""
        with self.cond:
            def found():
                return next((v for v in self.versions if pred(v)), None)
            self.cond.wait_for(
                lambda: found() is not None or not self.thread.is_alive(),
                timeout=timeout)
            return found()

    def stop(self):
        self.call.cancel()
        self.thread.join(timeout=DEADLINE_S)


class LeapdClientTest(unittest.TestCase):

    def setUp(self):
        self.leapd = Leapd(["--rls_batch=1", "--rls_batch_max=1", "--rls_flush=10ms"])
        self.addCleanup(self.leapd.kill)
        self.predictor = PB["predictor_pb2_grpc"].PredictorStub(
            self.leapd.channel)
        self.admin = PB["admin_pb2_grpc"].AdminStub(self.leapd.channel)
        apb = PB["admin_pb2"]
        info = self.admin.CreateReadout(
            apb.CreateReadoutRequest(
                name=READOUT,
                cold_start=apb.ColdStart(dim=DIM, **{"lambda": LAMBDA})),
            timeout=DEADLINE_S)
        self.assertEqual(info.name, READOUT)
        self.assertEqual(info.dim, DIM)
        self.assertEqual(info.version, 1)
        self.assertEqual(info.max_tokens, BUDGET)
        route = self.admin.SetRoute(
            apb.SetRouteRequest(route=apb.Route(
                product_line="",
                arms=[apb.Arm(readout=READOUT, percent=100)])),
            timeout=DEADLINE_S)
        self.assertEqual([a.readout for a in route.arms], [READOUT])
        self.rng = random.Random(5)

    def stop_leapd(self):
        self.assertEqual(self.leapd.terminate(), 0, "leapd exit code on SIGTERM")

    def features(self):
        return [self.rng.gauss(0.0, 1.0) for _ in range(DIM)]

    def predict(self, request_id, x, dtype=None):
        pb = PB["predictor_pb2"]
        if dtype is None:
            dtype = pb.FEATURE_DTYPE_FLOAT32
        return self.predictor.Predict(
            pb.PredictRequest(
                record=pb.FeatureRecord(request_id=request_id,
                                        features=pack_f32(x)),
                dtype=dtype),
            timeout=DEADLINE_S).prediction

    def complete(self, request_id, tokens, reason=None):
        pb = PB["predictor_pb2"]
        if reason is None:
            reason = pb.FINISH_REASON_STOP
        return self.predictor.Complete(
            pb.CompleteRequest(completion=pb.Completion(
                request_id=request_id, output_tokens=tokens, reason=reason)),
            timeout=DEADLINE_S)

    def assert_rpc_error(self, code, needles, fn, *args):
        with self.assertRaises(grpc.RpcError) as cm:
            fn(*args)
        self.assertEqual(cm.exception.code(), code, cm.exception.details())
        for needle in needles:
            self.assertIn(needle, cm.exception.details())
        return cm.exception

    def test_predict_complete_and_watch_push(self):
        watch = WatchThread(self.predictor, READOUT)
        self.addCleanup(watch.stop)
        # The current version first: from here on every publish is pushed.
        first = watch.wait_for(lambda v: True)
        self.assertIsNotNone(first, "WatchReadout sent no current version")
        self.assertEqual(first.version, 1)
        self.assertEqual(first.dim, DIM)
        self.assertEqual(first.cause, "create")
        self.assertEqual(unpack_f32(first.w), [0.0] * DIM)

        rows, targets = [], []
        for i, tokens in enumerate([100, 400, 25]):
            x = self.features()
            p = self.predict("py-%d" % i, x)
            self.assertEqual(p.request_id, "py-%d" % i)
            self.assertEqual(p.readout, READOUT)
            if i == 0:
                # Cold start: theta = 0, score 0, clipped to 1 token.
                self.assertEqual(p.version, 1)
                self.assertEqual(p.score, 0.0)
                self.assertEqual(p.predicted_tokens, 1.0)
            done = self.complete("py-%d" % i, tokens)
            self.assertTrue(done.learned, done.skip_reason)
            self.assertEqual(done.skip_reason, "")
            rows.append(x)
            targets.append(math.sqrt(min(tokens, BUDGET)))

        v2 = watch.wait_for(lambda v: v.version == 2)
        self.assertIsNotNone(v2, "no push of version 2 within %s s: %r"
                             % (DEADLINE_S, [v.version for v in watch.versions]))
        self.assertEqual(v2.cause, "rls")
        self.assertGreaterEqual(v2.completions_learned, 1)
        last = watch.wait_for(lambda v: v.completions_learned == 3)
        self.assertIsNotNone(last, "no version with all 3 completions learned")
        self.assertIsNone(watch.error)
        got = [v.version for v in watch.versions]
        self.assertEqual(got, list(range(1, len(got) + 1)),
                         "versions pushed in order, none skipped")

        # The pushed weights against the FP64 closed form over the 3
        # learned completions (P is float32 in leapd: 1e-4 relative).
        theta = ridge_closed_form(rows, targets, LAMBDA)
        pushed = unpack_f32(last.w) + [last.bias]
        self.assertEqual(len(pushed), DIM + 1)
        err = math.sqrt(sum((a - b) ** 2 for a, b in zip(pushed, theta)))
        norm = math.sqrt(sum(t * t for t in theta))
        print("pushed version %d vs FP64 closed form: rel err %.3g"
              % (last.version, err / norm), file=sys.stderr)
        self.assertLess(err / norm, 1e-4)

        # A new request is scored with exactly the pushed version.
        x = self.features()
        p = self.predict("py-after", x)
        self.assertEqual(p.version, last.version)
        expected = sum(w * v for w, v in zip(unpack_f32(last.w), x)) + last.bias
        self.assertAlmostEqual(p.score, expected, delta=1e-4 * max(1, abs(expected)))
        clipped = min(max(expected, 1.0), math.sqrt(BUDGET))
        self.assertAlmostEqual(p.predicted_tokens, clipped * clipped,
                               delta=1e-3 * clipped * clipped)

        info = self.admin.GetReadout(
            PB["admin_pb2"].GetReadoutRequest(name=READOUT), timeout=DEADLINE_S)
        self.assertEqual(info.completions_learned, 3)
        self.assertEqual(info.version, last.version)
        watch.stop()
        self.stop_leapd()

    def test_bad_input_gets_precise_errors_and_changes_nothing(self):
        pb = PB["predictor_pb2"]
        apb = PB["admin_pb2"]
        inv = grpc.StatusCode.INVALID_ARGUMENT
        # Wrong feature size: the expected and the actual size are named.
        self.assert_rpc_error(
            inv, ["expected %d float32 values (%d bytes)" % (DIM, 4 * DIM),
                  "got %d bytes" % (4 * (DIM - 1))],
            self.predict, "bad-size", self.features()[:DIM - 1])
        # NaN feature: the element is named.
        x = self.features()
        x[3] = float("nan")
        self.assert_rpc_error(inv, ["element 3"], self.predict, "bad-nan", x)
        # Unspecified dtype.
        self.assert_rpc_error(inv, ["dtype"], self.predict, "bad-dtype",
                              self.features(), pb.FEATURE_DTYPE_UNSPECIFIED)
        # An id over 256 bytes: INVALID_ARGUMENT naming its size, the limit
        # and its start; a completion of one too (not NOT_FOUND: it is not
        # counted as unknown below).
        too_long = ["request_id of 300 bytes is over the limit of 256 bytes",
                    'it starts "' + "L" * 32 + '"']
        self.assert_rpc_error(inv, too_long, self.predict, "L" * 300,
                              self.features())
        self.assert_rpc_error(inv, too_long, self.complete, "L" * 300, 10)
        # Completion for an id never predicted: NOT_FOUND, naming it.
        self.assert_rpc_error(grpc.StatusCode.NOT_FOUND, ["never-seen"],
                              self.complete, "never-seen", 10)
        # A live id: duplicate -> ALREADY_EXISTS; negative count ->
        # INVALID_ARGUMENT and the request stays live.
        x = self.features()
        self.assertEqual(self.predict("live-1", x).version, 1)
        self.assert_rpc_error(grpc.StatusCode.ALREADY_EXISTS, ["live-1"],
                              self.predict, "live-1", x)
        self.assert_rpc_error(inv, ["output_tokens", "got -5"], self.complete,
                              "live-1", -5)

        # Nothing was learned and the failed completion was counted.
        info = self.admin.GetReadout(apb.GetReadoutRequest(name=READOUT),
                                     timeout=DEADLINE_S)
        self.assertEqual(info.version, 1)
        self.assertEqual(info.completions_learned, 0)
        stats = self.admin.GetStats(apb.GetStatsRequest(), timeout=DEADLINE_S)
        self.assertEqual(stats.unknown_completions, 1)
        self.assertEqual(stats.live_requests, 1)  # live-1 only
        # The request survived its bad completion.
        self.assertTrue(self.complete("live-1", 50).learned)
        self.assert_rpc_error(grpc.StatusCode.NOT_FOUND, ["live-1"],
                              self.complete, "live-1", 50)
        self.stop_leapd()


def main():
    global ARGS
    ARGS = test_main.parse_args(__doc__, "leapd", "proto-dir")
    test_main.run()


if __name__ == "__main__":
    main()
