"""`make doctor WHERE=local`: what would make the local launcher's run fail on this machine, before it starts.

    python -m deploy.local.doctor -n 4 --devices-per-process 2 [--python .venv/bin/python] [--port P] [--host H]
        [--args 'train ...'] [--sweep 'optim.lr=1e-3,3e-3'] [--check-run 0]

Takes the launcher's own flags (`python -m job.launch`, read by its parser, so a bad -n fails the same
way) and the job's ARGS, and prints one line per check, exit 1 when any failed:

| check          | fails when                                                                            |
|----------------|---------------------------------------------------------------------------------------|
| coordinator    | --port is taken on --host (process 0 then crashes), or no free port can be found     |
| /dev/shm       | it is missing or not writable; with GPUs, under 1 GiB free (NCCL's shared memory)     |
| cores          | more than 8 processes per usable core (16 on 2 cores is the most measured to work)    |
| memory         | less available (MemAvailable, within the cgroup's limit) than 300 MiB per process    |
| venv           | --python cannot `import job, jax`                                                     |
| run            | ARGS (every run of SWEEP with it): its task does not import, its config does not      |
|                | validate, or its global batch does not split over -n x --devices-per-process devices |

Without --args (or with --check-run 0: make doctor without ARGS or SWEEP) the run's line says it was not
checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from deploy.checks import Check, Devices, report, run_check, run_skipped
from deploy.runner import Runner, shell_words
from job import launch
from job.core import values
from job.runtime.host import host_available, usable_cores

SHM = Path("/dev/shm")
SHM_FOR_GPUS = 1 << 30  # NCCL's shared-memory transport between the GPUs of one host; docker's default is 64 MiB
PROCESSES_PER_CORE = 8  # FACTS: 16 processes on 2 cores start and run a collective (~9.5 s); more is untested
PROCESS_BYTES = 300 << 20  # FACTS: ~230 MB RSS per process after jax's init and a collective, rounded up
VENV_PROBE = "import sys, job, jax; print(sys.version.split()[0], jax.__version__, job.__file__)"


@dataclasses.dataclass(frozen=True)
class Machine:
    """What this machine offers the launcher; read by `this_machine()`, given by tests."""

    cores: float  # usable: CPU affinity, capped by the cgroup's cpu.max quota
    available: int | None  # bytes of memory the run may take; None: unknown
    shm: Path = SHM


def this_machine() -> Machine:
    return Machine(cores=usable_cores(), available=host_available())


def _size(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


PORT_PICKS = 5  # free ports picked and tried before "the host cannot listen" is believed


def port_problem(host: str, port: int) -> str | None:
    """Why `port` cannot be bound on `host` (the coordinator's address), or None when it can. Bound as the
    coordinator's gRPC server binds it (SO_REUSEADDR): a port an earlier connection left in TIME_WAIT is
    free to it, a port another program listens on is not."""
    bare = host[1:-1] if host.startswith("[") else host
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bare, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def coordinator(cfg: launch.LaunchConfig) -> Check:
    name = "coordinator port"
    if cfg.port is not None:
        problem = port_problem(cfg.host, cfg.port)
        if problem:
            taken = problem == os.strerror(errno.EADDRINUSE)
            return Check(name, False, f"--port {cfg.port} on {cfg.host}: {problem}"
                         + (" (another program holds it: process 0 would crash at its start)" if taken else ""),
                         fix="leave --port out (the launcher picks a free one), or another --port")
        return Check(name, True, f"{cfg.host}:{cfg.port} is free")
    in_use = os.strerror(errno.EADDRINUSE)
    for _ in range(PORT_PICKS):  # a port picked free can be taken before it is tried (another program's pick)
        try:
            port = launch.coordinator_port(None)  # as the launcher picks it
        except Exception as exc:  # noqa: BLE001 (portpicker raises NoFreePortFoundError or OSError)
            return Check(name, False, f"no free port on this machine ({exc})", fix="close programs that hold ports")
        problem = port_problem(cfg.host, port)
        if problem != in_use:
            break
    if problem == in_use:
        return Check(name, False, f"each of {PORT_PICKS} ports picked free was taken before it could be tried",
                     fix="close programs that take ports, or pass --port with a port kept free for the launcher")
    if problem:
        return Check(name, False, f"--host {cfg.host}: cannot listen there ({problem})",
                     fix="--host 127.0.0.1 (the default), or an address of this machine")
    return Check(name, True, f"a free port on {cfg.host} (e.g. {port}; the launcher picks its own at the start)")


def shared_memory(cfg: launch.LaunchConfig, machine: Machine) -> Check:
    name = str(machine.shm)
    try:
        stat = os.statvfs(machine.shm)
        with tempfile.NamedTemporaryFile(dir=machine.shm, prefix="doctor-"):
            pass
    except OSError as exc:
        return Check(name, False, f"{machine.shm} is not a writable folder ({exc.strerror}): Python's "
                     "multiprocessing and NCCL keep their shared memory there",
                     fix="mount it (mount -t tmpfs -o size=2g tmpfs /dev/shm), or docker run --shm-size=2g")
    total, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    found = f"{_size(total)}, {_size(free)} free"
    if cfg.gpus and free < SHM_FOR_GPUS:
        return Check(name, False, f"{found}: under the {_size(SHM_FOR_GPUS)} NCCL needs between the GPUs of "
                     f"{cfg.num_processes} processes", fix="docker run --shm-size=8g, or mount -o remount,size=8g "
                     "/dev/shm")
    return Check(name, True, found)


def cores(cfg: launch.LaunchConfig, machine: Machine) -> Check:
    n, devices = cfg.num_processes, cfg.devices_per_process or 1
    found = (f"{n} processes x {devices} CPU device(s) on {machine.cores:g} usable core(s)"
             if not cfg.gpus else f"{n} processes on {machine.cores:g} usable core(s)")
    if n > PROCESSES_PER_CORE * machine.cores:
        most = max(int(PROCESSES_PER_CORE * machine.cores), 1)
        return Check("cores", False, f"{found}: over {PROCESSES_PER_CORE} processes per core, more than was "
                     "measured to work (16 on 2 cores); processes that reach the first collective over 30 s apart "
                     "end the run", fix=f"NPROC={most} or fewer (-n {most})")
    ratio = n * devices / machine.cores
    return Check("cores", True, found + (f" ({ratio:.1f} devices per core: slower than one each, works)"
                                         if ratio > 1 else ""))


def memory(cfg: launch.LaunchConfig, machine: Machine) -> Check:
    needed = cfg.num_processes * PROCESS_BYTES
    if machine.available is None:
        return Check.skip("memory", f"not known here (no /proc/meminfo); {cfg.num_processes} processes need about "
                          f"{_size(needed)} beyond the model", to_run="the doctor on Linux (it reads /proc/meminfo)")
    if machine.available < needed:
        most = max(machine.available // PROCESS_BYTES, 1)
        return Check("memory", False, f"{_size(machine.available)} available, under the {_size(needed)} that "
                     f"{cfg.num_processes} processes of jax need before the model (about {_size(PROCESS_BYTES)} each)",
                     fix=f"NPROC={most} or fewer, or free memory")
    return Check("memory", True, f"{_size(machine.available)} available, {cfg.num_processes} processes need about "
                 f"{_size(needed)} before the model")


def venv(python: str, runner: Runner) -> Check:
    name = "venv"
    try:
        proc = runner.run([python, "-c", VENV_PROBE], capture=True, check=False, timeout=300, mutating=False)
    except OSError as exc:
        return Check(name, False, f"{python} does not run ({exc.strerror})", fix="make venv")
    if proc.returncode != 0:
        last = ([line for line in (proc.stderr or "").splitlines() if line.strip()] or ["no message"])[-1]
        return Check(name, False, f"{python} cannot `import job, jax` (exit {proc.returncode}: {last})",
                     fix="make venv (again: it installs requirements.lock and this checkout)")
    version, jax_version, job_file = (proc.stdout.split(maxsplit=2) + ["", "", ""])[:3]
    return Check(name, True, f"{python}: Python {version}, jax {jax_version}, job from {job_file.strip()}")


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    python: str = sys.executable  # --python: the interpreter the processes run (make passes .venv's)
    args: tuple[str, ...] | None = None  # --args: ARGS, what `python -m job` runs in each process; None: not given
    sweep: str | None = None  # --sweep: SWEEP, its runs each checked with ARGS
    check_run: bool = True  # --check-run 0: the run's line says it was not checked (make doctor without ARGS, SWEEP)


def devices(cfg: launch.LaunchConfig) -> Devices:
    """The job's devices as the launcher hands them out: its GPUs, else -n x --devices-per-process CPU devices."""
    if cfg.gpus:
        return Devices(sum(len(visible.split(",")) for visible in cfg.gpus), f"the GPUs of NPROC={cfg.num_processes}")
    each = cfg.devices_per_process or 1
    return Devices(cfg.num_processes * each, f"NPROC={cfg.num_processes} x DEVICES={each}")


def run(cfg: launch.LaunchConfig, options: DoctorOptions) -> Check:
    if options.args is None or not options.check_run:
        return run_skipped(devices(cfg))
    return run_check(options.args, options.sweep, devices(cfg))


def checks(cfg: launch.LaunchConfig, options: DoctorOptions, runner: Runner, machine: Machine) -> Iterator[Check]:
    yield coordinator(cfg)
    yield shared_memory(cfg, machine)
    yield cores(cfg, machine)
    yield memory(cfg, machine)
    yield venv(options.python, runner)
    yield run(cfg, options)


def parse(argv: Sequence[str]) -> tuple[launch.LaunchConfig, DoctorOptions]:
    """The launcher's config (its own parser: a bad -n is refused as `make run-local` would refuse it), and the
    doctor's own flags."""
    parser = argparse.ArgumentParser(prog="python -m deploy.local.doctor", add_help=False)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--args", type=shell_words, default=None)
    parser.add_argument("--sweep", default="")
    parser.add_argument("--check-run", type=values.for_argparse(values.switch), nargs="?", const=True, default=True)
    ours, rest = parser.parse_known_args(list(argv))
    options = DoctorOptions(python=ours.python, args=ours.args, sweep=ours.sweep.strip() or None,
                            check_run=ours.check_run)
    return launch.parse_args([*rest, "--", sys.executable]), options


def main(argv: Sequence[str] | None = None, runner: Runner | None = None, machine: Machine | None = None) -> int:
    cfg, options = parse(sys.argv[1:] if argv is None else argv)
    return report(checks(cfg, options, runner or Runner(), machine or this_machine()), before="running")


if __name__ == "__main__":
    sys.exit(main())
