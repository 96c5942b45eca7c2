#!/usr/bin/python3
"""leapd refuses bad flag values before it opens any state: exit code 1 and
one line on stderr, "leapd: error: <message>", the message naming the flag,
what it must be and the value given (the fleet's ranges and files, the TLS
files, the retention counts). Each case is a real leapd process that ends at once (no NATS, no
store is opened).

Run: /usr/bin/python3 tests/leapd_flags_test.py --leapd PATH
"""

import argparse
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)

ARGS = None
DEADLINE_S = 30.0


class LeapdFlagsTest(unittest.TestCase):

    def setUp(self):
        self.dir = temp_dirs.make("leapd_flags_test")
        self.addCleanup(temp_dirs.remove, self.dir)
        self.fleet = ["--fleet=nats://127.0.0.1:4222", "--fleet_name=f",
                      "--fleet_member=m", "--data_dir=" + os.path.join(self.dir, "db")]

    def refused(self, args, message):
        r = subprocess.run([ARGS.leapd, "--listen=unix://" + os.path.join(self.dir, "s")] + args,
                           capture_output=True, text=True, timeout=DEADLINE_S)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertEqual(r.stderr, "leapd: error: " + message + "\n")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "db")), "no state opened")

    def test_fleet_ranges(self):
        for flag, bad, allowed in (("fleet_replicas", "9", "[1, 5]"),
                                   ("fleet_replicas", "0", "[1, 5]"),
                                   ("fleet_lease_ms", "299", "[300, 600000]"),
                                   ("fleet_lease_ms", "600001", "[300, 600000]"),
                                   ("fleet_version_interval_ms", "-1", "[0, 3600000]"),
                                   ("fleet_version_interval_ms", "3600001", "[0, 3600000]"),
                                   ("fleet_checkpoint_every_s", "0", "[1, 86400]"),
                                   ("fleet_checkpoint_every_s", "86401", "[1, 86400]")):
            with self.subTest(flag=flag, value=bad):
                self.refused(self.fleet + ["--%s=%s" % (flag, bad)],
                             "--%s must be in %s, got %s" % (flag, allowed, bad))

    def test_retention(self):
        for flag, bad, data_dir in (("versions_kept", "0", False),
                                    ("versions_kept", "-5", False),
                                    ("versions_kept", "0", True),
                                    ("checkpoints_kept", "0", True),
                                    ("checkpoints_kept", "-1", True)):
            with self.subTest(flag=flag, value=bad, data_dir=data_dir):
                args = ["--data_dir=" + os.path.join(self.dir, "db")] if data_dir else []
                self.refused(args + ["--%s=%s" % (flag, bad)],
                             "--%s must be >= 1, got %s" % (flag, bad))

    def test_versions_kept_below_checkpoint_every_batches(self):
        """With --data_dir, recovery replays the log since the checkpoint
        in the batches of the versions published after it: they must all be
        kept (docs/STORAGE.md, "Recovery")."""
        db = "--data_dir=" + os.path.join(self.dir, "db")
        for kept, every in (("100", None), ("9", "10"), ("1", "2")):
            with self.subTest(versions_kept=kept, checkpoint_every_batches=every):
                args = [db, "--versions_kept=" + kept]
                if every is not None:
                    args.append("--checkpoint_every_batches=" + every)
                self.refused(args, "--versions_kept (%s) must be >= "
                             "--checkpoint_every_batches (%s) with --data_dir: "
                             "recovery replays the log since the newest checkpoint "
                             "in the batches of the versions published after it"
                             % (kept, every or "256"))
        # Equal is enough; without --data_dir, or in fleet mode (a member's
        # readouts serve only), nothing is replayed in batches. (A bad
        # --outbox_bytes, checked after them, stops leapd before it opens
        # anything, so its error shows these passed.)
        for args in ([db, "--versions_kept=10", "--checkpoint_every_batches=10"],
                     ["--versions_kept=5"],
                     self.fleet + ["--versions_kept=5"]):
            with self.subTest(args=args):
                self.refused(args + ["--outbox_bytes=0"], "--outbox_bytes must be >= 1")

    def test_unreadable_files(self):
        missing = os.path.join(self.dir, "missing.pem")
        for flag in ("fleet_creds", "fleet_tls_ca"):
            with self.subTest(flag=flag):
                self.refused(self.fleet + ["--%s=%s" % (flag, missing)],
                             "--%s=%s: cannot read: No such file or directory"
                             % (flag, missing))
        self.refused(["--tls_cert=" + missing, "--tls_key=" + missing],
                     "--tls_cert=%s: cannot read: No such file or directory" % missing)
        not_pem = os.path.join(self.dir, "cert.txt")
        with open(not_pem, "w") as f:
            f.write("hello\n")
        self.refused(["--tls_cert=" + not_pem, "--tls_key=" + not_pem],
                     "--tls_cert=%s: not a PEM file" % not_pem)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--leapd", required=True)
    ARGS, rest = p.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
