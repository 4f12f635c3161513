"""`job.initialize`: join the JAX cluster this process belongs to.

    import job
    info = job.initialize()          # first thing in main, before any JAX call
    print(info.summary())

Explicit arguments win over environment variables, which win over detection. Every
value jax needs is supplied here, and jax's own cluster detection is switched off: under
Slurm it would otherwise pick the GPU ``SLURM_LOCALID`` whenever local_device_ids is None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import ClassVar, TypedDict

from job.core import exits, internals
from job.core.errors import BAD_INPUT_EXIT_CODE, ConfigError, InitOrderError, JobError
from job.runtime import watchdog
from job.runtime.cluster import ClusterInfo, detect
from job.runtime.cluster.base import CUDA_VISIBLE_DEVICES, read_id_list, read_int
from job.runtime.gloo_noise import filter_output
from job.runtime.leaving import leave

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds. jax's defaults (300/100/300) let a dead peer hang a job for minutes."""

    init_s: int = 120  # every process must register with the coordinator within this
    heartbeat_s: int = 10  # a silent peer is declared dead after this
    shutdown_s: int = 60  # a clean exit waits this long for the slowest peer

    ENV: ClassVar[tuple[tuple[str, str], ...]] = (
        ("init_s", "JOB_INIT_TIMEOUT"),
        ("heartbeat_s", "JOB_HEARTBEAT_TIMEOUT"),
        ("shutdown_s", "JOB_SHUTDOWN_TIMEOUT"),
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Timeouts:
        values = {
            field: read_int(env, name, minimum=1, fix=f"set {name} to a whole number of seconds, or unset it")
            for field, name in cls.ENV
            if name in env
        }
        return cls(**values)


class _Overrides(TypedDict, total=False):
    """The ClusterInfo fields an environment variable or an argument of `resolve` sets."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...]


def resolve(
    env: Mapping[str, str],
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> ClusterInfo:
    """Detection, then environment overrides, then explicit arguments."""
    if local_device_ids is not None or "JAX_LOCAL_DEVICE_IDS" in env:
        # the override replaces the detected devices: a GPU layout detection rejects
        # (an uneven split) must not stop the override that fixes it
        env = {name: value for name, value in env.items() if name != CUDA_VISIBLE_DEVICES}
    info = detect(env)
    overrides: _Overrides = {}
    if "JAX_COORDINATOR_ADDRESS" in env:
        overrides["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if "JAX_LOCAL_DEVICE_IDS" in env:
        overrides["local_device_ids"] = read_id_list(
            env, "JAX_LOCAL_DEVICE_IDS", fix="give device ids such as '0,1', or unset it"
        )
    if coordinator_address is not None:
        overrides["coordinator_address"] = coordinator_address
    if num_processes is not None:
        overrides["num_processes"] = num_processes
    if process_id is not None:
        overrides["process_id"] = process_id
    if local_device_ids is not None:
        overrides["local_device_ids"] = tuple(local_device_ids)
    if not overrides:
        return info
    if info.kind == "single" and {"num_processes", "process_id"} <= overrides.keys():
        info = dataclasses.replace(info, kind="manual")
    info = dataclasses.replace(info, **overrides)
    _validate(info)
    return info


def _validate(info: ClusterInfo) -> None:
    fix = "pass num_processes >= 1 and 0 <= process_id < num_processes"
    if info.num_processes < 1:
        raise ConfigError("num_processes", expected="an integer >= 1", found=info.num_processes, fix=fix)
    if not 0 <= info.process_id < info.num_processes:
        raise ConfigError(
            "process_id", expected=f"0 <= process_id < {info.num_processes}", found=info.process_id, fix=fix
        )
    if info.num_processes > 1 and not info.coordinator_address:
        raise ConfigError(
            "coordinator_address", expected="'host:port' of process 0", found=info.coordinator_address,
            fix="pass coordinator_address= or set JAX_COORDINATOR_ADDRESS",
        )
    if info.coordinator_address and ":" not in info.coordinator_address:
        raise ConfigError(
            "coordinator_address", expected="'host:port'", found=info.coordinator_address,
            fix="append the port, e.g. 'node1:61440'",
        )


def check_coordinator_port(address: str) -> None:
    """On process 0: the coordinator's port must be free, or jax crashes (or segfaults) while
    every other process waits for its init timeout."""
    port = int(address.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            raise ConfigError(
                "coordinator port", expected=f"port {port} free on this host (process 0)",
                found=f"in use ({exc.strerror})",
                fix="stop whatever holds it, or set JOB_COORDINATOR_PORT (or the launcher's --port) to a free port",
            ) from None


def bind_address(address: str, env: Mapping[str, str], *, resolve=socket.gethostbyname) -> str | None:
    """Where process 0's coordinator listens: the one interface its peers use, when that is knowable.

    JAX_COORDINATOR_BIND_ADDRESS wins. Otherwise the coordinator's host is
    resolved; if it is an address of this machine, only that interface
    listens. None (jax's default: every interface) when the name does not
    resolve, resolves elsewhere, or is a host *name* that resolves to loopback
    here: Debian's `127.0.1.1 <hostname>` line makes a node's own name look
    like loopback while its peers reach it on the network.
    """
    if env.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return env["JAX_COORDINATOR_BIND_ADDRESS"]
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(resolve(host))
    except (OSError, ValueError):
        return None
    named_loopback = ip.is_loopback and host != "localhost" and host != str(ip)
    if named_loopback or not _is_local(ip):
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _is_local(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip` belongs to this machine (a socket can bind to it)."""
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _explain_init_timeout(info: ClusterInfo, init_s: int) -> Iterator[None]:
    """jax aborts with a bare DEADLINE_EXCEEDED (RegisterTask) when the cluster does not form:
    just before that, say what it means and what to check."""

    def explain() -> None:
        print(
            f"job.initialize: process {info.process_id}: expected all {info.num_processes} processes to "
            f"join {info.coordinator_address} within {init_s} s, found it still incomplete; jax will "
            "abort with DEADLINE_EXCEEDED (RegisterTask). A process with no 'joining: process N' line never "
            "started: read its log (a crash before initialize, a node that did not start). If every process "
            "has one, some cannot reach the coordinator: check the network and firewall, the address process "
            "0 listens on (JAX_COORDINATOR_BIND_ADDRESS=[::]:PORT listens on every interface), or raise "
            "JOB_INIT_TIMEOUT if starts are slow",
            file=sys.stderr, flush=True,
        )

    timer = threading.Timer(max(init_s - 1.0, init_s * 0.9), explain)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _record_error(kind: type[BaseException], value: BaseException) -> None:
    """The exception's first line and the time, in the file the launcher named (exits.ERROR_FILE_ENV), if any."""
    path = os.environ.get(exits.ERROR_FILE_ENV)
    if not path:
        return
    first = next(iter(str(value).splitlines()), "")[:500]
    with contextlib.suppress(OSError):
        with open(path, "w", encoding="utf-8") as out:
            out.write(f"{time.time():.6f} {kind.__name__}: {first}\n")


def _exit_on_uncaught(previous, before_exit: Callable[[], None] | None = None):
    """An uncaught exception ends this process at once.

    A normal interpreter exit runs jax's shutdown barrier, which waits for
    every peer; the peers wait for us in their next collective. Leaving alone
    (`leave`: the exit handlers within their bound, no barrier, no teardown)
    makes the failure visible to the launcher or Slurm in seconds.
    The package's own errors (bad input, a failed preflight, a barrier timeout)
    already say what to do: they print as one message, without a traceback.
    """

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _record_error(kind, value)
        if isinstance(value, JobError):
            if not value.reported:
                print(f"{kind.__name__}: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        if before_exit is not None:  # the output filter writes out the message before the process ends
            before_exit()
        if isinstance(value, ConfigError):
            code = BAD_INPUT_EXIT_CODE
        else:
            code = value.code if isinstance(value, SystemExit) and isinstance(value.code, int) else 1
        leave(code or 1)

    return hook


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    *,
    timeouts: Timeouts | None = None,
    exit_on_uncaught: bool = True,
    env: Mapping[str, str] | None = None,
) -> ClusterInfo:
    """Detect the environment and start JAX's distributed runtime.

    Call it first, before any other JAX call. Calling it again returns the same
    record. In a single process nothing is started. jax gets every value from the
    record, with its own detection off: local_device_ids None means every device
    this process sees.
    """
    env = os.environ if env is None else env
    info = resolve(
        env,
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    if _joined_already(info) or not info.is_multiprocess:
        return info
    _check_no_backend()
    timeouts = timeouts or Timeouts.from_env(env)
    log.debug("joining %s (timeouts %s)", info.summary(), timeouts)
    _prepare_process(info, env, exit_on_uncaught)
    bind = None
    if info.is_coordinator and info.coordinator_address:
        check_coordinator_port(info.coordinator_address)
        bind = bind_address(info.coordinator_address, env)
    _announce(info, timeouts, bind)
    _join(info, timeouts, bind)
    return info


def _joined_already(info: ClusterInfo) -> bool:
    """Whether jax.distributed is started already, as `info` says this process is (a second `initialize`); an
    InitOrderError where it was started as another process."""
    import jax  # `import job` imports this module: it and python -m job.launch stay jax-free

    if not jax.distributed.is_initialized():
        return False
    if jax.process_index() != info.process_id or jax.process_count() != info.num_processes:
        raise InitOrderError(
            "jax.distributed was already initialised as process "
            f"{jax.process_index()} of {jax.process_count()}, but this environment says "
            f"{info.process_id} of {info.num_processes}. Fix: call job.initialize() once, "
            "instead of jax.distributed.initialize()."
        )
    return True


def _check_no_backend() -> None:
    """An InitOrderError where a JAX backend has started: jax.distributed can no longer join the cluster."""
    if internals.backends_are_initialized():
        raise InitOrderError(
            "job.initialize() must run before any JAX computation: expected no JAX backend yet, "
            "found one already started (something called jax.devices(), jnp.*, jax.jit(...)(), or "
            "device_put first, possibly at import time). Fix: call job.initialize() at the very top "
            "of main(), before building meshes, models or arrays."
        )


def _prepare_process(info: ClusterInfo, env: Mapping[str, str], exit_on_uncaught: bool) -> None:
    """This process, before it joins: gloo's noise filtered, an uncaught exception ending it at once, its stacks
    printed on request."""
    relay = None
    if info.kind != "local":  # the local launcher drops gloo's "connected" lines itself
        relay = filter_output(env)
    if exit_on_uncaught:
        sys.excepthook = _exit_on_uncaught(sys.excepthook, relay.restore if relay else None)
    watchdog.stacks_on_request()  # a process stuck past its stop shows where before the launcher kills it


def _announce(info: ClusterInfo, timeouts: Timeouts, bind: str | None) -> None:
    """The 'joining' line every process prints (the init timeout's explanation points at it)."""
    listens = f", listening on {bind or 'every interface'}" if info.is_coordinator else ""
    # printed, not logged: it must show whether or not the program configured logging
    devices = "all" if info.local_device_ids is None else ",".join(map(str, info.local_device_ids))
    print(f"job.initialize: joining: process {info.process_id} of {info.num_processes}, coordinator "
          f"{info.coordinator_address}{listens}, local devices {devices} (init timeout {timeouts.init_s} s)",
          file=sys.stderr, flush=True)


def _join(info: ClusterInfo, timeouts: Timeouts, bind: str | None) -> None:
    """jax.distributed started with every value of `info`, jax's own cluster detection off."""
    import jax  # here, not at the top: as in `_joined_already`

    with _explain_init_timeout(info, timeouts.init_s):
        jax.distributed.initialize(
            coordinator_address=info.coordinator_address,
            num_processes=info.num_processes,
            process_id=info.process_id,
            local_device_ids=list(info.local_device_ids) if info.local_device_ids is not None else None,
            cluster_detection_method="deactivate",
            initialization_timeout=timeouts.init_s,
            heartbeat_timeout_seconds=timeouts.heartbeat_s,
            shutdown_timeout_seconds=timeouts.shutdown_s,
            coordinator_bind_address=bind,
        )
