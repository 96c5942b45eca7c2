"""scripts/tail-frontier on hand-made `leapctl replay --json` runs: the gain
share, the target check, the curve comparison with and without
--knob-points, --min-span, --window-p99, and the error on a run without
window_p99_latency. Test-only."""

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                      "scripts", "tail-frontier")

# FCFS 100 ms/token, the oracle 50: gain = (100 - PTL) / 50.
ROWS = {
    # policy: (mean_ptl, p99_latency, window_p99_latency)
    "fcfs": (100.0, 100.0, 100.0),
    "oracle": (50.0, 200.0, 200.0),
    "leap": (55.0, 300.0, 300.0),              # gain 0.9 at 3.0x
    "leap+target=1.2": (52.5, 100.0, 100.0),   # 0.95 at 1.0x
    "leap+target=1.5": (75.0, 140.0, 140.0),   # 0.5 at 1.4x
    "leap+target=2": (70.0, 150.0, 150.0),     # 0.6 at 1.5x
    "leap+aging=0.01": (65.0, 145.0, 145.0),   # 0.7 at 1.45x
    "leap+hrrn": (54.0, 140.0, 160.0),         # 0.92 at 1.4x, 1.6x per period
}


def run_json(rows, drop_window=False):
    out = []
    for policy, (ptl, p99, window) in rows.items():
        r = {"policy": policy, "load": 1.0, "mean_ptl": ptl,
             "p90_latency": p99 / 2, "p95_latency": p99 / 1.5,
             "p99_latency": p99, "mean_ttft": 0.1, "throughput": 1000.0,
             "long_p95_latency": None}
        if not drop_window:
            r["window_p99_latency"] = window
        out.append(r)
    return out


class TailFrontierTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory(prefix="tail-frontier-")
        self.path = os.path.join(self.dir.name, "t.json")
        with open(self.path, "w") as f:
            json.dump(run_json(ROWS), f)

    def tearDown(self):
        self.dir.cleanup()

    def frontier(self, *flags, path=None):
        p = subprocess.run(
            [sys.executable, SCRIPT, "--target-loads", "1.0", *flags,
             "t=" + (path or self.path)],
            capture_output=True, text=True)
        return p.returncode, p.stdout, p.stderr

    def line(self, out, prefix):
        for l in out.splitlines():
            if l.strip().startswith(prefix):
                return l
        self.fail(f"no line starting {prefix!r} in:\n{out}")

    def test_gain_share_and_the_target_check(self):
        rc, out, err = self.frontier()
        self.assertEqual(rc, 0, err)
        self.assertRegex(self.line(out, "leap+target=1.2 "),
                         r"0\.950 at 1\.00x .*window 1\.00x MEETS")
        # Gain 0.92 >= 0.9 x 0.9, P99 1.4x: met over the whole run.
        self.assertRegex(self.line(out, "leap+hrrn "),
                         r"0\.920 at 1\.40x .*window 1\.60x MEETS")
        self.assertNotIn("MEETS", self.line(out, "leap  "))         # 3.0x
        self.assertNotIn("MEETS", self.line(out, "leap+target=1.5 "))  # gain
        misses = out[out.index("misses over 1"):]
        self.assertRegex(misses, r"leap\s+1\s+t@1")
        self.assertRegex(misses, r"leap\+hrrn\s+0\s*\n")

    def test_curve_interpolated_and_with_knob_points(self):
        # In X order the target's curve runs 1.0x -> 1.4x -> 1.5x; at 1.45x
        # only the last segment spans: 0.5 + 0.1 x 0.5 = 0.55 < 0.7 - 0.01.
        rc, out, err = self.frontier()
        self.assertEqual(rc, 0, err)
        self.assertIn("leap+aging=0.01: BEHIND 0.550 vs 0.700 at 1.45x",
                      self.line(out, "target:"))
        self.assertIn("under the aging curve: 0 (n/c 3)", out)
        # X = 1.2 at 1.0x with 0.95 is on the curve at 1.45x too.
        rc, out, err = self.frontier("--knob-points")
        self.assertEqual(rc, 0, err)
        self.assertIn("leap+aging=0.01: ok 0.950 vs 0.700",
                      self.line(out, "target:"))
        # The aging curve is a single point: the target's points at other
        # P99 ratios are not comparable with it, with or without the flag.
        self.assertIn("under the aging curve: 0 (n/c 3)", out)

    def test_knob_points_only_where_a_segment_spans(self):
        # HRRN at 0.9x lies below every segment of the target's curve
        # (1.0x-1.5x): not comparable, with the flag too.
        rows = dict(ROWS)
        rows["leap+hrrn"] = (54.0, 90.0, 90.0)
        path = os.path.join(self.dir.name, "low.json")
        with open(path, "w") as f:
            json.dump(run_json(rows), f)
        for flags in ([], ["--knob-points"]):
            rc, out, err = self.frontier(*flags, path=path)
            self.assertEqual(rc, 0, err)
            self.assertIn("leap+hrrn: n/c", self.line(out, "target:"), flags)

    def test_min_span_checks_only_the_tail_where_there_is_no_gain(self):
        # The oracle within 0.5% of FCFS: the "gain" shares divide noise.
        rows = {"fcfs": (100.0, 100.0, 100.0),
                "oracle": (99.5, 100.0, 100.0),
                "leap": (99.0, 160.0, 160.0),               # 2.0 at 1.6x
                "leap+target=1.45": (101.0, 140.0, 140.0)}  # -2.0 at 1.4x
        path = os.path.join(self.dir.name, "flat.json")
        with open(path, "w") as f:
            json.dump(run_json(rows), f)
        rc, out, err = self.frontier(path=path)
        self.assertEqual(rc, 0, err)
        self.assertRegex(self.line(out, "leap+target=1.45 "), r"-2\.000 at 1\.40x")
        self.assertNotIn("MEETS", self.line(out, "leap+target=1.45 "))
        rc, out, err = self.frontier("--min-span", "0.01", path=path)
        self.assertEqual(rc, 0, err)
        self.assertRegex(self.line(out, "leap+target=1.45 "),
                         r"- at 1\.40x .*MEETS")
        self.assertNotIn("MEETS", self.line(out, "leap  "))  # 1.6x
        # Above the span the gain is checked again.
        rc, out, err = self.frontier("--min-span", "0.004", path=path)
        self.assertEqual(rc, 0, err)
        self.assertNotIn("MEETS", self.line(out, "leap+target=1.45 "))

    def test_window_p99_judges_per_period(self):
        rc, out, err = self.frontier("--window-p99")
        self.assertEqual(rc, 0, err)
        hrrn = self.line(out, "leap+hrrn ")
        self.assertRegex(hrrn, r"0\.920 at 1\.60x")
        self.assertNotIn("MEETS", hrrn)
        self.assertNotIn("window", hrrn)  # the ratio is the P99 column now
        misses = out[out.index("misses over 1"):]
        self.assertRegex(misses, r"leap\+hrrn\s+1\s+t@1")

    def test_window_p99_needs_the_field(self):
        path = os.path.join(self.dir.name, "old.json")
        with open(path, "w") as f:
            json.dump(run_json(ROWS, drop_window=True), f)
        rc, out, _ = self.frontier(path=path)
        self.assertEqual(rc, 0)  # without the flag an older run still reads
        self.assertNotIn("window", self.line(out, "leap+hrrn "))
        rc, _, err = self.frontier("--window-p99", path=path)
        self.assertNotEqual(rc, 0)
        self.assertIn("no window_p99_latency in the run", err)


if __name__ == "__main__":
    unittest.main(verbosity=2)
