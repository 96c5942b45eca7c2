#!/usr/bin/python3
"""The Python binding leap_shim against a real leapd, with Debian's
python3-torch making the tensors (the module itself links no torch).

  - End to end (unix socket, --data_dir, --rls_batch=1): torch tensors of
    float32, bfloat16 and float16, a strided slice, a transposed view, a
    numpy array, a torch DLPack capsule and a hand-made ctypes capsule
    (byte_offset, NULL strides, a deleter that must run once) are captured;
    every request gets a prediction; two complete; leapd publishes versions
    2 and 3 and rescores the live requests, whose scores equal w . x + b over
    the published weights and the tensors' own values (so every DLPack path
    read the right elements); Scheduler.apply + select order the requests
    exactly as a brute-force countdown does; leapd is killed with SIGKILL and
    restarted on the same socket: the client reconnects by itself and the
    live requests are predicted again, then learned by the new process.
  - TLS: a client with tls_ca_file/tls_cert_file/tls_key_file gets
    predictions from a leapd whose TCP listener speaks mutual TLS
    (certificates made by openssl at test time); clients with another CA's
    certificate, without a certificate or in plaintext never connect.
  - Bad input raises the documented Python exception and consumes nothing.
  - Scheduler.apply / select over many steps against a brute-force
    countdown (newest version wins, unpredicted requests last).
  - CUDA capture (skipped unless this process has a CUDA device, a CUDA
    torch and a leap_shim built with CUDA).

Waits are on events with deadlines (Client.poll(timeout_s=...), a stdout
reader thread, a WatchReadout stream); nothing sleeps.

Run: /usr/bin/python3 tests/python_shim_test.py --leapd PATH --proto-dir DIR
       --module-dir DIR_OF_leap_shim
"""

import ctypes
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import leapd_lines  # noqa: E402  (tests/support/leapd_lines.py)
import proto_stubs  # noqa: E402  (tests/support/proto_stubs.py)
import test_main  # noqa: E402  (tests/support/test_main.py)
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)
import numpy as np
import torch

ARGS = None  # parsed command line (set in main)
PB = {}  # generated modules
STUB_DIR = None
leap_shim = None  # imported in setUpModule from --module-dir

DIM = 64
READOUT = "r"
DEADLINE_S = 30.0


def setUpModule():
    """Imports leap_shim and generates the gRPC stubs (Admin and
    WatchReadout only) from proto/ into a temporary directory."""
    global STUB_DIR, leap_shim
    leap_shim = test_main.import_leap_shim(ARGS.module_dir)
    STUB_DIR, stubs = proto_stubs.generate(ARGS.proto_dir, "leap_shim_stubs_")
    PB.update(stubs)


def tearDownModule():
    if STUB_DIR is not None:
        shutil.rmtree(STUB_DIR, ignore_errors=True)


class Leapd:
    """A leapd child process on a unix socket with its state in data_dir;
    stdout is read by a thread so waiting for a line has a deadline."""

    def __init__(self, sock, data_dir, extra_args=()):
        self.sock = sock
        self.proc = subprocess.Popen(
            [ARGS.leapd, "--listen=unix://" + sock, "--shm=" + sock + ".shm",
             "--metrics_listen=127.0.0.1:0", "--data_dir=" + data_dir,
             "--rls_batch=1", "--rls_batch_max=1", "--rls_flush=10ms"] +
            list(extra_args),
            stdout=subprocess.PIPE, text=True)
        self.lines = leapd_lines.StdoutLines(self.proc, DEADLINE_S)
        listens = 1 + sum(a.startswith("--listen=") for a in extra_args)
        addresses = [self.wait_for_line("listening on ")
                     for _ in range(listens)]
        # The TCP listener's address with its port (extra_args' --listen).
        self.tcp = next((a for a in addresses if not a.startswith("unix:")),
                        None)
        self.wait_for_line("leapd ")  # "leapd <id> ready"

    def wait_for_line(self, prefix):
        return self.lines.wait_for(prefix)

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE_S)
        self.proc.stdout.close()

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=DEADLINE_S)
        self.proc.stdout.close()


def process_state(pid):
    """The state letter of /proc/PID/stat ('T': stopped), '' if gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class Events:
    """Everything a Client delivered, with waits on a predicate."""

    def __init__(self, client):
        self.client = client
        self.all = []

    def wait_for(self, pred, timeout=DEADLINE_S):
        """Polls (each poll waits for the next event) until pred(self.all)
        holds; returns whether it did before the deadline."""
        deadline = time.monotonic() + timeout
        while not pred(self.all):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.all.extend(self.client.poll(timeout_s=min(left, 1.0)))
        return True

    def since(self, start, kind):
        return [e for e in self.all[start:] if e.kind == kind]


def latest(events, ids, kinds=("prediction", "rescore"), min_version=0):
    """request id -> its event of the newest version (of the given kinds)."""
    out = {}
    for e in events:
        if e.kind in kinds and e.request_id in ids and e.version >= min_version:
            if e.request_id not in out or e.version >= out[e.request_id].version:
                out[e.request_id] = e
    return out


# ---- A DLPack capsule made by hand (ctypes), to test the raw protocol ------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice),
                ("ndim", ctypes.c_int), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor),
                            ("manager_ctx", ctypes.c_void_p),
                            ("deleter", DELETER)]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_DLTENSOR = b"dltensor"  # must outlive the capsules named by it


class HandMadeCapsule:
    """A 'dltensor' capsule over `values` (a float32 numpy array) with the
    given shape, strides (None = NULL), byte offset and device; counts the
    calls of its deleter."""

    def __init__(self, values, shape, strides=None, byte_offset=0,
                 device_type=1, dtype=(2, 32), data=None):
        self.values = values
        self.deleted = 0
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (None if strides is None
                        else (ctypes.c_int64 * len(strides))(*strides))
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = data if data is not None else values.ctypes.data
        t.device = DLDevice(device_type, 0)
        t.ndim = len(shape)
        t.dtype = DLDataType(dtype[0], dtype[1], 1)
        t.shape = self.shape
        if self.strides is not None:
            t.strides = self.strides
        t.byte_offset = byte_offset
        self.deleter = DELETER(self._delete)
        self.managed.deleter = self.deleter
        self.capsule = _capsule_new(ctypes.addressof(self.managed), _DLTENSOR,
                                    None)

    def _delete(self, _):
        self.deleted += 1

    def name(self):
        return _capsule_name(self.capsule).decode()


# ---- The tests --------------------------------------------------------------

class LeapdFixture(unittest.TestCase):
    """Starts leapd (unix socket, data_dir) with a cold-start readout of
    dim 64 on the default route."""

    def setUp(self):
        self.dir = temp_dirs.make("leap_shim_test")
        self.addCleanup(temp_dirs.remove, self.dir)
        self.sock = os.path.join(self.dir, "leapd.sock")
        self.data_dir = os.path.join(self.dir, "db")
        self.leapd = Leapd(self.sock, self.data_dir, self.leapd_args())
        self.addCleanup(lambda: self.leapd.kill9())
        apb = PB["admin_pb2"]
        with grpc.insecure_channel("unix://" + self.sock) as ch:
            admin = PB["admin_pb2_grpc"].AdminStub(ch)
            info = admin.CreateReadout(apb.CreateReadoutRequest(
                name=READOUT, cold_start=apb.ColdStart(dim=DIM, **{"lambda": 1.0})),
                timeout=DEADLINE_S)
            self.assertEqual(info.version, 1)
            admin.SetRoute(apb.SetRouteRequest(route=apb.Route(
                product_line="", arms=[apb.Arm(readout=READOUT, percent=100)])),
                timeout=DEADLINE_S)
        # Rows x = c * v + noise: a readout that learns from c = +1 (900
        # tokens) and c = -1 (25 tokens) predicts distinct lengths for
        # distinct c in between.
        self.gen = torch.Generator().manual_seed(7)
        self.v = torch.randn(DIM, generator=self.gen)
        self.v *= 4.0 / self.v.norm()

    def leapd_args(self):
        """leapd flags beyond the fixture's own (subclasses)."""
        return []

    def rows(self, cs):
        cs = torch.tensor(cs, dtype=torch.float32)
        noise = 0.1 * torch.randn(len(cs), DIM, generator=self.gen)
        return cs[:, None] * self.v[None, :] + noise

    def client(self):
        c = leap_shim.Client("unix://" + self.sock, DIM, dtype="float32",
                             engine_id="py-test", model_id="m", layer=12,
                             min_backoff_s=0.02, max_backoff_s=0.2)
        self.addCleanup(c.close)
        self.assertTrue(c.wait_connected(DEADLINE_S), "client never connected")
        return c

    def weights(self):
        """The readout's current version with its folded weights."""
        pb = PB["predictor_pb2"]
        with grpc.insecure_channel("unix://" + self.sock) as ch:
            stub = PB["predictor_pb2_grpc"].PredictorStub(ch)
            call = stub.WatchReadout(
                pb.WatchReadoutRequest(readout=READOUT, include_weights=True),
                timeout=DEADLINE_S)
            v = next(call)
            call.cancel()
        w = torch.tensor(struct.unpack("<%df" % DIM, v.w), dtype=torch.float64)
        return v, w

    def wait_learned(self, n):
        """Waits on WatchReadout until the readout learned n completions."""
        pb = PB["predictor_pb2"]
        with grpc.insecure_channel("unix://" + self.sock) as ch:
            stub = PB["predictor_pb2_grpc"].PredictorStub(ch)
            call = stub.WatchReadout(pb.WatchReadoutRequest(readout=READOUT),
                                     timeout=DEADLINE_S)
            for v in call:
                if v.completions_learned >= n:
                    call.cancel()
                    return v
        return None

    def assert_scores(self, events, expected_rows, w, bias):
        """Each event's score against w . x + bias in FP64 (leapd computes
        in float32: 1e-4 relative)."""
        for rid, x in expected_rows.items():
            want = float(x.double() @ w) + bias
            got = events[rid].score
            self.assertAlmostEqual(got, want, delta=1e-4 * max(1.0, abs(want)),
                                   msg="score of %s" % rid)


class EndToEndTest(LeapdFixture):

    def test_shm_endpoint(self):
        """The same binding over leapd's shared-memory data plane: captured
        rows (fp32 and bf16 tensors) come back as predictions equal to
        w . x + b, and a completion is learned."""
        client = leap_shim.Client("shm://" + self.sock + ".shm", DIM,
                                  dtype="float32", engine_id="py-shm",
                                  min_backoff_s=0.02, max_backoff_s=0.2)
        self.addCleanup(client.close)
        self.assertTrue(client.wait_connected(DEADLINE_S), "no shm attach")
        ev = Events(client)
        v, w = self.weights()
        f32 = self.rows([1.0, -0.4, 0.25])
        bf16 = self.rows([0.6]).to(torch.bfloat16)
        client.capture(f32, ["m0", "m1", "m2"])
        client.capture(bf16, ["m3"])
        expected = {"m0": f32[0], "m1": f32[1], "m2": f32[2], "m3": bf16[0].float()}
        ids = set(expected)
        self.assertTrue(ev.wait_for(
            lambda a: len(latest(a, ids, ("prediction",))) == len(ids)),
            "no predictions over shm")
        got = latest(ev.all, ids, ("prediction",))
        self.assert_scores({k: got[k] for k in ids}, expected, w, v.bias)
        client.complete("m0", 321, reason="stop")
        self.assertIsNotNone(self.wait_learned(1))

    def test_length_prior(self):
        """request_priors end to end: leapd learns the prior from the
        completions that carry prompt_tokens, 'prior' events equal an FP64
        ridge solve, and Scheduler.apply makes admission follow them."""
        client = self.client()
        ev = Events(client)
        n = 40
        ids = ["p%d" % i for i in range(n)]
        client.capture(self.rows([0.0] * n), ids)
        client.capture(self.rows([0.0]), ["sentinel"], max_tokens=10)
        samples = []
        for i, rid in enumerate(ids):
            p = 20 + 10 * i
            client.complete(rid, 3 * p + 7, "stop", prompt_tokens=p)
            samples.append((p, 3 * p + 7))
        # Refused by leapd (a length stop above its own cap): its error is
        # the answer to the last completion message, so every completion
        # before it was learned once it arrives.
        client.complete("sentinel", 50, "length", prompt_tokens=5)
        self.assertTrue(ev.wait_for(lambda a: any(
            e.kind == "error" and e.request_id == "sentinel" for e in a)))
        # FP64 reference: ridge (lambda 1 off the intercept) on
        # (1, log1p p, log1p M, 0) -> sqrt(tokens); M = 2048.
        budget = 2048.0
        x = torch.tensor([[1.0, math.log1p(p), math.log1p(budget), 0.0]
                          for p, _ in samples], dtype=torch.float64)
        y = torch.tensor([math.sqrt(t) for _, t in samples], dtype=torch.float64)
        a = x.T @ x + torch.diag(torch.tensor([0.0, 1.0, 1.0, 1.0],
                                              dtype=torch.float64))
        wref = torch.linalg.solve(a, x.T @ y)

        def prior(p):
            s = max(float(wref @ torch.tensor(
                [1.0, math.log1p(p), math.log1p(budget), 0.0],
                dtype=torch.float64)), 0.0)
            return min(s * s, budget)

        sched = leap_shim.Scheduler(slots=1, waiting_cap=0)
        arrivals = [("a400", 400), ("a30", 30), ("a200", 200)]
        for rid, _ in arrivals:
            sched.add(rid)
        start = len(ev.all)
        client.request_priors([r for r, _ in arrivals],
                              prompt_tokens=[p for _, p in arrivals])
        self.assertTrue(ev.wait_for(
            lambda a: len(ev.since(start, "prior")) == len(arrivals)),
            "no prior events")
        got = {e.request_id: e for e in ev.since(start, "prior")}
        for rid, p in arrivals:
            want = prior(p)
            self.assertAlmostEqual(got[rid].predicted_tokens, want,
                                   delta=1e-6 * max(want, 1.0), msg=rid)
        self.assertIn("predicted_tokens=", repr(got["a30"]))
        self.assertEqual(sched.apply(ev.since(start, "prior")), 3)
        self.assertEqual(sched.select(3), ["a30", "a200", "a400"])
        st = client.stats
        self.assertEqual(st["priors"], 3)
        self.assertFalse(st["priors_unsupported"])
        self.assertEqual(st["completion_retries"], 0)  # nothing refused UNAVAILABLE
        # The caller's mistakes are exceptions.
        with self.assertRaises(ValueError):
            client.request_priors(["x"], prompt_tokens=0)
        with self.assertRaises(ValueError):
            client.request_priors(["x"])
        with self.assertRaises(ValueError):
            client.request_priors(["x", "y"], prompt_tokens=[5])
        with self.assertRaises(ValueError):
            client.complete("p0", 1, "stop", prompt_tokens=-1)

    def test_capture_learn_rescore_schedule_and_restart(self):
        client = self.client()
        ev = Events(client)
        sched = leap_shim.Scheduler(slots=4)
        expected = {}  # request id -> the float32 values leapd must see

        def capture(tensor, ids, values, **kw):
            for rid in ids:
                sched.add(rid)
            client.capture(tensor, ids, **kw)
            for rid, x in zip(ids, values):
                expected[rid] = x.float()

        # float32, contiguous; a0/a1 will be completed and learned.
        f32 = self.rows([1.0, -1.0, 0.3])
        capture(f32, ["a0", "a1", "a2"], f32, max_tokens=[1000, 0, 500])
        # bfloat16 and float16 (converted to the client's float32).
        bf16 = self.rows([-0.7, 0.55]).to(torch.bfloat16)
        capture(bf16, ["b0", "b1"], bf16.float())
        f16 = self.rows([0.12, -0.33]).to(torch.float16)
        capture(f16, ["h0", "h1"], f16.float())
        # A strided slice (col stride 2) of a wider tensor.
        wide = torch.zeros(3, 2 * DIM)
        wide[:, ::2] = self.rows([0.8, -0.05, 0.41])
        capture(wide[:, ::2], ["s0", "s1", "s2"], wide[:, ::2])
        # A transposed view (row stride 1, col stride 2).
        tt = self.rows([0.66, -0.5]).t().contiguous()
        capture(tt.t(), ["t0", "t1"], tt.t())
        # numpy through its own __dlpack__.
        npa = self.rows([0.2]).numpy()
        capture(npa, ["n0"], torch.from_numpy(npa))
        # A torch capsule: consumed by the capture.
        pt = self.rows([-0.2])
        cap = torch.utils.dlpack.to_dlpack(pt)
        capture(cap, ["p0"], pt)
        with self.assertRaisesRegex(ValueError, "consumed already"):
            client.capture(cap, ["p0-again"])
        # A hand-made capsule: byte_offset skips row 0, NULL strides; its
        # deleter runs once, before capture() returns (CPU copies at once).
        two = self.rows([0.9, -0.9]).numpy()
        hand = HandMadeCapsule(two, shape=[1, DIM], byte_offset=4 * DIM)
        capture(hand.capsule, ["k0"], torch.from_numpy(two[1:]))
        self.assertEqual(hand.deleted, 1)
        self.assertEqual(hand.name(), "used_dltensor")

        ids = set(expected)
        self.assertTrue(ev.wait_for(
            lambda a: len(latest(a, ids, ("prediction",))) == len(ids)),
            "predictions missing for %s" % (ids - set(latest(ev.all, ids))))
        first = latest(ev.all, ids, ("prediction",))
        for rid, e in first.items():
            # Cold start: theta = 0, score 0, one token.
            self.assertEqual((e.readout, e.version, e.score, e.predicted_tokens),
                             (READOUT, 1, 0.0, 1.0), rid)
        self.assertFalse([e for e in ev.all if e.kind == "error"])
        self.assertEqual(sched.apply(ev.all), len(ids))

        # A duplicate id is an error event from the client itself.
        client.capture(self.rows([0.0]), ["a2"])
        self.assertTrue(ev.wait_for(lambda a: any(
            e.kind == "error" and e.request_id == "a2" and e.code == 6
            for e in a)))

        # Two finish: leapd publishes versions 2 and 3 and rescores the
        # live requests from their cached features.
        client.complete("a0", 900, "stop")
        client.complete("a1", 25, "stop")
        sched.remove("a0")
        sched.remove("a1")
        live = ids - {"a0", "a1"}
        self.assertTrue(ev.wait_for(
            lambda a: len(latest(a, live, ("rescore",), 3)) == len(live)),
            "no rescore at version 3 for every live request")
        now = latest(ev.all, live)
        version, w = self.weights()
        self.assertEqual(version.version, 3)
        self.assertEqual(version.completions_learned, 2)
        self.assertEqual({e.version for e in now.values()}, {3})
        self.assert_scores(now, {r: expected[r] for r in live}, w,
                           version.bias)
        preds = {r: e.predicted_tokens for r, e in now.items()}
        print("version 3 predictions: %s" % ", ".join(
            "%s=%.1f" % (r, preds[r]) for r in sorted(preds)), file=sys.stderr)
        self.assertGreater(len(set(preds.values())), len(live) - 2,
                           "predictions should mostly differ: %r" % preds)

        # Scheduler: apply() keeps the newest version; select() is the
        # countdown (shortest remaining first, ties by arrival).
        sched.apply(ev.all)
        arrival = {r: sched.request(r)["arrival"] for r in live}
        for r in live:
            self.assertEqual(sched.request(r)["predicted_tokens"], preds[r])
        generated = dict.fromkeys(live, 0)
        for _ in range(3):
            want = sorted(live, key=lambda r: (max(preds[r] - generated[r], 1.0),
                                               arrival[r]))[:4]
            self.assertEqual(sched.select(), want)
            for r in want:
                generated[r] += 1

        # SIGKILL; the client notices and keeps trying; leapd comes back on
        # the same socket with its state and the client resubmits.
        stats = client.stats
        self.assertEqual(stats["live"], len(live))
        self.leapd.kill9()
        self.assertTrue(ev.wait_for(
            lambda a: any(e.kind == "disconnected" for e in a)))
        mark = len(ev.all)
        os.remove(self.sock)
        self.leapd = Leapd(self.sock, self.data_dir)
        self.assertTrue(ev.wait_for(lambda a: len(
            latest(a[mark:], live, ("prediction",))) == len(live)),
            "live requests were not predicted again after the restart")
        self.assertTrue(ev.since(mark, "connected"))
        # The resubmitted features are the captured ones: scored with the
        # weights of the recovered readout. leapd recovers by replaying its
        # completion log back to the version it had (same number, same
        # weights) before it serves; once it holds both, every live request
        # holds a prediction or rescore of that version.
        self.assertIsNotNone(self.wait_learned(2))
        version, w = self.weights()
        self.assertTrue(ev.wait_for(lambda a: {
            e.version for e in latest(a[mark:], live).values()} == {
                version.version} and len(latest(a[mark:], live)) == len(live)),
            "no prediction of version %d for every live request"
            % version.version)
        again = latest(ev.all[mark:], live)
        print("after the restart: version %d, %d resubmitted" % (
            version.version, client.stats["resubmitted"]), file=sys.stderr)
        self.assert_scores(again, {r: expected[r] for r in live}, w,
                           version.bias)
        stats = client.stats
        self.assertGreaterEqual(stats["resubmitted"], len(live))
        self.assertGreaterEqual(stats["connects"], 2)
        self.assertTrue(stats["connected"])
        self.assertGreaterEqual(sched.apply(ev.all[mark:]), len(live))
        for r in live:
            self.assertEqual(sched.request(r)["predicted_tokens"],
                             again[r].predicted_tokens)

        # The new process learns the rest.
        for rid in sorted(live):
            client.complete(rid, 100, "stop")
            sched.remove(rid)
        learned = self.wait_learned(2 + len(live))
        self.assertIsNotNone(learned)
        self.assertEqual(learned.completions_learned, 2 + len(live))
        self.assertTrue(ev.wait_for(lambda a: client.stats["live"] == 0))
        self.assertEqual(len(sched), 0)

        client.close()
        self.assertTrue(client.closed)
        with self.assertRaisesRegex(RuntimeError, "closed"):
            client.capture(self.rows([0.0]), ["late"])
        client.close()  # idempotent
        self.leapd.terminate()


class ClientOptionsTest(LeapdFixture):
    """The Client options shared with the C++ Client reach leapd: the
    instance id scopes request ids, shm_slots and shm_ring_bytes size the
    shared-memory segment, response_timeout_s abandons a hung leapd. Ids
    over leapd's bound are refused by the client alone."""

    def options_client(self, endpoint, **kw):
        c = leap_shim.Client(endpoint, DIM, min_backoff_s=0.02,
                             max_backoff_s=0.2, **kw)
        self.addCleanup(c.close)
        self.assertTrue(c.wait_connected(DEADLINE_S), "client never connected")
        return c

    def test_instance_id_scopes_request_ids(self):
        unix = "unix://" + self.sock
        a = self.options_client(unix, instance_id="engine-a")
        b = self.options_client(unix, instance_id="engine-b")
        again = self.options_client(unix, instance_id="engine-a")
        self.assertEqual((a.instance_id, b.instance_id), ("engine-a", "engine-b"))
        made = self.options_client(unix)
        self.assertRegex(made.instance_id, "^[0-9a-f]{32}$")
        self.assertNotEqual(made.instance_id, self.options_client(unix).instance_id)
        row = self.rows([0.5])
        # Same request id from two instances: two live requests.
        for c in (a, b):
            ev = Events(c)
            c.capture(row, ["r0"])
            self.assertTrue(ev.wait_for(lambda e: latest(e, {"r0"}, ("prediction",))),
                            "no prediction for " + c.instance_id)
        # The same id again from a client saying instance "engine-a": leapd
        # holds it live for that instance already.
        ev = Events(again)
        again.capture(row, ["r0"])
        self.assertTrue(ev.wait_for(lambda e: any(x.kind == "error" for x in e)))
        err = [x for x in ev.all if x.kind == "error"][0]
        self.assertEqual((err.request_id, err.code), ("r0", 6), err.message)

    def test_overlong_ids_are_refused_alone_and_the_connection_stays(self):
        """A request id or product line over 256 bytes (also one larger
        than a shm frame) is refused by capture / request_priors as an
        'error' event (code 3) for itself alone, in leapd's words
        (docs/WIRE.md, "Sizes"): nothing of it is sent, the connection
        stays, the rows around it are predicted; 256 bytes are served. On
        both transports."""
        def over(field, n, c):
            return ('%s of %d bytes is over the limit of 256 bytes '
                    '(it starts "%s")' % (field, n, c * 32))

        for endpoint in ("unix://" + self.sock, "shm://" + self.sock + ".shm"):
            with self.subTest(endpoint=endpoint):
                c = self.options_client(endpoint, shm_ring_bytes=65536)
                ev = Events(c)
                huge, long_id, at_limit = "h" * 20000, "o" * 257, "k" * 256
                c.capture(self.rows([0.1, 0.2, 0.3, 0.4]),
                          ["before", huge, long_id, at_limit])
                c.capture(self.rows([0.5]), ["long-line"], product_line="p" * 257)
                c.request_priors(["q" * 20000], prompt_tokens=10)
                c.capture(self.rows([0.6]), ["after"])
                served = {"before", at_limit, "after"}
                self.assertTrue(ev.wait_for(
                    lambda a: len(latest(a, served, ("prediction",))) == 3 and
                    len([e for e in a if e.kind == "error"]) == 4),
                    "the rows around the refused ids were not predicted")
                errors = {e.request_id: (e.code, e.message)
                          for e in ev.all if e.kind == "error"}
                self.assertEqual(errors, {
                    huge: (3, over("request_id", 20000, "h")),
                    long_id: (3, over("request_id", 257, "o")),
                    "long-line": (3, over("product_line", 257, "p")),
                    "q" * 20000: (3, "arrival record: " + over("request_id", 20000, "q")),
                })
                c.complete(huge, 10, "stop")  # a refused id: nothing happens
                for rid in sorted(served):
                    c.complete(rid, 50, "stop")
                self.assertTrue(ev.wait_for(lambda a: c.stats["live"] == 0))
                stats = c.stats
                self.assertEqual((stats["connects"], stats["errors"],
                                  stats["predictions"]), (1, 4, 3))
                self.assertTrue(stats["connected"])
                self.assertEqual([e for e in ev.all if e.kind == "disconnected"], [])

    def test_shm_slots_and_ring_bytes_size_the_segment(self):
        shm = "shm://" + self.sock + ".shm"
        sizes = {}
        for name, slots, ring in (("small", 16, 65536), ("large", 16, 1 << 20),
                                  ("slots", 48, 65536)):
            c = self.options_client(shm, engine_id=name, shm_slots=slots,
                                    shm_ring_bytes=ring)
            self.assertEqual((c.shm_slots, c.shm_ring_bytes), (slots, ring))
            line = self.leapd.wait_for_line("shm: engine '%s' attached:" % name)
            self.assertIn(" %d slots," % slots, line)
            sizes[name] = os.path.getsize(line.rsplit("segment ", 1)[1].strip())
        # Two rings per segment; a slot of 64 float32 values is 256 bytes.
        self.assertEqual(sizes["large"] - sizes["small"], 2 * ((1 << 20) - 65536))
        self.assertEqual(sizes["slots"] - sizes["small"], 32 * DIM * 4)

    def test_response_timeout_abandons_a_hung_leapd(self):
        c = self.options_client("unix://" + self.sock, response_timeout_s=0.3)
        self.assertEqual(c.response_timeout_s, 0.3)
        ev = Events(c)
        self.leapd.proc.send_signal(signal.SIGSTOP)
        self.addCleanup(self.leapd.proc.send_signal, signal.SIGCONT)
        # The stop takes effect asynchronously: the request goes out only
        # once every leapd thread is stopped, so no answer can reach it.
        deadline = time.monotonic() + DEADLINE_S
        while (process_state(self.leapd.proc.pid) != "T" and
               time.monotonic() < deadline):
            ev.wait_for(lambda e: False, timeout=0.01)
        self.assertEqual(process_state(self.leapd.proc.pid), "T")
        self.assertTrue(c.connected, c.stats)
        start = time.monotonic()
        c.capture(self.rows([0.1]), ["hung"])
        deadline = start + DEADLINE_S
        while c.stats["stalls"] < 1 and time.monotonic() < deadline:
            ev.wait_for(lambda e: False, timeout=0.05)
        waited = time.monotonic() - start
        self.assertGreaterEqual(c.stats["stalls"], 1,
                                "never abandoned: %s" % c.stats)
        # The default (2 s) would not have abandoned it yet.
        self.assertLess(waited, 1.9)
        self.assertTrue(c.degraded)
        self.leapd.proc.send_signal(signal.SIGCONT)
        self.assertTrue(c.wait_connected(DEADLINE_S), "no reconnect after SIGCONT")


def make_certificates(d):
    """openssl at test time: a CA `ca`, a server certificate for 127.0.0.1
    signed by it, a client certificate signed by it, and a client
    certificate `rogue` signed by another CA."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
           "-nodes"]

    def run(args):
        subprocess.run(["openssl"] + args, cwd=d, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ca(name):
        run(["req", "-x509"] + key + ["-keyout", name + ".key", "-out",
            name + ".pem", "-days", "2", "-subj", "/CN=" + name])

    def leaf(name, ca_name, ext):
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext + "\n")
        run(["req"] + key + ["-keyout", name + ".key", "-out", name + ".csr",
            "-subj", "/CN=" + name])
        run(["x509", "-req", "-in", name + ".csr", "-CA", ca_name + ".pem",
             "-CAkey", ca_name + ".key", "-CAcreateserial", "-out",
             name + ".pem", "-days", "2", "-extfile", name + ".ext"])

    ca("ca")
    ca("rogue-ca")
    leaf("server", "ca",
         "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth")
    leaf("client", "ca", "extendedKeyUsage=clientAuth")
    leaf("rogue", "rogue-ca", "extendedKeyUsage=clientAuth")


class TlsTest(LeapdFixture):
    """leap_shim.Client's tls_ca_file / tls_cert_file / tls_key_file against
    a leapd whose TCP listener speaks mutual TLS (--tls_cert, --tls_key,
    --tls_client_ca); the readout is set up over its plaintext unix
    socket."""

    def leapd_args(self):
        make_certificates(self.dir)
        return ["--listen=127.0.0.1:0",
                "--tls_cert=" + self.cert("server.pem"),
                "--tls_key=" + self.cert("server.key"),
                "--tls_client_ca=" + self.cert("ca.pem")]

    def cert(self, name):
        return os.path.join(self.dir, name)

    def tls_client(self, engine_id, cert=None, ca="ca.pem"):
        tls = {}
        if ca is not None:
            tls["tls_ca_file"] = self.cert(ca)
        if cert is not None:
            tls["tls_cert_file"] = self.cert(cert + ".pem")
            tls["tls_key_file"] = self.cert(cert + ".key")
        c = leap_shim.Client(self.leapd.tcp, DIM, engine_id=engine_id,
                             min_backoff_s=0.02, max_backoff_s=0.2, **tls)
        self.addCleanup(c.close)
        return c

    def test_mutual_tls(self):
        """A client with the CA and a certificate signed by it connects and
        gets predictions equal to w . x + b; one with another CA's
        certificate, one without a certificate and one speaking plaintext
        never connect."""
        rogue = self.tls_client("py-tls-rogue", cert="rogue")
        anonymous = self.tls_client("py-tls-anonymous")
        plain = self.tls_client("py-tls-plain", ca=None)
        client = self.tls_client("py-tls", cert="client")
        self.assertTrue(client.wait_connected(DEADLINE_S),
                        "the client with a certificate never connected")
        ev = Events(client)
        v, w = self.weights()
        x = self.rows([0.5, -0.5])
        client.capture(x, ["t0", "t1"])
        ids = {"t0", "t1"}
        self.assertTrue(ev.wait_for(
            lambda a: len(latest(a, ids, ("prediction",))) == len(ids)),
            "no predictions over TLS")
        got = latest(ev.all, ids, ("prediction",))
        self.assert_scores(got, {"t0": x[0], "t1": x[1]}, w, v.bias)
        # By now the refused clients have had as many attempts as the good
        # one needed and more; none of them ever got a session.
        for c in (rogue, anonymous, plain):
            self.assertEqual(c.stats["connects"], 0, c.stats)
            self.assertFalse(c.connected)


class BadInputTest(unittest.TestCase):
    """Validation happens before any I/O: no leapd needed."""

    def setUp(self):
        self.client = leap_shim.Client(
            "unix://" + os.path.join(tempfile.gettempdir(), "no-leapd.sock"),
            DIM, dtype="bfloat16")
        self.addCleanup(self.client.close)

    def test_tensor_errors(self):
        c = self.client
        ok = torch.zeros(2, DIM)
        cases = [
            (TypeError, "supports DLPack", [[0.0] * DIM] * 2),
            (TypeError, "got int64", torch.zeros(2, DIM, dtype=torch.int64)),
            (TypeError, "got float64", torch.zeros(2, DIM, dtype=torch.float64)),
            (ValueError, "2-D .* got 1-D", torch.zeros(DIM)),
            (ValueError, "2-D .* got 3-D", torch.zeros(2, 1, DIM)),
            (ValueError, "expected 64 columns, got 63", torch.zeros(2, DIM - 1)),
            (ValueError, "positive strides",
             torch.zeros(1, DIM).expand(2, DIM)),
        ]
        for exc, regex, tensor in cases:
            with self.subTest(regex=regex):
                with self.assertRaisesRegex(exc, regex):
                    c.capture(tensor, ["x", "y"])
        with self.assertRaisesRegex(ValueError, "2 rows, got 3 request ids"):
            c.capture(ok, ["x", "y", "z"])
        with self.assertRaises(TypeError):
            c.capture(ok, "xy")  # a str is not a list of ids
        with self.assertRaisesRegex(ValueError, "one max_tokens per request"):
            c.capture(ok, ["x", "y"], max_tokens=[1])
        with self.assertRaisesRegex(ValueError, "max_tokens must be >= 0"):
            c.capture(ok, ["x", "y"], max_tokens=-1)
        with self.assertRaisesRegex(ValueError, "stream"):
            c.capture(ok, ["x", "y"], stream=0)
        # Nothing of the above was submitted.
        self.assertEqual(c.stats["live"], 0)

    def test_priors_fail_open_without_leapd(self):
        """No leapd: request_priors returns at once, drops the queries and
        no 'prior' event ever comes (FCFS admission); its argument errors
        are still raised."""
        c = self.client
        c.request_priors(["x", "y"], prompt_tokens=[10, 20])
        st = c.stats
        self.assertEqual(st["priors_dropped"], 2)
        self.assertTrue(st["degraded"])
        self.assertFalse(any(e.kind == "prior" for e in c.poll()))
        with self.assertRaisesRegex(ValueError, "prompt_tokens must be >= 1"):
            c.request_priors(["x"], prompt_tokens=0)
        with self.assertRaisesRegex(ValueError, "one prompt_tokens per request"):
            c.request_priors(["x", "y"], prompt_tokens=[1])
        with self.assertRaisesRegex(ValueError, "max_tokens must be >= 0"):
            c.request_priors(["x"], prompt_tokens=5, max_tokens=-2)

    def test_rejected_capsules_are_not_consumed(self):
        c = self.client
        data = np.zeros((3, DIM), np.float32)
        for kw, exc, regex in [
                (dict(shape=[3, DIM, 1]), ValueError, "3-D"),
                (dict(shape=[3, DIM], dtype=(0, 32)), TypeError, "int32"),
                (dict(shape=[3, DIM], device_type=4), ValueError, "opencl"),
                (dict(shape=[3, DIM - 1]), ValueError, "63")]:
            with self.subTest(kw=kw):
                hand = HandMadeCapsule(data, **kw)
                with self.assertRaisesRegex(exc, regex):
                    c.capture(hand.capsule, ["x", "y", "z"])
                self.assertEqual(hand.name(), "dltensor")
                self.assertEqual(hand.deleted, 0)
        hand = HandMadeCapsule(data, shape=[3, DIM])
        with self.assertRaisesRegex(ValueError, "one request id per row"):
            c.capture(hand.capsule, ["x"])
        self.assertEqual((hand.name(), hand.deleted), ("dltensor", 0))
        # Accepted now: consumed, released at once.
        c.capture(hand.capsule, ["x", "y", "z"])
        self.assertEqual((hand.name(), hand.deleted), ("used_dltensor", 1))
        # Another capsule name.
        other = _capsule_new(ctypes.addressof(hand.managed), b"dltensor_versioned", None)
        with self.assertRaisesRegex(TypeError, "dltensor_versioned"):
            c.capture(other, ["x"])

    def test_cuda_tensor_without_cuda_capture(self):
        if leap_shim.cuda_capture_available():
            self.skipTest("this process can capture CUDA tensors")
        data = np.zeros((1, DIM), np.float32)
        hand = HandMadeCapsule(data, shape=[1, DIM], device_type=2,
                               data=0x1000)
        with self.assertRaisesRegex(RuntimeError, "cuda:0.*no CUDA capture"):
            self.client.capture(hand.capsule, ["x"])
        self.assertEqual((hand.name(), hand.deleted), ("dltensor", 0))

    def test_option_and_call_errors(self):
        with self.assertRaisesRegex(ValueError, "dim must be in"):
            leap_shim.Client("unix:///nowhere", 0)
        with self.assertRaisesRegex(ValueError, "dtype must be"):
            leap_shim.Client("unix:///nowhere", DIM, dtype="int8")
        self.assertEqual(
            leap_shim.Client("unix:///nowhere", DIM, dtype=str(torch.float16)).dtype,
            "float16")
        with self.assertRaisesRegex(ValueError, "reason must be"):
            self.client.complete("x", 10, "done")
        with self.assertRaisesRegex(ValueError, "output_tokens"):
            self.client.complete("x", -1)
        with self.assertRaisesRegex(ValueError, "max must be"):
            self.client.poll(max=-1)
        with self.assertRaisesRegex(ValueError, "timeout_s"):
            self.client.poll(timeout_s=-1.0)
        # Endpoints leapd does not speak are refused, with the forms it does.
        for bad, why in (("http://foo", "scheme 'http'"),
                         ("https://foo:443", "scheme 'https'"),
                         ("foo", "no port"),
                         ("shm://relative/path", "absolute path")):
            with self.assertRaisesRegex(ValueError, why) as cm:
                leap_shim.Client(bad, DIM)
            self.assertIn("unix:///path/to/leapd.sock", str(cm.exception))
        # Not connected: wait_connected answers False at its deadline, and
        # the client says it is degraded (fail-open: nothing waits).
        self.assertFalse(self.client.wait_connected(0.05))
        self.assertFalse(self.client.connected)
        self.assertTrue(self.client.degraded)
        self.assertTrue(self.client.stats["degraded"])
        self.assertTrue(self.client.stats["degraded_reason"])
        with leap_shim.Client("unix:///nowhere", DIM) as c:
            self.assertEqual((c.dim, c.dtype), (DIM, "float32"))
        self.assertTrue(c.closed)

    def test_client_option_errors(self):
        """instance_id, engine_id, model_id, response_timeout_s, shm_slots
        and shm_ring_bytes: a bad value is a ValueError naming the option,
        the value and the allowed range (before any I/O)."""
        def raises(msg, **kw):
            with self.assertRaises(ValueError) as cm:
                leap_shim.Client("unix:///nowhere", DIM, **kw)
            self.assertEqual(str(cm.exception), msg)

        raises("instance_id must be at most 128 bytes without NUL, got 129 bytes",
               instance_id="i" * 129)
        raises("instance_id must be at most 128 bytes without NUL, got 3 bytes with a NUL",
               instance_id="a\0b")
        # leapd's bound on a hello's ids, in its words (docs/WIRE.md, "Sizes").
        for field, n in (("engine_id", 257), ("model_id", 70000)):
            raises('%s of %d bytes is over the limit of 256 bytes (it starts "%s")'
                   % (field, n, "x" * 32), **{field: "x" * n})
        for bad in (0.0, -1.0, float("nan")):
            raises("response_timeout_s must be > 0 seconds, got %s" % (
                "nan" if bad != bad else "%g" % bad), response_timeout_s=bad)
        for bad in (0, -1, (1 << 20) + 1, 1 << 40):
            raises("shm_slots must be in [1, 1048576], got %d" % bad, shm_slots=bad)
        for bad in (0, 1000, 3 * 65536, 1 << 27, -65536, 1 << 40):
            raises("shm_ring_bytes must be a power of two in [65536, 67108864], "
                   "got %d" % bad, shm_ring_bytes=bad)
        with leap_shim.Client("unix:///nowhere", DIM, instance_id="i" * 128,
                              engine_id="e" * 256, model_id="m" * 256,
                              response_timeout_s=0.5, shm_slots=1 << 20,
                              shm_ring_bytes=1 << 26) as c:
            self.assertEqual((c.instance_id, c.response_timeout_s, c.shm_slots,
                              c.shm_ring_bytes), ("i" * 128, 0.5, 1 << 20, 1 << 26))
        self.assertEqual(c.instance_id, "i" * 128)  # still readable after close

    def test_tls_option_errors(self):
        """TLS files are read when the client starts: a missing one, or a
        certificate without its key, is a ValueError naming it."""
        d = temp_dirs.make("leap_shim_tls")
        self.addCleanup(shutil.rmtree, d, True)
        missing = os.path.join(d, "missing-ca.pem")
        with self.assertRaisesRegex(ValueError, "cannot read TLS file .*missing-ca.pem"):
            leap_shim.Client("127.0.0.1:1", DIM, tls_ca_file=missing)
        pem = os.path.join(d, "some.pem")
        with open(pem, "w") as f:
            f.write("-----BEGIN CERTIFICATE-----\n")
        with self.assertRaisesRegex(ValueError, "tls_cert_file and tls_key_file go together"):
            leap_shim.Client("127.0.0.1:1", DIM, tls_cert_file=pem)
        with self.assertRaisesRegex(ValueError, "tls_cert_file and tls_key_file go together"):
            leap_shim.Client("127.0.0.1:1", DIM, tls_key_file=pem)

    def test_scheduler_errors(self):
        with self.assertRaisesRegex(ValueError, "slots must be >= 1"):
            leap_shim.Scheduler(slots=0)
        with self.assertRaisesRegex(ValueError, "unpredicted must be"):
            leap_shim.Scheduler(unpredicted="random")
        with self.assertRaisesRegex(ValueError, "aging_rate"):
            leap_shim.Scheduler(aging_rate=-1.0)
        with self.assertRaisesRegex(ValueError, "policy must be"):
            leap_shim.Scheduler(policy="fifo")
        with self.assertRaisesRegex(ValueError, "max_slowdown"):
            leap_shim.Scheduler(policy="bounded", max_slowdown=0.5)
        # The tail bound: a long request admitted first is served before
        # later short ones once its deadline (S x its FCFS latency) nears.
        b = leap_shim.Scheduler(slots=1, waiting_cap=0, policy="bounded",
                                max_slowdown=2.0)
        b.add("long")
        b.set_prediction("long", 10.0)
        served = []
        for step in range(40):
            b.add(f"s{step}")
            b.set_prediction(f"s{step}", 1.0)
            served += b.select()
            if served[-1] != "long":
                b.remove(served[-1])  # a short one is done
        # Deadline 0 + 2 * 10 = 20: it runs its 10 tokens by step 20.
        self.assertEqual(served[:20].count("long"), 10)
        c = leap_shim.Scheduler(slots=1, waiting_cap=0)
        c.add("long")
        c.set_prediction("long", 10.0)
        served = []
        for step in range(40):
            c.add(f"s{step}")
            c.set_prediction(f"s{step}", 1.0)
            served += c.select()
            if served[-1] != "long":
                c.remove(served[-1])
        self.assertNotIn("long", served)  # the countdown starves it
        s = leap_shim.Scheduler()
        s.add("a")
        with self.assertRaises(ValueError):
            s.add("a")
        with self.assertRaises(KeyError):
            s.remove("b")
        with self.assertRaises(KeyError):
            s.request("b")
        with self.assertRaisesRegex(ValueError, "finite and >= 0"):
            s.set_prediction("a", -3.0)
        s.set_prediction("a", 3.0)
        with self.assertRaises(RuntimeError):
            s.set_prediction("a", 4.0)  # a newer value goes through rescore
        with self.assertRaisesRegex(TypeError, "leap_shim.Event"):
            s.apply([("prediction", "a", 5.0)])
        # A prior before prefill places a request until its prediction.
        p = leap_shim.Scheduler(slots=1, waiting_cap=0)
        for rid in ("x", "y", "z"):
            p.add(rid)
        p.set_prediction("x", 50.0)
        p.set_prior("y", 10.0)  # z has none: the median (x's 50)
        self.assertEqual(p.select(), ["y"])
        p.set_prediction("y", 500.0)  # the prediction replaces the prior
        p.set_prior("y", 1.0)         # ignored once predicted
        self.assertEqual(p.select(), ["x"])
        with self.assertRaises(KeyError):
            p.set_prior("nope", 1.0)
        with self.assertRaisesRegex(ValueError, "finite and >= 0"):
            p.set_prior("z", -1.0)
        with self.assertRaisesRegex(ValueError, "kind must be"):
            leap_shim.Event("guess")


class SchedulerTest(unittest.TestCase):
    """apply() + select() against a brute-force countdown."""

    def test_apply_and_select_match_brute_force(self):
        import random
        rng = random.Random(11)
        slots, n, steps = 3, 12, 25
        s = leap_shim.Scheduler(slots=slots, waiting_cap=0, unpredicted="last")
        ids = ["q%02d" % i for i in range(n)]
        for rid in ids:
            s.add(rid)
        pred, ver, gen = {}, {}, dict.fromkeys(ids, 0)
        for step in range(steps):
            # Some events, some of them stale (an older version).
            events = []
            for rid in rng.sample(ids, 4):
                v = rng.randint(1, 6)
                tokens = float(rng.randint(1, 60))
                kind = rng.choice(["prediction", "rescore"])
                events.append(leap_shim.Event(kind, rid, tokens, version=v))
                if v >= ver.get(rid, 0):
                    pred[rid], ver[rid] = tokens, v
            events.append(leap_shim.Event("error", "q00", code=3))
            events.append(leap_shim.Event("prediction", "unknown", 5.0))
            s.apply(events)
            predicted = [r for r in ids if r in pred]
            unpredicted = [r for r in ids if r not in pred]
            want = sorted(predicted, key=lambda r: (
                max(pred[r] - gen[r], 1.0), ids.index(r)))
            want = (want + unpredicted)[:slots]
            self.assertEqual(s.select(), want, "step %d" % step)
            for r in want:
                gen[r] += 1
        self.assertEqual(s.counters["steps"], steps)
        self.assertEqual(s.counters["selections"], steps * slots)
        self.assertEqual(len(s), n)
        self.assertIn("q01", s)
        self.assertEqual(s.request("q01")["generated"], gen["q01"])


@unittest.skipUnless(torch.cuda.is_available(),
                     "needs a CUDA torch and a CUDA device")
class CudaCaptureTest(LeapdFixture):
    """CUDA tensors: copied on a side stream after the producer's stream,
    shipped from a host callback; values checked like the CPU ones."""

    def test_cuda_capture(self):
        if not leap_shim.cuda_capture_available():
            self.skipTest("leap_shim built without CUDA capture")
        client = self.client()
        ev = Events(client)
        learn = self.rows([1.0, -1.0])
        client.capture(learn, ["a0", "a1"])
        self.assertTrue(ev.wait_for(lambda a: len(
            latest(a, {"a0", "a1"}, ("prediction",))) == 2))
        client.complete("a0", 900)
        client.complete("a1", 25)
        self.assertIsNotNone(self.wait_learned(2))
        version, w = self.weights()

        expected = {}
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = self.rows([0.5, -0.25, 0.75]).cuda().to(torch.bfloat16)
            y = (x.float() * 1.0).to(torch.bfloat16)  # still on `side`
            client.capture(y, ["c0", "c1", "c2"],
                           stream=torch.cuda.current_stream().cuda_stream)
        wide = torch.zeros(2, 2 * DIM, device="cuda")
        wide[:, 1::2] = self.rows([0.1, -0.6]).cuda()
        client.capture(wide[:, 1::2], ["d0", "d1"])  # legacy default stream
        client.flush()
        self.assertEqual(client.stats["cuda_captures_in_flight"], 0)
        for rid, row in zip(["c0", "c1", "c2"], y.float().cpu()):
            expected[rid] = row
        for rid, row in zip(["d0", "d1"], wide[:, 1::2].cpu()):
            expected[rid] = row
        ids = set(expected)
        self.assertTrue(ev.wait_for(lambda a: len(
            latest(a, ids, ("prediction",))) == len(ids)))
        got = latest(ev.all, ids, ("prediction",))
        self.assertEqual({e.version for e in got.values()}, {version.version})
        self.assert_scores(got, expected, w, version.bias)


def main():
    global ARGS
    ARGS = test_main.parse_args(__doc__, "leapd", "proto-dir", "module-dir")
    test_main.run()


if __name__ == "__main__":
    main()
