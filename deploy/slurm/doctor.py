"""`make doctor` on Slurm: what would make the job fail, found from the login node before anything is queued.

    make doctor NODES=4 [PARTITION=gpu TIME=2-00:00:00 GPUS_PER_NODE=8 IMAGE=... PYTHON=... ARGS='train --run-dir ...']
    python -m deploy.slurm.doctor --nodes 4 [any flag of python -m deploy.slurm] [--quick] [--probe-wait 60]
        [--check-run 0]

One line per check, ok or the problem and its fix; exit 1 when any failed. The quick part reads
the cluster (scontrol, sinfo: deploy/slurm/partitions.py), and is what `make submit-slurm` runs
before it queues anything; the doctor adds that every node of the partition answers the controller (a
node whose slurmd died is named, with the fix). Then the run itself is checked here (`deploy.checks.run_check`):
ARGS, or every run of SWEEP, parses, its task imports, its config validates and its global batch splits over
the job's devices, NODES x GPUS_PER_NODE, or without GPUs NODES x TASKS_PER_NODE tasks of one CPU
device each (XLA_FLAGS' host device count, which sbatch passes on, when it sets one); with
--check-run 0 (make doctor without ARGS or SWEEP) its line says it was not checked. The probe (not
with --quick) is one task through srun, with the job's partition, account, QOS and constraint and a
5-minute limit: it starts within --probe-wait seconds or is reported as not started, and on the
local cluster it takes under a second (docs/slurm.md). On the compute node it checks, with
slurm/doctor-probe.sh:

- that the folder make runs in is there too (the job starts in it);
- that the run dir is the same folder: it writes a token into it, which this node must read back
  (a /tmp or a login-node-only disk fails here);
- that PYTHON (or the default tasks' interpreter) runs `import job, jax`, with jax's CUDA plugin
  when GPUS_PER_NODE is set;
- with IMAGE, that the container runtime slurm/train.sbatch would pick is there (pyxis: srun
  --container-image on this node; apptainer or podman on the compute node);
- with WHEELHOUSE (a folder of `make wheelhouse` on a shared file system, for nodes without a package
  index), that PYTHON's pip there installs every pin from it with no index (`pip install --dry-run`):
  its wheels fit the node's Python and platform. Here, the quick part checks that the folder is whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from deploy.checks import Check, Devices, failed, report, run_check, run_skipped
from deploy.runner import Runner
from deploy.slurm import array, partitions, wheels
from deploy.slurm.options import ROOT, SlurmConfig, check, resource_options, switch, time_minutes
from deploy.slurm.submit import LOCAL_CLUSTER_ENV, check_gpu_python, parse
from job.core import values
from job.errors import ConfigError, as_config_error
from job.launch import HOST_DEVICES_FLAG
from job.runtime.cluster.base import SKIP_GPU_CHECK, skips_gpu_check

PROBE_SCRIPT = ROOT / "slurm" / "doctor-probe.sh"
PROBE_MINUTES = 5  # the probe's --time (or TIME when shorter): short jobs start sooner
PROBE_WAIT_S = 60  # srun --immediate: how long the probe may wait for a node
DEFAULT_RUN_DIR = "runs/example"  # `python -m job train`'s --run-dir when ARGS names none (job/train/config.py)
PROBE_OPTIONS = ("partition", "account", "qos", "constraint")  # the job's options the probe takes too
SHARED_FIX = ("a --run-dir on a file system the compute nodes mount too (a shared home or project folder, not /tmp "
              "or a login node's own disk), e.g. ARGS='train --run-dir runs/NAME' from a shared checkout, or gs://")


@dataclasses.dataclass(frozen=True)
class DoctorOptions:
    quick: bool = False  # --quick: no probe job (what make submit-slurm runs)
    probe_wait_s: int = PROBE_WAIT_S  # --probe-wait: seconds the probe may wait for a node
    check_run: bool = True  # --check-run 0: the run's line says it was not checked (make doctor without ARGS, SWEEP)
    wheelhouse: str = ""  # WHEELHOUSE: a `make wheelhouse` folder the compute nodes install from ('' without)


def run_dir_of(args: Sequence[str]) -> str:
    """The job's run dir as slurm/train.sbatch finds it: the last --run-dir, a sweep element's SWEEP_DIR."""
    found = args[1] if len(args) > 1 and args[0] == "sweep-run" else DEFAULT_RUN_DIR
    for i, arg in enumerate(args):
        if arg in ("--run-dir", "--run_dir") and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(("--run-dir=", "--run_dir=")):
            found = arg.split("=", 1)[1]
    return found


def quick_checks(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str]) -> Iterator[Check]:
    """The checks with no job; stops after one whose failure leaves the rest nothing to check."""
    if runner.which("sbatch") is None:
        yield Check("sbatch", False, "expected Slurm's sbatch on PATH, found none",
                    fix="run this on a Slurm login node, or `make slurm-up NODES=4` (then "
                        f"`source {LOCAL_CLUSTER_ENV}`, which make doctor does for you)")
        return
    try:
        cluster = partitions.read(cfg, runner)
    except ConfigError as exc:
        yield failed("partition", exc)
        return
    for name, quick in partitions.QUICK:
        try:
            yield Check(name, True, quick(cfg, cluster))
        except ConfigError as exc:
            yield failed(name, exc)
    yield nodes_answer(cluster)
    if cfg.gpus_per_node and not cfg.image:
        try:
            check_gpu_python(cfg, runner, environ)
            yield (Check.skip("GPU interpreter here", f"{cfg.task_python}: {SKIP_GPU_CHECK}=1",
                              to_run=f"unset {SKIP_GPU_CHECK}") if skips_gpu_check(environ)
                   else Check("GPU interpreter here", True, f"{cfg.task_python} has jax's CUDA plugin"))
        except ConfigError as exc:
            yield failed("GPU interpreter here", exc)


def nodes_answer(cluster: partitions.Cluster, most: int = 10) -> Check:
    """Every node of the job's partition answers the controller (sinfo: not down, unknown or not responding): a
    node whose slurmd died takes no job and, while its state still reads idle, makes a job that lands on it wait."""
    name, partition = "nodes answer", cluster.partition.name
    silent = [node for node in cluster.nodes if not node.answers]
    if not silent:
        return Check(name, True, f"all {len(cluster.nodes)} node(s) of partition {partition} answer the controller")
    said = ", ".join(node.said() for node in silent[:most]) + (f" and {len(silent) - most} more"
                                                                if len(silent) > most else "")
    names = ",".join(node.name for node in silent)
    return Check(name, False, f"expected every node of partition {partition} to answer the controller (its slurmd "
                 f"running), found {len(silent)} of {len(cluster.nodes)} that do not: {said}",
                 fix=f"start slurmd on {silent[0].name} again (the local cluster: `make slurm-up NODES=...` with its "
                     f"node count starts any that died; elsewhere: ask the admins), then, if it stays down, "
                     f"`scontrol update nodename={names} state=resume`")


def host_devices(environ: Mapping[str, str]) -> int:
    """CPU devices per task: XLA_FLAGS' --xla_force_host_platform_device_count (sbatch passes it on), else 1."""
    found = 1
    for flag in environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == HOST_DEVICES_FLAG and value.isdigit() and int(value) > 0:
            found = int(value)
    return found


def devices(cfg: SlurmConfig, environ: Mapping[str, str]) -> Devices:
    """The job's devices as the submit path asks for them (`array.devices`): NODES x GPUS_PER_NODE; without GPUs
    NODES x TASKS_PER_NODE tasks, each with its CPU devices."""
    gpus = array.devices(cfg)
    if gpus is not None:
        return Devices(gpus, f"NODES={cfg.nodes} x GPUS_PER_NODE={cfg.gpus_per_node}")
    each = host_devices(environ)
    tasks = f"NODES={cfg.nodes} x TASKS_PER_NODE={cfg.ntasks_per_node}"
    return Devices(cfg.nodes * cfg.ntasks_per_node * each,
                   f"{tasks} x {each} CPU devices from XLA_FLAGS" if each > 1 else f"{tasks}, one CPU device each")


def run(cfg: SlurmConfig, environ: Mapping[str, str], options: DoctorOptions) -> Check:
    if not options.check_run:
        return run_skipped(devices(cfg, environ))
    return run_check(cfg.args, cfg.sweep, devices(cfg, environ))


def container_runtime(cfg: SlurmConfig, runner: Runner) -> str:
    """With IMAGE: pyxis, apptainer or podman, as slurm/train.sbatch picks it (auto: pyxis when srun has it)."""
    if cfg.container_runtime not in ("auto", "pyxis"):
        return cfg.container_runtime
    help_text = runner.run(["srun", "--help"], capture=True, check=False, mutating=False)
    pyxis = "--container-image" in f"{help_text.stdout}{help_text.stderr}"
    if cfg.container_runtime == "pyxis" and not pyxis:
        raise ConfigError("CONTAINER_RUNTIME", expected="pyxis: srun with --container-image",
                          found="pyxis, but `srun --help` has no --container-image",
                          fix="CONTAINER_RUNTIME=auto (apptainer), or CONTAINER_RUNTIME=podman where podman is "
                              "installed")
    return "pyxis" if pyxis else "apptainer"


def probe_argv(cfg: SlurmConfig, run_dir: Path | None, token: str, runtime: str, wait_s: int,
               wheelhouse: str = "") -> list[str]:
    """srun of one task running slurm/doctor-probe.sh's text (and with `wheelhouse`, wheels.PROBE), with the
    job's partition, account, QOS, constraint. No run dir (None: gs://): the probe checks none."""
    options = [f"--{name}={value}" for name, value in resource_options(cfg) if name in PROBE_OPTIONS]
    python = "" if cfg.image else cfg.task_python
    script, more = (PROBE_SCRIPT.read_text() + wheels.PROBE, [str(Path(wheelhouse).absolute())]) if wheelhouse \
        else (PROBE_SCRIPT.read_text(), [])
    return ["srun", f"--job-name={cfg.job_name}-doctor", "--nodes=1", "--ntasks=1",
            f"--time={min(PROBE_MINUTES, time_minutes(cfg.time))}", f"--immediate={wait_s}", "--quiet", *options,
            "bash", "-c", script, "doctor-probe", str(run_dir or ""), token, python, cfg.image or "",
            "" if runtime == "pyxis" else runtime, *more]


def findings(stdout: str) -> dict[str, str]:
    """The probe's `doctor:KEY=VALUE` lines -> {KEY: VALUE}."""
    found = {}
    for line in stdout.splitlines():
        key, eq, value = line.strip().removeprefix("doctor:").partition("=")
        if line.startswith("doctor:") and eq:
            found[key] = value
    return found


def make_run_dir(path: Path) -> list[Path]:
    """Make `path` (as the job would) and return the folders that were made, deepest first."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return made


def remove_made(made: Sequence[Path]) -> None:
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def probe_checks(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str], wait_s: int,
                 wheelhouse: str = "") -> Iterator[Check]:
    """One task through srun: the submit folder, run dir, interpreter, container runtime and wheelhouse on a compute
    node."""
    runtime = ""
    if cfg.image:
        try:
            runtime = container_runtime(cfg, runner)
        except ConfigError as exc:
            yield failed("container runtime", exc)
            return
    run_dir = run_dir_of(cfg.args)
    path = None if "://" in run_dir else Path(run_dir).expanduser().absolute()
    if path is None:
        yield Check.skip("run dir on a compute node", f"{run_dir} is object storage, not a folder: not probed",
                         to_run=f"`python -m job check-run-dir {run_dir}` checks that a host can write there")
    try:
        made = make_run_dir(path) if path is not None else []
    except OSError as exc:
        yield Check("run dir here", False, f"--run-dir {run_dir}: cannot make {path} ({exc.strerror})",
                    fix="a --run-dir this user can create")
        return
    token = secrets.token_hex(8)
    started = time.monotonic()
    try:
        proc = runner.run(probe_argv(cfg, path, token, runtime, wait_s, wheelhouse), capture=True, check=False,
                          timeout=wait_s + 60 * PROBE_MINUTES + 60)
        out, err, code = proc.stdout or "", proc.stderr or "", proc.returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        out, err, code = "", str(exc), -1
    finally:
        elapsed = time.monotonic() - started
        seen = path is not None and _take_token(path / f".doctor-{token}", token)
        remove_made(made)
    found = findings(out)
    if "node" not in found:
        said = " | ".join(line.strip() for line in f"{err}\n{out}".splitlines() if line.strip()) or "no message"
        late = elapsed >= wait_s
        yield Check("probe job", False, f"srun of one task did not run (exit {code}"
                    + (f", not started within {wait_s} s" if late else "") + f"): {said}",
                    fix="PROBE_WAIT=600 (seconds to wait for a node), or QUICK=1 to skip the probe" if late
                    else "see srun's words above; the quick checks said what they could")
        return
    node = found["node"]
    yield Check("probe job", True, f"1 task on {node} in {elapsed:.1f} s (srun, start to end)")
    yield from _read_findings(cfg, found, node, path, seen, runtime, environ)
    if wheelhouse and not cfg.image:
        yield wheels.on_node(cfg, wheelhouse, found, node)


def _take_token(token_file: Path, token: str) -> bool:
    """Whether the probe's token is here, removing it."""
    try:
        return token_file.read_text().strip() == token
    except OSError:
        return False
    finally:
        token_file.unlink(missing_ok=True)


def _read_findings(cfg: SlurmConfig, found: Mapping[str, str], node: str, path: Path | None, seen: bool,
                   runtime: str, environ: Mapping[str, str]) -> Iterator[Check]:
    here = os.path.realpath(os.getcwd())
    if found.get("cwd") == here:
        yield Check("submit folder on a compute node", True, f"{here} on {node}")
    else:
        yield Check("submit folder on a compute node", False, f"{here}, where make runs, is not on {node} (the task "
                    f"started in {found.get('cwd')}); the job starts there and reads slurm/requeue.sh from there",
                    fix="run make from a checkout on a file system the compute nodes mount")
    if path is not None:
        yield _run_dir_check(found.get("run_dir", ""), path, node, seen)
    if not cfg.image:
        yield _python_check(cfg, found.get("python", ""), node, environ)
    elif runtime == "pyxis":
        yield Check("container runtime", True, "pyxis (srun --container-image) on this node's srun")
    else:
        yield _runtime_check(cfg, runtime, found, node)


def _run_dir_check(said: str, path: Path, node: str, seen: bool) -> Check:
    name = "run dir on a compute node"
    if said == "written" and seen:
        return Check(name, True, f"{path} is the same folder on {node} (a token written there was read here)")
    if said == "written":
        return Check(name, False, f"--run-dir {path}: a token written there on {node} is not here: {node} has "
                     "its own folder of that name (like /tmp on each machine)", fix=SHARED_FIX)
    if said == "unwritable":
        return Check(name, False, f"--run-dir {path} is on {node} but this user cannot write there",
                     fix="a --run-dir this user can write on the compute nodes (chmod, or another folder)")
    return Check(name, False, f"--run-dir {path} (made here) does not exist on {node}: the compute nodes do not "
                 "see this folder", fix=SHARED_FIX)


def _python_check(cfg: SlurmConfig, said: str, node: str, environ: Mapping[str, str]) -> Check:
    name, python = "interpreter on a compute node", cfg.task_python
    status, _, rest = said.partition(" ")
    if status == "missing" or not said:
        return Check(name, False, f"PYTHON={python} does not exist on {node}",
                     fix="PYTHON=an interpreter on a file system the compute nodes mount (`make venv` in a shared "
                         "checkout), or IMAGE=... to run from an image")
    if status == "failed":
        code, _, words = rest.partition(" ")
        return Check(name, False, f"PYTHON={python} on {node} cannot `import job, jax` (exit {code}: {words})",
                     fix=f"install the job into it ({python} -m pip install -r requirements.lock -e .), or "
                         "PYTHON=.venv/bin/python of a shared checkout")
    version, jax_version, cuda, job_file = (rest.split(" ", 3) + ["", "", ""])[:4]
    if cfg.gpus_per_node and cuda != "1" and not skips_gpu_check(environ):
        return Check(name, False, f"PYTHON={python} on {node} has no jax CUDA plugin (jax-cuda12-plugin) for "
                     f"GPUS_PER_NODE={cfg.gpus_per_node}: jax would train on the CPU",
                     fix=f"`make venv FLAVOR=cuda` and leave PYTHON unset, or IMAGE=...:cuda; stand-in GPUs: "
                         f"{SKIP_GPU_CHECK}=1")
    return Check(name, True, f"{python} on {node}: Python {version}, jax {jax_version}, job from {job_file}")


def _runtime_check(cfg: SlurmConfig, runtime: str, found: Mapping[str, str], node: str) -> Check:
    name = "container runtime"
    if found.get("runtime", "missing") == "missing":
        how = " (CONTAINER_RUNTIME=auto and srun has no pyxis)" if cfg.container_runtime == "auto" else ""
        return Check(name, False, f"IMAGE={cfg.image} runs through {runtime}{how}, which is not on PATH on {node}",
                     fix="CONTAINER_RUNTIME=podman (or apptainer) where it is installed, `module load "
                         f"{runtime}` in the shell that runs make, or unset IMAGE to run from the shared venv")
    image = found.get("image", "")
    if image == "missing":
        return Check(name, False, f"IMAGE={cfg.image}: no such file on {node} for apptainer",
                     fix="IMAGE=a .sif on a shared file system, or docker://... to pull it")
    note = {"absent": "; the image is not on the node yet: podman pulls it when the job starts",
            "remote": "; apptainer pulls the image when the job starts"}.get(image, "")
    return Check(name, True, f"{runtime} at {found['runtime'].removeprefix('ok ')} on {node}{note}")


def checks(cfg: SlurmConfig, runner: Runner, environ: Mapping[str, str], options: DoctorOptions) -> Iterator[Check]:
    """Every check of `cfg`, in the order printed: the quick ones, the run's, then (unless quick) the probe's."""
    reachable = True
    for found in quick_checks(cfg, runner, environ):
        reachable = reachable and (found.ok or found.name not in ("sbatch", "partition", "access"))
        yield found
    if options.wheelhouse:
        yield wheels.here(options.wheelhouse)
    yield run(cfg, environ, options)
    if not options.quick and reachable:
        yield from probe_checks(cfg, runner, environ, options.probe_wait_s, options.wheelhouse)


def parse_options(argv: Sequence[str]) -> tuple[DoctorOptions, list[str]]:
    """The doctor's own flags, and the rest (python -m deploy.slurm's flags, and ARGS after --)."""
    cut = list(argv).index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--quick", nargs="?", const="1", default="")
    parser.add_argument("--probe-wait", default="")
    parser.add_argument("--check-run", default="1")
    parser.add_argument("--wheelhouse", default="")
    ours, rest = parser.parse_known_args(list(argv[:cut]))
    quick = switch("QUICK", ours.quick.strip())
    with as_config_error("PROBE_WAIT", expected="whole seconds 1..86400", found=ours.probe_wait,
                         fix="PROBE_WAIT=60, or leave it unset"):
        wait = values.whole(ours.probe_wait.strip() or str(PROBE_WAIT_S), minimum=1, maximum=86400)
    return DoctorOptions(quick=quick, probe_wait_s=wait, check_run=switch("--check-run", ours.check_run.strip()),
                         wheelhouse=ours.wheelhouse.strip()), [*rest, *argv[cut:]]


def main(argv: Sequence[str] | None = None, runner: Runner | None = None,
         environ: Mapping[str, str] = os.environ) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        options, rest = parse_options(argv)
        cfg = parse(rest)
        check(cfg)
    except ConfigError as exc:
        return report([failed("request", exc)])
    return report(checks(cfg, runner or Runner(), environ, options))


if __name__ == "__main__":
    sys.exit(main())
