"""10. Models that need the cluster: memory of a sharded state, accumulation and remat, the largest model.

    python -m bench.scale [--quick]

Every figure is a whole `python -m job train` run (bench/peak.py) on CPU processes started by
`job.launch`, 1 device each, the lm task; memory is each process's peak RSS minus that of a bare
JAX process of the same cluster (`job.initialize` and one psum), so what is left is what the job
holds: its state, gradients, activations and compiled programs.

- sharded state: the 50M-parameter LM (dim 1024, 8 heads, 4 layers, mlp 4096) on 4 processes,
  2 steps, replicated vs fsdp, and an fsdp run resumed from its checkpoint;
- accumulation and remat: one process, a global batch of 32 x 128 tokens of a 12M LM, with
  --accum-steps 1 / 4 and --model.remat off / on (activation memory falls with either);
- the largest model: the LM at ~1B parameters (dim 2048, 16 heads, 20 layers, mlp 8192) under
  fsdp over 4 processes with remat: created sharded, 2 steps, saved, resumed for 2 more.
  Replicated it would need its 16 GB of state on every process (64 GB here).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import launch_template
from bench.report import Section, standalone
from bench.timing import median

NAME = "scale"
TITLE = "10. Models that need the cluster: sharded state, accumulation, the largest model"

LM_50M = ("--model.vocab-size", "256", "--model.dim", "1024", "--model.heads", "8", "--model.layers", "4",
          "--model.mlp-dim", "4096")
LM_12M = ("--model.vocab-size", "256", "--model.seq-len", "128", "--model.dim", "512", "--model.heads", "8",
          "--model.layers", "4", "--model.mlp-dim", "1024")
LM_1B = ("--model.vocab-size", "256", "--model.dim", "2048", "--model.heads", "16", "--model.layers", "20",
         "--model.mlp-dim", "8192", "--model.remat")
COMMON = ("--log-every", "1", "--eval-every", "1000", "--data.eval-batches", "0", "--watchdog-s", "0",
          "--compile-cache", "none")


def params(dim: int, layers: int, mlp: int, vocab: int = 256, seq: int = 32) -> int:
    return 2 * vocab * dim + seq * dim + layers * (4 * dim * dim + 2 * dim * mlp + 2 * dim) + dim


def _job(n: int, run_dir: Path, *flags: str, timeout_s: float = 1800) -> list[float]:
    """Peak RSS (MiB) of each process of one `python -m job train` run."""
    ran = launch_template(n, ["bench.peak", "train", "--run-dir", str(run_dir), *COMMON, *flags],
                          timeout_s=timeout_s)
    return [r["peak_rss_mib"] for r in ran.ranks]


def _bare(n: int) -> float:
    return median([r["peak_rss_mib"] for r in launch_template(n, ["bench.peak", "bare"]).ranks])


def _mib(x: float) -> str:
    return f"{x:,.0f} MiB"


def run(quick: bool = False) -> Section:
    section = Section(NAME, TITLE, columns=["run", "processes", "peak RSS per process above bare JAX", "note"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        bare4, bare1 = _bare(4), _bare(1)
        rows: dict[str, float] = {}

        def record(label: str, n: int, rss: list[float], bare: float, note: str = "") -> float:
            above = max(rss) - bare
            rows[label] = above
            section.rows.append([label, str(n), _mib(above), note])
            print(f"  {label}: {_mib(above)} above a bare process ({_mib(bare)})", file=sys.stderr, flush=True)
            return above

        size = f"{params(1024, 4, 4096) / 1e6:.0f}M"
        replicated = record(f"{size} LM, replicated, 2 steps", 4,
                            _job(4, tmp / "rep", *LM_50M, "--steps", "2", "--data.global-batch", "4"), bare4)
        fsdp = record(f"{size} LM, fsdp, 2 steps", 4,
                      _job(4, tmp / "fsdp", *LM_50M, "--steps", "2", "--data.global-batch", "4", "--rule", "fsdp"),
                      bare4, "state created as its shards")
        resumed = record(f"{size} LM, fsdp, resumed to step 4", 4,
                         _job(4, tmp / "fsdp", *LM_50M, "--steps", "4", "--data.global-batch", "4", "--rule", "fsdp"),
                         bare4, "restored into its shards")
        section.headline += [
            (f"peak RSS per process above bare, {size} LM on 4 processes, fsdp / replicated",
             f"{fsdp / replicated:.2f}x ({_mib(fsdp)} / {_mib(replicated)})", "report"),
            ("the same, fsdp resumed / replicated", f"{resumed / replicated:.2f}x", "report"),
        ]
        accum = {}
        for k, remat in ((1, False), (4, False), (1, True), (4, True)):
            label = f"12M LM, batch 32 x 128, --accum-steps {k}" + (", --model.remat" if remat else "")
            flags = (*LM_12M, "--steps", "2", "--data.global-batch", "32", "--accum-steps", str(k),
                     *(("--model.remat",) if remat else ()))
            accum[(k, remat)] = record(label, 1, _job(1, tmp / f"acc{k}{remat}", *flags), bare1)
        section.headline += [
            ("activation memory, 12M LM, --accum-steps 4 / 1", f"{accum[(4, False)] / accum[(1, False)]:.2f}x",
             "< 1"),
            ("activation memory, 12M LM, --model.remat / none", f"{accum[(1, True)] / accum[(1, False)]:.2f}x", "< 1"),
        ]
        if not quick:
            size = f"{params(2048, 20, 8192) / 1e9:.2f}B"
            began = time.perf_counter()
            big = record(f"{size} LM, fsdp, remat, 2 steps and a save", 4,
                         _job(4, tmp / "big", *LM_1B, "--steps", "2", "--data.global-batch", "4", "--rule", "fsdp"),
                         bare4, "created sharded")
            big_resumed = record(f"{size} LM, fsdp, resumed for 2 more steps", 4,
                                 _job(4, tmp / "big", *LM_1B, "--steps", "4", "--data.global-batch", "4",
                                      "--rule", "fsdp"), bare4, "restored into its shards")
            state_gib = params(2048, 20, 8192) * 12 / 2**30  # float32 parameters and two Adam moments
            section.headline += [
                (f"{size} LM (fsdp, 4 processes): peak RSS per process above bare", _mib(max(big, big_resumed)),
                 f"<= 0.35 x replicated ({_mib(0.35 * state_gib * 2**10)} of its {state_gib:.1f} GiB state)"),
            ]
            section.notes.append(f"the {size} runs took {time.perf_counter() - began:.0f} s; a replicated copy "
                                 f"of their state would be {state_gib:.1f} GiB on every process")
        section.notes += [
            f"bare JAX process (job.initialize and one psum): {_mib(bare4)} at 4 processes, {_mib(bare1)} at 1",
            "peak RSS is the high-water mark of the whole run (creation, compilation, steps, save, restore): "
            "what a process must be able to hold",
        ]
        section.data = {"rows": rows, "bare": {"4": bare4, "1": bare1}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return section


if __name__ == "__main__":
    sys.exit(standalone(sys.argv[1:], run))
