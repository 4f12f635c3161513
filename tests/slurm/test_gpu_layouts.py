"""GPU-shaped jobs on the local Slurm (4 stand-in GPUs a node, `slurm/local-cluster.sh`), submitted
through both paths: what real Slurm gives every task, and the devices `job.initialize` derives from it.

Each task's interpreter is a wrapper (`--python`) that prints the task's own Slurm GPU variables and
turns on the `job.runtime.distributed` debug line, which names the devices `job.initialize` hands to jax
(`joining slurm cluster: process r of n, ..., local devices D`). The job runs on CPU
(JAX_PLATFORMS=cpu; JOB_SKIP_GPU_CHECK=1, the GPUs being stand-ins): `python -m job demo` (2 CPU
devices a process, for its tensor-parallel check), and for one layout a 2-step `train`, whose
preflight says in every task how many GPUs it was given before skipping the check. Every task joins
one JAX cluster; process 0 reports the cluster summary.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import ROOT, explain
from tests.slurm.test_slurm import SMALL, deploy_argv, job_id, task_env

pytestmark = pytest.mark.slurm

NODES = 2
GPUS = "0,1,2,3"  # every node's gres.conf: /dev/fakegpu[0-3]
SLURM_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_TASK", "SLURM_STEP_GPUS",
              "SLURM_JOB_GPUS", "SLURM_LOCALID", "SLURMD_NODENAME")
TASK_LINE = re.compile(r"^task-env procid=(\d+) (.*)$", re.MULTILINE)
JOINING = re.compile(r"joining slurm cluster: process (\d+) of (\d+), coordinator (\S+), local devices ([0-9,]+|all)")
SKIPPED = re.compile(r"GPU check skipped \(JOB_SKIP_GPU_CHECK=1\): this process was given (\d+) GPU\(s\), "
                     r"jax runs on (\d+) cpu device")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    via: str  # submit path
    options: tuple[str, ...]  # deploy.slurm.submit flags
    tasks_per_node: int
    visible: tuple[str, ...]  # CUDA_VISIBLE_DEVICES Slurm sets, by SLURM_LOCALID
    derived: tuple[str, ...]  # the local devices job.initialize derives, by SLURM_LOCALID
    gpus_per_task: str  # SLURM_GPUS_PER_TASK in the task ("-": unset)
    train: bool = False  # a 2-step train (its preflight counts each task's GPUs); else the demo (cheaper)


LAYOUTS = (
    Layout("per-node", "submitit", ("--gpus-per-node", "4", "--tasks-per-node", "1"), 1,
           visible=(GPUS,), derived=(GPUS,), gpus_per_task="-", train=True),
    Layout("per-task-2", "sbatch", ("--gpus-per-node", "4", "--tasks-per-node", "2"), 2,
           visible=("0,1", "2,3"), derived=("0,1", "0,1"), gpus_per_task="2"),
    Layout("per-task-1", "submitit", ("--gpus-per-node", "4", "--tasks-per-node", "4"), 4,
           visible=("0", "1", "2", "3"), derived=("0",) * 4, gpus_per_task="1"),
    Layout("gres-shared", "sbatch", ("--gpus-per-node", "4", "--tasks-per-node", "4", "--gres"), 4,
           visible=(GPUS,) * 4, derived=("0", "1", "2", "3"), gpus_per_task="-"),
)


def reporting_python(tmp: Path) -> Path:
    """An interpreter for the tasks: prints what Slurm gave the task, then runs this Python with the
    `job.runtime.distributed` logger at DEBUG (a sitecustomize on PYTHONPATH), so its `joining ...` line shows."""
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import logging\nlogging.getLogger('job.runtime.distributed').setLevel(logging.DEBUG)\n")
    shown = " ".join(f"{name}=${{{name}:--}}" for name in SLURM_VARS)
    wrapper = tmp / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ -z "${{SLURM_PROCID:-}}" ] || echo "task-env procid=$SLURM_PROCID {shown}"\n'
        f'PYTHONPATH={hook}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def task_logs(logs: Path, via: str, jid: str, ntasks: int) -> list[str]:
    name = "{jid}_{rank}_log.out" if via == "submitit" else "{jid}-{rank}.log"
    return [(logs / name.format(jid=jid, rank=rank)).read_text() for rank in range(ntasks)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{layout.name}-{layout.via}" for layout in LAYOUTS])
def test_every_task_gets_its_gpus_from_slurm_and_uses_them(layout: Layout, slurm_env: dict[str, str],
                                                           tmp_path: Path) -> None:
    env = {**task_env(slurm_env), "JOB_SKIP_GPU_CHECK": "1"}  # stand-in GPUs: deploy and preflight skip the check
    if layout.train:
        job = ["train", "--run-dir", str(tmp_path / "run"), "--steps", "2", "--log-every", "1", *SMALL]
    else:  # the demo's tensor-parallel check needs 2 devices a process
        job = ["demo"]
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    argv = deploy_argv(tmp_path, "--via", layout.via, *layout.options, "--python", str(reporting_python(tmp_path)),
                       "--wait", job=job, nodes=NODES)
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, explain(proc, proc.stdout, proc.stderr)
    jid = job_id(proc.stdout)
    ntasks = NODES * layout.tasks_per_node
    nodes: list[str] = []
    for rank, log in enumerate(task_logs(tmp_path / "logs", layout.via, jid, ntasks)):
        local = rank % layout.tasks_per_node
        # what Slurm gave the task, printed by the task itself
        seen = TASK_LINE.search(log)
        assert seen and int(seen.group(1)) == rank, log
        got = dict(pair.split("=", 1) for pair in seen.group(2).split())
        expected = {"CUDA_VISIBLE_DEVICES": layout.visible[local], "SLURM_GPUS_ON_NODE": "4",
                    "SLURM_GPUS_PER_TASK": layout.gpus_per_task, "SLURM_STEP_GPUS": layout.visible[local],
                    "SLURM_JOB_GPUS": GPUS, "SLURM_LOCALID": str(local)}
        assert {k: got[k] for k in expected} == expected, f"task {rank}:\n{log}"
        nodes.append(got["SLURMD_NODENAME"])
        # what job.initialize derived from it and handed to jax
        joined = JOINING.search(log)
        assert joined, f"task {rank} has no `joining` line:\n{log}"
        assert (int(joined.group(1)), int(joined.group(2))) == (rank, ntasks), joined.group(0)
        assert joined.group(4) == layout.derived[local], f"task {rank}: {joined.group(0)}"
        if layout.train:  # the preflight counted as many GPUs, then skipped the check (stand-ins)
            skipped = SKIPPED.search(log)
            assert skipped, f"task {rank} has no skipped GPU check:\n{log}"
            assert int(skipped.group(1)) == len(layout.derived[local].split(",")), skipped.group(0)
            assert f"process {rank} of {ntasks} (slurm) on {got['SLURMD_NODENAME']}" in log
    # ranks fill the nodes in order: 0..T-1 on the first node, and so on
    per_node = [nodes[r:r + layout.tasks_per_node] for r in range(0, ntasks, layout.tasks_per_node)]
    assert all(len(set(group)) == 1 for group in per_node) and len({g[0] for g in per_node}) == NODES, nodes
    # process 0's own report (its log, streamed by --wait) names the same devices
    summary = re.search(r"slurm cluster: process 0 of (\d+), coordinator \S+, local devices ([0-9,]+|all)",
                        proc.stdout)
    assert summary and summary.groups() == (str(ntasks), layout.derived[0]), proc.stdout
    if layout.train:
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["final_step"] == 2
    else:
        assert "demo OK" in proc.stdout
