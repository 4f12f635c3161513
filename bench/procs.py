"""Starting benchmark processes: one worker, a cluster through `job.launch`, or a bare cluster.

Children report by printing one line ``BENCH-RECORD {json}`` on stdout
(`emit`); the parent collects those lines (`records`), whatever prefix the
launcher put in front of them. Everything runs on CPU (JAX_PLATFORMS=cpu)
unless a benchmark asks otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARKER = "BENCH-RECORD "
HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"


class BenchError(RuntimeError):
    """A benchmark process failed; the message carries the end of its output."""


def emit(record: dict[str, Any]) -> None:
    """Child side: hand one record to the parent."""
    print(MARKER + json.dumps(record), flush=True)


def records(text: str) -> list[dict[str, Any]]:
    """Parent side: every record in a child's (or the launcher's) output."""
    return [json.loads(line.split(MARKER, 1)[1]) for line in text.splitlines() if MARKER in line]


def cpu_env(devices: int | None = 1, **extra: str) -> dict[str, str]:
    """This environment, on CPU, with `devices` host devices per process and unbuffered output."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = env.get("BENCH_JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if devices is not None:
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(HOST_DEVICES_FLAG)]
        env["XLA_FLAGS"] = " ".join([*kept, f"{HOST_DEVICES_FLAG}={devices}"])
    env.update(extra)
    return env


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_worker(module: str, args: list[str], *, devices: int | None = 2, timeout_s: float = 600,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m MODULE worker ARGS`` in a fresh process; return its last record.

    The worker's stderr (its progress lines) passes through to ours.
    """
    command = [sys.executable, "-m", module, "worker", *args]
    proc = subprocess.run(command, cwd=ROOT, env=env or cpu_env(devices), stdout=subprocess.PIPE,
                          text=True, timeout=timeout_s, check=False)
    found = records(proc.stdout)
    if proc.returncode != 0 or not found:
        raise BenchError(f"{' '.join(command)} exited with {proc.returncode}:\n{_tail(proc.stdout)}")
    return found[-1]


@dataclasses.dataclass
class ClusterRun:
    """One cluster launch: when it started and ended (time.time()), and each rank's record."""

    started: float
    ended: float
    ranks: list[dict[str, Any]]

    @property
    def wall_s(self) -> float:
        return self.ended - self.started


def launch_template(n: int, child: list[str], *, timeout_s: float = 300) -> ClusterRun:
    """``python -m job.launch -n N --devices-per-process 1 -- python -m CHILD...``."""
    command = [sys.executable, "-m", "job.launch", "-n", str(n), "--devices-per-process", "1",
               "--", sys.executable, "-m", *child]
    started = time.time()
    proc = subprocess.Popen(command, cwd=ROOT, env=cpu_env(None), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher forwards it to every rank
        out, err = proc.communicate()
        raise BenchError(f"job.launch -n {n} ran past {timeout_s} s:\n{_tail(out + err)}") from None
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    ended = time.time()
    ranks = sorted(records(out), key=lambda r: r["rank"])
    if proc.returncode != 0 or len(ranks) != n:
        raise BenchError(f"job.launch -n {n} exited with {proc.returncode}, {len(ranks)} of {n} records:\n"
                         f"{_tail(out)}\n{_tail(err)}")
    return ClusterRun(started, ended, ranks)


def launch_bare(n: int, child: list[str], *, timeout_s: float = 300) -> ClusterRun:
    """The baseline launcher: a plain Popen loop and a portpicker port, nothing else.

    Children get their own sessions like job.launch's (see below), so both are scheduled alike.

    Rank i runs ``python -m CHILD... 127.0.0.1:PORT N i``.
    """
    import portpicker

    port = portpicker.pick_unused_port()
    env = cpu_env(1)
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as tmp:
        outs = [open(Path(tmp) / f"{i}.out", "w+") for i in range(n)]  # noqa: SIM115
        started = time.time()
        # Each child in its own session, as job.launch starts them: with the kernel's autogroup
        # scheduling, processes of one session share one CPU share against everything else running.
        procs = [subprocess.Popen([sys.executable, "-m", *child, f"127.0.0.1:{port}", str(n), str(i)],
                                  cwd=ROOT, env=env, stdout=outs[i], stderr=subprocess.STDOUT,
                                  start_new_session=True)
                 for i in range(n)]
        deadline = time.monotonic() + timeout_s
        failed = None
        try:
            while any(p.poll() is None for p in procs):
                failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        finally:  # a failure, the deadline or Ctrl-C: the others would wait in init for minutes
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        ended = time.time()
        texts = []
        for f in outs:
            f.seek(0)
            texts.append(f.read())
            f.close()
    failed = next((i for i, p in enumerate(procs) if p.returncode != 0), failed)
    ranks = sorted((r for t in texts for r in records(t)), key=lambda r: r["rank"])
    if failed is not None or len(ranks) != n:
        where = failed if failed is not None else 0
        raise BenchError(f"bare cluster of {n}: rank {where} exited with {procs[where].returncode}, "
                         f"{len(ranks)} of {n} records:\n{_tail(texts[where])}")
    return ClusterRun(started, ended, ranks)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
