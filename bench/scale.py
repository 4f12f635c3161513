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
- checkpoints at scale: one process, 4 CPU devices, the fsdp state of a 126M LM (1.5 GB of
  float32 parameters and Adam moments, created as its shards): the whole orbax write
  (`Checkpointer.save` + `wait`) against numpy writing the same shards (`np.save` each), and
  `Checkpointer.restore` into the abstract state against `np.load` of those files and
  `jax.make_array_from_single_device_arrays` with the same shardings; page cache, no fsync;
- token files at scale: time of a whole 1-step `python -m job train` (start-up to exit, one process,
  compilation cache warm) on a 2 GiB token file (1.07G uint16 tokens) against a 200 KB one,
  interleaved; both described by the FILE.json `tokenize` writes;
- the largest model: the LM at ~1B parameters (dim 2048, 16 heads, 20 layers, mlp 8192) under
  fsdp over 4 processes with remat: created sharded, 2 steps, saved, resumed for 2 more; when
  it does not fit, the same at ~0.5B (10 layers). Replicated, every process would hold the
  whole state (12 bytes a parameter) and its gradients.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.ckpt.baseline import read_numpy, write_numpy
from bench.procs import BenchError, emit, launch_template, run_worker
from bench.report import Section, standalone
from bench.timing import fmt_ratio, fmt_s, interleave, median, ratio

NAME = "scale"
TITLE = "10. Models that need the cluster: sharded state, accumulation, the largest model"

LM_50M = ("--model.vocab-size", "256", "--model.dim", "1024", "--model.heads", "8", "--model.layers", "4",
          "--model.mlp-dim", "4096")
LM_12M = ("--model.vocab-size", "256", "--model.seq-len", "128", "--model.dim", "512", "--model.heads", "8",
          "--model.layers", "4", "--model.mlp-dim", "1024")
LARGE = ((2048, 20, 8192), (2048, 10, 8192))  # (dim, layers, mlp): ~1.0B and ~0.5B parameters, 16 heads
COMMON = ("--log-every", "1", "--eval-every", "1000", "--data.eval-batches", "0", "--watchdog-s", "0",
          "--compile-cache", "none")


CKPT_MODEL = {"vocab_size": 256, "dim": 1024, "heads": 8, "layers": 10, "mlp_dim": 4096}  # 126M parameters
QUICK_CKPT_MODEL = {"vocab_size": 256, "dim": 512, "heads": 8, "layers": 4, "mlp_dim": 2048}  # 12.7M


def worker(argv: list[str]) -> None:
    """Checkpoints at scale, in one process with 4 devices: orbax vs numpy, write and restore."""
    import dataclasses

    import jax
    import numpy as np
    import optax

    from job import sharding
    from job import task as tasks
    from job.runs.checkpoint import Checkpointer
    from job.train import config, state
    from job.train.config import CheckpointConfig

    quick = "--quick" in argv
    task = tasks.load("lm")
    cfg = dataclasses.replace(config.defaults(task), rule="fsdp",
                              model=task.model_config(**(QUICK_CKPT_MODEL if quick else CKPT_MODEL)))
    mesh = sharding.make_mesh()
    planned = state.plan(task, cfg, mesh, optax.adamw(1e-3))
    train_state = jax.block_until_ready(planned.init())
    leaves = jax.tree.leaves(train_state)
    nbytes = sum(x.nbytes for x in leaves)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-scale-"))
    ckpt = Checkpointer(root / "orbax", CheckpointConfig(every=1, keep=1))
    steps = iter(range(1, 1000))
    saved: list[int] = []

    def orbax_write() -> None:
        step = next(steps)
        ckpt.save(step, train_state)
        ckpt.wait()
        saved.append(step)

    npdir = root / "numpy"

    def numpy_write() -> None:
        shutil.rmtree(npdir, ignore_errors=True)
        write_numpy(npdir, leaves, sync=False)

    reps = 2 if quick else 3
    writes = interleave({"orbax": orbax_write, "numpy": numpy_write}, reps=reps, warmup=1)

    def orbax_restore() -> None:
        jax.block_until_ready(ckpt.restore(saved[-1], planned.abstract))

    def numpy_restore() -> None:
        jax.block_until_ready(read_numpy(npdir, leaves))

    restores = interleave({"orbax": orbax_restore, "numpy": numpy_restore}, reps=reps, warmup=1)
    restored = ckpt.restore(saved[-1], planned.abstract)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                zip(jax.tree.leaves(restored), leaves, strict=True))
    ckpt.close()
    shutil.rmtree(root, ignore_errors=True)
    emit({"bytes": nbytes, "params": planned.params, "writes": writes, "restores": restores, "exact": exact})


BIG_TOKENS = 1 << 30  # 2 GiB of uint16
SMALL_TOKENS = 100_000


def _token_file(path: Path, n: int) -> Path:
    """A .npy of n uint16 tokens (a repeating byte pattern), written in chunks, with its description."""
    import json

    import numpy as np

    from job.tasks.lm import data

    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(n,))
    chunk = 1 << 24
    pattern = (np.arange(chunk) * 7 % 256).astype(np.uint16)
    for lo in range(0, n, chunk):
        out[lo:lo + chunk] = pattern[:min(chunk, n - lo)]
    out.flush()
    del out
    data.sidecar(path).write_text(json.dumps({"tokens": n, "vocab_size": 256}))
    return path


def _first_step_s(token_file: Path, run_dir: Path) -> float:
    import subprocess

    from bench.procs import ROOT, cpu_env

    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "job", "train", "--run-dir", str(run_dir), "--steps", "1",
                    "--data.source", str(token_file), "--model.vocab-size", "256", "--data.eval-batches", "0",
                    "--watchdog-s", "0"], cwd=ROOT, env=cpu_env(1), check=True, capture_output=True, timeout=600)
    return time.perf_counter() - start


def params(dim: int, layers: int, mlp: int, vocab: int = 256, seq: int = 32) -> int:
    return 2 * vocab * dim + seq * dim + layers * (4 * dim * dim + 2 * dim * mlp + 2 * dim) + dim


def _job(n: int, run_dir: Path, *flags: str, timeout_s: float = 1800) -> list[float]:
    """Peak RSS (MiB) of each process of one `python -m job train` run."""
    ran = launch_template(n, ["bench.peak", "train", "--run-dir", str(run_dir), *COMMON, *flags],
                          timeout_s=timeout_s)
    return [r["peak_rss_mib"] for r in ran.ranks]


def _timing(run_dir: Path) -> dict[str, float]:
    """A finished run's time to its first step (start-up and compilation) and its mean step time."""
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    split = summary["goodput"]  # steps_s: every step, the first less its compilation (compile_s)
    steps = max(1, summary["final_step"])
    return {"first_step_s": split["startup_s"] + split["compile_s"], "step_s": split["steps_s"] / steps}


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
            label = f"12M LM, batch 32 x 128, --accum-steps {k}" + (", --model.remat full" if remat else "")
            flags = (*LM_12M, "--steps", "2", "--data.global-batch", "32", "--accum-steps", str(k),
                     "--model.remat", "full" if remat else "none")
            accum[(k, remat)] = record(label, 1, _job(1, tmp / f"acc{k}{remat}", *flags), bare1)
        section.headline += [
            ("activation memory, 12M LM, --accum-steps 4 / 1", f"{accum[(4, False)] / accum[(1, False)]:.2f}x",
             "< 1"),
            ("activation memory, 12M LM, --model.remat full / none", f"{accum[(1, True)] / accum[(1, False)]:.2f}x", "< 1"),
        ]
        at_scale = run_worker("bench.scale", ["--quick"] if quick else [], devices=4, timeout_s=1800)
        w, r = at_scale["writes"], at_scale["restores"]
        gb = at_scale["bytes"] / 1e9
        label = f"{at_scale['params'] / 1e6:.0f}M LM state, fsdp over 4 devices ({gb:.2f} GB)"
        section.notes.append(
            f"checkpoints at scale, {label}: whole write {fmt_s(median(w['orbax']))} (orbax) vs "
            f"{fmt_s(median(w['numpy']))} (numpy), {fmt_ratio(w['orbax'], w['numpy'])}; restore "
            f"{fmt_s(median(r['orbax']))} vs {fmt_s(median(r['numpy']))}, {fmt_ratio(r['orbax'], r['numpy'])}; "
            f"restored bitwise: {at_scale['exact']}")
        section.headline += [
            (f"checkpoint write, orbax / numpy, {gb:.2f} GB sharded state", f"{ratio(w['orbax'], w['numpy']):.2f}x",
             "<= 2"),
            (f"checkpoint restore, orbax / numpy, {gb:.2f} GB sharded state",
             f"{ratio(r['orbax'], r['numpy']):.2f}x", "<= 2"),
        ]
        big_file = _token_file(tmp / "big.npy", SMALL_TOKENS * 10 if quick else BIG_TOKENS)
        small_file = _token_file(tmp / "small.npy", SMALL_TOKENS)
        firsts = interleave({"big": lambda: _first_step_s(big_file, tmp / "tok"),
                             "small": lambda: _first_step_s(small_file, tmp / "tok")}, reps=2 if quick else 3)
        size_gib = big_file.stat().st_size / 2**30
        section.headline.append((f"time to the first step, {size_gib:.2f} GiB token file / 200 KB one",
                                 fmt_ratio(firsts["big"], firsts["small"]), "<= 1.2"))
        section.notes.append(f"token files: a 1-step run takes {fmt_s(median(firsts['big']))} on the "
                             f"{size_gib:.2f} GiB file and {fmt_s(median(firsts['small']))} on the small one "
                             "(the file in the page cache, as just written)")
        big_file.unlink()
        if not quick:  # the largest first; a size that does not fit is said, and the next one tried
            for dim, layers, mlp in LARGE:
                size = f"{params(dim, layers, mlp) / 1e9:.2f}B"
                # the 1B is `--preset 1b` as a user runs it (scanned, --model.remat full, background saves);
                # the 0.5B its half-depth
                flags = ("--preset", "1b", "--model.layers", str(layers), "--rule", "fsdp")
                # what one replicated process would hold: float32 parameters, two Adam moments, gradients
                need_gib = params(dim, layers, mlp) * 16 / 2**30
                began = time.perf_counter()
                try:
                    big = record(f"{size} LM, fsdp, scanned, remat full, 2 steps and a save", 4,
                                 _job(4, tmp / f"big{layers}", *flags, "--steps", "2"), bare4, "created sharded")
                    first = _timing(tmp / f"big{layers}")
                    big_resumed = record(f"{size} LM, fsdp, resumed for 2 more steps", 4,
                                         _job(4, tmp / f"big{layers}", *flags, "--steps", "4"), bare4,
                                         "restored into its shards")
                except BenchError as exc:
                    section.rows.append([f"{size} LM, fsdp, scanned, remat full", "4", "did not fit",
                                         str(exc).split(":")[0]])
                    section.notes.append(f"the {size} LM under fsdp on 4 processes did not fit in this "
                                         f"machine's memory ({str(exc).splitlines()[0]})")
                    continue
                finally:
                    shutil.rmtree(tmp / f"big{layers}", ignore_errors=True)
                peak = max(big, big_resumed)
                section.headline += [
                    (f"largest LM trained here: {size} (fsdp, 4 processes, default flags), peak RSS per process "
                     "above bare / what one replicated process needs (state and gradients)",
                     f"{_mib(peak)} / {need_gib:.1f} GiB = {peak / (need_gib * 2**10):.2f}x", "<= 0.30x"),
                    (f"{size} LM: time to the first step, and a step", f"{fmt_s(first['first_step_s'])}, "
                     f"{fmt_s(first['step_s'])}", "report"),
                ]
                section.notes.append(f"the {size} runs took {time.perf_counter() - began:.0f} s; replicated, "
                                     f"every process would hold its whole state and gradients, {need_gib:.1f} GiB")
                break
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
    sys.exit(standalone(sys.argv[1:], run, worker))
