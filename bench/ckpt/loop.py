"""A save as the user's run sees it: `python -m job train` itself, every step timed, each variant in its own process.

    python -m bench.ckpt.loop OUT_DIR [--variants job,template,...] [--small] [-- TRAIN_FLAGS...]   # on a TPU VM

Each variant is a fresh process that trains the same command (by default a user's Llama-style model in its own
package, tests/user_tasks/llama_fast.py, 120 steps, a save every 40 and every step logged) into a run dir of its
own, so that no variant inherits another's heap, page faults or thread priorities:

- `job`: `python -m job train` itself, nothing added: the figures a user reads in metrics.jsonl;
- `template`: the same loop in a process that also samples where the loop's thread is (bench.ckpt.stalls) and
  times each save's call;
- `no-scan`: the template without its one addition to orbax's save (the writer threads' priority lowered,
  found through /proc), to measure what it earns in the real loop;
- `gc-paused`: the template with the collector off from each save until its write is seen finished;
- `bare`: the template's handler saved by orbax's `CheckpointManager.save` alone, nothing else at the save;
- `orbax`: orbax's own defaults (a CheckpointManager with its default handler, `StandardSave`);
- `compressed`: the template, its arrays written with orbax's zstd (`use_compression=True`);
- `chunked`: the template, every array written in chunks of at most CHUNK_BYTES (orbax's `chunk_byte_size`);
- `uncompressed`: the template with its arrays written without zstd on any device (as on CPU devices);
- `lowered`: the template with its writer threads lowered to nice 19 on any device (as on CPU devices).

For each: every step's time (metrics.jsonl's `step_time_s`, the time between two logged steps), their median,
mean, p99 and maximum, each save's blocked seconds (`bare` and `orbax` included), the steps after each save
against the median (the first save's too), when the write was seen finished, and, in the sampled variants, where
the loop's thread was in each stalled step. Written to OUT_DIR/loop.json and printed as one table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.procs import ROOT

VARIANTS = ("job", "template", "no-scan", "gc-paused", "bare", "orbax", "compressed", "chunked", "uncompressed",
            "lowered")
CHUNK_BYTES = 16 << 20  # `chunked`: orbax's chunk_byte_size for every array
TRAIN = ["--task", "tests.user_tasks.llama_fast:TASK", "--preset", "gpt2-small-size", "--steps", "120",
         "--ckpt.every", "40", "--log-every", "1", "--eval-every", "100000"]
SMALL = ["--task", "tests.user_tasks.llama_fast:TASK", "--steps", "30", "--ckpt.every", "10", "--log-every", "1",
         "--eval-every", "100000"]  # the task's own small defaults
DEFAULT = ("job", "template", "uncompressed", "lowered", "orbax")  # the save as it is, each difference from CPU's, orbax's
AFTER = 5  # the steps after each save reported one by one
VARIANT_TIMEOUT_S = 300


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def steps_of(run_dir: Path) -> dict[int, float]:
    """{step: its step_time_s} from the run's metrics.jsonl (train records only)."""
    found: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split", "train") == "train" and "step_time_s" in record:
            found[int(record["step"])] = float(record["step_time_s"])
    return found


def saves_of(flags: list[str]) -> list[int]:
    """The steps the command saves: every --ckpt.every, and its last (--steps)."""
    every, end = int(flags[flags.index("--ckpt.every") + 1]), int(flags[flags.index("--steps") + 1])
    return sorted({*range(every, end + 1, every), end})


def summary(steps: dict[int, float], saved: list[int]) -> dict[str, Any]:
    """Every step's time but the first (its compile), against the median; the steps after each save one by one."""
    plain = [t for s, t in sorted(steps.items()) if s > min(steps)]
    median = statistics.median(plain)
    after = {str(at): [round(steps[at + k] / median, 2) for k in range(1, AFTER + 1) if at + k in steps]
             for at in saved}
    return {"median_ms": round(median * 1e3, 1), "mean_ms": round(statistics.mean(plain) * 1e3, 1),
            "p99_ms": round(percentile(plain, 0.99) * 1e3, 1), "max_ms": round(max(plain) * 1e3, 1),
            "slowest": [(s, round(t * 1e3)) for s, t in sorted(steps.items(), key=lambda kv: -kv[1])[1:6]],
            "after_save_x_median": after,
            "lost_beside_writes_s": round(sum(max(0.0, steps[at + k] - median) for at in saved
                                              for k in range(1, AFTER + 1) if at + k in steps), 3)}


# ------------------------------------------------------------------------------------------------ one variant
def patch(variant: str, timings: dict[str, list[Any]]) -> None:
    """The variant's change to the template's save, and the timers every sampled variant has."""
    import orbax.checkpoint as ocp

    from job.runs import checkpoint, tiers

    if variant == "no-scan":
        checkpoint.Checkpointer._lower_writers = lambda self: None  # type: ignore[method-assign]
    elif variant == "gc-paused":
        import gc

        paused_save, paused_writing = checkpoint.Checkpointer.save, checkpoint.Checkpointer.writing

        def pausing(self: Any, step: int, state: Any) -> None:
            gc.disable()
            paused_save(self, step, state)

        def resuming(self: Any) -> bool:
            busy = paused_writing(self)
            if not busy:
                gc.enable()
            return busy

        checkpoint.Checkpointer.save, checkpoint.Checkpointer.writing = pausing, resuming  # type: ignore[method-assign]
    elif variant in ("bare", "orbax"):
        def bare_save(self: Any, step: int, state: Any) -> None:
            self._writing = step
            args = ocp.args.StandardSave(state) if variant == "orbax" else ocp.args.PyTreeSave(state)
            self.manager.save(step, args=args, force=True)

        checkpoint.Checkpointer.save = bare_save  # type: ignore[method-assign]
        if variant == "orbax":
            checkpoint.Checkpointer._manager = (  # type: ignore[method-assign]
                lambda self: ocp.CheckpointManager(self.directory, options=self.options))

    elif variant == "compressed":
        handler = ocp.PyTreeCheckpointHandler

        checkpoint.ocp.PyTreeCheckpointHandler = (  # type: ignore[misc]
            lambda **kw: handler(**{**kw, "use_compression": True}))
    elif variant == "chunked":
        tree_save = ocp.args.PyTreeSave

        def chunked(item: Any, **kw: Any) -> Any:
            import jax

            args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), item)
            return tree_save(item, save_args=args, **kw)

        ocp.args.PyTreeSave = chunked  # type: ignore[misc]

    elif variant in ("uncompressed", "lowered"):
        made = checkpoint.Checkpointer.__init__

        def init(self: Any, *args: Any, **kw: Any) -> None:
            if variant == "uncompressed":  # the manager is made in __init__: compression follows the platform's flag
                real = checkpoint.jax.local_devices
                checkpoint.jax.local_devices = lambda: [type("Cpu", (), {"platform": "cpu"})()]
                try:
                    made(self, *args, **kw)
                finally:
                    checkpoint.jax.local_devices = real
                self._host_computes = False  # its writers' priority as on an accelerator
            else:
                made(self, *args, **kw)
                self._host_computes = True  # lowered after the manager is made: compressed, writers lowered

        checkpoint.Checkpointer.__init__ = init  # type: ignore[method-assign]

    save, writing = tiers.Checkpoints.save, checkpoint.Checkpointer.writing

    def timed_save(self: Any, step: int, state: Any, tier: Any) -> None:
        began = time.perf_counter()
        save(self, step, state, tier)
        timings["saves"].append((step, began, time.perf_counter()))

    def seen_writing(self: Any) -> bool:
        busy = writing(self)
        if not busy and timings["saves"] and len(timings["written"]) < len(timings["saves"]):
            timings["written"].append(time.perf_counter())
        return busy

    tiers.Checkpoints.save = timed_save  # type: ignore[method-assign]
    checkpoint.Checkpointer.writing = seen_writing  # type: ignore[method-assign]

    from job.observe import report

    train = report.Reporter.train

    def logged(self: Any, step: int, metrics: dict[str, float], lr: float) -> None:
        timings["logged"].append((step, time.perf_counter()))
        train(self, step, metrics, lr)

    report.Reporter.train = logged  # type: ignore[method-assign]


def one(variant: str, run_dir: Path, flags: list[str], out: Path) -> int:
    """Train in this process under `variant`'s patch, the loop's thread sampled; OUT written with what was timed."""
    from bench.ckpt.stalls import Stalls
    from job.__main__ import main

    timings: dict[str, list[Any]] = {"saves": [], "written": [], "logged": []}
    patch(variant, timings)
    with Stalls() as stalls:
        code = main(["train", *flags, "--run-dir", str(run_dir)])
    logged = timings["logged"]
    spans = [(a[1], b[1]) for a, b in zip(logged[1:], logged[2:])]
    out.write_text(json.dumps({
        "code": code, "saves": [(s, round(e - b, 3)) for s, b, e in timings["saves"]],
        "written_after_s": [round(w - b, 3) for (_, b, _), w in zip(timings["saves"], timings["written"])],
        "stalls": stalls.report(spans)}, default=str))
    return code


# ------------------------------------------------------------------------------------------------ the driver
def measure(variant: str, out_dir: Path, flags: list[str]) -> dict[str, Any]:
    run_dir, timed = out_dir / variant, out_dir / f"{variant}.timed.json"
    if variant == "job":
        argv = [sys.executable, "-m", "job", "train", *flags, "--run-dir", str(run_dir)]
    else:
        argv = [sys.executable, "-m", "bench.ckpt.loop", "--one", variant, "--timed", str(timed), str(run_dir),
                "--", *flags]
    began = time.perf_counter()
    with (out_dir / f"{variant}.log").open("w") as log:
        done = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=VARIANT_TIMEOUT_S,
                              check=False)
    result: dict[str, Any] = {"variant": variant, "exit": done.returncode,
                              "process_s": round(time.perf_counter() - began, 1)}
    try:
        steps = steps_of(run_dir)
        saved = saves_of(flags)
        result.update(summary(steps, saved))
    except (OSError, ValueError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    try:  # what the run itself says: each save's blocked seconds (metrics.jsonl), the saves' cost (summary.json)
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result["saves"] = [(r["step"], round(r["blocked_s"], 3)) for r in lines if r.get("split") == "checkpoint"]
        goodput = json.loads((run_dir / "summary.json").read_text())["goodput"]
        result["goodput_checkpoint"] = {k: goodput.get(k) for k in ("checkpoint_s", "checkpoint_stalls_s", "steps_s")}
    except (OSError, ValueError, KeyError) as exc:
        result["run_said"] = f"{type(exc).__name__}: {exc}"
    if timed.exists():
        result.update(json.loads(timed.read_text()))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a chip VM's disk holds a few states, not all
    return result


def line(r: dict[str, Any]) -> str:
    if "median_ms" not in r:
        return f"{r['variant']:<12} exit {r['exit']}: {r.get('error', 'no steps')}"
    saves = " ".join(f"{s}:{b:.2f}s" for s, b in r.get("saves", [])) or "-"
    after = " ".join(f"{at}:[{', '.join(f'{x:.2f}' for x in xs)}]" for at, xs in r["after_save_x_median"].items())
    return (f"{r['variant']:<12} median {r['median_ms']:7.1f} ms  mean {r['mean_ms']:7.1f}  p99 {r['p99_ms']:7.1f}  "
            f"max {r['max_ms']:7.1f}  lost beside writes {r['lost_beside_writes_s']:.2f} s  blocked {saves}  "
            f"after (x median) {after}  goodput {r.get('goodput_checkpoint')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="OUT_DIR (a variant's run dir and log go under it)")
    parser.add_argument("--variants", default=",".join(DEFAULT),
                        help=f"among {','.join(VARIANTS)} (default: {','.join(DEFAULT)}, about 5 minutes on a chip)")
    parser.add_argument("--small", action="store_true", help="a CPU-sized model (a dry run of the bench)")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # the driver's child
    parser.add_argument("--timed", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    given = argv[argv.index("--") + 1:] if "--" in argv else []  # train flags after --, instead of the default's
    args = parser.parse_args(argv[:len(argv) - len(given) - (1 if "--" in argv else 0)])
    if args.one:
        return one(args.one, args.out, given, args.timed)
    flags = given or (SMALL if args.small else TRAIN)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"expected --variants among {','.join(VARIANTS)}, found {','.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants.split(","):
        results.append(measure(variant, args.out, flags))
        print(line(results[-1]), flush=True)
        (args.out / "loop.json").write_text(json.dumps({"flags": flags, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
