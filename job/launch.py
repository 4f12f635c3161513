"""Start N local processes that form one JAX cluster (like torchrun, for JAX).

    python -m job.launch -n 4 --devices-per-process 2 -- python -m job train

Each child gets the variables `job.initialize` detects as a "local" cluster,
its own CPU device count, and a free coordinator port on loopback. Output
lines carry a ``[rank N]`` prefix. Fail fast: when one process fails the
others are stopped and the launcher exits with that first failure's code.
SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 are forwarded to every child.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import os
import re
import shlex
import shutil
import sys

from job.cluster.local import LocalLauncher
from job.errors import ConfigError, refuse_dash_values
from job.procgroup import ProcessGroup

log = logging.getLogger("job.launch")

HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
MAX_LOCAL = 1024  # more processes (or CPU devices per process) than this on one machine is a typo
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")  # RFC 1123


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


def positive_int(text: str) -> int:
    try:
        value = int(text) if text.strip().isascii() and text.strip().isdigit() else 0
    except ValueError:  # more digits than int() takes
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, found {text!r}")
    return value


def local_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_LOCAL:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_LOCAL} on one machine, found {text!r}")
    return value


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1..65535, found {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration flag: a finite number of seconds >= 0 (NaN, inf and negatives are typos)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, found {text!r}")
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
        epilog="example: python -m job.launch -n 4 --devices-per-process 2 -- python -m job",
    )
    p.add_argument("-n", "--nproc", type=local_count, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=local_count, default=None,
                   help="CPU devices each process sees (sets XLA_FLAGS)")
    p.add_argument("--host", type=_host, default="127.0.0.1", help="coordinator address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--kill-after", type=seconds, default=5.0,
                   help="seconds the others get after one process fails, before SIGKILL")
    p.add_argument("--stop-timeout", type=seconds, default=60.0,
                   help="seconds children get to exit after a forwarded signal, before SIGKILL")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    return p


def parse_args(argv: list[str]) -> LaunchConfig:
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
    return LaunchConfig(
        num_processes=args.nproc,
        command=tuple(command),
        devices_per_process=args.devices_per_process,
        host=args.host,
        port=args.port,
        kill_after_s=args.kill_after,
        stop_timeout_s=args.stop_timeout,
        prefix=not args.no_prefix,
    )


def with_host_devices(xla_flags: str, count: int) -> str:
    """XLA_FLAGS with the host device count set to `count` (replacing any earlier value)."""
    kept = [flag for flag in xla_flags.split() if not flag.startswith(HOST_DEVICES_FLAG)]
    return " ".join([*kept, f"{HOST_DEVICES_FLAG}={count}"])


def child_environments(cfg: LaunchConfig, port: int, base: dict[str, str]) -> list[dict[str, str]]:
    """The environment of every rank: detection variables, devices, unbuffered output."""
    if not 1 <= port <= 65535:
        raise ConfigError("coordinator port", expected="1..65535", found=port, fix="pass --port or omit it")
    envs = []
    for rank in range(cfg.num_processes):
        env = dict(base)
        env.update(LocalLauncher.variables(f"{cfg.host}:{port}", cfg.num_processes, rank))
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{cfg.host}:{port}"
        env["PYTHONUNBUFFERED"] = "1"
        if cfg.devices_per_process is not None:
            env["XLA_FLAGS"] = with_host_devices(base.get("XLA_FLAGS", ""), cfg.devices_per_process)
        envs.append(env)
    return envs


def launch(cfg: LaunchConfig) -> int:
    """Run the processes to the end; return the exit code the launcher should use."""
    if cfg.port is None:
        import portpicker

        port = portpicker.pick_unused_port()
    else:
        port = cfg.port
    envs = child_environments(cfg, port, dict(os.environ))
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
