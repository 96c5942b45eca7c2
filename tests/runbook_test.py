#!/usr/bin/python3
"""Walks deploy/RUNBOOK.md: every ```sh runbook block, in order, in one bash
(set -euo pipefail), with a real leapctl and a real leapd.

There is no Kubernetes cluster here: `kubectl` is tests/runbook_kubectl.py,
which checks each cluster command against the objects the real
`kubectl kustomize` renders from the overlay and runs the real leapd with
the rendered leapd container's arguments (volumes mapped to directories,
TCP ports to 127.0.0.1). Placeholders substituted:
  - `export LEAP_SERVER=127.0.0.1:7070` -> the address the port-forward
    stand-in wrote (the pod's leapd, port 0 at its first start),
  - $HOME -> a temporary directory (the admin token lives under it),
  - the working directory: a temporary one with `deploy` linked to the
    repository's, and the .npy files the runbook trains from made with
    `leapctl synth` (d = 64).
Between two blocks the test also plays the engine (leapctl feed on product
line "chat") where the runbook says traffic flows, so versions advance and
both A/B arms have completions. Checks: each block exits 0 (the script
stops at the first failure and names the block), chosen outputs per block,
no command block in the runbook is left unmarked, and afterwards leapd
refuses admin calls without the token (so the runbook's calls did carry it).

Run: /usr/bin/python3 tests/runbook_test.py --leapd PATH --leapctl PATH
         --source-dir DIR [--kubectl PATH]
"""

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)

ARGS = None

BLOCK_OPEN = re.compile(r"^```(\S*)(?:\s+(\S+))?\s*$")
SERVER_EXPORT = "export LEAP_SERVER=127.0.0.1:7070"
SYNTH_MODEL = ["--dim", "64", "--signal", "1.6", "--model-seed", "7",
               "--domain", "chat", "--median", "300", "--log-sigma", "0.9"]


def parse_runbook(path, tag_wanted="runbook"):
    """Returns (blocks, unmarked): blocks as dicts {section, text, line}
    of the fences marked `tag_wanted`; unmarked: shell-looking fences marked
    neither `runbook` nor `runbook-fleet` (the fleet walk's)."""
    blocks, unmarked = [], []
    section = ""
    with open(path) as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        m = BLOCK_OPEN.match(line)
        if m and m.group(1):
            start = i
            body = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            lang, tag = m.group(1), m.group(2)
            if lang in ("sh", "bash", "shell", "console"):
                if tag == tag_wanted:
                    blocks.append({"section": section,
                                   "text": "\n".join(body),
                                   "line": start + 1})
                elif tag not in ("runbook", "runbook-fleet"):
                    unmarked.append(start + 1)
        i += 1
    return blocks, unmarked


def wait_exit(pid, timeout_s):
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout_s * 1000))
    finally:
        os.close(fd)



# The trainer-lost section's last block.
LAST_FLEET_BLOCK = ("leapctl versions chat --server $LEAP_SERVER\n"
                    "leapctl readouts get chat")
# Plays the engines on every fleet member (pods fleet-leap-N of the
# stand-in's state) and checks that all of them serve one version.
FLEET_HELPER = r"""
import json, os, re, subprocess, sys, time
state = os.environ["RUNBOOK_STATE"]
def addresses():
    with open(os.path.join(state, "cluster.json")) as f:
        c = json.load(f)
    out = {}
    for k, ports in sorted(c["ports"].items()):
        pod = k.split("/", 1)[1]
        if pod.startswith("fleet-leap-") and k in c["pods"]:
            out[pod] = "127.0.0.1:%d" % ports["7070"]
    return out
def leapctl(args):
    return subprocess.run([os.environ["LEAPCTL"]] + args, capture_output=True,
                          text=True, timeout=300)
def version(addr):
    r = leapctl(["readouts", "get", "chat", "--server", addr])
    m = re.search(r"version: (\d+)", r.stdout)
    return int(m.group(1)) if r.returncode == 0 and m else -1
before_file = os.path.join(state, "fleet_version_before_feed")
cmd = sys.argv[1]
if cmd == "feed":
    with open(before_file, "w") as f:
        f.write(str(version(addresses()["fleet-leap-0"])))
    # feed PREFIX: files PREFIX-<i>_features.npy / _lengths.npy, one per member
    total = 0
    for i, (pod, addr) in enumerate(addresses().items()):
        # Completions refused with UNAVAILABLE (a NATS stream electing its
        # leader after a node loss) are fed again, as an engine resends.
        deadline = time.monotonic() + 60
        while True:
            r = leapctl(["feed", "--features", "%s-%d_features.npy" % (sys.argv[2], i),
                         "--lengths", "%s-%d_lengths.npy" % (sys.argv[2], i),
                         "--product-line", "chat", "--server", addr, "--json"])
            if r.returncode == 0 or "UNAVAILABLE" not in r.stderr or \
                    time.monotonic() > deadline:
                break
            print("feed %s refused (UNAVAILABLE), again" % pod)
            # A resend's back-off, as an engine's: no event says when the
            # stream has its new leader (the RUNBOOK helper has only leapctl).
            time.sleep(0.5)
        if r.returncode != 0:
            sys.exit("feed %s: %s" % (pod, r.stderr))
        total += json.loads(r.stdout)["learned"]
    print("fed %s: learned %d" % (sys.argv[2], total))
elif cmd == "same-version":
    # Every member serves the same version: at least member 0's now, and
    # after a feed a newer one than before it (the fed completions learned).
    addrs = addresses()
    floor = version(addrs["fleet-leap-0"])
    if os.path.exists(before_file):
        with open(before_file) as f:
            floor = max(floor, int(f.read()) + 1)
        os.unlink(before_file)
    deadline = time.monotonic() + 60
    while True:
        vs = {pod: version(a) for pod, a in addrs.items()}
        if len(set(vs.values())) == 1 and min(vs.values()) >= floor:
            break
        if time.monotonic() > deadline:
            sys.exit("members disagree: %s" % vs)
        # Polled: the members install the version asynchronously, and this
        # RUNBOOK helper reads it the way an operator does, with `leapctl`,
        # which has no command that streams versions (WatchReadout).
        time.sleep(0.1)
    print("fleet version %d on %d members" % (min(vs.values()), len(vs)))
"""


class RunbookTest(unittest.TestCase):

    def setUp(self):
        self.tmp = temp_dirs.make("leap_runbook")
        self.work = os.path.join(self.tmp, "work")
        self.home = os.path.join(self.tmp, "home")
        self.state = os.path.join(self.tmp, "state")
        self.bin = os.path.join(self.tmp, "bin")
        for d in (self.work, self.home, self.state, self.bin):
            os.makedirs(d)
        os.symlink(os.path.join(ARGS.source_dir, "deploy"),
                   os.path.join(self.work, "deploy"))
        with open(os.path.join(self.bin, "kubectl"), "w") as f:
            f.write("#!/bin/sh\nexec /usr/bin/python3 %s \"$@\"\n" %
                    os.path.join(ARGS.source_dir, "tests",
                                 "runbook_kubectl.py"))
        os.chmod(os.path.join(self.bin, "kubectl"), 0o755)
        os.symlink(ARGS.leapctl, os.path.join(self.bin, "leapctl"))
        self.env = dict(os.environ)
        self.env.pop("LEAP_ADMIN_TOKEN_FILE", None)
        self.env.update({
            "PATH": self.bin + ":" + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.home, "RUNBOOK_STATE": self.state,
            "REAL_KUBECTL": ARGS.kubectl, "LEAPD": ARGS.leapd,
            "LEAPCTL": ARGS.leapctl, "KUBECONFIG": "/nonexistent"})

    def tearDown(self):
        cluster = os.path.join(self.state, "cluster.json")
        if os.path.exists(cluster):
            with open(cluster) as f:
                pods = json.load(f)["pods"]
            for pod in pods.values():
                try:
                    os.kill(pod["pid"], signal.SIGTERM)
                except ProcessLookupError:
                    continue
                if not wait_exit(pod["pid"], 60):
                    os.kill(pod["pid"], signal.SIGKILL)
        temp_dirs.remove(self.tmp)

    def leapctl(self, args, env=None):
        return subprocess.run([ARGS.leapctl] + args, cwd=self.work,
                              env=env or self.env, capture_output=True,
                              text=True, timeout=120)

    def synth(self, name, n, seed):
        r = self.leapctl(["synth", "--out-features", name + "_features.npy",
                          "--out-lengths", name + "_lengths.npy", "--n",
                          str(n), "--seed", str(seed)] + SYNTH_MODEL)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_walk_the_runbook(self):
        blocks, unmarked = parse_runbook(
            os.path.join(ARGS.source_dir, "deploy", "RUNBOOK.md"))
        self.assertEqual(unmarked, [],
                         "shell blocks in RUNBOOK.md not marked `sh runbook`"
                         " (every command must be one this test runs)")
        # Which procedures the runbook covers is checked below by what its
        # blocks do (install, import, snapshot, restart, rollback, freeze
        # and resume, A/B test, token rotation, disaster recovery), not by
        # its headings or its number of blocks.
        self.assertTrue(blocks, "no `sh runbook` block in RUNBOOK.md")

        # What the runbook trains from, and the engine's traffic.
        self.synth("chat", 3000, 1)
        self.synth("chat_heldout", 500, 2)
        self.synth("chat_new", 3000, 3)
        self.synth("traffic", 1200, 4)

        feed = ('"$LEAPCTL" feed --features traffic_features.npy '
                '--lengths traffic_lengths.npy --product-line chat '
                '--server "$LEAP_SERVER" --json > {out}')
        # Disaster: leapd crashes and its state on the volume is found
        # corrupt (its RocksDB MANIFEST overwritten); the kubelet restarts
        # the leapd container (here: the stand-in's pod start).
        crash = os.path.join(self.tmp, "crash_and_corrupt.py")
        with open(crash, "w") as f:
            f.write(CRASH_AND_CORRUPT)
        hooks = {
            # After the backups: the state is lost.
            "mkdir -p backups": '/usr/bin/python3 %s && kubectl -n leap '
                                'rollout restart statefulset/chat-leap '
                                '> hook-restart.txt' % crash,
            # After the first import and routes: the engine's traffic.
            "deploy/k8s/overlays/chat/routes.json --server": feed.format(
                out="hook-feed-1.json"),
            # After the A/B routes: traffic on both arms.
            "routes-ab.json": feed.format(out="hook-feed-ab.json"),
        }
        script = ["set -euo pipefail"]
        substituted = 0
        used_hooks = set()
        for i, b in enumerate(blocks):
            text = b["text"]
            if SERVER_EXPORT in text:
                text = text.replace(
                    SERVER_EXPORT,
                    'export LEAP_SERVER=$(cat "$RUNBOOK_STATE/address")')
                substituted += 1
            script += [f'echo "::block {i}"', text, f'echo "::end {i}"']
            for marker, hook in hooks.items():
                if marker in text and marker not in used_hooks:
                    used_hooks.add(marker)
                    script += [f'echo "::hook {i}"', hook]
        self.assertEqual(substituted, 1, "one `%s` expected" % SERVER_EXPORT)
        self.assertEqual(used_hooks, set(hooks))
        with open(os.path.join(self.tmp, "runbook.sh"), "w") as f:
            f.write("\n".join(script) + "\n")

        run = subprocess.run(["bash", os.path.join(self.tmp, "runbook.sh")],
                             cwd=self.work, env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=600)
        out = {}
        current = None
        ended = set()
        for line in run.stdout.split("\n"):
            m = re.fullmatch(r"::(block|end|hook) (\d+)", line)
            if m:
                if m.group(1) == "end":
                    ended.add(int(m.group(2)))
                    current = None
                else:
                    current = int(m.group(2))
                    out.setdefault(current, "")
                continue
            if current is not None:
                out[current] += line + "\n"
        failed = [i for i in range(len(blocks)) if i not in ended]
        if run.returncode != 0 or failed:
            i = failed[0] if failed else len(blocks) - 1
            self.fail("runbook block %d (RUNBOOK.md line %d, section '%s') "
                      "failed, exit %d:\n%s\n--- output:\n%s" % (
                          i, blocks[i]["line"], blocks[i]["section"],
                          run.returncode, blocks[i]["text"],
                          out.get(i, "") or run.stdout[-3000:]))

        def output_of(command):
            """Output of the first block that contains `command`."""
            for i, b in enumerate(blocks):
                if command in b["text"]:
                    return out[i]
            self.fail("no runbook block runs " + command)

        def outputs_of(command):
            return [out[i] for i, b in enumerate(blocks)
                    if command in b["text"]]

        self.assertIn("secret/leap-admin-token created",
                      output_of("create secret generic"))
        self.assertIn("statefulset/chat-leap created",
                      output_of("kubectl apply -k"))
        self.assertIn("roll out complete", output_of("rollout status"))
        self.assertIn("Forwarding from 127.0.0.1:7070 -> 7070",
                      output_of("port-forward"))
        # A fresh leapd has no readouts (install, and again after recovery).
        lists = outputs_of("leapctl readouts list")
        self.assertIn("no readouts", lists[0])
        self.assertIn("no readouts", lists[-1])
        first = output_of("leapctl import chat --artifact chat.leapr")
        self.assertIn("created readout chat version 1", first)
        self.assertIn("applied 2 route(s)", first)
        with open(os.path.join(self.work, "hook-feed-1.json")) as f:
            learned = json.load(f)["learned"]
        self.assertGreater(learned, 0)

        snap = output_of("leapctl snapshot create")
        self.assertIn("snapshot of readout chat taken", snap)
        m = re.search(r"exported readout chat version (\d+)", snap)
        self.assertIsNotNone(m, snap)
        snap_version = int(m.group(1))
        self.assertGreater(snap_version, 1)  # the traffic was learned
        # The restart kept the state (from the volume): leapd resumed at the
        # version it had, which holds every completion learned before it,
        # and published nothing for the restart.
        restarted = output_of("rollout restart")
        self.assertIn("statefulset.apps/chat-leap restarted", restarted)
        # The newest row of the version table (quality sections follow it).
        rows = [l for l in restarted.splitlines()
                if re.match(r"^\s*\d+\s+\d+\s+\d{4}-\d\d-\d\d", l)]
        self.assertTrue(rows, restarted)
        last = rows[-1]
        self.assertRegex(last, r"\s%d\s+\S+\s+rls\s" % learned)
        self.assertRegex(output_of("leapctl rollback"),
                         r"rolled readout chat back to snapshot before-rollout"
                         r" as version \d+")
        self.assertIn("rollback", output_of("leapctl rollback"))
        frozen = output_of("leapctl freeze chat")
        self.assertIn("froze readout chat", frozen)
        self.assertIn("frozen: yes", frozen)
        self.assertIn("resumed readout chat", output_of("leapctl resume"))

        ab = output_of("routes-ab.json")
        self.assertIn("created readout chat-candidate version 1", ab)
        with open(os.path.join(self.work, "ab-result.json")) as f:
            result = json.load(f)
        arms = {a["arm"]: a for a in result["arms"]
                if a["product_line"] == "chat"}
        self.assertEqual(set(arms), {"a", "b"}, result)
        self.assertEqual(arms["a"]["readout"], "chat")
        self.assertEqual(arms["b"]["readout"], "chat-candidate")
        for a in arms.values():
            self.assertGreater(a["completions"], 0, a)
        self.assertIn("deleted readout chat-candidate",
                      output_of("leapctl readouts delete"))

        # Disaster recovery: the readout is back at the exported version
        # and the routes are those saved.
        backup = output_of("mkdir -p backups")
        m = re.search(r"exported readout chat version (\d+)", backup)
        self.assertIsNotNone(m, backup)
        recovered = output_of("backups/routes.json --server")
        # leapd moved the corrupt state aside by itself and started empty;
        # nothing was scaled down.
        logs = output_of("logs chat-leap-0 -c leapd")
        self.assertRegex(logs, r"recovery: state in \S+/state cannot be "
                         r"recovered \(.*\); moved to \S+/state\.unrecoverable-"
                         r"\d{8}T\d{6}Z; starting with an empty state")
        for b in blocks:
            self.assertNotRegex(b["text"], r"scale .*--replicas=0",
                                "a runbook step scales serving down")
        self.assertIn("version: %s\n" % m.group(1), recovered)
        self.assertIn("applied 2 route(s)", recovered)

        # The leapd the runbook drove requires the token over TCP: the
        # commands above carried it.
        with open(os.path.join(self.state, "address")) as f:
            address = f.read().strip()
        refused = self.leapctl(["readouts", "list", "--server", address])
        self.assertEqual(refused.returncode, 1, refused.stdout)
        self.assertIn("UNAUTHENTICATED", refused.stderr)
        # ...and the rotated one: the file changed, the restarted leapd
        # accepts the new content.
        env = dict(self.env)
        env["LEAP_ADMIN_TOKEN_FILE"] = os.path.join(
            self.home, ".config", "leap", "admin.token")
        ok = self.leapctl(["route", "list", "--json", "--server", address],
                          env=env)
        self.assertEqual(ok.returncode, 0, ok.stderr)
        with open(os.path.join(self.state, "calls.log")) as f:
            calls = [json.loads(line) for line in f]
        self.assertIn(["apply", "-f", "-"], calls)

    def test_walk_the_fleet_sections(self):
        """The `sh runbook-fleet` blocks (fleet mode: 3 NATS pods, 3 leapd
        members), after Install's namespace and Secret."""
        install, _ = parse_runbook(
            os.path.join(ARGS.source_dir, "deploy", "RUNBOOK.md"))
        blocks, _ = parse_runbook(
            os.path.join(ARGS.source_dir, "deploy", "RUNBOOK.md"),
            "runbook-fleet")
        self.assertTrue(blocks, "no `sh runbook-fleet` block in RUNBOOK.md")
        secret = [b for b in install if "create secret generic" in b["text"]]
        sections = {b["section"] for b in blocks}
        for want in ("fleet: roll back a product line", "fleet: NATS node lost",
                     "fleet: trainer lost"):
            self.assertIn(want, sections)
        self.synth("chat", 3000, 1)
        hooks_fed = []
        for hook in range(4):
            for i in range(3):
                r = self.leapctl(["synth", "--out-features",
                                  "fleet%d-%d_features.npy" % (hook, i),
                                  "--out-lengths",
                                  "fleet%d-%d_lengths.npy" % (hook, i),
                                  "--n", "300", "--seed",
                                  str(100 + 10 * hook + i)] + SYNTH_MODEL)
                self.assertEqual(r.returncode, 0, r.stderr)
        helper = os.path.join(self.tmp, "fleet_members.py")
        with open(helper, "w") as f:
            f.write(FLEET_HELPER)
        members = "/usr/bin/python3 " + helper
        hooks = [
            # The engines' traffic on every member, then all serve one version.
            ("overlays/fleet/routes.json", ["feed fleet0", "same-version"]),
            ("snapshot list", ["feed fleet1", "same-version"]),
            ("leapctl rollback", ["same-version"]),
            ("delete pod fleet-nats-1", ["feed fleet2", "same-version"]),
            (LAST_FLEET_BLOCK, ["feed fleet3", "same-version"]),
        ]
        script = ["set -euo pipefail", secret[0]["text"]]
        used = set()
        for i, b in enumerate(blocks):
            text = b["text"].replace(
                SERVER_EXPORT,
                'export LEAP_SERVER=$(cat "$RUNBOOK_STATE/address")')
            script += [f'echo "::block {i}"', text, f'echo "::end {i}"']
            for marker, cmds in hooks:
                if marker in text and marker not in used:
                    used.add(marker)
                    script += [f'echo "::hook {i}"'] + [
                        f"{members} {c}" for c in cmds]
        self.assertEqual(used, {m for m, _ in hooks})
        with open(os.path.join(self.tmp, "fleet.sh"), "w") as f:
            f.write("\n".join(script) + "\n")
        run = subprocess.run(["bash", os.path.join(self.tmp, "fleet.sh")],
                             cwd=self.work, env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=900)
        out, hook_out = {}, {}
        current, target = None, out
        ended = set()
        for line in run.stdout.split("\n"):
            m = re.fullmatch(r"::(block|end|hook) (\d+)", line)
            if m:
                if m.group(1) == "end":
                    ended.add(int(m.group(2)))
                    current = None
                else:
                    current = int(m.group(2))
                    target = out if m.group(1) == "block" else hook_out
                    target.setdefault(current, "")
                continue
            if current is not None:
                target[current] += line + "\n"
        failed = [i for i in range(len(blocks)) if i not in ended]
        if run.returncode != 0 or failed:
            i = failed[0] if failed else len(blocks) - 1
            self.fail("fleet runbook block %d (RUNBOOK.md line %d, section "
                      "'%s') failed, exit %d:\n%s\n--- output:\n%s\n--- "
                      "hook:\n%s\n--- all:\n%s" % (
                          i, blocks[i]["line"], blocks[i]["section"],
                          run.returncode, blocks[i]["text"], out.get(i, ""),
                          hook_out.get(i - 1, ""), run.stdout[-4000:]))

        def index_of(command):
            for i, b in enumerate(blocks):
                if command in b["text"]:
                    return i
            self.fail("no fleet runbook block runs " + command)

        def fleet_version(i):
            m = re.search(r"fleet version (\d+) on 3 members", hook_out[i])
            self.assertIsNotNone(m, hook_out[i])
            return int(m.group(1))

        def learned(i):
            m = re.search(r"learned (\d+)", hook_out[i])
            self.assertIsNotNone(m, hook_out[i])
            return int(m.group(1))

        self.assertIn("statefulset/fleet-nats created",
                      out[index_of("kubectl apply -k deploy/k8s/overlays/fleet")])
        imported = index_of("overlays/fleet/routes.json")
        self.assertIn("created readout chat version 1", out[imported])
        self.assertGreater(learned(imported), 0)
        v_fed = fleet_version(imported)
        self.assertGreater(v_fed, 1)
        snap = index_of("snapshot list")
        self.assertIn("before-rollout", out[snap])
        rb = index_of("leapctl rollback")
        m = re.search(r"rolled readout chat back to snapshot before-rollout "
                      r"as version (\d+)", out[rb])
        self.assertIsNotNone(m, out[rb])
        # Every member serves the rollback's version.
        self.assertEqual(fleet_version(rb), int(m.group(1)))
        nats_lost = index_of("delete pod fleet-nats-1")
        self.assertIn('pod "fleet-nats-1" force deleted', out[nats_lost])
        self.assertGreater(learned(nats_lost), 0)
        self.assertGreater(fleet_version(nats_lost), fleet_version(rb))
        self.assertIn('pod "fleet-leap-0" force deleted',
                      out[index_of("delete pod fleet-leap-0")])
        last = index_of(LAST_FLEET_BLOCK)
        self.assertGreater(learned(last), 0)
        self.assertGreater(fleet_version(last), fleet_version(nats_lost))


CRASH_AND_CORRUPT = r"""
import glob, json, os, select, signal
state = os.environ["RUNBOOK_STATE"]
with open(os.path.join(state, "cluster.json")) as f:
    pods = json.load(f)["pods"]
pid = pods["leap/chat-leap-0"]["pid"]
exited = os.pidfd_open(pid)  # readable once the process has exited
os.kill(pid, signal.SIGKILL)
assert select.select([exited], [], [], 30)[0], "leapd did not die"
manifests = glob.glob(os.path.join(state, "pvc", "data-chat-leap-0", "state",
                                   "MANIFEST-*"))
assert manifests, "no RocksDB MANIFEST in the volume"
for m in manifests:
    size = os.path.getsize(m)
    with open(m, "r+b") as f:
        f.write(bytes([0xA5]) * size)
"""


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leapd", required=True)
    parser.add_argument("--leapctl", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--kubectl", default=shutil.which("kubectl"))
    ARGS, rest = parser.parse_known_args()
    if ARGS.kubectl is None:
        sys.exit("runbook_test: no kubectl on PATH (scripts/install-deps "
                 "installs Debian's kubernetes-client)")
    ARGS.leapd = os.path.abspath(ARGS.leapd)
    ARGS.leapctl = os.path.abspath(ARGS.leapctl)
    ARGS.source_dir = os.path.abspath(ARGS.source_dir)
    result = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if result.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
