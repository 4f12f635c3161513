"""12. Model depth: time to the first step and activation memory, scanned blocks vs unrolled.

    python -m bench.depth [--quick]

Time to the first step: `python -m job train` of the lm task's default model (1 process, 2 CPU
devices, `--compile-cache none`, 2 steps) at 2, 8 and 32 layers, its blocks scanned (the default)
and unrolled (`--model.no-scan`); the figure is `startup_s + compile_s` of summary.json's goodput
split (initialisation, the state built, the train step compiled), and the headline is 32 layers
against 2 (goal for the scanned model: <= 1.3x).

Activation memory: peak RSS above a bare JAX process of one process training the 12M-shaped LM
of bench section 10 (batch 32 x 128 tokens) at 8 layers, with each `--model.remat` policy,
scanned and unrolled; the headline is `full` against `none`, scanned (goal <= 0.6x).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import ROOT, BenchError, cpu_env, launch_template
from bench.report import Section, standalone
from bench.timing import fmt_s, median

NAME = "depth"
TITLE = "12. Model depth: time to the first step and activation memory, scanned vs unrolled blocks"
DEPTHS = (2, 8, 32)
FLAGS = ("--steps", "2", "--log-every", "1", "--eval-every", "1000", "--data.eval-batches", "0",
         "--watchdog-s", "0", "--compile-cache", "none")
LM_12M_8 = ("--model.vocab-size", "256", "--model.seq-len", "128", "--model.dim", "512", "--model.heads", "8",
            "--model.layers", "8", "--model.mlp-dim", "1024", "--data.global-batch", "32")
POLICIES = ("none", "full", "dots")


def first_step(root: Path, layers: int, scan: bool) -> dict[str, float]:
    """One run's time to its first step and the part of it spent compiling."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    command = [sys.executable, "-m", "job", "train", "--run-dir", str(run_dir), "--model.layers", str(layers),
               "--model.scan" if scan else "--model.no-scan", *FLAGS]
    began = time.perf_counter()
    proc = subprocess.run(command, env=cpu_env(devices=2), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    split = json.loads((run_dir / "summary.json").read_text())["goodput"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"first_step_s": split["startup_s"] + split["compile_s"], "compile_s": split["compile_s"], "wall_s": wall}


def peak_above_bare(root: Path, scan: bool, remat: str, bare: float) -> float:
    """Peak RSS (MiB) above a bare JAX process of one process training the 8-layer 12M-shaped LM."""
    run_dir = Path(tempfile.mkdtemp(prefix="mem-", dir=root))
    ran = launch_template(1, ["bench.peak", "train", "--run-dir", str(run_dir), *FLAGS, *LM_12M_8,
                              "--model.scan" if scan else "--model.no-scan", "--model.remat", remat],
                          timeout_s=1800)
    shutil.rmtree(run_dir, ignore_errors=True)
    return ran.ranks[0]["peak_rss_mib"] - bare


def run(quick: bool = False) -> Section:
    depths = (2, 8) if quick else DEPTHS
    reps = 1 if quick else 2
    root = Path(tempfile.mkdtemp(prefix="bench-depth-"))
    section = Section(NAME, TITLE, columns=["what", "scanned", "unrolled", "unrolled / scanned"])
    try:
        times: dict[tuple[bool, int], list[dict[str, float]]] = {}
        for _ in range(reps):  # alternated, so load on the machine falls on both alike
            for layers in depths:
                for scan in (True, False):
                    print(f"[bench depth] {layers} layers, {'scanned' if scan else 'unrolled'} ...",
                          file=sys.stderr, flush=True)
                    times.setdefault((scan, layers), []).append(first_step(root, layers, scan))

        def first(scan: bool, layers: int, key: str = "first_step_s") -> float:
            return median([r[key] for r in times[(scan, layers)]])

        for layers in depths:
            for key, what in (("first_step_s", "time to the first step"), ("compile_s", "of which compile")):
                s, u = first(True, layers, key), first(False, layers, key)
                section.rows.append([f"{layers} layers, {what}", fmt_s(s), fmt_s(u), f"{u / s:.2f}x"])
        deep, shallow = depths[-1], depths[0]
        for scan, name in ((True, "scanned"), (False, "unrolled")):
            section.headline.append((f"time to the first step, {deep} / {shallow} layers, {name}",
                                     f"{first(scan, deep) / first(scan, shallow):.2f}x",
                                     "<= 1.3x" if scan else "report"))

        bare = median([launch_template(1, ["bench.peak", "bare"]).ranks[0]["peak_rss_mib"] for _ in range(2)])
        memory: dict[tuple[bool, str], float] = {}
        for scan in (True, False):
            for remat in POLICIES if scan else ("none", "full"):
                print(f"[bench depth] peak memory, 8 layers, {'scanned' if scan else 'unrolled'}, remat {remat} ...",
                      file=sys.stderr, flush=True)
                memory[(scan, remat)] = peak_above_bare(root, scan, remat, bare)
        for remat in POLICIES:
            unrolled = memory.get((False, remat))
            section.rows.append([f"peak RSS above bare, 12M-shaped LM, 8 layers, batch 32 x 128, --model.remat {remat}",
                                 f"{memory[(True, remat)]:,.0f} MiB",
                                 f"{unrolled:,.0f} MiB" if unrolled is not None else "-",
                                 f"{unrolled / memory[(True, remat)]:.2f}x" if unrolled is not None else "-"])
        section.headline += [
            ("activation memory, 8 layers, scanned, --model.remat full / none",
             f"{memory[(True, 'full')] / memory[(True, 'none')]:.2f}x", "<= 0.6x"),
            ("the same, unrolled", f"{memory[(False, 'full')] / memory[(False, 'none')]:.2f}x", "report"),
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section.notes.append(f"time to the first step: startup + compile of summary.json's goodput split, median of {reps} "
                         "alternated runs; 1 process x 2 CPU devices, lm task defaults but the depth, no cache")
    section.notes.append(f"peak RSS: one process x 1 device, 2 steps; a bare JAX process is {bare:,.0f} MiB")
    section.data = {"times": {f"{'scan' if s else 'unrolled'}-{n}": r for (s, n), r in times.items()},
                    "memory_mib": {f"{'scan' if s else 'unrolled'}-{p}": m for (s, p), m in memory.items()}}
    return section


def main(argv: list[str]) -> int:
    return standalone(argv, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
