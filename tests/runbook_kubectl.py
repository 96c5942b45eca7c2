#!/usr/bin/python3
"""A stand-in for `kubectl` that tests/runbook_test.py puts first on PATH.

There is no Kubernetes cluster on the test machines, so the runbook's
cluster commands are run against this stand-in instead. It is strict rather
than permissive: every name, namespace, port and volume a command uses must
exist in the objects rendered from the overlay by the real
`kubectl kustomize`, and "running a pod" means starting the real leapd with
the leapd container's own command and arguments from the rendered
StatefulSet, its volumes mapped to directories:
  - the volumeClaimTemplate -> a directory that outlives the pod (the PVC),
  - emptyDir -> a fresh directory per pod start,
  - the Secret and ConfigMap volumes -> their files, from what was applied,
and its TCP listen addresses mapped to 127.0.0.1 (port 0 the first time,
the same port after a restart, as a pod keeps its port).
A StatefulSet whose container runs nats-server (the fleet overlay's NATS
cluster) runs the real nats-server with its mounted configuration, every
port of every replica mapped to a free 127.0.0.1 port chosen at apply
time; a pod's DNS name (<pod>.<service>[.<ns>[.svc[.cluster.local]]]:PORT)
in a configuration or in leapd's arguments (--fleet) becomes that address,
and $POD_NAME is the pod's name. Such StatefulSets start before the ones
with leapd, their pods in parallel, ready when their httpGet startup probe
answers 200.

Supported (anything else exits 2):
  kubectl kustomize DIR                       (the real kubectl)
  kubectl create namespace NAME
  kubectl -n NS create secret generic NAME --from-file=KEY=PATH [--dry-run=client -o yaml]
  kubectl apply -k DIR | -f FILE|-            (-f: Secrets only)
  kubectl -n NS rollout status|restart statefulset/NAME [--timeout=...]
  kubectl -n NS scale statefulset/NAME --replicas=N
  kubectl -n NS delete pvc NAME
  kubectl -n NS delete pod NAME [--grace-period=0 --force]   (kill -9 with
      --force, else SIGTERM; the StatefulSet starts it again at once)
  kubectl -n NS port-forward pod/NAME LOCAL:REMOTE   (writes $RUNBOOK_STATE/address)
  kubectl -n NS logs POD -c CONTAINER

Environment: RUNBOOK_STATE (state directory), REAL_KUBECTL, LEAPD.
"""

import base64
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import yaml

STATE = os.environ["RUNBOOK_STATE"]
REAL_KUBECTL = os.environ["REAL_KUBECTL"]
LEAPD = os.environ["LEAPD"]
STATE_FILE = os.path.join(STATE, "cluster.json")
NATS_SERVER = os.environ.get("NATS_SERVER", "/usr/sbin/nats-server")


class KubectlError(Exception):
    pass


def load_state():
    if not os.path.exists(STATE_FILE):
        return {"namespaces": [], "secrets": {}, "objects": {}, "pods": {},
                "ports": {}}
    with open(STATE_FILE) as f:
        return json.load(f)


def save_state(state):
    tmp = STATE_FILE + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
    os.replace(tmp, STATE_FILE)


def key(ns, kind, name):
    return f"{ns}/{kind}/{name}"


def statefulset(state, ns, ref):
    kind, _, name = ref.partition("/")
    if kind not in ("statefulset", "statefulsets", "sts",
                    "statefulset.apps"):
        raise KubectlError(f"unsupported resource '{ref}' (statefulset/NAME)")
    obj = state["objects"].get(key(ns, "StatefulSet", name))
    if obj is None:
        raise KubectlError(
            f'Error from server (NotFound): statefulsets.apps "{name}" not '
            f'found in namespace "{ns}"')
    return name, obj


def leapd_container(sts):
    spec = sts["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        if c.get("command", [""])[0].endswith("/leapd"):
            return c
    raise KubectlError(f"no leapd container in {sts['metadata']['name']}")


def nats_container(sts):
    for c in sts["spec"]["template"]["spec"].get("containers", []):
        if os.path.basename(c.get("command", [""])[0]) == "nats-server":
            return c
    return None


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def allocate_ports(state, ns, sts):
    """Fixed local ports for every replica's container ports (the pods'
    DNS names must resolve before they start: cluster routes)."""
    c = nats_container(sts)
    for i in range(replicas(sts)):
        ports = state["ports"].setdefault(f"{ns}/{sts['metadata']['name']}-{i}", {})
        for p in c.get("ports", []):
            ports.setdefault(str(p["containerPort"]), free_port())


DNS = re.compile(r"\b([a-z0-9][a-z0-9-]*)\.([a-z0-9][a-z0-9-]*)"
                 r"(?:\.([a-z0-9][a-z0-9-]*)(?:\.svc(?:\.cluster\.local)?)?)?:(\d+)\b")


def resolve(state, ns, text):
    """<pod>.<service>[.<ns>...]:PORT of a running StatefulSet pod ->
    127.0.0.1:<its mapped port>."""
    def sub(m):
        pod, svc, pod_ns, port = m.group(1), m.group(2), m.group(3) or ns, m.group(4)
        sts_name = pod.rsplit("-", 1)[0]
        sts = state["objects"].get(key(pod_ns, "StatefulSet", sts_name))
        if sts is None or sts["spec"].get("serviceName") != svc:
            return m.group(0)
        mapped = state["ports"].get(f"{pod_ns}/{pod}", {}).get(port)
        if mapped is None:
            raise KubectlError(f"{m.group(0)}: no such pod port")
        return f"127.0.0.1:{mapped}"
    return DNS.sub(sub, text)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) is not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_exit(pid, timeout_s):
    """Waits for a process that is not our child (pidfd, no polling)."""
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


def stop_pod(state, pod_key):
    pod = state["pods"].pop(pod_key, None)
    if pod is None or not pid_alive(pod["pid"]):
        return
    os.kill(pod["pid"], signal.SIGTERM)
    if not wait_exit(pod["pid"], 60):
        os.kill(pod["pid"], signal.SIGKILL)
        wait_exit(pod["pid"], 10)


def start_pod(state, ns, sts, ordinal):
    name = sts["metadata"]["name"]
    pod_name = f"{name}-{ordinal}"
    pod_key = f"{ns}/{pod_name}"
    spec = sts["spec"]["template"]["spec"]
    nats = nats_container(sts)
    c = nats if nats is not None else leapd_container(sts)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    claims = {t["metadata"]["name"]
              for t in sts["spec"].get("volumeClaimTemplates", [])}
    pod_dir = os.path.join(STATE, "pods", pod_name)
    shutil.rmtree(pod_dir, ignore_errors=True)
    os.makedirs(pod_dir)
    mapping = []
    for m in c.get("volumeMounts", []):
        vname = m["name"]
        if vname in claims:
            d = os.path.join(STATE, "pvc", f"{vname}-{name}-{ordinal}")
            os.makedirs(d, exist_ok=True)
        elif vname in volumes and "emptyDir" in volumes[vname]:
            d = os.path.join(pod_dir, vname)
            os.makedirs(d)
        elif vname in volumes and "secret" in volumes[vname]:
            src = volumes[vname]["secret"]
            secret = state["secrets"].get(f"{ns}/{src['secretName']}")
            if secret is None:
                raise KubectlError(
                    f"pod {pod_name}: secret \"{src['secretName']}\" not found"
                    " (CreateContainerConfigError)")
            d = os.path.join(pod_dir, vname)
            os.makedirs(d)
            items = src.get("items") or [{"key": k, "path": k} for k in secret]
            for item in items:
                if item["key"] not in secret:
                    raise KubectlError(f"secret {src['secretName']} has no key "
                                       f"'{item['key']}'")
                with open(os.path.join(d, item["path"]), "wb") as f:
                    f.write(base64.b64decode(secret[item["key"]]))
        elif vname in volumes and "configMap" in volumes[vname]:
            cm_name = volumes[vname]["configMap"]["name"]
            cm = state["objects"].get(key(ns, "ConfigMap", cm_name))
            if cm is None:
                raise KubectlError(f"pod {pod_name}: configmap {cm_name} not "
                                   "found")
            d = os.path.join(pod_dir, vname)
            os.makedirs(d)
            for fname, text in cm.get("data", {}).items():
                with open(os.path.join(d, fname), "w") as f:
                    f.write(resolve(state, ns, text) if nats is not None
                            else text)
        else:
            raise KubectlError(f"pod {pod_name}: volume '{vname}' mounted by "
                               f"{c['name']} is not defined")
        mapping.append((m["mountPath"].rstrip("/"), d))
    mapping.sort(key=lambda p: -len(p[0]))

    if nats is not None:
        return start_nats_pod(state, ns, sts, ordinal, c, pod_dir, mapping)
    ports = state["ports"].setdefault(pod_key, {})
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    argv = [LEAPD]
    for arg in c["command"][1:] + c.get("args", []):
        # The kubelet expands $(VAR) from the container's env.
        arg = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                     arg)
        # The pod's fsGroup is a group of leapd here only when run as root:
        # give the sockets to our own group instead.
        if arg.startswith("--shm_group="):
            arg = "--shm_group=%d" % os.getgid()
        for mount, d in mapping:
            arg = arg.replace(mount + "/", d + "/")
            if arg.endswith("=" + mount):
                arg = arg[: -len(mount)] + d
        m = re.fullmatch(r"--listen=([^/:]+):(\d+)", arg)
        if m:
            arg = f"--listen=127.0.0.1:{ports.get(m.group(2), 0)}"
        if arg.startswith("--metrics_listen=") and arg != "--metrics_listen=":
            arg = "--metrics_listen=127.0.0.1:0"
        if arg.startswith("--fleet="):
            arg = resolve(state, ns, arg)
        argv.append(arg)
    tcp_ports = [re.fullmatch(r"--listen=[^/:]+:(\d+)", a).group(1)
                 for a in c["command"][1:] + c.get("args", [])
                 if re.fullmatch(r"--listen=[^/:]+:(\d+)", a)]

    log_path = os.path.join(STATE, f"{pod_name}.leapd.log")
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(argv) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=log,
                            start_new_session=True)
    listening = []
    metrics = None
    ready = False
    for raw in proc.stdout:
        log.write(raw)
        log.flush()
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith("listening on "):
            listening.append(line[len("listening on "):])
        elif line.startswith("metrics on "):
            metrics = line[len("metrics on "):]
        elif line.startswith("leapd ") and line.endswith(" ready"):
            ready = True
            break
    if not ready:
        proc.wait()
        log.close()
        with open(log_path) as f:
            tail = f.read()[-2000:]
        raise KubectlError(f"pod {pod_name}: leapd exited with "
                           f"{proc.returncode} before it was ready "
                           f"(CrashLoopBackOff):\n{tail}")
    # Keep draining leapd's stdout into its log after we exit.
    subprocess.Popen(["cat"], stdin=proc.stdout, stdout=log,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    log.close()
    tcp = [a for a in listening if not a.startswith("unix:")]
    if len(tcp) != len(tcp_ports):
        raise KubectlError(f"pod {pod_name}: expected {len(tcp_ports)} TCP "
                           f"listen addresses, leapd printed {listening}")
    for container_port, addr in zip(tcp_ports, tcp):
        ports[container_port] = int(addr.rsplit(":", 1)[1])
    state["pods"][pod_key] = {
        "pid": proc.pid, "statefulset": name, "log": log_path,
        "metrics": metrics, "argv": argv,
        "container_ports": [p["containerPort"] for p in c.get("ports", [])]}


def start_nats_pod(state, ns, sts, ordinal, c, pod_dir, mapping):
    """Starts nats-server for pod <sts>-<ordinal> (not waiting: see
    wait_nats_ready)."""
    name = sts["metadata"]["name"]
    pod_name = f"{name}-{ordinal}"
    ports = state["ports"][f"{ns}/{pod_name}"]
    # The configuration files were written resolved; map its mount paths
    # and its 0.0.0.0:PORT listeners too.
    for mount, d in mapping:
        for root, _, files in os.walk(d):
            for fname in files:
                path = os.path.join(root, fname)
                if not path.startswith(pod_dir):
                    continue
                with open(path) as f:
                    text = f.read()
                for m2, d2 in mapping:
                    text = text.replace(m2 + "/", d2 + "/").replace(m2 + "\n", d2 + "\n")
                text = re.sub(r"0\.0\.0\.0:(\d+)",
                              lambda m: f"127.0.0.1:{ports[m.group(1)]}", text)
                with open(path, "w") as f:
                    f.write(text)
    argv = [NATS_SERVER]
    for arg in c["command"][1:] + c.get("args", []):
        for mount, d in mapping:
            arg = arg.replace(mount + "/", d + "/")
        argv.append(arg)
    env = dict(os.environ)
    for e in c.get("env", []):
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = pod_name
        elif "value" in e:
            env[e["name"]] = e["value"]
    log_path = os.path.join(STATE, f"{pod_name}.nats.log")
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(argv) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    state["pods"][f"{ns}/{pod_name}"] = {
        "pid": proc.pid, "statefulset": name, "log": log_path,
        "metrics": None, "argv": argv,
        "container_ports": [p["containerPort"] for p in c.get("ports", [])]}


def wait_nats_ready(state, ns, sts, ordinal, timeout_s=60):
    """The pod's startupProbe (httpGet) answers 200."""
    c = nats_container(sts)
    pod_key = f"{ns}/{sts['metadata']['name']}-{ordinal}"
    probe = c["startupProbe"]["httpGet"]
    port = probe["port"]
    if not str(port).isdigit():
        port = [p["containerPort"] for p in c["ports"] if p["name"] == port][0]
    url = f"http://127.0.0.1:{state['ports'][pod_key][str(port)]}{probe['path']}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(state["pods"][pod_key]["pid"]):
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        # A probe, as the kubelet's: polled. Deliberately not the pod's
        # "ready" line: what is tested is the manifest's startupProbe
        # (path, port) as the kubelet runs it.
        time.sleep(0.05)
    with open(state["pods"][pod_key]["log"]) as f:
        tail = f.read()[-2000:]
    raise KubectlError(f"pod {pod_key}: startup probe failed:\n{tail}")


def start_pods(state, ns, sts, ordinals):
    if nats_container(sts) is None:
        for i in ordinals:
            start_pod(state, ns, sts, i)
        return
    allocate_ports(state, ns, sts)
    for i in ordinals:
        start_pod(state, ns, sts, i)
    for i in ordinals:
        wait_nats_ready(state, ns, sts, i)


def replicas(sts):
    return int(sts["spec"].get("replicas", 1))


def pods_of(state, ns, name):
    return sorted(k for k, p in state["pods"].items()
                  if k.startswith(ns + "/") and p["statefulset"] == name)


def cmd_apply(state, ns, args):
    if args[:1] == ["-k"] and len(args) == 2:
        out = subprocess.run([REAL_KUBECTL, "kustomize", args[1]],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise KubectlError(out.stderr)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    elif args[:1] == ["-f"] and len(args) == 2:
        text = sys.stdin.read() if args[1] == "-" else open(args[1]).read()
        docs = [d for d in yaml.safe_load_all(text) if d]
        if any(d["kind"] != "Secret" for d in docs):
            raise KubectlError("this stand-in applies only Secrets with -f")
    else:
        raise KubectlError(f"unsupported: apply {' '.join(args)}")
    to_start = []
    for d in docs:
        d_ns = d["metadata"].get("namespace", ns)
        if d_ns not in state["namespaces"]:
            raise KubectlError(f'Error from server (NotFound): namespaces '
                               f'"{d_ns}" not found')
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "Secret":
            state["secrets"][f"{d_ns}/{name}"] = dict(d.get("data", {}))
            print(f"secret/{name} configured")
            continue
        k = key(d_ns, kind, name)
        old = state["objects"].get(k)
        state["objects"][k] = d
        print(f"{kind.lower()}/{name} "
              f"{'created' if old is None else 'unchanged' if old == d else 'configured'}")
        if kind == "StatefulSet" and (
                old is None or old["spec"]["template"] != d["spec"]["template"]):
            to_start.append((d_ns, d))
    # What the leapd pods connect to (NATS) first.
    to_start.sort(key=lambda x: nats_container(x[1]) is None)
    for d_ns, d in to_start:
        for pod_key in pods_of(state, d_ns, d["metadata"]["name"]):
            stop_pod(state, pod_key)
        start_pods(state, d_ns, d, range(replicas(d)))


def cmd_create(state, ns, args):
    if args[:1] == ["namespace"] and len(args) == 2:
        if args[1] in state["namespaces"]:
            raise KubectlError(f'Error from server (AlreadyExists): '
                               f'namespaces "{args[1]}" already exists')
        state["namespaces"].append(args[1])
        print(f"namespace/{args[1]} created")
        return
    if args[:2] != ["secret", "generic"] or len(args) < 4:
        raise KubectlError(f"unsupported: create {' '.join(args)}")
    if "--dry-run=client" in args:
        real = subprocess.run([REAL_KUBECTL, "-n", ns, "create"] + args,
                              capture_output=True, text=True)
        sys.stderr.write(real.stderr)
        if real.returncode != 0:
            raise KubectlError("kubectl create --dry-run=client failed")
        sys.stdout.write(real.stdout)
        return
    if ns not in state["namespaces"]:
        raise KubectlError(f'Error from server (NotFound): namespaces "{ns}" '
                           'not found')
    name = args[2]
    if f"{ns}/{name}" in state["secrets"]:
        raise KubectlError(f'Error from server (AlreadyExists): secrets '
                           f'"{name}" already exists')
    data = {}
    for a in args[3:]:
        m = re.fullmatch(r"--from-file=([^=]+)=(.+)", a)
        if not m:
            raise KubectlError(f"unsupported argument {a}")
        with open(m.group(2), "rb") as f:
            data[m.group(1)] = base64.b64encode(f.read()).decode()
    state["secrets"][f"{ns}/{name}"] = data
    print(f"secret/{name} created")


def cmd_rollout(state, ns, args):
    args = [a for a in args if not a.startswith("--timeout=")]
    if len(args) != 2 or args[0] not in ("status", "restart"):
        raise KubectlError(f"unsupported: rollout {' '.join(args)}")
    name, sts = statefulset(state, ns, args[1])
    if args[0] == "restart":
        for pod_key in pods_of(state, ns, name):
            stop_pod(state, pod_key)
        start_pods(state, ns, sts, range(replicas(sts)))
        print(f"statefulset.apps/{name} restarted")
        return
    running = [k for k in pods_of(state, ns, name)
               if pid_alive(state["pods"][k]["pid"])]
    if len(running) != replicas(sts):
        raise KubectlError(f"statefulset {name}: {len(running)} of "
                           f"{replicas(sts)} pods running")
    print(f"partitioned roll out complete: {len(running)} new pods have been "
          "updated...")


def cmd_scale(state, ns, args):
    if len(args) != 2 or not args[1].startswith("--replicas="):
        raise KubectlError(f"unsupported: scale {' '.join(args)}")
    name, sts = statefulset(state, ns, args[0])
    n = int(args[1].split("=", 1)[1])
    for pod_key in pods_of(state, ns, name):
        if int(pod_key.rsplit("-", 1)[1]) >= n:
            stop_pod(state, pod_key)
    sts["spec"]["replicas"] = n
    start_pods(state, ns, sts,
               [i for i in range(n) if f"{ns}/{name}-{i}" not in state["pods"]])
    print(f"statefulset.apps/{name} scaled")


def cmd_delete_pod(state, ns, args):
    force = "--force" in args
    rest = [a for a in args if a not in ("--force", "--grace-period=0")]
    if len(rest) != 1 or len(args) - len(rest) not in (0, 2):
        raise KubectlError(f"unsupported: delete pod {' '.join(args)}")
    pod_key = f"{ns}/{rest[0]}"
    pod = state["pods"].get(pod_key)
    if pod is None:
        raise KubectlError(f'Error from server (NotFound): pods "{rest[0]}" '
                           'not found')
    if force:
        if pid_alive(pod["pid"]):
            os.kill(pod["pid"], signal.SIGKILL)
            wait_exit(pod["pid"], 10)
        state["pods"].pop(pod_key)
        print("Warning: Immediate deletion does not wait for confirmation "
              "that the running resource has been terminated.")
        print(f'pod "{rest[0]}" force deleted')
    else:
        stop_pod(state, pod_key)
        print(f'pod "{rest[0]}" deleted')
    # The StatefulSet controller replaces it (same name, ports, PVC).
    sts = state["objects"][key(ns, "StatefulSet", pod["statefulset"])]
    start_pods(state, ns, sts, [int(rest[0].rsplit("-", 1)[1])])


def cmd_delete(state, ns, args):
    if args[:1] in (["pod"], ["pods"]):
        return cmd_delete_pod(state, ns, args[1:])
    if len(args) != 2 or args[0] not in ("pvc", "persistentvolumeclaim"):
        raise KubectlError(f"unsupported: delete {' '.join(args)}")
    d = os.path.join(STATE, "pvc", args[1])
    if not os.path.isdir(d):
        raise KubectlError(f'Error from server (NotFound): '
                           f'persistentvolumeclaims "{args[1]}" not found')
    for pod_key, pod in state["pods"].items():
        if pod_key.startswith(ns + "/") and any(d in a for a in pod["argv"]):
            raise KubectlError(f"pvc {args[1]} is in use by pod "
                               f"{pod_key} (it would stay Terminating)")
    shutil.rmtree(d)
    print(f'persistentvolumeclaim "{args[1]}" deleted')


def cmd_port_forward(state, ns, args):
    if len(args) != 2 or not args[0].startswith("pod/"):
        raise KubectlError(f"unsupported: port-forward {' '.join(args)}")
    pod_key = f"{ns}/{args[0][len('pod/'):]}"
    pod = state["pods"].get(pod_key)
    if pod is None or not pid_alive(pod["pid"]):
        raise KubectlError(f'error: unable to forward port because pod is not '
                           f'running ({pod_key})')
    local, _, remote = args[1].partition(":")
    if int(remote) not in pod["container_ports"]:
        raise KubectlError(f"pod {pod_key} declares no container port "
                           f"{remote}")
    mapped = state["ports"].get(pod_key, {}).get(remote)
    if mapped is None:
        raise KubectlError(f"pod {pod_key}: nothing listens on {remote}")
    with open(os.path.join(STATE, "address"), "w") as f:
        f.write(f"127.0.0.1:{mapped}")
    print(f"Forwarding from 127.0.0.1:{local} -> {remote}")


def cmd_logs(state, ns, args):
    if len(args) != 3 or args[1] != "-c":
        raise KubectlError(f"unsupported: logs {' '.join(args)}")
    pod = state["pods"].get(f"{ns}/{args[0]}")
    if pod is None:
        raise KubectlError(f'Error from server (NotFound): pods "{args[0]}" '
                           'not found')
    with open(pod["log"]) as f:
        sys.stdout.write(f.read())


def main(argv):
    with open(os.path.join(STATE, "calls.log"), "a") as f:
        f.write(json.dumps(argv) + "\n")
    ns = "default"
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] in ("-n", "--namespace"):
            ns = argv[i + 1]
            i += 2
            continue
        if argv[i].startswith("--namespace="):
            ns = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    if not rest:
        raise KubectlError("no command")
    if rest[0] == "kustomize":
        os.execv(REAL_KUBECTL, [REAL_KUBECTL] + rest)
    handlers = {"apply": cmd_apply, "create": cmd_create,
                "rollout": cmd_rollout, "scale": cmd_scale,
                "delete": cmd_delete, "port-forward": cmd_port_forward,
                "logs": cmd_logs}
    if rest[0] not in handlers:
        raise KubectlError(f"unsupported command '{rest[0]}'")
    state = load_state()
    try:
        handlers[rest[0]](state, ns, rest[1:])
    finally:
        save_state(state)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KubectlError as e:
        print(f"kubectl (runbook stand-in): {e}", file=sys.stderr)
        sys.exit(1)
