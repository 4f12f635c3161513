"""`tpu-vm ssh --command=...` on simulated workers: one local `bash -c COMMAND` per worker.

Each worker gets what a TPU VM would give it: its own home directory (under
the state folder), a PATH whose `python3` is the simulator's interpreter, and
the variables `job.initialize` reads on a TPU pod (TPU_WORKER_ID,
TPU_WORKER_HOSTNAMES) plus a free JOB_COORDINATOR_PORT per session, on CPU.
The command itself is run as given, never rewritten.

Every process started on a worker carries FAKE_GCLOUD_VM (its VM), so a
process that left the ssh session (setsid, nohup) still belongs to its VM, as
on a real one: while any session watches the node, PREEMPTED (see
`state.schedule_preemption`) sends SIGTERM to every process of the node's VMs,
SIGKILL after FAKE_GCLOUD_PREEMPT_GRACE_SECONDS (default 30); a deleted node
kills them at once. Either way the session ends with exit code 255, as a real
ssh whose VM went away. A dropped connection (`schedule_drop`) ends one session
with 255 (its own commands get SIGHUP) while the VMs and their detached
processes go on. Otherwise the exit code is the first non-zero one in worker
order, or 0.

The VM image has `gcloud` (this simulator, so `gcloud auth configure-docker`
works there) and `docker` (podman, with this machine's CONTAINERS_CONF; each
VM's container names kept apart, and a `pull` of an image present locally
stands for the registry's copy). Nodes of one queued resource share one
coordinator port (one network), so a multislice job forms one cluster.
FAKE_GCLOUD_WORKER_ENV (a JSON object) adds variables to every worker: the
simulated cloud's service endpoints (a Cloud Storage emulator). A worker is a
process the tests start: it compiles as they do (tests/site/sitecustomize.py,
JOB_TESTS_COMPILE and JOB_TESTS_CACHE_KEYS) into their compilation cache
(tests/launching.py: each worker's own home would hold a cache no other worker
and no later test reads), and nothing else of this machine's environment
reaches it.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from job.core.ports import free_port
from tests.launching import compilation_cache_env
from tests.tpu.fake_gcloud.commands import CloudError, where
from tests.tpu.fake_gcloud.grammar import Parsed
from tests.tpu.fake_gcloud.state import Cloud

BIN_DIR = Path(__file__).resolve().parent  # holds the `gcloud` executable
TESTS_SITE = BIN_DIR.parents[1] / "site"  # the tests' sitecustomize.py
TESTS_SITE_ENV = ("JOB_TESTS_COMPILE", "JOB_TESTS_CACHE_KEYS")

GRACE_ENV = "FAKE_GCLOUD_PREEMPT_GRACE_SECONDS"
WORKER_ENV = "FAKE_GCLOUD_WORKER_ENV"  # JSON object: variables every worker gets on top
VM_ENV = "FAKE_GCLOUD_VM"  # on every worker process: STATE/PROJECT/ZONE/NODE/worker-I
DEVICES_ENV = "FAKE_GCLOUD_DEVICES_PER_WORKER"  # CPU devices each simulated worker sees (default 1)
LOST = 255  # what ssh returns when the connection drops
POLL_S = 0.1


def select_workers(parsed: Parsed, record: dict[str, Any]) -> list[int]:
    """--worker=all | 0 | 1,4,6 | 1-3 (default 0) -> worker indices, checked against the node."""
    spec = str(parsed.get("worker") or "0")
    count = record["workers"]
    if spec == "all":
        return list(range(count))
    if not re.fullmatch(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*", spec):
        raise CloudError(parsed, f"Invalid value for [--worker]: {spec!r}; expected all, N, N,M,... or N-M")
    chosen: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        chosen += range(int(first), int(last or first) + 1)
    bad = [w for w in chosen if w >= count]
    if bad:
        raise CloudError(parsed, f"Invalid value for [--worker]: {bad[0]} is not a worker of {record['name']} "
                         f"(workers 0-{count - 1})")
    return sorted(set(chosen))


def _vm_bin(cloud: Cloud) -> Path:
    """The simulated VM image's own programs, first on the workers' PATH."""
    folder = cloud.root / "vm-bin"
    folder.mkdir(exist_ok=True)
    programs = {
        # the VM's python: the interpreter running this simulator (it has the job's dependencies)
        "python3": f'#!/bin/sh\nexec {json.dumps(sys.executable)} "$@"\n',
        "python": f'#!/bin/sh\nexec {json.dumps(sys.executable)} "$@"\n',
        # the host's devices are not the VM's: never kill what holds them here
        "fuser": '#!/bin/sh\necho "fuser $*" >>"$HOME/.fuser-calls"\nexit 1\n',
        # no privileges to gain on a simulated VM; and the host's sudo would reset PATH to the host's fuser
        "sudo": '#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n',
        "gcloud": (f'#!/bin/sh\nFAKE_GCLOUD_STATE={shlex.quote(str(cloud.root))} '
                   f'FAKE_GCLOUD_PYTHON={shlex.quote(sys.executable)} exec {shlex.quote(str(BIN_DIR / "gcloud"))} "$@"\n'),
        "docker": _docker_shim(),
    }
    for name, text in programs.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            tmp = folder / f".{name}.tmp"
            tmp.write_text(text)
            tmp.chmod(0o755)
            tmp.replace(path)
    return folder


def _docker_shim() -> str:
    """`docker` on a simulated VM: podman (Debian's podman-docker `docker` is the same thing)."""
    podman = shutil.which("podman") or "podman"
    conf = os.environ.get("CONTAINERS_CONF", "")
    return "\n".join([
        "#!/bin/bash",
        "# one docker per VM: its container names get the VM's suffix",
        'vm=-vm$(printf %s "$FAKE_GCLOUD_VM" | cksum | cut -d" " -f1)',
        f"engine=(env {'CONTAINERS_CONF=' + shlex.quote(conf) + ' ' if conf else ''}{shlex.quote(podman)})",
        'if [ "$1" = pull ] && "${engine[@]}" image exists "${@: -1}"; then echo "${@: -1}: present"; exit 0; fi',
        'args=("$1"); shift',
        'for a in "$@"; do',
        '  case "$a" in',
        '    --name=*) a="$a$vm" ;;',
        '    -*) ;;',
        '    *) if [ "${args[0]}" = rm ] || [ "${args[0]}" = kill ] || [ "${args[0]}" = stop ]; then a="$a$vm"; fi ;;',
        '  esac',
        '  args+=("$a")',
        'done',
        'exec "${engine[@]}" "${args[@]}"',  # signals (tpu-stop's TERM) reach podman, which passes them on
        "",
    ])


def _port(cloud: Cloud, parsed: Parsed, record: dict[str, Any]) -> int:
    """The coordinator port of the node's network: one per queued resource (all its nodes), else per node."""
    project, zone = where(parsed)
    path = cloud.root / "ports" / project / zone / str(record.get("queuedResource") or record["name"])
    with cloud.lock():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(str(free_port()))
        return int(path.read_text())


def worker_env(cloud: Cloud, record: dict[str, Any], worker: int, port: int, home: Path) -> dict[str, str]:
    user = getpass.getuser()
    tests_site = {name: os.environ[name] for name in TESTS_SITE_ENV if name in os.environ}
    return {
        **({"PYTHONPATH": str(TESTS_SITE), **compilation_cache_env(), **tests_site} if tests_site else {}),
        **json.loads(os.environ.get(WORKER_ENV, "{}")),
        VM_ENV: f"{cloud.root}/{record['project']}/{record['zone']}/{record['name']}/worker-{worker}",
        "HOME": str(home), "USER": user, "LOGNAME": user, "SHELL": "/bin/bash", "LANG": "C.UTF-8",
        "PATH": f"{_vm_bin(cloud)}:/usr/local/bin:/usr/bin:/bin",
        "TPU_WORKER_ID": str(worker),
        "TPU_WORKER_HOSTNAMES": ",".join(["127.0.0.1"] * record["workers"]),
        "TPU_ACCELERATOR_TYPE": record["acceleratorType"],
        "JOB_COORDINATOR_PORT": str(port),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={os.environ.get(DEVICES_ENV, '1')}",
    }


def _pump(pipe: IO[bytes], out: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(pipe.readline, b""):
        with lock:
            out.write(line)
            out.flush()
    pipe.close()


def _signal_all(procs: list[subprocess.Popen[bytes]], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)


def _due(plan: dict[str, Any], started: float) -> bool:
    if plan.get("when_exists") and Path(plan["when_exists"]).exists():
        return True
    return plan.get("after_s") is not None and time.monotonic() - started >= float(plan["after_s"])


def _preemption_due(control: Path, started: float) -> bool:
    try:
        plan = json.loads(control.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return _due(plan, started)


def _drop_file(cloud: Cloud, project: str, zone: str, name: str) -> Path:
    return cloud.root / "control" / project / zone / f"{name}.drop.json"


def _drop_due(cloud: Cloud, path: Path, started: float) -> bool:
    """The first planned drop is due for this session: take it off the plan."""
    try:
        plans = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return False
    if not plans or not _due(plans[0], started):
        return False
    with cloud.lock():
        path.write_text(json.dumps(plans[1:]))
    return True


def vm_processes(prefix: str) -> list[int]:
    """Every process whose FAKE_GCLOUD_VM starts with `prefix` (a node's, or one worker's)."""
    wanted = f"{VM_ENV}={prefix}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if any(var.startswith(wanted) for var in (entry / "environ").read_bytes().split(b"\0")):
                found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def _signal_vms(prefix: str, sig: int) -> None:
    for pid in vm_processes(prefix):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop_vms(prefix: str, grace_s: float) -> None:
    """A VM going away: SIGTERM to all its processes, SIGKILL to what is left after `grace_s`."""
    _signal_vms(prefix, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and vm_processes(prefix):
        time.sleep(POLL_S)
    _signal_vms(prefix, signal.SIGKILL)


def ssh(cloud: Cloud, parsed: Parsed, workers: list[int], record: dict[str, Any]) -> int:
    command = parsed.get("command")
    if command is None:
        raise CloudError(parsed, "the simulator does not model interactive sessions: pass --command=...")
    project, zone = where(parsed)
    name = record["name"]
    port = _port(cloud, parsed, record)
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    hangups: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: hangups.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for worker in workers:
            print(f"SSH: Attempting to connect to worker {worker}...", file=sys.stderr, flush=True)
            home = cloud.home(project, zone, name, worker)
            proc = subprocess.Popen(["bash", "-c", str(command)], cwd=home,
                                    env=worker_env(cloud, record, worker, port, home), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            cloud.register_pid(proc.pid)
            procs.append(proc)
            for pipe, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                pumps.append(threading.Thread(target=_pump, args=(pipe, out, lock), daemon=True))
                pumps[-1].start()
        code = _watch(cloud, parsed, record, procs, hangups)
    finally:
        _signal_all(procs, signal.SIGKILL)
        for proc in procs:
            proc.wait()
            cloud.unregister_pid(proc.pid)
        for pump in pumps:
            pump.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == LOST:
        print(f"Connection to 127.0.0.1 closed by remote host ({name}).", file=sys.stderr, flush=True)
    return code


def _watch(cloud: Cloud, parsed: Parsed, record: dict[str, Any], procs: list[subprocess.Popen[bytes]],
           hangups: list[int]) -> int:
    project, zone = where(parsed)
    name = record["name"]
    control = cloud.control_file(project, zone, name)
    drops = _drop_file(cloud, project, zone, name)
    node_vms = f"{cloud.root}/{project}/{zone}/{name}/"
    started = time.monotonic()
    while any(p.poll() is None for p in procs):
        if hangups or _drop_due(cloud, drops, started):
            # our own ssh was interrupted, or the connection dropped: the session's commands get SIGHUP
            _signal_all(procs, signal.SIGHUP)
            _wait_all(procs, 30)
            return LOST
        if _preemption_due(control, started):
            with cloud.lock():
                cloud.preempt(project, zone, name)
                control.unlink(missing_ok=True)
        now = cloud.node(project, zone, name)
        if now is None or now["state"] != "READY":
            if now is not None and now["state"] == "PREEMPTED":
                _signal_all(procs, signal.SIGTERM)
                _stop_vms(node_vms, float(os.environ.get(GRACE_ENV, "30")))
                _wait_all(procs, float(os.environ.get(GRACE_ENV, "30")))
            else:
                _signal_vms(node_vms, signal.SIGKILL)
            return LOST
        time.sleep(POLL_S)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)


# ---------------------------------------------------------------------- for tests
def schedule_drop(state: Path, name: str, zone: str, *, when_exists: Path | None = None, after_s: float | None = None,
                  project: str = "fake-project") -> None:
    """Drop the connection of the ssh session running on the node when `when_exists` appears, or `after_s`
    seconds after it started: that session exits 255, the workers' detached processes go on. Each call
    plans one more drop; they happen in order, one per session."""
    cloud = Cloud(state)
    path = _drop_file(cloud, project, zone, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with cloud.lock():
        plans = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*plans, {"when_exists": str(when_exists) if when_exists else None,
                                             "after_s": after_s}]))


def kill_vms(state: Path) -> list[int]:
    """SIGKILL every process still running on a simulated VM of this state folder (detached ones too)."""
    pids = vm_processes(f"{Cloud(state).root}/")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
