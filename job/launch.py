"""Start N local processes that form one JAX cluster (like torchrun, for JAX).

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job train
    python -m job.launch -n 8 -- python -m job train      # on an 8-GPU machine: one GPU each

Each child gets the variables `job.initialize` detects as a "local" cluster,
its own CPU device count, and a free coordinator port on loopback. On a
machine with GPUs (CUDA_VISIBLE_DEVICES, else the /dev/nvidiaN device files;
none when JAX_PLATFORMS names no GPU platform) each child gets its own share
through CUDA_VISIBLE_DEVICES: the visible GPUs split evenly, or
``--gpus-per-process K``; ``--gpus-per-process 0`` gives every child all of
them. Output lines carry a ``[rank N]`` prefix. Fail fast: when one process
fails the others are stopped and the launcher exits with that failure's code
(a rank that crashed, killed by SIGKILL or SIGSEGV, counts as the failure even
when a peer's exit in reaction to it was seen first). SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 are forwarded to every child.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from job.core import ports, values
from job.core.errors import ConfigError, refuse_dash_values
from job.runtime.cluster.base import CUDA_VISIBLE_DEVICES, visible_gpus
from job.runtime.cluster.local import LocalLauncher
from job.runtime.procgroup import ProcessGroup

log = logging.getLogger("job.launch")

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
MAX_LOCAL = 1024  # more processes (or CPU devices per process) than this on one machine is a typo
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")  # RFC 1123
DEVICE_DIR = Path("/dev")  # where the NVIDIA driver's /dev/nvidiaN files are
_GPU_FILE = re.compile(r"nvidia[0-9]+")
_GPU_PLATFORMS = {"cuda", "gpu"}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    num_processes: int  # how many processes to start
    command: tuple[str, ...]  # what each process runs
    devices_per_process: int | None = None  # CPU devices per process; None leaves XLA_FLAGS alone
    host: str = "127.0.0.1"  # where process 0's coordinator listens
    port: int | None = None  # coordinator port; None picks a free one
    kill_after_s: float = 5.0  # after a failure, how long the others get before SIGKILL
    stop_timeout_s: float = 60.0  # after a forwarded signal, how long children get to save and exit
    prefix: bool = True  # prefix each output line with [rank N]
    gpus: tuple[str, ...] = ()  # each process's CUDA_VISIBLE_DEVICES, by rank; empty leaves it alone


positive_int = values.for_argparse(values.whole, minimum=1)


def command_line(nproc: int, devices: int | None, job_argv: Sequence[str]) -> list[str]:
    """The command line that runs `python -m job JOB_ARGV` on `nproc` local processes (`devices` CPU devices each)."""
    argv = [sys.executable, "-m", "job.launch", "-n", str(nproc)]
    if devices is not None:
        argv += ["--devices-per-process", str(devices)]
    return [*argv, "--", sys.executable, "-m", "job", *job_argv]


def local_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_LOCAL:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LOCAL} on one machine, found {text!r}")
    return value


_gpu_count = values.for_argparse(values.whole, maximum=MAX_LOCAL)  # --gpus-per-process: 0 (do not split) or GPUs


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, found {text!r}")
    return value


def _host(text: str) -> str:
    """An IPv4 address, a [bracketed] IPv6 address or a host name: the coordinator address is HOST:PORT."""
    bracketed = text.startswith("[") and text.endswith("]")
    try:
        ok = (ipaddress.ip_address(text[1:-1] if bracketed else text).version == 6) == bracketed
    except ValueError:
        ok = not bracketed and _HOSTNAME.fullmatch(text) is not None
    if not ok:
        raise argparse.ArgumentTypeError(
            f"expected an IP address or host name (IPv6 in brackets: [::1]), found {text!r}")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m job.launch",
        description="Run COMMAND as N local processes that form one JAX cluster.",
        epilog="examples: python -m job.launch -n 4 --devices-per-process 2 -- python -m job; "
               "on an 8-GPU machine, one GPU each: python -m job.launch -n 8 -- python -m job",
    )
    p.add_argument("-n", "--nproc", type=local_count, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=local_count, default=None,
                   help="CPU devices each process sees (sets XLA_FLAGS)")
    p.add_argument("--gpus-per-process", type=_gpu_count, default=None, metavar="K",
                   help="GPUs each process gets, through CUDA_VISIBLE_DEVICES (default: the visible GPUs split "
                        "evenly over -n; 0: every process sees them all). Visible: CUDA_VISIBLE_DEVICES, else "
                        "/dev/nvidiaN; none when JAX_PLATFORMS names no GPU platform (cpu): then nothing changes")
    p.add_argument("--host", type=_host, default="127.0.0.1", help="coordinator address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--kill-after", type=values.for_argparse(values.seconds), default=5.0,
                   help="seconds the others get after one process fails, before SIGKILL")
    p.add_argument("--stop-timeout", type=values.for_argparse(values.seconds), default=60.0,
                   help="seconds children get to exit after a forwarded signal, before SIGKILL")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    return p


def gpus_here(env: Mapping[str, str], device_dir: Path = DEVICE_DIR) -> tuple[tuple[str, ...], str]:
    """The GPUs this machine lets the launcher hand out, and where that came from.

    CUDA_VISIBLE_DEVICES's list when it is set (its entries go to the children as
    written); else one per /dev/nvidiaN file, numbered 0..N-1 as CUDA numbers them;
    none when JAX_PLATFORMS is set without a GPU platform (``cpu``).
    """
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms and not _GPU_PLATFORMS & {name.strip() for name in platforms.split(",")}:
        return (), f"JAX_PLATFORMS={platforms}"
    listed = visible_gpus(env)
    if listed is not None:
        return listed, f"{CUDA_VISIBLE_DEVICES}={env[CUDA_VISIBLE_DEVICES]}"
    try:
        count = sum(1 for entry in device_dir.iterdir() if _GPU_FILE.fullmatch(entry.name))
    except OSError:
        count = 0
    return tuple(map(str, range(count))), f"{count} {device_dir / 'nvidiaN'} device files"


def gpu_shares(parser: argparse.ArgumentParser, nproc: int, per_process: int | None,
               gpus: tuple[str, ...], source: str) -> tuple[str, ...]:
    """Each rank's CUDA_VISIBLE_DEVICES, or () to leave it alone; a usage error when they do not fit."""
    if per_process == 0 or (per_process is None and not gpus):
        return ()
    found = len(gpus)
    if per_process is None:
        if found % nproc:
            fits = f"--gpus-per-process {found // nproc} (some idle), " if found >= nproc else ""
            parser.error(f"--gpus-per-process: expected the {found} visible GPUs ({source}) to split evenly "
                         f"over -n {nproc} processes, found {found % nproc} left over. Fix: pass -n {found} or "
                         f"another divisor of {found}, {fits}or --gpus-per-process 0 to let every process see "
                         "them all")
        per_process = found // nproc
    elif per_process * nproc > found:
        parser.error(f"--gpus-per-process: expected {per_process} x {nproc} processes = {per_process * nproc} "
                     f"GPUs at most, found {found} visible ({source}). Fix: pass a smaller -n or "
                     "--gpus-per-process, or leave --gpus-per-process out on a machine without GPUs")
    return tuple(",".join(gpus[rank * per_process:(rank + 1) * per_process]) for rank in range(nproc))


def parse_args(argv: list[str], *, env: Mapping[str, str] | None = None,
               device_dir: Path = DEVICE_DIR) -> LaunchConfig:
    """The launch config from the command line, and the GPUs of this machine (`env`, `device_dir`)."""
    parser = _parser()
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    refuse_dash_values(parser, own)
    args, extra = parser.parse_known_args(own)
    if extra and extra[0].startswith("-"):
        parser.error(f"expected one of the options above, found {extra[0]!r}. "
                     "Fix: check its spelling (python -m job.launch --help); the command goes after '--'")
    if extra:
        parser.error(f"expected '--' before the command, found {shlex.join(extra)!r}. "
                     f"Fix: python -m job.launch ... -- {shlex.join(extra)}")
    if not command:
        parser.error("expected a command after '--', found none. "
                     "Fix: python -m job.launch -n 4 -- python -m job")
    if shutil.which(command[0]) is None:
        parser.error(f"expected an executable as the command, found {command[0]!r} (not on PATH). "
                     "Fix: give a full path or an installed program such as 'python'")
    gpus, source = gpus_here(os.environ if env is None else env, device_dir)
    return LaunchConfig(
        num_processes=args.nproc,
        command=tuple(command),
        devices_per_process=args.devices_per_process,
        host=args.host,
        port=args.port,
        kill_after_s=args.kill_after,
        stop_timeout_s=args.stop_timeout,
        prefix=not args.no_prefix,
        gpus=gpu_shares(parser, args.nproc, args.gpus_per_process, gpus, source),
    )


def with_host_devices(xla_flags: str, count: int) -> str:
    """XLA_FLAGS with the host device count set to `count` (replacing any earlier value)."""
    kept = [flag for flag in xla_flags.split() if not flag.startswith(HOST_DEVICES_FLAG)]
    return " ".join([*kept, f"{HOST_DEVICES_FLAG}={count}"])


def child_environments(cfg: LaunchConfig, port: int, base: dict[str, str]) -> list[dict[str, str]]:
    """The environment of every rank: detection variables, devices (CPU count, its GPUs), unbuffered output."""
    if not 1 <= port <= 65535:
        raise ConfigError("coordinator port", expected="1..65535", found=port, fix="pass --port or omit it")
    if cfg.gpus and len(cfg.gpus) != cfg.num_processes:
        raise ConfigError("LaunchConfig.gpus", expected=f"one CUDA_VISIBLE_DEVICES per process ({cfg.num_processes})",
                          found=cfg.gpus, fix="build the config with parse_args, or give one entry per process")
    envs = []
    for rank in range(cfg.num_processes):
        env = dict(base)
        env.update(LocalLauncher.variables(f"{cfg.host}:{port}", cfg.num_processes, rank))
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{cfg.host}:{port}"
        env["PYTHONUNBUFFERED"] = "1"
        if cfg.devices_per_process is not None:
            env["XLA_FLAGS"] = with_host_devices(base.get("XLA_FLAGS", ""), cfg.devices_per_process)
        if cfg.gpus:
            env[CUDA_VISIBLE_DEVICES] = cfg.gpus[rank]
        envs.append(env)
    return envs


def coordinator_port(port: int | None) -> int:
    """`port`, or a free one on this machine when it is None (job.core.ports: not an ephemeral port, which
    another process's connection could be given before the coordinator binds it)."""
    if port is not None:
        return port
    return ports.free_port()


def launch(cfg: LaunchConfig) -> int:
    """Run the processes to the end; return the exit code the launcher should use."""
    port = coordinator_port(cfg.port)
    envs = child_environments(cfg, port, dict(os.environ))
    if cfg.gpus:
        log.info("%d processes, GPUs (CUDA_VISIBLE_DEVICES) %s", cfg.num_processes, " | ".join(cfg.gpus))
    group = ProcessGroup(
        list(cfg.command), envs, prefix=cfg.prefix,
        kill_after_s=cfg.kill_after_s, stop_timeout_s=cfg.stop_timeout_s,
    )
    return group.run()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[launch] %(message)s")
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
