"""`tpu-vm ssh --command=...` on simulated workers: one local `bash -c COMMAND` per worker.

Each worker gets what a TPU VM would give it: its own home directory (under
the state folder), a PATH whose `python3` is the simulator's interpreter, and
the variables `job.initialize` reads on a TPU pod (TPU_WORKER_ID,
TPU_WORKER_HOSTNAMES) plus a free JOB_COORDINATOR_PORT per session, on CPU.
The command itself is run as given, never rewritten.

While the workers run, the node's state is watched: PREEMPTED (see
`state.schedule_preemption`) sends SIGTERM to every worker's process group,
SIGKILL after FAKE_GCLOUD_PREEMPT_GRACE_SECONDS (default 30); a deleted node
kills them at once. Either way the session ends with exit code 255, as a real
ssh whose VM went away. Otherwise the exit code is the first non-zero one in
worker order, or 0.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from tests.tpu.fake_gcloud.commands import CloudError, where
from tests.tpu.fake_gcloud.grammar import Parsed
from tests.tpu.fake_gcloud.state import Cloud

GRACE_ENV = "FAKE_GCLOUD_PREEMPT_GRACE_SECONDS"
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
    }
    for name, text in programs.items():
        path = folder / name
        if not path.exists() or path.read_text() != text:
            tmp = folder / f".{name}.tmp"
            tmp.write_text(text)
            tmp.chmod(0o755)
            tmp.replace(path)
    return folder


def worker_env(cloud: Cloud, record: dict[str, Any], worker: int, port: int, home: Path) -> dict[str, str]:
    user = getpass.getuser()
    return {
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


def _preemption_due(control: Path, started: float) -> bool:
    try:
        plan = json.loads(control.read_text())
    except (FileNotFoundError, ValueError):
        return False
    if plan.get("when_exists") and Path(plan["when_exists"]).exists():
        return True
    return plan.get("after_s") is not None and time.monotonic() - started >= float(plan["after_s"])


def ssh(cloud: Cloud, parsed: Parsed, workers: list[int], record: dict[str, Any]) -> int:
    import portpicker

    command = parsed.get("command")
    if command is None:
        raise CloudError(parsed, "the simulator does not model interactive sessions: pass --command=...")
    project, zone = where(parsed)
    name = record["name"]
    port = portpicker.pick_unused_port()
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
    started = time.monotonic()
    while any(p.poll() is None for p in procs):
        if hangups:  # our own ssh was interrupted: the remote commands get SIGHUP, as when a session drops
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
                _wait_all(procs, float(os.environ.get(GRACE_ENV, "30")))
            return LOST
        time.sleep(POLL_S)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)
