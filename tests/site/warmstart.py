"""Processes the tests launch start warm: forked from a parent that has already imported jax, flax, optax and orbax.

A short training process of the tests spends about half its CPU importing those libraries. With
JOB_TESTS_WARM=DIR (tests/conftest.py sets it: one folder per pytest worker), sitecustomize.py hands a
process started as `python -m job` or as a test scenario's script over to a warm parent of this module
(`serve`): the parent forks, the child takes the process's argv, environment, working folder, sys.path,
standard streams, ignored signals, umask, niceness and CPU affinity, and runs the program as Python would
have; the process the caller started (the stand-in) stays, forwards every signal it gets to the child, and
exits as the child did: with its code, or killed by its signal. A stand-in killed by SIGKILL takes its child
with it (the parent watches every stand-in's pidfd).

The parent never starts a jax backend (a fork after that deadlocks): it imports, freezes its objects out of
the garbage collector's reach, and forks. One parent per set of variables read at import time (KEY_EXEMPT
lists those read only later: the launcher's per-rank variables, XLA_FLAGS, PYTHONPATH...); a process whose
set has no parent yet starts one and runs cold itself. A process started otherwise, under Slurm, under
coverage, with other interpreter options, or with inherited file descriptors beyond the three standard ones
runs cold, as does any test's process whose environment sets JOB_TESTS_WARM= (empty). The CPU time of each
child is added to the folder's `cpu-PID` ledger, which tests/conftest.py counts as the test's.

Only the tests' processes start this way: nothing in job/ or deploy/ knows of it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
import warnings
from pathlib import Path

ENV = "JOB_TESTS_WARM"
PRELOAD = ("numpy", "jax", "jax.numpy", "flax", "flax.nnx", "optax", "orbax.checkpoint", "tensorstore", "tyro",
           "rich", "yaml")
# variables that no preloaded library reads while it is imported: they may differ between a parent and its children
KEY_EXEMPT_PREFIXES = ("JOB_", "PYTEST_", "TPU_", "CUDA_", "SLURM_", "COORDINATOR", "MEGASCALE_")
KEY_EXEMPT = frozenset({"XLA_FLAGS", "JAX_COORDINATOR_BIND_ADDRESS", "PYTHONPATH", "PYTHONFAULTHANDLER", "HOME", "PWD",
                        "OLDPWD", "SHLVL", "_", "TMPDIR", "COLUMNS", "LINES",
                        # the Cloud Storage emulator's address, a port of each test's own: read when a client is made
                        "STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"})
KEY_BOUND = frozenset({"JOB_TESTS_CACHE_KEYS"})  # read by sitecustomize.py while the parent imports jax
IDLE_S = 1800.0  # a parent with no request for this long ends
_HEADER = struct.Struct("!I")
_UNFORWARDED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGWINCH, signal.SIGURG}


def key_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k in KEY_BOUND or not (k in KEY_EXEMPT or k.startswith(KEY_EXEMPT_PREFIXES))}


def key(env: dict[str, str]) -> str:
    text = json.dumps([sys.executable, sys.version, list(sys.flags), sorted(key_env(env).items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- the stand-in side
def _cold_reason(env: dict[str, str]) -> str | None:
    if not env.get(ENV) or not os.path.isdir(env[ENV]):
        return "off"
    if "SLURM_JOB_ID" in env or {"COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG", "COV_CORE_SOURCE"} & set(env):
        return "Slurm or coverage"
    if sorted(int(fd) for fd in os.listdir("/proc/self/fd")) != [0, 1, 2, 3]:  # 3: the listing itself
        return "inherited file descriptors"
    return None


def hand_over(which: tuple[str, str]) -> None:
    """Run this process's program (sitecustomize.warm_program's: ("module", NAME) or ("script", PATH)) in a warm
    child and exit as it does; return (to run cold) where it cannot. An error before the child exists is written
    to the folder's errors.log (the process then runs cold); once it exists, the process never runs the program
    itself."""
    try:
        _hand_over(which)
    except Exception:  # noqa: BLE001 - nothing started: the program runs cold, the reason kept for whoever looks
        import traceback

        with contextlib.suppress(OSError), open(Path(os.environ[ENV]) / "errors.log", "a") as errors:
            errors.write(f"pid {os.getpid()}: {sys.orig_argv}\n{traceback.format_exc()}\n")


def _hand_over(which: tuple[str, str]) -> None:
    env = dict(os.environ)
    if _cold_reason(env) is not None:
        return
    folder = Path(env[ENV])
    address = folder / f"{key(env)}.sock"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(address))
    except OSError:
        conn.close()
        _start_parent(folder, address, env)
        return
    forwarded = [s for s in signal.Signals if s not in _UNFORWARDED and signal.getsignal(s) != signal.SIG_IGN]
    ignored = [int(s) for s in signal.Signals if s not in _UNFORWARDED and signal.getsignal(s) == signal.SIG_IGN]
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)  # a signal before the child exists waits for it
    umask = os.umask(0)
    os.umask(umask)
    request = {"kind": which[0], "target": which[1], "argv": sys.argv if which[0] == "script" else sys.orig_argv[3:],
               "env": env, "cwd": os.getcwd(), "path": _path(which), "ignored": ignored, "umask": umask,
               "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0))}
    try:
        body = json.dumps(request).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body)) + body], [0, 1, 2])
        child = int(_read_line(conn))
    except (OSError, ValueError):  # the parent ended: nothing started, so run cold
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        return
    try:
        for sig in forwarded:
            signal.signal(sig, lambda signum, _frame: _forward(child, signum))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        _leave_as(_read_line(conn))
    except BaseException as exc:  # noqa: BLE001 - the child runs the program: wait for it, never run it again
        with contextlib.suppress(OSError), selectors.DefaultSelector() as ended:
            ended.register(os.pidfd_open(child), selectors.EVENT_READ)
            ended.select()
        sys.stderr.write(f"warmstart: lost the warm child {child} ({exc!r}); its exit code is unknown\n")
        os._exit(70)


def _path(which: tuple[str, str]) -> list[str]:
    """sys.path as Python makes it once site has run: with the script's folder, or for -m the working folder, first."""
    if sys.flags.safe_path:
        return list(sys.path)
    first = os.path.dirname(os.path.realpath(which[1])) if which[0] == "script" else os.getcwd()
    return [first, *sys.path]


def _forward(child: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signum)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise OSError("the warm parent closed the connection")
        data += chunk
    return data.decode().strip()


def _leave_as(status_line: str) -> None:
    """Exit as the child did: its code, or killed by its signal."""
    status = int(status_line)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        time.sleep(1)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _start_parent(folder: Path, address: Path, env: dict[str, str]) -> None:
    """Start the warm parent for this process's set of import-time variables, once (this process runs cold)."""
    try:
        marker = os.open(str(address.with_suffix(".started")), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return
    os.close(marker)
    import subprocess

    # only what decides the key (and where warmstart is): no run's own variables linger in /proc/PID/environ
    parent_env = {**key_env(env), **{k: env[k] for k in ("PYTHONPATH", "HOME") if k in env}}
    with open(address.with_suffix(".log"), "ab") as log:
        subprocess.Popen([sys.executable, "-m", "warmstart", "serve", str(address)], env=parent_env,
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                         cwd=str(folder))


# ------------------------------------------------------------------------------------------------ the parent side
class Parent:
    """Forks a child per stand-in's request; reports each child's end to its stand-in; kills the child of a stand-in
    that died; ends when its folder is removed (the pytest worker ended) or after IDLE_S without a request."""

    def __init__(self, address: Path) -> None:
        self.address = address
        self.ledger = address.parent / f"cpu-{os.getpid()}"
        self.cpu = 0.0
        self.children: dict[int, tuple[socket.socket, int]] = {}  # child pid: (its stand-in's connection, pidfd)
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wakeup_r, self.wakeup_w = os.pipe()

    def serve(self) -> dict | None:
        """The loop; returns a request in a forked child (the caller runs it), None in the parent when it ends."""
        with contextlib.suppress(FileNotFoundError):
            self.address.unlink()
        self.listener.bind(str(self.address))
        self.listener.listen(64)
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "reap")
        last = time.monotonic()
        while self.address.parent.is_dir() and (self.children or time.monotonic() - last < IDLE_S):
            for item, _ in self.selector.select(timeout=1.0):
                if item.data == "accept":
                    last = time.monotonic()
                    request = self._accept()
                    if request is not None:
                        return request
                elif item.data == "reap":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_r, 4096)
                else:
                    _forward(item.data, signal.SIGKILL)  # the stand-in died: its child goes too
            self._reap()
        for child in self.children:
            _forward(child, signal.SIGKILL)
        return None

    def _accept(self) -> dict | None:
        conn, _ = self.listener.accept()
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 22, 3)
            size = _HEADER.unpack_from(msg)[0]
            body = msg[_HEADER.size:]
            while len(body) < size:
                more = conn.recv(size - len(body))
                if not more:
                    raise OSError("short request")
                body += more
            request = json.loads(body)
            stand_in = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            pidfd = os.pidfd_open(stand_in)
        except (OSError, ValueError, struct.error):
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():  # numpy's BLAS thread: it stops itself around a fork
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            self._become_child(fds, pidfd, conn)
            return request
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        self.children[pid] = (conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        return None

    def _become_child(self, fds: list[int], pidfd: int, conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        self.selector.close()
        for fd in (self.wakeup_r, self.wakeup_w, pidfd, *(p for _, p in self.children.values())):
            os.close(fd)
        for other, _ in self.children.values():
            other.close()
        self.listener.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.cpu += usage.ru_utime + usage.ru_stime
            tmp = self.ledger.with_suffix(".tmp")
            tmp.write_text(f"{self.cpu:.3f}\n")
            tmp.replace(self.ledger)  # before the stand-in hears: the test counts it when the stand-in has ended
            conn, pidfd = self.children.pop(pid)
            self.selector.unregister(pidfd)
            os.close(pidfd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{status}\n".encode())
            conn.close()


def become(request: dict) -> None:
    """In the forked child: take the stand-in's process state, as Python would have set it up at start."""
    os.setsid()
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
        os.sched_setaffinity(0, request["cpus"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    ignored = set(request["ignored"])
    for sig in signal.Signals:
        if sig in _UNFORWARDED:
            continue
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these at start
            default = signal.SIG_IGN
        signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _reopen_standard_streams()
    import faulthandler
    import tempfile

    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    tempfile.tempdir = None  # TMPDIR is the child's own
    if "numpy" in sys.modules:  # numpy's global generator was seeded once, in the parent
        sys.modules["numpy"].random.seed()
    # the parent's objects stay frozen (serve): what the imports made lives as long as the process in a cold one too


def _reopen_standard_streams() -> None:
    """New sys.stdin, stdout and stderr over the stand-in's descriptors; a logging handler a preloaded library made
    for the parent's stream writes to the new one."""
    import io
    import logging

    old_streams = {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # as -u would; its flag is in the key
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        mode = "rb" if fd == 0 else "wb"
        raw = io.open(fd, mode, buffering=0 if unbuffered and fd else -1, closefd=False)
        interactive = os.isatty(fd)
        stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, newline=None if fd == 0 else "\n",
                                  line_buffering=fd != 0 and (interactive or fd == 2) and not unbuffered,
                                  write_through=unbuffered or fd == 2)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in (h for logger in loggers for h in logger.handlers):
        if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old_streams:
            handler.setStream(getattr(sys, old_streams[id(handler.stream)]))


def run_program(request: dict) -> None:
    """Run the stand-in's program as `python -m MODULE` or `python SCRIPT` would."""
    become(request)
    if request["kind"] == "module":
        import runpy

        sys.argv[:] = [request["target"], *request["argv"]]
        runpy._run_module_as_main(request["target"], alter_argv=True)  # what `python -m` calls
        return
    import types

    script = request["target"]
    sys.argv[:] = request["argv"]
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    code = compile(Path(script).read_bytes(), script, "exec")
    exec(code, main.__dict__)  # noqa: S102 - the script the stand-in was started to run


def serve(address: Path) -> dict | None:
    """Import PRELOAD, then serve; in a forked child, the request to run."""
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the children's collections then leave the parent's objects' pages shared
    # its log (KEY.log): the names that made its key, not their values (a test's variables may hold secrets)
    print(f"warm parent {os.getpid()}: imported {', '.join(n for n in PRELOAD if n in sys.modules)}; key of "
          f"{', '.join(sorted(key_env(dict(os.environ))))}", flush=True)
    return Parent(address).serve()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _request = serve(Path(sys.argv[2]))
    if _request is not None:
        run_program(_request)
