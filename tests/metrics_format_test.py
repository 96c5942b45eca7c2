#!/usr/bin/python3
"""leapd's /metrics read as Prometheus does (text exposition format 0.0.4),
from a real leapd:

  - every line is a HELP, a TYPE or a sample line; every family has one
    HELP and one TYPE before its samples; names are valid;
  - conventions: counters end in _total; one unit per metric, in the name
    (a name that speaks of seconds or bytes ends in _seconds or _bytes,
    before _total for counters); no `unit` label; histograms have ascending
    `le` buckets ending in +Inf, _count equal to the +Inf bucket, a _sum;
  - every metric README.md documents (its "Metrics" paragraph) is served
    from the start, before any event, with the documented label values at
    zero; per-arm series once the arm served a request;
  - every quality gauge (*_spearman) has a *_samples gauge with the same
    labels, and arm gauges carry the readout label;
  - the latency histograms have buckets on both sides of, and close to,
    each alert threshold of deploy/prometheus/alerts.yaml;
  - leap_build_info{version,revision,build_type} = 1 and `leapd --version`
    print the CMake project version and build type.

Run: metrics_format_test.py --leapd PATH --leapctl PATH --source-dir DIR
         --version V --build-type T
"""

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import unittest
import urllib.request

import grpc
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import proto_stubs  # noqa: E402  (tests/support/proto_stubs.py)
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)

ARGS = None

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(r"(%s)(\{(.*)\})? (\S+)( \d+)?$" % NAME)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """{family: {"type", "help", "samples": [(name, labels, value)]}};
    raises AssertionError naming the first bad line."""
    families, current = {}, None
    for n, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            parts = line.split(" ", 3)
            assert len(parts) >= 3 and re.fullmatch(NAME, parts[2]), \
                "line %d: %r" % (n, line)
            fam = families.setdefault(parts[2], {"samples": []})
            key = "help" if parts[1] == "HELP" else "type"
            assert key not in fam, "line %d: second %s for %s" % (
                n, key, parts[2])
            assert not fam["samples"], "line %d: %s after samples" % (n, key)
            fam[key] = parts[3] if len(parts) > 3 else ""
            current = parts[2]
            continue
        assert not line.startswith("#"), "line %d: %r" % (n, line)
        m = SAMPLE.match(line)
        assert m, "line %d is no sample: %r" % (n, line)
        name, labels = m.group(1), {}
        if m.group(3):
            labels = dict(LABEL.findall(m.group(3)))
            rebuilt = ",".join('%s="%s"' % kv for kv in
                               LABEL.findall(m.group(3)))
            assert rebuilt == m.group(3).rstrip(","), \
                "line %d: bad labels %r" % (n, m.group(3))
        value = float(m.group(4))  # also NaN, +Inf
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        fam_name = current if name == current or base == current else None
        assert fam_name is not None, \
            "line %d: sample %s outside its family (%s)" % (n, name, current)
        families[fam_name]["samples"].append((name, labels, value))
    return families


class MetricsFormatTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = temp_dirs.make("leap_metrics")
        cls.stub_dir, cls.pb = proto_stubs.generate(
            os.path.join(ARGS.source_dir, "proto"), "leap_metrics_stubs_")
        t = cls.tmp
        run = lambda *a: subprocess.run([ARGS.leapctl] + list(a),
                                        capture_output=True, text=True)
        r = run("synth", "--out-features", t + "/f.npy", "--out-lengths",
                t + "/l.npy", "--n", "400", "--dim", "16", "--seed", "1")
        assert r.returncode == 0, r.stderr
        r = run("train", "--features", t + "/f.npy", "--lengths",
                t + "/l.npy", "--out", t + "/r.leapr")
        assert r.returncode == 0, r.stderr
        cls.proc = subprocess.Popen(
            [ARGS.leapd, "--listen=127.0.0.1:0",
             "--metrics_listen=127.0.0.1:0", "--data_dir=" + t + "/db",
             "--import=r=" + t + "/r.leapr"],
            stdout=subprocess.PIPE, text=True)
        cls.address = cls.metrics = None
        for line in cls.proc.stdout:
            if line.startswith("listening on "):
                cls.address = line.split()[2]
            if line.startswith("metrics on "):
                cls.metrics = line.split()[2]
            if line.startswith("leapd ") and "ready" in line:
                break
        assert cls.metrics, "leapd printed no metrics address"
        cls.start = cls.scrape()
        r = run("feed", "--features", t + "/f.npy", "--lengths",
                t + "/l.npy", "--server", cls.address)
        assert r.returncode == 0, r.stderr
        # The feed returns once every completion is acknowledged; the RLS
        # thread may still be applying a backlog (counted when applied).
        # The event that says it is done: the version WatchReadout streams
        # once the last batch is applied (completions_learned; the RLS
        # thread counts leap_completions_total before it publishes).
        m = re.search(r"completions: learned (\d+)", r.stdout)
        assert m, r.stdout
        want = int(m.group(1))
        channel = grpc.insecure_channel(cls.address)
        stream = cls.pb["predictor_pb2_grpc"].PredictorStub(
            channel).WatchReadout(
                cls.pb["predictor_pb2"].WatchReadoutRequest(readout="r"),
                timeout=60)
        try:
            learned = -1
            for v in stream:
                learned = v.completions_learned
                if learned >= want:
                    break
            assert learned >= want, (
                "WatchReadout ended at learned %d of %d" % (learned, want))
        finally:
            stream.cancel()
            channel.close()
        cls.after = cls.scrape()

    @classmethod
    def tearDownClass(cls):
        cls.proc.send_signal(signal.SIGTERM)
        cls.proc.stdout.close()
        cls.proc.wait(timeout=60)
        temp_dirs.remove(cls.tmp)
        temp_dirs.remove(cls.stub_dir)

    @classmethod
    def scrape(cls):
        with urllib.request.urlopen(cls.metrics, timeout=30) as resp:
            ctype = resp.headers.get("Content-Type", "")
            assert ctype.startswith("text/plain"), ctype
            return resp.read().decode()

    def leap(self, text):
        fams = parse(text)
        return {k: v for k, v in fams.items() if k.startswith("leap_")}

    def test_text_format_and_conventions(self):
        for text in (self.start, self.after):
            for name, fam in self.leap(text).items():
                self.assertIn("help", fam, name)
                self.assertTrue(fam["help"], name + ": empty HELP")
                kind = fam.get("type")
                self.assertIn(kind, ("counter", "gauge", "histogram"), name)
                if kind == "counter":
                    self.assertTrue(name.endswith("_total"), name)
                else:
                    self.assertFalse(name.endswith("_total"), name)
                stem = name[:-len("_total")] if kind == "counter" else name
                for unit in ("seconds", "bytes"):
                    if unit in stem.split("_"):
                        self.assertTrue(stem.endswith("_" + unit),
                                        "%s: the unit goes last" % name)
                for latency_word in ("latency", "duration", "time"):
                    if latency_word in stem.split("_"):
                        self.assertTrue(stem.endswith("_seconds"), name)
                for _, labels, _ in fam["samples"]:
                    self.assertNotIn("unit", labels,
                                     name + ": one unit per metric")
                if kind == "histogram":
                    self.check_histogram(name, fam)

    def check_histogram(self, name, fam):
        series = {}
        for sname, labels, value in fam["samples"]:
            key = tuple(sorted((k, v) for k, v in labels.items()
                               if k != "le"))
            s = series.setdefault(key, {"buckets": []})
            if sname == name + "_bucket":
                s["buckets"].append((float(labels["le"]), value))
            elif sname == name + "_count":
                s["count"] = value
            elif sname == name + "_sum":
                s["sum"] = value
            else:
                self.fail("%s: stray sample %s" % (name, sname))
        for key, s in series.items():
            les = [le for le, _ in s["buckets"]]
            self.assertEqual(les, sorted(les), (name, key))
            self.assertEqual(les[-1], math.inf, (name, key))
            counts = [c for _, c in s["buckets"]]
            self.assertEqual(counts, sorted(counts), (name, key))
            self.assertEqual(s["count"], counts[-1], (name, key))
            self.assertIn("sum", s, (name, key))

    def documented(self):
        """(metric, {label: [values]}) from README.md's Metrics paragraph."""
        with open(os.path.join(ARGS.source_dir, "README.md")) as f:
            readme = f.read()
        start = readme.index("Metrics (`/metrics`)")
        end = readme.index("\n\n", start)
        para = readme[start:end]
        out = {}
        for m in re.finditer(r"`(leap_\w+)(\{([^}]*)\})?`", para):
            labels = {}
            for part in (m.group(3) or "").split(","):
                if not part:
                    continue
                k, _, vals = part.partition("=")
                labels[k.strip()] = [v.strip().strip('"')
                                     for v in vals.split("|") if v.strip()]
            out.setdefault(m.group(1), {}).update(labels)
        return out

    def test_documented_series_present_from_the_start(self):
        fams = self.leap(self.start)
        doc = self.documented()
        self.assertGreaterEqual(len(doc), 25, doc)
        # Served per arm once the arm served a request (README says so).
        per_arm = {"leap_arm_spearman", "leap_arm_spearman_samples"}
        for metric, labels in doc.items():
            if metric in per_arm:
                fam = self.leap(self.after).get(metric)
            else:
                fam = fams.get(metric)
            self.assertIsNotNone(fam, metric + " is not served from the start")
            self.assertTrue(fam["samples"], metric + " has no series")
            for label, values in labels.items():
                served = {l.get(label) for _, l, _ in fam["samples"]}
                self.assertNotIn(None, served, (metric, label))
                for v in values:
                    self.assertIn(v, served, (metric, label))
        # Counters with documented label values start at zero.
        for metric in ("leap_request_errors_total",
                       "leap_duplicate_completions_total",
                       "leap_shm_detached_total", "leap_outbox_dropped_total"):
            self.assertTrue(all(v == 0 for _, _, v in fams[metric]["samples"]),
                            metric)

    def test_quality_gauges_have_sample_counts(self):
        fams = self.leap(self.after)
        gauges = [n for n in fams if n.endswith("_spearman")]
        self.assertIn("leap_readout_spearman", gauges)
        self.assertIn("leap_arm_spearman", gauges)
        for g in gauges:
            samples = fams.get(g + "_samples")
            self.assertIsNotNone(samples, g)
            have = {tuple(sorted(l.items())) for _, l, _ in
                    samples["samples"]}
            for _, labels, value in fams[g]["samples"]:
                self.assertIn(tuple(sorted(labels.items())), have, g)
                self.assertIn("readout", labels, g)
        # After the feed (400 requests): the windows hold every learned
        # completion (censored ones are not judged).
        learned = [v for _, l, v in fams["leap_completions_total"]["samples"]
                   if l == {"readout": "r", "outcome": "learned"}]
        self.assertEqual(len(learned), 1)
        self.assertGreater(learned[0], 300)
        n = {tuple(sorted(l.items())): v for _, l, v in
             fams["leap_readout_spearman_samples"]["samples"]}
        self.assertEqual(n[(("readout", "r"),)], learned[0])
        arm = fams["leap_arm_spearman_samples"]["samples"]
        self.assertEqual(sum(v for _, _, v in arm), learned[0])

    def test_buckets_dense_around_alert_thresholds(self):
        with open(os.path.join(ARGS.source_dir, "deploy", "prometheus",
                               "alerts.yaml")) as f:
            rules = yaml.safe_load(f)["groups"][0]["rules"]
        fams = self.leap(self.after)
        checked = 0
        for rule in rules:
            m = re.search(r"histogram_quantile\([^,]+,.*?(leap_\w+)_bucket"
                          r".*\)\s*>\s*([0-9.e-]+)", rule["expr"])
            if not m:
                continue
            metric, threshold = m.group(1), float(m.group(2))
            les = sorted({float(l["le"]) for n, l, _ in
                          fams[metric]["samples"] if n.endswith("_bucket")})
            below = [le for le in les if le < threshold]
            above = [le for le in les if le > threshold and le != math.inf]
            self.assertIn(threshold, les, rule["alert"])
            # Neighbours within 25 % (below) and 50 % (above) of it.
            self.assertGreaterEqual(below[-1], 0.75 * threshold, rule["alert"])
            self.assertLessEqual(above[0], 1.5 * threshold, rule["alert"])
            checked += 1
        self.assertGreaterEqual(checked, 3)

    def test_build_info_and_version(self):
        fams = self.leap(self.start)
        info = fams["leap_build_info"]["samples"]
        self.assertEqual(len(info), 1)
        _, labels, value = info[0]
        self.assertEqual(value, 1)
        self.assertEqual(labels["version"], ARGS.version)
        self.assertEqual(labels["build_type"], ARGS.build_type)
        self.assertRegex(labels["revision"],
                         r"^([0-9a-f]{12}(-dirty)?|unknown)$")
        r = subprocess.run([ARGS.leapd, "--version"], capture_output=True,
                           text=True)
        self.assertEqual(r.returncode, 0)
        self.assertEqual(r.stdout.strip(), "leapd %s (revision %s, %s build)"
                         % (ARGS.version, labels["revision"],
                            ARGS.build_type))
        self.assertNotIn("NDEBUG", r.stdout)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leapd", required=True)
    parser.add_argument("--leapctl", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--build-type", required=True)
    ARGS, rest = parser.parse_known_args()
    result = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if result.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
