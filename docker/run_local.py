"""Run the job's image as N containers on this machine that form one JAX cluster.

    python docker/run_local.py -n 4 --devices-per-process 2 --image jax-cluster-job:cpu \\
        -- train --run-dir runs/docker

`make docker-run-local` runs this: `python -m job.launch`, with containers.
Every container runs with host networking and gets the variables that
`job.initialize()` detects as a "local" cluster. They are passed by name
(`--env=NAME`, the value comes from each rank's environment), so every rank
runs the same argv and `job.runtime.procgroup.ProcessGroup` can run them: output
lines carry `[rank N]`, signals are forwarded, and when one container fails
the others are stopped; whatever is left is removed at the end.

The host folder --runs (default runs/) is /workspace/runs in every container:
one filesystem for all ranks, as orbax needs for a multi-process checkpoint,
so `--run-dir runs/NAME` inside is runs/NAME here. Containers run as the
image's non-root user; as root, this gives that user the --runs folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

from job.errors import seconds
from job.launch import LaunchConfig, child_environments, coordinator_port, local_count
from job.runtime.procgroup import ProcessGroup

log = logging.getLogger("job.launch")

HERE = Path(__file__).resolve().parent
WORKDIR = "/workspace"  # the image's WORKDIR (docker/Dockerfile)
RUN_LABEL = "jax-cluster-job.run"  # marks one launch's containers, for the clean-up
FORWARDED_PREFIXES = ("JOB_", "JAX_", "XLA_")  # variables every container receives
FORWARDED_NAMES = ("PYTHONUNBUFFERED",)


class RunError(Exception):
    """A problem found before anything is started: what was expected, what was found, the fix."""


@dataclasses.dataclass(frozen=True)
class ContainerRun:
    engine: str  # docker or podman
    image: str  # the image to run (make docker-build)
    num_processes: int  # how many containers
    job_args: tuple[str, ...]  # arguments of `python -m job` (empty: the image's CMD)
    devices_per_process: int | None = None  # CPU devices per container; None leaves XLA_FLAGS alone
    runs_dir: Path = Path("runs")  # host folder shared as /workspace/runs
    volumes: tuple[str, ...] = ()  # extra HOST:CONTAINER[:OPTIONS] mounts
    port: int | None = None  # coordinator port; None picks a free one
    kill_after_s: float = 5.0  # after a failure, how long the others get before SIGKILL
    stop_timeout_s: float = 60.0  # after a forwarded signal, how long they get to save and exit


def default_engine() -> str:
    """docker/engine.sh's choice: CONTAINER_ENGINE, else docker with a daemon, else podman."""
    proc = subprocess.run(["sh", str(HERE / "engine.sh")], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunError(proc.stderr.strip())
    return proc.stdout.strip()


def image_user(engine: str, image: str) -> str:
    """The image's USER ('' for root); a clear error when the image is not there."""
    proc = subprocess.run([engine, "image", "inspect", "--format", "{{.Config.User}}", image],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunError(f"expected the image {image!r} in {engine}, found none ({proc.stderr.strip()}). "
                       f"Fix: make docker-build IMAGE={image}")
    return proc.stdout.strip()


def user_options(engine: str, user: str, runs_dir: Path, *, euid: int, uid: int, gid: int) -> list[str]:
    """Who the containers run as, so that they can write the shared runs folder.

    As root: the image's own (non-root) user, and the folder is given to it.
    Otherwise: this user, so that what the job writes belongs to them
    (rootless podman maps it with keep-id; docker runs it as --user).
    """
    if euid != 0:
        return (["--userns=keep-id"] if engine == "podman" else []) + [f"--user={uid}:{gid}"]
    owner = user.split(":")
    if user in ("", "0", "root") or owner[0] in ("0", "root"):
        return []
    if not all(part.isdigit() for part in owner):
        log.warning("the image's user %r is not numeric; make sure it can write %s", user, runs_dir)
        return []
    new_uid, new_gid = int(owner[0]), int(owner[-1])
    if (runs_dir.stat().st_uid, runs_dir.stat().st_gid) != (new_uid, new_gid):
        log.info("giving %s to uid %d:%d, the image's user (the containers write there)", runs_dir, new_uid, new_gid)
        os.chown(runs_dir, new_uid, new_gid)
    return []


def forwarded(env: dict[str, str]) -> list[str]:
    """Names of the variables each container receives from its rank's environment."""
    return sorted(name for name in env if name.startswith(FORWARDED_PREFIXES) or name in FORWARDED_NAMES)


def container_argv(run: ContainerRun, names: list[str], token: str, users: list[str]) -> list[str]:
    """One argv for every rank: the values of `names` differ per rank, not the argv."""
    return [
        run.engine, "run", "--rm", "--init", "--network=host",
        f"--label={RUN_LABEL}={token}",
        f"--volume={run.runs_dir.resolve()}:{WORKDIR}/runs",
        *(f"--volume={volume}" for volume in run.volumes),
        *users,
        *(f"--env={name}" for name in names),
        run.image,
        *run.job_args,
    ]


def rank_environments(run: ContainerRun, port: int, base: dict[str, str]) -> list[dict[str, str]]:
    """The `podman run` / `docker run` client's environment per rank (job.launch's, on CPU)."""
    cfg = LaunchConfig(num_processes=run.num_processes, command=(run.engine,),
                       devices_per_process=run.devices_per_process, port=port)
    return child_environments(cfg, port, {**base, "JAX_PLATFORMS": "cpu"})


def remove_containers(engine: str, token: str) -> None:
    """Remove this launch's containers that are still there (a killed client leaves its container)."""
    listed = subprocess.run([engine, "ps", "--all", "--quiet", f"--filter=label={RUN_LABEL}={token}"],
                            capture_output=True, text=True)
    ids = listed.stdout.split()
    if ids:
        log.info("removing %d container(s) left running", len(ids))
        subprocess.run([engine, "rm", "--force", *ids], capture_output=True)


def launch(run: ContainerRun) -> int:
    """Start the containers and watch them to the end; return the first failure's code, or 0."""
    user = image_user(run.engine, run.image)
    run.runs_dir.mkdir(parents=True, exist_ok=True)
    users = user_options(run.engine, user, run.runs_dir, euid=os.geteuid(), uid=os.getuid(), gid=os.getgid())
    port = coordinator_port(run.port)
    envs = rank_environments(run, port, dict(os.environ))
    token = uuid.uuid4().hex[:12]
    argv = container_argv(run, forwarded(envs[0]), token, users)
    log.info("%d containers, coordinator 127.0.0.1:%d: %s", run.num_processes, port, shlex.join(argv))
    group = ProcessGroup(argv, envs, kill_after_s=run.kill_after_s, stop_timeout_s=run.stop_timeout_s)
    try:
        return group.run()
    finally:
        remove_containers(run.engine, token)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python docker/run_local.py",
        description="Run the job's image as N containers (host network) that form one JAX cluster.",
        epilog="example: python docker/run_local.py -n 2 --image jax-cluster-job:cpu -- train --steps 50",
    )
    p.add_argument("-n", "--nproc", type=local_count, required=True, help="number of containers")
    p.add_argument("--image", required=True, help="the image to run (make docker-build)")
    p.add_argument("--engine", choices=("docker", "podman"), default=None,
                   help="container engine (default: docker/engine.sh's choice)")
    p.add_argument("--devices-per-process", type=local_count, default=None,
                   help="CPU devices each container sees (sets XLA_FLAGS)")
    p.add_argument("--runs", type=Path, default=Path("runs"),
                   help=f"host folder shared by every container as {WORKDIR}/runs (default: runs)")
    p.add_argument("-v", "--volume", action="append", default=[], metavar="HOST:CONTAINER[:OPTIONS]",
                   help="another folder to mount in every container (repeatable), e.g. data")
    p.add_argument("--kill-after", type=seconds, default=5.0,
                   help="seconds the others get after one container fails, before SIGKILL")
    return p


def parse_args(argv: list[str]) -> ContainerRun:
    parser = _parser()
    own, job_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    for volume in args.volume:
        if ":" not in volume or not Path(volume.split(":", 1)[0]).exists():
            parser.error(f"expected --volume HOST:CONTAINER with an existing HOST folder, found {volume!r}. "
                         "Fix: --volume $PWD/data:/data")
    try:
        engine = args.engine or default_engine()
    except RunError as err:
        parser.error(str(err))
    return ContainerRun(engine=engine, image=args.image, num_processes=args.nproc, job_args=tuple(job_args),
                        devices_per_process=args.devices_per_process, runs_dir=args.runs,
                        volumes=tuple(args.volume), kill_after_s=args.kill_after)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[run-local] %(message)s")
    run = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return launch(run)
    except RunError as err:
        print(f"docker/run_local.py: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
