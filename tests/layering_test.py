#!/usr/bin/env python3
"""The layering of the CMake targets (docs/ARCHITECTURE.md, "Layers").

Reads leap_targets.txt, which the configure step writes into the build tree
(top-level CMakeLists.txt: every target of the project with its folder and
the targets it links or depends on), prints the graph in a compact text form
and fails on
  (a) a library target defined under tools/ (a tool is a program only), or
      one defined under tests/ that a non-test target links (tests beside
      their code may link the test support);
  (b) an arrow from a lower layer to a higher one, or between two different
      layers of the same rank;
  (c) a target no layer below declares (a new target must be placed);
  (d) with --source-dir: a folder of the source tree that
      docs/ARCHITECTURE.md does not name.
Before checking the real graph it checks itself on a made-up graph with one
violation of each kind.

  layering_test.py --targets BUILD/leap_targets.txt [--source-dir SRC]
"""
import argparse
import os
import subprocess
import re
import sys
import tempfile

# The layer order, declared once: (layer, rank, targets). A target may link
# or depend on targets of a lower rank and of its own layer only.
LAYERS = [
    ("build", 0, {"leap_warnings", "leap_openblas", "leap_tsan_absl"}),
    ("common", 1, {"leap_common"}),
    ("proto", 2, {"leap_proto"}),
    ("readout", 3, {"leap_readout"}),
    ("storage", 4, {"leap_storage"}),
    ("client", 4, {"leap_client"}),
    ("engine_shim", 4, {"leap_shim_client", "leap_shim_scheduler",
                        "leap_shim_capture", "leap_shim_torch", "leap_shim"}),
    # The length prior before prefill (sidecar/core/length_prior.h): no
    # project dependency, shared by leapd's core and the replay.
    ("length_prior", 4, {"leap_length_prior"}),
    ("sidecar_core", 5, {"leap_sidecar_core"}),
    ("replay", 5, {"leap_replay"}),
    ("sidecar_grpc", 6, {"leap_sidecar_grpc"}),
    ("sidecar_shm", 6, {"leap_sidecar_shm"}),
    ("fleet", 6, {"leap_fleet", "leap_fleet_trainer"}),
    ("service", 7, {"leap_service"}),
    ("app", 8, {"leap_app", "leapd"}),
    ("tools", 9, {"leapctl", "leapd_bench"}),
    # Tests, benchmarks, fuzzers and their helpers: every target defined
    # under tests/ or fuzz/, the *_test / *_benchmark programs beside the
    # code they test, and the tests' shared precompiled header (defined at
    # the top, LEAP_TEST_PCH).
    ("tests", 10, {"leap_test_pch", "leap_test_pch_deps"}),
]
LIBRARY_TYPES = {"STATIC_LIBRARY", "SHARED_LIBRARY", "MODULE_LIBRARY",
                 "OBJECT_LIBRARY", "INTERFACE_LIBRARY"}


def parse(text):
    """{name: (type, folder, [deps])} of the project's targets."""
    targets = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, typ, folder, deps = line.split("|")
        targets[name] = (typ, folder, [d for d in deps.split(",") if d])
    return targets


def layer_of(name, folder):
    top = folder.split("/")[0]
    if top in ("tests", "fuzz") or re.search(r"_(test|benchmark)$", name):
        return "tests", 10
    for layer, rank, names in LAYERS:
        if name in names:
            return layer, rank
    return None, None


def check(targets):
    """The violations, as sentences."""
    problems = []
    for name, (typ, folder, deps) in sorted(targets.items()):
        layer, rank = layer_of(name, folder)
        top = folder.split("/")[0]
        if top == "tools" and typ in LIBRARY_TYPES:
            problems.append(f"{name}: a library inside a tool ({folder}/); "
                            "move it to a library folder")
        if layer is None:
            problems.append(f"{name} ({folder}/): in no layer; declare it in "
                            "tests/layering_test.py LAYERS")
            continue
        for dep in deps:
            if dep not in targets:
                continue  # imported (absl, gRPC, ...)
            dtyp, dfolder, _ = targets[dep]
            dtop = dfolder.split("/")[0]
            # A test anywhere may link the test support under tests/; nothing
            # else may link a library of tests/ or tools/.
            if dtyp in LIBRARY_TYPES and dtop in ("tools", "tests") and \
                    top != dtop and not (dtop == "tests" and layer == "tests"):
                problems.append(f"{name} ({folder}/) links {dep}, a library "
                                f"defined under {dfolder}/")
            dlayer, drank = layer_of(dep, dfolder)
            if dlayer is None or dlayer == layer:
                continue
            if drank >= rank:
                problems.append(f"{name} ({layer}, rank {rank}) -> {dep} "
                                f"({dlayer}, rank {drank}): an arrow from a "
                                "lower layer to a higher one or a sibling")
    return problems


def render(targets):
    """The graph, one line per target outside tests, the tests summarized."""
    out = []
    ranks = sorted({r for _, r, _ in LAYERS})
    for rank in ranks:
        for layer, r, _ in LAYERS:
            if r != rank or layer in ("build", "tests"):
                continue
            for name in sorted(n for n, (_, f, _) in targets.items()
                               if layer_of(n, f)[0] == layer):
                typ, folder, deps = targets[name]
                own = sorted(d for d in deps if d in targets and
                             layer_of(d, targets[d][1])[0] != "build")
                kind = "lib" if typ in LIBRARY_TYPES else "exe"
                out.append(f"[{rank}] {layer:<12} {name} ({kind}, {folder}/)"
                           f" -> {', '.join(own) if own else '-'}")
    tests = [n for n, (_, f, _) in targets.items()
             if layer_of(n, f)[0] == "tests"]
    uses = {}
    for n in tests:
        for d in targets[n][2]:
            if d in targets and layer_of(d, targets[d][1])[0] not in (
                    "tests", "build"):
                uses[d] = uses.get(d, 0) + 1
    out.append(f"[10] tests        {len(tests)} targets (tests/, fuzz/, "
               "*_test and *_benchmark beside their code) -> " +
               ", ".join(f"{d} x{c}" for d, c in sorted(uses.items())))
    return "\n".join(out)


def self_test():
    bad = parse("\n".join([
        "leap_common|STATIC_LIBRARY|common|",
        "leap_readout|STATIC_LIBRARY|readout|leap_common,leap_storage",
        "leap_storage|STATIC_LIBRARY|storage|leap_readout",
        "leap_client|STATIC_LIBRARY|client|leap_storage",
        "leap_tool_lib|STATIC_LIBRARY|tools/leapctl|leap_common",
        "leap_test_support|STATIC_LIBRARY|tests|leap_client",
        "leapctl|EXECUTABLE|tools/leapctl|leap_tool_lib,leap_test_support",
        "core_test|EXECUTABLE|sidecar|leap_test_support,leap_storage",
    ]))
    found = "\n".join(check(bad))
    expected = [
        "leap_readout (readout, rank 3) -> leap_storage",  # upward
        "leap_client (client, rank 4) -> leap_storage",    # sibling
        "leap_tool_lib: a library inside a tool",
        "leapctl (tools/leapctl/) links leap_test_support",
        "leap_tool_lib (tools/leapctl/): in no layer",
    ]
    missed = [e for e in expected if e not in found]
    # A test beside its code may link the test support under tests/.
    if missed or "leap_storage (storage, rank 4) -> leap_readout" in found or \
            "core_test" in found:
        print("self-test failed: missed", missed, "\nfound:\n" + found)
        return False
    with tempfile.TemporaryDirectory() as src:
        for d in ("docs", "named/inner", "unnamed", "build/x"):
            os.makedirs(os.path.join(src, d))
        open(os.path.join(src, "build", "CMakeCache.txt"), "w").close()
        with open(os.path.join(src, "docs", "ARCHITECTURE.md"), "w") as f:
            f.write("`docs/` and `named/inner/`\n")
        got = unnamed_folders(src)
        if got != ["unnamed/"]:
            print("self-test failed: unnamed folders", got)
            return False
    return True


def git_ignored(source_dir):
    """The folders of source_dir that git ignores (e.g. var/, the demo's
    data): not part of the tree a reader clones. Empty outside a git
    checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", source_dir, "ls-files", "--others", "--ignored",
             "--exclude-standard", "--directory"],
            capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {line.rstrip("/") for line in out.splitlines() if line.endswith("/")}


def unnamed_folders(source_dir):
    """Folders of the source tree (build trees, .git and caches left out)
    whose path docs/ARCHITECTURE.md does not contain as "path/"."""
    with open(os.path.join(source_dir, "docs", "ARCHITECTURE.md")) as f:
        doc = f.read()
    ignored = git_ignored(source_dir)
    missing = []
    for root, dirs, _ in os.walk(source_dir):
        dirs[:] = sorted(
            d for d in dirs
            if not d.startswith((".git", "__pycache__")) and
            not os.path.exists(os.path.join(root, d, "CMakeCache.txt")) and
            os.path.relpath(os.path.join(root, d), source_dir) not in ignored)
        for d in dirs:
            rel = os.path.relpath(os.path.join(root, d), source_dir)
            if rel + "/" not in doc:
                missing.append(rel + "/")
    return missing


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", required=True,
                   help="leap_targets.txt of a configured build tree")
    p.add_argument("--source-dir",
                   help="also check that docs/ARCHITECTURE.md names every "
                        "folder of this source tree")
    args = p.parse_args()
    if not self_test():
        return 1
    with open(args.targets) as f:
        targets = parse(f.read())
    if "leapd" not in targets or "leap_sidecar_core" not in targets:
        print(f"{args.targets}: not the whole project's target list")
        return 1
    print(render(targets))
    problems = check(targets)
    if args.source_dir:
        problems += [f"{d}: a folder docs/ARCHITECTURE.md does not name"
                     for d in unnamed_folders(args.source_dir)]
    for pr in problems:
        print("LAYERING:", pr)
    print(f"{len(targets)} targets, {len(problems)} layering problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
