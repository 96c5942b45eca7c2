#!/usr/bin/python3
"""Checks of deploy/ that need neither a cluster nor a Docker engine.

Kubernetes (every overlay rendered with the real `kubectl kustomize`, or,
without a kubectl whose kustomize is v4.1+, from the YAML sources):
  - leapd is a native sidecar (init container, restartPolicy: Always) and
    the engine a main container; every leapd flag in the manifest is one
    `leapd --help` documents;
  - both containers mount the memory-backed shared volume at the same path,
    leapd's unix socket is in it, and the engine's LEAP_ENDPOINT names it;
  - fail-open: leapd has no startup or readiness probe (a native
    sidecar's would gate the engine's start and the pod's readiness), only
    a liveness probe on the gRPC health service "liveness" on its --listen
    port; the engine's own probes never involve leapd's ports or tools; the
    engine container has ports, probes and a GPU;
  - the NetworkPolicy admits every engine port and opens leapd's ports only
    to named sources; `Parallel` pod management; per-container users (the
    engine keeps its image's), the sockets given to the pod's fsGroup;
  - the first readout comes from an init step before leapd into a volume
    leapd imports from optionally (no ConfigMap); no deprecated kustomize
    fields or warnings;
  - the volumeClaimTemplate is mounted at (or above) leapd's --data_dir;
  - the admin token Secret is mounted and --admin_token_file names the
    mounted key;
  - a restrictive securityContext (non-root with the image's uid, read-only
    root filesystem, no privilege escalation, all capabilities dropped);
  - memory request = limit, and the limit covers --feature_cache_bytes plus
    the measured peak of leapd with two d = 4096 readouts;
  - Prometheus annotations name the metrics port leapd listens on;
  - the routes files of each overlay (mounted as a ConfigMap) route its
    product line, and routes-ab.json splits it over two arms;
  - the overlays' selectors do not overlap;
  - fleet mode (overlays whose leapd has --fleet): --fleet names every pod
    of the overlay's NATS StatefulSet (headless service, client port),
    --fleet_replicas = 3 <= the odd number of NATS nodes, no --fleet_member
    (the pod name is the id); the NATS config (ConfigMap) routes to every
    node by DNS name, uses the declared ports, keeps JetStream on the PVC,
    names each server after its pod, and the real nats-server accepts it
    (`nats-server -t`); health probes; a PodDisruptionBudget of one; the
    NetworkPolicy lets the leap pods reach the client port.
Docker (deploy/docker/Dockerfile, no image is built; its commands are run
here instead of asserting its text):
  - the build stage's CMake configuration (the flags of its scripts/build
    run) succeeds, defines every file the stage installs, builds no test
    or benchmark, and every package it finds is in the list the stage's
    `install-deps` run prints (or their dependencies);
  - the runtime stage's `install-deps` list has no compiler or -dev
    package, is the only way it installs packages, and (with its
    dependencies and what every Debian image has) covers every library
    `ldd` shows for the built leapd and leapctl; it copies exactly leapd
    and leapctl from files the build stage installs; numeric non-root user;
  - ENTRYPOINT + CMD run with the built leapd (socket and data moved to a
    temporary directory, TCP ports to 0) use only documented flags, become
    ready and serve /metrics; EXPOSE declares exactly their TCP ports.
Prometheus (deploy/prometheus): the scrape job keeps the port name and
annotations the manifests use; every metric an alert (and the Grafana
dashboard, deploy/grafana) uses is one a real leapd serves on /metrics;
every alert is described in RUNBOOK.md.

Run: /usr/bin/python3 tests/deploy_test.py --leapd PATH --leapctl PATH
         --source-dir DIR [--kubectl PATH]
"""

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import unittest
import urllib.request

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "support"))
import temp_dirs  # noqa: E402  (tests/support/temp_dirs.py)

ARGS = None
KUSTOMIZE = None  # kubectl with kustomize v4.1+, or None (render_sources)

# Measured (deploy/k8s/README.md, "Sizing"): peak RSS of leapd holding two
# d = 4096 readouts through import, 5,000 fed requests, export, snapshot
# and rollback: VmHWM 734,204 kB.
MEASURED_PEAK_BYTES = 734204 * 1024
MIB = 1 << 20


def parse_quantity(q):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m, q
    return int(m.group(1)) * units.get(m.group(2), 1)


def flag_values(args, name):
    prefix = "--" + name + "="
    return [a[len(prefix):] for a in args if a.startswith(prefix)]


DEPRECATED_KUSTOMIZE_FIELDS = ("bases", "commonLabels",
                               "patchesStrategicMerge", "patchesJson6902",
                               "vars")


def kustomize_usable():
    """The real `kubectl kustomize` when it is there and new enough (v4.1+:
    `labels`, `patches`), else None: the manifests are then rendered from
    their YAML sources by render_sources()."""
    if ARGS.kubectl is None or shutil.which(ARGS.kubectl) is None:
        return None
    r = subprocess.run([ARGS.kubectl, "version", "--client"],
                       capture_output=True, text=True)
    m = re.search(r"Kustomize Version: v(\d+)\.(\d+)", r.stdout)
    if m is None or (int(m.group(1)), int(m.group(2))) < (4, 1):
        return None
    return ARGS.kubectl


def render(overlay):
    """The overlay's objects, and what kustomize wrote on stderr."""
    if KUSTOMIZE is None:
        return render_sources(overlay), ""
    r = subprocess.run([KUSTOMIZE, "kustomize", overlay],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AssertionError("kubectl kustomize %s failed:\n%s" %
                             (overlay, r.stderr))
    return [d for d in yaml.safe_load_all(r.stdout) if d], r.stderr


def merge_patch(base, patch):
    """Strategic merge of what the overlays' patches use: maps merged key by
    key, lists of named items merged by name (the patch's items first, as
    kustomize orders them), other lists replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge_patch(base[k], v) if k in base else v
        return out
    if (isinstance(base, list) and isinstance(patch, list) and
            all(isinstance(i, dict) and "name" in i for i in base + patch)):
        by_name = {i["name"]: i for i in base}
        out = [merge_patch(by_name[i["name"]], i) if i["name"] in by_name
               else i for i in patch]
        seen = {i["name"] for i in patch}
        return out + [i for i in base if i["name"] not in seen]
    return patch


def render_sources(overlay):
    """Without a usable kustomize: the overlay rendered from the YAML
    sources for the fields these tests read (resources, patches, name
    prefix, namespace, labels with their selectors, generated ConfigMaps and
    the references to them, images)."""
    with open(os.path.join(overlay, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    objects = []
    for res in k.get("resources", []) + k.get("bases", []):
        path = os.path.join(overlay, res)
        if os.path.isdir(path):
            objects += render_sources(path)
        else:
            with open(path) as f:
                objects += [d for d in yaml.safe_load_all(f) if d]
    patches = [(p["path"], p.get("target")) for p in k.get("patches", [])] + \
        [(p, None) for p in k.get("patchesStrategicMerge", [])]
    for path, target in patches:
        with open(os.path.join(overlay, path)) as f:
            patch = yaml.safe_load(f)
        if isinstance(patch, list):  # JSON 6902 operations on the target
            for o in objects:
                if (o["kind"], o["metadata"]["name"]) == (
                        target["kind"], target["name"]):
                    json6902(o, patch)
            continue
        for i, o in enumerate(objects):
            if (o["kind"], o["metadata"]["name"]) == (
                    patch["kind"], patch["metadata"]["name"]):
                objects[i] = merge_patch(o, patch)
    generated = {}
    for g in k.get("configMapGenerator", []):
        data = {}
        for f in g.get("files", []):
            with open(os.path.join(overlay, f)) as fh:
                data[os.path.basename(f)] = fh.read()
        for lit in g.get("literals", []):
            key, _, value = lit.partition("=")
            data[key] = value
        generated[g["name"]] = True
        objects.append({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": g["name"]}, "data": data})
    prefix = k.get("namePrefix", "")
    labels = dict(k.get("commonLabels", {}))
    for entry in k.get("labels", []):
        if entry.get("includeSelectors"):
            labels.update(entry["pairs"])
    images = {i["name"]: "%s:%s" % (i.get("newName", i["name"]),
                                    i.get("newTag", "latest"))
              for i in k.get("images", [])}
    for o in objects:
        if prefix:
            o["metadata"]["name"] = prefix + o["metadata"]["name"]
        if "namespace" in k:
            o["metadata"]["namespace"] = k["namespace"]
        o["metadata"].setdefault("labels", {}).update(labels)
        spec = o.get("spec", {})
        if o["kind"] == "StatefulSet":
            spec["selector"]["matchLabels"].update(labels)
            spec["template"]["metadata"]["labels"].update(labels)
            spec["serviceName"] = prefix + spec["serviceName"]
            pod = spec["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                c["image"] = images.get(c["image"], c["image"])
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref and ref["name"] in generated:
                        ref["name"] = prefix + ref["name"]
            for v in pod.get("volumes", []):
                if "configMap" in v and v["configMap"]["name"] in generated:
                    v["configMap"]["name"] = prefix + v["configMap"]["name"]
        elif o["kind"] == "Service":
            spec["selector"].update(labels)
        elif o["kind"] == "NetworkPolicy":
            spec["podSelector"]["matchLabels"].update(labels)
        elif o["kind"] == "PodDisruptionBudget":
            spec["selector"]["matchLabels"].update(labels)
    return objects


def json6902(obj, ops):
    """The JSON patch operations the overlays use: test, add (list index or
    '-' to append)."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~")
                 for p in op["path"].split("/")[1:]]
        parent = obj
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if op["op"] == "test":
            got = parent[int(last)] if isinstance(parent, list) else parent[last]
            assert got == op["value"], (op, got)
        elif op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
        else:
            raise AssertionError("unsupported JSON patch op %s" % op["op"])


def dockerfile_stages(path):
    """[(from_line, [instructions])] with continuation lines joined."""
    with open(path) as f:
        text = f.read()
    logical, cur = [], ""
    for line in text.split("\n"):
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        logical.append(cur + s)
        cur = ""
    stages = []
    for ins in logical:
        if ins.upper().startswith("FROM "):
            stages.append((ins, []))
        else:
            stages[-1][1].append(ins)
    return stages


_DPKG_FILES = None


def dpkg_files():
    """Installed path -> owning package, read once from dpkg's file lists
    (what dpkg-query -S searches; one dpkg-query per path took ~0.5 s)."""
    global _DPKG_FILES
    if _DPKG_FILES is None:
        _DPKG_FILES = {}
        for lst in sorted(glob.glob("/var/lib/dpkg/info/*.list")):
            pkg = os.path.basename(lst)[:-len(".list")].split(":")[0]
            with open(lst, errors="replace") as f:
                for line in f:
                    _DPKG_FILES.setdefault(line.rstrip("\n"), pkg)
    return _DPKG_FILES


def dpkg_owner(path):
    files = dpkg_files()
    for p in {path, os.path.realpath(path)}:
        for cand in {p, re.sub(r"^/usr/lib/", "/lib/", p),
                     re.sub(r"^/lib/", "/usr/lib/", p)}:
            if cand in files:
                return files[cand]
    return None


class Dpkg:
    """Dependency closure over the installed packages (dpkg status)."""

    def __init__(self):
        r = subprocess.run(
            ["dpkg-query", "-W", "-f",
             "${Package}\t${Essential}\t${Provides}\t${Pre-Depends}, "
             "${Depends}\n"],
            capture_output=True, text=True, check=True)
        self.deps, self.essential, self.providers = {}, set(), {}
        for line in r.stdout.strip().split("\n"):
            pkg, essential, provides, depends = line.split("\t")
            if essential == "yes":
                self.essential.add(pkg)
            for p in provides.split(","):
                p = p.strip().split(" ")[0]
                if p:
                    self.providers.setdefault(p, set()).add(pkg)
            self.deps[pkg] = [[a.strip().split(" ")[0].split(":")[0]
                               for a in group.split("|")]
                              for group in depends.split(",") if group.strip()]

    def closure(self, roots):
        seen, todo = set(), list(roots)
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            for alternatives in self.deps.get(p, []):
                for a in alternatives:
                    for real in ({a} if a in self.deps else set()) | \
                            self.providers.get(a, set()):
                        todo.append(real)
        return seen

    def base_image(self):
        """What a debian:12(-slim) image has: essential packages and apt."""
        return self.closure(self.essential | {"apt"})


def install_deps(args):
    """The packages `scripts/install-deps ARGS --print` lists."""
    r = subprocess.run([os.path.join(ARGS.source_dir, "scripts",
                                     "install-deps")] + list(args) +
                       ["--print"],
                       capture_output=True, text=True, check=True)
    return r.stdout.split()


def simple_commands(instructions):
    """The simple commands of a stage's RUN instructions, as word lists
    without leading VAR=value assignments (split at &&, || and ;)."""
    out = []
    for ins in instructions:
        if not ins.startswith("RUN "):
            continue
        cmd = []
        for w in shlex.split(ins[4:]) + ["&&"]:
            if w in ("&&", "||", ";"):
                while cmd and re.fullmatch(r"\w+=.*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def invocations(instructions, program):
    """Argument lists of every run of `program` (matched by basename)."""
    return [c[1:] for c in simple_commands(instructions)
            if os.path.basename(c[0]) == program]


def installed_files(instructions):
    """{destination: source} of the stage's `install SRC... DEST` runs."""
    out = {}
    for args in invocations(instructions, "install"):
        paths, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a in ("-m", "-o", "-g", "--mode", "--owner", "--group"):
                skip = True
            elif not a.startswith("-"):
                paths.append(a)
        if len(paths) == 2 and "-d" not in args:
            out[paths[1]] = paths[0]
    return out


class DockerfileTest(unittest.TestCase):
    """What the image would hold and run, from the Dockerfile's commands run
    here (no Docker engine): the package lists its install-deps runs print,
    the CMake configuration of its build command, the files it installs and
    copies, and leapd started with its default command."""

    @classmethod
    def setUpClass(cls):
        cls.stages = dockerfile_stages(os.path.join(
            ARGS.source_dir, "deploy", "docker", "Dockerfile"))
        cls.names = [frm.split()[-1] if " AS " in frm.upper() else None
                     for frm, _ in cls.stages]
        cls.runtime = cls.stages[-1][1]

    def stage_packages(self, instructions):
        runs = invocations(instructions, "install-deps")
        self.assertEqual(len(runs), 1, "one install-deps run per stage")
        return install_deps(runs[0])

    def copied_from(self, stage):
        """(sources, destination) of the runtime stage's COPY --from."""
        copies = [shlex.split(i)[1:] for i in self.runtime
                  if i.startswith("COPY --from=" + stage + " ")]
        self.assertEqual(len(copies), 1, copies)
        return copies[0][1:-1], copies[0][-1]

    def test_build_stage_configuration(self):
        """The build stage's CMake configuration, run here: it succeeds,
        defines every file the stage installs, builds no tests,
        benchmarks, LibTorch, CUDA or Python module (none is in the
        image), and finds only packages its install-deps run brings in
        (with their dependencies and what a Debian image has)."""
        frm, ins = self.stages[0]
        # The package closure below is computed on this host: the build
        # stage must be the same distribution (Debian 12).
        self.assertRegex(frm, r"^FROM debian:12(\.\d+)?\b")
        packages = self.stage_packages(ins)
        builds = invocations(ins, "build")
        self.assertEqual(len(builds), 1, builds)
        build_dir = [a for a in builds[0] if not a.startswith("-")][0]
        flags = [a for a in builds[0] if a.startswith("-D")]
        tmp = temp_dirs.make("leap_docker_configure")
        try:
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            r = subprocess.run(
                ["cmake", "-S", ARGS.source_dir, "-B", tmp] + gen +
                ["-DCMAKE_BUILD_TYPE=Release", "-DLEAP_WERROR=ON"] + flags,
                capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("CUDA capture OFF", r.stdout)
            self.assertIn("LibTorch adapter OFF", r.stdout)
            self.assertIn("Python binding OFF", r.stdout)
            if gen:
                t = subprocess.run(["ninja", "-C", tmp, "-t", "targets",
                                    "all"], capture_output=True, text=True)
                names = {line.split(":")[0] for line in t.stdout.split("\n")}
                installed = installed_files(ins)
                built = [src for src in installed.values()
                         if src.startswith(build_dir.rstrip("/") + "/")]
                self.assertTrue(built, installed)
                for src in built:
                    self.assertIn(os.path.relpath(src, build_dir), names,
                                  "the build stage installs %s, which its "
                                  "configuration does not build" % src)
                programs = {os.path.basename(n) for n in names
                            if re.fullmatch(r"[\w/]+", n)}
                self.assertFalse({p for p in programs
                                  if p.endswith(("_test", "_benchmark"))},
                                 "tests or benchmarks in the image build")
            with open(os.path.join(tmp, "CMakeCache.txt")) as f:
                cache = f.read()
        finally:
            temp_dirs.remove(tmp)
        dpkg = Dpkg()
        allowed = dpkg.closure(packages) | dpkg.base_image()
        found = {}
        # Config packages (X_DIR) and what module mode found (libraries,
        # headers, programs such as protoc).
        for m in re.finditer(r"^([\w-]+)_DIR:PATH=(/usr/\S+)$", cache, re.M):
            cfg = glob.glob(os.path.join(m.group(2), "*onfig.cmake"))
            if cfg:
                found[m.group(1)] = dpkg_owner(cfg[0])
        for m in re.finditer(r"^([\w-]+_(?:LIBRARY|LIBRARY_RELEASE|"
                             r"INCLUDE_DIR|EXECUTABLE)):(?:FILE)?PATH="
                             r"(/usr/\S+)$", cache, re.M):
            if os.path.isdir(m.group(2)) and m.group(2).count("/") <= 3:
                continue  # /usr/include and the like: every -dev owns it
            found[m.group(1)] = dpkg_owner(m.group(2))
        for k in ("prometheus-cpp", "gRPC", "absl", "RocksDB", "Eigen3",
                  "Protobuf_PROTOC_EXECUTABLE", "Protobuf_LIBRARY_RELEASE"):
            self.assertIn(k, found)
        unowned = {k for k, v in found.items() if v is None}
        self.assertEqual(unowned, set(), "found outside Debian packages")
        found = set(found.values())
        self.assertEqual(found - allowed, set(),
                         "packages the build finds but the build stage's "
                         "install-deps run does not bring in")

    def test_runtime_stage_holds_only_the_two_tools(self):
        """The runtime stage installs packages only through install-deps,
        and that list has no compiler or -dev package; it copies from the
        build stage exactly leapd and leapctl, files the build stage
        installs; it runs as a numeric non-root user (what Kubernetes'
        runAsNonRoot can verify)."""
        packages = self.stage_packages(self.runtime)
        self.assertFalse([p for p in packages if p.endswith("-dev")])
        self.assertFalse({"build-essential", "gcc", "g++", "cmake",
                          "ninja-build", "clang"} & set(packages))
        for cmd in simple_commands(self.runtime):
            self.assertNotIn(os.path.basename(cmd[0]),
                             ("apt-get", "apt", "aptitude", "dpkg", "pip",
                              "pip3"), "packages outside install-deps: %s" %
                             " ".join(cmd))
        build_name = self.names[0]
        sources, dest = self.copied_from(build_name)
        self.assertEqual(sorted(os.path.basename(s) for s in sources),
                         ["leapctl", "leapd"])
        installed = installed_files(self.stages[0][1])
        for s in sources:
            self.assertIn(s, installed, "copied but never installed: " + s)
        user = [i for i in self.runtime if i.startswith("USER ")]
        self.assertEqual(len(user), 1)
        uid, _, gid = user[0].split()[1].partition(":")
        self.assertTrue(uid.isdigit() and int(uid) > 0, user)
        self.assertTrue(gid.isdigit() and int(gid) > 0, user)

    def test_runtime_packages_cover_the_binaries(self):
        dpkg = Dpkg()
        runtime = self.stage_packages(self.runtime)
        for p in runtime:
            self.assertIn(p, dpkg.deps, "not a Debian package here: " + p)
        covered = dpkg.closure(runtime) | dpkg.base_image()
        for binary in (ARGS.leapd, ARGS.leapctl):
            r = subprocess.run(["ldd", binary], capture_output=True,
                               text=True, check=True)
            self.assertNotIn("not found", r.stdout)
            libs = re.findall(r"=> (/\S+)", r.stdout)
            self.assertGreater(len(libs), 5)
            for lib in libs:
                owner = dpkg_owner(lib)
                self.assertIsNotNone(owner, lib)
                self.assertIn(owner, covered,
                              "%s loads %s (package %s), which the runtime "
                              "stage does not install" % (binary, lib, owner))

    def test_default_command_serves_on_the_exposed_ports(self):
        """ENTRYPOINT + CMD, run here with the built leapd (its unix socket
        and data directory moved to a temporary directory, its TCP ports
        to 0): every flag is one leapd documents, it becomes ready and
        serves gRPC and /metrics; the ports EXPOSE declares are exactly the
        TCP ports of that command."""
        def json_instruction(name):
            ins = [i for i in self.runtime if i.startswith(name + " ")]
            self.assertEqual(len(ins), 1, name)
            return json.loads(ins[0][len(name) + 1:])
        entry = json_instruction("ENTRYPOINT")
        cmd = json_instruction("CMD")
        sources, dest = self.copied_from(self.names[0])
        self.assertEqual(entry[0], os.path.join(dest, "leapd"))
        args = entry[1:] + cmd
        h = subprocess.run([ARGS.leapd, "--help"], capture_output=True,
                           text=True)
        documented = set(re.findall(r"--(\w+) \(", h.stdout + h.stderr))
        ports = set()
        tmp = temp_dirs.make("leap_docker_cmd")
        local = []
        for a in args:
            m = re.fullmatch(r"--(\w+)=(.*)", a)
            self.assertTrue(m, a)
            self.assertIn(m.group(1), documented, a)
            flag, value = m.groups()
            if value.startswith("unix://"):
                value = "unix://" + os.path.join(
                    tmp, os.path.basename(value[len("unix://"):]))
            elif re.fullmatch(r"[\w.]+:\d+", value):
                ports.add(int(value.rsplit(":", 1)[1]))
                value = "127.0.0.1:0"
            elif flag == "data_dir":
                value = os.path.join(tmp, "data")
            local.append("--%s=%s" % (flag, value))
        exposed = set()
        for i in self.runtime:
            if i.startswith("EXPOSE "):
                exposed |= {int(p.split("/")[0]) for p in i.split()[1:]}
        self.assertEqual(exposed, ports)
        proc = subprocess.Popen([ARGS.leapd] + local, stdout=subprocess.PIPE,
                                text=True)
        killer = threading.Timer(60, proc.kill)
        killer.start()
        try:
            listening, metrics, ready = [], None, False
            for line in proc.stdout:
                if line.startswith("listening on "):
                    listening.append(line.split()[2])
                if line.startswith("metrics on "):
                    metrics = line.split()[2]
                if line.startswith("leapd ") and "ready" in line:
                    ready = True
                    break
            self.assertTrue(ready, "leapd did not become ready")
            self.assertEqual(len(listening),
                             len([a for a in local
                                  if a.startswith("--listen=")]))
            self.assertTrue(any(a.startswith("unix:") for a in listening))
            with urllib.request.urlopen(metrics, timeout=30) as resp:
                self.assertIn("# TYPE leap_", resp.read().decode())
        finally:
            killer.cancel()
            proc.send_signal(signal.SIGTERM)
            proc.stdout.close()
            self.assertEqual(proc.wait(timeout=60), 0)
            temp_dirs.remove(tmp)


class ManifestTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        root = os.path.join(ARGS.source_dir, "deploy", "k8s", "overlays")
        cls.overlays = {name: os.path.join(root, name)
                        for name in sorted(os.listdir(root))}
        cls.rendered, cls.warnings = {}, {}
        for n, d in cls.overlays.items():
            cls.rendered[n], cls.warnings[n] = render(d)
        h = subprocess.run([ARGS.leapd, "--help"], capture_output=True,
                           text=True)
        cls.leapd_flags = set(re.findall(r"--(\w+) \(", h.stdout + h.stderr))
        stages = dockerfile_stages(os.path.join(
            ARGS.source_dir, "deploy", "docker", "Dockerfile"))
        user = [i for i in stages[-1][1] if i.startswith("USER ")][0]
        cls.image_uid = int(user.split()[1].split(":")[0])
        entry = [i for i in stages[-1][1] if i.startswith("ENTRYPOINT ")][0]
        cls.image_entrypoint = json.loads(entry[len("ENTRYPOINT "):])

    def test_help_documents_every_leapd_flag(self):
        """`leapd --help` (not only --helpfull) lists every flag leapd
        defines: those of sidecar/app/leapd_options.cc and of
        sidecar/app/leapd_data_flags.cc (dataset and bootstrap)."""
        app = os.path.join(ARGS.source_dir, "sidecar", "app")
        defined = set()
        for name in sorted(os.listdir(app)):
            if name.endswith(".cc"):
                with open(os.path.join(app, name)) as f:
                    defined |= set(re.findall(
                        r"^ABSL_FLAG\([^,]+,\s*(\w+)\s*,", f.read(), re.M))
        self.assertIn("dataset_max_records", defined)
        self.assertIn("bootstrap_readout", defined)
        self.assertEqual(defined - self.leapd_flags, set(),
                         "flags in --helpfull only")

    def objects(self, name, kind):
        return [o for o in self.rendered[name] if o["kind"] == kind]

    def pod(self, name):
        # The StatefulSet with the leapd sidecar (the fleet overlay also
        # renders its NATS cluster's).
        sts = [s for s in self.objects(name, "StatefulSet")
               if any(c["name"] == "leapd" for c in
                      s["spec"]["template"]["spec"].get("initContainers", []))]
        self.assertEqual(len(sts), 1, name)
        spec = sts[0]["spec"]["template"]["spec"]
        leapd = [c for c in spec.get("initContainers", [])
                 if c["name"] == "leapd"]
        self.assertEqual(len(leapd), 1, name)
        engine = [c for c in spec["containers"] if c["name"] == "engine"]
        self.assertEqual(len(engine), 1, name)
        return sts[0], spec, leapd[0], engine[0]

    def test_two_product_lines(self):
        self.assertGreaterEqual(len(self.overlays), 2)

    def test_native_sidecar_and_flags(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            self.assertEqual(leapd.get("restartPolicy"), "Always", name)
            # The image's leapd (its ENTRYPOINT), whatever path it has.
            self.assertEqual(leapd["command"], self.image_entrypoint)
            for arg in leapd["args"]:
                m = re.fullmatch(r"--(\w+)=.*", arg)
                self.assertTrue(m, arg)
                self.assertIn(m.group(1), self.leapd_flags,
                              "%s: leapd has no flag %s" % (name, arg))
            self.assertNotEqual(leapd["image"], "leapd",
                                name + ": the overlay sets the image")

    def test_shared_volume(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            volumes = {v["name"]: v for v in spec["volumes"]}
            socket = [a for a in flag_values(leapd["args"], "listen")
                      if a.startswith("unix://")]
            self.assertEqual(len(socket), 1, name)
            path = socket[0][len("unix://"):]
            mounts = [m for m in leapd["volumeMounts"]
                      if path.startswith(m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(mounts), 1, name)
            shared = volumes[mounts[0]["name"]]
            self.assertEqual(shared["emptyDir"]["medium"], "Memory")
            self.assertIn("sizeLimit", shared["emptyDir"])
            engine_mounts = [m for m in engine["volumeMounts"]
                             if m["name"] == shared["name"]]
            self.assertEqual(len(engine_mounts), 1, name)
            self.assertEqual(engine_mounts[0]["mountPath"],
                             mounts[0]["mountPath"])
            env = {e["name"]: e.get("value") for e in engine["env"]}
            self.assertEqual(env["LEAP_GRPC_ENDPOINT"], socket[0])
            # The engine's data plane is leapd's shm socket, on the same
            # memory-backed volume (segments are created beside it).
            shm = flag_values(leapd["args"], "shm")
            self.assertEqual(len(shm), 1, name)
            self.assertTrue(shm[0].startswith(mounts[0]["mountPath"].rstrip("/") + "/"),
                            name)
            self.assertEqual(env["LEAP_ENDPOINT"], "shm://" + shm[0])
            limit = shared["emptyDir"]["sizeLimit"]
            self.assertTrue(limit.endswith("Mi") and int(limit[:-2]) >= 64,
                            "%s: %s holds too few shm segments" % (name, limit))

    def test_leapd_probes_restart_leapd_only(self):
        """leapd is never on the engine's start or readiness path: a native
        sidecar's startupProbe holds back the main containers and its
        readinessProbe counts in the pod's readiness, so leapd has neither;
        its liveness probe asks the gRPC health service "liveness" (SERVING
        through recovery) on the TCP port leapd listens on."""
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            self.assertNotIn("startupProbe", leapd, name)
            self.assertNotIn("readinessProbe", leapd, name)
            self.assertNotIn("postStart", leapd.get("lifecycle", {}), name)
            tcp = [a for a in flag_values(leapd["args"], "listen")
                   if not a.startswith("unix:")]
            self.assertEqual(len(tcp), 1, name)
            port = int(tcp[0].rsplit(":", 1)[1])
            self.assertNotEqual(port, 0)
            self.assertIn(port, [p["containerPort"] for p in leapd["ports"]])
            p = leapd["livenessProbe"]
            self.assertEqual(set(p) & {"grpc", "httpGet", "tcpSocket",
                                       "exec"}, {"grpc"})
            self.assertEqual(p["grpc"]["port"], port, name)
            self.assertEqual(p["grpc"].get("service"), "liveness", name)

    def test_engine_probes_do_not_involve_leapd(self):
        """The engine's own probes (its server's port), none of them asking
        leapd: no probe on leapd's ports, no exec of a leap tool; and the
        engine container is complete: ports, probes, a GPU."""
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            engine_ports = {p["name"]: p["containerPort"]
                            for p in engine.get("ports", [])}
            self.assertTrue(engine_ports, name + ": the engine declares no port")
            leapd_ports = {p["containerPort"] for p in leapd["ports"]} | \
                {p["name"] for p in leapd["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                self.assertIn(probe, engine, (name, probe))
                p = engine[probe]
                self.assertNotIn("exec", p, (name, probe))
                handler = p.get("httpGet") or p.get("tcpSocket") or \
                    p.get("grpc")
                self.assertIsNotNone(handler, (name, probe))
                port = handler["port"]
                self.assertNotIn(port, leapd_ports, (name, probe))
                number = engine_ports.get(port, port)
                self.assertIn(number, engine_ports.values(), (name, probe))
            limits = engine["resources"]["limits"]
            self.assertGreaterEqual(int(limits["nvidia.com/gpu"]), 1, name)

    def test_parallel_pod_management(self):
        for name in self.overlays:
            sts, *_ = self.pod(name)
            self.assertEqual(sts["spec"].get("podManagementPolicy"),
                             "Parallel", name)

    def test_network_policy_admits_the_engine_and_guards_leapd(self):
        """Every engine port is admitted (a rule without `from`, or from
        some source), and leapd's ports only from named sources."""
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            # The policies that select the leap pods (the fleet overlay's
            # NATS pods have their own).
            pod_labels = sts["spec"]["template"]["metadata"]["labels"]
            pols = [np for np in self.objects(name, "NetworkPolicy") if all(
                pod_labels.get(k) == v for k, v in
                np["spec"]["podSelector"].get("matchLabels", {}).items())]
            self.assertTrue(pols, name)
            for np in pols:
                rules = np["spec"].get("ingress", [])

                def admitting(port, port_name):
                    return [r for r in rules if not r.get("ports") or any(
                        p.get("port") in (port, port_name)
                        for p in r["ports"])]
                for p in engine["ports"]:
                    self.assertTrue(admitting(p["containerPort"], p["name"]),
                                    "%s: NetworkPolicy %s cuts off the "
                                    "engine's port %s" % (
                                        name, np["metadata"]["name"],
                                        p["containerPort"]))
                for p in leapd["ports"]:
                    for r in admitting(p["containerPort"], p["name"]):
                        self.assertTrue(r.get("from"), (
                            "%s: leapd's port %s open to every source" %
                            (name, p["containerPort"])))

    def test_readout_delivery_scales_past_a_configmap(self):
        """The first readout reaches a new pod through an init step that
        runs before leapd and writes into a volume leapd imports from
        (--import_optional: a failed fetch never blocks the pod), not
        through a ConfigMap (1 MiB at most)."""
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            imports = flag_values(leapd["args"], "import")
            self.assertEqual(len(imports), 1, name)
            path = imports[0].split("=", 1)[-1]
            self.assertIn("--import_optional=true", leapd["args"])
            mount = [m for m in leapd["volumeMounts"]
                     if path.startswith(m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(mount), 1, name)
            volumes = {v["name"]: v for v in spec["volumes"]}
            vol = volumes[mount[0]["name"]]
            self.assertNotIn("configMap", vol, name)
            inits = spec["initContainers"]
            order = [c["name"] for c in inits]
            writers = [c for c in inits
                       if c.get("restartPolicy") != "Always" and
                       any(m["name"] == vol["name"] and not m.get("readOnly")
                           for m in c.get("volumeMounts", []))]
            self.assertEqual(len(writers), 1, name)
            self.assertLess(order.index(writers[0]["name"]),
                            order.index("leapd"), name)
            script = " ".join(writers[0].get("command", []) +
                              writers[0].get("args", []))
            self.assertIn("exit 0", script, name + ": the fetch must not "
                          "fail the pod")
            self.assertIn("--max-time", script, name)
            # The name leapd gives it: the readout the product line routes to.
            env = {e["name"]: e.get("value") for e in leapd.get("env", [])}
            readout = imports[0].split("=", 1)[0]
            m = re.fullmatch(r"\$\((\w+)\)", readout)
            if m:
                readout = env[m.group(1)]
            with open(os.path.join(self.overlays[name], "routes.json")) as f:
                routes = json.load(f)["routes"]
            line = {e["name"]: e.get("value") for e in engine["env"]}[
                "LEAP_PRODUCT_LINE"]
            served = [a["readout"] for r in routes
                      if r["product_line"] == line for a in r["arms"]]
            self.assertIn(readout, served, name)

    def test_no_deprecated_kustomize_fields(self):
        for name, d in self.overlays.items():
            with open(os.path.join(d, "kustomization.yaml")) as f:
                k = yaml.safe_load(f)
            for field in DEPRECATED_KUSTOMIZE_FIELDS:
                self.assertNotIn(field, k, "%s: deprecated `%s`" % (name, field))
            self.assertNotIn("deprecated", self.warnings[name].lower(),
                             name + ": " + self.warnings[name])

    def test_pvc_mounted_at_data_dir(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            data_dir = flag_values(leapd["args"], "data_dir")
            self.assertEqual(len(data_dir), 1)
            claims = {t["metadata"]["name"]: t
                      for t in sts["spec"]["volumeClaimTemplates"]}
            # The volume's root or a directory in it (move_aside renames
            # the state directory, which a mount point cannot be).
            mount = [m for m in leapd["volumeMounts"]
                     if (data_dir[0].rstrip("/") + "/").startswith(
                         m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(mount), 1, name)
            self.assertIn(mount[0]["name"], claims)
            self.assertNotIn(mount[0]["name"],
                             {v["name"] for v in spec["volumes"]})
            claim = claims[mount[0]["name"]]
            self.assertEqual(claim["spec"]["accessModes"], ["ReadWriteOnce"])
            self.assertGreaterEqual(
                parse_quantity(claim["spec"]["resources"]["requests"]
                               ["storage"]), 1 << 30)

    def test_admin_token_secret_mounted_and_passed(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            token_file = flag_values(leapd["args"], "admin_token_file")
            self.assertEqual(len(token_file), 1, name)
            d, _, fname = token_file[0].rpartition("/")
            mounts = [m for m in leapd["volumeMounts"]
                      if m["mountPath"].rstrip("/") == d]
            self.assertEqual(len(mounts), 1, name)
            self.assertTrue(mounts[0].get("readOnly"))
            vol = [v for v in spec["volumes"]
                   if v["name"] == mounts[0]["name"]][0]
            secret = vol["secret"]
            self.assertEqual(secret["secretName"], "leap-admin-token")
            paths = {i["path"]: i["key"] for i in secret["items"]}
            self.assertEqual(paths.get(fname), "token")
            self.assertEqual(secret["defaultMode"] & 0o007, 0)
            # Not given to the engine.
            self.assertNotIn(mounts[0]["name"],
                             [m["name"] for m in engine["volumeMounts"]])

    def test_security_context(self):
        """Users per container: leapd as the image's uid, the engine as its
        own image's (no runAsUser for it, none for the pod); what they share
        is the pod's fsGroup, which leapd gives its sockets and segments."""
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            pod_sc = spec["securityContext"]
            self.assertNotIn("runAsUser", pod_sc, name)
            self.assertNotIn("runAsGroup", pod_sc, name)
            self.assertEqual(pod_sc["seccompProfile"]["type"],
                             "RuntimeDefault")
            sc = leapd["securityContext"]
            self.assertEqual(sc["runAsUser"], self.image_uid, name)
            self.assertTrue(sc["runAsNonRoot"])
            self.assertTrue(sc["readOnlyRootFilesystem"])
            self.assertFalse(sc["allowPrivilegeEscalation"])
            self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
            self.assertFalse(sc.get("privileged", False))
            esc = engine["securityContext"]
            self.assertNotIn("runAsUser", esc, name)
            self.assertNotIn("runAsGroup", esc, name)
            self.assertFalse(esc["allowPrivilegeEscalation"])
            self.assertEqual(flag_values(leapd["args"], "shm_group"),
                             [str(pod_sc["fsGroup"])], name)

    def test_resources_from_measured_figures(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            res = leapd["resources"]
            limit = parse_quantity(res["limits"]["memory"])
            self.assertEqual(parse_quantity(res["requests"]["memory"]), limit)
            cache = int(flag_values(leapd["args"], "feature_cache_bytes")[0])
            # The cache, the measured peak with two d = 4096 readouts, and
            # at least 128 MiB of headroom.
            self.assertGreaterEqual(limit - cache,
                                    MEASURED_PEAK_BYTES + 128 * MIB,
                                    name)
            self.assertLessEqual(limit - cache, MEASURED_PEAK_BYTES * 2)
            self.assertIn("cpu", res["requests"])

    def test_prometheus_annotations(self):
        for name in self.overlays:
            sts, spec, leapd, engine = self.pod(name)
            ann = sts["spec"]["template"]["metadata"]["annotations"]
            self.assertEqual(ann["prometheus.io/scrape"], "true")
            metrics = flag_values(leapd["args"], "metrics_listen")[0]
            self.assertEqual(ann["prometheus.io/port"],
                             metrics.rsplit(":", 1)[1])
            self.assertEqual(ann["prometheus.io/path"], "/metrics")
            port = [p for p in leapd["ports"]
                    if p["containerPort"] == int(ann["prometheus.io/port"])]
            self.assertEqual([p["name"] for p in port], ["metrics"])

    def test_routes(self):
        for name, d in self.overlays.items():
            sts, spec, leapd, engine = self.pod(name)
            env = {e["name"]: e.get("value") for e in engine["env"]}
            line = env["LEAP_PRODUCT_LINE"]
            # The overlay's product line (its name, or its label where the
            # overlay is named after a deployment mode, e.g. fleet).
            self.assertEqual(line, sts["metadata"]["labels"].get(
                "leap.dev/product-line", name))
            files = {}
            for f in ("routes.json", "routes-ab.json"):
                with open(os.path.join(d, f)) as fh:
                    files[f] = json.load(fh)
            steady = {r["product_line"]: r for r in
                      files["routes.json"]["routes"]}
            self.assertIn(line, steady)
            ab = [r for r in files["routes-ab.json"]["routes"]
                  if r["product_line"] == line]
            self.assertEqual(len(ab), 1)
            serving = [a for a in ab[0]["arms"] if not a.get("shadow")]
            self.assertGreaterEqual(len(serving), 2)
            self.assertAlmostEqual(sum(a["percent"] for a in serving), 100)
            self.assertGreaterEqual(len({a["readout"] for a in serving}), 2)
            # The ConfigMap carries both, mounted in leapd.
            cms = [c for c in self.objects(name, "ConfigMap")
                   if "routes.json" in c.get("data", {})]
            self.assertEqual(len(cms), 1)
            self.assertEqual(json.loads(cms[0]["data"]["routes-ab.json"]),
                             files["routes-ab.json"])
            vol = [v for v in spec["volumes"] if "configMap" in v and
                   v["configMap"]["name"] == cms[0]["metadata"]["name"]]
            self.assertEqual(vol[0]["configMap"]["name"],
                             cms[0]["metadata"]["name"])
            self.assertIn(vol[0]["name"],
                          [m["name"] for m in leapd["volumeMounts"]])

    def test_selectors_do_not_overlap(self):
        selectors = {}
        for name in self.overlays:
            sts, *_ = self.pod(name)
            selectors[name] = sts["spec"]["selector"]["matchLabels"]
            self.assertEqual(sts["metadata"]["namespace"], "leap")
            svc = [o for o in self.objects(name, "Service")
                   if o["metadata"]["name"] == sts["spec"]["serviceName"]][0]
            self.assertEqual(svc["spec"]["selector"], selectors[name])
            np = [o for o in self.objects(name, "NetworkPolicy")
                  if o["metadata"]["name"] == sts["metadata"]["name"]][0]
            self.assertEqual(np["spec"]["podSelector"]["matchLabels"],
                             selectors[name])
        names = list(selectors)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                sa, sb = selectors[a], selectors[b]
                self.assertTrue(any(k in sb and sb[k] != v
                                    for k, v in sa.items()), (a, b))


class FleetManifestTest(unittest.TestCase):
    """The overlays with leapd --fleet: their NATS JetStream cluster (or the
    one --fleet names) matches what leapd is told."""

    @classmethod
    def setUpClass(cls):
        root = os.path.join(ARGS.source_dir, "deploy", "k8s", "overlays")
        cls.fleets = {}
        for name in sorted(os.listdir(root)):
            objs = render(os.path.join(root, name))[0]
            for o in objs:
                if o["kind"] != "StatefulSet":
                    continue
                for c in o["spec"]["template"]["spec"].get("initContainers", []):
                    if c["name"] == "leapd" and flag_values(c.get("args", []), "fleet"):
                        cls.fleets[name] = (objs, o, c)

    def test_a_fleet_overlay_exists(self):
        self.assertIn("fleet", self.fleets)

    def nats(self, objs):
        sts = [o for o in objs if o["kind"] == "StatefulSet" and any(
            c["name"] == "nats" for c in o["spec"]["template"]["spec"]["containers"])]
        self.assertEqual(len(sts), 1)
        return sts[0]

    def test_fleet_flags(self):
        for name, (objs, sts, leapd) in self.fleets.items():
            args = leapd["args"]
            fleet_name = flag_values(args, "fleet_name")
            self.assertEqual(len(fleet_name), 1, name)
            self.assertRegex(fleet_name[0], r"^[A-Za-z0-9_-]{1,32}$")
            # Member ids default to $HOSTNAME: the pod name, unique.
            self.assertEqual(flag_values(args, "fleet_member"), [], name)
            self.assertGreaterEqual(sts["spec"]["replicas"], 2, name)
            nats = self.nats(objs)
            replicas = int(flag_values(args, "fleet_replicas")[0])
            self.assertEqual(replicas, 3, name)
            self.assertGreaterEqual(nats["spec"]["replicas"], replicas)
            self.assertEqual(nats["spec"]["replicas"] % 2, 1, "RAFT quorum")
            # --fleet names every NATS pod by its stable DNS name and the
            # client port.
            svc = [o for o in objs if o["kind"] == "Service" and
                   o["metadata"]["name"] == nats["spec"]["serviceName"]]
            self.assertEqual(len(svc), 1, name)
            self.assertEqual(svc[0]["spec"].get("clusterIP"), "None")
            self.assertTrue(svc[0]["spec"].get("publishNotReadyAddresses"))
            self.assertEqual(svc[0]["spec"]["selector"],
                             nats["spec"]["selector"]["matchLabels"])
            c = nats["spec"]["template"]["spec"]["containers"][0]
            client = [p["containerPort"] for p in c["ports"] if p["name"] == "client"][0]
            want = ["nats://%s-%d.%s:%d" % (nats["metadata"]["name"], i,
                                            svc[0]["metadata"]["name"], client)
                    for i in range(nats["spec"]["replicas"])]
            self.assertEqual(flag_values(args, "fleet")[0].split(","), want)

    def test_nats_cluster(self):
        for name, (objs, sts, leapd) in self.fleets.items():
            nats = self.nats(objs)
            ns = nats["metadata"]["namespace"]
            spec = nats["spec"]["template"]["spec"]
            c = spec["containers"][0]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            conf_arg = [a for a in c["args"] if a.startswith("--config=")]
            self.assertEqual(len(conf_arg), 1)
            conf_dir, _, conf_file = conf_arg[0][len("--config="):].rpartition("/")
            mount = [m for m in c["volumeMounts"] if m["mountPath"] == conf_dir][0]
            vol = [v for v in spec["volumes"] if v["name"] == mount["name"]][0]
            cm = [o for o in objs if o["kind"] == "ConfigMap" and
                  o["metadata"]["name"] == vol["configMap"]["name"]][0]
            conf = cm["data"][conf_file]
            # Server name = pod name from the downward API.
            self.assertIn("server_name: $POD_NAME", conf)
            env = {e["name"]: e for e in c["env"]}
            self.assertEqual(env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
                             "metadata.name")
            # Go's scheduler threads follow the CPU request (a whole core).
            gmp = env["GOMAXPROCS"]["valueFrom"]["resourceFieldRef"]
            self.assertEqual(gmp["resource"], "requests.cpu")
            self.assertEqual(gmp.get("containerName"), c["name"])
            cpu = str(c["resources"]["requests"]["cpu"])  # "1", "1500m"
            cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
            self.assertGreaterEqual(cores, 1)
            # Ports of the config = the declared container ports.
            self.assertIn("listen: 0.0.0.0:%d" % ports["client"], conf)
            self.assertIn("http: 0.0.0.0:%d" % ports["monitor"], conf)
            self.assertIn("listen: 0.0.0.0:%d" % ports["cluster"], conf)
            # Routes to every node by its DNS name in this namespace.
            svc = nats["spec"]["serviceName"]
            routes = re.findall(r"nats-route://([^\s,\]]+)", conf)
            self.assertEqual(routes, ["%s-%d.%s.%s.svc.cluster.local:%d" % (
                nats["metadata"]["name"], i, svc, ns, ports["cluster"])
                for i in range(nats["spec"]["replicas"])])
            # JetStream's file store on the node's PVC.
            store = re.search(r"store_dir:\s*(\S+)", conf).group(1)
            claims = {t["metadata"]["name"] for t in nats["spec"]["volumeClaimTemplates"]}
            data = [m for m in c["volumeMounts"]
                    if store.startswith(m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(data), 1)
            self.assertIn(data[0]["name"], claims)
            # Probes on the monitoring port's JetStream health.
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                self.assertEqual(c[probe]["httpGet"]["port"], "monitor")
                self.assertTrue(c[probe]["httpGet"]["path"].startswith("/healthz"))
            self.assertTrue(c["securityContext"]["readOnlyRootFilesystem"])
            # At most one node down by a voluntary disruption.
            pdb = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
            self.assertEqual(len(pdb), 1)
            self.assertEqual(pdb[0]["spec"]["maxUnavailable"], 1)
            self.assertEqual(pdb[0]["spec"]["selector"]["matchLabels"],
                             nats["spec"]["selector"]["matchLabels"])
            # The real nats-server accepts the configuration.
            server = shutil.which("nats-server") or "/usr/sbin/nats-server"
            if os.path.exists(server):
                tmp = temp_dirs.make("leap_deploy_nats")
                try:
                    path = os.path.join(tmp, conf_file)
                    with open(path, "w") as f:
                        f.write(conf)
                    r = subprocess.run([server, "-t", "-c", path],
                                       capture_output=True, text=True,
                                       env=dict(os.environ,
                                                POD_NAME=nats["metadata"]["name"] + "-0"),
                                       timeout=60)
                    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                finally:
                    temp_dirs.remove(tmp)

    def test_network_policy_lets_members_reach_nats(self):
        for name, (objs, sts, leapd) in self.fleets.items():
            nats = self.nats(objs)
            labels = sts["spec"]["template"]["metadata"]["labels"]
            client = [p["containerPort"] for p in
                      nats["spec"]["template"]["spec"]["containers"][0]["ports"]
                      if p["name"] == "client"][0]
            nps = [o for o in objs if o["kind"] == "NetworkPolicy" and all(
                nats["spec"]["template"]["metadata"]["labels"].get(k) == v
                for k, v in o["spec"]["podSelector"]["matchLabels"].items())]
            self.assertTrue(nps, name)
            allowed = False
            for np in nps:
                for rule in np["spec"]["ingress"]:
                    if client not in [p["port"] for p in rule.get("ports", [])]:
                        continue
                    for peer in rule["from"]:
                        exprs = peer.get("podSelector", {}).get("matchExpressions", [])
                        allowed |= all(labels.get(e["key"]) in e["values"]
                                       for e in exprs if e["operator"] == "In")
            self.assertTrue(allowed, name + ": leap pods cannot reach NATS")


class PrometheusTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        d = os.path.join(ARGS.source_dir, "deploy", "prometheus")
        with open(os.path.join(d, "scrape-config.yaml")) as f:
            cls.scrape = yaml.safe_load(f)
        with open(os.path.join(d, "alerts.yaml")) as f:
            cls.alerts = yaml.safe_load(f)

    def test_scrape_job_matches_the_manifests(self):
        jobs = self.scrape["scrape_configs"]
        self.assertEqual(len(jobs), 1)
        relabel = jobs[0]["relabel_configs"]
        keep = {tuple(r["source_labels"]): r["regex"] for r in relabel
                if r.get("action") == "keep"}
        self.assertEqual(keep[(
            "__meta_kubernetes_pod_annotation_prometheus_io_scrape",)], "true")
        self.assertEqual(keep[(
            "__meta_kubernetes_pod_container_port_name",)], "metrics")
        self.assertEqual(jobs[0]["job_name"], "leap")

    def test_alerts_use_metrics_leapd_serves(self):
        tmp = temp_dirs.make("leap_deploy_metrics")
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write("deploy-test-token\n")
        proc = subprocess.Popen(
            [ARGS.leapd, "--listen=127.0.0.1:0",
             "--metrics_listen=127.0.0.1:0", "--data_dir=" + tmp + "/data",
             "--admin_token_file=" + token],
            stdout=subprocess.PIPE, text=True)
        try:
            address = metrics = None
            for line in proc.stdout:
                if line.startswith("listening on "):
                    address = line.split()[2]
                if line.startswith("metrics on "):
                    metrics = line.split()[2]
                if line.startswith("leapd ") and "ready" in line:
                    break
            self.assertIsNotNone(metrics)
            r = subprocess.run([ARGS.leapctl, "readouts", "create", "r",
                                "--cold-start", "--dim", "8", "--lambda", "1",
                                "--server", address, "--token-file", token],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            # A refused call, so leap_request_errors_total has a series.
            r = subprocess.run([ARGS.leapctl, "readouts", "list",
                                "--server", address], capture_output=True,
                               text=True)
            self.assertIn("UNAUTHENTICATED", r.stderr)
            with urllib.request.urlopen(metrics, timeout=30) as resp:
                text = resp.read().decode()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.stdout.close()
            self.assertEqual(proc.wait(timeout=60), 0)
            temp_dirs.remove(tmp)
        served = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
        with open(os.path.join(ARGS.source_dir, "deploy",
                               "RUNBOOK.md")) as f:
            runbook = f.read()
        rules = self.alerts["groups"][0]["rules"]
        self.assertGreaterEqual(len(rules), 10)
        for rule in rules:
            for metric in re.findall(r"\b(leap_\w+)", rule["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", metric)
                self.assertIn(base, served, rule["alert"])
                self.assertIn("`%s" % base, runbook, rule["alert"])
            self.assertIn("`%s`" % rule["alert"], runbook)
            self.assertIn(rule["labels"]["severity"],
                          ("critical", "warning", "info"))
        # The Grafana dashboard queries only series leapd serves.
        with open(os.path.join(ARGS.source_dir, "deploy", "grafana",
                               "leap-dashboard.json")) as f:
            dashboard = json.load(f)
        exprs = [t["expr"] for p in dashboard["panels"]
                 for t in p["targets"]]
        self.assertGreaterEqual(len(exprs), 10)
        # Per-arm series exist once an arm served a request (none here;
        # tests/metrics_format_test.py checks them after traffic).
        per_arm = {"leap_arm_spearman", "leap_arm_spearman_samples"}
        for expr in exprs:
            for metric in re.findall(r"\b(leap_\w+)", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", metric)
                self.assertIn(base, served | per_arm, expr)


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leapd", required=True)
    parser.add_argument("--leapctl", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--kubectl", default=shutil.which("kubectl"))
    ARGS, rest = parser.parse_known_args()
    global KUSTOMIZE
    KUSTOMIZE = kustomize_usable()
    if KUSTOMIZE is None:
        print("deploy_test: no kubectl with kustomize v4.1+ here; the "
              "manifests are checked from their YAML sources")
    ARGS.source_dir = os.path.abspath(ARGS.source_dir)
    result = unittest.main(argv=[sys.argv[0]] + rest, exit=False, verbosity=2)
    sys.exit(0 if result.result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
