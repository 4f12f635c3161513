"""The bash scripts that run on every TPU worker (through `gcloud ... ssh --worker=all --command=`).

Every user-supplied word (job arguments, image, folder names) is passed
through `shlex.quote`, so a value with spaces, quotes, `$()` or `;` reaches
the job as one argument and is never run as shell. The scripts assume bash,
the login shell of TPU VM images.

Layout on each worker, under its home directory:

    REMOTE_DIR.tar.gz          the shipped code (when no image is used)
    REMOTE_DIR/                the code, unpacked; the job runs here
    REMOTE_DIR/logs/job.log    this worker's output (every worker keeps its own)
    REMOTE_DIR/logs/job.pid    the running job, for `tpu-stop` and stale-run cleanup
"""

from __future__ import annotations

import shlex

from deploy.tpu_config import TpuConfig

LOG = "logs/job.log"
PID = "logs/job.pid"

# Install the locked dependencies unless the VM's python3 already has them (3.11 + jax + ...; found, not
# imported, which would cost seconds per worker): a venv made by uv (which brings its own Python 3.11;
# TPU VM images ship 3.10), with libtpu.
DEFAULT_SETUP = """\
if python3 -c 'import sys, importlib.util as u; sys.exit(sys.version_info[:2] != (3, 11) or not all(
    u.find_spec(m) for m in ("jax", "flax", "optax", "orbax.checkpoint", "tyro", "portpicker")))' >/dev/null 2>&1
then
  :  # python3 already has the job's dependencies
else
  [ -x .venv/bin/python ] || { python3 -m pip install --quiet --user uv && python3 -m uv venv --python 3.11 .venv; }
  python3 -m uv pip install --quiet --python .venv/bin/python -r requirements.lock -e '.[tpu]'
fi"""

_WORKER_ID = (  # TPU_WORKER_ID where the runtime sets it (GKE, the simulator), else the metadata server
    'worker="${TPU_WORKER_ID:-$(curl -sf -H "Metadata-Flavor: Google" '
    'http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || echo 0)}"'
)
_SUDO = "sudo=; if command -v sudo >/dev/null 2>&1; then sudo='sudo -n'; fi"
_IS_JOB = "tr '\\0' ' ' </proc/\"$1\"/cmdline 2>/dev/null | grep -q -- ' -m job'"
# Processes left over by an earlier run hold the TPU (JAX would then silently use the CPU).
_FREE_TPU = [
    f'is_job() {{ {_IS_JOB}; }}',
    f'if [ -f {PID} ] && is_job "$(cat {PID})"; then kill -KILL "$(cat {PID})"; fi',
    'for dev in /dev/accel* /dev/vfio/*; do',
    '  if [ -e "$dev" ]; then $sudo fuser -k "$dev" >/dev/null 2>&1; fi',
    'done',
    '$sudo rm -f /tmp/libtpu_lockfile',
]


def _enter(cfg: TpuConfig) -> list[str]:
    d = shlex.quote(cfg.remote_dir)
    return [f"mkdir -p {d}/logs && cd {d} || exit 1", _SUDO]


def setup_script(cfg: TpuConfig) -> str:
    """Unpack the shipped code (or pull the image) and prepare the environment; stops at the first error."""
    lines = ["set -e", *_enter(cfg)]
    if cfg.image:
        lines.append(f"$sudo docker pull {shlex.quote(cfg.image)}")
    else:
        stale = " ".join(shlex.quote(p) for p in cfg.ship)
        lines += [f"rm -rf -- {stale}", f"tar -xzf ../{shlex.quote(cfg.remote_dir)}.tar.gz"]
        lines.append(cfg.setup if cfg.setup is not None else DEFAULT_SETUP)
    return "\n".join(lines)


def job_command(cfg: TpuConfig) -> str:
    args = " ".join(shlex.quote(a) for a in cfg.job_args)
    if cfg.image:
        name = shlex.quote(cfg.remote_dir)
        return (f"$sudo docker run --rm --name={name} --privileged --network=host --env=PYTHONUNBUFFERED=1 "
                f"{shlex.quote(cfg.image)} python -m job {args}").rstrip()
    return f'PYTHONUNBUFFERED=1 "$py" -m job {args}'.rstrip()


def run_script(cfg: TpuConfig) -> str:
    """Free the TPU, start the job, stream worker 0's log, exit with the job's status.

    The job runs in the background so its pid can be recorded; a TERM/INT/HUP
    to the script is passed on to the job (which then saves and exits 75).
    """
    lines = [*_enter(cfg), _WORKER_ID, *_FREE_TPU]
    if cfg.image:
        lines.append(f"$sudo docker rm -f {shlex.quote(cfg.remote_dir)} >/dev/null 2>&1")
    else:
        lines.append("py=python3; if [ -x .venv/bin/python ]; then py=.venv/bin/python; fi")
    lines += [
        f": >{LOG}",  # exists before tail opens it (the background job opens it in its own time)
        f"{job_command(cfg)} >>{LOG} 2>&1 </dev/null &",
        "pid=$!",
        f'echo "$pid" >{PID}',
        "trap 'kill -TERM \"$pid\" 2>/dev/null' TERM INT HUP",
        f'if [ "$worker" = 0 ]; then tail -n +1 -f --pid="$pid" {LOG} & fi',
        'while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done',
        'wait "$pid"; code=$?',
        "wait",
        f"rm -f {PID}",
        'exit "$code"',
    ]
    return "\n".join(lines)


def stop_script(cfg: TpuConfig) -> str:
    """SIGTERM the job (it saves and exits 75), SIGKILL it after the grace period, free the TPU."""
    d = shlex.quote(cfg.remote_dir)
    lines = [
        f"cd {d} 2>/dev/null || exit 0",
        _SUDO,
        f'is_job() {{ {_IS_JOB}; }}',
        f'if [ -f {PID} ] && is_job "$(cat {PID})"; then',
        f'  pid=$(cat {PID}); kill -TERM "$pid"',
        f'  for _ in $(seq {int(cfg.stop_grace_s)}); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done',
        '  kill -KILL "$pid" 2>/dev/null',
        "fi",
    ]
    if cfg.image:
        lines.append(f"$sudo docker rm -f {d} >/dev/null 2>&1")
    lines += [
        "for dev in /dev/accel* /dev/vfio/*; do",
        '  if [ -e "$dev" ]; then $sudo fuser -k "$dev" >/dev/null 2>&1; fi',
        "done",
        "$sudo rm -f /tmp/libtpu_lockfile",
        "exit 0",
    ]
    return "\n".join(lines)
