"""8. Time to the first step with jax's persistent compilation cache: cold vs warm.

    python -m bench.compile_cache [--quick]

`python -m job train` (the lm task's default model, 1 process, 2 CPU devices,
2 steps, a fresh run directory each time) run alternately with an empty cache
folder (cold: every program compiled, then written) and with a folder an
earlier run filled (warm: read back). The time to the first step is the
run's `startup_s + compile_s` from summary.json's goodput split (initialisation,
preflight, model and optimizer built, the first step's compilation), so
interpreter start and imports, equal in both, are left out; the process's
wall time is shown too. The figure is warm / cold (below 1 is a saving).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import ROOT, BenchError, cpu_env
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, interleave, median

NAME = "compile_cache"
TITLE = "8. Time to the first step: persistent compilation cache cold vs warm"
FLAGS = ("--steps", "2", "--log-every", "1", "--eval-every", "2", "--ckpt.every", "2", "--watchdog-s", "0")


def train(root: Path, cache: Path) -> dict[str, float]:
    """One run with `cache` as its cache folder: its time to the first step, cache hits and wall time."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "job", "train", "--run-dir", str(run_dir), "--compile-cache",
                           str(cache), *FLAGS], env=cpu_env(devices=2), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise BenchError(f"python -m job train exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    split = json.loads((run_dir / "summary.json").read_text())["goodput"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"first_step_s": split["startup_s"] + split["compile_s"], "compile_s": split["compile_s"],
            "hits": split["compile_cache"]["hits"], "wall_s": wall}


def run(quick: bool = False) -> Section:
    reps = 1 if quick else 3
    root = Path(tempfile.mkdtemp(prefix="bench-compile-cache-"))
    figures: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    try:
        warm_cache = root / "warm"
        train(root, warm_cache)  # fills it

        def cold() -> float:
            cache = Path(tempfile.mkdtemp(prefix="cold-", dir=root))
            figures["cold"].append(train(root, cache))
            shutil.rmtree(cache, ignore_errors=True)
            return figures["cold"][-1]["first_step_s"]

        def warm() -> float:
            figures["warm"].append(train(root, warm_cache))
            return figures["warm"][-1]["first_step_s"]

        print(f"[bench compile_cache] {reps} x (cold, warm) runs of python -m job train ...", file=sys.stderr,
              flush=True)
        times = interleave({"cold": cold, "warm": warm}, reps=reps, warmup=0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section = Section(NAME, TITLE, columns=["cache", "time to first step", "of which compile", "cache hits",
                                            "process wall"])
    for name in ("cold", "warm"):
        runs = figures[name]
        section.rows.append([name, fmt_s(median(times[name])), fmt_s(median([r["compile_s"] for r in runs])),
                             str(int(median([r["hits"] for r in runs]))), fmt_s(median([r["wall_s"] for r in runs]))])
    section.headline.append(("time to first step, warm / cold", fmt_ratio(times["warm"], times["cold"]),
                             "< 1"))
    section.notes.append(f"time to the first step, warm / cold: {fmt_ratio(times['warm'], times['cold'])}")
    section.notes.append(f"median of {reps} interleaved repetitions; 1 process x 2 CPU devices, lm task defaults")
    section.data = {"runs": figures}
    return section


def main(argv: list[str]) -> int:
    return standalone(argv, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
