"""The bash scripts that run on every TPU worker (through `gcloud ... ssh --command=`).

Every user-supplied word (job arguments, image, folder names) is passed
through `shlex.quote`, so a value with spaces, quotes, `$()` or `;` reaches
the job as one argument and is never run as shell. The scripts assume bash,
the login shell of TPU VM images.

The job runs detached from the ssh session that starts it (its own session,
`setsid nohup`), so a dropped connection never stops it: `follow_script`
re-attaches to its log, `probe_script` says whether it still runs. Layout on
each worker, under its home directory:

    REMOTE_DIR.tar.gz          the shipped code (when no image is used)
    REMOTE_DIR/                the code, unpacked; the job runs here
    REMOTE_DIR/workspace/      IMAGE: the container's working folder (same path inside), so a
                               relative run dir and its checkpoints stay on the worker's disk
    REMOTE_DIR/logs/job.log    this worker's output (every worker keeps its own)
    REMOTE_DIR/logs/job.pid    the detached job's session leader, for `tpu-stop` and stale-run cleanup
    REMOTE_DIR/logs/job.exit   the job's exit code, written when it ends
    REMOTE_DIR/logs/job.stop   written by `tpu-stop`: the job was stopped on purpose
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from deploy import wheelhouse
from deploy.tpu import ship, wheels
from deploy.tpu.config import TpuConfig, run_dir_of

LOG = "logs/job.log"
PID = "logs/job.pid"
EXIT = "logs/job.exit"
STOP = "logs/job.stop"
WORKSPACE = "workspace"
NO_JOB_EXIT = 3  # follow_script: no job has ever run on this worker
GONE_EXIT = 137  # follow_script: the job is gone and wrote no exit code (SIGKILL, a restarted VM)
FOLLOW_POLL_S = 1  # how often follow_script looks for the exit-code file
OUTCOME_TAIL = 50  # outcome_script: the log's last line is looked for in this many lines
OUTCOME_CHARS = 300  # ... and cut to this many characters
# The TPU runtime's worker variables where the VM sets them (GKE-style runtimes, the simulator; a GCE TPU VM
# keeps them in the metadata server instead): the job in the container sees them as it would outside.
WORKER_VARS = ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_ACCELERATOR_TYPE",
               "JOB_COORDINATOR_PORT")
# Registries whose pulls need `gcloud auth configure-docker HOST` first: Artifact Registry and Container Registry.
_GOOGLE_REGISTRY = re.compile(r"^(?:[a-z0-9-]+-docker\.pkg\.dev|(?:[a-z]+\.)?gcr\.io)$")

# Install the locked dependencies unless the VM's python3 already has them (3.11 or newer + jax + ...; found,
# not imported, which would cost seconds per worker): a venv made by uv (which brings its own Python 3.12,
# whose lock gets JAX 0.12; TPU VM images ship 3.10), with libtpu.
_HAS_DEPS = """\
if python3 -c 'import sys, importlib.util as u; sys.exit(sys.version_info[:2] < (3, 11) or not all(
    u.find_spec(m) for m in ("jax", "flax", "optax", "orbax.checkpoint", "tyro", "portpicker")))' >/dev/null 2>&1
then
  :  # python3 already has the job's dependencies
else"""
DEFAULT_SETUP = f"""\
{_HAS_DEPS}
  [ -x .venv/bin/python ] || {{ python3 -m pip install --quiet --user uv && python3 -m uv venv --python 3.12 .venv; }}
  python3 -m uv pip install --quiet --python .venv/bin/python -r requirements.lock -e '.[tpu]'
fi"""

_WORKER_ID = (  # TPU_WORKER_ID where the runtime sets it (GKE, the simulator), else the metadata server
    'worker="${TPU_WORKER_ID:-$(curl -sf -H "Metadata-Flavor: Google" '
    'http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0)}"'
)
# WHEELHOUSE (deploy/tpu/wheels.py): the same from its folder, unpacked in .wheelhouse, with no index; the venv is
# made by the VM's python3 without pip (no python3-venv needed), then gets pip from the folder.
_WH = wheels.REMOTE
_OTHER_PYTHON = ("worker $worker: expected python3 to be Python $want (the wheelhouse's), found Python $have. Fix: "
                 "make wheelhouse FLAVOR=tpu WHEEL_PYTHON=$have (3.11 or newer), or a RUNTIME whose python3 is $want")
_VERSION = """-c 'import sys; print("%d.%d" % sys.version_info[:2])'"""
WHEELHOUSE_SETUP = f"""\
{_HAS_DEPS}
  want=$(python3 -c 'import json; print(json.load(open("{_WH}/{wheelhouse.MANIFEST}"))["python"])')
  have=$(python3 {_VERSION})
  if [ "$have" != "$want" ]; then
    {_WORKER_ID}
    echo "{_OTHER_PYTHON}" >&2
    exit 1
  fi
  # a venv of another Python (an earlier set-up's, made by uv) cannot take these wheels: made again
  if [ -x .venv/bin/python ] && [ "$(.venv/bin/python {_VERSION})" != "$want" ]; then rm -rf .venv; fi
  [ -x .venv/bin/python ] || python3 -m venv --without-pip .venv
  if ! .venv/bin/python -c 'import pip' >/dev/null 2>&1; then
    pip_wheel=$(ls {_WH}/pip-*.whl)
    .venv/bin/python "$pip_wheel/pip" install --isolated --quiet --no-index "$pip_wheel"
  fi
  .venv/bin/python -m pip install --isolated --quiet --no-index --find-links {_WH} -r {_WH}/{wheelhouse.PINS}
fi"""

_SUDO = "sudo=; if command -v sudo >/dev/null 2>&1; then sudo='sudo -n'; fi"
_IS_JOB = "{ tr '\\0' ' ' </proc/\"$1\"/cmdline; } 2>/dev/null | grep -q -- ' -m job'"
_RUNNING = f'[ -f {PID} ] && is_job "$(cat {PID})"'
_PY = "py=python3; if [ -x .venv/bin/python ]; then py=.venv/bin/python; fi"
_FREE_DEVICES = [
    'for dev in /dev/accel* /dev/vfio/*; do',
    '  if [ -e "$dev" ]; then $sudo fuser -k "$dev" >/dev/null 2>&1; fi',
    'done',
    '$sudo rm -f /tmp/libtpu_lockfile',
]
# Processes left over by an earlier run hold the TPU (JAX would then silently use the CPU). The job's
# pid is its session's leader, so `kill -- -PID` reaches everything it started.
_FREE_TPU = [
    f'is_job() {{ {_IS_JOB}; }}',
    f'if {_RUNNING}; then kill -KILL -- -"$(cat {PID})" 2>/dev/null; kill -KILL "$(cat {PID})" 2>/dev/null; fi',
    *_FREE_DEVICES,
]


def _enter(cfg: TpuConfig) -> list[str]:
    d = shlex.quote(cfg.remote_dir)
    return [f"mkdir -p {d}/logs && cd {d} || exit 1", _SUDO]


def registry_host(image: str) -> str | None:
    """The Google registry host of `image` (us-docker.pkg.dev, gcr.io, eu.gcr.io), or None."""
    host = image.split("/", 1)[0] if "/" in image else ""
    return host if _GOOGLE_REGISTRY.fullmatch(host) else None


def setup_script(cfg: TpuConfig) -> str:
    """Unpack the shipped code (or log in to the registry, pull the image and look for the tasks' packages in it)
    and prepare the environment (from WHEELHOUSE without an index when given); stops at the first error."""
    lines = ["set -e", *_enter(cfg)]
    if cfg.image:
        host = registry_host(cfg.image)
        if host:  # docker runs as root: root's docker config gets the credential helper
            lines.append(f"$sudo gcloud auth configure-docker {shlex.quote(host)} --quiet")
        lines += [f"mkdir -p {WORKSPACE}", f"$sudo docker pull {shlex.quote(cfg.image)}", *_image_holds_tasks(cfg)]
        return "\n".join(lines)
    stale = " ".join(shlex.quote(p) for p in cfg.ship)
    lines += [f"rm -rf -- {stale}", f"tar -xzf ../{shlex.quote(cfg.remote_dir)}.tar.gz"]
    if cfg.wheelhouse is not None:
        lines.append(f"rm -rf {_WH} && mkdir {_WH} && tar -xf ../{shlex.quote(wheels.remote_archive(cfg))} -C {_WH}")
    default = WHEELHOUSE_SETUP if cfg.wheelhouse is not None else DEFAULT_SETUP
    lines.append(cfg.setup if cfg.setup is not None else default)
    return "\n".join(lines)


def _image_holds_tasks(cfg: TpuConfig) -> list[str]:
    """With IMAGE and tasks outside job/: stop the set-up when the image lacks their packages (nothing is shipped)."""
    modules = ship.image_modules(cfg)
    if not modules:
        return []
    find = " ".join(shlex.quote(w) for w in ("--entrypoint", "python", cfg.image or "", "-c", ship.FIND_IN_IMAGE,
                                              *modules))
    # IMAGE is one plain word (config.py) and the words around it hold no `"`, `$` or backquote: double quotes do
    message = (f"worker $worker: expected the image {cfg.image} to hold the tasks' packages {' '.join(modules)} "
               "(nothing is shipped with IMAGE), found it without ${missing:-them (docker run exit $code)}. Fix: "
               f"{ship.IMAGE_FIX}")
    return [_WORKER_ID, f"missing=$($sudo docker run --rm --network=none {find}) || {{",
            "  code=$?", f'  echo "{message}" >&2', "  exit 1", "}"]


def _docker_run(cfg: TpuConfig, name: str | None, env: Mapping[str, str]) -> str:
    """`docker run` of the image: the host's network (the JAX coordinator and peers), every device
    (`--privileged`: /dev/accel* and /dev/vfio/*, and the memory locking libtpu needs), as the ssh user
    (files on the host stay theirs), with the workspace and an absolute run dir's parent mounted at
    the same paths."""
    mounts = ['--volume="$PWD/workspace:$PWD/workspace"']
    parent = _run_dir_parent(cfg)
    if parent:
        mounts.append(f"--volume={shlex.quote(parent)}:{shlex.quote(parent)}")
    return " ".join([
        "$sudo docker run --rm", *([f"--name={shlex.quote(name)}"] if name else []),
        # an init as PID 1 passes SIGTERM on to the job from the start; `docker stop` waits for its save
        f"--init --stop-timeout={int(cfg.stop_grace_s)}",
        "--privileged --network=host", '--user="$(id -u):$(id -g)"', *mounts,
        '--workdir="$PWD/workspace" --env=HOME="$PWD/workspace" --env=PYTHONUNBUFFERED=1',
        *(f"--env={name}" for name in WORKER_VARS),
        *(f"--env={shlex.quote(f'{k}={v}')}" for k, v in env.items()),
        shlex.quote(cfg.image or ""),
    ])


def _run_dir_parent(cfg: TpuConfig) -> str | None:
    """The folder above an absolute run dir (mounted into the container at the same path), or None."""
    run_dir = run_dir_of(cfg.job_args)
    if run_dir is None or not run_dir.startswith("/") or run_dir.rstrip("/").count("/") < 2:
        return None
    return run_dir.rstrip("/").rsplit("/", 1)[0]


def job_command(cfg: TpuConfig, *args: str, env: Mapping[str, str] | None = None) -> str:
    """`python -m job ARGS` on a worker (in the image with IMAGE); ARGS defaults to the job's arguments;
    `env`: variables the job gets on top (multislice)."""
    words = " ".join(shlex.quote(a) for a in (args or cfg.job_args))
    env = env or {}
    if cfg.image:
        return f"{_docker_run(cfg, cfg.remote_dir if not args else None, env)} python -m job {words}".rstrip()
    assign = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())
    return f'{assign}PYTHONUNBUFFERED=1 "$py" -m job {words}'.rstrip()


def check_run_dir_script(cfg: TpuConfig, url: str) -> str:
    """`python -m job check-run-dir URL` on the worker: exits 2 with one line (prefixed by the worker) when
    the job could not write there."""
    lines = [*_enter(cfg), _WORKER_ID]
    if cfg.image:
        lines.append(f"mkdir -p {WORKSPACE}")
    else:
        lines.append(_PY)
    lines += [
        f"if out=$({job_command(cfg, 'check-run-dir', url)} 2>&1); then exit 0; fi",
        'echo "worker $worker: $(printf %s "$out" | tail -n 1)" >&2',
        "exit 2",
    ]
    return "\n".join(lines)


def start_script(cfg: TpuConfig, env: Mapping[str, str] | None = None) -> str:
    """Free the TPU and start the job detached (own session, output to the log, exit code to a file
    when it ends); returns at once. `env`: variables the job gets on top (multislice)."""
    lines = [*_enter(cfg), *_FREE_TPU]
    if cfg.image:
        lines += [f"$sudo docker rm -f {shlex.quote(cfg.remote_dir)} >/dev/null 2>&1", f"mkdir -p {WORKSPACE}"]
        if _run_dir_parent(cfg):  # docker would create a missing one as root; podman refuses it
            lines.append(f"mkdir -p {shlex.quote(_run_dir_parent(cfg) or '')} 2>/dev/null || "
                         f"$sudo mkdir -p {shlex.quote(_run_dir_parent(cfg) or '')}")
    else:
        lines.append(_PY)
    # The detached shell passes TERM/INT on to the job (which saves and exits 75) and records its status.
    wrapper = "\n".join([
        f"{job_command(cfg, env=env)} >>{LOG} 2>&1 </dev/null &",
        "pid=$!",
        # sudo does not pass on a signal from its own process group: a container is signalled by name
        (f"trap '$sudo docker kill --signal=TERM {shlex.quote(cfg.remote_dir)} >/dev/null 2>&1; "
         "kill -TERM \"$pid\" 2>/dev/null' TERM INT" if cfg.image else
         "trap 'kill -TERM \"$pid\" 2>/dev/null' TERM INT"),
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
        'wait "$pid"; code=$?',
        f'echo "$code" >{EXIT}.tmp && mv -f {EXIT}.tmp {EXIT}',
    ])
    lines += [
        f"rm -f {EXIT} {STOP}",
        f": >{LOG}",
        "export py sudo",
        f"setsid nohup bash -c {shlex.quote(wrapper)} >/dev/null 2>&1 </dev/null &",
        f'echo "$!" >{PID}',
    ]
    return "\n".join(lines)


def follow_script(cfg: TpuConfig, lines: str = "+1") -> str:
    """Worker 0: print its log (`tail -n LINES -F`) until the job ends; exit with the job's status.
    Run again after a dropped connection: the job itself never noticed."""
    d = shlex.quote(cfg.remote_dir)
    return "\n".join([
        f"cd {d} 2>/dev/null && [ -f {LOG} ] || "
        f"{{ echo 'no job has run on this worker: nothing to follow' >&2; exit {NO_JOB_EXIT}; }}",
        f'is_job() {{ {_IS_JOB}; }}',
        f"tail -n {shlex.quote(lines)} -F {LOG} 2>/dev/null &",
        "tailpid=$!",
        f"while [ ! -f {EXIT} ]; do",
        f"  if ! {{ {_RUNNING}; }}; then",
        f"    sleep {FOLLOW_POLL_S}; [ -f {EXIT} ] && break",
        '    kill "$tailpid" 2>/dev/null',
        "    echo 'the job is gone and left no exit code (killed, or the VM restarted)' >&2",
        f"    exit {GONE_EXIT}",
        "  fi",
        f"  sleep {FOLLOW_POLL_S}",
        "done",
        f"sleep {FOLLOW_POLL_S}",  # tail prints the last lines
        'kill "$tailpid" 2>/dev/null; wait',
        f'exit "$(cat {EXIT})"',
    ])


def probe_script(cfg: TpuConfig) -> str:
    """One line: `running`, `ended CODE` or `none`, then ` stopped` when `tpu-stop` stopped it."""
    d = shlex.quote(cfg.remote_dir)
    return "\n".join([
        f"cd {d} 2>/dev/null || {{ echo none; exit 0; }}",
        f'is_job() {{ {_IS_JOB}; }}',
        f"stop=; if [ -f {STOP} ]; then stop=' stopped'; fi",
        f'if [ -f {EXIT} ]; then echo "ended $(cat {EXIT})$stop"',
        f'elif {_RUNNING}; then echo "running$stop"',
        'else echo "none$stop"; fi',
    ])


def outcome_script(cfg: TpuConfig) -> str:
    """Every worker says how its job ended, one line: `worker I: ended CODE SECONDS LAST-LINE` (its exit code,
    when that was written, in seconds since the epoch), `worker I: running LAST-LINE` or `worker I: none ...`;
    LAST-LINE is the last line of its log. Read-only (deploy/tpu/failures.py reads the lines)."""
    d = shlex.quote(cfg.remote_dir)
    return "\n".join([
        _WORKER_ID,
        f'cd {d} 2>/dev/null || {{ echo "worker $worker: none"; exit 0; }}',
        f'is_job() {{ {_IS_JOB}; }}',
        f"last=$(tail -n {OUTCOME_TAIL} {LOG} 2>/dev/null | grep -v '^[[:space:]]*$' | tail -n 1 | "
        f"tr -d '\\r' | cut -c1-{OUTCOME_CHARS})",
        f'if [ -f {EXIT} ]; then echo "worker $worker: ended $(cat {EXIT}) '
        f'$(date -r {EXIT} +%s.%N 2>/dev/null || echo 0) $last"',
        f'elif {_RUNNING}; then echo "worker $worker: running $last"',
        'else echo "worker $worker: none $last"; fi',
    ])


def stop_script(cfg: TpuConfig) -> str:
    """SIGTERM the job (it saves and exits 75), SIGKILL it after the grace period, free the TPU."""
    d = shlex.quote(cfg.remote_dir)
    lines = [
        f"cd {d} 2>/dev/null || exit 0",
        _SUDO,
        f'is_job() {{ {_IS_JOB}; }}',
        f"if {_RUNNING}; then",
        f'  pid=$(cat {PID}); date >{STOP}; kill -TERM "$pid"',
        f'  for _ in $(seq {int(cfg.stop_grace_s)}); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done',
        '  if kill -0 "$pid" 2>/dev/null; then',
        '    kill -KILL -- -"$pid" 2>/dev/null; kill -KILL "$pid" 2>/dev/null',
        f'    [ -f {EXIT} ] || echo {GONE_EXIT} >{EXIT}',
        "  fi",
        "fi",
    ]
    if cfg.image:
        lines.append(f"$sudo docker rm -f {d} >/dev/null 2>&1")
    lines += [*_FREE_DEVICES, "exit 0"]
    return "\n".join(lines)
