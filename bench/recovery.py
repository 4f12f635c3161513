"""Recovery from a lost process on the local Slurm cluster: requeue vs restart in the allocation vs the same with
the node-local tier.

    make slurm-up NODES=4 && python -m bench.recovery [--quick]

Each case is one `python -m deploy.slurm --wait` job of 2 nodes x 1 task (the example LM, small), whose process on
node2 is SIGKILLed at step 22 (tests/user_tasks/node_fault.py: the OOM killer's signal):

- requeue: no spare; the supervisor requeues the job away from node2 (`scontrol requeue`, ExcNodeList);
- restart in the allocation: SPARES=1; a new step on node1 and node3 at once;
- restart with the local tier: SPARES=1 and node-local saves every 5 steps (`--ckpt.local-every 5`): process 1's
  shards come from node1 over the network.
Every case saves to the persistent tier every 50 steps (none yet at the fault).

Figures, from the run's own records: the restart gap (attempts.jsonl's `resumed` record: from the failed
attempt's end, as the supervisor saw srun end, to the first step completed after the restart), the kill to that
step (from the faulty process's `node_fault: SIGKILL at` line: the survivors' way out included) and the steps
redone (the fault's step minus the step restored). The requeue here meets an idle queue (the partition holds
nothing else): on a busy cluster it waits behind other jobs on top of this; a restart in the allocation never
waits (tests/slurm/test_retries.py holds a job pending to show it). The compilation cache is warm for the
restart (the failed attempt filled it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import Section, standalone
from bench.timing import fmt_s, median

NAME = "recovery"
TITLE = "Recovery from a killed process on Slurm: requeue vs restart in the allocation (vs with the node-local tier)"
ROOT = Path(__file__).resolve().parent.parent
CLUSTER = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/tmp/jax-job-slurm"))
FAULT_STEP = 22  # the process on node2 dies when it is asked for step 22's rows (0-based), after step 20's save
SMALL = ["--model.layers", "1", "--model.dim", "32", "--model.mlp-dim", "64", "--eval-every", "1000",
         "--log-every", "5"]
CASES = {
    "requeue": (["--spares", "0"], ["--ckpt.every", "50"], "persistent"),
    "restart in the allocation": (["--spares", "1"], ["--ckpt.every", "50"], "persistent"),
    "restart, node-local tier": (["--spares", "1"], ["--ckpt.every", "50", "--ckpt.local-every", "5"], "local"),
}


def _cluster_env() -> dict[str, str] | None:
    conf = CLUSTER / "etc" / "slurm.conf"
    if shutil.which("sbatch") is None or not conf.exists():
        return None
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(SLURM_CONF=str(conf), PATH=f"{CLUSTER / 'bin'}:{env['PATH']}", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
    return env


def one(env: dict[str, str], folder: Path, case: str) -> dict[str, float]:
    """One job of `case`: its restart gap, steps redone, and the whole job's wall time."""
    from job.runs.config import CheckpointConfig
    from job.runs.local_format import shard_file
    from job.runs.local_tier import run_folder
    from job.runs.tiers import Tier

    submit, ckpt, tier = CASES[case]
    run_dir = folder / "run"
    fault = {"NODE_FAULT": "node2", "NODE_FAULT_STEP": str(FAULT_STEP)}
    if tier == "local":  # the local step 20 is in on node2 (and so, sent at the same time, on node1)
        held = shard_file(run_folder(CheckpointConfig.local_dir, str(run_dir)), 20, 0)
        fault.update(NODE_FAULT_AFTER=str(held), NODE_FAULT_SETTLE_S="1")
    argv = [sys.executable, "-m", "deploy.slurm", "--nodes", "2", "--partition", "strict", "--retries", "1",
            "--log-dir", str(folder / "logs"), "--wait", *submit, "--", "train", "--run-dir", str(run_dir),
            "--task", "tests.user_tasks.node_fault:TASK", "--steps", "40", *ckpt, *SMALL]
    began = time.perf_counter()
    proc = subprocess.run(argv, env={**env, **fault}, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: the job failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines() if line.strip()]
    resumed = [r for r in records if r["event"] == "resumed"][-1]
    failed = next(r for r in records if r["event"] == "ended" and r["outcome"] == "failed")
    kills = [float(m) for log in (folder / "logs").glob("*_log.out")
             for m in re.findall(r"^node_fault: SIGKILL at ([0-9.]+)$", log.read_text(errors="replace"), re.MULTILINE)]
    return {"gap_s": float(resumed["gap_s"]), "kill_to_step_s": float(resumed["time"]) - min(kills), "redone": float(FAULT_STEP - int(resumed["from_step"])),
            "from_step": float(resumed["from_step"]), "wall_s": wall, "failed_code": float(failed["code"]),
            "tier_local": float(Tier(resumed["tier"]) is Tier.LOCAL)}


def run(quick: bool = False) -> Section:
    section = Section(NAME, TITLE)
    env = _cluster_env()
    if env is None:
        section.notes.append("skipped: no local Slurm cluster (make slurm-up NODES=4, as root)")
        return section
    reps = 1 if quick else 3
    figures: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-", dir="/var/tmp") as tmp:
        for rep in range(reps):  # interleaved: case by case within each repetition
            for number, case in enumerate(CASES):
                folder = Path(tmp) / f"{rep}-{number}"
                folder.mkdir()
                figures[case].append(one(env, folder, case))
                print(f"[bench recovery] {case}: {figures[case][-1]}", file=sys.stderr, flush=True)
    base = median([f["gap_s"] for f in figures["requeue"]])
    section.columns = ["case", "restart gap (median)", "kill to first step", "vs requeue", "steps redone",
                       "restored from", "job wall time"]
    for case, runs in figures.items():
        gap = median([f["gap_s"] for f in runs])
        section.rows.append([case, fmt_s(gap), fmt_s(median([f["kill_to_step_s"] for f in runs])),
                             f"{gap / base:.2f}x" if base else "-",
                             f"{median([f['redone'] for f in runs]):.0f}",
                             f"step {median([f['from_step'] for f in runs]):.0f}"
                             + (", node-local" if runs[0]["tier_local"] else " (no persistent save yet)"
                                if not median([f["from_step"] for f in runs]) else ", persistent"),
                             fmt_s(median([f["wall_s"] for f in runs]))])
    section.notes += [
        f"2 nodes x 1 process, the example LM (1 layer, dim 32), SIGKILL of process 1 on node2 at step {FAULT_STEP}; "
        f"medians of {reps}; the restart gap runs from the failed attempt's end to the first step completed after it",
        "requeue: through an idle queue (nothing else pending); on a busy cluster it waits behind other jobs as well",
    ]
    section.data = {case: runs for case, runs in figures.items()}
    return section


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run))
